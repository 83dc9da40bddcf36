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

After each task the record also holds the penalty step alone (``penalty(net)`` and its
backward, the best of ``--repeats`` timings, in milliseconds) of FROMP and EWC, and for FROMP
the number of memorable points, the network's own forward and backward on them (softmax,
sum of squares: the floor of a penalty on those points, same timing), and the phases of its
after-task step (memorable selection, curvature, kernels; ``FROMPMethod.learn_task``).
FROMP's penalty step after ``t`` tasks evaluates the network on the ``40 t`` memorable points,
so it grows with the points however the quadratic forms are batched; its after-task step
recomputes every earlier task's kernel under the new posterior, so it grows with the tasks
by design (``FROMPRegularizer.update``).

Example: ``nice -n 5 python -m studies.task_time --tasks 10 --steps 50``
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fromp.continual.ewc import EWCMethod
from fromp.continual.methods import FROMPMethod
from studies import harness
from studies.harness import RESULTS

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


def _best_ms(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``fn`` (after three untimed calls), milliseconds."""
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def _step(net: nn.Module, loss: Callable[[nn.Module], torch.Tensor]) -> Callable[[], None]:
    def run() -> None:
        net.zero_grad()
        loss(net).backward()

    return run


def measure(
    tasks: int,
    steps: int,
    n_train: int,
    batch: int,
    root: str | None,
    seed: int,
    repeats: int = 50,
) -> dict[str, Any]:
    """Per-task seconds of each method (training, after-task step, total), and after each
    task the penalty step alone (FROMP, EWC), FROMP's memorable points, the network's
    forward and backward on them and FROMP's after-task phases."""
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
    after: dict[str, list[float]] = {
        k: []
        for k in (
            "fromp_penalty_step_ms",
            "ewc_penalty_step_ms",
            "fromp_memorable_points",
            "fromp_forward_backward_ms",
            "fromp_select_s",
            "fromp_curvature_s",
            "fromp_kernel_s",
        )
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
                phases = fromp.learn_task(net, x, y, None)
                for k in ("select_s", "curvature_s", "kernel_s"):
                    after[f"fromp_{k}"].append(phases[k])
            elif m == "ewc":
                ewc.learn_task(net, x, y, None)
            t2 = time.perf_counter()
            times[m]["train_s"].append(t1 - t0)
            times[m]["after_task_s"].append(t2 - t1)
            times[m]["total_s"].append(t2 - t0)
        x_mem = torch.cat([ms.inputs for ms in fromp.regularizer.memories])
        after["fromp_memorable_points"].append(len(x_mem))
        after["fromp_penalty_step_ms"].append(
            _best_ms(_step(nets["fromp"], fromp.penalty), repeats)
        )
        after["ewc_penalty_step_ms"].append(_best_ms(_step(nets["ewc"], ewc.penalty), repeats))
        after["fromp_forward_backward_ms"].append(
            _best_ms(
                _step(nets["fromp"], lambda n, x=x_mem: n(x).softmax(-1).square().sum()), repeats
            )
        )
    out: dict[str, Any] = {"per_task": times, "after_each_task": after}
    out.update({"ratio_to_naive": {}, "growth": {}})
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
    # the penalty step after the last task over after the first (issue: within 1.5x)
    out["penalty_step_growth"] = {
        m: after[f"{m}_penalty_step_ms"][-1] / after[f"{m}_penalty_step_ms"][0]
        for m in ("fromp", "ewc")
    }
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(__name__, __doc__)
    ap.add_argument("--tasks", type=int, default=10)
    ap.add_argument("--steps", type=int, default=50, help="Adam steps per task")
    ap.add_argument("--n-train", type=int, default=1000, help="training examples per task")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument(
        "--repeats", type=int, default=50, help="timings of each penalty step (the best kept)"
    )
    harness.add_data_root(ap)
    harness.add_seed(ap)
    harness.add_threads(ap, 1)
    harness.add_out(ap, RESULTS / "task_time.json")
    args = ap.parse_args(argv)
    for name in ("tasks", "steps", "n_train", "batch_size", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    harness.prepare_out(args.out)
    harness.set_threads(args.threads)
    res = measure(
        args.tasks,
        args.steps,
        args.n_train,
        args.batch_size,
        args.data_root,
        args.seed,
        args.repeats,
    )
    record = {
        "tasks": args.tasks,
        "steps": args.steps,
        "n_train": args.n_train,
        "batch_size": args.batch_size,
        "repeats": args.repeats,
        "data": "mnist" if args.data_root else "synthetic",
        **res,
    }
    for m in METHODS:
        tot = ", ".join(f"{v:.2f}" for v in res["per_task"][m]["total_s"])
        print(f"{m}: per-task s {tot}; median x{res['ratio_to_naive_median'][m]:.2f} Naive")
    for m in ("fromp", "ewc"):
        ms = ", ".join(f"{v:.2f}" for v in res["after_each_task"][f"{m}_penalty_step_ms"])
        print(f"{m}: penalty step ms after each task {ms}")
    return harness.write_record(args.out, record, module=__name__, argv=argv)


if __name__ == "__main__":
    main()
