"""Step time of VOGN and IVON (one posterior sample) relative to Adam, same models and
batches.

Timings per model, batch of 128, interleaved step by step, median, minimum and mean over
``--steps`` steps after warm-up:

* ``adam``: ``zero_grad``, forward, mean cross-entropy, ``backward``, ``Adam.step``;
* ``vogn``: ``VOGN.step(closure)`` (sampling, the closure's forward, mean cross-entropy
  and backward, exact per-example squared gradients of its model call, the update);
* ``vogn_two_phase``: the Avalanche path of :class:`fromp_avalanche.vogn.VOGNPlugin`
  (sampling, forward with the layer inputs recorded, squared per-example gradients from a
  partial backward of the data loss, the ordinary backward, ``VOGN.step()``);
* ``ivon``: ``with IVON.sampled_params(train=True):`` ``zero_grad``, forward,
  cross-entropy, ``backward``, then ``IVON.step()`` (only with ``--ivon``);
* ``ivon_antithetic``: the same with ``IVON(antithetic=True)``, whose steps alternate
  between a fresh normal draw and its mirror (no random numbers): its cost per step is the
  mean, so its ratio to Adam is a ratio of means (``ratio_ivon_antithetic_adam_mean``);
* ``normal``: ``Tensor.normal_`` of ``P`` numbers alone (``P`` the parameter count), the
  random numbers of one IVON draw (only with ``--ivon``). ``ratio_normal_floor`` =
  ``(adam + normal) / adam`` (means) is what Adam's step would cost with IVON's draw added
  and nothing else. IVON's update reads and writes more per-parameter state than Adam's
  (momentum, ``h``, the draw, the gradient; on the MLP the two updates cost about the same),
  so an IVON step with independent draws cannot come in much below this ratio on the
  machine that ran it; ``ratio_normal_floor_antithetic`` adds half a draw.

Usage::

    python -m studies.vogn_speed [--steps 20] [--threads 1] [--models mlp,cnn]
    python -m studies.vogn_speed --ivon --steps 40 \\
        --out benchmarks/results/ivon_speed.json

Writes ``benchmarks/results/vogn_speed.json`` (or ``--out``).
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from fromp.models import CifarCNN, MultiHeadMLP, with_task
from fromp.optim import IVON, VOGN
from fromp.optim.vogn import LayerCapture
from studies import harness

RESULTS = harness.RESULTS


def _models() -> dict[str, Callable[[], tuple[nn.Module, torch.Tensor, torch.Tensor]]]:
    def mlp():
        net = with_task(MultiHeadMLP(784, (256, 256), n_heads=5, head_size=2), 0)
        return net, torch.rand(128, 1, 28, 28), torch.randint(0, 2, (128,))

    def cnn():
        net = with_task(CifarCNN(3, n_heads=6, head_size=10), 0)
        return net, torch.rand(128, 3, 32, 32), torch.randint(0, 10, (128,))

    return {"mlp": mlp, "cnn": cnn}


def bench(
    name: str, steps: int, chunk_size: int | None, method: str, ivon: bool = False
) -> dict[str, float]:
    make = _models()[name]
    loss_fn = nn.CrossEntropyLoss()

    torch.manual_seed(0)
    net, x, y = make()
    net.train()
    n_params = sum(p.numel() for p in net.parameters())
    adam = torch.optim.Adam(net.parameters(), lr=1e-4)

    def adam_step():
        adam.zero_grad()
        loss_fn(net(x), y).backward()
        adam.step()

    torch.manual_seed(0)
    net_v, _, _ = make()
    net_v.train()
    vogn = VOGN(
        net_v,
        lr=1e-4,
        ess=10_000,
        hess_init=1e-3,
        chunk_size=chunk_size,
        method=method,
    )

    def closure():
        vogn.zero_grad()
        loss = loss_fn(net_v(x), y)
        loss.backward()
        return loss

    def vogn_step():
        vogn.step(closure)

    torch.manual_seed(0)
    net_2, _, _ = make()
    net_2.train()
    vogn2 = VOGN(
        net_2,
        lr=1e-4,
        ess=10_000,
        hess_init=1e-3,
        chunk_size=chunk_size,
        method=method,
    )

    def vogn_two_phase():  # what VOGNPlugin does inside Avalanche's loop
        vogn2.zero_grad()
        vogn2.sample_params(copy=False)
        with LayerCapture(net_2) as capture:
            out = net_2(x)
        h = capture.squared_grads(vogn2.loss_fn(out, y))
        loss_fn(out, y).backward()
        vogn2.set_curvature(h)
        vogn2.step()

    # Interleave the steps so that machine load affects them alike.
    fns = {"adam": adam_step, "vogn": vogn_step, "vogn_two_phase": vogn_two_phase}
    if ivon:
        for key, anti in (("ivon", False), ("ivon_antithetic", True)):
            torch.manual_seed(0)
            net_i, _, _ = make()
            net_i.train()
            opt_i = IVON(net_i.parameters(), lr=0.1, ess=10_000, hess_init=0.1, antithetic=anti)

            def ivon_step(net_i=net_i, opt_i=opt_i):
                with opt_i.sampled_params(train=True):
                    opt_i.zero_grad()
                    loss_fn(net_i(x), y).backward()
                opt_i.step()

            fns[key] = ivon_step
        noise = torch.empty(n_params)
        fns["normal"] = noise.normal_
    for fn in fns.values():
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(steps):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    out: dict[str, float] = {}
    for key, ts in times.items():
        out[key] = statistics.median(ts)
        out[key + "_min"] = min(ts)
        out[key + "_mean"] = statistics.fmean(ts)
    out["ratio_vogn_adam"] = out["vogn"] / out["adam"]
    out["ratio_two_phase_adam"] = out["vogn_two_phase"] / out["adam"]
    out["ratio_vogn_adam_min"] = out["vogn_min"] / out["adam_min"]
    if ivon:
        out["ratio_ivon_adam"] = out["ivon"] / out["adam"]
        out["ratio_ivon_adam_min"] = out["ivon_min"] / out["adam_min"]
        out["ratio_ivon_adam_mean"] = out["ivon_mean"] / out["adam_mean"]
        out["ratio_ivon_antithetic_adam_mean"] = out["ivon_antithetic_mean"] / out["adam_mean"]
        out["ratio_normal_floor"] = 1 + out["normal_mean"] / out["adam_mean"]
        out["ratio_normal_floor_antithetic"] = 1 + out["normal_mean"] / (2 * out["adam_mean"])
    out["num_params"] = n_params
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = harness.parser(__name__, __doc__)
    ap.add_argument("--steps", type=int, default=20)
    harness.add_threads(ap, 1)
    ap.add_argument("--models", default="mlp,cnn")
    ap.add_argument("--chunk-size", type=int, default=None)
    ap.add_argument("--method", default="auto", choices=["auto", "hooks", "vmap"])
    ap.add_argument("--ivon", action="store_true", help="also time IVON")
    harness.add_out(ap, RESULTS / "vogn_speed.json")
    args = ap.parse_args(argv)
    harness.prepare_out(args.out)
    torch.set_num_threads(args.threads)
    result = {
        "batch_size": 128,
        "threads": args.threads,
        "steps": args.steps,
        "chunk_size": args.chunk_size,
        "method": args.method,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "models": {},
    }
    for name in args.models.split(","):
        r = bench(name, args.steps, args.chunk_size, args.method, args.ivon)
        result["models"][name] = r
        print(
            f"{name}: adam {r['adam'] * 1e3:.1f} ms, vogn {r['vogn'] * 1e3:.1f} ms "
            f"(x{r['ratio_vogn_adam']:.2f}), two-phase {r['vogn_two_phase'] * 1e3:.1f} ms "
            f"(x{r['ratio_two_phase_adam']:.2f})"
            + (
                f", ivon {r['ivon'] * 1e3:.1f} ms (x{r['ratio_ivon_adam']:.2f}; mean "
                f"x{r['ratio_ivon_adam_mean']:.2f}), antithetic mean "
                f"{r['ivon_antithetic_mean'] * 1e3:.1f} ms "
                f"(x{r['ratio_ivon_antithetic_adam_mean']:.2f}); Adam + normal draw "
                f"x{r['ratio_normal_floor']:.2f}"
                if args.ivon
                else ""
            ),
            flush=True,
        )
    harness.write_record(args.out, result, module=__name__, argv=argv)
    return result


if __name__ == "__main__":
    main()
