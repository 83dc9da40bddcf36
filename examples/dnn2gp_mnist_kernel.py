"""DNN2GP on MNIST: the kernel a trained MLP induces, and its predictive variance off the data.

    python examples/dnn2gp_mnist_kernel.py [--data-root DIR] [--out outputs]

1. A small MLP (784-100-10) is trained briefly (Adam) on a subset of MNIST.
2. A diagonal Laplace-GGN posterior is fitted, with the prior precision chosen by the Laplace
   evidence (:func:`fromp.laplace.log_evidence_grid`).
3. DNN2GP (:func:`fromp.dnn2gp`) gives the kernel ``k(x, x') = J(x) Sigma J(x')^T``. Its
   per-class blocks on 100 test images sorted by class are shown summed over classes, raw
   and normalised to correlations (a block structure by class is expected).
4. The GP's marginal variance of the logits, ``tr Var[f(x)] / C``, is compared between MNIST
   test images and out-of-distribution inputs: Fashion-MNIST when it is in the data root,
   else MNIST digits rotated by 90 degrees, plus uniform noise images.

Without MNIST in the data root (``--data-root`` or ``$FROMP_DATA``), scikit-learn's 8x8
digits, upsampled to 28x28, stand in and the output says so. Writes
``<out>/dnn2gp_mnist_kernel.png``, ``<out>/dnn2gp_mnist_variance.png`` and
``<out>/dnn2gp_mnist_kernel.json``. About a minute on one CPU core with the defaults.
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
import torch.nn.functional as F
from fromp_bench.data import DataNotFoundError, load_fashion_mnist, load_mnist
from torch import Tensor

from fromp import dnn2gp, fit_laplace
from fromp.laplace.one_call import log_evidence_grid
from fromp.models import MultiHeadMLP


def _digits_28() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False)[:, 0]
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return x[:1400], y[:1400], x[1400:], y[1400:]


def load_data(data_root: str | None) -> tuple[tuple[Tensor, ...], str]:
    """``((x_train, y_train, x_test, y_test), source)``, images ``[N, 28, 28]`` in [0, 1]."""
    try:
        return load_mnist(data_root, download=False), "MNIST"
    except DataNotFoundError:
        print("MNIST not found: using scikit-learn's 8x8 digits upsampled to 28x28 instead.")
        return _digits_28(), "sklearn digits (MNIST not found)"


def ood_sets(data_root: str | None, x_test: Tensor, n: int) -> dict[str, Tensor]:
    """Out-of-distribution inputs ``[n, 28, 28]`` by name."""
    gen = torch.Generator().manual_seed(1)
    out = {}
    try:
        _, _, fashion, _ = load_fashion_mnist(data_root, download=False)
        out["Fashion-MNIST"] = fashion[:n]
    except DataNotFoundError:
        out["rotated digits (90°)"] = torch.rot90(x_test[:n], 1, dims=(1, 2))
    out["uniform noise"] = torch.rand(n, 28, 28, generator=gen)
    return out


def train(model: MultiHeadMLP, x: Tensor, y: Tensor, epochs: int, lr: float, batch: int) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=gen).split(batch):
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    model.eval()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-root", default=None, help="holds MNIST/raw (else $FROMP_DATA)")
    parser.add_argument("--out", default="outputs", help="output directory")
    parser.add_argument("--n-train", type=int, default=2000, help="training images")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--hidden", type=int, default=100)
    parser.add_argument("--n-kernel", type=int, default=100, help="test images in the heatmap")
    parser.add_argument("--n-var", type=int, default=300, help="images per variance histogram")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if min(args.n_train, args.epochs, args.n_kernel, args.n_var) < 1:
        parser.error("--n-train, --epochs, --n-kernel and --n-var must be >= 1")
    torch.manual_seed(args.seed)
    start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (x_tr, y_tr, x_te, y_te), source = load_data(args.data_root)
    x_tr, y_tr = x_tr[: args.n_train], y_tr[: args.n_train]
    print(f"data: {source}; training on {len(x_tr)} images")

    model = MultiHeadMLP(784, (args.hidden,), n_heads=1, head_size=10)
    train(model, x_tr, y_tr, args.epochs, args.lr, 128)
    with torch.no_grad():
        acc = float((model(x_te).argmax(-1) == y_te).float().mean())
    print(f"test accuracy {acc:.3f}")

    grid = torch.logspace(-2, 4, 25).tolist()
    deltas, evidence = log_evidence_grid(model, (x_tr, y_tr), "categorical", grid)
    delta = float(deltas[int(torch.argmax(evidence))])
    post = fit_laplace(model, x_tr, "categorical", delta)
    gp = dnn2gp(model, post, "categorical")
    print(f"prior precision (evidence, grid): {delta:.3g}")

    # kernel heatmap: n-kernel test images sorted by class
    n_k = min(args.n_kernel, len(x_te))
    order = torch.argsort(y_te[:n_k], stable=True)
    xk, yk = x_te[:n_k][order], y_te[:n_k][order]
    blocks = gp.kernel(xk, diagonal_outputs=True)  # [C, n, n]
    k_sum = blocks.sum(0)
    d = k_sum.diagonal().sqrt()
    corr = k_sum / (d[:, None] * d[None, :])
    same = yk[:, None] == yk[None, :]
    off = ~torch.eye(n_k, dtype=torch.bool)
    corr_same = float(corr[same & off].mean()) if (same & off).any() else float("nan")
    corr_diff = float(corr[~same].mean()) if (~same).any() else float("nan")
    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    for ax, mat, title in zip(
        axes, (k_sum, corr), ("sum_c K_c (per-class blocks)", "normalised (correlation)")
    ):
        im = ax.imshow(mat.numpy(), cmap="viridis")
        ax.set_title(f"DNN2GP kernel, {n_k} test images sorted by class\n{title}", fontsize=9)
        bounds = torch.nonzero(yk[1:] != yk[:-1])[:, 0] + 0.5
        for b in bounds.tolist():
            ax.axhline(b, color="w", lw=0.4)
            ax.axvline(b, color="w", lw=0.4)
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(out / "dnn2gp_mnist_kernel.png", dpi=110)
    plt.close(fig)

    # predictive variance in and out of distribution
    n_v = min(args.n_var, len(x_te))
    sets = {f"{source.split(' ')[0]} test": x_te[:n_v], **ood_sets(args.data_root, x_te, n_v)}
    variances = {}
    for name, xs in sets.items():
        v = gp.variance(xs)
        variances[name] = torch.diagonal(v, dim1=-2, dim2=-1).mean(-1)
    fig, ax = plt.subplots(figsize=(7, 4))
    lo = min(float(v.min()) for v in variances.values())
    hi = max(float(v.max()) for v in variances.values())
    bins = torch.logspace(torch.log10(torch.tensor(lo)), torch.log10(torch.tensor(hi)), 50)
    for name, v in variances.items():
        ax.hist(v.numpy(), bins=bins.numpy(), alpha=0.5, label=name)
    ax.set_xscale("log")
    ax.set_xlabel("GP marginal variance of the logits, tr Var[f(x)] / C")
    ax.set_ylabel("images")
    ax.set_title("DNN2GP predictive variance: in-distribution vs out-of-distribution")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "dnn2gp_mnist_variance.png", dpi=110)
    plt.close(fig)

    result = {
        "data": source,
        "n_train": len(x_tr),
        "test_accuracy": acc,
        "prior_precision": delta,
        "kernel_corr_same_class": corr_same,
        "kernel_corr_different_class": corr_diff,
        "median_variance": {k: float(v.median()) for k, v in variances.items()},
        "seconds": time.time() - start,
        "figures": [str(out / "dnn2gp_mnist_kernel.png"), str(out / "dnn2gp_mnist_variance.png")],
    }
    (out / "dnn2gp_mnist_kernel.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
