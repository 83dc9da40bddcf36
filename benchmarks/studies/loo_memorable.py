"""``fromp-memorable --map`` leave-one-out estimates against the test set, every task of a
checkpoint.

    python -m benchmarks.studies.loo_memorable CHECKPOINT [--tasks 0,1,...] \\
        [--posterior last-layer|diagonal] [--prior-precision trained|auto|X] [--n-fit N] \\
        --out benchmarks/results/loo_memorable_NAME.json

runs ``fromp-memorable CHECKPOINT --task T --map`` (its defaults unless given) for each task
and writes the table: estimated leave-one-out NLL and accuracy, test NLL and accuracy, their
ratio and difference, the posterior, delta and number of training examples used.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

from benchmarks.cli import load_trained, memorable_main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.loo_memorable")
    p.add_argument("checkpoint")
    p.add_argument("--tasks", default=None, help="comma-separated (default: every trained one)")
    p.add_argument("--posterior", default=None)
    p.add_argument("--prior-precision", default=None)
    p.add_argument("--n-fit", default=None)
    p.add_argument("--data-root", default=None)
    p.add_argument("--out", required=True, help="results JSON")
    args = p.parse_args(argv)
    _, seq, cfg = load_trained(args.checkpoint, args.data_root)
    tasks = (
        [int(t) for t in args.tasks.split(",")]
        if args.tasks
        else list(range(cfg.get("tasks_trained") or len(seq)))
    )
    extra: list[str] = []
    for flag in ("posterior", "prior_precision", "n_fit", "data_root"):
        value = getattr(args, flag)
        if value is not None:
            extra += ["--" + flag.replace("_", "-"), str(value)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for t in tasks:
            out = Path(tmp) / f"t{t}"
            cli = [args.checkpoint, "--task", str(t), "--map", "--out", str(out), *extra]
            if memorable_main(cli) != 0:
                return 2
            m = json.loads((out / "memory_map.json").read_text())
            loo = m["loo"]
            rows.append(
                {
                    "task": t,
                    "command": "fromp-memorable " + shlex.join(cli[:4] + extra),
                    "posterior": m["posterior"],
                    "prior_precision": m["prior_precision"],
                    "prior_precision_source": m["prior_precision_source"],
                    "n_fit": m["n_fit"],
                    "loo_nll": loo["loo_nll"],
                    "train_nll": loo["train_nll"],
                    "loo_accuracy": loo["loo_accuracy"],
                    "train_accuracy": loo["train_accuracy"],
                    "test_nll": m.get("test_nll"),
                    "test_accuracy": m.get("test_accuracy"),
                    "nll_ratio": loo["loo_nll"] / m["test_nll"] if "test_nll" in m else None,
                    "accuracy_gap_points": 100 * (loo["loo_accuracy"] - m["test_accuracy"])
                    if "test_accuracy" in m
                    else None,
                }
            )
    payload = {
        "command": "python -m benchmarks.studies.loo_memorable "
        + shlex.join(sys.argv[1:] if argv is None else argv),
        "checkpoint_config": {k: v for k, v in cfg.items() if k != "data"},
        "tasks": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")
    print("| task | LOO NLL | test NLL | ratio | LOO acc | test acc | gap (points) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['task']} | {r['loo_nll']:.4f} | {r['test_nll']:.4f} | {r['nll_ratio']:.2f} | "
            f"{100 * r['loo_accuracy']:.2f} | {100 * r['test_accuracy']:.2f} | "
            f"{r['accuracy_gap_points']:+.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
