"""DNN2GP on 1-D regression: a trained MLP becomes a GP through its Laplace posterior.

    python examples/dnn2gp_regression.py [--out outputs] [--epochs 3000] [--n 200]

1. Snelson-like data (generated here): a wiggly function observed with Gaussian noise
   (sigma = 0.25) on [-2, 5] with a gap in (1, 2.5).
2. An MLP 1-50-50-1 (tanh) is trained with Adam on the MAP objective
   ``sum_n nll_n + delta_0 / 2 ||w||^2``.
3. The prior precision is chosen by the Laplace evidence on a grid of ``delta``
   (:func:`fromp.laplace.optimize_prior_precision`, full GGN: the model is small) and, as a check,
   by gradient ascent.
4. Laplace posteriors (full GGN and its diagonal) give DNN2GP GPs; their predictive
   ``mean +- 2 sd`` (noise included) are plotted, as is ``log p(D | delta)`` against ``delta``
   with the chosen value marked.

Writes ``<out>/dnn2gp_regression.png``, ``<out>/dnn2gp_evidence.png`` and
``<out>/dnn2gp_regression.json``. Runs in well under a minute on one CPU core.
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

from fromp import dnn2gp, fit_laplace
from fromp.laplace.one_call import (
    log_evidence_grid,
    log_marginal_likelihood,
    optimize_prior_precision,
)
from fromp.likelihood import GaussianLikelihood

SIGMA = 0.25


def snelson_like(n: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    """``(x [n, 1], y [n])`` float64: ``y = sin(3x)/2 + 0.3 x + noise`` on [-2, 5] minus
    (1, 2.5), noise ``N(0, 0.25^2)``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.empty(0, dtype=torch.float64)
    while len(x) < n:
        cand = -2 + 7 * torch.rand(2 * n, generator=gen, dtype=torch.float64)
        x = torch.cat([x, cand[(cand < 1) | (cand > 2.5)]])
    x = x[:n].sort().values
    f = 0.5 * torch.sin(3 * x) + 0.3 * x
    y = f + SIGMA * torch.randn(n, generator=gen, dtype=torch.float64)
    return x.unsqueeze(1), y


def make_mlp(hidden: int = 50) -> nn.Module:
    return nn.Sequential(
        nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1)
    ).double()


def train_map(
    model: nn.Module, x: Tensor, y: Tensor, delta: float, epochs: int, lr: float
) -> list[float]:
    """Full-batch Adam on ``sum_n nll_n + delta/2 ||w||^2``; returns the loss curve."""
    lik = GaussianLikelihood(SIGMA)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs)
    losses = []
    for _ in range(epochs):
        opt.zero_grad()
        reg = sum((p**2).sum() for p in model.parameters())
        loss = lik.nll(model(x), y).sum() + 0.5 * delta * reg
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    return losses


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="outputs", help="output directory")
    parser.add_argument("--n", type=int, default=200, help="training points")
    parser.add_argument("--epochs", type=int, default=3000, help="Adam steps (full batch)")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--hidden", type=int, default=50)
    parser.add_argument("--delta0", type=float, default=1.0, help="prior precision for MAP")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.n < 2 or args.epochs < 1:
        parser.error("need --n >= 2 and --epochs >= 1")
    torch.manual_seed(args.seed)
    start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lik = GaussianLikelihood(SIGMA)
    x, y = snelson_like(args.n, args.seed)
    model = make_mlp(args.hidden)
    losses = train_map(model, x, y, args.delta0, args.epochs, args.lr)

    grid = torch.logspace(-3, 3, 61, dtype=torch.float64)
    choice = {}
    for curv in ("full", "diag"):
        _, vals = log_evidence_grid(model, (x, y), lik, grid, hessian_structure=curv)
        d = float(grid[int(vals.argmax())])
        choice[curv] = {"delta": d, "values": vals}
    delta = choice["full"]["delta"]
    delta_grad = optimize_prior_precision(
        model, (x, y), lik, "marglik", optimizer="lbfgs", hessian_structure="full"
    )
    post_full = fit_laplace(model, (x, y), lik, delta, hessian_structure="full")
    post_diag = fit_laplace(model, (x, y), lik, choice["diag"]["delta"])

    xs = torch.linspace(-3, 6, 300, dtype=torch.float64).unsqueeze(1)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    summary = {}
    posts = [("full GGN", post_full, delta), ("diagonal GGN", post_diag, choice["diag"]["delta"])]
    for ax, (name, post, d) in zip(axes, posts):
        gp = dnn2gp(model, post, lik)
        mean, var = gp.predictive(xs)
        sd = var[:, 0, 0].sqrt()
        sd_f = gp.variance(xs)[:, 0, 0].sqrt()
        m = mean[:, 0]
        ax.fill_between(xs[:, 0], m - 2 * sd, m + 2 * sd, alpha=0.25, label="mean ± 2 sd (y)")
        ax.fill_between(xs[:, 0], m - 2 * sd_f, m + 2 * sd_f, alpha=0.35, label="± 2 sd (f)")
        ax.plot(xs[:, 0], m, lw=2, label="GP mean = network")
        ax.scatter(x[:, 0], y, s=6, c="k", alpha=0.6, label="data")
        ax.axvspan(1, 2.5, color="grey", alpha=0.1)
        ax.set_title(f"DNN2GP, Laplace with {name}, δ = {d:.3g}")
        ax.set_xlabel("x")
        in_gap = (xs[:, 0] > 1.2) & (xs[:, 0] < 2.3)
        summary[name] = {
            "mean_sd_f_in_gap": float(sd_f[in_gap].mean()),
            "mean_sd_f_on_data": float(sd_f[(xs[:, 0] > -1.8) & (xs[:, 0] < 0.8)].mean()),
        }
    axes[0].set_ylabel("y")
    axes[0].legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "dnn2gp_regression.png", dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, curv, label in zip(axes, ("full", "diag"), ("full GGN", "diagonal GGN")):
        d, vals = choice[curv]["delta"], choice[curv]["values"]
        ax.semilogx(grid, vals, lw=2)
        ax.axvline(d, color="r", ls=":", label=f"chosen δ = {d:.3g} (grid max)")
        if curv == "full":
            ax.axvline(delta_grad, color="g", ls="--", lw=0.8, label=f"gradient: {delta_grad:.3g}")
        top = float(vals.max())
        ax.set_ylim(top - 3 * max(50.0, top - float(vals[len(vals) // 2])), top + 0.1 * abs(top))
        ax.set_xlabel("prior precision δ")
        ax.set_ylabel("log p(D | δ), Laplace")
        ax.set_title(f"Laplace evidence, {label}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "dnn2gp_evidence.png", dpi=120)
    plt.close(fig)

    result = {
        "n": args.n,
        "epochs": args.epochs,
        "final_loss": losses[-1],
        "train_rmse": float((model(x)[:, 0] - y).detach().pow(2).mean().sqrt()),
        "delta_grid_full": delta,
        "delta_gradient_full": delta_grad,
        "delta_grid_diag": choice["diag"]["delta"],
        "log_evidence_full": float(choice["full"]["values"].max()),
        "log_evidence_diag": float(choice["diag"]["values"].max()),
        "log_evidence_diag_at_full_delta": float(
            log_marginal_likelihood(model, (x, y), lik, delta, hessian_structure="diag")
        ),
        "predictive_sd": summary,
        "seconds": time.time() - start,
        "figures": [str(out / "dnn2gp_regression.png"), str(out / "dnn2gp_evidence.png")],
    }
    (out / "dnn2gp_regression.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
