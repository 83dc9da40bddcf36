"""Which posterior gives a leave-one-out estimate that tracks the test set, on one task of a
checkpoint: the last-layer full Laplace-GGN (``fromp-memorable --map``'s default) against a
diagonal Laplace-GGN over all weights (with and without the example's own curvature removed),
over a grid of prior precisions and the Laplace evidence's choice, fitted on all of the
task's training examples.

    python -m benchmarks.studies.loo_posteriors CHECKPOINT --task T \\
        --out benchmarks/results/loo_posteriors_NAME.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

from benchmarks.cli import _test_metrics, load_trained
from fromp.laplace import laplace, optimize_prior_precision
from fromp.models import with_task
from fromp.sensitivity import last_layer_loo, memory_perturbation


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.loo_posteriors")
    p.add_argument("checkpoint")
    p.add_argument("--task", type=int, required=True)
    p.add_argument("--deltas", default="1e-3,0.01,0.1,1,10")
    p.add_argument("--data-root", default=None)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    net, seq, cfg = load_trained(args.checkpoint, args.data_root)
    task = seq[args.task]
    model = with_task(net, task.task_id if seq.multi_head else None)
    x, y = task.train_x, task.train_y
    evidence = float(optimize_prior_precision(model, (x, y), "categorical"))
    deltas = [evidence] + [float(d) for d in args.deltas.split(",")]
    rows = []
    for d in deltas:
        ll = last_layer_loo(model, x, y, d).perturbation.loo_summary()
        rows.append({"posterior": "last-layer full", "delta": d, **ll})
        q = laplace(model, (x, y), "categorical", d)
        for cov, corr in (("diagonal", False), ("full", True)):
            s = memory_perturbation(model, q, x, y, covariance=cov, correction=corr).loo_summary()
            name = "diagonal all weights" + (", own curvature removed" if corr else "")
            rows.append({"posterior": name, "delta": d, **s})
        for r in rows[-3:]:
            print(f"{r['posterior']:45s} δ={d:.3g}: LOO NLL {r['loo_nll']:.4f}, "
                  f"accuracy {100 * r['loo_accuracy']:.2f} %", flush=True)  # fmt: skip
    payload = {
        "command": "python -m benchmarks.studies.loo_posteriors "
        + shlex.join(sys.argv[1:] if argv is None else argv),
        "checkpoint_config": {k: v for k, v in cfg.items() if k != "data"},
        "task": args.task,
        "n_train": len(y),
        "evidence_delta": evidence,
        **_test_metrics(model, task),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")
    print(f"test: NLL {payload['test_nll']:.4f}, accuracy {100 * payload['test_accuracy']:.2f} %")
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(True)
    sys.exit(main())
