"""The GPU check (``make gpu-check``): CUDA tests and GPU timings, written to
``benchmarks/results/gpu/``.

    python -m benchmarks.studies.gpu_check [--device cuda] [--data-root DIR]
                                           [--out benchmarks/results/gpu]

Four parts, each recorded in ``OUT/gpu_check.json`` (with the command, the device name,
torch and CUDA versions) as soon as it ends, so a part that fails keeps the others:

* ``tests``: ``pytest -rs`` over the test files with a CUDA axis (``-k cuda``): counts of
  passed, skipped and failed tests and pytest's summary line. On a machine without a GPU
  they all skip, which is why this check refuses to run there.
* ``split_mnist``: ``python -m benchmarks split-mnist --strategies ALL --seeds 1 --device
  DEVICE`` (all strategies but ``joint``, seed 0, the registry's settings), its
  ``results.json`` copied to ``OUT/split-mnist.json``; the summary keeps each strategy's
  mean accuracy and its seconds per phase (training, memorable selection, curvature,
  kernels, evaluation; every phase timed after ``torch.cuda.synchronize``) and the ratio of
  FROMP's total time to Naive's.
* ``laplace_resnet18``: ``fromp.laplace(resnet18(num_classes=10), x, "categorical", 1.0)``,
  the diagonal GGN of all weights on ``--n-laplace`` (10,000) CIFAR-shaped inputs
  ``[N, 3, 32, 32]`` (standard normal, eval mode): wall seconds (synchronised) and
  ``torch.cuda.max_memory_allocated``.
* ``ivon_adam_resnet18``: one optimisation step of ResNet-18 at batch 128 (forward,
  cross-entropy, backward, step) with Adam and with IVON (one posterior draw: ``with
  IVON.sampled_params(train=True)``), interleaved, ``--steps`` timed steps after 5 of
  warm-up, each synchronised; medians and the ratio IVON/Adam (the IVON paper reports
  IVON's step as "nearly identical to Adam" on GPUs).

``--device cpu --smoke`` runs every part on tiny sizes (the built-in ``split-digits``
benchmark with two strategies, 64 Laplace inputs, batch 8, 2 steps) so the tests can check
the script without a GPU; its numbers mean nothing and are not written under ``benchmarks/``.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from fromp import laplace
from fromp.optim import IVON

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "gpu"
ALL_STRATEGIES = "fromp,fromp-l2,fromp-vogn,fromp-ivon,ivon,vogn,vcl,vcl-coreset,ewc,naive"
CUDA_TEST_FILES = ["tests/test_devices.py", "tests/test_avalanche_models.py"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_mb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def run_tests() -> dict[str, Any]:
    """The CUDA cases of the test suite (``-k cuda``); counts from pytest's summary line."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-k", "cuda"]
    proc = subprocess.run(cmd + CUDA_TEST_FILES, cwd=ROOT, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    summary = lines[-1] if lines else proc.stderr.strip()[-300:]
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|skipped|failed|error)", summary)}
    return {"command": shlex.join(cmd + CUDA_TEST_FILES), "returncode": proc.returncode,
            "summary": summary, **counts}  # fmt: skip


def run_split(device: str, data_root: str | None, out: Path, smoke: bool) -> dict[str, Any]:
    """Every strategy on split MNIST, seed 0, through the runner; per-phase seconds."""
    bench, strategies = "split-mnist", ALL_STRATEGIES
    if smoke:
        bench, strategies = "split-digits", "fromp,naive"
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "benchmarks", bench, "--strategies", strategies,
               "--seeds", "1", "--device", device, "--out", tmp, "--no-progress"]  # fmt: skip
        if smoke:
            cmd += ["--epochs", "1", "--n-train", "64", "--n-test", "32"]
        if data_root:
            cmd += ["--data-root", data_root]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        shown = [c if c != tmp else "OUT" for c in cmd]
        if proc.returncode != 0:
            return {"command": shlex.join(shown), "returncode": proc.returncode,
                    "error": proc.stderr.strip()[-2000:]}  # fmt: skip
        results = json.loads((Path(tmp) / bench / "results.json").read_text())
    (out / f"{bench}.json").write_text(json.dumps(results, indent=1) + "\n")
    return {"command": shlex.join(shown), "returncode": 0,
            "strategies": summarise_split(results)}  # fmt: skip


def summarise_split(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{strategy: {"mean_accuracy", "seconds": {phase: s}, "total_s"}}`` and, where
    both ran, ``fromp_over_naive`` (ratio of total seconds) in FROMP's entry."""
    out: dict[str, dict[str, Any]] = {}
    for run in results.get("runs", []):
        seconds: dict[str, float] = {}
        for task in run.get("timing", []):
            for k, v in task.items():
                if k.endswith("_s"):
                    seconds[k] = seconds.get(k, 0.0) + float(v)
        out[run["strategy"]] = {
            "mean_accuracy": run.get("mean_accuracy"),
            "seconds": seconds,
            "total_s": sum(seconds.values()),
        }
    if "fromp" in out and "naive" in out and out["naive"]["total_s"] > 0:
        out["fromp"]["fromp_over_naive"] = out["fromp"]["total_s"] / out["naive"]["total_s"]
    return out


def run_laplace(device: torch.device, n: int, batch: int = 500) -> dict[str, Any]:
    """Diagonal GGN Laplace of a ResNet-18 (all weights) on ``n`` CIFAR-shaped inputs."""
    from torchvision.models import resnet18

    torch.manual_seed(0)
    net = resnet18(num_classes=10).to(device).eval()
    x = torch.randn(n, 3, 32, 32, device=device)
    loader = [x[i : i + batch] for i in range(0, n, batch)]
    _sync(device)
    _peak_reset(device)
    t0 = time.perf_counter()
    post = laplace(net, loader, "categorical", 1.0)
    _sync(device)
    wall = time.perf_counter() - t0
    prec = post.precision
    if not bool(torch.isfinite(prec).all()):
        raise RuntimeError("the ResNet-18 GGN diagonal has non-finite entries")
    return {"n": n, "batch": batch, "params": int(prec.numel()), "wall_s": wall,
            "peak_cuda_mb": _peak_mb(device)}  # fmt: skip


def run_ivon_adam(device: torch.device, batch: int, steps: int, warmup: int = 5) -> dict[str, Any]:
    """Median step time of Adam and IVON (one draw) on ResNet-18 at ``batch``."""
    from torchvision.models import resnet18

    torch.manual_seed(0)
    nets = [resnet18(num_classes=10).to(device) for _ in range(2)]
    adam = torch.optim.Adam(nets[0].parameters(), lr=1e-3)
    ivon = IVON(nets[1].parameters(), lr=0.1, ess=50_000)
    x = torch.randn(batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    def adam_step() -> None:
        adam.zero_grad()
        F.cross_entropy(nets[0](x), y).backward()
        adam.step()

    def ivon_step() -> None:
        with ivon.sampled_params(train=True):
            ivon.zero_grad()
            F.cross_entropy(nets[1](x), y).backward()
        ivon.step()

    times: dict[str, list[float]] = {"adam": [], "ivon": []}
    for i in range(warmup + steps):
        for name, step in (("adam", adam_step), ("ivon", ivon_step)):
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"batch": batch, "steps": steps, "adam_ms": 1e3 * med["adam"],
            "ivon_ms": 1e3 * med["ivon"], "ratio_ivon_adam": med["ivon"] / med["adam"]}  # fmt: skip


def check_device(device: str, smoke: bool) -> torch.device:
    """The device, refused in one line when it is not a usable CUDA device (or, with
    ``--smoke``, any device torch knows)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"--device must be a torch device such as 'cuda', got {device!r}") from err
    if dev.type != "cuda" and not smoke:
        raise ValueError(f"--device {device}: the GPU check needs a CUDA device (or --smoke)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine")
    return dev


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--data-root", default=None, help="data root (default: $FROMP_DATA)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--n-laplace", type=int, default=10_000)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--parts", default="tests,split_mnist,laplace_resnet18,ivon_adam_resnet18")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, to test the script")
    args = p.parse_args(argv)
    try:
        dev = check_device(args.device, args.smoke)
    except ValueError as err:
        print(f"gpu_check: {err}", file=sys.stderr)
        return 2
    if args.smoke:
        args.n_laplace, args.batch, args.steps = 64, 8, 2
    args.out.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "benchmarks.studies.gpu_check", *(argv or [])]),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "smoke": args.smoke,
    }
    parts = {
        "tests": run_tests,
        "split_mnist": lambda: run_split(args.device, args.data_root, args.out, args.smoke),
        "laplace_resnet18": lambda: run_laplace(dev, args.n_laplace),
        "ivon_adam_resnet18": lambda: run_ivon_adam(dev, args.batch, args.steps),
    }
    failed = False
    for name in [s.strip() for s in args.parts.split(",") if s.strip()]:
        if name not in parts:
            print(f"gpu_check: --parts: unknown part {name!r}, expected {sorted(parts)}",
                  file=sys.stderr)  # fmt: skip
            return 2
        try:
            record[name] = parts[name]()
        except Exception as err:  # a failed part is recorded, the others still run
            record[name] = {"error": f"{type(err).__name__}: {err}"}
        failed |= "error" in record[name] or record[name].get("returncode", 0) != 0
        (args.out / "gpu_check.json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"{name}: {json.dumps(record[name])[:400]}", flush=True)
    print(f"wrote {args.out / 'gpu_check.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
