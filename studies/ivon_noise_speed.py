"""What an IVON step on the FROMP MLP costs beyond Adam's, by operation, on one thread.

Times (median of ``--calls`` calls) the Gaussian draw (``normal_``), the uniform draw alone
(``uniform_``, the Mersenne-Twister part of it) and single elementwise passes over
``P = 269,322`` float32 numbers (the FROMP split-MNIST MLP, 784-256-256-10). An IVON step
does one draw (half a draw with ``antithetic=True``) and seventeen such passes (the draw 2, the
restore 2, the update 13; torch's Adam makes about seven, in a loop over the tensors).

Usage::

    python -m studies.ivon_noise_speed [--calls 200]
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from studies import harness

P = 269_322


def _median_ms(fn: Callable[[], object], calls: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = harness.parser(__name__, __doc__)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    z, c = torch.empty(P), torch.empty(P)
    a, b = torch.randn(P), torch.rand(P) + 0.5
    ops: dict[str, Callable[[], object]] = {
        "normal_": lambda: z.normal_(),
        "uniform_": lambda: z.uniform_(),
        "mul (out=)": lambda: torch.mul(a, b, out=c),
        "addcmul_": lambda: c.addcmul_(a, b),
        "lerp_": lambda: c.lerp_(a, 0.1),
        "div_": lambda: c.div_(b),
        "copy_": lambda: c.copy_(a),
        "rsqrt (out=)": lambda: torch.rsqrt(b, out=c),
    }
    out = {name: _median_ms(fn, args.calls) for name, fn in ops.items()}
    for name, ms in out.items():
        print(f"{name:14s} {ms:.3f} ms")
    return out


if __name__ == "__main__":
    main()
