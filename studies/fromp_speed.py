"""Cost of FROMP relative to plain fine-tuning (Naive) on the same split-MNIST stream.

Both strategies are trained in one process, one after the other, on the same Avalanche
stream with the same settings (by default the official code's split-MNIST settings,
:data:`fromp_bench.settings.FROMP_REFERENCE`, 40 memorable points per task;
``--settings default`` uses the runner's :data:`fromp_bench.settings.SETTINGS`; Naive uses the
same optimiser, epochs and batch size).
Reported: total training wall time of each, the ratio FROMP / Naive, and FROMP's per-task
cost of memorable-point selection, curvature (diagonal GGN) and kernel construction.

    python -m studies.fromp_speed --data-root $FROMP_DATA
    python -m studies.fromp_speed --n-train 2000 --epochs 2      # quick

Without MNIST (``--benchmark split-digits``) the built-in 8x8 digits are used.
"""

from __future__ import annotations

import json
import platform
import time
import warnings
from typing import Any

import torch
from avalanche.evaluation.metrics import accuracy_metrics
from avalanche.training import Naive
from avalanche.training.plugins import EvaluationPlugin
from fromp_avalanche.fromp import FROMP
from fromp_avalanche.models import as_avalanche_model
from fromp_bench.data import split_digits, split_mnist, to_avalanche
from fromp_bench.settings import FROMP_REFERENCE, SETTINGS

from fromp.models import MultiHeadMLP
from studies import harness


def _evaluator() -> EvaluationPlugin:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return EvaluationPlugin(accuracy_metrics(experience=True), loggers=[])


def measure(
    benchmark: str = "split-mnist",
    *,
    data_root: str | None = None,
    n_train: int | None = None,
    epochs: int | None = None,
    seed: int = 0,
    settings: str = "reference",
) -> dict[str, Any]:
    """Train Naive and FROMP on the same stream; return timings and final accuracies.
    ``settings``: ``"reference"`` (the official code's, 40 memorable points per task on split
    MNIST) or ``"default"`` (the runner's)."""
    seq = split_mnist(data_root, download=False) if benchmark == "split-mnist" else split_digits()
    if n_train is not None:
        seq = seq.subsample(n_train, None, seed=0)
    if settings not in ("reference", "default"):
        raise ValueError(f"settings must be 'reference' or 'default', got {settings!r}")
    d = (FROMP_REFERENCE if settings == "reference" else SETTINGS["fromp"])[benchmark]
    n_epochs = int(epochs if epochs is not None else d["train_epochs"])
    scenario = to_avalanche(seq)
    in_features = 1
    for s in seq.input_shape:
        in_features *= s
    out: dict[str, Any] = {}
    for name in ("naive", "fromp"):
        torch.manual_seed(seed)
        net = MultiHeadMLP(in_features, (256, 256), n_heads=len(seq), head_size=seq.n_outputs)
        model = as_avalanche_model(net)
        opt = torch.optim.Adam(model.parameters(), lr=d["lr"])
        common = dict(
            train_mb_size=d["train_mb_size"], train_epochs=n_epochs, evaluator=_evaluator()
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if name == "naive":
                strategy = Naive(model=model, optimizer=opt, **common)
            else:
                strategy = FROMP(model=model, optimizer=opt, **common, **d["kwargs"])
        per_task, per_task_cpu = [], []
        for exp in scenario.train_stream:
            t0, c0 = time.perf_counter(), time.process_time()
            strategy.train(exp)
            per_task.append(time.perf_counter() - t0)
            per_task_cpu.append(time.process_time() - c0)
        res = strategy.eval(scenario.test_stream)
        accs = [float(v) for k, v in sorted(res.items()) if k.startswith("Top1_Acc_Exp")]
        out[name] = {
            "train_wall_s": sum(per_task),
            "per_task_wall_s": per_task,
            "train_cpu_s": sum(per_task_cpu),
            "per_task_cpu_s": per_task_cpu,
            "final_accuracies": accs,
            "mean_accuracy": sum(accs) / len(accs),
        }
        if name == "fromp":
            out[name]["per_task_setup_s"] = strategy.plugin.method.timings
            setup = sum(sum(t.values()) for t in strategy.plugin.method.timings)
            out[name]["setup_total_s"] = setup
    out["ratio_fromp_over_naive"] = out["fromp"]["train_wall_s"] / out["naive"]["train_wall_s"]
    # process CPU time is less sensitive to other jobs on a shared machine
    out["cpu_ratio_fromp_over_naive"] = out["fromp"]["train_cpu_s"] / out["naive"]["train_cpu_s"]
    n_mem = [0, *[len(m.inputs) for m in strategy.plugin.method.regularizer.memories][:-1]]
    cum = [sum(n_mem[: i + 1]) for i in range(len(n_mem))]
    # forward/backward examples per iteration relative to Naive: 1 + (memorable points) / B
    out["expected_compute_ratio"] = sum(1 + c / d["train_mb_size"] for c in cum) / len(cum)
    out["settings"] = {
        "fromp_settings": settings,
        "benchmark": benchmark,
        "n_train_per_task": [len(t.train_x) for t in seq],
        "epochs": n_epochs,
        "lr": d["lr"],
        "train_mb_size": d["train_mb_size"],
        "fromp_kwargs": d["kwargs"],
        "seed": seed,
        "torch_threads": torch.get_num_threads(),
        "machine": platform.platform(),
    }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = harness.parser(__name__, __doc__)
    ap.add_argument("--benchmark", choices=["split-mnist", "split-digits"], default="split-mnist")
    harness.add_data_root(ap)
    ap.add_argument("--n-train", type=int, default=None, help="train examples per task")
    ap.add_argument("--epochs", type=int, default=None, help="default: FROMP's SETTINGS")
    harness.add_seed(ap)
    ap.add_argument(
        "--settings",
        choices=["reference", "default"],
        default="reference",
        help="FROMP settings: the official code's (default) or the runner's defaults",
    )
    harness.add_threads(ap, 1)
    harness.add_out(ap, harness.RESULTS / "fromp_speed.json")
    args = ap.parse_args(argv)
    harness.prepare_out(args.out)
    torch.set_num_threads(args.threads)
    result = measure(
        args.benchmark,
        data_root=args.data_root,
        n_train=args.n_train,
        epochs=args.epochs,
        seed=args.seed,
        settings=args.settings,
    )
    result = harness.write_record(args.out, result, module=__name__, argv=argv, indent=1)
    keys = ("ratio_fromp_over_naive", "cpu_ratio_fromp_over_naive", "expected_compute_ratio")
    print(json.dumps({k: result[k] for k in keys}, indent=1))
    naive, fromp = result["naive"]["train_wall_s"], result["fromp"]["train_wall_s"]
    print(f"naive {naive:.1f} s, fromp {fromp:.1f} s")
    return result


if __name__ == "__main__":
    main()
