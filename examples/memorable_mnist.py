"""The most and least memorable MNIST training images of each class (FROMP's Fig. 2 idea).

A small MLP is trained briefly on (a subset of) MNIST; every training image is scored by
``tr Lambda(x) = sum_k p_k (1 - p_k)`` (:func:`fromp.continual.memorable.memorability_scores`) and,
per class, the ``k`` highest-scoring images (hard, near the decision boundary: what FROMP keeps)
and the ``k`` lowest-scoring ones (prototypical, confidently classified) are drawn in a grid.

    FROMP_DATA=/path/to/data python examples/memorable_mnist.py --out memorable_mnist.png

``--dataset digits`` uses scikit-learn's 8x8 digits instead (no download).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from torch import Tensor, nn

from fromp.continual.memorable import memorability_scores, select_memorable


def load(dataset: str, data_root: str | None, n_train: int, seed: int) -> tuple[Tensor, Tensor]:
    """Training images ``[N, H, W]`` in [0, 1] and labels ``[N]`` (random subset)."""
    if dataset == "mnist":
        from fromp_bench.data import load_mnist

        x, y, _, _ = load_mnist(data_root, download=False)
    elif dataset == "digits":
        from sklearn.datasets import load_digits

        d = load_digits()
        x = torch.as_tensor(d.images, dtype=torch.float32) / 16.0
        y = torch.as_tensor(d.target, dtype=torch.long)
    else:
        raise ValueError(f"dataset must be 'mnist' or 'digits', got {dataset!r}")
    idx = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))[:n_train]
    return x[idx], y[idx]


def train_mlp(x: Tensor, y: Tensor, *, epochs: int, hidden: int = 100, seed: int = 0) -> nn.Module:
    """A two-hidden-layer ReLU MLP trained with Adam (lr 1e-3, batch 128)."""
    torch.manual_seed(seed)
    d = x[0].numel()
    net = nn.Sequential(
        nn.Flatten(), nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, 10),
    )  # fmt: skip
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    for _ in range(epochs):
        for idx in torch.randperm(len(x)).split(128):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
            opt.step()
    return net.eval()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", choices=["mnist", "digits"], default="mnist")
    ap.add_argument("--data-root", default=None, help="default: $FROMP_DATA or ./data")
    ap.add_argument("--n-train", type=int, default=10000)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--k", type=int, default=8, help="images per class and kind")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="memorable_mnist.png")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    x, y = load(args.dataset, args.data_root, args.n_train, args.seed)
    net = train_mlp(x, y, epochs=args.epochs, seed=args.seed)
    with torch.no_grad():
        accuracy = float((net(x).argmax(-1) == y).float().mean())
    scores = memorability_scores(net, x)
    most = select_memorable(net, x, y, n_per_class=args.k, order="descending").view(10, args.k)
    least = select_memorable(net, x, y, n_per_class=args.k, order="ascending").view(10, args.k)

    fig, axes = plt.subplots(10, 2 * args.k + 1, figsize=(0.8 * (2 * args.k + 1), 8.5))
    for c in range(10):
        row = [*most[c].tolist(), None, *least[c].tolist()]
        for j, i in enumerate(row):
            ax = axes[c, j]
            ax.axis("off")
            if i is not None:
                ax.imshow(x[i].reshape(x.shape[-2:]).numpy(), cmap="gray_r", vmin=0, vmax=1)
                ax.set_title(f"{float(scores[i]):.2f}", fontsize=6, pad=1)
    axes[0, 0].text(0, -12, "most memorable (largest tr Lambda)", fontsize=9)
    axes[0, args.k + 1].text(0, -12, "least memorable (smallest tr Lambda)", fontsize=9)
    fig.subplots_adjust(hspace=0.45, wspace=0.05, top=0.93, bottom=0.01, left=0.01, right=0.99)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    summary = {
        "dataset": args.dataset,
        "n_train": len(x),
        "train_accuracy": accuracy,
        "mean_score_most": float(scores[most].mean()),
        "mean_score_least": float(scores[least].mean()),
        "figure": str(out),
        "wall_time_s": time.perf_counter() - start,
    }
    print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
