"""Per-task time across permuted-MNIST tasks: Naive, FROMP and EWC in one plain loop.

A small MLP (784-100-100-10, one head) trains a fixed number of Adam steps on each of
``--tasks`` permuted tasks; after each task FROMP and EWC do their after-task step
(``FROMPMethod.learn_task``, ``EWCMethod.learn_task``). The record holds, per method and
task, the training seconds (the steps, penalty included), the after-task seconds and their
sum, and each method's per-task total over Naive's on the same task; the question is whether
a step's cost grows with the tasks learnt (issue: flat per-step cost). The data are
synthetic (10 Gaussian class prototypes in 784 dimensions, noise) unless ``--data-root``
names a torchvision MNIST folder. Methods run interleaved task by task, so that machine load
affects them alike.

Example: ``nice -n 5 python -m fromp_bench.studies.task_time --tasks 10 --steps 50``
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from fromp_bench.studies import harness
from fromp_bench.studies.harness import RESULTS
from torch import nn

from fromp.continual.ewc import EWCMethod
from fromp.continual.methods import FROMPMethod

METHODS = ("naive", "fromp", "ewc")


def _data(n: int, root: str | None, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` examples ``[n, 784]`` in [0, 1] and their labels: MNIST's first ``n`` training
    images from ``root``, else synthetic."""
    if root is not None:
        from torchvision.datasets import MNIST

        ds = MNIST(root, train=True, download=False)
        return ds.data[:n].reshape(n, -1).float() / 255, ds.targets[:n].clone()
    g = torch.Generator().manual_seed(seed)
    protos = torch.rand(10, 784, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    x = (protos[y] + 0.3 * torch.randn(n, 784, generator=g)).clamp(0, 1)
    return x, y


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10)
    )


def measure(
    tasks: int, steps: int, n_train: int, batch: int, root: str | None, seed: int
) -> dict[str, Any]:
    """Per-task seconds of each method (training, after-task step, total)."""
    x0, y = _data(n_train, root, seed)
    g = torch.Generator().manual_seed(seed + 1)
    perms = [torch.arange(784)] + [torch.randperm(784, generator=g) for _ in range(tasks - 1)]
    nets = {m: _net(seed) for m in METHODS}
    opts = {m: torch.optim.Adam(nets[m].parameters(), lr=1e-3) for m in METHODS}
    fromp = FROMPMethod(tau=10.0, n_points=40, curvature_examples=n_train)
    ewc = EWCMethod(ewc_lambda=640.0, batch_size=batch, max_examples=n_train)
    penalty: dict[str, Callable[[nn.Module], torch.Tensor] | None] = {
        "naive": None,
        "fromp": fromp.penalty,
        "ewc": ewc.penalty,
    }
    times: dict[str, dict[str, list[float]]] = {
        m: {"train_s": [], "after_task_s": [], "total_s": []} for m in METHODS
    }
    for perm in perms:
        x = x0[:, perm]
        order = torch.randperm(n_train, generator=g)
        for m in METHODS:
            net, opt, pen = nets[m], opts[m], penalty[m]
            t0 = time.perf_counter()
            for s in range(steps):
                idx = order[(s * batch) % n_train :][:batch]
                opt.zero_grad()
                loss = F.cross_entropy(net(x[idx]), y[idx])
                if pen is not None:
                    loss = loss + pen(net)
                loss.backward()
                opt.step()
            t1 = time.perf_counter()
            if m == "fromp":
                fromp.learn_task(net, x, y, None)
            elif m == "ewc":
                ewc.learn_task(net, x, y, None)
            t2 = time.perf_counter()
            times[m]["train_s"].append(t1 - t0)
            times[m]["after_task_s"].append(t2 - t1)
            times[m]["total_s"].append(t2 - t0)
    out: dict[str, Any] = {"per_task": times, "ratio_to_naive": {}, "growth": {}}
    for m in METHODS:
        out["ratio_to_naive"][m] = [
            a / b for a, b in zip(times[m]["total_s"], times["naive"]["total_s"])
        ]
        train = times[m]["train_s"]
        # training time of the last task over the first task's (1: flat)
        out["growth"][m] = train[-1] / train[0]
    out["ratio_to_naive_median"] = {
        k: statistics.median(v) for k, v in out["ratio_to_naive"].items()
    }
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(__name__, __doc__)
    ap.add_argument("--tasks", type=int, default=10)
    ap.add_argument("--steps", type=int, default=50, help="Adam steps per task")
    ap.add_argument("--n-train", type=int, default=1000, help="training examples per task")
    ap.add_argument("--batch-size", type=int, default=128)
    harness.add_data_root(ap)
    harness.add_seed(ap)
    harness.add_threads(ap, 1)
    harness.add_out(ap, RESULTS / "task_time.json")
    args = ap.parse_args(argv)
    for name in ("tasks", "steps", "n_train", "batch_size"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    harness.prepare_out(args.out)
    harness.set_threads(args.threads)
    res = measure(args.tasks, args.steps, args.n_train, args.batch_size, args.data_root, args.seed)
    record = {
        "tasks": args.tasks,
        "steps": args.steps,
        "n_train": args.n_train,
        "batch_size": args.batch_size,
        "data": "mnist" if args.data_root else "synthetic",
        **res,
    }
    for m in METHODS:
        tot = ", ".join(f"{v:.2f}" for v in res["per_task"][m]["total_s"])
        print(f"{m}: per-task s {tot}; median x{res['ratio_to_naive_median'][m]:.2f} Naive")
    return harness.write_record(args.out, record, module=__name__, argv=argv)


if __name__ == "__main__":
    main()
