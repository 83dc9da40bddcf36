"""``fromp-bench sweep``: a grid of (benchmark, strategy, settings, seed) as Ray Tune trials.

Every trial is one :func:`fromp_bench.runner.run` writing what a plain run writes (its
checkpoint after every experience, ``checkpoints/<run>.pt``, and its result, ``runs/<run>.json``)
and reporting to Tune after every experience, so a failed trial is retried from its last
finished experience (``--max-failures``). The results are then aggregated as the plain runner
does; Tune's own files go to a new ``<out>/<benchmark>/ray/sweep[-k]/`` at every invocation.

``--resume`` continues from these files, never from Tune's saved state (``tuner.pkl``,
``experiment_state-*.json`` are pickled code, which would run on loading): a trial whose
record is a complete run is reported from it; the others run in a new Tune experiment, each
resuming from its checkpoint (checksum and no code checked before Ray starts; settings, data
and code by the runner).

Ray is an optional dependency (``pip install 'fromp[ray]'``). By default a local Ray instance
is started and shut down at the end (``--num-cpus`` caps it); ``--address`` joins a cluster
(``auto``, ``ray://host:10001``; ``--out`` on storage every node reaches); :func:`sweep` called
where Ray is already initialised (``ray.init``) uses that instance and leaves it running. Each
trial asks for ``--cpus-per-trial`` CPUs (its torch threads) and ``--gpus-per-trial`` GPUs
(fractions share a GPU)::

    fromp-bench sweep split-mnist --strategies fromp,ewc --seeds 5 --cpus-per-trial 1
    fromp-bench sweep split-mnist --strategies fromp --grid tau=10,30 --valid-fraction 0.1 \\
        --select-on validation --address auto --device cuda --gpus-per-trial 0.25
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from fromp_bench.command import (
    USER_ERRORS,
    UsageError,
    _earlier_runs,
    _read_run,
    build_parser,
    check_args,
    check_data,
    describe,
    parse_strategies,
    plan,
    run_name,
    run_options,
    write_report,
)
from fromp_bench.plugins import _read_checkpoint, check_writable_run_dirs, out_lock
from fromp_bench.registry import get_benchmark
from fromp_bench.report import command_line
from fromp_bench.runner import RunConfig, data_root_of, run

__all__ = ["sweep", "sweep_main"]


def failure_reason(error: Any, limit: int = 300) -> str:
    """One line of at most ``limit`` characters from a trial's error, without the ANSI colour
    escapes Ray puts in its tracebacks (cutting the text could split one)."""
    if not error:
        return "no result reported"
    text = re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", str(error))
    return " ".join(text.split())[:limit]


def _label(job: dict[str, Any], seed: int) -> str:
    return run_name(job["strategy"], job["tag"], seed)


def _trial(config: dict[str, Any]) -> None:
    """One Ray Tune trial: a runner run with the plain run's checkpoint and result files,
    reporting every experience; resumed from its checkpoint when the sweep is resumed or
    Tune retries it (Tune's checkpoint only marks that an experience was reported)."""
    from fromp_bench.report import portable, save_json
    from ray import tune

    torch.set_num_threads(int(config["threads"]))
    job, seed = config["trial"]["job"], int(config["trial"]["seed"])
    base = Path(config["base"])
    root = config.get("work_root")
    if root:
        Path(root).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="fromp-trial-", dir=root or None))
    cfg = RunConfig(
        config["benchmark"],
        job["strategy"],
        seed,
        config["data_root"],
        config["device"],
        job["overrides"],
        config["train_size"],
        config["test_size"],
        str(base / "checkpoints" / f"{_label(job, seed)}.pt"),
        bool(config["resume"]) or tune.get_checkpoint() is not None,
        None,
        False,
        config["valid_fraction"],
        config["valid_seed"],
        bool(config["allow_code_change"]),
    )
    crash = config.get("crash_once_after")  # tests: fail once to exercise the retry

    def report(info: dict[str, Any]) -> None:
        metrics = {k: v for k, v in info.items() if k != "checkpoint" and v is not None}
        (work / "progress.json").write_text(json.dumps({"tasks_done": info["tasks_done"]}))
        tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(str(work)))
        marker = Path(str(config.get("crash_marker")))
        if crash is not None and info["tasks_done"] == crash and not marker.exists():
            marker.write_text("crashed once\n")
            raise RuntimeError(f"planned crash after task {crash}")

    try:
        result = portable(run(cfg, report), base)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    save_json(base / "runs" / f"{_label(job, seed)}.json", result)
    tune.report({"tasks_done": len(result["accuracy_matrix"]), "result_json": json.dumps(result)})


def _finished(base: Path, wanted: list[tuple[dict[str, Any], int]]) -> dict[str, dict[str, Any]]:
    """``--resume``: the complete run results in ``runs/`` of the wanted trials (by label;
    JSON, checked to be a run of that strategy and seed), and, before Ray starts, every
    checkpoint of the others read as the runner reads it (checksum, no code; a bad one is
    refused in one line naming it)."""
    done = {}
    for job, seed in wanted:
        label = _label(job, seed)
        record = base / "runs" / f"{label}.json"
        if record.is_file():
            res = _read_run(record)
            mine = (res["strategy"], res["seed"]) == (job["strategy"], seed)
            if mine and res["complete"] and not res.get("failed"):
                done[label] = res
                continue
        ckpt = base / "checkpoints" / f"{label}.pt"
        if ckpt.exists():
            _read_checkpoint(ckpt)
    return done


def _experiment_name(storage: Path) -> str:
    """The first of ``sweep``, ``sweep-1``, ... not under ``storage``: every invocation's Tune
    files go to a new folder (Tune never finds, let alone loads, an earlier state)."""
    names = ["sweep", *(f"sweep-{k}" for k in range(1, 10_000))]
    return next(n for n in names if not (storage / n).exists())


def sweep(
    benchmark: str,
    strategies: list[str],
    *,
    address: str | None = None,
    num_cpus: int | None = None,
    cpus_per_trial: float = 1.0,
    gpus_per_trial: float = 0.0,
    max_concurrent: int | None = None,
    max_failures: int = 2,
    test_hooks: dict[str, Any] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Run the grid as Ray Tune trials and write the same report as the plain runner.

    ``options`` are those of :func:`fromp_bench.command.run_benchmark` (``seeds``, ``out``,
    ``data_root``, ``device``, ``overrides``, ``grid``, ``train_size``, ``test_size``,
    ``valid_fraction``, ``valid_seed``, ``select_on``, ``allow_code_change``; ``resume``
    continues an interrupted sweep from its run records and checkpoints). Returns the payload
    of ``results.json``. Settings are validated, the output checked and (on a local Ray
    instance) the data checked before Ray starts.
    """
    seeds, out = options["seeds"], Path(options["out"])
    data_root, device = options.get("data_root"), options.get("device", "cpu")
    train_size, test_size = options.get("train_size"), options.get("test_size")
    valid_fraction, valid_seed = options.get("valid_fraction"), options.get("valid_seed", 0)
    resume = bool(options.get("resume"))
    try:
        import ray
        from ray import tune
    except ImportError as err:
        raise UsageError(
            "fromp-bench sweep needs Ray Tune: pip install 'fromp[ray]' (or run the same grid "
            "without 'sweep')"
        ) from err

    grid = options.get("grid") or [{}]
    overrides = dict(options.get("overrides") or {})
    # under the record's names (runner.RECORD_NAMES), as the settings ids have always hashed them
    protocol = {"n_train": train_size, "n_test": test_size, "valid_fraction": valid_fraction,
                "valid_seed": valid_seed}  # fmt: skip
    jobs = plan(benchmark, strategies, overrides, grid, device if not address else "cpu",
                protocol)  # fmt: skip
    base = out.resolve() / benchmark
    job_list = [{"strategy": name, "overrides": merged, "tag": tag} for name, merged, tag in jobs]
    wanted = [(job, int(seed)) for job in job_list for seed in seeds]  # report order
    with out_lock(base):
        check_writable_run_dirs(base)
        if address is None:
            check_data(
                benchmark, jobs, data_root, train_size, test_size, valid_fraction, valid_seed
            )
        finished = _finished(base, wanted) if resume else {}
        todo = [(job, seed) for job, seed in wanted if _label(job, seed) not in finished]
        started = time.perf_counter()
        results = finished
        if todo:
            space = {
                "benchmark": benchmark,
                "base": str(base),
                "data_root": data_root_of(get_benchmark(benchmark), data_root),
                "device": device,
                "train_size": train_size,
                "test_size": test_size,
                "valid_fraction": valid_fraction,
                "valid_seed": valid_seed,
                "resume": resume,
                "allow_code_change": bool(options.get("allow_code_change")),
                "threads": max(1, int(cpus_per_trial)),
                "trial": tune.grid_search([{"job": j, "seed": s} for j, s in todo]),
                **(test_hooks or {}),
            }
            resources = {"cpu": cpus_per_trial, "gpu": gpus_per_trial}
            limits = {"max_concurrent": max_concurrent, "max_failures": max_failures}
            ran = _run_trials(space, resources, base, address, num_cpus, limits)
            results = {**finished, **ran}
        ordered = []
        for job, seed in wanted:
            res = results[_label(job, seed)]
            print(describe(res, job["tag"]), flush=True)
            ordered.append(res)
        labels = {_label(job, seed) for job, seed in wanted}
        return write_report(
            benchmark,
            base,
            _earlier_runs(base, labels) + ordered,
            command=command_line(["fromp-bench", "sweep", *sys.argv[2:]]),
            total_time_s=time.perf_counter() - started,
            select_on=options.get("select_on"),
            engine={"ray": ray.__version__, "address": address or "local"},
        )


def _run_trials(
    space: dict[str, Any],
    resources: dict[str, float],
    base: Path,
    address: str | None,
    num_cpus: int | None,
    limits: dict[str, Any],
) -> dict[str, dict[str, Any]]:
    """The trials of ``space`` in a new Tune experiment under ``base/ray`` (``limits``:
    ``max_concurrent``, ``max_failures``); their results by label (a trial that errored
    beyond its retries becomes a failed run, saved to ``runs/``)."""
    import ray
    from fromp_bench.report import save_json
    from ray import tune

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # a local sweep's trial directories live under one root that is removed at the end,
    # also after an interruption (Ray may kill a trial before its own clean-up runs)
    work_root = tempfile.mkdtemp(prefix="fromp-sweep-") if address is None else None
    space["work_root"] = work_root
    own_ray = not ray.is_initialized()  # the caller's Ray is used and left running
    if own_ray:
        ray.init(address=address, num_cpus=num_cpus if address is None else None,
                 include_dashboard=False, log_to_driver=False)  # fmt: skip
    # SIGTERM (a job scheduler, kill) ends the sweep as Ctrl-C does: Ray is shut down and the
    # trials' temporary directories removed; the records and checkpoints stay for --resume.
    # Installed after ray.init, which sets a handler of its own that exits without either.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if main_thread else None
    try:
        storage = base / "ray"
        tuner = tune.Tuner(
            tune.with_resources(_trial, resources),
            param_space=space,
            tune_config=tune.TuneConfig(
                max_concurrent_trials=limits["max_concurrent"], reuse_actors=True
            ),
            run_config=tune.RunConfig(
                name=_experiment_name(storage),
                storage_path=str(storage),
                failure_config=tune.FailureConfig(max_failures=limits["max_failures"]),
                verbose=0,
            ),
        )
        trials = list(tuner.fit())
    finally:
        if own_ray:
            ray.shutdown()
        if work_root is not None:
            shutil.rmtree(work_root, ignore_errors=True)
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    out = {}
    for r in trials:
        job, seed = r.config["trial"]["job"], int(r.config["trial"]["seed"])
        metrics = r.metrics or {}
        if "result_json" in metrics:
            res = json.loads(metrics["result_json"])
        else:
            res = {
                "benchmark": space["benchmark"],
                "strategy": job["strategy"],
                "seed": seed,
                "complete": False,
                "failed": {
                    "task": int(metrics.get("tasks_done", 0)) + 1,
                    "reason": failure_reason(r.error),
                },
                "accuracy_matrix": [],
                "settings": None,
            }
            save_json(base / "runs" / f"{_label(job, seed)}.json", res)
        out[_label(job, seed)] = res
    return out


def sweep_main(argv: list[str] | None = None) -> int:
    """``fromp-bench sweep ...``; exit status as ``fromp-bench``."""
    parser = build_parser(sweep=True)
    args = parser.parse_args(argv)
    if args.benchmark is None:
        parser.error("a benchmark name is required")
    out = Path(args.out)
    try:
        if args.address is not None:
            device, args.device = args.device, "cpu"  # the cluster's nodes hold the devices
            check_args(args)
            args.device = device
        else:
            check_args(args)
        check_ray_args(args)
        if args.report_only:
            raise UsageError("--report-only: use 'fromp-bench <benchmark> --report-only'")
        names = parse_strategies(args.strategies)
        payload = _sweep_with_args(args, names)
    except USER_ERRORS as err:
        print(f"fromp-bench sweep: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"\nfromp-bench sweep: interrupted; run the same command with --resume to continue "
            f"(run records and checkpoints in {out / args.benchmark})",
            file=sys.stderr,
        )
        return 130
    if payload["failed"]:
        print(f"fromp-bench sweep: {len(payload['failed'])} run(s) failed", file=sys.stderr)
        return 3
    return 0


def check_ray_args(args: Any) -> None:
    """The Ray arguments, before Ray starts (Ray itself hangs on some of them): a trial needs
    more than 0 CPUs, a local instance at least one CPU (and at least one per trial), GPUs
    per trial only where this machine has a GPU (on a local instance), and ``--address``
    is ``auto``, ``local``, or ``ray://host:port`` / ``host:port`` where something listens
    (a connection is tried, 10 s at most)."""
    import math

    cpus, gpus = args.cpus_per_trial, args.gpus_per_trial
    if not (math.isfinite(cpus) and cpus > 0):
        raise UsageError(f"--cpus-per-trial must be a number > 0, got {cpus}")
    if not (math.isfinite(gpus) and gpus >= 0):
        raise UsageError(f"--gpus-per-trial must be a number >= 0, got {gpus}")
    if args.max_failures < 0:
        raise UsageError(f"--max-failures must be >= 0, got {args.max_failures}")
    if args.max_concurrent is not None and args.max_concurrent < 1:
        raise UsageError(f"--max-concurrent must be >= 1, got {args.max_concurrent}")
    if args.address is None:
        if args.num_cpus is not None and args.num_cpus < 1:
            raise UsageError(f"--num-cpus must be >= 1, got {args.num_cpus}")
        if args.num_cpus is not None and cpus > args.num_cpus:
            raise UsageError(f"--cpus-per-trial {cpus} is more than --num-cpus {args.num_cpus}: "
                             "no trial could start")  # fmt: skip
        if gpus > 0 and not torch.cuda.is_available():
            raise UsageError(f"--gpus-per-trial {gpus}: this machine has no GPU "
                             "(torch.cuda.is_available() is False); use 0")  # fmt: skip
        return
    if args.num_cpus is not None:
        raise UsageError("--num-cpus sizes a local Ray instance; with --address the cluster "
                         "has its own CPUs")  # fmt: skip
    address = args.address
    if address in ("auto", "local"):
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in host:
        raise UsageError(f"--address {address!r}: expected auto, local, ray://host:port or "
                         "host:port (a port number 1-65535)")  # fmt: skip
    import socket

    try:  # Ray waits for a cluster that is not there: look before it starts
        with socket.create_connection((host.strip("[]"), int(port)), timeout=10):
            pass
    except OSError as err:
        raise UsageError(
            f"--address {address}: no Ray cluster reachable there ({err.strerror or err}); "
            "start one or check the address"
        ) from err


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _sweep_with_args(args: Any, names: list[str]) -> dict[str, Any]:
    return sweep(
        args.benchmark,
        names,
        **run_options(args),
        address=args.address,
        num_cpus=args.num_cpus,
        cpus_per_trial=args.cpus_per_trial,
        gpus_per_trial=args.gpus_per_trial,
        max_concurrent=args.max_concurrent,
        max_failures=args.max_failures,
    )
