"""Speed and memory of the DNN2GP kernel ``K = J Sigma J^T`` against the reference loop.

    python -m studies.kernel_speed [--n 1000] [--ref-n 100] [--data-root DIR]

For ``--n`` MNIST test images (uniform-noise images of MNIST's shape when MNIST is not found;
the output says so) and two networks, split MNIST's ``MultiHeadMLP(784, (256, 256), 5, 2)``
with head 0 and ``LeNet5`` (10 classes), with a random diagonal posterior, it measures

* ``fromp``: :meth:`fromp.gp.GP.kernel` with ``diagonal_outputs=True`` (the per-class blocks
  ``[C, N, N]`` FROMP uses) and the full ``[N, C, N, C]`` kernel, each with the default
  ``method="auto"`` (structured Linear layers) and with ``method="jacobian"``; the Jacobian
  stage alone (all whitened per-example Jacobians, ``vmap(jacrev)`` in chunks) is timed too;
* ``reference``: the way the kernel is usually computed, one forward pass per example and one
  ``torch.autograd.grad`` per output class, stacking ``J [N, C, P]``, then the same matrix
  products. The loop is timed on ``--ref-n`` images and scaled linearly to ``--n`` (the loop
  is linear in the number of images, and this is said in the output); its matrix products
  ``J Sigma J^T`` are those of ``method="jacobian"``, taken from that measured run (its time
  minus the Jacobian stage). The reference's ``J`` on
  ``--ref-n`` images is also compared numerically with ``fromp``'s.

Every measurement runs in a fresh subprocess so that peak memory can be read per measurement:
``torch.cuda.max_memory_allocated`` on GPU, else the peak growth of the resident set size
over the measurement (sampled every 2 ms from ``/proc/self/statm``). Times are wall-clock
on GPU and process CPU time on CPU (single-threaded by default; wall time on a shared
machine depends on the other load, both are recorded), after a warm-up call on two images.
Results go to
``benchmarks/results/kernel_speed.json``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import platform
import resource
import sys
import threading
import time
from typing import Any

import torch
from torch import Tensor, nn

from studies import harness

__all__ = ["main", "make_model", "measure"]

MODELS = ("mlp", "lenet")


def make_model(name: str) -> tuple[nn.Module, nn.Module]:
    """``(net, view)``: the network and the ``x -> [N, C]`` module whose kernel is timed."""
    from fromp.models import LeNet5, MultiHeadMLP, with_task

    torch.manual_seed(0)
    if name == "mlp":
        net = MultiHeadMLP(784, (256, 256), n_heads=5, head_size=2).eval()
        return net, with_task(net, 0)
    if name == "lenet":
        net = LeNet5(in_channels=1, n_heads=1, head_size=10).eval()
        return net, net
    raise ValueError(f"model must be one of {MODELS}, got {name!r}")


def _posterior(view: nn.Module):
    from fromp.curvature.jacobian import flat_params
    from fromp.posterior import DiagonalGaussian

    mean = flat_params(view)
    gen = torch.Generator().manual_seed(1)
    precision = 1.0 + torch.rand(mean.shape, generator=gen).to(mean)
    return DiagonalGaussian(mean, precision)


def _rss_mb() -> float:
    """Current resident set size (Linux ``/proc/self/statm``; else the peak so far)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


class _RssSampler:
    """Peak of the resident set size above its value at start, sampled every 2 ms."""

    def __init__(self) -> None:
        self.base = _rss_mb()
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_mb())
            time.sleep(0.002)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_mb())
        return self.peak - self.base


def reference_jacobians(view: nn.Module, x: Tensor) -> Tensor:
    """``J [N, C, P]`` by one forward pass per example and one ``autograd.grad`` per class."""
    params = [p for p in view.parameters() if p.requires_grad]
    rows = []
    for i in range(len(x)):
        out = view(x[i : i + 1])[0]
        per_class = []
        for c in range(len(out)):
            grads = torch.autograd.grad(
                out[c],
                params,
                retain_graph=c + 1 < len(out),
                allow_unused=True,  # other task heads
                materialize_grads=True,
            )
            per_class.append(torch.cat([g.reshape(-1) for g in grads]))
        rows.append(torch.stack(per_class))
    return torch.stack(rows)


def measure(task: dict[str, Any]) -> dict[str, Any]:
    """One measurement (run in a subprocess): ``task["what"]`` is ``"fromp_jacobian"``,
    ``"fromp_diag"``, ``"fromp_full"`` or ``"reference"``."""
    from fromp.gp.process import dnn2gp

    torch.set_num_threads(task["threads"])
    device = torch.device(task["device"])
    _, view = make_model(task["model"])
    view = view.to(device)
    x = task["x"].to(device)
    gp = dnn2gp(view, _posterior(view).to(device), "categorical", chunk_size=task["chunk_size"])
    cache = int(task["cache_gb"] * (1 << 30))
    what = task["what"]
    # warm-up on two images (first-call costs: functorch tracing, allocator, autograd engine)
    if what == "reference":
        reference_jacobians(view, x[:2])
    else:
        method = "auto" if what in ("fromp_diag", "fromp_full") else "jacobian"
        gp.kernel(x[:2], diagonal_outputs=what.startswith("fromp_diag"), method=method)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    sampler = _RssSampler() if device.type != "cuda" else None
    harness.sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    extra: dict[str, Any] = {}
    if what == "fromp_jacobian":
        for s in range(0, len(x), task["chunk_size"]):
            gp._whitened(x, slice(s, s + task["chunk_size"]))
    elif what.startswith(("fromp_diag", "fromp_full")):
        method = "jacobian" if what.endswith("_jacobian") else "auto"
        k = gp.kernel(
            x, diagonal_outputs=what.startswith("fromp_diag"), max_cache_bytes=cache, method=method
        )
        extra["shape"] = list(k.shape)
        extra["method"] = "jacobian" if gp._structured in (None, False) else "structured"
    elif what == "reference":
        jac = reference_jacobians(view, x)
    else:
        raise ValueError(f"unknown measurement {what!r}")
    harness.sync(device)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    # on a shared CPU machine wall time depends on other load: single-threaded CPU runs are
    # compared on process CPU time, GPU runs on wall time
    seconds = wall if device.type == "cuda" else cpu
    if device.type == "cuda":
        peak_mb = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    else:
        peak_mb = sampler.stop()
    if what == "reference":
        ours = gp.jacobians(x)
        extra["max_abs_diff_vs_fromp"] = float((jac - ours).abs().max())
        extra["max_abs_jacobian"] = float(ours.abs().max())
        extra["jacobian_shape"] = list(jac.shape)
    return {"seconds": seconds, "wall_seconds": wall, "cpu_seconds": cpu, "peak_mem_mb": peak_mb,
            **extra}  # fmt: skip


def _run(task: dict[str, Any]) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(measure, (task,))


def load_images(n: int, data_root: str | None) -> tuple[Tensor, str]:
    """``n`` MNIST test images ``[n, 1, 28, 28]`` and where they came from."""
    from fromp_bench.data import DataNotFoundError, load_mnist

    try:
        _, _, x_test, _ = load_mnist(data_root, download=False)
        if n > len(x_test):
            raise ValueError(f"--n must be at most {len(x_test)}, got {n}")
        return x_test[:n].unsqueeze(1).contiguous(), "MNIST test set"
    except DataNotFoundError as err:
        print(f"MNIST not found ({str(err).splitlines()[0][:120]}...);", file=sys.stderr)
        print("using SYNTHETIC uniform-noise images of MNIST's shape instead.", file=sys.stderr)
        gen = torch.Generator().manual_seed(0)
        return torch.rand(n, 1, 28, 28, generator=gen), "synthetic (MNIST not found)"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = harness.parser(__name__, __doc__)
    parser.add_argument("--n", type=int, default=1000, help="images in the kernel")
    parser.add_argument("--ref-n", type=int, default=100, help="images for the timed loop")
    parser.add_argument("--data-root", default=None, help="holds MNIST/raw (else $FROMP_DATA)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma list of mlp,lenet")
    parser.add_argument("--chunk-size", type=int, default=100, help="examples per Jacobian")
    parser.add_argument("--cache-gb", type=float, default=2.5, help="kernel's Jacobian cache")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    parser.add_argument("--no-full", action="store_true", help="skip the full [N,C,N,C] kernel")
    harness.add_out(parser, harness.RESULTS / "kernel_speed.json")
    args = parser.parse_args(argv)
    harness.prepare_out(args.out)
    if args.n < 1 or not 1 <= args.ref_n <= args.n:
        parser.error("need --n >= 1 and 1 <= --ref-n <= --n")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            parser.error(f"--models: unknown model {m!r}; choose from {MODELS}")
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    x, source = load_images(args.n, args.data_root)
    scale = args.n / args.ref_n
    print(f"data: {source}, n={args.n}; device={device}, threads={args.threads}")
    report: dict[str, Any] = {
        "data": source,
        "n": args.n,
        "ref_n": args.ref_n,
        "device": device,
        "threads": args.threads,
        "chunk_size": args.chunk_size,
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "memory": "peak CUDA allocation" if device == "cuda" else "peak RSS growth (2 ms samples)",
        "seconds": "wall time" if device == "cuda" else "process CPU time (shared machine)",
        "reference_scaling": f"loop timed on {args.ref_n} images, scaled x{scale:g} (linear)",
        "models": {},
    }
    for name in models:
        net, view = make_model(name)
        with torch.no_grad():
            c = view(x[:1]).shape[1]
        p = sum(q.numel() for q in view.parameters() if q.requires_grad)
        base = {
            "model": name,
            "x": x,
            "device": device,
            "threads": args.threads,
            "chunk_size": args.chunk_size,
            "cache_gb": args.cache_gb,
        }
        res: dict[str, Any] = {"P": p, "C": c}
        kinds = ["diag"] if args.no_full else ["diag", "full"]
        res["fromp_jacobian"] = _run({**base, "what": "fromp_jacobian"})
        for k in kinds:
            res[f"fromp_{k}"] = _run({**base, "what": f"fromp_{k}"})
            res[f"fromp_{k}_jacobian"] = _run({**base, "what": f"fromp_{k}_jacobian"})
        ref = _run({**base, "what": "reference", "x": x[: args.ref_n]})
        ref_jac = ref["seconds"] * scale
        jac_s = res["fromp_jacobian"]["seconds"]
        # the reference's products are those of the Jacobian way (same matrix products)
        products = {k: max(0.0, res[f"fromp_{k}_jacobian"]["seconds"] - jac_s) for k in kinds}
        res["reference"] = {
            "measured_seconds": ref["seconds"],
            "measured_on": args.ref_n,
            "jacobian_seconds_scaled": ref_jac,
            "jacobian_memory_mb_scaled": args.n * c * p * x.element_size() / 2**20,
            "peak_mem_mb_measured": ref["peak_mem_mb"],
            "max_abs_diff_vs_fromp": ref["max_abs_diff_vs_fromp"],
            "max_abs_jacobian": ref["max_abs_jacobian"],
        }
        res["speedup_jacobian_stage"] = ref_jac / jac_s
        for k in kinds:
            res[f"reference_{k}_seconds_estimate"] = ref_jac + products[k]
            res[f"speedup_{k}_end_to_end"] = (ref_jac + products[k]) / res[f"fromp_{k}"]["seconds"]
        report["models"][name] = res
        print(f"\n[{name}] P={p}, C={c}, n={args.n}")
        print(
            f"  fromp Jacobian stage (all J, vmap)    {jac_s:8.2f} s  "
            f"peak {res['fromp_jacobian']['peak_mem_mb']:7.0f} MB"
        )
        for k in kinds:
            for suffix in ("", "_jacobian"):
                r = res[f"fromp_{k}{suffix}"]
                print(
                    f"  fromp kernel {k:<4} method={r['method']:<10}  {r['seconds']:8.2f} s  "
                    f"peak {r['peak_mem_mb']:7.0f} MB"
                )
        print(
            f"  reference loop (J only)               {ref_jac:8.2f} s  (measured "
            f"{ref['seconds']:.2f} s on {args.ref_n} images, scaled x{scale:g}); J needs "
            f"{res['reference']['jacobian_memory_mb_scaled']:.0f} MB; "
            f"max |J_ref - J_fromp| = {ref['max_abs_diff_vs_fromp']:.2e}"
        )
        print(f"  speed-up, Jacobian stage (vmap vs loop): {res['speedup_jacobian_stage']:.1f}x")
        for k in kinds:
            print(
                f"  speed-up, {k} kernel end to end (reference = loop + products "
                f"{products[k]:.2f} s): {res[f'speedup_{k}_end_to_end']:.1f}x"
            )
        del net, view
    harness.write_record(args.out, report, module=__name__, argv=argv)
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    main()
