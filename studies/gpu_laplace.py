"""The Laplace posteriors, IVON and ``Laplace.fit`` across processes on a GPU (issue 37):
each case written to ``OUT/<date>-<device>-laplace.json`` (and a summary ``.md``) as soon as
it ends. The CUDA tests and the runner's training times are the product's GPU check
(``make gpu-check``, :mod:`fromp_bench.gpu_check`); this study measures the library at scale.

    python -m studies.gpu_laplace [--device cuda] [--budget 520] [--quick] [--cases NAMES]
                                  [--out benchmarks/results/gpu]

The cases, in the order they run (the most telling first, so that a run cut short by its
budget or killed still leaves them):

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
* ``ivon_adam``: one step of ResNet-18 at batch 128 (forward, cross-entropy, backward, step)
  with Adam and with IVON (one posterior draw), interleaved, medians and IVON/Adam.
* ``distributed``: ``torchrun --nproc_per_node=<GPUs>`` (``nvidia-smi -L``) of this module's
  ``--dist-worker``: ``Laplace.fit`` (all weights, diag and kron) over a ``DistributedSampler``
  shard per rank, against rank 0's single-process fit (predictive and evidence); skipped,
  with the reason recorded, on a machine with one GPU.

Every case is guarded: an out-of-memory error, an exception or a case that outruns its time
share is recorded with ``status`` (``oom``, ``error``, ``failed``, ``timeout``, ``skipped``,
``not_run``) and a ``reason``, never with a number, and the other cases still run. Cases not yet
reached are ``pending`` in the file (``finished`` false). ``targets`` holds the issue's flag
(``null`` when not measured at the target's sizes): all-weights kron GLM predictive on 10,000
inputs <= 8 GB (8e9 bytes) peak.

``--budget`` (seconds, default 520) bounds the run: each case runs under ``min(its own cap,
the time left)`` and a case that would start with less than 5 s left is ``not_run``.
``--quick`` runs every case on small sizes (500 inputs; on the CPU a small CNN of the same
input and output shape and 64 / 32 inputs); its flags are ``null`` and its files end in
``-quick``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import math
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
from fromp_bench.gpu_check import _tail, check_device, run_command
from fromp_bench.report import code_record
from torch import Tensor, nn

from studies import harness

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "gpu"
SCHEMA = 2
MIN_CASE_S = 5.0

KRON_PEAK_LIMIT_BYTES = 8e9
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
    ivon_batch: int = 128
    ivon_steps: int = 30
    dist_n: int = 2_000
    caps: dict[str, float] = field(
        default_factory=lambda: {
            "laplace/all/kron": 120.0,
            "laplace": 60.0,
            "ivon_adam": 40.0,
            "distributed": 120.0,
        }
    )


FULL = Sizes()
# fmt: off
QUICK = replace(FULL, n_fit=500, n_pred=500, pilot=50, subnet=200, gp_subset=50, dist_n=200,
                ivon_steps=5)
QUICK_CPU = replace(QUICK, model="small-cnn", n_fit=64, n_pred=32, pilot=8, fit_batch=32,
                    mc_samples=2, subnet=50, low_rank=2, gp_subset=8, ivon_batch=8,
                    ivon_steps=2, dist_n=32)
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
            "studies.gpu_laplace",
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
        "## Target (issue 37)",
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
def device_slug(dev: torch.device) -> str:
    """``nvidia-h100-80gb-hbm3`` from the device's name (``cpu`` on the CPU)."""
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or dev.type


def case_names() -> list[str]:
    """Every case, in the order the check runs them."""
    lap = [f"laplace/{s}/{h}" for s, h in LAPLACE_PAIRS]
    return [lap[0], "ivon_adam", *lap[1:], "distributed"]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__name__, __doc__)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, default=OUT, help="folder of the results")
    p.add_argument("--budget", type=float, default=520.0, help="seconds for the whole check")
    p.add_argument("--quick", action="store_true", help="small sizes (the CPU: tiny)")
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
    return p.parse_args(argv)


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
        if not (math.isfinite(args.budget) and args.budget > 0):
            raise ValueError(f"--budget must be a finite number of seconds > 0, got {args.budget}")
        if args.out.exists() and not args.out.is_dir():
            raise ValueError(f"--out {args.out}: is a file, expected a folder")
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
        print(f"gpu_laplace: {err}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    stem = f"{date}-{device_slug(dev)}-laplace" + ("-quick" if args.quick else "")
    json_path, md_path = args.out / f"{stem}.json", args.out / f"{stem}.md"
    record: dict[str, Any] = {
        "schema": SCHEMA,
        "command": harness.command(__name__, argv),
        "date": date,
        "environment": harness.environment(dev),
        "cuda": torch.version.cuda,
        "device_count": torch.cuda.device_count() if dev.type == "cuda" else 0,
        "code": {"source_hash": code_record()["source_hash"]},
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
        if name.startswith("laplace/"):
            _, subset, structure = name.split("/")
            st = laplace_data()
            return laplace_case(st["model"], st["data"], subset, structure, sizes, dev, seconds)
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
