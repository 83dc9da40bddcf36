"""The runner's machinery: its own Avalanche plugins and metrics (predictions collected for
accuracy, NLL and ECE; a guard that stops a run whose loss or weights become non-finite;
progress, bars on a terminal and one line per task in a log; the optimizer state restored on
resume; the method plugins' phase timings), its output directory (checked writable before
any work, held by a lock file) and its checkpoint files (written atomically
with a SHA-256 beside them, verified on reading, holding only tensors and plain containers
and read with ``weights_only=True``: a checkpoint never runs code)."""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from avalanche.core import SupervisedPlugin
from avalanche.training.plugins import EvaluationPlugin
from fromp_avalanche.checkpoint import CheckpointError as _BaseCheckpointError
from fromp_avalanche.checkpoint import read_checked, write_checked
from torch import Tensor
from tqdm.auto import tqdm

__all__ = [
    "CHECKPOINT_VERSION",
    "MIN_FREE_BYTES",
    "CheckpointError",
    "NonFiniteError",
    "UsageError",
    "check_out",
    "check_report_files",
    "check_writable_run_dirs",
    "expected_calibration_error",
    "method_plugins",
    "out_lock",
]


class CheckpointError(_BaseCheckpointError):
    """A checkpoint that cannot be read or belongs to another run (one-line message)."""


#: Version 4: the state is tensors and plain containers only (NumPy's RNG keys as a tensor,
#: a plugin's attributes encoded by :func:`_plain`), with the CUDA generators' states.
#: Version 3 files (NumPy RNG array, no CUDA states) are still read when they need no code.
CHECKPOINT_VERSION = 4
_READABLE_VERSIONS = (3, 4)


class NonFiniteError(RuntimeError):
    """A loss, weight or prediction became NaN or infinite: the run failed."""


def expected_calibration_error(probs: Tensor, y: Tensor, n_bins: int = 15) -> float:
    """ECE: ``sum_b |B_b| / N * |acc(B_b) - conf(B_b)|`` over equal-width confidence bins.

    Args:
        probs: ``[N, C]`` predicted class probabilities.
        y: ``[N]`` labels.

    Returns:
        The ECE in [0, 1]; NaN when any probability is not finite (such predictions fall in
        no bin, so they must not be averaged away).
    """
    if not bool(torch.isfinite(probs).all()):
        return math.nan
    conf, pred = probs.max(dim=1)
    correct = (pred == y).double()
    edges = torch.linspace(0, 1, n_bins + 1, dtype=conf.dtype)
    ece = 0.0
    for lo, hi in itertools.pairwise(edges):
        mask = (conf > lo) & (conf <= hi)
        if mask.any():
            ece += mask.double().mean().item() * abs(
                correct[mask].mean().item() - conf[mask].double().mean().item()
            )
    return ece


class _Collector(SupervisedPlugin):
    """Keeps the softmax outputs and labels of every evaluated experience."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: dict[int, list[tuple[Tensor, Tensor]]] = {}

    def before_eval(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        self.outputs = {}

    def after_eval_iteration(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        exp = strategy.experience.current_experience
        probs = torch.softmax(strategy.mb_output.detach().double(), dim=1).cpu()
        self.outputs.setdefault(exp, []).append((probs, strategy.mb_y.detach().cpu()))

    def metrics(self, split: str = "test") -> dict[int, dict[str, float]]:
        """Accuracy (%), NLL and ECE per evaluated experience.

        Raises:
            NonFiniteError: a predicted probability is NaN or infinite (the metrics would
                hide it: NaN is never the argmax and falls in no ECE bin).
        """
        out = {}
        for exp, chunks in self.outputs.items():
            probs = torch.cat([p for p, _ in chunks])
            y = torch.cat([t for _, t in chunks])
            if not bool(torch.isfinite(probs).all()):
                bad = int((~torch.isfinite(probs)).any(1).sum())
                raise NonFiniteError(
                    f"{bad} of {len(y)} predictions on task {exp + 1}'s {split} set are not finite"
                )
            p_true = probs[torch.arange(len(y)), y].clamp_min(1e-12)
            out[exp] = {
                "accuracy": 100.0 * (probs.argmax(1) == y).double().mean().item(),
                "nll": -p_true.log().mean().item(),
                "ece": expected_calibration_error(probs, y),
            }
        return out


class _Guard(SupervisedPlugin):
    """Stops training at a non-finite loss, and after each experience when a weight is not
    finite. The loss is checked on the device: a flag accumulated without a host
    synchronisation, read every ``every`` iterations and at the end of each epoch (so a GPU
    run does not wait for the device at every step), and the error says between which
    iterations the loss became non-finite."""

    def __init__(self, every: int = 50) -> None:
        super().__init__()
        self.every, self.ok, self.since = every, None, 0

    def after_training_iteration(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        loss = strategy.loss
        if not isinstance(loss, Tensor):
            return
        finite = torch.isfinite(loss.detach()).all()
        self.ok = finite if self.ok is None else self.ok & finite
        it = strategy.clock.train_epoch_iterations + 1
        if it % self.every == 0:
            self._check(strategy, it)

    def after_training_epoch(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        self._check(strategy, strategy.clock.train_epoch_iterations)

    def _check(self, strategy: Any, it: int) -> None:
        if self.ok is not None and not bool(self.ok):
            epoch = strategy.clock.train_exp_epochs + 1
            raise NonFiniteError(
                f"training loss is not finite at epoch {epoch}, iteration "
                f"{max(self.since, 1)}-{max(it, 1)}"
            )
        self.ok, self.since = None, it + 1

    def before_training_epoch(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        self.ok, self.since = None, 1

    def after_training_exp(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        for name, p in strategy.model.named_parameters():
            if not bool(torch.isfinite(p).all()):
                raise NonFiniteError(f"weights {name} are not finite after training")


class _Progress(SupervisedPlugin):
    """Progress of each experience: a tqdm bar over its training iterations (with the loss)
    on a terminal; one line per experience (iterations, last loss, seconds) when the output
    goes to a file or pipe, so that a log holds no bar updates."""

    def __init__(self, label: str, enabled: bool = True, stream: Any = None) -> None:
        super().__init__()
        self.label, self.enabled, self.bar = label, enabled, None
        self.stream = sys.stderr if stream is None else stream
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0, self.iterations = 0.0, 0

    def _what(self, strategy: Any) -> str:
        exp = strategy.experience.current_experience
        return "all tasks" if getattr(strategy, "_is_joint", False) else f"task {exp + 1}"

    def before_training_exp(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        self.t0, self.iterations = time.perf_counter(), 0
        if self.enabled and self.tty:
            total = strategy.train_epochs * len(strategy.dataloader)
            self.bar = tqdm(total=total, desc=f"{self.label} {self._what(strategy)}",
                            leave=False, mininterval=1.0, file=self.stream)  # fmt: skip

    def after_training_iteration(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        self.iterations += 1
        if self.bar is not None:
            self.bar.update(1)
            if self.bar.n % 20 == 0:
                self.bar.set_postfix(loss=f"{float(strategy.loss.detach()):.4f}")

    def after_training_exp(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.enabled:
            loss = strategy.loss
            shown = f", last loss {float(loss.detach()):.4f}" if isinstance(loss, Tensor) else ""
            print(
                f"{self.label} {self._what(strategy)}: {self.iterations} iterations{shown}, "
                f"{time.perf_counter() - self.t0:.1f} s",
                file=self.stream,
                flush=True,
            )


class _RestoreOptimizer(SupervisedPlugin):
    """Loads a checkpointed optimizer state once, after Avalanche has (re)built the optimizer
    for the first experience of a resumed run."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: dict[str, Any] | None = None

    def before_training_exp(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        if self.pending is not None:
            strategy.optimizer.load_state_dict(self.pending)
            self.pending = None


class _StepSchedule(SupervisedPlugin):
    r"""A step size set before every iteration of each experience, restarted at the next:
    a cosine :math:`\eta_t = \tfrac12 \eta (1 + \cos(\pi t / T))` at iteration ``t`` of the
    experience (``cosine=True``) or the constant :math:`\eta`, after an optional linear
    warm-up over the first :math:`W = \max(1, \lfloor w T \rfloor)` iterations
    (``warmup`` :math:`= w > 0`): :math:`\eta_t = \eta (t + 1) / W` for :math:`t < W`,
    then the cosine over the remaining :math:`T - W`, :math:`\tfrac12 \eta (1 + \cos(\pi
    (t - W) / (T - W)))`. ``T`` = epochs x mini-batches per epoch (counted when the
    experience's first epoch starts) and ``eta`` the run's ``lr``. Set in every parameter
    group, so a resumed optimizer (whose state holds the last step size) follows the
    schedule too; the plugin keeps no state of its own.

    The warm-up keeps the first steps on a new task small while Adam's second-moment
    estimate still holds the previous task's converged (small) gradients, whose steps
    ``m / sqrt(v)`` would otherwise start at many times the step size."""

    def __init__(self, lr: float, warmup: float = 0.0, cosine: bool = True) -> None:
        super().__init__()
        self.lr, self.total = float(lr), 1
        self.warmup, self.cosine = float(warmup), bool(cosine)

    def before_training_epoch(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        if strategy.clock.train_exp_epochs == 0:
            self.total = max(1, len(strategy.dataloader) * int(strategy.train_epochs))

    def step_size(self, t: int) -> float:
        """The step size at iteration ``t`` of an experience of :attr:`total` iterations."""
        t = min(t, self.total)
        w = max(1, int(self.warmup * self.total)) if self.warmup > 0 else 0
        if t < w:
            return self.lr * (t + 1) / w
        if not self.cosine:
            return self.lr
        return 0.5 * self.lr * (1.0 + math.cos(math.pi * (t - w) / max(1, self.total - w)))

    def before_training_iteration(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        lr = self.step_size(strategy.clock.train_exp_iterations)
        for group in strategy.optimizer.param_groups:
            group["lr"] = lr


LR_SCHEDULES = ("constant", "cosine")


def lr_schedule_plugins(schedule: str, lr: float, warmup: float = 0.0) -> list[SupervisedPlugin]:
    """The runner's plugins for ``lr_schedule`` (:data:`LR_SCHEDULES`) and ``lr_warmup`` (the
    share ``w`` of each experience's iterations, ``0 <= w < 1``, over which the step size
    rises linearly to ``lr``): none for ``"constant"`` without warm-up, else
    :class:`_StepSchedule`."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}, got {schedule!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int | float) or not 0 <= warmup < 1:
        raise ValueError(f"lr_warmup must be a number in [0, 1), got {warmup!r}")
    if schedule == "constant" and warmup == 0:
        return []
    return [_StepSchedule(lr, warmup=warmup, cosine=schedule == "cosine")]


class _ResetOptimizerState(SupervisedPlugin):
    r"""Clears the optimizer's per-parameter state before each experience: Adam's moment
    estimates :math:`m, v` and its step count start again, so that the first steps on a new
    task are bias-corrected estimates of the new task's gradients instead of
    :math:`m / \sqrt{v}` with :math:`v` from the previous task's converged end (small
    gradients, hence large steps until :math:`v` catches up). The step size and the other
    hyperparameters (``param_groups``) are kept. Runs after the state a resumed run loads
    (:class:`_RestoreOptimizer` comes first), so a run resumed at an experience clears it as
    the uninterrupted one does; the first experience's state is empty either way."""

    def before_training_exp(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        strategy.optimizer.state.clear()


OPTIMIZER_STATES = ("keep", "reset")
# optimizers whose state is their posterior (VOGN's and IVON's curvature estimates): a reset
# would throw the posterior away, not an optimisation detail
_STATEFUL_POSTERIORS = ("vogn", "ivon")


def optimizer_state_plugins(mode: str, optimizer: str) -> list[SupervisedPlugin]:
    """The runner's plugins for ``optimizer_state`` (:data:`OPTIMIZER_STATES`): none for
    ``"keep"`` (the state carries over from one experience to the next, Avalanche's way),
    :class:`_ResetOptimizerState` for ``"reset"`` (``adam`` and ``sgd`` only: VOGN's and
    IVON's state is their posterior)."""
    if mode == "keep":
        return []
    if mode == "reset":
        if optimizer in _STATEFUL_POSTERIORS:
            raise ValueError(
                f"optimizer_state=reset needs optimizer adam or sgd, got {optimizer!r} (its "
                "state is its posterior)"
            )
        return [_ResetOptimizerState()]
    raise ValueError(f"optimizer_state must be one of {', '.join(OPTIMIZER_STATES)}, got {mode!r}")


_OWN = (_Collector, _Guard, _Progress, _RestoreOptimizer, _StepSchedule, _ResetOptimizerState)


def method_plugins(strategy: Any) -> dict[str, Any]:
    """The strategy's own plugins (not the runner's, not the evaluator), keyed by class
    name; a repeated class gets ``#2``, ``#3``... in plugin order."""
    out: dict[str, Any] = {}
    for p in strategy.plugins:
        if isinstance(p, (*_OWN, EvaluationPlugin)) or p is strategy.evaluator:
            continue
        name, k = type(p).__name__, 1
        while (name if k == 1 else f"{name}#{k}") in out:
            k += 1
        out[name if k == 1 else f"{name}#{k}"] = p
    return out


def _plugin_state(plugin: Any) -> dict[str, Any]:
    """A plugin's state as tensors and plain containers: its ``state_dict()``, or (a plugin
    without one, e.g. Avalanche's EWC) its attributes encoded by :func:`_plain`."""
    if hasattr(plugin, "state_dict"):
        return {"state_dict": plugin.state_dict()}
    return {"vars": {k: _plain(v, f"{type(plugin).__name__}.{k}") for k, v in vars(plugin).items()}}


_PLAIN = (Tensor, str, int, float, bool, type(None))
_FACTORIES = {"dict": dict, "list": list, "int": int, "float": float, "set": set}


def _plain(value: Any, where: str) -> Any:
    """``value`` as tensors and plain containers (readable with ``weights_only=True``):
    ``defaultdict`` of a builtin factory, Avalanche's ``ParamData``, ``torch.Size`` and
    ``torch.device`` are tagged dicts that :func:`_unplain` turns back.

    Raises:
        CheckpointError: a value of another type (named by ``where``), which a checkpoint
            could only hold as code.
    """
    from collections import defaultdict

    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, torch.Size):
        return {"__plain__": "Size", "value": [int(d) for d in value]}
    if isinstance(value, torch.device):
        return {"__plain__": "device", "value": str(value)}
    if isinstance(value, defaultdict):
        name = getattr(value.default_factory, "__name__", None)
        if _FACTORIES.get(name) is not value.default_factory:
            raise CheckpointError(f"{where}: a defaultdict of {value.default_factory!r} cannot "
                                  "be checkpointed (builtin factories only)")  # fmt: skip
        items = [[_plain(k, where), _plain(v, where)] for k, v in value.items()]
        return {"__plain__": "defaultdict", "factory": name, "items": items}
    if isinstance(value, dict):
        if all(isinstance(k, str | int) for k in value) and "__plain__" not in value:
            return {k: _plain(v, f"{where}[{k!r}]") for k, v in value.items()}
        return {"__plain__": "dict", "items": [[_plain(k, where), _plain(v, where)]
                                               for k, v in value.items()]}  # fmt: skip
    if isinstance(value, list):
        return [_plain(v, where) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v, where) for v in value)
    if isinstance(value, set | frozenset):
        return {"__plain__": "set", "items": [_plain(v, where) for v in value]}
    if type(value).__name__ == "ParamData" and isinstance(getattr(value, "data", None), Tensor):
        return {"__plain__": "ParamData", "name": value.name, "data": value.data}
    raise CheckpointError(f"{where}: a {type(value).__name__} cannot be checkpointed (tensors "
                          "and plain containers only); give the plugin a state_dict()")  # fmt: skip


def _unplain(value: Any, device: torch.device | str = "cpu") -> Any:
    """Inverse of :func:`_plain` (``ParamData`` tensors moved to ``device``)."""
    from collections import defaultdict

    if isinstance(value, list):
        return [_unplain(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_unplain(v, device) for v in value)
    if not isinstance(value, dict):
        return value
    kind = value.get("__plain__")
    if kind is None:
        return {k: _unplain(v, device) for k, v in value.items()}
    if kind == "Size":
        return torch.Size(value["value"])
    if kind == "device":
        return torch.device(value["value"])
    if kind == "set":
        return {_unplain(v, device) for v in value["items"]}
    pairs = [(_unplain(k, device), _unplain(v, device)) for k, v in value.get("items", [])]
    if kind == "defaultdict":
        return defaultdict(_FACTORIES[value["factory"]], pairs)
    if kind == "dict":
        return dict(pairs)
    if kind == "ParamData":
        from avalanche.training.utils import ParamData

        data = value["data"].to(device)
        return ParamData(value["name"], init_tensor=data, device=data.device)
    raise CheckpointError(f"unknown plain-encoded kind {kind!r} in a checkpoint")


def _phase_times(strategy: Any, before: dict[str, int]) -> dict[str, float]:
    """Seconds the method plugins spent in memorable selection, curvature and kernel set-up
    during the last experience (from the ``timings`` lists they keep, e.g. FROMP's)."""
    out = {"memorable_s": 0.0, "curvature_s": 0.0, "kernel_s": 0.0}
    for name, p in method_plugins(strategy).items():
        timings = getattr(p, "timings", None)
        if not isinstance(timings, list):
            continue
        for t in timings[before.get(name, 0) :]:
            out["memorable_s"] += float(t.get("select_s", 0.0))
            out["curvature_s"] += float(t.get("curvature_s", 0.0))
            out["kernel_s"] += float(t.get("kernel_s", 0.0))
    return out


def _timing_counts(strategy: Any) -> dict[str, int]:
    return {
        name: len(p.timings)
        for name, p in method_plugins(strategy).items()
        if isinstance(getattr(p, "timings", None), list)
    }


def _summarise(
    matrix: list[list[float | None]], final: dict[int, dict[str, float]], n_tasks: int
) -> dict[str, Any]:
    last = matrix[-1]
    accs = [a for a in last if a is not None]
    out: dict[str, Any] = {
        "final_accuracies": last,
        "mean_accuracy": float(np.mean(accs)),
        "mean_nll": float(np.mean([m["nll"] for m in final.values()])),
        "mean_ece": float(np.mean([m["ece"] for m in final.values()])),
    }
    if len(matrix) == n_tasks and n_tasks > 1:
        # forgetting: best earlier accuracy minus final accuracy; BWT: final minus just-learned.
        forget, bwt = [], []
        for k in range(n_tasks - 1):
            history = [matrix[j][k] for j in range(k, n_tasks - 1)]
            best = max(a for a in history if a is not None)
            forget.append(best - last[k])
            bwt.append(last[k] - matrix[k][k])
        out["forgetting"] = float(np.mean(forget))
        out["backward_transfer"] = float(np.mean(bwt))
    else:
        out["forgetting"] = out["backward_transfer"] = None
    return out


def _write_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Atomic and checked (:func:`fromp_avalanche.checkpoint.write_checked`): the bytes go to a
    temporary file, are flushed to disk and then renamed over ``path``; their SHA-256 goes to
    ``path.sha256`` (written the same way), which :func:`_read_checkpoint` verifies. A crash
    leaves the previous checkpoint whole."""
    try:
        write_checked(path, state)
    except _BaseCheckpointError as err:
        raise CheckpointError(str(err)) from err


def _read_checkpoint(path: Path, device: str = "cpu") -> dict[str, Any]:
    """A checkpoint's content, read on the CPU with ``weights_only=True`` whatever the run's
    device (RNG states must stay CPU byte tensors; the caller moves what belongs on the
    device); :class:`CheckpointError` (one line, naming the file) when it is a directory,
    empty, has no or another checksum, needs code to load, is truncated, is not a checkpoint
    or is of another checkpoint version."""
    hint = "delete it or drop --resume"
    try:
        state = read_checked(path, hint=hint)
    except _BaseCheckpointError as err:
        raise CheckpointError(str(err)) from err
    if not isinstance(state, dict) or "config" not in state or "model" not in state:
        raise CheckpointError(f"{path} is not a fromp-bench checkpoint (no model/config)")
    if state.get("version") not in _READABLE_VERSIONS:
        raise CheckpointError(
            f"checkpoint {path} has format version {state.get('version')}, this fromp-bench "
            f"writes version {CHECKPOINT_VERSION}; {hint}"
        )
    return state


def _check_key(path: Path, state: Mapping[str, Any], key: Mapping[str, Any]) -> None:
    old = state["config"]
    diff = [k for k in sorted(set(old) | set(key)) if old.get(k) != key.get(k)]
    if diff:
        parts = []
        for k in diff:
            a, b = _short(old.get(k)), _short(key.get(k))
            parts.append(f"{k} {a} (checkpoint) vs {b} (now)")
        raise CheckpointError(
            f"checkpoint {path} was written by a different run: {'; '.join(parts)}; "
            "delete it or drop --resume"
        )


#: What a runner checkpoint holds, and the type of each entry.
_CHECKPOINT_ENTRIES = {"config": Mapping, "done": int, "model": Mapping, "plugins": Mapping,
                       "optimizer": Mapping, "rng": Mapping, "matrix": list,
                       "valid_matrix": list, "metrics": Mapping, "timing": list,
                       "elapsed": float}  # fmt: skip


def _check_content(
    path: Path, state: Mapping[str, Any], steps: int, n_tasks: int, model: Any, valid: bool
) -> None:
    """A checksummed checkpoint's entries, before anything is restored: each present and of
    its type, ``0 <= done <= steps``, ``done`` rows of ``n_tasks`` accuracies (as many
    validation rows with a split, none without) and timing entries, the model's weight names
    and shapes, the RNG states; :class:`CheckpointError` names the path and the entry."""
    from fromp_avalanche.checkpoint import _check_weights

    hint = "delete it or drop --resume"
    missing = [k for k in _CHECKPOINT_ENTRIES if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path} is missing keys {missing}; {hint}")
    for key, kind in _CHECKPOINT_ENTRIES.items():
        value = state[key]
        number = isinstance(value, int | float) and not isinstance(value, bool)
        ok = number if kind is float else isinstance(value, kind) and not isinstance(value, bool)
        if not ok:
            raise CheckpointError(f"checkpoint {path}: {key} is a {type(value).__name__}, "
                                  f"expected a {kind.__name__}; {hint}")  # fmt: skip
    done = state["done"]
    if not 0 <= done <= steps:
        raise CheckpointError(f"checkpoint {path}: done={done}, expected 0 <= done <= {steps} "
                              f"(the run's training steps); {hint}")  # fmt: skip
    rows = {"matrix": done, "valid_matrix": done if valid else 0, "timing": done}
    for key, want in rows.items():
        if len(state[key]) != want:
            raise CheckpointError(f"checkpoint {path}: {key} has {len(state[key])} entries, "
                                  f"expected {want} (done={done}); {hint}")  # fmt: skip
    for key in ("matrix", "valid_matrix"):
        for row in state[key]:
            cells = isinstance(row, list) and len(row) == n_tasks
            if not cells or not all(a is None or isinstance(a, float) for a in row):
                raise CheckpointError(f"checkpoint {path}: a row of {key} is {_short(row)}, "
                                      f"expected {n_tasks} accuracies or None; {hint}")  # fmt: skip
    if not math.isfinite(state["elapsed"]) or state["elapsed"] < 0:
        raise CheckpointError(f"checkpoint {path}: elapsed={state['elapsed']}; {hint}")
    absent = [k for k in ("python", "numpy", "torch") if k not in state["rng"]]
    if absent:
        raise CheckpointError(f"checkpoint {path}: rng is missing {absent}; {hint}")
    try:
        _check_weights(model, state["model"], path)
    except _BaseCheckpointError as err:
        raise CheckpointError(f"{err}; {hint}") from None


def _short(value: Any) -> str:
    if isinstance(value, Mapping) and "hash" in value:
        return f"data hash {value['hash']}"
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


# ----------------------------------------------------------------------- the output directory
class UsageError(ValueError):
    """A command-line value that cannot be used."""


def _check_writable(d: Path, name: str) -> None:
    """Create ``d`` and write a file there; a ``UsageError`` starting with ``name`` if not."""
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d, prefix=".write-test-"):
            pass
    except OSError as err:
        raise UsageError(f"{name}: cannot write there ({err.strerror or err})") from err


def check_out(out: Path) -> None:
    """Refuse an output directory that is a file or cannot be written."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: is a file, expected a directory")
    _check_writable(out, f"--out {out}")
    if not os.access(out, os.W_OK):
        raise UsageError(f"--out {out}: cannot write there (no write permission)")


#: Free space below which a run is refused before training (checkpoints of the paper's
#: networks are a few MB each; a full disk would lose the task being trained).
MIN_FREE_BYTES = 200 * 2**20


def check_writable_run_dirs(base: Path) -> None:
    """Before any training: ``base/checkpoints`` and ``base/runs`` exist and can be written,
    and the disk has at least :data:`MIN_FREE_BYTES` free (a one-line ``UsageError`` naming
    the directory otherwise)."""
    import shutil

    for sub in ("checkpoints", "runs"):
        _check_writable(base / sub, str(base / sub))
    check_report_files(base)
    free = shutil.disk_usage(base).free
    if free < MIN_FREE_BYTES:
        raise UsageError(
            f"{base}: only {free / 2**20:.0f} MB free on its disk, under the "
            f"{MIN_FREE_BYTES / 2**20:.0f} MB a run needs for its checkpoints; free some space"
        )


REPORT_FILES = ("results.json", "report.md", "accuracy.png")


def check_report_files(base: Path) -> None:
    """Before any work: ``base`` can be written and none of :data:`REPORT_FILES` is a
    directory or a file that cannot be written (one-line ``UsageError`` naming it)."""
    if not os.access(base, os.W_OK):
        raise UsageError(f"{base}: cannot write there (no write permission)")
    for name in REPORT_FILES:
        f = base / name
        if f.is_dir():
            raise UsageError(f"{f}: is a directory, expected the report file; move it")
        if f.exists() and not os.access(f, os.W_OK):
            raise UsageError(f"{f}: cannot be written (no write permission)")


@contextlib.contextmanager
def out_lock(base: Path) -> Iterator[None]:
    """Hold ``base/.lock`` (the process id) while a job writes into ``base``: a second job
    into the same directory is refused in one line; a lock left by a process that no longer
    runs is taken over."""
    base.mkdir(parents=True, exist_ok=True)
    lock = base / ".lock"
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                pid = int(lock.read_text().strip() or 0)
            except (OSError, ValueError):
                pid = 0
            if pid and pid != os.getpid() and _alive(pid):
                raise UsageError(
                    f"--out {base.parent}: another fromp-bench (pid {pid}) is writing to "
                    f"{base}; wait for it or use another --out"
                ) from None
            lock.unlink(missing_ok=True)  # stale: its process is gone
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        break
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _DataParallel(SupervisedPlugin):
    """Data parallelism on ``torch.distributed`` for the runner (one process per rank, each
    holding its shard of every experience as the experience itself, see
    :func:`fromp_bench.runner.run`).

    Avalanche 0.6 shards its loaders with a ``DistributedSampler`` whenever
    ``torch.distributed`` is initialised but leaves the gradients alone; here the loaders are
    rebuilt without that sampler (the training data are already the rank's shard and every
    rank evaluates the whole test sets, so that rank 0's metrics are those of one process),
    and after every backward pass the gradients are averaged over the ranks, one all-reduce
    per step: what ``DistributedDataParallel`` does, without its reducer, which refuses the
    parameters that only a penalty reaches (the old heads FROMP and EWC regularise).
    Batch-norm running statistics stay per rank."""

    supports_distributed = True

    def before_training_exp(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        from avalanche.benchmarks.utils.data_loader import TaskBalancedDataLoader

        common = strategy._obtain_common_dataloader_parameters(
            batch_size=strategy.train_mb_size,
            num_workers=0,
            shuffle=True,
            pin_memory=None,
            persistent_workers=False,
            drop_last=False,
        )
        strategy.dataloader = TaskBalancedDataLoader(
            strategy.adapted_dataset,
            oversample_small_groups=True,
            distributed_sampling=False,
            **common,
        )

    def before_eval_exp(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        from avalanche.benchmarks.utils.data_loader import (
            SingleDatasetDataLoader,
            collate_from_data_or_kwargs,
        )

        common = strategy._obtain_common_dataloader_parameters(
            batch_size=strategy.eval_mb_size,
            num_workers=0,
            shuffle=False,
            pin_memory=None,
            persistent_workers=False,
        )
        collate_from_data_or_kwargs(strategy.adapted_dataset, common)
        strategy.dataloader = SingleDatasetDataLoader(
            strategy.adapted_dataset, distributed_sampling=False, **common
        )

    def after_backward(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        from fromp import distributed

        # the same parameters have a gradient on every rank (one model, one code path); those
        # without one (another task's head) keep None, as in one process (Adam skips them)
        grads = [p.grad for p in strategy.model.parameters() if p.grad is not None]
        distributed.all_reduce_sum(grads)
        for g in grads:
            g.div_(distributed.world_size())
