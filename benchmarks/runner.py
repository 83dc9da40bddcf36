"""Run one strategy on one benchmark with one seed, with checkpoints and full metrics.

The loop is Avalanche's: the task sequence becomes an Avalanche benchmark
(:func:`fromp_bench.data.to_avalanche`), the strategy is an Avalanche
``SupervisedTemplate``, and after every experience the strategy is evaluated on the test sets
of all tasks seen so far. A plugin collects the predicted probabilities during evaluation, so
accuracy, negative log-likelihood and expected calibration error come from the same outputs
Avalanche's own metrics see.

After every experience a checkpoint holds the model, the strategy's method state (its
plugins' ``state_dict``, keyed by plugin class name), the optimizer state, the random-number
generators and the metrics so far; :func:`run` with ``resume=True`` continues from it and ends
with the same results as an uninterrupted run. The checkpoint is keyed by the run's settings,
the data root and a fingerprint of the data (:meth:`fromp_bench.data.TaskSequence.fingerprint`):
resuming with any of them changed is refused.

Integrity: a non-finite loss, weight or predicted probability stops the run; the result is
marked ``failed`` with the task where it happened and never enters a table.

With ``valid_fraction`` each task's training data is split (:meth:`~fromp_bench.data.TaskSequence.
with_validation`) and the validation sets are evaluated after every experience too, under a
forked random-number generator so that the test results do not depend on it.

Data parallelism: launched by ``torchrun --nproc_per_node=R`` (``WORLD_SIZE > 1``; one
machine or several), :func:`run` joins the process group (gloo on the CPU, NCCL on CUDA with
one GPU per local rank), gives rank ``r`` the examples ``r, r + R, ...`` of every task's
training set (each task cut to a multiple of ``R`` examples, so every rank takes the same
number of steps) with mini-batches of ``train_mb_size / R`` and averages the gradients over
the ranks after every backward pass (:class:`fromp_bench.plugins._DataParallel`): a global
mini-batch of ``train_mb_size``. Every rank is seeded with the run's seed (the same initial
weights), evaluates the whole test sets and returns the same metrics; only rank 0 writes the
checkpoint. FROMP's and EWC's after-experience steps combine the ranks' shards
(:mod:`fromp.distributed`); other plugins (VCL's coreset, VOGN's and IVON's ``ess``) see
their rank's shard. ``torchrun --nproc_per_node=1`` and plain runs are the one-process run.
"""

from __future__ import annotations

import inspect
import math
import os
import random
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from avalanche.evaluation.metrics import accuracy_metrics
from avalanche.training.plugins import EvaluationPlugin
from fromp_avalanche.checkpoint import get_rng_state, set_rng_state
from fromp_avalanche.models import as_avalanche_model
from fromp_bench.data import Task, TaskSequence, resolve_data_root, to_avalanche
from fromp_bench.plugins import (
    CHECKPOINT_VERSION,
    CheckpointError,
    NonFiniteError,
    _check_content,
    _check_key,
    _Collector,
    _DataParallel,
    _Guard,
    _phase_times,
    _plugin_state,
    _Progress,
    _read_checkpoint,
    _RestoreOptimizer,
    _summarise,
    _timing_counts,
    _unplain,
    _write_checkpoint,
    expected_calibration_error,
    lr_schedule_plugins,
    method_plugins,
    optimizer_state_plugins,
)
from fromp_bench.registry import BenchmarkSpec, StrategySpec, get_benchmark, get_strategy
from fromp_bench.report import code_record, env_record, kwarg_defaults
from torch import Tensor, nn

from fromp import distributed
from fromp.optim.ivon import DEFAULT_BETAS

__all__ = [
    "CheckpointError",
    "NonFiniteError",
    "RunConfig",
    "SettingsError",
    "check_device",
    "check_sequence",
    "data_root_of",
    "expected_calibration_error",
    "load_sequence",
    "method_plugins",
    "resolve_settings",
    "run",
    "validate_settings",
]

OPTIMIZERS = ("adam", "sgd", "vogn", "ivon")


class SettingsError(ValueError):
    """A setting that cannot be used; the message names it and what was expected."""


@dataclass
class RunConfig:
    """What to run.

    Attributes:
        benchmark: a name from :data:`fromp_bench.registry.BENCHMARKS`.
        strategy: a name from :data:`fromp_bench.registry.STRATEGIES`.
        seed: seeds Python, NumPy and PyTorch (model init, data order, sampling).
        data_root: data root (``--data-root``; None: ``$FROMP_DATA`` or ``./data``).
        device: torch device string.
        overrides: settings that win over all defaults (``lr``, ``train_epochs``,
            ``train_mb_size``, ``optimizer``, ``lr_schedule`` (``"constant"``, the default,
            or ``"cosine"`` within each experience), ``lr_warmup`` (the share of each
            experience's iterations over which the step size rises linearly to ``lr``; 0,
            the default, none), ``optimizer_state`` (``"keep"``, the
            default, or ``"reset"`` before each experience), and ``kwargs`` for the strategy
            class).
        n_train, n_test: keep this many train / test examples per task (quick runs).
        checkpoint: file to checkpoint to after every experience (None: no checkpoints).
        resume: continue from ``checkpoint`` when it exists.
        stop_after: stop after this many experiences (for testing resumption).
        progress: show progress bars.
        valid_fraction: hold out this share of each task's training data for validation
            (None: no validation split, train on everything).
        valid_seed: seed of the validation split (the same split for every run seed).
        allow_code_change: resume a checkpoint written by other code (recorded in the run).
    """

    benchmark: str
    strategy: str
    seed: int = 0
    data_root: str | None = None
    device: str = "cpu"
    overrides: dict[str, Any] = field(default_factory=dict)
    n_train: int | None = None
    n_test: int | None = None
    checkpoint: str | None = None
    resume: bool = False
    stop_after: int | None = None
    progress: bool = True
    valid_fraction: float | None = None
    valid_seed: int = 0
    allow_code_change: bool = False


_SEQ_CACHE: dict[tuple[Any, ...], tuple[TaskSequence, dict[str, Any]]] = {}


def data_root_of(spec: BenchmarkSpec, data_root: str | os.PathLike[str] | None) -> str | None:
    """The absolute data root a benchmark reads (None for built-in data sets)."""
    if not spec.needs:
        return None
    return str(resolve_data_root(data_root).resolve())


def load_sequence(
    spec: BenchmarkSpec,
    data_root: str | os.PathLike[str] | None,
    n_train: int | None = None,
    n_test: int | None = None,
    valid_fraction: float | None = None,
    valid_seed: int = 0,
) -> TaskSequence:
    """The benchmark's task sequence (cached per process): the validation split first (from
    the full training sets), then the optional per-task subsample of train and test."""
    return _load_with_fingerprint(spec, data_root, n_train, n_test, valid_fraction, valid_seed)[0]


def _load_with_fingerprint(spec, data_root, n_train, n_test, valid_fraction, valid_seed):
    root = data_root_of(spec, data_root)
    key = (spec.name, root, n_train, n_test, valid_fraction, valid_seed)
    if key not in _SEQ_CACHE:
        seq = spec.load(data_root)
        if valid_fraction is not None:
            seq = seq.with_validation(valid_fraction, seed=valid_seed)
        if n_train is not None or n_test is not None:
            seq = seq.subsample(n_train, n_test, seed=0, strict=True)
        _SEQ_CACHE[key] = (seq, seq.fingerprint())
    return _SEQ_CACHE[key]


def resolve_settings(
    bench: BenchmarkSpec, strat: StrategySpec, overrides: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Merge benchmark defaults < :data:`fromp_bench.settings.SETTINGS` < preset < overrides.

    Returns a dict with ``optimizer``, ``lr``, ``train_epochs``, ``train_mb_size``,
    ``optimizer_kwargs`` and ``kwargs`` (keyword arguments of the strategy class).
    """
    out: dict[str, Any] = {"optimizer_kwargs": {}, "kwargs": {}}
    layers = [dict(bench.settings), strat.defaults(bench.name), dict(strat.settings)]
    layers.append({"kwargs": dict(strat.kwargs)})
    layers.append(dict(overrides or {}))
    for layer in layers:
        for key, value in layer.items():
            if key in ("kwargs", "optimizer_kwargs"):
                out[key] = {**out[key], **dict(value)}
            else:
                out[key] = value
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


_TYPE_NAMES = {"int": int, "float": float, "str": str, "bool": bool}


def _accepted_types(param: inspect.Parameter) -> tuple[type, ...] | None:
    """The plain types a keyword argument accepts, from its annotation (a string under
    ``from __future__ import annotations``) or its default; None when unknown."""
    ann = param.annotation
    names: set[str] = set()
    if isinstance(ann, str):
        names = {t.strip() for t in ann.replace("Optional[", "").rstrip("]").split("|")}
    elif isinstance(ann, type):
        names = {ann.__name__}
    types = {_TYPE_NAMES[n] for n in names if n in _TYPE_NAMES}
    if not types and param.default not in (inspect.Parameter.empty, None):
        types = {type(param.default)} & set(_TYPE_NAMES.values())
    if not types:
        return None
    if float in types:
        types.add(int)
    return tuple(types) + ((type(None),) if "None" in names or param.default is None else ())


def _type_ok(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, types)


def _check_kwargs(cls: type, kwargs: Mapping[str, Any], strat: StrategySpec) -> None:
    from avalanche.training.templates import SupervisedTemplate

    params: dict[str, inspect.Parameter] = {}
    open_ended = False
    for c in (cls, SupervisedTemplate):
        sig = inspect.signature(c.__init__)
        for name, p in sig.parameters.items():
            if p.kind is inspect.Parameter.VAR_KEYWORD:
                open_ended = True
            elif name != "self":
                params.setdefault(name, p)
        if not open_ended:
            break
    reserved = {"model", "optimizer", "criterion", "plugins", "evaluator", "device"}
    for key, value in kwargs.items():
        if key in reserved or key not in params:
            known = sorted(set(params) - reserved - {"train_mb_size", "train_epochs"})
            raise SettingsError(
                f"--set {key}: not a setting of strategy {strat.name!r} "
                f"(it accepts: {', '.join(known)}; and lr, train_epochs, train_mb_size, "
                "optimizer)"
            )
        types = _accepted_types(params[key])
        if types is not None and not _type_ok(value, types):
            want = " or ".join(sorted({t.__name__ for t in types}))
            raise SettingsError(
                f"--set {key}={value!r}: expected {want}, got {type(value).__name__}"
            )


class _Layout:
    """The shape facts a benchmark's model needs, without its data."""

    def __init__(self, spec: BenchmarkSpec) -> None:
        self.n_tasks, self.input_shape, self.n_outputs, self.multi_head = spec.layout

    def __len__(self) -> int:
        return self.n_tasks


def check_device(device: str) -> None:
    """Refuse a device string torch cannot parse or a device this machine lacks."""
    try:
        d = torch.device(device)
    except (RuntimeError, ValueError) as err:
        raise SettingsError(f"--device {device!r}: not a torch device ({err})") from err
    if d.type == "cuda":
        if not torch.cuda.is_available():
            raise SettingsError(
                f"--device {device}: CUDA is not available on this machine "
                "(torch.cuda.is_available() is False); use --device cpu"
            )
        if d.index is not None and d.index >= torch.cuda.device_count():
            raise SettingsError(
                f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here"
            )
    elif d.type == "mps" and not torch.backends.mps.is_available():
        raise SettingsError(f"--device {device}: MPS is not available on this machine")
    elif d.type not in ("cpu", "cuda", "mps"):
        raise SettingsError(f"--device {device}: expected cpu, cuda[:i] or mps")


def validate_settings(
    bench: BenchmarkSpec, strat: StrategySpec, settings: Mapping[str, Any], device: str = "cpu"
) -> None:
    """Check resolved settings before any data is loaded: types and ranges of the training
    settings, the strategy's keyword arguments against its constructor (names and types, then
    its own range checks, by building it on the benchmark's network), and the device.

    Raises:
        SettingsError: one line naming the setting and what was expected.
    """
    if settings.get("optimizer") not in OPTIMIZERS:
        raise SettingsError(
            f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {settings.get('optimizer')!r}"
        )
    lr = settings.get("lr")
    if not _is_number(lr) or not math.isfinite(lr) or lr <= 0:
        raise SettingsError(f"lr (--lr) must be a finite number > 0, got {lr!r}")
    for key, flag in (("train_epochs", "--epochs"), ("train_mb_size", "--batch-size")):
        v = settings.get(key)
        if not _is_int(v) or v < 1:
            raise SettingsError(f"{key} ({flag}) must be an integer >= 1, got {v!r}")
    try:  # the plugins' own checks, one message each
        lr_schedule_plugins(
            settings.get("lr_schedule", "constant"), 1.0, settings.get("lr_warmup", 0.0)
        )
        optimizer_state_plugins(settings.get("optimizer_state", "keep"), settings["optimizer"])
    except ValueError as err:
        raise SettingsError(str(err)) from err
    for key in ("kwargs", "optimizer_kwargs"):
        if not isinstance(settings.get(key, {}), Mapping):
            raise SettingsError(f"{key} must be a mapping, got {settings.get(key)!r}")
    check_device(device)
    _check_optimizer_kwargs(settings["optimizer"], settings.get("optimizer_kwargs") or {})
    cls = strat.load_class()
    _check_kwargs(cls, settings["kwargs"], strat)
    model = as_avalanche_model(bench.model(_Layout(bench)))  # type: ignore[arg-type]
    try:
        optimizer = _make_optimizer(
            settings["optimizer"], model, float(lr), 100, settings["optimizer_kwargs"]
        )
    except (TypeError, ValueError) as err:
        raise SettingsError(f"optimizer settings: {' '.join(str(err).split())}") from err
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        evaluator = EvaluationPlugin(loggers=[])
        try:
            cls(
                model=model,
                optimizer=optimizer,
                criterion=nn.CrossEntropyLoss(),
                train_mb_size=int(settings["train_mb_size"]),
                train_epochs=int(settings["train_epochs"]),
                device="cpu",
                plugins=[],
                evaluator=evaluator,
                **settings["kwargs"],
            )
        except (TypeError, ValueError) as err:
            raise SettingsError(
                f"strategy {strat.name!r} settings: {' '.join(str(err).split())}"
            ) from err


def _optimizer_class(name: str) -> type:
    if name in ("adam", "sgd"):
        return torch.optim.Adam if name == "adam" else torch.optim.SGD
    from fromp.optim import IVON, VOGN

    return VOGN if name == "vogn" else IVON


def _check_optimizer_kwargs(name: str, extra: Mapping[str, Any]) -> None:
    """``--set opt.NAME=value``: a keyword argument of the optimizer, of the kind of its
    default (a tuple default, e.g. Adam's ``betas``, needs a tuple of as many numbers)."""
    params = inspect.signature(_optimizer_class(name).__init__).parameters
    owned = {"self", "params", "params_or_model", "model", "lr", "ess"}
    var = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for key, value in extra.items():
        if key in owned or (key not in params and not open_ended):
            known = sorted(k for k, p in params.items() if k not in owned and p.kind not in var)
            raise SettingsError(f"--set opt.{key}: not a keyword argument of the {name} "
                                f"optimizer (it accepts: {', '.join(known)})")  # fmt: skip
        if key not in params:
            continue
        default = params[key].default
        if isinstance(default, tuple):
            ok = isinstance(value, tuple | list) and len(value) == len(default)
            if not ok or not all(_is_number(v) for v in value):
                raise SettingsError(f"--set opt.{key}={value!r}: expected a tuple of "
                                    f"{len(default)} numbers like {default!r}")  # fmt: skip
        elif _is_number(default) and not isinstance(default, bool) and not _is_number(value):
            raise SettingsError(f"--set opt.{key}={value!r}: expected a number like {default!r}")


def check_sequence(seq: TaskSequence, settings: Mapping[str, Any], strategy: str = "") -> None:
    """Check settings that depend on the data, before any training: memorable points per
    class (``n_points``) and coreset size against the smallest class / task (those of
    ``settings``, else the defaults of ``strategy``'s class).

    Raises:
        SettingsError: one line naming the setting, the task and the class.
    """
    kwargs = {**kwarg_defaults(strategy), **settings.get("kwargs", {})}
    n_points = kwargs.get("n_points")
    if _is_int(n_points):
        for t in seq:
            counts = torch.bincount(t.train_y)
            present = counts[counts > 0]
            per_class = n_points // len(present)
            smallest = int(present.min())
            if per_class > smallest:
                label = int(torch.nonzero(counts == smallest)[0, 0])
                raise SettingsError(
                    f"n_points={n_points} asks for {per_class} memorable examples per class but "
                    f"task {t.task_id + 1} has only {smallest} training examples of class "
                    f"{label}; lower n_points or raise --n-train"
                )
    size = kwargs.get("coreset_size")
    if _is_int(size):
        smallest_task = min(len(t.train_x) for t in seq)
        if size > smallest_task:
            raise SettingsError(
                f"coreset_size={size} exceeds the smallest task's {smallest_task} training "
                "examples; lower coreset_size or raise --n-train"
            )


def init_distributed(device: str = "cpu") -> str:
    """Join the ``torch.distributed`` process group that ``torchrun`` describes in the
    environment (``WORLD_SIZE > 1``; gloo on the CPU, NCCL on CUDA) unless one is already
    initialised; returns the device of this rank (``cuda:LOCAL_RANK`` for ``"cuda"``). A no-op
    returning ``device`` without ``torchrun`` or with one process."""
    dist = torch.distributed
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        cuda = torch.device(device).type == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo")
    if distributed.is_distributed() and device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return f"cuda:{local}"
    return device


def _shard(seq: TaskSequence) -> TaskSequence:
    """This rank's shard of every task's training set: examples ``r, r + R, ...`` of the
    first ``R * floor(N / R)`` (the same count on every rank)."""
    r, world = distributed.rank(), distributed.world_size()
    tasks = []
    for t in seq:
        n = len(t.train_x) // world * world
        tasks.append(t.subset(slice(r, n, world)))
    return TaskSequence(seq.name, tasks, seq.multi_head, seq.input_shape, seq.n_outputs)


def strategy_kwargs(cls: Any, kwargs: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """The strategy's keyword arguments for a run of ``seed``: ``kwargs`` and, for a strategy
    whose own ``seed`` defaults to a fixed number (FROMP's ``seed=0``: its random memorable
    points and curvature subsample) and that ``kwargs`` does not set, the run's seed, so
    that every random choice changes with the run's seed, as Replay's buffer draws do (the
    fixed default gave every run of class-incremental split MNIST the same memory). A
    ``seed`` defaulting to None (VCL's) already draws from the global generator, which the
    run's seed sets; it is left as it is."""
    out = dict(kwargs)
    param = inspect.signature(cls).parameters.get("seed")
    if "seed" not in out and param is not None and param.default is not None:
        out["seed"] = seed
    return out


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)  # noqa: NPY002 (libraries draw from the legacy global state)
    torch.manual_seed(seed)


def _rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU and (where CUDA is available) every CUDA generator's state, as
    tensors and plain containers (:func:`fromp_avalanche.checkpoint.get_rng_state`)."""
    return get_rng_state()


def _set_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of :func:`_rng_state`; a checkpoint without CUDA states (CPU, or version 3)
    leaves the CUDA generators as they are."""
    try:
        set_rng_state(state)
    except ValueError as err:
        raise CheckpointError(str(err)) from err


def ivon_kwargs(extra: Mapping[str, Any], n_train: int) -> dict[str, Any]:
    """IVON's keyword arguments with ivon-opt's names, which settings and ``--set opt.`` may
    still use, in IVON's (IVON refuses ivon-opt's): ``beta1`` / ``beta2`` as ``betas =
    (beta1, beta2)`` (each defaulting to its entry of :data:`fromp.optim.ivon.DEFAULT_BETAS`) and
    ``weight_decay`` as ``prior_precision = weight_decay * n_train`` (``n_train``: the ``ess``
    IVON is built with). Settings ids are unchanged: the settings keep their names, only the
    call is translated.

    Raises:
        SettingsError: both names of one quantity, or a ``weight_decay`` that is not a finite
            number ``>= 0``.
    """
    out = dict(extra)
    if "beta1" in out or "beta2" in out:
        if "betas" in out:
            raise SettingsError("opt.betas and opt.beta1 / opt.beta2 given together: use betas")
        out["betas"] = (out.pop("beta1", DEFAULT_BETAS[0]), out.pop("beta2", DEFAULT_BETAS[1]))
    if "weight_decay" in out:
        if "prior_precision" in out:
            raise SettingsError(
                "opt.prior_precision and opt.weight_decay given together: use prior_precision"
            )
        wd = out.pop("weight_decay")
        if not _is_number(wd) or not math.isfinite(wd) or wd < 0:
            raise SettingsError(f"opt.weight_decay must be a finite number >= 0, got {wd!r}")
        out["prior_precision"] = float(wd) * n_train
    return out


def _make_optimizer(
    name: str, model: nn.Module, lr: float, n_train: int, extra: Mapping[str, Any]
) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr, **extra)
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, **extra)
    if name == "vogn":
        from fromp.optim import VOGN

        return VOGN(model, lr=lr, ess=n_train, **extra)
    if name == "ivon":
        from fromp.optim import IVON

        # several processes: the ranks average IVON's statistics (sync=True) unless set
        kwargs = {"sync": True, **ivon_kwargs(extra, n_train)}
        return IVON(model.parameters(), lr=lr, ess=n_train, **kwargs)
    raise ValueError(f"optimizer must be 'adam', 'sgd', 'vogn' or 'ivon', got {name!r}")


def _load_plugin_states(
    strategy: Any, states: Mapping[str, Any], path: Path, device: str | torch.device = "cpu"
) -> None:
    plugins = method_plugins(strategy)
    if set(plugins) != set(states):
        raise CheckpointError(
            f"checkpoint {path} holds the state of plugins {sorted(states)} but the strategy "
            f"has {sorted(plugins)}; delete it or drop --resume"
        )
    for name, plugin in plugins.items():
        state = states[name]
        if "state_dict" in state:
            plugin.load_state_dict(state["state_dict"])
        else:
            vars(plugin).update(_unplain(state["vars"], device))


def _validation_view(seq: TaskSequence) -> TaskSequence | None:
    """The sequence with each task's validation set in place of its test set (to reuse the
    Avalanche test stream for validation), or None without a validation split."""
    if any(t.valid_x is None for t in seq):
        return None
    tasks = [
        Task(t.train_x[:1], t.train_y[:1], t.valid_x, t.valid_y, t.task_id, list(t.classes))
        for t in seq
    ]
    return TaskSequence(seq.name, tasks, seq.multi_head, seq.input_shape, seq.n_outputs)


def run(
    cfg: RunConfig, on_experience: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Train ``cfg.strategy`` on ``cfg.benchmark`` and return the results.

    ``on_experience`` is called after every experience, once its checkpoint is written, with
    ``{"task", "tasks_done", "mean_accuracy", "mean_valid_accuracy", "checkpoint"}`` (mean
    test / validation accuracy over the tasks seen so far; the sweep reports it to Ray Tune).

    Returns:
        A JSON-serialisable dict: ``accuracy_matrix`` (row ``j`` holds the test accuracy of
        every task after training on task ``j``; ``None`` for tasks not seen yet),
        ``final_accuracies``, ``mean_accuracy`` (the benchmark score), ``forgetting``,
        ``backward_transfer``, ``mean_nll``, ``mean_ece``, ``per_task`` (final NLL and ECE
        per task), ``wall_time_s``, ``timing`` (per task: training, memorable selection,
        curvature, kernel set-up and evaluation seconds), ``settings``, ``data`` (root and
        fingerprint) and the config; with a validation split also ``valid_accuracy_matrix``
        and ``mean_valid_accuracy``. A run stopped by a non-finite loss, weight or
        prediction has ``complete=False`` and ``failed={"task": t, "reason": ...}``.

    Raises:
        SettingsError: a setting that cannot be used (before any training).
        CheckpointError: an unreadable checkpoint, or one written by a different run.
    """
    bench, strat = get_benchmark(cfg.benchmark), get_strategy(cfg.strategy)
    settings = resolve_settings(bench, strat, cfg.overrides)
    validate_settings(bench, strat, settings, device=cfg.device)
    device = init_distributed(cfg.device)
    world, main = distributed.world_size(), distributed.rank() == 0
    if world > 1 and int(settings["train_mb_size"]) % world:
        raise SettingsError(
            f"train_mb_size={settings['train_mb_size']} must be a multiple of the "
            f"{world} processes (each takes train_mb_size / {world} examples a step)"
        )
    seq, fingerprint = _load_with_fingerprint(
        bench, cfg.data_root, cfg.n_train, cfg.n_test, cfg.valid_fraction, cfg.valid_seed
    )
    check_sequence(seq, settings, cfg.strategy)
    data = {"root": data_root_of(bench, cfg.data_root), "fingerprint": fingerprint}
    n_tasks = len(seq)
    cls = strat.load_class()

    _seed_everything(cfg.seed)
    scenario = to_avalanche(_shard(seq) if world > 1 else seq)
    valid_seq = _validation_view(seq)
    valid_stream = None if valid_seq is None else to_avalanche(valid_seq).test_stream
    net = bench.model(seq)
    model = as_avalanche_model(net)
    optimizer = _make_optimizer(
        settings["optimizer"],
        model,
        float(settings["lr"]),
        len(seq[0].train_x),
        settings["optimizer_kwargs"],
    )
    collector = _Collector()
    progress = _Progress(f"{cfg.strategy}/seed{cfg.seed}", cfg.progress and main)
    restore = _RestoreOptimizer()
    with warnings.catch_warnings():  # metrics are reported by the runner, not a logger
        warnings.filterwarnings("ignore", message="No loggers specified")
        evaluator = EvaluationPlugin(accuracy_metrics(experience=True), loggers=[])
    strategy = cls(
        model=model,
        optimizer=optimizer,
        criterion=nn.CrossEntropyLoss(),
        train_mb_size=int(settings["train_mb_size"]) // world,
        train_epochs=int(settings["train_epochs"]),
        eval_mb_size=1000,
        device=device,
        plugins=[
            collector,
            _Guard(),
            progress,
            restore,
            *lr_schedule_plugins(
                settings.get("lr_schedule", "constant"),
                float(settings["lr"]),
                settings.get("lr_warmup", 0.0),
            ),
            *optimizer_state_plugins(
                settings.get("optimizer_state", "keep"), str(settings["optimizer"])
            ),
            *([_DataParallel()] if world > 1 else []),
        ],
        evaluator=evaluator,
        **strategy_kwargs(cls, settings["kwargs"], cfg.seed),
    )
    strategy._is_joint = strat.joint
    if cfg.checkpoint:  # a plugin state a checkpoint could hold only as code: refused now
        for p in method_plugins(strategy).values():
            if not hasattr(p, "state_dict"):
                _plugin_state(p)

    matrix: list[list[float | None]] = []
    valid_matrix: list[list[float | None]] = []
    metrics: dict[int, dict[str, float]] = {}
    timing: list[dict[str, float]] = []
    elapsed, done = 0.0, 0
    key = _ckpt_key(cfg, settings, data)
    code = code_record()
    key["code"] = code["source_hash"]
    ckpt = Path(cfg.checkpoint) if cfg.checkpoint else None
    resumed_from_code = None
    if cfg.resume and ckpt is not None and ckpt.exists():
        state = _read_checkpoint(ckpt, cfg.device)
        old_code = state["config"].get("code")
        if cfg.allow_code_change and old_code != key["code"]:
            resumed_from_code = old_code
            state["config"]["code"] = key["code"]
        _check_key(ckpt, state, key)
        n_steps = 1 if strat.joint else n_tasks
        _check_content(ckpt, state, n_steps, n_tasks, model, valid_stream is not None)
        model.load_state_dict(state["model"])
        _load_plugin_states(strategy, state["plugins"], ckpt, cfg.device)
        restore.pending = state["optimizer"]
        matrix, valid_matrix, metrics = state["matrix"], state["valid_matrix"], state["metrics"]
        timing, elapsed, done = state["timing"], state["elapsed"], state["done"]
        _set_rng_state(state["rng"])

    train_stream, test_stream = scenario.train_stream, scenario.test_stream
    steps = [list(range(n_tasks))] if strat.joint else [[i] for i in range(n_tasks)]
    failed: dict[str, Any] | None = None
    for step, exps in enumerate(steps):
        if step < done:
            continue
        if cfg.stop_after is not None and step >= cfg.stop_after:
            break
        seen = exps[-1] + 1
        try:
            counts = _timing_counts(strategy)
            t0 = time.perf_counter()
            strategy.train(train_stream if strat.joint else train_stream[exps[0]])
            t1 = time.perf_counter()
            if valid_stream is not None:
                with torch.random.fork_rng(devices=_cuda_devices(cfg.device)):
                    strategy.eval(valid_stream[:seen])
                valid_metrics = collector.metrics("validation")
                valid_matrix.append(
                    [valid_metrics[k]["accuracy"] if k < seen else None for k in range(n_tasks)]
                )
            strategy.eval(test_stream[:seen])
            metrics = collector.metrics()
            t2 = time.perf_counter()
        except NonFiniteError as err:
            failed = {"task": seen if not strat.joint else 1, "reason": str(err)}
            break
        matrix.append([metrics[k]["accuracy"] if k < seen else None for k in range(n_tasks)])
        phases = _phase_times(strategy, counts)
        method_s = sum(phases.values())
        timing.append(
            {"task": seen, "training_s": t1 - t0 - method_s, **phases, "evaluation_s": t2 - t1}
        )
        elapsed += t2 - t0
        done = step + 1
        if ckpt is not None and main:
            _write_checkpoint(
                ckpt,
                {
                    "version": CHECKPOINT_VERSION,
                    "config": key,
                    "done": done,
                    "model": model.state_dict(),
                    "plugins": {n: _plugin_state(p) for n, p in method_plugins(strategy).items()},
                    "optimizer": strategy.optimizer.state_dict(),
                    "rng": _rng_state(),
                    "matrix": matrix,
                    "valid_matrix": valid_matrix,
                    "metrics": metrics,
                    "timing": timing,
                    "elapsed": elapsed,
                },
            )
        if on_experience is not None:
            seen_accs = [a for a in matrix[-1] if a is not None]
            seen_valid = [a for a in valid_matrix[-1] if a is not None] if valid_matrix else []
            on_experience(
                {
                    "task": seen,
                    "tasks_done": done,
                    "mean_accuracy": float(np.mean(seen_accs)),
                    "mean_valid_accuracy": float(np.mean(seen_valid)) if seen_valid else None,
                    "checkpoint": None if ckpt is None else str(ckpt),
                }
            )

    complete = failed is None and done == len(steps)
    result: dict[str, Any] = {
        "benchmark": cfg.benchmark,
        "strategy": cfg.strategy,
        "seed": cfg.seed,
        "complete": complete,
        "failed": failed,
        "accuracy_matrix": matrix,
        "per_task": {str(k): v for k, v in sorted(metrics.items())},
        "wall_time_s": elapsed,
        "timing": timing,
        "settings": settings,
        "config": asdict(cfg),
        "data": data,
        "n_train_per_task": [len(t.train_x) for t in seq],
        "code": code,
        "env": env_record(cfg.device),
    }
    if resumed_from_code is not None:
        result["resumed_from_code"] = resumed_from_code
    if world > 1:
        result["distributed"] = {"world_size": world, "backend": torch.distributed.get_backend()}
    if matrix and failed is None:
        result.update(_summarise(matrix, metrics, n_tasks if not strat.joint else 1))
    if valid_matrix and failed is None:
        result["valid_accuracy_matrix"] = valid_matrix
        result["mean_valid_accuracy"] = float(
            np.mean([a for a in valid_matrix[-1] if a is not None])
        )
    return _jsonable(result)


def _cuda_devices(device: str) -> list[int]:
    d = torch.device(device)
    if d.type != "cuda":
        return []
    return [d.index if d.index is not None else torch.cuda.current_device()]


def _ckpt_key(
    cfg: RunConfig, settings: Mapping[str, Any], data: Mapping[str, Any]
) -> dict[str, Any]:
    keep = ("benchmark", "strategy", "seed", "overrides", "n_train", "n_test")
    keep += ("valid_fraction", "valid_seed")
    out = {k: _jsonable(getattr(cfg, k)) for k in keep}
    out["settings"] = _jsonable(settings)
    out["data_root"] = data["root"]
    out["data"] = {"hash": data["fingerprint"]["hash"]}
    if distributed.world_size() > 1:  # a run of R processes resumes only with R processes
        out["world_size"] = distributed.world_size()
    return out


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Tensor):
        return obj.tolist()
    return obj
