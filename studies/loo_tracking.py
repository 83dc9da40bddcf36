"""Does the leave-one-out estimate track the test loss during training? MNIST, an MLP and a
small CNN, trained by Adam and by IVON; after each epoch :class:`fromp.memory.loo.LOOTracker`
estimates the leave-one-out NLL of the training set (Adam: a last-layer full Laplace-GGN with
delta = weight decay x N, refitted each epoch; IVON: its own posterior, over the output layer
and, on a fixed subset of the examples, over all weights) and the test NLL is measured.

    FROMP_DATA=... python -m studies.loo_tracking --n-train 10000 --epochs 12 \\
        --out benchmarks/results/loo_tracking_mnist.json

writes the per-epoch numbers, the Pearson correlation of LOO and test NLL across epochs and
the cost of the estimate relative to an epoch, and a plot next to the JSON (``.png``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch import nn

from fromp.memory.loo import LOOTracker
from fromp.optim import IVON
from studies import harness


def _load(root: str | None):
    from fromp_bench.data import load_mnist

    return load_mnist(root, download=False)


def _model(kind: str) -> nn.Module:
    if kind == "mlp":
        return nn.Sequential(
            nn.Flatten(), nn.Linear(784, 100), nn.ReLU(), nn.Linear(100, 100), nn.ReLU(),
            nn.Linear(100, 10),
        )  # fmt: skip
    return nn.Sequential(
        nn.Conv2d(1, 8, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 5), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 10),
    )  # fmt: skip


def _test(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    model.eval()
    with torch.no_grad():
        f = torch.cat([model(b) for b in x.split(2000)])
    model.train()
    nll = nn.functional.cross_entropy(f, y).item()
    return nll, (f.argmax(-1) == y).double().mean().item()


def _pearson(a: list[float], b: list[float]) -> float:
    return float(torch.corrcoef(torch.tensor([a, b], dtype=torch.float64))[0, 1])


def run_one(kind: str, optim: str, data, args) -> dict:
    x, y, xt, yt = data
    torch.manual_seed(args.seed)
    model = _model(kind)
    n = len(x)
    if optim == "adam":
        opt = torch.optim.Adam(model.parameters(), lr=args.adam_lr, weight_decay=args.wd)
    else:
        opt = IVON(
            model.parameters(), lr=args.ivon_lr, ess=n, hess_init=args.hess_init,
            prior_precision=args.wd * n,
        )  # fmt: skip
    trackers = {"loo": LOOTracker()}
    if optim == "ivon":
        trackers["loo_all"] = LOOTracker(subset_of_weights="all", max_examples=args.n_all)
    # "free": the output layer's inputs recorded during the epoch's own training passes, a
    # Kronecker last-layer Laplace for Adam (IVON: its own posterior), no extra pass;
    # "sub": the curvature from the recorded passes, the estimate on a fresh pass over a
    # fixed subset of --n-sub examples
    free = LOOTracker(hessian_structure="kron")
    part = LOOTracker(hessian_structure="kron")
    sub = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed))[: args.n_sub]
    epochs = []
    for epoch in range(args.epochs):
        g = torch.Generator().manual_seed(args.seed * 1000 + epoch)
        perm = torch.randperm(n, generator=g)
        start = time.perf_counter()
        model.train()
        with free.recording(model), part.recording(model):
            for i in range(0, n, args.batch_size):
                b = perm[i : i + args.batch_size]
                if optim == "adam":
                    opt.zero_grad()
                    out = model(x[b])
                    free.observe(y[b])
                    part.observe(y[b])
                    nn.functional.cross_entropy(out, y[b]).backward()
                else:
                    with opt.sampled_params(train=True):
                        opt.zero_grad()
                        out = model(x[b])
                        free.observe(y[b])
                        part.observe(y[b])
                        nn.functional.cross_entropy(out, y[b]).backward()
                opt.step()
        train_s = time.perf_counter() - start
        row = {"epoch": epoch + 1, "epoch_seconds": train_s}
        rec = free(model, optimizer=opt, epoch=epoch + 1)
        row |= {"loo_free_nll": rec["loo_nll"], "loo_free_accuracy": rec["loo_accuracy"]}
        row |= {"loo_free_seconds": rec["seconds"], "loo_free_posterior": rec["posterior"]}
        rec = part(model, x[sub], y[sub], opt, epoch=epoch + 1)
        row |= {"loo_sub_nll": rec["loo_nll"], "loo_sub_accuracy": rec["loo_accuracy"]}
        row |= {"loo_sub_seconds": rec["seconds"], "loo_sub_posterior": rec["posterior"]}
        for key, tr in trackers.items():
            rec = tr(model, x, y, opt, epoch=epoch + 1)
            row |= {f"{key}_nll": rec["loo_nll"], f"{key}_accuracy": rec["loo_accuracy"]}
            row |= {f"{key}_seconds": rec["seconds"], f"{key}_posterior": rec["posterior"]}
            row["train_nll"] = rec["train_nll"]
        row["test_nll"], row["test_accuracy"] = _test(model, xt, yt)
        epochs.append(row)
        print(
            f"{kind} {optim} epoch {epoch + 1}: LOO NLL {row['loo_nll']:.4f} test NLL "
            f"{row['test_nll']:.4f} train {row['train_nll']:.4f} (LOO {row['loo_seconds']:.2f} "
            f"s, epoch {train_s:.2f} s)",
            flush=True,
        )
    out = {"model": kind, "optimizer": optim, "epochs": epochs}
    test = [r["test_nll"] for r in epochs]
    for key in [*trackers, "loo_free", "loo_sub"]:
        out[f"pearson_{key}_test_nll"] = _pearson([r[f"{key}_nll"] for r in epochs], test)
        out[f"{key}_cost_over_epoch"] = sum(r[f"{key}_seconds"] for r in epochs) / sum(
            r["epoch_seconds"] for r in epochs
        )
    return out


def _plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(3.2 * len(runs), 3.0), squeeze=False)
    for ax, r in zip(axes[0], runs, strict=True):
        ep = [e["epoch"] for e in r["epochs"]]
        ax.plot(ep, [e["test_nll"] for e in r["epochs"]], "k-o", ms=3, label="test NLL")
        ax.plot(ep, [e["loo_nll"] for e in r["epochs"]], "C0-s", ms=3, label="LOO (last layer)")
        if "pearson_loo_all_test_nll" in r:
            ax.plot(ep, [e["loo_all_nll"] for e in r["epochs"]], "C1-^", ms=3, label="LOO (all)")
        if "pearson_loo_free_test_nll" in r:
            free = [e["loo_free_nll"] for e in r["epochs"]]
            ax.plot(ep, free, "C3--", label="LOO (recorded passes)")
        if "pearson_loo_sub_test_nll" in r:
            part = [e["loo_sub_nll"] for e in r["epochs"]]
            ax.plot(ep, part, "C4-.", label="LOO (recorded + subset)")
        ax.plot(ep, [e["train_nll"] for e in r["epochs"]], "C2:", label="train NLL")
        ax.set_title(
            f"{r['model']}, {r['optimizer']}: ρ={r['pearson_loo_test_nll']:.2f}", fontsize=9
        )
        ax.set_xlabel("epoch")
        ax.set_yscale("log")
    axes[0][0].set_ylabel("NLL")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__name__, __doc__)
    harness.add_data_root(p)
    p.add_argument("--n-train", type=int, default=10000)
    p.add_argument("--n-test", type=int, default=10000)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--models", default="mlp,cnn")
    p.add_argument("--optimizers", default="adam,ivon")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--adam-lr", type=float, default=1e-3)
    p.add_argument("--ivon-lr", type=float, default=0.2)
    p.add_argument("--hess-init", type=float, default=0.1)
    p.add_argument("--wd", type=float, default=1e-4, help="weight decay (both optimizers)")
    p.add_argument("--n-all", type=int, default=500, help="examples of the all-weights LOO")
    p.add_argument("--n-sub", type=int, default=500, help="examples of the subset estimate")
    harness.add_seed(p)
    harness.add_out(p)
    args = p.parse_args(argv)
    out = harness.prepare_out(args.out)
    x, y, xt, yt = _load(args.data_root)
    g = torch.Generator().manual_seed(args.seed)
    keep = torch.randperm(len(x), generator=g)[: args.n_train]
    data = (x[keep, None], y[keep], xt[: args.n_test, None], yt[: args.n_test])
    runs = []
    for kind in args.models.split(","):
        for optim in args.optimizers.split(","):
            runs.append(run_one(kind, optim, data, args))
            payload = {
                "config": vars(args),
                "runs": runs,
            }
            harness.write_record(out, payload, module=__name__, argv=argv)
            _plot(runs, Path(args.out).with_suffix(".png"))
    for r in runs:
        print(
            f"{r['model']} {r['optimizer']}: Pearson(LOO, test NLL) "
            f"{r['pearson_loo_test_nll']:.3f}, cost {100 * r['loo_cost_over_epoch']:.0f} % of "
            f"an epoch; recorded passes {r['pearson_loo_free_test_nll']:.3f}, cost "
            f"{100 * r['loo_free_cost_over_epoch']:.1f} %; recorded + subset "
            f"{r['pearson_loo_sub_test_nll']:.3f}, cost {100 * r['loo_sub_cost_over_epoch']:.1f} %"
            + (
                f"; all weights {r['pearson_loo_all_test_nll']:.3f}"
                if "pearson_loo_all_test_nll" in r
                else ""
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
