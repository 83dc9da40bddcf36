"""The runner's command line: argument parsing and checks, planning, running and reporting
(``fromp-bench``; the entry point, its examples and exit statuses are in
:mod:`fromp_bench.__main__`). Writes ``<out>/<benchmark>/results.json`` (every run and the
aggregate), ``report.md`` and ``accuracy.png``; checkpoints go to
``<out>/<benchmark>/checkpoints/``."""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from fromp_bench.data import (
    DATA_ENV_VAR,
    CorruptDataError,
    DataNotFoundError,
    resolve_data_root,
)
from fromp_bench.plugins import (
    UsageError,
    check_out,
    check_report_files,
    check_writable_run_dirs,
    out_lock,
)
from fromp_bench.registry import (
    BENCHMARKS,
    STRATEGIES,
    UnknownNameError,
    get_benchmark,
    get_strategy,
)
from fromp_bench.report import command_line
from fromp_bench.runner import (
    CheckpointError,
    RunConfig,
    SettingsError,
    check_device,
    check_sequence,
    init_distributed,
    load_sequence,
    resolve_settings,
    run,
    validate_settings,
)

from fromp import distributed

DEMO_STRATEGIES = ("fromp", "ewc", "vcl", "naive")
# For each demo slot, the strategies to try in order (the first installed one runs).
_DEMO_SLOTS = (("fromp",), ("ewc", "ewc-avalanche"), ("vcl",), ("naive",))


_TRAINING_KEYS = (
    "lr",
    "train_epochs",
    "train_mb_size",
    "optimizer",
    "lr_schedule",
    "lr_warmup",
    "optimizer_state",
)
_OPT_PREFIX = "opt."  # --set opt.beta2=0.999: a keyword argument of the optimizer


def _literal(raw: str) -> Any:
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


def _put(out: dict[str, Any], key: str, value: Any) -> None:
    if key in _TRAINING_KEYS:
        out[key] = value
    elif key.startswith(_OPT_PREFIX):
        if not key[len(_OPT_PREFIX) :]:
            raise UsageError(f"{key!r}: expected opt.NAME, a keyword argument of the optimizer")
        out.setdefault("optimizer_kwargs", {})[key[len(_OPT_PREFIX) :]] = value
    else:
        out.setdefault("kwargs", {})[key] = value


def _parse_set(items: list[str]) -> dict[str, Any]:
    """``key=value`` pairs; values are Python literals when they parse as one, else strings.
    Keys ``lr``, ``train_epochs``, ``train_mb_size``, ``optimizer``, ``lr_schedule``,
    ``lr_warmup``, ``optimizer_state`` set training settings;
    ``opt.NAME`` a keyword argument of the optimizer (e.g. ``opt.beta2=0.999`` for IVON); any
    other key is a keyword argument of the strategy class."""
    out: dict[str, Any] = {"kwargs": {}}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--set expects key=value, got {item!r}")
        _put(out, key, _literal(raw))
    return out


def parse_grid(items: list[str]) -> list[dict[str, Any]]:
    """``--grid key=v1,v2,...`` options -> the list of override dicts of their Cartesian
    product (in the order given; ``[{}]`` without options)."""
    axes: list[tuple[str, list[Any]]] = []
    for item in items:
        key, sep, raw = item.partition("=")
        values = [_literal(v) for v in raw.split(",") if v != ""]
        if not sep or not key or not values:
            raise UsageError(f"--grid expects key=value1,value2,..., got {item!r}")
        if key in (k for k, _ in axes):
            raise UsageError(f"--grid {key} given twice")
        if len({repr(v) for v in values}) < len(values):
            raise UsageError(f"--grid {item}: a value is listed twice (one run would be "
                             "counted as two seeds)")  # fmt: skip
        axes.append((key, values))
    points: list[dict[str, Any]] = [{}]
    for key, values in axes:
        points = [{**p, key: v} for p in points for v in values]
    out = []
    for p in points:
        o: dict[str, Any] = {}
        for key, value in p.items():
            _put(o, key, value)
        out.append(o)
    return out


def grid_tag(point: dict[str, Any]) -> str:
    """A file-name-safe tag of a grid point (``""`` for the empty point)."""
    flat = {k: v for k, v in point.items() if k not in ("kwargs", "optimizer_kwargs")}
    flat.update({f"{_OPT_PREFIX}{k}": v for k, v in point.get("optimizer_kwargs", {}).items()})
    flat.update(point.get("kwargs", {}))
    text = ",".join(f"{k}={v}" for k, v in flat.items())
    return "".join(c if c.isalnum() or c in "=.,-_" else "_" for c in text)


def parse_strategies(raw: str | None) -> list[str]:
    """``--strategies a,b``: the names in order (None: the default four). An empty list, an
    empty name or a name given twice is refused (a repeated strategy would be one run
    reported as two seeds)."""
    if raw is None:
        return list(DEMO_STRATEGIES)
    names = [n.strip() for n in raw.split(",")]
    if not raw.strip() or "" in names:
        raise UsageError(f"--strategies {raw!r}: expected comma-separated names from "
                         f"{', '.join(STRATEGIES)}, with no empty name")  # fmt: skip
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise UsageError(f"--strategies {raw!r}: {', '.join(repeated)} listed twice (one run "
                         "would be counted as two seeds)")  # fmt: skip
    return names


def settings_id(
    benchmark: str,
    strategy: str,
    overrides: dict[str, Any],
    protocol: dict[str, Any] | None = None,
) -> str:
    """``""`` for a strategy's default settings on the benchmark's full data; otherwise
    ``"s"`` and 8 hex digits of a SHA-256 of the resolved settings and the protocol
    (``n_train``, ``n_test``, ``valid_fraction``, ``valid_seed``, and ``world_size`` for a
    data-parallel run of more than one process: it trains otherwise, so it is another
    setting; runs of one process keep the ids they had). It is part of the run's file names,
    so that runs of other settings never replace each other, while the same (strategy,
    settings, seed) replaces itself."""
    import hashlib

    bench, spec = get_benchmark(benchmark), get_strategy(strategy)
    defaults = {"n_train": None, "n_test": None, "valid_fraction": None, "valid_seed": 0}
    proto = {**defaults, **(protocol or {})}

    def ident(settings: dict[str, Any], proto: dict[str, Any]) -> str:
        return json.dumps({"settings": settings, **proto}, sort_keys=True, default=repr)

    mine = ident(resolve_settings(bench, spec, overrides), proto)
    if mine == ident(resolve_settings(bench, spec, {}), defaults):
        return ""
    return "s" + hashlib.sha256(mine.encode()).hexdigest()[:8]


def _merge(base: dict[str, Any], point: dict[str, Any]) -> dict[str, Any]:
    nested = ("kwargs", "optimizer_kwargs")
    out = {k: v for k, v in base.items() if k not in nested}
    out.update({k: v for k, v in point.items() if k not in nested})
    for key in nested:
        merged = {**base.get(key, {}), **point.get(key, {})}
        if merged:
            out[key] = merged
    return out


def build_parser(sweep: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fromp-bench sweep" if sweep else "fromp-bench",
        description=(
            "Run a grid of (strategy, settings, seed) as Ray Tune trials and aggregate them."
            if sweep
            else "Run continual-learning benchmarks (FROMP, EWC, VCL, Naive, ...) on "
            "Avalanche and report accuracy, forgetting, NLL and calibration. "
            "'fromp-bench sweep ...' runs the same grid on Ray Tune."
        ),
    )
    p.add_argument(
        "benchmark",
        nargs="?",
        help=f"one of: {', '.join(BENCHMARKS)}; or 'demo' (the README's main job)",
    )
    p.add_argument(
        "--strategies",
        default=None,
        help=f"comma-separated, from: {', '.join(STRATEGIES)} (default: fromp,ewc,vcl,naive)",
    )
    p.add_argument("--seeds", type=int, default=1, help="number of seeds (default 1)")
    p.add_argument("--seed-offset", type=int, default=0, help="first seed (default 0)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default cpu)")
    p.add_argument("--data-root", default=None, help="data root (default: $FROMP_DATA or ./data)")
    p.add_argument("--out", default="runs", help="output directory (default ./runs)")
    p.add_argument("--resume", action="store_true", help="continue from checkpoints")
    p.add_argument(
        "--allow-code-change",
        action="store_true",
        help="with --resume: accept checkpoints written by other code (recorded in the run)",
    )
    p.add_argument("--epochs", type=int, default=None, help="override epochs per task")
    p.add_argument("--lr", type=float, default=None, help="override the learning rate")
    p.add_argument("--batch-size", type=int, default=None, help="override the batch size")
    p.add_argument("--n-train", type=int, default=None, help="train examples per task (subset)")
    p.add_argument("--n-test", type=int, default=None, help="test examples per task (subset)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a setting, a strategy keyword argument or (opt.NAME) an optimizer "
        "keyword argument, e.g. --set tau=10 --set opt.beta2=0.999",
    )
    p.add_argument(
        "--grid",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="run every combination of these values (repeatable), e.g. --grid tau=10,30",
    )
    p.add_argument(
        "--valid-fraction",
        type=float,
        default=None,
        help="hold out this share of each task's training examples for validation (e.g. "
        "0.1; the split is fixed by --valid-seed, the same for every run seed)",
    )
    p.add_argument("--valid-seed", type=int, default=0, help="seed of the validation split")
    p.add_argument(
        "--select-on",
        choices=("validation",),
        default=None,
        help="per strategy, report the grid point with the best mean validation accuracy "
        "(and its test accuracy); needs --valid-fraction",
    )
    p.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: rebuild results.json, report.md and accuracy.png from the "
        "per-run JSON files in <out>/<benchmark>/runs/",
    )
    p.add_argument("--stop-after", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--list", action="store_true", help="list benchmarks and strategies")
    if sweep:
        p.add_argument(
            "--address",
            default=None,
            help="Ray cluster address (e.g. ray://head:10001 or auto); default: start a local "
            "Ray instance",
        )
        p.add_argument("--cpus-per-trial", type=float, default=1.0, help="default 1")
        p.add_argument(
            "--gpus-per-trial", type=float, default=0.0, help="fractions allowed (default 0)"
        )
        p.add_argument(
            "--max-concurrent", type=int, default=None, help="trials at once (default: Ray's)"
        )
        p.add_argument("--max-failures", type=int, default=2, help="retries of a failed trial")
        p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray instance")
    return p


def _list() -> str:
    lines = ["benchmarks:"]
    lines += [f"  {b.name:22s} {b.description}" for b in BENCHMARKS.values()]
    lines += ["strategies:"]
    for s in STRATEGIES.values():
        flag = "" if s.available() else "  [not installed]"
        lines.append(f"  {s.name:22s} {s.description}{flag}")
    return "\n".join(lines)


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out = _parse_set(args.set)
    for key, val in (
        ("train_epochs", args.epochs),
        ("lr", args.lr),
        ("train_mb_size", args.batch_size),
    ):
        if val is not None:
            out[key] = val
    if not out["kwargs"]:
        del out["kwargs"]
    return out


def check_args(args: argparse.Namespace) -> None:
    """Every command-line value that can be checked without data; one line per error."""
    for flag, value in (
        ("--seeds", args.seeds),
        ("--epochs", args.epochs),
        ("--batch-size", args.batch_size),
        ("--n-train", args.n_train),
        ("--n-test", args.n_test),
    ):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if args.seed_offset < 0:
        raise UsageError(f"--seed-offset must be >= 0, got {args.seed_offset}")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise UsageError(f"--lr must be a finite number > 0, got {args.lr}")
    if args.valid_fraction is not None and not 0 < args.valid_fraction < 1:
        raise UsageError(f"--valid-fraction must be in (0, 1), got {args.valid_fraction}")
    if args.select_on == "validation" and args.valid_fraction is None and not args.report_only:
        raise UsageError("--select-on validation needs --valid-fraction (e.g. 0.1)")
    if args.stop_after is not None and args.stop_after < 1:
        raise UsageError(f"--stop-after must be >= 1, got {args.stop_after}")
    check_device(args.device)
    if not args.report_only:
        check_out(Path(args.out))


def plan(
    benchmark: str,
    strategies: list[str],
    overrides: dict[str, Any],
    grid: list[dict[str, Any]],
    device: str = "cpu",
    protocol: dict[str, Any] | None = None,
) -> list[tuple[str, dict[str, Any], str]]:
    """Every (strategy, overrides, tag) to run, each validated (names, types, ranges, the
    device) before any data is loaded. The tag is the grid point's and the settings id
    (:func:`settings_id`, with ``protocol``: ``n_train``, ``n_test``, ``valid_fraction``,
    ``valid_seed``), joined by ``-``; it names the run's files."""
    bench = get_benchmark(benchmark)
    if len(set(strategies)) < len(strategies):
        raise UsageError(f"strategies {strategies}: a strategy is listed twice")
    specs = [get_strategy(s) for s in strategies]
    missing = [s.name for s in specs if not s.available()]
    if missing:
        raise UnknownNameError(f"strategy not installed: {', '.join(missing)}")
    jobs = []
    for spec in specs:
        for point in grid:
            merged = _merge(overrides, point)
            validate_settings(bench, spec, resolve_settings(bench, spec, merged), device)
            sid = settings_id(benchmark, spec.name, merged, protocol)
            jobs.append((spec.name, merged, "-".join(t for t in (grid_tag(point), sid) if t)))
    return jobs


def check_data(
    benchmark: str,
    jobs: list[tuple[str, dict[str, Any], str]],
    data_root: str | None,
    n_train: int | None,
    n_test: int | None,
    valid_fraction: float | None,
    valid_seed: int,
) -> None:
    """Load the data once (corrupt or missing data fail here) and check the settings that
    depend on it (memorable points per class, coreset size), before any training."""
    bench = get_benchmark(benchmark)
    try:
        seq = load_sequence(bench, data_root, n_train, n_test, valid_fraction, valid_seed)
    except ValueError as err:
        if isinstance(err, USER_ERRORS):
            raise
        raise UsageError(str(err)) from err
    for name, merged, _ in jobs:
        check_sequence(seq, resolve_settings(bench, get_strategy(name), merged), name)


def run_name(strategy: str, tag: str, seed: int) -> str:
    return f"{strategy}{'-' + tag if tag else ''}-seed{seed}"


def run_benchmark(
    benchmark: str,
    strategies: list[str],
    *,
    seeds: list[int],
    out: Path,
    data_root: str | None = None,
    device: str = "cpu",
    overrides: dict[str, Any] | None = None,
    grid: list[dict[str, Any]] | None = None,
    n_train: int | None = None,
    n_test: int | None = None,
    valid_fraction: float | None = None,
    valid_seed: int = 0,
    select_on: str | None = None,
    resume: bool = False,
    stop_after: int | None = None,
    progress: bool = True,
    allow_code_change: bool = False,
) -> dict[str, Any]:
    """Run every (strategy, grid point, seed), then write the JSON, the Markdown report and
    the plot. Settings are validated and the data checked before the first run starts.

    Returns the payload written to ``results.json`` (``failed`` lists runs stopped by a
    non-finite value).
    """
    init_distributed(device)  # under torchrun: join the process group; rank 0 writes
    main = distributed.rank() == 0
    grid = grid or [{}]
    protocol = {"n_train": n_train, "n_test": n_test, "valid_fraction": valid_fraction,
                "valid_seed": valid_seed}  # fmt: skip
    if distributed.world_size() > 1:  # its own label: never replaces a run of other processes
        protocol["world_size"] = distributed.world_size()
    jobs = plan(benchmark, strategies, dict(overrides or {}), grid, device, protocol)
    base = out / benchmark
    results = []
    labels = set()
    started = time.perf_counter()
    lock = out_lock(base) if main else contextlib.nullcontext()
    with lock:  # taken before the data checks: a second job is refused at once
        if main:
            check_writable_run_dirs(base)
        check_data(benchmark, jobs, data_root, n_train, n_test, valid_fraction, valid_seed)
        for name, merged, tag in jobs:
            for seed in seeds:
                label = run_name(name, tag, seed)
                labels.add(label)
                res = _run_one(benchmark, name, merged, seed, label, base, data_root, device,
                               n_train, n_test, resume, stop_after, progress, valid_fraction,
                               valid_seed, allow_code_change)  # fmt: skip
                results.append(res)
                if main:
                    print(describe(res, tag), flush=True)
        if not main:  # the other ranks return what rank 0 writes, and write nothing
            failed = [{"strategy": r["strategy"], "seed": r["seed"], **r["failed"]}
                      for r in results if r.get("failed")]  # fmt: skip
            return {"benchmark": benchmark, "runs": results, "failed": failed}
        # results.json keeps this directory's earlier runs (other strategies, settings or
        # seeds); a run of the same (strategy, settings, seed) replaces its earlier result
        earlier = _earlier_runs(base, labels)
        return write_report(
            benchmark,
            base,
            earlier + results,
            command=command_line(["fromp-bench", *sys.argv[1:]]),
            total_time_s=time.perf_counter() - started,
            select_on=select_on,
        )


def _run_one(benchmark: str, name: str, merged: dict[str, Any], seed: int, label: str,
             base: Path, *args: Any) -> dict[str, Any]:  # fmt: skip
    """One run (``args``: the rest of :class:`RunConfig`'s fields after ``overrides``, the
    checkpoint path excepted), its result saved as ``base/runs/<label>.json``."""
    from fromp_bench.report import portable, save_json

    data_root, device, n_train, n_test, resume, stop_after, progress, *rest = args
    ckpt = base / "checkpoints" / f"{label}.pt"
    if resume and not ckpt.exists() and distributed.rank() == 0:  # said once, by rank 0
        others = sorted(f.name for f in ckpt.parent.glob(f"{name}-*seed{seed}.pt"))
        if others:
            print(f"fromp-bench: no checkpoint of these settings ({ckpt.name}); {name} seed "
                  f"{seed} starts from the beginning (checkpoints of other settings, kept: "
                  f"{', '.join(others[:3])})", file=sys.stderr, flush=True)  # fmt: skip
    cfg = RunConfig(benchmark, name, seed, data_root, device, merged, n_train, n_test,
                    str(ckpt), resume, stop_after, progress, *rest)  # fmt: skip
    res = portable(run(cfg), base)
    if distributed.rank() == 0:  # under torchrun only rank 0 writes
        save_json(base / "runs" / f"{label}.json", res)
    return res


def _earlier_runs(base: Path, exclude: set[str]) -> list[dict[str, Any]]:
    """The run results in ``base/runs`` other than ``exclude`` (labels); unreadable files
    are refused with their path."""
    return [_read_run(f) for f in sorted((base / "runs").glob("*.json")) if f.stem not in exclude]


def _read_run(f: Path) -> dict[str, Any]:
    """One ``runs/*.json``; refused in one line naming the file when it is unreadable, not
    JSON, or JSON that is not a run result (a ``strategy`` name, an integer ``seed`` and
    ``complete``)."""
    try:
        run = json.loads(f.read_text())
    except (OSError, ValueError) as err:
        raise UsageError(f"{f}: not a run result ({' '.join(str(err).split())})") from err
    ok = (
        isinstance(run, dict)
        and isinstance(run.get("strategy"), str)
        and isinstance(run.get("seed"), int)
        and not isinstance(run.get("seed"), bool)
        and "complete" in run
    )
    if not ok:
        got = sorted(run)[:6] if isinstance(run, dict) else type(run).__name__
        raise UsageError(f"{f}: not a run result (expected a JSON object with strategy, seed "
                         f"and complete; got {got}); move it out of runs/")  # fmt: skip
    return run


def describe(res: dict[str, Any], tag: str = "") -> str:
    """One line about a finished, stopped or failed run."""
    head = f"{res['strategy'] + (' [' + tag + ']' if tag else ''):14s} seed {res['seed']}"
    if res.get("failed"):
        f = res["failed"]
        return f"{head}: FAILED on task {f['task']}: {f['reason']}"
    if res["complete"]:
        val = res.get("mean_valid_accuracy")
        val_s = "" if val is None else f", validation {val:.2f} %"
        return (
            f"{head}: {res['mean_accuracy']:.2f} % (per task: "
            f"{', '.join(f'{a:.1f}' for a in res['final_accuracies'])}{val_s}) "
            f"in {res['wall_time_s']:.0f} s"
        )
    return (
        f"{head}: stopped after {len(res['accuracy_matrix'])} tasks (checkpointed; rerun "
        "with --resume)"
    )


def write_report(
    bench_name: str,
    base: Path,
    results: list[dict[str, Any]],
    *,
    select_on: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Aggregate ``results`` and write ``results.json``, ``report.md`` and ``accuracy.png``
    under ``base``; print the table. Failed runs are listed, never aggregated. Returns the
    payload of ``results.json``."""
    from fromp_bench.report import aggregate, markdown_report, plot_accuracy, save_json, select

    bench = get_benchmark(bench_name)
    agg = aggregate(results)
    failed = [r for r in results if r.get("failed")]
    selection = None
    if select_on == "validation" and agg:
        try:
            selection = select(agg)
        except ValueError as err:
            raise UsageError(str(err)) from err
    payload = {
        "benchmark": bench_name,
        **extra,
        "select_on": select_on,
        "selection": selection,
        "aggregate": agg,
        "failed": [
            {"strategy": r["strategy"], "seed": r["seed"], **(r.get("failed") or {})}
            for r in failed
        ],
        "runs": results,
    }
    save_json(base / "results.json", payload)
    if agg or failed:
        report = markdown_report(bench, agg, failed=failed, selection=selection)
        (base / "report.md").write_text(report)
        if agg:
            shown = (
                agg
                if selection is None
                else {v["selected"]: agg[v["selected"]] for v in selection.values()}
            )
            plot_accuracy(bench, shown, base / "accuracy.png")
        print()
        print(report)
        files = [base / "results.json", base / "report.md"] + (
            [base / "accuracy.png"] if agg else []
        )
        print(f"results: {', '.join(map(str, files))}")
    return payload


def report_only(benchmark: str, out: Path, select_on: str | None = None) -> dict[str, Any]:
    """Rebuild the report of ``benchmark`` from ``<out>/<benchmark>/runs/*.json``; runs are
    grouped by identical settings and data (:func:`fromp_bench.report.group_key`)."""
    base = out / benchmark
    files = sorted((base / "runs").glob("*.json"))
    if not files:
        raise UsageError(f"no run results in {base / 'runs'}")
    results = [_read_run(f) for f in files]
    check_report_files(base)
    return write_report(
        benchmark, base, results, command=f"report of OUT/{benchmark}/runs", select_on=select_on
    )


def demo(args: argparse.Namespace) -> dict[str, Any]:
    """The main job: FROMP, EWC, VCL and Naive on split MNIST, one seed, quick settings;
    Permuted-Digits when MNIST cannot be found or downloaded. Ends with :func:`takeaway`."""
    benchmark = "split-mnist"
    try:
        load_sequence(get_benchmark(benchmark), args.data_root)
    except DataNotFoundError as err:
        first = str(err).split(". ")[0]
        root = resolve_data_root(args.data_root).resolve()
        print(
            f"demo: {first} in data root {root} (from --data-root, ${DATA_ENV_VAR} or ./data); "
            "running the built-in Permuted-Digits benchmark instead."
        )
        benchmark = "permuted-digits"
    if args.strategies is not None:
        names = parse_strategies(args.strategies)
    else:
        names = []
        for slot in _DEMO_SLOTS:
            names += [s for s in slot if get_strategy(s).available()][:1]
    overrides = _overrides(args)
    if benchmark == "split-mnist":
        overrides.setdefault("train_epochs", 2)
    seed = args.seed_offset
    print(f"demo: {', '.join(names)} on {benchmark}, seed {seed} (quick settings; see README)")
    payload = run_benchmark(
        benchmark,
        names,
        seeds=[seed],
        out=Path(args.out),
        data_root=args.data_root,
        device=args.device,
        overrides=overrides,
        n_train=args.n_train,
        n_test=args.n_test,
        progress=not args.no_progress,
    )
    note = takeaway(payload["aggregate"])
    if note:
        print(note)
    return payload


def takeaway(agg: dict[str, Any]) -> str | None:
    """The table's point in one line (``agg`` of :func:`fromp_bench.report.aggregate`): the
    mean forgetting (points of accuracy an earlier task lost from its best to the end) of
    Naive, then of the others, least first, with how much less (or more); then the group most
    accurate at the end. None when no group has a forgetting (one task, no complete run)."""
    forgot = {k: r["forgetting"]["mean"] for k, r in agg.items()}
    forgot = {k: v for k, v in forgot.items() if v is not None}
    if not forgot:
        return None
    acc = {k: agg[k]["mean_accuracy"]["mean"] for k in forgot}
    base = forgot.pop("naive", None)
    rest = []
    for k, v in sorted(forgot.items(), key=lambda kv: kv[1]):
        vs = "" if base is None else f" ({abs(base - v):.1f} {'less' if v <= base else 'more'})"
        rest.append(f"{k} {v:.1f}{vs}")
    parts = (
        [] if base is None else [f"naive forgets {base:.1f} points of accuracy on earlier tasks"]
    )
    if rest:
        head = "forgetting on earlier tasks, in points of accuracy: " if base is None else ""
        parts.append(head + ", ".join(rest))
    if len(acc) > 1:
        best = max(acc, key=lambda k: acc[k])
        than = f", naive {acc['naive']:.1f} %" if "naive" in acc and best != "naive" else ""
        parts.append(f"most accurate at the end: {best} ({acc[best]:.1f} %{than})")
    return f"demo: {'; '.join(parts)}."


#: Errors reported as one line with exit status 2.
USER_ERRORS = (
    UnknownNameError,
    DataNotFoundError,
    CorruptDataError,
    UsageError,
    SettingsError,
    CheckpointError,
)


def run_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of :func:`run_benchmark` (and the sweep) given on the command
    line: seeds, output, data, device, settings, grid, subsample, validation, selection,
    resume."""
    return {
        "seeds": list(range(args.seed_offset, args.seed_offset + args.seeds)),
        "out": Path(args.out),
        "data_root": args.data_root,
        "device": args.device,
        "overrides": _overrides(args),
        "grid": parse_grid(args.grid),
        "n_train": args.n_train,
        "n_test": args.n_test,
        "valid_fraction": args.valid_fraction,
        "valid_seed": args.valid_seed,
        "select_on": args.select_on,
        "resume": args.resume,
        "allow_code_change": args.allow_code_change,
    }
