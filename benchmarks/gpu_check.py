"""The GPU check (``make gpu-check``, docs/gpu.md): the CUDA tests and the runner's training
times on a GPU, each case written to ``OUT/<date>-<device>.json`` and ``.md`` as it ends.

    python -m fromp_bench.gpu_check [--device cuda] [--budget 400] [--quick] [--cases NAMES]
                                    [--data-root DIR] [--out benchmarks/results/gpu]

Cases, in order: ``tests`` (``pytest -k cuda tests``: counts, summary line), then
``<timing>/<strategy>`` for each :class:`Timing` of :data:`FULL`, each ``python -m fromp_bench
... --seeds 1`` in its own process: per-task seconds (training and the method's phases;
evaluation apart) and accuracy (a run stopped by its share: ``partial``, the tasks its
checkpoint holds). A case that fails or runs past its share has a ``status`` (``failed``,
``timeout``, ``skipped``, ``not_run``) and a ``reason``, never a number; cases not reached stay
``pending`` and ``finished`` false. ``targets`` holds the flags (``null`` when not measured, or
with ``--quick``): each method's time over Naive's within its limit (:attr:`Timing.limits`),
each per-task time flat within :data:`FLAT_LIMIT` (max / min over tasks 2..T). ``--budget``
bounds the check (each case: its share or the time left, the smaller); ``--quick`` runs small
sizes (on the CPU split-digits, 64 / 32 examples per task, and a 2 % synthetic CIFAR). Paths are
recorded as ``OUT`` and ``DATA``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "gpu"
SCHEMA = 4
CUDA_TEST_PATHS = ("tests",)
MIN_CASE_S = 5.0
FLAT_LIMIT = 1.2
STRATEGIES = ("naive", "fromp", "ewc")
TESTS_CAP_S = 90.0


@dataclass(frozen=True)
class Timing:
    """Timing cases: ``benchmark`` by ``python -m module *prefix`` (the runner, or a study
    running it on synthetic data) with ``args`` (none: the registry's settings) and ``only``
    for one strategy, each of ``strategies`` in its own process; ``limits`` the largest time
    over Naive's per method, ``cap_s`` each run's time share (seconds)."""

    name: str
    benchmark: str
    args: tuple[str, ...] = ()
    limits: tuple[tuple[str, float], ...] = (("fromp", 1.3), ("ewc", 1.15))
    cap_s: float = 130.0
    strategies: tuple[str, ...] = STRATEGIES
    module: str = "fromp_bench"
    prefix: tuple[str, ...] = ()
    only: tuple[tuple[str, tuple[str, ...]], ...] = ()


def _cifar(scale: str, *args: str, only: tuple = ()) -> Timing:  # on synthetic files
    synthetic = ("naive", "fromp"), "studies.synthetic_cifar", ("--scale", scale, "--")
    return Timing("split-cifar-1", "split-cifar", ("--epochs", "1", *args), (("fromp", 1.2),),
                  150.0, *synthetic, only)  # fmt: skip


FULL = (Timing("split-mnist-2", "split-mnist", ("--epochs", "2"), cap_s=60.0),
        Timing("split-mnist", "split-mnist", cap_s=110.0), _cifar("1"))  # fmt: skip
QUICK = (Timing("split-mnist-2", "split-mnist", ("--epochs", "1", "--n-train", "2000")),)
TINY = ("--epochs", "1", "--n-train", "64", "--n-test", "32")
FEW = (("fromp", ("--set", "n_points=10")),)  # memorable points on 64 examples per task
QUICK_CPU = (Timing("split-digits", "split-digits", TINY),
             _cifar("0.02", *TINY[2:4], "--n-test", "20", only=FEW))  # fmt: skip


# ----------------------------------------------------------------------- subprocesses
def run_command(cmd: list[str], timeout: float) -> dict[str, Any]:
    """Run ``cmd`` from the repository root in its own process group, killed (the whole
    group) after ``timeout`` seconds: ``{"returncode", "stdout", "stderr", "timed_out",
    "wall_s"}``."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=max(timeout, 1.0))
        timed_out = False
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        timed_out = True
    return {"returncode": proc.returncode, "stdout": out or "", "stderr": err or "",
            "timed_out": timed_out, "wall_s": time.perf_counter() - t0}  # fmt: skip


def _tail(text: str, n: int = 800) -> str:
    return text.strip()[-n:]


def tests_case(seconds: float, paths: tuple[str, ...] = CUDA_TEST_PATHS) -> dict[str, Any]:
    """``pytest -k cuda`` over ``paths``: counts from pytest's summary line; ``failed`` when a
    test fails or errors."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", "-k", "cuda", *paths]  # fmt: skip
    res = run_command(cmd, seconds)
    out: dict[str, Any] = {"command": shlex.join(["python", *cmd[1:]])}
    if res["timed_out"]:
        return {**out, "status": "timeout", "reason": f"pytest ran past {seconds:.0f} s"}
    lines = [ln for ln in res["stdout"].strip().splitlines() if ln.strip()]
    summary = lines[-1] if lines else _tail(res["stderr"], 300)
    found = re.findall(r"(\d+) (passed|skipped|failed|errors?|deselected)", summary)
    counts = {("errors" if k.startswith("error") else k): int(n) for n, k in found}
    out.update(returncode=res["returncode"], summary=summary, **counts)
    if res["returncode"] == 0:
        return {**out, "status": "ok", "wall_s": res["wall_s"]}
    status = "failed" if counts.get("failed") or counts.get("errors") else "error"
    return {**out, "status": status, "output": _tail(res["stdout"], 1500),
            "reason": f"pytest exit status {res['returncode']}: {summary[:300]}"}  # fmt: skip


# ------------------------------------------------------------------------- timings
def _phase_seconds(task: dict[str, Any]) -> tuple[float, float]:
    """(training + the method's phases, evaluation) seconds of one task's timing entry."""
    work = sum(float(v) for k, v in task.items() if k.endswith("_s") and k != "evaluation_s")
    return work, float(task.get("evaluation_s", 0.0))


def summarise_run(run: dict[str, Any]) -> dict[str, Any]:
    """Per-task seconds of one runner result (``run["timing"]``): ``per_task_s`` (training
    plus method phases), ``per_task_eval_s``, ``phases_s`` (summed over tasks), ``total_s``
    and ``flatness`` (max / min of ``per_task_s`` over tasks 2..T, all tasks when fewer)."""
    timing = run.get("timing") or []
    work = [_phase_seconds(t)[0] for t in timing]
    keys = dict.fromkeys(k for t in timing for k in t if k.endswith("_s"))  # in their order
    phases = {k: sum(float(t.get(k, 0.0)) for t in timing) for k in keys}
    later = work[1:] if len(work) > 2 else work
    return {
        "per_task_s": work,
        "per_task_eval_s": [_phase_seconds(t)[1] for t in timing],
        "phases_s": phases,
        "total_s": sum(work),
        "flatness": max(later) / min(later) if later and min(later) > 0 else None,
        "mean_accuracy": run.get("mean_accuracy"),
    }


def missing_data(benchmark: str, root: Path) -> str | None:
    """Why ``benchmark``'s data files are not under ``root`` (the runner would try to
    download them), or None."""
    from fromp_bench.data import _EXPECTED
    from fromp_bench.registry import get_benchmark

    for name in get_benchmark(benchmark).needs:
        sub, files = _EXPECTED[name]
        absent = [f for f in files if not any((root / sub / g).exists() for g in (f, f + ".gz"))]
        if absent:
            return f"no {name} under DATA/{sub} (--data-root or $FROMP_DATA; make gpu-bundle)"
    return None


def timing_case(t: Timing, strategy: str, device: str, root: Path, seconds: float) -> dict:
    """``strategy`` on ``t.benchmark`` through the runner (``python -m fromp_bench``), seed 0."""
    from fromp_bench.report import command_line

    synthetic = t.module != "fromp_bench"  # a study writing its data in the run's folder
    if not synthetic and (why := missing_data(t.benchmark, root)):
        return {"status": "skipped", "reason": why}
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", t.module, *t.prefix, t.benchmark, "--strategies", strategy,
               "--seeds", "1", "--device", device, "--out", tmp, "--no-progress",
               "--data-root", tmp if synthetic else str(root), *t.args,
               *dict(t.only).get(strategy, ())]  # fmt: skip
        out: dict[str, Any] = {"command": command_line(["python", *cmd[1:]])}
        res = run_command(cmd, seconds)
        base = Path(tmp) / t.benchmark
        if res["timed_out"]:
            out.update(status="timeout", reason=f"stopped after {seconds:.0f} s (its share)")
            partial = _checkpoint_timing(base)
            if partial:
                out["partial"] = summarise_run({"timing": partial})
            return out
        if res["returncode"] != 0:
            reason = f"exit status {res['returncode']}: {_tail(res['stderr'])}"
            return {**out, "status": "failed", "reason": reason.replace(tmp, "OUT")}
        runs = json.loads((base / "results.json").read_text()).get("runs", [])
    if len(runs) != 1 or not runs[0].get("complete", False):
        return {**out, "status": "failed", "reason": "the runner did not complete the run"}
    return {**out, "status": "ok", "wall_s": res["wall_s"], **summarise_run(runs[0])}


def _checkpoint_timing(base: Path) -> list[dict[str, Any]]:
    """The per-task timing in the runner's newest checkpoint under ``base`` (a stopped run),
    read as ``--resume`` reads it (checksum, weights only)."""
    from fromp_bench.plugins import CheckpointError, _read_checkpoint

    ckpts = sorted((base / "checkpoints").glob("*.pt"), key=lambda p: p.stat().st_mtime)
    try:
        return list(_read_checkpoint(ckpts[-1]).get("timing") or []) if ckpts else []
    except CheckpointError:  # cut mid-write, or not a checkpoint: nothing to report
        return []


def targets(cases: dict[str, dict[str, Any]], timings: tuple[Timing, ...], quick: bool) -> dict:
    """The pass/fail flags from the cases so far: ``{"pass": True | False | None, "value",
    "limit", "note"}`` (None: not measured, or quick mode), keyed ``<timing>/<name>``."""
    out: dict[str, dict[str, Any]] = {}

    def flag(limit: str, value: Any, ok: bool | None, note: str | None = None) -> dict:
        f: dict[str, Any] = {"limit": limit, "value": value, "pass": None if quick else ok}
        note = "quick mode: not at the target's sizes" if quick and ok is not None else note
        return {**f, "note": note} if note else f

    def state(case: dict[str, Any]) -> str:
        reason = case.get("reason")
        return f"{case.get('status', 'not in this run')}" + (f": {reason[:120]}" if reason else "")

    for t in timings:
        naive = cases.get(f"{t.name}/naive", {})
        for name, most in t.limits:
            run = cases.get(f"{t.name}/{name}", {})
            limit = f"time <= {most}x Naive's (training and method phases, all tasks)"
            key = f"{t.name}/{name}_over_naive"
            if run.get("status") == "ok" and naive.get("status") == "ok" and naive["total_s"] > 0:
                ratio = run["total_s"] / naive["total_s"]
                pairs = zip(run["per_task_s"], naive["per_task_s"])
                per_task = [a / b if b > 0 else None for a, b in pairs]
                out[key] = {**flag(limit, ratio, ratio <= most), "per_task": per_task}
            else:
                note = f"not measured ({state(run)}; naive: {state(naive)})"
                out[key] = flag(limit, None, None, note)
        limit = f"per-task time max/min <= {FLAT_LIMIT} over tasks 2..T"
        for name in t.strategies:
            run = cases.get(f"{t.name}/{name}", {})
            flat = run.get("flatness") if run.get("status") == "ok" else None
            ok = None if flat is None else flat <= FLAT_LIMIT
            note = None if flat is not None else f"not measured ({state(run)})"
            out[f"{t.name}/{name}_per_task_flat"] = flag(limit, flat, ok, note)
    return out


# ---------------------------------------------------------------------------- record
def markdown(record: dict[str, Any]) -> str:
    """A short summary of ``record``: the flags, then one line per case."""
    env = record["environment"]
    lines = [
        f"# GPU check, {record['date']}, {env.get('device_name') or env.get('device')}",
        "",
        f"`{record['command']}`; torch {env['torch']}, CUDA {record['cuda']}, "
        f"{'quick' if record['quick'] else 'full'} mode, budget {record['budget_s']:.0f} s, "
        f"{'finished' if record['finished'] else 'NOT finished'} after "
        f"{record['elapsed_s']:.0f} s.",
        "",
        "| target | value | limit | pass |",
        "|---|---|---|---|",
    ]
    for name, t in record["targets"].items():
        v = t.get("value")
        v = f"{v:.3f}" if isinstance(v, float) else (v or t.get("note", "–"))
        mark = {True: "PASS", False: "FAIL", None: "–"}[t.get("pass")]
        lines.append(f"| {name} | {v} | {t['limit']} | {mark} |")
    lines += ["", "| case | status | result |", "|---|---|---|"]
    for name, c in record["cases"].items():
        res = c.get("summary") or c.get("reason", "")
        if c.get("status") == "ok" and "per_task_s" in c:
            per = ", ".join(f"{s:.1f}" for s in c["per_task_s"])
            res = f"per task (s): {per}; total {c['total_s']:.1f} s; accuracy {c['mean_accuracy']}"
        lines.append(f"| {name} | {c.get('status')} | {str(res)[:300].replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def case_names(timings: tuple[Timing, ...]) -> list[str]:
    """Every case, in the order the check runs them."""
    return ["tests", *(f"{t.name}/{s}" for t in timings for s in t.strategies)]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fromp_bench.gpu_check",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--device", default="cuda")
    p.add_argument("--data-root", default=None, help="data root (else $FROMP_DATA, ./data)")
    p.add_argument("--out", type=Path, default=OUT, help="folder of the results")
    p.add_argument("--budget", type=float, default=400.0, help="seconds for the whole check")
    p.add_argument("--quick", action="store_true", help="small sizes (the CPU: tiny)")
    p.add_argument("--cases", default=None, help="comma-separated case names or prefixes")
    return p.parse_args(argv)


def _checked(args: argparse.Namespace) -> tuple[torch.device, tuple[Timing, ...], list[str]]:
    """Every argument, before any work: the device (one this machine has,
    :func:`fromp_bench.runner.check_device`; CUDA without ``--quick``), ``--budget`` (a finite
    number > 0), ``--out`` (a folder that can be written), ``--cases`` (known names)."""
    from fromp_bench.plugins import UsageError, check_out
    from fromp_bench.runner import check_device

    check_device(args.device)  # a SettingsError, a ValueError, names --device
    if (dev := torch.device(args.device)).type != "cuda" and not args.quick:
        raise ValueError(f"--device {dev}: the GPU check needs a CUDA device (or --quick)")
    if not (math.isfinite(args.budget) and args.budget > 0):
        raise ValueError(f"--budget must be a finite number of seconds > 0, got {args.budget}")
    timings = (QUICK_CPU if dev.type != "cuda" else QUICK) if args.quick else FULL
    names = case_names(timings)
    if args.cases is not None:
        wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
        unknown = [w for w in wanted if not any(n.startswith(w) for n in names)]
        if unknown or not wanted:
            raise ValueError(f"--cases: unknown {unknown}, expected names or prefixes of {names}")
        names = [n for n in names if any(n.startswith(w) for w in wanted)]
    try:
        check_out(args.out)
    except UsageError as err:
        raise ValueError(str(err)) from err
    return dev, timings, names


def main(argv: list[str] | None = None) -> int:
    from fromp_bench.data import resolve_data_root
    from fromp_bench.report import code_record, command_line, env_record, save_json

    args = parse(argv)
    start = time.monotonic()
    try:
        dev, timings, names = _checked(args)
    except ValueError as err:
        print(f"gpu_check: {err}", file=sys.stderr)
        return 2
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    slug = re.sub(r"[^a-z0-9]+", "-", env_record(str(dev))["device_name"].lower()).strip("-")
    stem = f"{date}-{slug if dev.type == 'cuda' else 'cpu'}" + ("-quick" if args.quick else "")
    json_path, md_path = args.out / f"{stem}.json", args.out / f"{stem}.md"
    shown = list(sys.argv[1:] if argv is None else argv)
    record: dict[str, Any] = {
        "schema": SCHEMA,
        "command": command_line(["python", "-m", "fromp_bench.gpu_check", *shown]),
        "date": date,
        "environment": env_record(str(dev)),
        "cuda": torch.version.cuda,
        "code": code_record(),
        "quick": args.quick,
        "budget_s": args.budget,
        "timings": [dataclasses.asdict(t) for t in timings],
        "finished": False,
        "elapsed_s": 0.0,
        "cases": {n: {"status": "pending"} for n in names},
        "targets": {},
    }

    def write() -> None:
        record["elapsed_s"] = time.monotonic() - start
        record["targets"] = targets(record["cases"], timings, args.quick)
        save_json(json_path, record)
        md_path.write_text(markdown(record))

    write()
    root = resolve_data_root(args.data_root).resolve()
    by_name = {t.name: t for t in timings}
    for name in names:
        t0 = time.monotonic()
        group, _, strategy = name.partition("/")
        cap = TESTS_CAP_S if name == "tests" else by_name[group].cap_s
        seconds = min(cap, args.budget - (t0 - start))
        if seconds < MIN_CASE_S:
            result = {"status": "not_run", "reason": f"the budget ({args.budget:.0f} s) was spent"}
        elif name == "tests":
            result = tests_case(seconds)
        else:
            result = timing_case(by_name[group], strategy, args.device, root, seconds)
        try:  # a diverged measurement is a failure, never a number
            json.dumps(result, allow_nan=False)
        except ValueError:
            result = {"status": "error", "reason": "non-finite numbers in the measurement"}
        record["cases"][name] = {**result, "case_s": time.monotonic() - t0}
        write()
        print(f"{name}: {result['status']} {json.dumps(result)[:300]}", flush=True)
    record["finished"] = True
    write()
    print(f"wrote {json_path} and {md_path}")
    return int(any(c["status"] not in ("ok", "skipped") for c in record["cases"].values()))


if __name__ == "__main__":
    sys.exit(main())
