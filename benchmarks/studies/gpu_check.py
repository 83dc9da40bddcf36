"""The GPU check (``make gpu-check``): the CUDA tests and the GPU measurements of issue 37,
each case written to ``OUT/<date>-<device>.json`` (and a summary ``.md``) as soon as it ends.

    python -m fromp_bench.studies.gpu_check [--device cuda] [--budget 520] [--quick]
                                           [--data-root DIR] [--out benchmarks/results/gpu]

The cases, in the order they run (the most telling first, so that a run cut short by its
budget or killed still leaves them):

* ``tests``: ``pytest -k cuda`` over the test suite (``--continue-on-collection-errors``):
  counts of passed, skipped, failed tests and pytest's summary line.
* ``laplace/<subset>/<structure>``: ``fromp.Laplace(model, "classification", subset,
  structure).fit(...)`` of a torchvision ResNet-18 (10 classes, eval mode) on ``--n-fit``
  CIFAR-shaped inputs ``[N, 3, 32, 32]`` (standard normal, random labels, batches of 500),
  then its GLM predictive ``la(x, pred_type="glm", link_approx="probit")`` on ``--n-pred``
  test inputs in one call, and, where sampling the posterior is cheap, the Monte Carlo
  predictive ``la(x, pred_type="nn", n_samples=10)``. Each of fit, GLM and MC is timed
  (synchronised) with its own peak memory (``torch.cuda.max_memory_allocated``, reset before
  it; ``held_mb`` is what was allocated when it started: model, data, posterior). Each
  predictive first runs on 4 inputs (warm-up) and on ``--pilot`` inputs; when the pilot's
  time, scaled to ``--n-pred`` inputs, exceeds the time left, the case is skipped with that
  estimate (the pilot's numbers are kept, labelled as such). All ten subset x structure
  pairs of :func:`fromp.Laplace` run: all weights (kron, diag, lowrank, gp, full), last
  layer (diag, kron, full), subnetwork of ``--subnet`` weights (diag, full).
* ``split-mnist/<strategy>``: ``python -m fromp_bench split-mnist --strategies S --seeds 1
  --device DEVICE`` for Naive, FROMP and EWC at the registry's settings (15 epochs per task),
  one process each: per-task seconds (training plus the method's own phases; evaluation, which
  grows with the tasks seen by design, is kept apart) and mean accuracy. A run stopped by its
  time share keeps the tasks its checkpoint holds (``partial``).
* ``ivon_adam``: one step of ResNet-18 at batch 128 (forward, cross-entropy, backward, step)
  with Adam and with IVON (one posterior draw), interleaved, medians and IVON/Adam.
* ``distributed``: ``torchrun --nproc_per_node=<GPUs>`` (``nvidia-smi -L``) of this module's
  ``--dist-worker``: ``Laplace.fit`` (all weights, diag and kron) over a ``DistributedSampler``
  shard per rank, against rank 0's single-process fit (predictive and evidence); skipped,
  with the reason recorded, on a machine with one GPU.

Every case is guarded: an out-of-memory error, an exception or a case that outruns its time
share is recorded with ``status`` (``oom``, ``error``, ``failed``, ``timeout``, ``skipped``,
``not_run``) and a ``reason``, never with a number, and the other cases still run. Cases not yet
reached are ``pending`` in the file, so a killed run is told apart from a finished one
(``finished``). ``targets`` holds the issue's pass/fail flags (``null`` when not measured at the
target's sizes): all-weights kron GLM predictive on 10,000 inputs <= 8 GB (8e9 bytes) peak,
FROMP <= 1.3x and EWC <= 1.2x Naive's time, each method's per-task time flat within 20 %
(max / min over tasks 2..T, the tasks with a penalty).

``--budget`` (seconds, default 520: the whole check on an H100 in about 9 minutes) bounds the
run: each case runs under ``min(its own cap, the time left)`` and a case that would start
with less than 5 s left is ``not_run``. ``--quick`` runs every case on small sizes (1 epoch,
500 inputs; on the CPU a small CNN of the same input and output shape, the built-in
split-digits benchmark and 64 / 32 inputs: what the tests run); its flags are ``null`` and its
files end in ``-quick``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from fromp_bench.studies import harness
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "gpu"
SCHEMA = 2
CUDA_TEST_PATHS = ["tests"]
MIN_CASE_S = 5.0

KRON_PEAK_LIMIT_BYTES = 8e9
RATIO_LIMITS = {"fromp": 1.3, "ewc": 1.2}
FLAT_LIMIT = 1.2
TARGET_N_PRED = 10_000

STATUSES = ("ok", "failed", "oom", "timeout", "error", "skipped", "not_run", "pending")

LAPLACE_PAIRS = [
    ("all", "kron"),
    ("all", "diag"),
    ("last_layer", "diag"),
    ("last_layer", "kron"),
    ("last_layer", "full"),
    ("subnetwork", "diag"),
    ("subnetwork", "full"),
    ("all", "lowrank"),
    ("all", "gp"),
    ("all", "full"),
]
# drawing weights is cheap except from a P x P precision (all weights, full) or a GP
MC_CHEAP = set(LAPLACE_PAIRS) - {("all", "full"), ("all", "gp")}
SPLIT_STRATEGIES = ("naive", "fromp", "ewc")


@dataclass(frozen=True)
class Sizes:
    """Every size of the check, and each case's cap in seconds."""

    model: str = "resnet18"
    n_fit: int = 10_000
    n_pred: int = 10_000
    pilot: int = 100
    fit_batch: int = 500
    mc_samples: int = 10
    subnet: int = 1_000
    low_rank: int = 10
    gp_subset: int = 500
    bench: str = "split-mnist"
    bench_args: tuple[str, ...] = ()
    ivon_batch: int = 128
    ivon_steps: int = 30
    dist_n: int = 2_000
    caps: dict[str, float] = field(
        default_factory=lambda: {
            "tests": 150.0,
            "laplace/all/kron": 120.0,
            "laplace": 60.0,
            "split-mnist/naive": 80.0,
            "split-mnist/fromp": 130.0,
            "split-mnist/ewc": 130.0,
            "ivon_adam": 40.0,
            "distributed": 120.0,
        }
    )


FULL = Sizes()
# fmt: off
QUICK = replace(FULL, n_fit=500, n_pred=500, pilot=50, subnet=200, gp_subset=50, dist_n=200,
                ivon_steps=5, bench_args=("--epochs", "1", "--n-train", "2000", "--n-test", "500"))
QUICK_CPU = replace(QUICK, model="small-cnn", n_fit=64, n_pred=32, pilot=8, fit_batch=32,
                    mc_samples=2, subnet=50, low_rank=2, gp_subset=8, bench="split-digits",
                    bench_args=("--epochs", "1", "--n-train", "64", "--n-test", "32"),
                    ivon_batch=8, ivon_steps=2, dist_n=32)
# fmt: on


# ----------------------------------------------------------------------------- guards
class CaseTimeout(Exception):
    """A case ran past its time share."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`CaseTimeout` in the main thread after ``seconds`` (SIGALRM; between
    Python operations, so a single long kernel ends first). No limit off the main thread or
    without SIGALRM."""
    usable = hasattr(signal, "setitimer") and _main_thread()
    if not usable:
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise CaseTimeout(f"stopped after {seconds:.0f} s (its share of the time budget)")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def is_oom(err: BaseException) -> bool:
    """Whether ``err`` is an out-of-memory error (CUDA's, or the CPU allocator's)."""
    if isinstance(err, torch.cuda.OutOfMemoryError | MemoryError):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


def _reason(err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first[:500]}"


def _cleanup(dev: torch.device, collect: bool = False) -> None:
    """Free what a measurement left (``collect``: also reference cycles, after a failure)."""
    if collect:
        gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()


def guarded(fn: Callable[[], dict[str, Any] | None], dev: torch.device, seconds: float) -> dict:
    """Run ``fn`` under a time limit, timed (synchronised) with its peak memory.

    Returns ``{"status": "ok", "wall_s", "peak_mb", "held_mb", **fn()}``, or ``{"status":
    "oom" | "timeout" | "error" | "not_run", "reason"}`` with no measurement."""
    if seconds < MIN_CASE_S:
        return not_run(f"{max(seconds, 0):.0f} s of the time budget left")
    _cleanup(dev)
    held = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    try:
        with time_limit(seconds):
            extra = fn() or {}
            harness.sync(dev)
    except CaseTimeout as err:
        out = {"status": "timeout", "reason": str(err)}
    except Exception as err:
        out = {"status": "oom" if is_oom(err) else "error", "reason": _reason(err)}
    else:
        out = {"status": "ok", "wall_s": time.perf_counter() - t0}
        if dev.type == "cuda":
            out["peak_mb"] = torch.cuda.max_memory_allocated(dev) / 2**20
            out["held_mb"] = held / 2**20
        out.update(extra)
    _cleanup(dev, collect=out["status"] != "ok")
    return out


def not_run(reason: str) -> dict[str, Any]:
    return {"status": "not_run", "reason": reason}


# ----------------------------------------------------------------------- subprocesses
def run_command(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> dict:
    """Run ``cmd`` from the repository root in its own process group; on timeout the whole
    group (torchrun's workers too) is killed. ``{"returncode", "stdout", "stderr",
    "timed_out", "wall_s"}``."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=max(timeout, 1.0))
        timed_out = False
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        timed_out = True
    return {
        "returncode": proc.returncode,
        "stdout": out or "",
        "stderr": err or "",
        "timed_out": timed_out,
        "wall_s": time.perf_counter() - t0,
    }


def _tail(text: str, n: int = 1500) -> str:
    return text.strip()[-n:]


def tests_case(seconds: float, paths: list[str] | None = None) -> dict[str, Any]:
    """``pytest -k cuda`` over ``paths`` (default :data:`CUDA_TEST_PATHS`): counts from
    pytest's summary line; ``failed`` when a test fails or errors."""
    paths = list(CUDA_TEST_PATHS if paths is None else paths)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rs",
        "-p",
        "no:cacheprovider",
        "--continue-on-collection-errors",
        "-k",
        "cuda",
        *paths,
    ]
    res = run_command(cmd, seconds)
    shown = shlex.join(["python", *cmd[1:]])
    if res["timed_out"]:
        return {
            "status": "timeout",
            "command": shown,
            "reason": f"pytest ran past {seconds:.0f} s",
            "output": _tail(res["stdout"]),
        }
    lines = [ln for ln in res["stdout"].strip().splitlines() if ln.strip()]
    summary = lines[-1] if lines else _tail(res["stderr"], 300)
    counts = {
        k: int(n)
        for n, k in re.findall(r"(\d+) (passed|skipped|failed|errors?|deselected)", summary)
    }
    if "error" in counts or "errors" in counts:
        counts["errors"] = counts.pop("error", 0) + counts.pop("errors", 0)
    out: dict[str, Any] = {
        "command": shown,
        "returncode": res["returncode"],
        "summary": summary,
        **counts,
    }
    if res["returncode"] == 0:
        out["status"] = "ok"
        out["wall_s"] = res["wall_s"]
    else:
        out["status"] = "failed" if counts.get("failed") or counts.get("errors") else "error"
        out["reason"] = f"pytest exit status {res['returncode']}: {summary[:300]}"
        out["output"] = _tail(res["stdout"])
    return out


# -------------------------------------------------------------------------- models/data
def small_cnn(num_classes: int = 10) -> nn.Module:
    """A small CNN with ResNet-18's ingredients (convolutions, batch norm, a linear head)
    and its input and output shapes ``[N, 3, 32, 32] -> [N, num_classes]``; for the CPU."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(4),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, num_classes),
    )


def build_model(name: str, dev: torch.device, seed: int = 0) -> nn.Module:
    """``"resnet18"`` (torchvision, 10 classes) or ``"small-cnn"``, seeded, on ``dev``."""
    torch.manual_seed(seed)
    if name == "resnet18":
        from torchvision.models import resnet18

        return resnet18(num_classes=10).to(dev)
    if name == "small-cnn":
        return small_cnn().to(dev)
    raise ValueError(f"--model must be 'resnet18' or 'small-cnn', got {name!r}")


def cifar_like(n: int, dev: torch.device, seed: int) -> tuple[Tensor, Tensor]:
    """``n`` standard-normal inputs ``[n, 3, 32, 32]`` and labels in 0..9 (seeded, CPU draw)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return x.to(dev), y.to(dev)


def batches(x: Tensor, y: Tensor, size: int) -> list[tuple[Tensor, Tensor]]:
    return [(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)]


# ------------------------------------------------------------------------------- Laplace
def _check_probs(p: Any, n: int) -> dict[str, Any]:
    """Refuse a predictive that is not ``[n, 10]`` finite probabilities (rows summing to 1)."""
    if not isinstance(p, Tensor) or p.shape != (n, 10):
        shape = tuple(p.shape) if isinstance(p, Tensor) else type(p).__name__
        raise RuntimeError(f"the predictive has shape {shape}, expected ({n}, 10)")
    if not bool(torch.isfinite(p).all()):
        raise RuntimeError("the predictive has non-finite entries")
    err = float((p.sum(-1) - 1).abs().max())
    if err > 1e-3:
        raise RuntimeError(f"the predictive's rows sum to 1 only within {err:.2g}")
    return {"n": n}


def sized(
    call: Callable[[Tensor], Tensor],
    x: Tensor,
    n: int,
    pilot: int,
    dev: torch.device,
    deadline: float,
) -> dict[str, Any]:
    """``call`` on ``x[:n]`` in one call, after a warm-up on 4 inputs and a pilot on
    ``pilot`` inputs whose time, scaled to ``n``, must fit in the time left."""

    def left() -> float:
        return deadline - time.monotonic()

    def on(m: int) -> Callable[[], dict[str, Any]]:
        return lambda: _check_probs(call(x[:m]), m)

    warm = guarded(on(min(4, n)), dev, left())
    if warm["status"] != "ok":
        return {**warm, "reason": f"on {min(4, n)} inputs (warm-up): {warm['reason']}"}
    if pilot >= n:
        return guarded(on(n), dev, left())
    first = guarded(on(pilot), dev, left())
    if first["status"] != "ok":
        return {**first, "reason": f"on {pilot} inputs (pilot): {first['reason']}"}
    estimate = first["wall_s"] * n / pilot
    if estimate > left():
        return {
            "status": "skipped",
            "pilot": first,
            "reason": f"{n} inputs would take about {estimate:.0f} s ({pilot} took "
            f"{first['wall_s']:.2f} s); {left():.0f} s left",
        }
    full = guarded(on(n), dev, left())
    full["pilot"] = first
    return full


def subnet_indices(model: nn.Module, k: int, seed: int = 0) -> Tensor:
    """``k`` weight indices drawn without replacement (seeded), sorted."""
    p = sum(q.numel() for q in model.parameters())
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(p, generator=g)[: min(k, p)].sort().values


def laplace_case(
    model: nn.Module,
    data: dict[str, Tensor],
    subset: str,
    structure: str,
    sizes: Sizes,
    dev: torch.device,
    seconds: float,
) -> dict[str, Any]:
    """Fit, GLM predictive and (where cheap) MC predictive of one subset x structure."""
    from fromp import Laplace

    deadline = time.monotonic() + seconds
    kw: dict[str, Any] = {}
    if subset == "subnetwork":
        kw["subnetwork_indices"] = subnet_indices(model, sizes.subnet).to(dev)
    if structure == "lowrank":
        kw["low_rank"] = sizes.low_rank
    if structure == "gp":
        kw["n_subset"] = sizes.gp_subset
    out: dict[str, Any] = {
        "subset": subset,
        "structure": structure,
        "n_fit": sizes.n_fit,
        "n_pred": sizes.n_pred,
        "options": {k: v for k, v in kw.items() if k != "subnetwork_indices"},
    }
    if subset == "subnetwork":
        out["options"]["subnetwork_size"] = int(kw["subnetwork_indices"].numel())
    held: dict[str, Any] = {}

    def fit() -> dict[str, Any]:
        la = Laplace(model, "classification", subset, structure, **kw)
        held["la"] = la.fit(batches(data["x"], data["y"], sizes.fit_batch))
        return {"params": int(la.num_params)}

    out["fit"] = guarded(fit, dev, deadline - time.monotonic())
    if out["fit"]["status"] != "ok":
        out["glm"] = not_run("the fit did not finish")
        out["mc"] = not_run("the fit did not finish")
    else:
        la = held["la"]
        out["glm"] = sized(
            lambda x: la(x, pred_type="glm", link_approx="probit"),
            data["x_test"],
            sizes.n_pred,
            sizes.pilot,
            dev,
            deadline,
        )
        if (subset, structure) in MC_CHEAP:
            out["mc"] = sized(
                lambda x: la(x, pred_type="nn", n_samples=sizes.mc_samples),
                data["x_test"],
                sizes.n_pred,
                sizes.pilot,
                dev,
                deadline,
            )
            out["mc"]["n_samples"] = sizes.mc_samples
        else:
            out["mc"] = {
                "status": "skipped",
                "reason": "drawing weights from this structure is not cheap (the Cholesky "
                "factor of a P x P precision, or a function-space posterior)",
            }
    held.clear()
    _cleanup(dev, collect=True)
    main = [out["fit"], out["glm"]]
    bad = [m for m in main if m["status"] != "ok"]
    out["status"] = bad[0]["status"] if bad else "ok"
    if bad:
        out["reason"] = bad[0]["reason"]
    return out


# ----------------------------------------------------------------------- split MNIST
def _phase_seconds(task: dict[str, Any]) -> tuple[float, float]:
    """(training + the method's phases, evaluation) seconds of one task's timing entry."""
    work = sum(float(v) for k, v in task.items() if k.endswith("_s") and k != "evaluation_s")
    return work, float(task.get("evaluation_s", 0.0))


def summarise_run(run: dict[str, Any]) -> dict[str, Any]:
    """Per-task seconds of one runner result (``run["timing"]``): ``per_task_s`` (training
    plus method phases), ``per_task_eval_s``, ``phases_s`` (summed over tasks), ``total_s``
    and ``flatness`` (max / min of ``per_task_s`` over tasks 2..T, all tasks when fewer)."""
    timing = run.get("timing") or []
    work = [_phase_seconds(t)[0] for t in timing]
    evals = [_phase_seconds(t)[1] for t in timing]
    phases: dict[str, float] = {}
    for t in timing:
        for k, v in t.items():
            if k.endswith("_s"):
                phases[k] = phases.get(k, 0.0) + float(v)
    later = work[1:] if len(work) > 2 else work
    flat = max(later) / min(later) if later and min(later) > 0 else None
    return {
        "per_task_s": work,
        "per_task_eval_s": evals,
        "phases_s": phases,
        "total_s": sum(work),
        "flatness": flat,
        "mean_accuracy": run.get("mean_accuracy"),
    }


def data_root(arg: str | None) -> Path:
    """``--data-root``, else ``$FROMP_DATA``, else ``./data`` (the runner's rule)."""
    return Path(arg or os.environ.get("FROMP_DATA") or ROOT / "data")


def has_mnist(root: Path) -> bool:
    raw = root / "MNIST" / "raw"
    names = (
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    )
    return all((raw / n).exists() or (raw / f"{n}.gz").exists() for n in names)


def split_case(strategy: str, sizes: Sizes, device: str, root: Path, seconds: float) -> dict:
    """One strategy through the runner (``python -m fromp_bench``), seed 0."""
    if sizes.bench == "split-mnist" and not has_mnist(root):
        return {
            "status": "skipped",
            "reason": f"no MNIST under {root}/MNIST/raw "
            "(--data-root or $FROMP_DATA; make gpu-bundle copies it)",
        }
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "fromp_bench",
            sizes.bench,
            "--strategies",
            strategy,
            "--seeds",
            "1",
            "--device",
            device,
            "--out",
            tmp,
            "--no-progress",
            "--data-root",
            str(root),
            *sizes.bench_args,
        ]
        shown = shlex.join(["python", *[c if c != tmp else "OUT" for c in cmd[1:]]])
        res = run_command(cmd, seconds)
        base = Path(tmp) / sizes.bench
        out: dict[str, Any] = {"command": shown, "benchmark": sizes.bench}
        if res["timed_out"]:
            out.update(
                status="timeout",
                reason=f"stopped after {seconds:.0f} s (its share of the time budget)",
            )
            partial = _checkpoint_timing(base)
            if partial:
                out["partial"] = summarise_run({"timing": partial})
            return out
        if res["returncode"] != 0:
            return {
                **out,
                "status": "failed",
                "reason": f"exit status {res['returncode']}: {_tail(res['stderr'], 800)}",
            }
        runs = json.loads((base / "results.json").read_text()).get("runs", [])
    if len(runs) != 1 or not runs[0].get("complete", False):
        return {**out, "status": "failed", "reason": "the runner did not complete the run"}
    out.update(status="ok", wall_s=res["wall_s"], **summarise_run(runs[0]))
    return out


def _checkpoint_timing(base: Path) -> list[dict[str, Any]]:
    """The per-task timing in the runner's newest checkpoint under ``base`` (a stopped run)."""
    ckpts = sorted((base / "checkpoints").glob("*.pt"), key=lambda p: p.stat().st_mtime)
    if not ckpts:
        return []
    try:
        state = torch.load(ckpts[-1], map_location="cpu", weights_only=False)
    except Exception:  # a checkpoint cut mid-write: nothing to report
        return []
    return list(state.get("timing") or [])


# --------------------------------------------------------------------------- IVON/Adam
def ivon_adam_case(dev: torch.device, sizes: Sizes, warmup: int = 5) -> dict[str, Any]:
    """Median step time of Adam and IVON (one draw) at ``sizes.ivon_batch``."""
    from fromp.optim import IVON

    nets = [build_model(sizes.model, dev) for _ in range(2)]
    adam = torch.optim.Adam(nets[0].parameters(), lr=1e-3)
    ivon = IVON(nets[1].parameters(), lr=0.1, ess=50_000)
    x, y = cifar_like(sizes.ivon_batch, dev, seed=1)

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
    for i in range(warmup + sizes.ivon_steps):
        for name, step in (("adam", adam_step), ("ivon", ivon_step)):
            harness.sync(dev)
            t0 = time.perf_counter()
            step()
            harness.sync(dev)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "model": sizes.model,
        "batch": sizes.ivon_batch,
        "steps": sizes.ivon_steps,
        "adam_ms": 1e3 * med["adam"],
        "ivon_ms": 1e3 * med["ivon"],
        "ratio_ivon_adam": med["ivon"] / med["adam"],
    }


# ------------------------------------------------------------------------- distributed
def gpu_count() -> int:
    """GPUs on this machine: the lines of ``nvidia-smi -L`` (torch's count without it)."""
    exe = shutil.which("nvidia-smi")
    if exe:
        try:
            res = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30)
            if res.returncode == 0:
                return sum(1 for ln in res.stdout.splitlines() if ln.strip())
        except (OSError, subprocess.SubprocessError):
            pass
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def distributed_case(
    dev: torch.device, sizes: Sizes, nproc: int | None, seconds: float
) -> dict[str, Any]:
    """``torchrun --nproc_per_node=N`` of :func:`dist_worker`; skipped below 2 processes."""
    n = nproc if nproc is not None else (gpu_count() if dev.type == "cuda" else 0)
    if n < 2:
        where = f"{n} GPU" + ("s" if n != 1 else "") + " on this machine"
        return {
            "status": "skipped",
            "processes": n,
            "reason": f"{where}: the distributed check runs one process per GPU and "
            "needs 2 or more (a two-GPU run waits for a larger machine)",
        }
    launcher = (
        [shutil.which("torchrun")]
        if shutil.which("torchrun")
        else [sys.executable, "-m", "torch.distributed.run"]
    )
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "dist.json"
        cmd = [
            *launcher,
            "--standalone",
            f"--nproc_per_node={n}",
            "-m",
            "fromp_bench.studies.gpu_check",
            "--dist-worker",
            str(result),
            "--device",
            dev.type,
            "--model",
            sizes.model,
            "--n-fit",
            str(sizes.dist_n),
            "--fit-batch",
            str(sizes.fit_batch),
        ]
        shown = shlex.join(
            ["torchrun", *[c if c != str(result) else "OUT.json" for c in cmd[len(launcher) :]]]
        )
        res = run_command(cmd, seconds)
        out: dict[str, Any] = {"command": shown, "processes": n}
        if res["timed_out"]:
            return {**out, "status": "timeout", "reason": f"torchrun ran past {seconds:.0f} s"}
        if res["returncode"] != 0 or not result.exists():
            return {
                **out,
                "status": "failed",
                "reason": f"exit status {res['returncode']}: {_tail(res['stderr'], 800)}",
            }
        got = json.loads(result.read_text())
    bad = [s for s, r in got["structures"].items() if not r["equal"]]
    out.update(got)
    out["status"] = "failed" if bad else "ok"
    if bad:
        out["reason"] = f"the distributed fit differs from one process for {bad}"
    return out


def dist_worker(result: Path, device: str, model_name: str, n: int, fit_batch: int) -> None:
    """One rank of the distributed case (run by ``torchrun``; ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK`` and the rendezvous from the environment). Rank 0 first fits every
    structure on all ``n`` inputs in one process (before the process group exists); then
    each rank fits its ``DistributedSampler`` shard and ``Laplace.fit`` combines them. Rank 0
    writes the single-process and distributed fit times and the largest differences of the
    predictive (16 test inputs) and of the log evidence."""
    from torch.utils.data import DistributedSampler

    from fromp import Laplace

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    n -= n % world  # equal shards: a DistributedSampler pads an uneven split with repeats
    dev = torch.device("cuda", local) if device.startswith("cuda") else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    model = build_model(model_name, dev).eval()
    x, y = cifar_like(n, dev, seed=2)
    xt, _ = cifar_like(16, dev, seed=3)
    structures = ("diag", "kron")

    def fit(structure: str, xs: Tensor, ys: Tensor) -> tuple[Any, float]:
        harness.sync(dev)
        t0 = time.perf_counter()
        la = Laplace(model, "classification", "all", structure).fit(batches(xs, ys, fit_batch))
        harness.sync(dev)
        return la, time.perf_counter() - t0

    ref: dict[str, tuple[Tensor, float, float]] = {}
    if rank == 0:
        for s in structures:
            la, wall = fit(s, x, y)
            ref[s] = (la(xt), float(la.log_marginal_likelihood()), wall)
            del la
    torch.distributed.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    try:
        idx = torch.tensor(list(DistributedSampler(range(n), world, rank, shuffle=False)))
        xs, ys = x[idx.to(dev)], y[idx.to(dev)]
        out: dict[str, Any] = {"world_size": world, "n_fit": n, "structures": {}}
        for s in structures:
            torch.distributed.barrier()
            la, wall = fit(s, xs, ys)
            probs, lml = la(xt), float(la.log_marginal_likelihood())
            if rank == 0:
                p0, lml0, wall0 = ref[s]
                dp = float((probs - p0).abs().max())
                dl = abs(lml - lml0) / max(1.0, abs(lml0))
                out["structures"][s] = {
                    "single_s": wall0,
                    "distributed_s": wall,
                    "max_prob_diff": dp,
                    "lml_rel_diff": dl,
                    "equal": dp <= 1e-4 and dl <= 1e-4,
                }
            del la
        if rank == 0:
            harness.write_json(result, out)
    finally:
        torch.distributed.destroy_process_group()


# ---------------------------------------------------------------------------- targets
def _state(case: dict[str, Any]) -> str:
    """A case's status, with its reason when it has one ('not in this run' when absent)."""
    if not case:
        return "not in this run"
    reason = case.get("reason")
    return f"{case.get('status')}: {reason[:120]}" if reason else str(case.get("status"))


def targets(cases: dict[str, dict[str, Any]], quick: bool) -> dict[str, dict[str, Any]]:
    """The issue's pass/fail flags from the cases so far: ``{"pass": True | False | None,
    "value", "limit", "note"}`` (``None``: not measured, or not at the target's sizes)."""
    out: dict[str, dict[str, Any]] = {}
    why_quick = "quick mode: not at the target's sizes"

    def flag(limit: str, value: Any, ok: bool | None, note: str | None = None) -> dict:
        f: dict[str, Any] = {"limit": limit, "value": value, "pass": None if quick else ok}
        note = why_quick if quick and ok is not None else note
        if note:
            f["note"] = note
        return f

    glm = cases.get("laplace/all/kron", {}).get("glm", {})
    limit = "peak <= 8 GB (8e9 bytes) on 10,000 test inputs"
    if glm.get("status") == "ok" and glm.get("peak_mb") is not None:
        peak = glm["peak_mb"] * 2**20
        value = f"{peak / 1e9:.2f} GB on {glm['n']} inputs"
        if glm["n"] < TARGET_N_PRED:
            out["kron_glm_predictive_peak"] = flag(limit, value, None, f"{glm['n']} inputs")
        else:
            out["kron_glm_predictive_peak"] = flag(limit, value, peak <= KRON_PEAK_LIMIT_BYTES)
    elif glm.get("status") == "oom":
        out["kron_glm_predictive_peak"] = flag(limit, "out of memory", False, glm.get("reason"))
    else:
        out["kron_glm_predictive_peak"] = flag(limit, None, None, f"not measured ({_state(glm)})")

    naive = cases.get("split-mnist/naive", {})
    for name, most in RATIO_LIMITS.items():
        run = cases.get(f"split-mnist/{name}", {})
        limit = f"time <= {most}x Naive's (training and method phases, all tasks)"
        if run.get("status") == "ok" and naive.get("status") == "ok" and naive["total_s"] > 0:
            ratio = run["total_s"] / naive["total_s"]
            out[f"{name}_over_naive"] = flag(limit, ratio, ratio <= most)
            pairs = zip(run["per_task_s"], naive["per_task_s"])
            out[f"{name}_over_naive"]["per_task"] = [a / b if b > 0 else None for a, b in pairs]
        else:
            note = f"not measured ({_state(run)}; naive: {_state(naive)})"
            out[f"{name}_over_naive"] = flag(limit, None, None, note)
    limit = f"per-task time max/min <= {FLAT_LIMIT} over tasks 2..T"
    for name in SPLIT_STRATEGIES:
        run = cases.get(f"split-mnist/{name}", {})
        if run.get("status") == "ok" and run.get("flatness") is not None:
            out[f"{name}_per_task_flat"] = flag(
                limit, run["flatness"], run["flatness"] <= FLAT_LIMIT
            )
        else:
            out[f"{name}_per_task_flat"] = flag(limit, None, None, f"not measured ({_state(run)})")
    return out


# ---------------------------------------------------------------------------- summary
def _num(v: Any, unit: str = "", digits: int = 2) -> str:
    return "–" if v is None else f"{v:.{digits}f}{unit}"


def _measure(m: dict[str, Any]) -> str:
    if m.get("status") != "ok":
        return f"{m.get('status')}: {m.get('reason', '')}"[:160]
    mem = f", {_num(m.get('peak_mb'), ' MB', 0)}" if m.get("peak_mb") is not None else ""
    n = f" ({m['n']} inputs)" if "n" in m else ""
    return f"{_num(m.get('wall_s'), ' s')}{mem}{n}"


def markdown(record: dict[str, Any]) -> str:
    """A short summary of ``record``: the flags, then one line per case."""
    env = record["environment"]
    lines = [
        f"# GPU check, {record['date']}, {env.get('device_name', env.get('device'))}",
        "",
        f"`{record['command']}`; torch {env['torch']}, CUDA {record['cuda']}, "
        f"{'quick' if record['quick'] else 'full'} mode, budget {record['budget_s']:.0f} s, "
        f"{'finished' if record['finished'] else 'NOT finished'} after "
        f"{record['elapsed_s']:.0f} s.",
        "",
        "## Targets (issue 37)",
        "",
        "| target | value | limit | pass |",
        "|---|---|---|---|",
    ]
    for name, t in record["targets"].items():
        v = t.get("value")
        v = f"{v:.3f}" if isinstance(v, float) else (v or t.get("note", "–"))
        mark = {True: "PASS", False: "FAIL", None: "–"}[t.get("pass")]
        lines.append(f"| {name} | {v} | {t['limit']} | {mark} |")
    lines += ["", "## Cases", "", "| case | status | result |", "|---|---|---|"]
    for name, c in record["cases"].items():
        st = c.get("status")
        if name.startswith("laplace/") and "fit" in c:
            res = f"fit {_measure(c['fit'])}; GLM {_measure(c['glm'])}; MC {_measure(c['mc'])}"
        elif name.startswith("split-mnist/") and st == "ok":
            per = ", ".join(f"{s:.1f}" for s in c["per_task_s"])
            res = (
                f"per task (s): {per}; total {c['total_s']:.1f} s; accuracy "
                f"{_num(c.get('mean_accuracy'))}"
            )
        elif name == "tests" and "summary" in c:
            res = c["summary"]
        elif name == "ivon_adam" and st == "ok":
            res = (
                f"Adam {c['adam_ms']:.2f} ms, IVON {c['ivon_ms']:.2f} ms, ratio "
                f"{c['ratio_ivon_adam']:.2f}"
            )
        else:
            res = c.get("reason", "")
        lines.append(f"| {name} | {st} | {str(res)[:300].replace('|', '/')} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ main
def check_device(device: str, quick: bool) -> torch.device:
    """The device, refused in one line when it is not a usable CUDA device (any device
    torch knows with ``--quick``)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"--device must be a torch device such as 'cuda', got {device!r}") from err
    if dev.type != "cuda" and not quick:
        raise ValueError(f"--device {device}: the GPU check needs a CUDA device (or --quick)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine")
    return dev


def device_slug(dev: torch.device) -> str:
    """``nvidia-h100-80gb-hbm3`` from the device's name (``cpu`` on the CPU)."""
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or dev.type


def source_hash() -> str:
    """The runner's ``code.source_hash`` (``fromp_bench.report.code_record``) without importing
    the runner (and Avalanche): SHA-256 over every ``.py`` of fromp, strategies, benchmarks."""
    h = hashlib.sha256()
    files = [
        f
        for pkg in ("fromp", "strategies", "benchmarks")
        for f in sorted((ROOT / pkg).rglob("*.py"))
    ]
    for f in files:
        h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def case_names() -> list[str]:
    """Every case, in the order the check runs them."""
    lap = [f"laplace/{s}/{h}" for s, h in LAPLACE_PAIRS]
    return [
        "tests",
        lap[0],
        *(f"split-mnist/{s}" for s in SPLIT_STRATEGIES),
        "ivon_adam",
        *lap[1:],
        "distributed",
    ]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__name__, __doc__)
    p.add_argument("--device", default="cuda")
    harness.add_data_root(p)
    p.add_argument("--out", type=Path, default=OUT, help="folder of the results")
    p.add_argument("--budget", type=float, default=520.0, help="seconds for the whole check")
    p.add_argument("--quick", action="store_true", help="small sizes (the CPU: tiny)")
    p.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)  # the 0.3 name
    p.add_argument(
        "--cases", default=None, help="comma-separated case names or prefixes (default: all)"
    )
    p.add_argument("--model", default=None, choices=["resnet18", "small-cnn"])
    p.add_argument("--n-fit", type=int, default=None)
    p.add_argument("--n-pred", type=int, default=None)
    p.add_argument("--fit-batch", type=int, default=None)
    p.add_argument(
        "--dist-nproc",
        type=int,
        default=None,
        help="processes of the distributed case (default: the GPUs)",
    )
    p.add_argument("--dist-worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.quick = args.quick or args.smoke
    return args


def sizes_for(args: argparse.Namespace, dev: torch.device) -> Sizes:
    s = (QUICK_CPU if dev.type != "cuda" else QUICK) if args.quick else FULL
    over = {
        k: getattr(args, k)
        for k in ("model", "n_fit", "n_pred", "fit_batch")
        if getattr(args, k) is not None
    }
    for k in ("n_fit", "n_pred", "fit_batch", "dist_nproc"):
        v = getattr(args, k)
        if v is not None and v < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be a positive integer, got {v}")
    return replace(s, **over)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.dist_worker is not None:
        dist_worker(
            args.dist_worker,
            args.device,
            args.model or "resnet18",
            args.n_fit or 2000,
            args.fit_batch or 500,
        )
        return 0
    start = time.monotonic()
    try:
        dev = check_device(args.device, args.quick)
        sizes = sizes_for(args, dev)
        if args.budget <= 0:
            raise ValueError(f"--budget must be a positive number of seconds, got {args.budget}")
        names = case_names()
        if args.cases is not None:
            wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
            unknown = [w for w in wanted if not any(n.startswith(w) for n in names)]
            if unknown:
                raise ValueError(
                    f"--cases: unknown {unknown}, expected names or prefixes of {names}"
                )
            names = [n for n in names if any(n.startswith(w) for w in wanted)]
    except ValueError as err:
        print(f"gpu_check: {err}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    stem = f"{date}-{device_slug(dev)}" + ("-quick" if args.quick else "")
    json_path, md_path = args.out / f"{stem}.json", args.out / f"{stem}.md"
    record: dict[str, Any] = {
        "schema": SCHEMA,
        "command": harness.command(__name__, argv),
        "date": date,
        "environment": harness.environment(dev),
        "cuda": torch.version.cuda,
        "device_count": torch.cuda.device_count() if dev.type == "cuda" else 0,
        "code": {"source_hash": source_hash()},
        "quick": args.quick,
        "budget_s": args.budget,
        "sizes": {k: v for k, v in asdict(sizes).items() if k != "caps"},
        "finished": False,
        "elapsed_s": 0.0,
        "cases": {n: {"status": "pending"} for n in names},
        "targets": {},
    }

    def write() -> None:
        record["elapsed_s"] = time.monotonic() - start
        record["targets"] = targets(record["cases"], args.quick)
        harness.write_json(json_path, record, indent=1)
        md_path.write_text(markdown(record))

    write()
    root = data_root(args.data_root)
    state: dict[str, Any] = {}

    def laplace_data() -> dict[str, Any]:
        if "model" not in state:
            state["model"] = build_model(sizes.model, dev).eval()
            x, y = cifar_like(sizes.n_fit, dev, seed=0)
            xt, _ = cifar_like(sizes.n_pred, dev, seed=1)
            state["data"] = {"x": x, "y": y, "x_test": xt}
        return state

    def run_case(name: str) -> dict[str, Any]:
        left = args.budget - (time.monotonic() - start)
        cap = sizes.caps.get(name, sizes.caps.get(name.split("/")[0], 60.0))
        seconds = min(cap, left)
        if seconds < MIN_CASE_S:
            return not_run(f"the time budget ({args.budget:.0f} s) was spent")
        if name == "tests":
            return tests_case(seconds)
        if name.startswith("laplace/"):
            _, subset, structure = name.split("/")
            st = laplace_data()
            return laplace_case(st["model"], st["data"], subset, structure, sizes, dev, seconds)
        if name.startswith("split-mnist/"):
            return split_case(name.split("/")[1], sizes, args.device, root, seconds)
        if name == "ivon_adam":
            return guarded(lambda: ivon_adam_case(dev, sizes), dev, seconds)
        if name == "distributed":
            return distributed_case(dev, sizes, args.dist_nproc, seconds)
        raise AssertionError(name)

    last_laplace = [n for n in names if n.startswith("laplace/")][-1:] or [None]
    last_laplace = last_laplace[0]
    for name in names:
        t0 = time.monotonic()
        try:
            result = run_case(name)
        except Exception as err:  # a failed case is recorded, the others still run
            result = {"status": "oom" if is_oom(err) else "error", "reason": _reason(err)}
        if name.startswith("laplace/") and name == last_laplace:
            state.clear()  # the model and data of the Laplace cases
        bad = harness.non_finite(result)
        if bad:
            result = {"status": "error", "reason": f"non-finite numbers at {bad[:5]}"}
        result["case_s"] = time.monotonic() - t0
        record["cases"][name] = result
        write()
        print(f"{name}: {result['status']} {json.dumps(result)[:300]}", flush=True)
    state.clear()
    record["finished"] = True
    write()
    print(f"wrote {json_path} and {md_path}")
    failed = [n for n, c in record["cases"].items() if c["status"] not in ("ok", "skipped")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
