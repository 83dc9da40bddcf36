"""FROMP's defaults on one head: permuted MNIST through the Avalanche strategy, as a user runs it.

``n_tasks`` permuted-MNIST tasks (the first unpermuted; ``--n-train`` training and
``--n-test`` test examples each), an MLP 784-100-100 with one 10-way head, Adam 10⁻³,
batches of 128, ``--epochs`` epochs per task. Naive against ``FROMP`` with its defaults
(the kept function chosen from the head's layout, here the logits since every task fills
the one head; τ = 10, 40 points per task, prior precision 10⁻³, jitter 10⁻⁶, curvature on
1,000 examples, no clipping) and with only the kept function or τ changed (``CONFIGS``;
``fromp-probs``: the paper's probabilities, the default before ``function="auto"``).
Records the accuracy matrix (row ``j``: every task's test accuracy after task ``j``), the
mean after the last task and whether the dominance warning fired.

    python -m studies.one_head_defaults --data-root DATA \\
        --out benchmarks/results/one_head_defaults.json
"""

from __future__ import annotations

import json
import time
import warnings
from typing import Any

import torch
from avalanche.evaluation.metrics import accuracy_metrics
from avalanche.training import Naive
from avalanche.training.plugins import EvaluationPlugin
from fromp_avalanche.fromp import FROMP
from fromp_avalanche.models import as_avalanche_model
from fromp_bench.data import permuted_mnist, to_avalanche

from fromp.models import MultiHeadMLP
from studies import harness
from studies.avalanche_models import check_trained

#: FROMP's keyword arguments per configuration (None: Naive); everything else is the default
CONFIGS: dict[str, dict[str, Any] | None] = {
    "naive": None,
    "fromp-defaults": {},
    "fromp-probs": {"function": "probs"},
    "fromp-logits-tau10": {"function": "logits"},
    "fromp-logits-tau1": {"function": "logits", "tau": 1.0},
    "fromp-logits-tau0.3": {"function": "logits", "tau": 0.3},
}
PROTOCOL = {"lr": 1e-3, "train_mb_size": 128, "hidden": (100, 100)}


def run_one(name: str, scenario: Any, epochs: int, seed: int) -> dict[str, Any]:
    """Train ``CONFIGS[name]`` on every task of ``scenario`` in turn; the accuracy matrix (%)."""
    kw = CONFIGS[name]
    torch.manual_seed(seed)
    model = as_avalanche_model(MultiHeadMLP(784, PROTOCOL["hidden"], n_heads=1, head_size=10))
    common = dict(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=PROTOCOL["lr"]),
        train_mb_size=PROTOCOL["train_mb_size"],
        eval_mb_size=1000,
        train_epochs=epochs,
        evaluator=EvaluationPlugin(accuracy_metrics(experience=True), loggers=[]),
    )
    t0 = time.perf_counter()
    rows = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy = Naive(**common) if kw is None else FROMP(**common, **kw)
        # what the strategy was built with, read back from it (not from CONFIGS)
        applied = None if kw is None else {
            "function": strategy.plugin.method.function,
            "tau": strategy.plugin.method.tau,
            "n_points": strategy.plugin.method.n_points,
        }  # fmt: skip
        for j, exp in enumerate(scenario.train_stream):
            strategy.train(exp)
            check_trained(strategy, f"{name}, task {j + 1}")
            res = strategy.eval(scenario.test_stream)
            keys = sorted(k for k in res if k.startswith("Top1_Acc_Exp/eval_phase/test_stream"))
            rows.append([100 * float(res[k]) for k in keys])
        if applied is not None:  # "auto" is chosen at the first task: read what was kept
            applied["function"] = strategy.plugin.method.function
    dominance = [str(w.message) for w in caught if "dominates training" in str(w.message)]
    final = rows[-1]
    return {
        "name": name,
        "fromp_kwargs": kw,
        "applied": applied,
        "accuracy_matrix": rows,
        "mean_accuracy": sum(final) / len(final),
        "dominance_warning": dominance[:1],
        "seconds": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = harness.parser(__name__, __doc__)
    harness.add_data_root(parser)
    harness.add_out(parser, harness.RESULTS / "one_head_defaults.json")
    harness.add_seed(parser)
    parser.add_argument("--n-tasks", type=int, default=5)
    parser.add_argument("--n-train", type=int, default=60000)
    parser.add_argument("--n-test", type=int, default=10000)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = parser.parse_args(argv)
    for name in ("n_tasks", "n_train", "n_test", "epochs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    harness.prepare_out(args.out)
    seq = permuted_mnist(args.data_root, n_tasks=args.n_tasks, download=False)
    scenario = to_avalanche(seq.subsample(args.n_train, args.n_test, seed=args.seed))
    protocol = {**PROTOCOL, "n_tasks": args.n_tasks, "n_train": args.n_train,
                "n_test": args.n_test, "epochs": args.epochs, "seed": args.seed}  # fmt: skip
    runs = []
    for name in args.configs:
        runs.append(run_one(name, scenario, args.epochs, args.seed))
        print(json.dumps({k: runs[-1][k] for k in ("name", "mean_accuracy")}), flush=True)
        record = {"protocol": protocol, "runs": runs}
        harness.write_record(args.out, record, module=__name__, argv=argv)
    return runs


if __name__ == "__main__":
    main()
