"""Cost of VCL relative to Naive on Avalanche's ``MTSimpleCNN``, per experience and per
evaluation, in one process.

Task-incremental split MNIST (labels 0, 1 in each experience, one two-unit head per task;
pixels repeated to the three channels ``MTSimpleCNN`` takes), ``--n-train`` examples per
experience, Adam, one epoch. For each repeat, Naive and VCL (its defaults) are built afresh
on the same seed and each trains experiences 0 and 1 and evaluates on both test
experiences, at a large and at a small evaluation batch; the wall times of each step are
recorded and the ratios VCL / Naive taken per repeat (median over repeats reported).
Experience 0 of VCL includes its maximum-likelihood fit of the means (``ml_init_epochs``,
default the strategy's ``train_epochs``), as in the reference code.

    python -m studies.vcl_cost --data-root $FROMP_DATA --out /tmp/vcl_cost.json
"""

from __future__ import annotations

import json
import os
import statistics
import time
import warnings
from typing import Any

import torch
from avalanche.benchmarks.classic import SplitMNIST
from avalanche.models import MTSimpleCNN
from avalanche.training import Naive
from fromp_avalanche.vcl import VCL
from torchvision import transforms as T

from studies import harness


def _streams(data_root: str | None, n_train: int, n_test: int) -> tuple[list, list]:
    """Experiences 0 and 1 of Avalanche's ``SplitMNIST`` (labels from zero in each, images
    standardised and repeated over three channels), ``n_train`` / ``n_test`` examples each
    (a seeded draw)."""
    tf = T.Compose([T.Normalize((0.1307,), (0.3081,)), T.Lambda(lambda x: x.repeat(3, 1, 1))])
    bm = SplitMNIST(
        n_experiences=5,
        return_task_id=True,
        class_ids_from_zero_in_each_exp=True,
        seed=0,
        dataset_root=data_root,
        train_transform=tf,
        eval_transform=tf,
    )
    g = torch.Generator().manual_seed(0)
    out = []
    for stream, n in ((bm.train_stream, n_train), (bm.test_stream, n_test)):
        exps = []
        for e in list(stream)[:2]:
            keep = torch.randperm(len(e.dataset), generator=g)[:n].tolist()
            e.dataset = e.dataset.subset(keep)
            exps.append(e)
        out.append(exps)
    return out[0], out[1]


def _timed(fn, *args: Any) -> float:
    """Wall seconds of ``fn(*args)``."""
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def measure(
    data_root: str | None,
    *,
    n_train: int = 1000,
    n_test: int = 500,
    repeats: int = 3,
    small_eval_mb: int = 16,
    seed: int = 0,
) -> dict[str, Any]:
    """Times of Naive and VCL per step and their ratios (see the module docstring)."""
    train, test = _streams(data_root, n_train, n_test)
    steps = ("train_exp0", "train_exp1", "eval_mb1000", f"eval_mb{small_eval_mb}")
    times: dict[str, dict[str, list[float]]] = {n: {s: [] for s in steps} for n in ("naive", "vcl")}
    for _ in range(repeats):
        for name in ("naive", "vcl"):
            torch.manual_seed(seed)
            model = MTSimpleCNN()
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            common = dict(train_mb_size=128, train_epochs=1, eval_mb_size=1000, evaluator=None)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if name == "naive":
                    strategy = Naive(model=model, optimizer=opt, **common)
                else:
                    strategy = VCL(model=model, optimizer=opt, seed=seed, **common)
            rec = times[name]
            rec["train_exp0"].append(_timed(strategy.train, train[0]))
            rec["train_exp1"].append(_timed(strategy.train, train[1]))
            rec["eval_mb1000"].append(_timed(strategy.eval, test))
            strategy.eval_mb_size = small_eval_mb
            rec[f"eval_mb{small_eval_mb}"].append(_timed(strategy.eval, test))
    ratios = {
        s: statistics.median(v / n for v, n in zip(times["vcl"][s], times["naive"][s]))
        for s in steps
    }
    return {
        "seconds": times,
        "ratio_vcl_over_naive": ratios,
        "settings": {
            "n_train_per_experience": n_train,
            "n_test_per_experience": n_test,
            "repeats": repeats,
            "seed": seed,
            "model": "MTSimpleCNN",
            "train_mb_size": 128,
            "epochs": 1,
        },
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = harness.parser(__name__, __doc__)
    harness.add_data_root(ap)  # Avalanche's MNIST files under it (MNIST/raw)
    ap.add_argument("--n-train", type=int, default=1000, help="train examples per experience")
    ap.add_argument("--n-test", type=int, default=500, help="test examples per experience")
    ap.add_argument("--repeats", type=int, default=3)
    harness.add_seed(ap)
    harness.add_threads(ap, 1)
    harness.add_out(ap, harness.RESULTS / "vcl_cost.json")
    args = ap.parse_args(argv)
    harness.prepare_out(args.out)
    torch.set_num_threads(args.threads)
    result = measure(
        args.data_root or os.environ.get("FROMP_DATA", "data"),
        n_train=args.n_train,
        n_test=args.n_test,
        repeats=args.repeats,
        seed=args.seed,
    )
    result = harness.write_record(args.out, result, module=__name__, argv=argv, indent=1)
    print(json.dumps(result["ratio_vcl_over_naive"], indent=1))
    return result


if __name__ == "__main__":
    main()
