"""FROMP on the 2-D toy problem of Pan et al. (2020), Fig. 1: five binary tasks of Gaussian
blobs learnt in sequence by one MLP with a single two-way head.

After each task the decision boundary is drawn for plain fine-tuning (Naive) and for FROMP
(memorable points marked with crosses). Naive forgets the earlier blobs; FROMP keeps them.

    python examples/fromp_toy.py --out fromp_toy.png

Settings follow the reference code (MLP 2-20-20-2 with sigmoid units, Adam lr 0.01, batch
20, 20 memorable points per task, tau = 1, prior precision 1e-4, jitter 1e-3); the number of
examples per blob and of epochs are reduced so that the script runs in under two minutes on
one CPU core.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
from torch import Tensor, nn

from fromp.continual.memorable import select_memorable
from fromp.continual.regularizer import FROMPRegularizer
from fromp.curvature.diagonal import diag_ggn_linear

# Blob centres and standard deviations of the reference toy data: task t has class 0 at
# CENTRES[t] and class 1 at CENTRES[t + 5].
CENTRES = [[0, 0.2], [0.6, 0.9], [1.3, 0.4], [1.6, -0.1], [2.0, 0.3],
           [0.45, 0], [0.7, 0.45], [1.0, 0.1], [1.7, -0.4], [2.3, 0.1]]  # fmt: skip
STDS = [[0.08, 0.22], [0.24, 0.08], [0.04, 0.2], [0.16, 0.05], [0.05, 0.16],
        [0.08, 0.16], [0.16, 0.08], [0.06, 0.16], [0.24, 0.05], [0.05, 0.22]]  # fmt: skip


def toy_tasks(n_per_blob: int = 200, seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    """Five tasks ``(x [2 n, 2], y [2 n])``, each one blob of class 0 and one of class 1."""
    g = torch.Generator().manual_seed(seed)
    tasks = []
    for t in range(5):
        xs, ys = [], []
        for cls, k in ((0, t), (1, t + 5)):
            mean, std = torch.tensor(CENTRES[k]), torch.tensor(STDS[k])
            xs.append(mean + std * torch.randn(n_per_blob, 2, generator=g))
            ys.append(torch.full((n_per_blob,), cls, dtype=torch.long))
        tasks.append((torch.cat(xs), torch.cat(ys)))
    return tasks


def make_net(hidden: int = 20) -> nn.Module:
    return nn.Sequential(
        nn.Linear(2, hidden), nn.Sigmoid(), nn.Linear(hidden, hidden), nn.Sigmoid(),
        nn.Linear(hidden, 2),
    )  # fmt: skip


def train_sequence(
    tasks: list[tuple[Tensor, Tensor]],
    *,
    fromp: bool,
    epochs: int = 80,
    batch_size: int = 20,
    lr: float = 0.01,
    tau: float = 1.0,
    n_points: int = 20,
    prior_precision: float = 1e-4,
    seed: int = 0,
    grid: Tensor | None = None,
) -> dict:
    """Learn the tasks in order; FROMP adds ``tau * R(w)`` (with Adam re-initialised per
    task, as in the reference code). Returns per-task accuracies after each task, the
    memorable points and, when ``grid`` is given, ``p(y = 1 | grid)`` after each task."""
    torch.manual_seed(seed)
    net = make_net()
    reg = FROMPRegularizer("per_class", jitter=1e-3)
    curvature = None
    memorable: list[Tensor] = []
    out: dict = {"accuracy": [], "grid_probs": [], "memorable": memorable}
    loss_fn = nn.CrossEntropyLoss()
    for x, y in tasks:
        opt = torch.optim.Adam(net.parameters(), lr=lr)
        for _ in range(epochs):
            for idx in torch.randperm(len(x)).split(batch_size):
                opt.zero_grad()
                loss = loss_fn(net(x[idx]), y[idx])
                if fromp and len(reg):
                    loss = loss + tau * reg.penalty(net).float()
                loss.backward()
                opt.step()
        net.eval()
        if fromp:
            sel = select_memorable(net, x, y, n_per_class=n_points // 2)
            memorable.append(x[sel])
            ggn = diag_ggn_linear(net, x, "categorical")
            curvature = ggn if curvature is None else curvature + ggn
            reg.add_task(net, x[sel], None, 1.0 / (curvature + prior_precision))
        with torch.no_grad():
            out["accuracy"].append(
                [float((net(xt).argmax(-1) == yt).float().mean()) for xt, yt in tasks]
            )
            if grid is not None:
                out["grid_probs"].append(torch.softmax(net(grid), -1)[:, 1].numpy())
        net.train()
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-per-blob", type=int, default=200)
    ap.add_argument("--epochs", type=int, default=80)
    ap.add_argument("--grid", type=int, default=150, help="grid points per axis")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="fromp_toy.png")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    tasks = toy_tasks(args.n_per_blob, args.seed)
    lo, hi = (-0.5, -1.0), (2.8, 1.5)
    gx, gy = np.meshgrid(np.linspace(lo[0], hi[0], args.grid), np.linspace(lo[1], hi[1], args.grid))
    grid = torch.tensor(np.stack([gx.ravel(), gy.ravel()], 1), dtype=torch.float32)
    runs = {
        name: train_sequence(tasks, fromp=name == "FROMP", epochs=args.epochs, seed=args.seed,
                             grid=grid)
        for name in ("Naive", "FROMP")
    }  # fmt: skip

    fig, axes = plt.subplots(2, 5, figsize=(17, 6.5), sharex=True, sharey=True)
    for row, (name, run) in enumerate(runs.items()):
        for t in range(5):
            ax = axes[row, t]
            probs = run["grid_probs"][t].reshape(args.grid, args.grid)
            ax.contourf(gx, gy, probs, levels=20, cmap="RdBu_r", vmin=0, vmax=1, alpha=0.6)
            ax.contour(gx, gy, probs, levels=[0.5], colors="k", linewidths=1.5)
            for s in range(t + 1):
                x, y = tasks[s]
                ax.scatter(*x[y == 0].numpy().T, s=2, c="C0")
                ax.scatter(*x[y == 1].numpy().T, s=2, c="C3")
                if run["memorable"]:
                    ax.scatter(
                        *run["memorable"][s].numpy().T, s=25, c="k", marker="x", linewidths=1
                    )
            acc = np.mean(run["accuracy"][t][: t + 1])
            ax.set_title(f"{name}, after task {t + 1}: acc {100 * acc:.1f}%", fontsize=9)
    fig.tight_layout()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    summary = {
        name: {"final_accuracies": run["accuracy"][-1], "mean": float(np.mean(run["accuracy"][-1]))}
        for name, run in runs.items()
    }
    summary["wall_time_s"] = time.perf_counter() - start
    summary["figure"] = str(out)
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
