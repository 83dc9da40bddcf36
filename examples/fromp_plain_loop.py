"""FROMP in a plain PyTorch loop: split digits (scikit-learn's 8x8 digits, no download) as
five two-class tasks, one head per task, learnt in sequence by one MLP.

The loop drives :class:`fromp.FROMPMethod` through the continual-method protocol
(``begin_task``, ``loss_terms``, ``before_update``, ``learn_task``): the same calls the
Avalanche strategy ``fromp_avalanche.FROMP`` and the benchmark runner make, so this loop runs
their algorithm (tau R on the memorable past, the gradient clipping at tau *
grad_clip_norm, and, when asked for, the coreset's loss and the context term). The same
loop with tau = 0 is plain fine-tuning (Naive), for comparison.

    python examples/fromp_plain_loop.py            # about 15 s on one CPU core
    python examples/fromp_plain_loop.py --tau 0    # Naive
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from fromp import FROMPMethod
from fromp.models import MultiHeadMLP, with_task


def split_digits(seed: int = 0) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """Five tasks ``(x_train, y_train, x_test, y_test)`` of the digits pairs (0, 1), (2, 3),
    ...: pixels in [0, 1], labels 0 and 1 within each task, a quarter of each pair kept for
    testing."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target)
    g = torch.Generator().manual_seed(seed)
    tasks = []
    for t in range(5):
        idx = torch.nonzero((y == 2 * t) | (y == 2 * t + 1)).squeeze(1)
        idx = idx[torch.randperm(len(idx), generator=g)]
        n_test = len(idx) // 4
        xt, yt = x[idx], (y[idx] - 2 * t).long()
        tasks.append((xt[n_test:], yt[n_test:], xt[:n_test], yt[:n_test]))
    return tasks


def accuracy(net: torch.nn.Module, task: int, x: Tensor, y: Tensor) -> float:
    net.eval()
    with torch.no_grad():
        out = with_task(net, task)(x)
    net.train()
    return float((out.argmax(1) == y).float().mean())


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tau", type=float, default=1.0, help="FROMP's weight (0: Naive)")
    ap.add_argument("--n-points", type=int, default=20, help="memorable points per task")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    tasks = split_digits(args.seed)
    net = MultiHeadMLP(64, (100, 100), n_heads=5, head_size=2)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    method = FROMPMethod(
        tau=args.tau, n_points=args.n_points, grad_clip_norm=1.0, curvature_examples=None
    )
    for t, (x, y, _, _) in enumerate(tasks):
        method.begin_task(net, task=t, experience=t, ess=len(x), classes=[0, 1])
        head = with_task(net, t)
        for _ in range(args.epochs):
            perm = torch.randperm(len(x))
            for s in range(0, len(x), args.batch_size):
                i = perm[s : s + args.batch_size]
                out = head(x[i])
                loss = F.cross_entropy(out, y[i])
                loss = loss + method.loss_terms(net, x[i], out, task=t, loss=loss)
                opt.zero_grad()
                loss.backward()
                method.before_update(net, opt)  # the clipping at tau * grad_clip_norm
                opt.step()
        method.learn_task(net, x, y, t, optimizer=opt, experience=t)
        seen = [accuracy(net, s, xs, ys) for s, (_, _, xs, ys) in enumerate(tasks[: t + 1])]
        print(f"after task {t + 1}: " + " ".join(f"{100 * a:.1f}" for a in seen))
    final = [accuracy(net, s, xs, ys) for s, (_, _, xs, ys) in enumerate(tasks)]
    summary = {
        "tau": args.tau,
        "final_accuracies": final,
        "mean_accuracy": sum(final) / len(final),
        "task_count": method.task_count,
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
