"""MNIST (not continual): an MLP trained by IVON and by Adam for the same number of epochs.

Reports test accuracy, negative log-likelihood and expected calibration error (15 bins) of

* Adam (point estimate);
* IVON's posterior mean;
* IVON's Monte-Carlo predictive (``predict_mc`` over IVON's posterior, ``--mc-test``
  samples), the prediction the IVON paper reports.

Usage (real MNIST under ``$FROMP_DATA`` or ``--data-root``)::

    python -m studies.ivon_mnist [--epochs 10] [--hidden 256,256] [--threads 1]

Defaults: MLP 784-256-256-10, batch 128, 10 epochs, Adam lr 1e-3 (as
``studies.vogn_mnist``); IVON lr 0.2 (rescaled by ``h0 + delta``), ``ess`` =
training-set size, ``h0 = 0.1``, betas (0.9, 0.99999) (the paper's ``beta2``; 0.999 diverged
in epoch 5 with lr 0.2, as did lr 0.5), weight decay 1e-4, one training sample, 20 test samples.

Writes ``benchmarks/results/ivon_mnist.json``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from fromp_bench.data import load_mnist

from fromp.models import MultiHeadMLP
from fromp.optim import IVON
from fromp.optim.vogn import predict_mc, predict_mean
from studies import harness
from studies.vogn_mnist import _batches, _chunks, _metrics, adam_baseline

RESULTS = harness.RESULTS


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

    if not args.skip_adam:
        out["adam"] = adam_baseline(args, hidden, xtr, ytr, xte, yte)

    torch.manual_seed(args.seed)
    net = MultiHeadMLP(784, hidden, n_heads=1, head_size=10)
    opt = IVON(
        net.parameters(),
        lr=args.ivon_lr,
        ess=n,
        hess_init=args.hess_init,
        betas=(args.beta1, args.beta2),
        prior_precision=args.weight_decay * n,
        mc_samples=args.mc_train,
        clip_radius=args.clip_radius,
        antithetic=args.antithetic,
    )
    g = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        net.train()
        total = 0.0
        for idx in _batches(n, args.batch_size, g):
            for _ in range(args.mc_train):
                with opt.sampled_params(train=True):
                    opt.zero_grad()
                    loss = F.cross_entropy(net(xtr[idx]), ytr[idx])
                    loss.backward()
                total += float(loss.detach()) * len(idx) / args.mc_train
            opt.step()
        if not total == total or total == float("inf"):
            raise RuntimeError(f"IVON diverged in epoch {epoch + 1}")
        print(f"ivon epoch {epoch + 1}: train nll at samples {total / n:.4f}", flush=True)
    ivon_time = time.perf_counter() - t0
    net.eval()
    q = opt.posterior(net)
    with torch.no_grad():
        p_mean = _chunks(net, lambda m, x: predict_mean(m, q, x), xte)
        gen = torch.Generator().manual_seed(args.seed)
        p_mc = _chunks(net, lambda m, x: predict_mc(m, q, x, args.mc_test, generator=gen), xte)
    out["ivon_mean"] = {**_metrics(p_mean, yte), "train_time_s": ivon_time}
    out["ivon_mc"] = {**_metrics(p_mc, yte), "mc_samples": args.mc_test}
    out["posterior_std_median"] = q.std.median().item()
    print("ivon mean", out["ivon_mean"], flush=True)
    print("ivon mc", out["ivon_mc"], flush=True)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = harness.parser(__name__, __doc__)
    ap.add_argument("--data-root", type=Path, default=None)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--hidden", default="256,256")
    ap.add_argument("--adam-lr", type=float, default=1e-3)
    ap.add_argument("--ivon-lr", type=float, default=0.2)
    ap.add_argument("--hess-init", type=float, default=0.1)
    ap.add_argument("--beta1", type=float, default=0.9)
    ap.add_argument("--beta2", type=float, default=0.99999)
    ap.add_argument("--weight-decay", type=float, default=1e-4)
    ap.add_argument("--clip-radius", type=float, default=None)
    ap.add_argument("--mc-train", type=int, default=1)
    ap.add_argument("--mc-test", type=int, default=20)
    ap.add_argument(
        "--antithetic", action="store_true", help="IVON draws in mirrored pairs (z, -z)"
    )
    ap.add_argument("--n-train", type=int, default=None, help="use the first n examples")
    ap.add_argument("--n-test", type=int, default=None)
    harness.add_seed(ap)
    harness.add_threads(ap, 1)
    ap.add_argument("--skip-adam", action="store_true", help="IVON only (tuning)")
    harness.add_out(ap, RESULTS / "ivon_mnist.json")
    args = ap.parse_args(argv)
    harness.prepare_out(args.out)
    result = run(args)
    harness.write_record(args.out, result, module=__name__, argv=argv)
    return result


if __name__ == "__main__":
    main()
