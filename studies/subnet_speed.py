"""Subnetwork Laplace on ResNet-18: the subnetwork's Jacobian columns by layer capture
against per-example Jacobians (``method="capture"`` / ``"reverse"`` of
:class:`fromp.laplace.subnet.SubnetLaplace`), same process, same weights, data and indices.

A torchvision ResNet-18 (10 classes, CIFAR-shaped ``[3, 32, 32]`` inputs, eval mode) and a
subnetwork of ``--subnet`` weights drawn at random over all its parameters (so that nearly
every parameter tensor holds entries: the case where ``"reverse"`` takes per-example
Jacobians of almost the whole network). ``Laplace(model, "classification", "subnetwork",
"full", subnetwork_indices=idx, method=m).fit`` on ``--n`` inputs, each method ``--repeats``
times (best time kept), the two precisions compared; records seconds, the ratio and the
largest relative difference of the precisions.

    python -m studies.subnet_speed [--n 64] [--subnet 1000] [--device cpu]
"""

from __future__ import annotations

import time
from typing import Any

import torch

from fromp import Laplace
from studies import harness


def resnet18(n_classes: int = 10) -> torch.nn.Module:
    from torchvision.models import resnet18 as tv_resnet18

    return tv_resnet18(num_classes=n_classes)


def fit_seconds(model, idx, x, y, method: str, device: str) -> tuple[float, torch.Tensor]:
    """Seconds of one fit and the posterior precision ``[S, S]``."""
    la = Laplace(model, "classification", "subnetwork", "full", subnetwork_indices=idx,
                 prior_precision=1.0, method=method)  # fmt: skip
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    la.fit([(x, y)])
    prec = la.posterior_precision
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t0, prec.detach().cpu()


def run(n: int, subnet: int, device: str, repeats: int, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = resnet18().to(device).eval()
    x = torch.randn(n, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (n,), device=device)
    p_total = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(p_total, generator=g)[:subnet]
    out: dict[str, Any] = {"params": p_total, "subnet": subnet, "n": n, "methods": {}}
    precs = {}
    for method in ("reverse", "capture"):
        times = []
        for _ in range(repeats):
            t, precs[method] = fit_seconds(model, idx, x, y, method, device)
            times.append(t)
        out["methods"][method] = {"seconds": min(times), "all_seconds": times}
    diff = (precs["capture"] - precs["reverse"]).abs().max()
    out["max_relative_difference"] = float(diff / precs["reverse"].abs().max())
    out["reverse_over_capture"] = (
        out["methods"]["reverse"]["seconds"] / out["methods"]["capture"]["seconds"]
    )
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = harness.parser(__name__, __doc__)
    harness.add_out(parser, harness.RESULTS / "subnet_speed.json")
    harness.add_seed(parser)
    parser.add_argument("--n", type=int, default=64, help="inputs the Laplace is fitted on")
    parser.add_argument("--subnet", type=int, default=1000, help="weights in the subnetwork")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    for name in ("n", "subnet", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be a positive integer, got {getattr(args, name)}")
    harness.prepare_out(args.out)
    torch.set_num_threads(args.threads)
    result = run(args.n, args.subnet, args.device, args.repeats, args.seed)
    if not result["max_relative_difference"] < 1e-3:
        raise SystemExit(
            f"subnet_speed: the two methods' precisions differ by "
            f"{result['max_relative_difference']:.3g} (relative): not recorded"
        )
    record = {"protocol": {k: v for k, v in vars(args).items() if k != "out"}, **result}
    record = harness.write_record(args.out, record, module=__name__, argv=argv, device=args.device)
    m = result["methods"]
    print(
        f"ResNet-18, {result['subnet']} of {result['params']} weights, {result['n']} inputs: "
        f"reverse {m['reverse']['seconds']:.2f} s, capture {m['capture']['seconds']:.2f} s "
        f"({result['reverse_over_capture']:.1f}x); precisions agree to "
        f"{result['max_relative_difference']:.1e}"
    )
    return record


if __name__ == "__main__":
    main()
