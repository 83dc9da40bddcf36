"""``python -m benchmarks`` / ``fromp-bench``: run continual-learning benchmarks.

Examples::

    fromp-bench split-mnist --strategies fromp,ewc,vcl,naive --seeds 3
    fromp-bench permuted-mnist --strategies fromp --seeds 1 --data-root ../shared/data
    fromp-bench split-mnist --strategies fromp --resume        # continue a killed run
    fromp-bench demo                                            # the README's main job
    fromp-bench --list

Writes ``<out>/<benchmark>/results.json`` (every run and the aggregate), ``report.md`` and
``accuracy.png``; checkpoints go to ``<out>/<benchmark>/checkpoints/``.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from benchmarks.registry import (
    BENCHMARKS,
    STRATEGIES,
    UnknownNameError,
    get_benchmark,
    get_strategy,
)
from fromp.data import DataNotFoundError

# Avalanche imports an optional QP solver package that warns when no solver is installed.
warnings.filterwarnings("ignore", message="no QP solver found")

DEMO_STRATEGIES = ("fromp", "ewc", "vcl", "naive")
# For each demo slot, the strategies to try in order (the first installed one runs).
_DEMO_SLOTS = (("fromp",), ("ewc", "ewc-avalanche"), ("vcl",), ("naive",))


class UsageError(ValueError):
    """A command-line value that cannot be used."""


def _parse_set(items: list[str]) -> dict[str, Any]:
    """``key=value`` pairs; values are Python literals when they parse as one, else strings.
    Keys ``lr``, ``train_epochs``, ``train_mb_size``, ``optimizer`` set training settings; any
    other key is a keyword argument of the strategy class."""
    out: dict[str, Any] = {"kwargs": {}}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--set expects key=value, got {item!r}")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        if key in ("lr", "train_epochs", "train_mb_size", "optimizer"):
            out[key] = value
        else:
            out["kwargs"][key] = value
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fromp-bench",
        description="Run continual-learning benchmarks (FROMP, EWC, VCL, Naive, ...) on "
        "Avalanche and report accuracy, forgetting, NLL and calibration.",
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
    p.add_argument("--seeds", type=int, default=1, help="number of seeds 0..N-1 (default 1)")
    p.add_argument("--seed-offset", type=int, default=0, help="first seed (default 0)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default cpu)")
    p.add_argument("--data-root", default=None, help="data root (default: $FROMP_DATA or ./data)")
    p.add_argument("--out", default="runs", help="output directory (default ./runs)")
    p.add_argument("--resume", action="store_true", help="continue from checkpoints")
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
        help="override a setting or a strategy keyword argument, e.g. --set tau=10",
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


def run_benchmark(
    benchmark: str,
    strategies: list[str],
    *,
    seeds: list[int],
    out: Path,
    data_root: str | None = None,
    device: str = "cpu",
    overrides: dict[str, Any] | None = None,
    n_train: int | None = None,
    n_test: int | None = None,
    resume: bool = False,
    stop_after: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Run every (strategy, seed), then write the JSON, the Markdown report and the plot.

    Returns the payload written to ``results.json``.
    """
    from benchmarks.report import save_json
    from benchmarks.runner import RunConfig, load_sequence, run

    bench = get_benchmark(benchmark)
    specs = [get_strategy(s) for s in strategies]
    missing = [s.name for s in specs if not s.available()]
    if missing:
        raise UnknownNameError(f"strategy not installed: {', '.join(missing)}")
    load_sequence(bench, data_root, n_train, n_test)  # fail early on missing data
    base = out / benchmark
    results = []
    started = time.perf_counter()
    for spec in specs:
        for seed in seeds:
            ckpt = base / "checkpoints" / f"{spec.name}-seed{seed}.pt"
            cfg = RunConfig(
                benchmark,
                spec.name,
                seed,
                data_root,
                device,
                dict(overrides or {}),
                n_train,
                n_test,
                str(ckpt),
                resume,
                stop_after,
                progress,
            )
            res = run(cfg)
            results.append(res)
            save_json(base / "runs" / f"{spec.name}-seed{seed}.json", res)
            if res["complete"]:
                print(
                    f"{spec.name:14s} seed {seed}: {res['mean_accuracy']:.2f} % "
                    f"(per task: {', '.join(f'{a:.1f}' for a in res['final_accuracies'])}) "
                    f"in {res['wall_time_s']:.0f} s",
                    flush=True,
                )
            else:
                print(
                    f"{spec.name:14s} seed {seed}: stopped after {len(res['accuracy_matrix'])}"
                    " tasks (checkpointed; rerun with --resume)",
                    flush=True,
                )
    return write_report(
        benchmark,
        base,
        results,
        command=" ".join(["fromp-bench", *sys.argv[1:]]),
        total_time_s=time.perf_counter() - started,
    )


def write_report(bench_name: str, base: Path, results: list[dict[str, Any]], **extra: Any):
    """Aggregate ``results`` and write ``results.json``, ``report.md`` and ``accuracy.png``
    under ``base``; print the table. Returns the payload of ``results.json``."""
    from benchmarks.report import aggregate, markdown_report, plot_accuracy, save_json

    bench = get_benchmark(bench_name)
    agg = aggregate(results)
    payload = {"benchmark": bench_name, **extra, "aggregate": agg, "runs": results}
    save_json(base / "results.json", payload)
    if agg:
        report = markdown_report(bench, agg)
        (base / "report.md").write_text(report)
        plot_accuracy(bench, agg, base / "accuracy.png")
        print()
        print(report)
        times = ", ".join(f"{k} {v['wall_time_s']['mean']:.0f} s" for k, v in agg.items())
        print(f"wall time per run: {times}")
        print(f"results: {base / 'results.json'}, {base / 'report.md'}, {base / 'accuracy.png'}")
    return payload


def report_only(benchmark: str, out: Path) -> dict[str, Any]:
    """Rebuild the report of ``benchmark`` from ``<out>/<benchmark>/runs/*.json``."""
    base = out / benchmark
    files = sorted((base / "runs").glob("*.json"))
    if not files:
        raise UsageError(f"no run results in {base / 'runs'}")
    results = [json.loads(f.read_text()) for f in files]
    return write_report(benchmark, base, results, command="report of " + str(base / "runs"))


def demo(args: argparse.Namespace) -> dict[str, Any]:
    """The main job: FROMP, EWC, VCL and Naive on split MNIST, one seed, quick settings;
    Split-Digits when MNIST cannot be found or downloaded."""
    from benchmarks.runner import load_sequence

    benchmark = "split-mnist"
    try:
        load_sequence(get_benchmark(benchmark), args.data_root)
    except DataNotFoundError as err:
        first = str(err).split(". ")[0]
        print(f"demo: {first}; running the built-in Split-Digits benchmark instead.")
        benchmark = "split-digits"
    if args.strategies:
        names = args.strategies.split(",")
    else:
        names = []
        for slot in _DEMO_SLOTS:
            names += [s for s in slot if get_strategy(s).available()][:1]
    overrides = _overrides(args)
    if benchmark == "split-mnist":
        overrides.setdefault("train_epochs", 2)
    print(f"demo: {', '.join(names)} on {benchmark}, seed 0 (quick settings; see README)")
    return run_benchmark(
        benchmark,
        names,
        seeds=[args.seed_offset],
        out=Path(args.out),
        data_root=args.data_root,
        device=args.device,
        overrides=overrides,
        n_train=args.n_train,
        n_test=args.n_test,
        progress=not args.no_progress,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        print(_list())
        return 0
    if args.benchmark is None:
        parser.error("a benchmark name is required (or --list)")
    try:
        if args.benchmark == "demo":
            demo(args)
            return 0
        get_benchmark(args.benchmark)
        if args.report_only:
            report_only(args.benchmark, Path(args.out))
            return 0
        names = (args.strategies or ",".join(DEMO_STRATEGIES)).split(",")
        for n in names:
            get_strategy(n)
        if args.seeds < 1:
            raise UsageError(f"--seeds must be >= 1, got {args.seeds}")
        run_benchmark(
            args.benchmark,
            names,
            seeds=list(range(args.seed_offset, args.seed_offset + args.seeds)),
            out=Path(args.out),
            data_root=args.data_root,
            device=args.device,
            overrides=_overrides(args),
            n_train=args.n_train,
            n_test=args.n_test,
            resume=args.resume,
            stop_after=args.stop_after,
            progress=not args.no_progress,
        )
    except (UnknownNameError, DataNotFoundError, UsageError) as err:
        print(f"fromp-bench: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
