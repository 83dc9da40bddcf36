"""IVON's posterior and its DNN2GP kernel against the Laplace-GGN ones, split MNIST task 1.

Trains FROMP's split-MNIST MLP (784-256-256, head of task 1: digits 0/1) with IVON for a
task's worth of steps, then prints, for the trained network:

* quantiles of IVON's Hessian estimate ``h`` and of the data's curvature ``G / N`` (the exact
  diagonal GGN of the task's training set divided by its size ``N``), and their correlation;
* quantiles of the posterior variances: IVON ``1 / (N (h + delta))``, Laplace
  ``1 / (G + 1e-3)`` (FROMP's prior precision on split MNIST);
* the diagonal of the logit kernel ``J Sigma J^T`` on 40 memorable points (20 per class,
  largest ``tr Lambda``) under each posterior.

Usage (real MNIST under ``$FROMP_DATA`` or ``--data-root``)::

    python -m studies.ivon_kernel_scale --beta2 0.999 --epochs 15 --clip-radius 0.1

Memory: the Jacobians of 40 points, ``[40, 2, P]`` with ``P = 269,322``; no ``P x P`` matrix.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from fromp_bench.data import load_mnist

import fromp
from fromp.continual.memorable import select_memorable
from fromp.curvature.diagonal import diag_ggn_linear
from fromp.curvature.jacobian import flat_params
from fromp.models import MultiHeadMLP, with_task
from fromp.optim import IVON
from fromp.posterior import DiagonalGaussian
from studies import harness


def _quantiles(v: torch.Tensor) -> str:
    v = v.float()
    if len(v) > 100_000:  # torch.quantile's size limit: a random subset
        v = v[torch.randperm(len(v), generator=torch.Generator().manual_seed(0))[:100_000]]
    return " / ".join(f"{torch.quantile(v, p).item():.3g}" for p in (0.05, 0.5, 0.95))


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__name__, __doc__)
    ap.add_argument("--beta2", type=float, default=0.99999)
    ap.add_argument("--hess-init", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=1e-4)
    ap.add_argument("--lr", type=float, default=0.2)
    ap.add_argument("--clip-radius", type=float, default=None)
    ap.add_argument("--epochs", type=int, default=15, help="epochs (default 15, FROMP's)")
    harness.add_data_root(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    xtr, ytr, _, _ = load_mnist(args.data_root, download=False)
    keep = (ytr == 0) | (ytr == 1)
    x, y = xtr[keep].reshape(-1, 784), ytr[keep]
    n = len(x)
    torch.manual_seed(0)
    net = with_task(MultiHeadMLP(784, (256, 256), 5, 2), 0)
    opt = IVON(
        [p for p in net.parameters() if p.requires_grad],
        lr=args.lr,
        ess=n,
        hess_init=args.hess_init,
        betas=(0.9, args.beta2),
        prior_precision=args.weight_decay * n,
        clip_radius=args.clip_radius,
    )
    t0 = time.perf_counter()
    for _ in range(args.epochs):
        perm = torch.randperm(n)
        for i in range(0, n, 128):
            idx = perm[i : i + 128]
            with opt.sampled_params(train=True):
                opt.zero_grad()
                F.cross_entropy(net(x[idx]), y[idx]).backward()
            opt.step()
    net.eval()
    with torch.no_grad():
        acc = (net(x).argmax(1) == y).float().mean().item()
    q = opt.posterior(net)
    h = torch.cat([st["hess"].reshape(-1) for st in [opt.state[p] for p in opt.params]])
    g = diag_ggn_linear(net, [(x,)], "categorical")
    laplace = DiagonalGaussian(flat_params(net), g + 1e-3)
    steps = opt.state[opt.params[0]]["step"]
    print(
        f"{vars(args)}: {steps} steps, {time.perf_counter() - t0:.0f} s, "
        f"training accuracy {100 * acc:.2f} %"
    )
    print(f"h, quantiles 5/50/95 %: {_quantiles(h)};  G/N: {_quantiles(g / n)}")
    used = g / n > 1e-4
    corr = torch.corrcoef(torch.stack([h[used].clamp_min(1e-12).log(), (g / n)[used].log()]))
    print(
        f"corr(log h, log G/N) over the {int(used.sum())} weights with G/N > 1e-4: {corr[0, 1]:.3f}"
    )
    print(f"variance, IVON: {_quantiles(q.variance)};  Laplace: {_quantiles(laplace.variance)}")
    xm = x[select_memorable(net, x, y, n_per_class=20)]
    for name, post in (("IVON", q), ("Laplace", laplace)):
        k = fromp.dnn2gp(net, post, "categorical").kernel(xm)  # [M, C, M, C]
        d = torch.einsum("icic->ic", k)
        print(f"kernel diagonal on 40 memorable points, {name}: median {d.median():.3g}")


if __name__ == "__main__":
    main()
