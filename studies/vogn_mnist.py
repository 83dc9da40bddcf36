"""MNIST (not continual): an MLP trained by VOGN and by Adam for the same number of epochs.

Reports test accuracy, negative log-likelihood and expected calibration error (15 bins) of

* Adam (point estimate);
* VOGN's posterior mean (``predict_mean``);
* VOGN's Monte-Carlo predictive (``predict_mc`` with ``--mc-test`` samples).

Usage (real MNIST under ``$FROMP_DATA`` or ``--data-root``)::

    python -m studies.vogn_mnist [--epochs 10] [--hidden 256,256] [--threads 1]

Defaults: MLP 784-256-256-10, batch 128, 10 epochs, Adam lr 1e-3; VOGN lr 1e-3,
betas (0.9, 0.999), prior precision 100, KL weight (temperature) 0.05, one training sample,
20 test samples.

Writes ``benchmarks/results/vogn_mnist.json``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from fromp_bench.data import load_mnist
from fromp_bench.runner import expected_calibration_error
from torch import Tensor, nn

from fromp.models import MultiHeadMLP
from fromp.optim import VOGN
from fromp.optim.vogn import predict_mc, predict_mean
from studies import harness

RESULTS = harness.RESULTS


def _metrics(probs: Tensor, y: Tensor) -> dict[str, float]:
    probs = probs.double()
    return {
        "accuracy": (probs.argmax(1) == y).double().mean().item(),
        "nll": F.nll_loss(probs.clamp_min(1e-12).log(), y).item(),
        "ece": expected_calibration_error(probs, y),
    }


def _batches(n: int, bs: int, g: torch.Generator):
    perm = torch.randperm(n, generator=g)
    for s in range(0, n, bs):
        yield perm[s : s + bs]


def _chunks(model: nn.Module, fn, x: Tensor, bs: int = 2000) -> Tensor:
    return torch.cat([fn(model, x[s : s + bs]) for s in range(0, len(x), bs)])


def adam_baseline(
    args: argparse.Namespace, hidden: tuple[int, ...], xtr: Tensor, ytr: Tensor, xte, yte
) -> dict[str, float]:
    """Adam on the MLP for ``args.epochs`` epochs: test metrics and training time."""
    torch.manual_seed(args.seed)
    net = MultiHeadMLP(784, hidden, n_heads=1, head_size=10)
    adam = torch.optim.Adam(net.parameters(), lr=args.adam_lr)
    g = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    for _ in range(args.epochs):
        net.train()
        for idx in _batches(len(xtr), args.batch_size, g):
            adam.zero_grad()
            F.cross_entropy(net(xtr[idx]), ytr[idx]).backward()
            adam.step()
    adam_time = time.perf_counter() - t0
    net.eval()
    with torch.no_grad():
        probs = _chunks(net, lambda m, x: torch.softmax(m(x), -1), xte)
    result = {**_metrics(probs, yte), "train_time_s": adam_time}
    print("adam", result, flush=True)
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    xtr, ytr, xte, yte = load_mnist(args.data_root, download=False)
    xtr, xte = xtr.reshape(len(xtr), -1), xte.reshape(len(xte), -1)
    if args.n_train:
        xtr, ytr = xtr[: args.n_train], ytr[: args.n_train]
    if args.n_test:
        xte, yte = xte[: args.n_test], yte[: args.n_test]
    hidden = tuple(int(h) for h in args.hidden.split(","))
    n = len(xtr)
    out: dict[str, Any] = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "n_train": n,
        "n_test": len(xte),
    }

    out["adam"] = adam_baseline(args, hidden, xtr, ytr, xte, yte)

    # VOGN
    torch.manual_seed(args.seed)
    net = MultiHeadMLP(784, hidden, n_heads=1, head_size=10)
    opt = VOGN(
        net,
        lr=args.vogn_lr,
        betas=(args.beta1, args.beta2),
        ess=n,
        prior_precision=args.prior_precision,
        hess_init=args.init_precision,
        mc_samples=args.mc_train,
        kl_weight=args.kl_weight,
    )
    g = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        net.train()
        total = 0.0
        for idx in _batches(n, args.batch_size, g):

            def closure(idx=idx):
                opt.zero_grad()
                loss = F.cross_entropy(net(xtr[idx]), ytr[idx])
                loss.backward()
                return loss

            total += float(opt.step(closure)) * len(idx)
        print(f"vogn epoch {epoch + 1}: train nll at samples {total / n:.4f}", flush=True)
    vogn_time = time.perf_counter() - t0
    net.eval()
    q = opt.posterior()
    with torch.no_grad():
        p_mean = _chunks(net, lambda m, x: predict_mean(m, q, x), xte)
        gen = torch.Generator().manual_seed(args.seed)
        p_mc = _chunks(net, lambda m, x: predict_mc(m, q, x, args.mc_test, generator=gen), xte)
    out["vogn_mean"] = {**_metrics(p_mean, yte), "train_time_s": vogn_time}
    out["vogn_mc"] = {**_metrics(p_mc, yte), "mc_samples": args.mc_test}
    out["posterior_std_median"] = q.std.median().item()
    print("vogn mean", out["vogn_mean"], flush=True)
    print("vogn mc", out["vogn_mc"], flush=True)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = harness.parser(__name__, __doc__)
    ap.add_argument("--data-root", type=Path, default=None)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--hidden", default="256,256")
    ap.add_argument("--adam-lr", type=float, default=1e-3)
    ap.add_argument("--vogn-lr", type=float, default=1e-3)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.999)
    ap.add_argument("--prior-precision", type=float, default=100.0)
    ap.add_argument("--init-precision", type=float, default=None)
    ap.add_argument("--kl-weight", type=float, default=0.05)
    ap.add_argument("--mc-train", type=int, default=1)
    ap.add_argument("--mc-test", type=int, default=20)
    ap.add_argument("--n-train", type=int, default=None, help="use the first n examples")
    ap.add_argument("--n-test", type=int, default=None)
    harness.add_seed(ap)
    harness.add_threads(ap, 1)
    harness.add_out(ap, RESULTS / "vogn_mnist.json")
    args = ap.parse_args(argv)
    harness.prepare_out(args.out)
    result = run(args)
    harness.write_record(args.out, result, module=__name__, argv=argv)
    return result


if __name__ == "__main__":
    main()
