"""Where the time of the structured DNN2GP kernel goes, on ResNet-18 (``cProfile``).

    python -m studies.kernel_profile [--n 256] [--full]

``torchvision.models.resnet18(num_classes=10)`` (eval, random weights) on ``--n`` standard
normal ``[3, 32, 32]`` inputs with a random diagonal posterior, one CPU thread: the CPU time
of the one-example check, of the feature capture (one forward, one batched backward of the
``C`` outputs) and of one symmetric kernel block over all ``--n`` examples (per-class
blocks, or the full kernel with ``--full``), then the ``cProfile`` table of the block (its
times are wall-clock: on a shared machine use their shares, not their values).
"""

from __future__ import annotations

import cProfile
import pstats
import resource
import time

import torch

from studies import harness


def main(argv: list[str] | None = None) -> None:
    parser = harness.parser(__name__, __doc__)
    parser.add_argument("--n", type=int, default=256)
    parser.add_argument("--full", action="store_true", help="the [N, C, N, C] kernel")
    args = parser.parse_args(argv)
    if args.n < 1:
        parser.error(f"--n must be >= 1, got {args.n}")
    import torchvision

    from fromp.curvature.jacobian import flat_params
    from fromp.gp.process import GP
    from fromp.posterior import DiagonalGaussian

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = torchvision.models.resnet18(num_classes=10).eval()
    mean = flat_params(net)
    prec = 1.0 + torch.rand(mean.shape, generator=torch.Generator().manual_seed(1))
    gp = GP(net, DiagonalGaussian(mean, prec), "categorical")
    x = torch.randn(args.n, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    t0 = time.process_time()
    st = gp._structure(x[:1], required=True)
    print(f"one-example check: {time.process_time() - t0:.1f} s CPU, "
          f"{st.bytes_per_example / 2**20:.1f} MiB of features per example")  # fmt: skip
    t0 = time.process_time()
    f = st.features(x, slice(0, args.n))
    print(f"features of {args.n} examples: {time.process_time() - t0:.1f} s CPU")
    prof = cProfile.Profile()
    t0 = time.process_time()
    prof.enable()
    st.block(f, f, not args.full)
    prof.disable()
    kind = "full" if args.full else "per-class"
    print(f"{kind} block {args.n} x {args.n}: {time.process_time() - t0:.1f} s CPU")
    pstats.Stats(prof).sort_stats("tottime").print_stats(10)
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GB")


if __name__ == "__main__":
    main()
