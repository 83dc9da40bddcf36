"""FROMP, EWC and VCL on Avalanche's own SplitMNIST and models, as a user would run them.

FROMP, EWC and VCL x {``MTSimpleMLP`` with ``return_task_id=True`` (multi-head, the labels
counted from zero in each experience: with Avalanche's global labels its heads differ in
width and the strategies refuse the padded heads), ``SimpleMLP`` with the default
arguments (one head, class-incremental)}, one epoch per experience on the first two
experiences of ``SplitMNIST(n_experiences=5, seed=0)``. Reports the test accuracy of
experience 0 after experience 0 and after experience 1, and of experience 1 after
experience 1, and the wall time.

    python -m studies.avalanche_models --data /path/to/data \\
        --out benchmarks/results/avalanche_models.json
"""

from __future__ import annotations

import json
import time

import torch
from avalanche.benchmarks.classic import SplitMNIST
from avalanche.evaluation.metrics import accuracy_metrics
from avalanche.models import MTSimpleMLP, SimpleMLP
from avalanche.training.plugins import EvaluationPlugin
from fromp_avalanche.ewc import EWC
from fromp_avalanche.fromp import FROMP
from fromp_avalanche.vcl import VCL

from studies import harness

SETTINGS = {
    "lr": 1e-3,
    "train_mb_size": 128,
    "train_epochs": 1,
    "fromp": {"tau": 10.0, "n_points": 40},
    "ewc": {"ewc_lambda": 6400.0},  # Avalanche's scale: (6400 / 128) sum F d^2, 0.3's 100
    "vcl": {"train_samples": 10, "test_samples": 100},
}


def _strategy(method: str, model: torch.nn.Module, device: str):
    evaluator = EvaluationPlugin(accuracy_metrics(experience=True), loggers=[])
    common = dict(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=SETTINGS["lr"]),
        train_mb_size=SETTINGS["train_mb_size"],
        train_epochs=SETTINGS["train_epochs"],
        eval_mb_size=1000,
        evaluator=evaluator,
        device=device,
    )
    cls = {"fromp": FROMP, "ewc": EWC, "vcl": VCL}[method]
    return cls(**common, **SETTINGS[method])


def _acc(results: dict, exp: int) -> float:
    (key,) = [k for k in results if k.startswith("Top1_Acc_Exp") and k.endswith(f"Exp{exp:03d}")]
    return float(results[key])


def check_trained(strategy, where: str) -> None:
    """Refuse (``RuntimeError``) a run whose last training loss or weights are not finite:
    a diverged run is a failed run, never a row of the table."""
    loss = getattr(strategy, "loss", None)
    if isinstance(loss, torch.Tensor) and not bool(torch.isfinite(loss).all()):
        raise RuntimeError(f"{where}: the training loss is not finite; the run diverged")
    for name, p in strategy.model.named_parameters():
        if not bool(torch.isfinite(p).all()):
            raise RuntimeError(f"{where}: weights {name} are not finite; the run diverged")


def run_one(method: str, model_name: str, data: str, device: str = "cpu", n_exp: int = 2):
    torch.manual_seed(0)
    multi = model_name == "MTSimpleMLP"
    bm = SplitMNIST(
        n_experiences=5,
        return_task_id=multi,
        class_ids_from_zero_in_each_exp=multi,
        seed=0,
        dataset_root=data,
    )
    model = MTSimpleMLP() if multi else SimpleMLP()
    strategy = _strategy(method, model, device)
    row = {"method": method, "model": model_name, "return_task_id": multi}
    t0 = time.perf_counter()
    test = list(bm.test_stream)[:n_exp]
    for e, exp in enumerate(list(bm.train_stream)[:n_exp]):
        strategy.train(exp)
        check_trained(strategy, f"{method} on {model_name}, experience {e}")
        res = strategy.eval(test[: e + 1])
        for s in range(e + 1):
            row[f"acc_exp{s}_after_exp{e}"] = _acc(res, s)
    row["seconds"] = time.perf_counter() - t0
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    parser = harness.parser(__name__, __doc__)
    parser.add_argument("--data", required=True, help="folder holding MNIST/raw")
    harness.add_out(parser, harness.RESULTS / "avalanche_models.json")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--methods", nargs="+", default=["fromp", "ewc", "vcl"])
    parser.add_argument("--models", nargs="+", default=["MTSimpleMLP", "SimpleMLP"])
    args = parser.parse_args(argv)
    harness.prepare_out(args.out)
    rows = []
    for model_name in args.models:
        for method in args.methods:
            rows.append(run_one(method, model_name, args.data, args.device))
            print(json.dumps(rows[-1]), flush=True)
            out = {"settings": SETTINGS, "benchmark": "SplitMNIST(n_experiences=5, seed=0)"}
            record = {**out, "runs": rows}
            harness.write_record(args.out, record, module=__name__, argv=argv, device=args.device)
    return rows


if __name__ == "__main__":
    main()
