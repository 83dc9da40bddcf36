"""``python -m fromp_bench`` / ``fromp-bench``: run continual-learning benchmarks.

Examples::

    fromp-bench split-mnist --strategies fromp,ewc,vcl,naive --seeds 3
    fromp-bench permuted-mnist --strategies fromp --seeds 1 --data-root ../shared/data
    fromp-bench split-mnist --strategies fromp --resume        # continue a killed run
    fromp-bench demo                                            # the README's main job
    fromp-bench --list
    fromp-bench split-mnist --strategies fromp --grid tau=10,30 --valid-fraction 0.1 \\
        --select-on validation                                  # select on validation
    fromp-bench sweep split-digits --strategies naive,ewc --seeds 2   # the same on Ray Tune

Exit status: 0 done; 2 a usage, data or checkpoint error (one line); 3 a run failed (a
non-finite loss, weight or prediction; listed in the report, never in the table); 130
interrupted by Ctrl-C or SIGTERM (the message says how to resume; the lock is released).

Writes ``<out>/<benchmark>/results.json`` (every run and the aggregate), ``report.md`` and
``accuracy.png``; checkpoints go to ``<out>/<benchmark>/checkpoints/``. The command line
lives in :mod:`fromp_bench.command`, the sweep in :mod:`fromp_bench.sweep`; this module only
dispatches, so that neither imports the other's entry point.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from fromp_bench.command import (
    USER_ERRORS,
    _list,
    build_parser,
    check_args,
    demo,
    parse_strategies,
    report_only,
    run_benchmark,
    run_options,
)
from fromp_bench.registry import get_benchmark, get_strategy
from fromp_bench.sweep import sweep_main

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 done, 2 a usage, data or checkpoint error (one line on stderr), 3 a run
    failed (non-finite loss, weights or predictions), 130 interrupted (Ctrl-C or SIGTERM)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sweep"]:
        return sweep_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        try:
            print(_list(), flush=True)
        except BrokenPipeError:  # `fromp-bench --list | head`
            sys.stdout = open(os.devnull, "w")
        return 0
    if args.benchmark is None:
        parser.error("a benchmark name is required (or --list)")
    out = Path(args.out)
    # SIGTERM (a job scheduler, kill) ends the job as Ctrl-C does (as the sweep's): the lock
    # is released, the message says how to resume, the exit status is 130
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if on_main else None
    try:
        return _main(args, out)
    finally:
        if on_main:
            signal.signal(signal.SIGTERM, previous)


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _interrupted(args: argparse.Namespace, out: Path) -> None:
    where = out / (args.benchmark or "") / "checkpoints"
    print(
        f"\nfromp-bench: interrupted; finished tasks are checkpointed in {where}; run the "
        "same command with --resume to continue",
        file=sys.stderr,
    )


def _main(args: argparse.Namespace, out: Path) -> int:
    try:
        check_args(args)
        if args.benchmark == "demo":
            payload = demo(args)
            return 3 if payload["failed"] else 0
        get_benchmark(args.benchmark)
        if args.report_only:
            report_only(args.benchmark, out, args.select_on)
            return 0
        names = parse_strategies(args.strategies)
        for n in names:
            get_strategy(n)
        payload = run_benchmark(
            args.benchmark,
            names,
            **run_options(args),
            stop_after=args.stop_after,
            progress=not args.no_progress,
        )
    except USER_ERRORS as err:
        print(f"fromp-bench: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        _interrupted(args, out)
        return 130
    if payload["failed"]:
        print(
            f"fromp-bench: {len(payload['failed'])} run(s) failed (non-finite values); they "
            "are listed in the report and left out of the table",
            file=sys.stderr,
        )
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
