"""FROMP, EWC and VCL in an ordinary Avalanche pipeline: SplitMNIST with task labels,
Avalanche's own MTSimpleMLP, an EvaluationPlugin with loggers, and a checkpoint taken after
each experience from which the run resumes exactly.

    python examples/avalanche_pipeline.py --data /path/to/data --epochs 1
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from avalanche.benchmarks.classic import SplitMNIST
from avalanche.evaluation.metrics import accuracy_metrics, loss_metrics
from avalanche.logging import InteractiveLogger, TextLogger
from avalanche.models import MTSimpleMLP
from avalanche.training.plugins import EvaluationPlugin
from fromp_avalanche.checkpoint import load_checkpoint, save_checkpoint
from fromp_avalanche.ewc import EWC
from fromp_avalanche.fromp import FROMP
from fromp_avalanche.vcl import VCL


def make_strategy(method: str, lr: float, epochs: int, loggers: list) -> object:
    torch.manual_seed(0)
    model = MTSimpleMLP()  # a MultiTaskModule: one head per task, grown by Avalanche
    evaluator = EvaluationPlugin(
        accuracy_metrics(experience=True, stream=True), loss_metrics(stream=True), loggers=loggers
    )
    common = dict(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=lr),
        train_mb_size=128,
        train_epochs=epochs,
        evaluator=evaluator,
    )
    if method == "fromp":
        return FROMP(tau=10.0, n_points=40, **common)
    if method == "ewc":
        return EWC(ewc_lambda=6400.0, **common)  # Avalanche's scale: (lambda / B) sum F d^2
    return VCL(train_samples=10, test_samples=10, **common)


def run(method: str, benchmark, out: Path, lr=1e-3, epochs=1, stop_after=None) -> dict:
    """Train ``method`` on every experience (the first ``stop_after`` only, as if
    interrupted), checkpointing after each; a checkpoint found in ``out`` is resumed from.
    Returns the final accuracy per experience."""
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / f"{method}_log.txt", "a")
    strategy = make_strategy(method, lr, epochs, [TextLogger(log), InteractiveLogger()])
    ckpt = out / f"{method}.pt"
    start = load_checkpoint(strategy, ckpt, benchmark.train_stream) if ckpt.exists() else 0
    for i, exp in enumerate(benchmark.train_stream):
        if i < start or (stop_after is not None and i >= stop_after):
            continue
        strategy.train(exp)
        save_checkpoint(strategy, ckpt, experiences_done=i + 1)
    results = strategy.eval(benchmark.test_stream)
    log.close()
    return {k: float(v) for k, v in results.items() if k.startswith("Top1_Acc_Exp")}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="folder holding MNIST/raw")
    parser.add_argument("--out", default="avalanche_pipeline_out")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--methods", nargs="+", default=["fromp", "ewc", "vcl"])
    args = parser.parse_args(argv)
    benchmark = SplitMNIST(  # labels 0, 1 in each task: one two-unit head per task
        n_experiences=5,
        return_task_id=True,
        class_ids_from_zero_in_each_exp=True,
        dataset_root=args.data,
    )
    results = {m: run(m, benchmark, Path(args.out), epochs=args.epochs) for m in args.methods}
    print(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
