"""Run one strategy on one benchmark with one seed, with checkpoints and full metrics.

The loop is Avalanche's: the task sequence becomes an Avalanche benchmark
(:func:`strategies.benchmarks.to_avalanche`), the strategy is an Avalanche
``SupervisedTemplate``, and after every experience the strategy is evaluated on the test sets
of all tasks seen so far. A plugin collects the predicted probabilities during evaluation, so
accuracy, negative log-likelihood and expected calibration error come from the same outputs
Avalanche's own metrics see.

After every experience a checkpoint holds the model, the strategy's method state (its
plugins' ``state_dict``), the optimizer state, the random-number generators and the metrics
so far; :func:`run` with ``resume=True`` continues from it and ends with the same results as
an uninterrupted run.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import time
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from avalanche.core import SupervisedPlugin
from avalanche.evaluation.metrics import accuracy_metrics
from avalanche.training.plugins import EvaluationPlugin
from torch import Tensor, nn
from tqdm.auto import tqdm

from benchmarks.registry import BenchmarkSpec, StrategySpec, get_benchmark, get_strategy
from fromp.data import TaskSequence
from strategies.benchmarks import to_avalanche
from strategies.models import as_avalanche_model

__all__ = ["RunConfig", "expected_calibration_error", "load_sequence", "resolve_settings", "run"]

CHECKPOINT_VERSION = 1


@dataclass
class RunConfig:
    """What to run.

    Attributes:
        benchmark: a name from :data:`benchmarks.registry.BENCHMARKS`.
        strategy: a name from :data:`benchmarks.registry.STRATEGIES`.
        seed: seeds Python, NumPy and PyTorch (model init, data order, sampling).
        data_root: data root (``--data-root``; None: ``$FROMP_DATA`` or ``./data``).
        device: torch device string.
        overrides: settings that win over all defaults (``lr``, ``train_epochs``,
            ``train_mb_size``, ``optimizer``, and ``kwargs`` for the strategy class).
        n_train, n_test: keep this many train / test examples per task (quick runs).
        checkpoint: file to checkpoint to after every experience (None: no checkpoints).
        resume: continue from ``checkpoint`` when it exists.
        stop_after: stop after this many experiences (for testing resumption).
        progress: show progress bars.
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


_SEQ_CACHE: dict[tuple[str, str | None, int | None, int | None], TaskSequence] = {}


def load_sequence(
    spec: BenchmarkSpec,
    data_root: str | os.PathLike[str] | None,
    n_train: int | None = None,
    n_test: int | None = None,
) -> TaskSequence:
    """The benchmark's task sequence (cached per process), optionally subsampled per task."""
    key = (spec.name, None if data_root is None else str(data_root), n_train, n_test)
    if key not in _SEQ_CACHE:
        seq = spec.load(data_root)
        if n_train is not None or n_test is not None:
            seq = seq.subsample(n_train, n_test, seed=0)
        _SEQ_CACHE[key] = seq
    return _SEQ_CACHE[key]


def resolve_settings(
    bench: BenchmarkSpec, strat: StrategySpec, overrides: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Merge benchmark defaults < strategy ``DEFAULTS`` < preset < overrides.

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


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)  # noqa: NPY002 (libraries draw from the legacy global state)
    torch.manual_seed(seed)


def _rng_state() -> dict[str, Any]:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),  # noqa: NPY002
        "torch": torch.get_rng_state(),
    }


def _set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])  # noqa: NPY002
    torch.set_rng_state(state["torch"])


def _make_optimizer(
    name: str, model: nn.Module, lr: float, n_train: int, extra: Mapping[str, Any]
) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr, **extra)
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, **extra)
    if name == "vogn":
        from fromp.optim import VOGN

        return VOGN(model, lr=lr, train_set_size=n_train, **extra)
    if name == "ivon":
        from fromp.optim import IVON

        return IVON(model.parameters(), lr=lr, ess=n_train, **extra)
    raise ValueError(f"optimizer must be 'adam', 'sgd', 'vogn' or 'ivon', got {name!r}")


def expected_calibration_error(probs: Tensor, y: Tensor, n_bins: int = 15) -> float:
    """ECE: ``sum_b |B_b| / N * |acc(B_b) - conf(B_b)|`` over equal-width confidence bins.

    Args:
        probs: ``[N, C]`` predicted class probabilities.
        y: ``[N]`` labels.
    """
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

    def metrics(self) -> dict[int, dict[str, float]]:
        out = {}
        for exp, chunks in self.outputs.items():
            probs = torch.cat([p for p, _ in chunks])
            y = torch.cat([t for _, t in chunks])
            p_true = probs[torch.arange(len(y)), y].clamp_min(1e-12)
            out[exp] = {
                "accuracy": 100.0 * (probs.argmax(1) == y).double().mean().item(),
                "nll": -p_true.log().mean().item(),
                "ece": expected_calibration_error(probs, y),
            }
        return out


class _Progress(SupervisedPlugin):
    """A tqdm bar per experience over all its training iterations, showing the loss."""

    def __init__(self, label: str, enabled: bool = True) -> None:
        super().__init__()
        self.label, self.enabled, self.bar = label, enabled, None

    def before_training_exp(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        if self.enabled:
            total = strategy.train_epochs * len(strategy.dataloader)
            exp = strategy.experience.current_experience
            what = "all tasks" if getattr(strategy, "_is_joint", False) else f"task {exp + 1}"
            self.bar = tqdm(total=total, desc=f"{self.label} {what}", leave=False, mininterval=1.0)

    def after_training_iteration(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if self.bar.n % 20 == 0:
                self.bar.set_postfix(loss=f"{float(strategy.loss):.4f}")

    def after_training_exp(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


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


def _method_plugins(strategy: Any, own: tuple[Any, ...]) -> list[Any]:
    return [
        p
        for p in strategy.plugins
        if not isinstance(p, (*own, EvaluationPlugin)) and p is not strategy.evaluator
    ]


def _plugin_state(plugin: Any) -> Any:
    if hasattr(plugin, "state_dict"):
        return {"state_dict": plugin.state_dict()}
    return {"vars": dict(vars(plugin))}


def _load_plugin_state(plugin: Any, state: Mapping[str, Any]) -> None:
    if "state_dict" in state:
        plugin.load_state_dict(state["state_dict"])
    else:
        vars(plugin).update(state["vars"])


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


def run(cfg: RunConfig) -> dict[str, Any]:
    """Train ``cfg.strategy`` on ``cfg.benchmark`` and return the results.

    Returns:
        A JSON-serialisable dict: ``accuracy_matrix`` (row ``j`` holds the test accuracy of
        every task after training on task ``j``; ``None`` for tasks not seen yet),
        ``final_accuracies``, ``mean_accuracy`` (the benchmark score), ``forgetting``,
        ``backward_transfer``, ``mean_nll``, ``mean_ece``, ``per_task`` (final NLL and ECE
        per task), ``wall_time_s``, ``settings`` and the config.
    """
    bench, strat = get_benchmark(cfg.benchmark), get_strategy(cfg.strategy)
    settings = resolve_settings(bench, strat, cfg.overrides)
    seq = load_sequence(bench, cfg.data_root, cfg.n_train, cfg.n_test)
    n_tasks = len(seq)
    cls = strat.load_class()

    _seed_everything(cfg.seed)
    scenario = to_avalanche(seq)
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
    progress = _Progress(f"{cfg.strategy}/seed{cfg.seed}", cfg.progress)
    restore = _RestoreOptimizer()
    with warnings.catch_warnings():  # metrics are reported by the runner, not a logger
        warnings.filterwarnings("ignore", message="No loggers specified")
        evaluator = EvaluationPlugin(accuracy_metrics(experience=True), loggers=[])
    strategy = cls(
        model=model,
        optimizer=optimizer,
        criterion=nn.CrossEntropyLoss(),
        train_mb_size=int(settings["train_mb_size"]),
        train_epochs=int(settings["train_epochs"]),
        eval_mb_size=1000,
        device=cfg.device,
        plugins=[collector, progress, restore],
        evaluator=evaluator,
        **settings["kwargs"],
    )
    strategy._is_joint = strat.joint
    own = (_Collector, _Progress, _RestoreOptimizer)

    matrix: list[list[float | None]] = []
    metrics: dict[int, dict[str, float]] = {}
    elapsed, done = 0.0, 0
    ckpt = Path(cfg.checkpoint) if cfg.checkpoint else None
    if cfg.resume and ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, map_location=cfg.device, weights_only=False)
        if state.get("version") != CHECKPOINT_VERSION or state["config"] != _ckpt_key(cfg):
            raise ValueError(
                f"checkpoint {ckpt} was written by a different run "
                f"({state.get('config')}); delete it or drop --resume"
            )
        model.load_state_dict(state["model"])
        for plugin, pstate in zip(_method_plugins(strategy, own), state["plugins"]):
            _load_plugin_state(plugin, pstate)
        restore.pending = state["optimizer"]
        matrix, metrics, elapsed, done = (
            state["matrix"],
            state["metrics"],
            state["elapsed"],
            state["done"],
        )
        _set_rng_state(state["rng"])

    train_stream, test_stream = scenario.train_stream, scenario.test_stream
    steps = [list(range(n_tasks))] if strat.joint else [[i] for i in range(n_tasks)]
    for step, exps in enumerate(steps):
        if step < done:
            continue
        if cfg.stop_after is not None and step >= cfg.stop_after:
            break
        start = time.perf_counter()
        if strat.joint:
            strategy.train(train_stream)
        else:
            strategy.train(train_stream[exps[0]])
        seen = exps[-1] + 1
        strategy.eval(test_stream[:seen])
        metrics = collector.metrics()
        matrix.append([metrics[k]["accuracy"] if k < seen else None for k in range(n_tasks)])
        elapsed += time.perf_counter() - start
        done = step + 1
        if ckpt is not None:
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            tmp = ckpt.with_suffix(".tmp")
            torch.save(
                {
                    "version": CHECKPOINT_VERSION,
                    "config": _ckpt_key(cfg),
                    "done": done,
                    "model": model.state_dict(),
                    "plugins": [_plugin_state(p) for p in _method_plugins(strategy, own)],
                    "optimizer": strategy.optimizer.state_dict(),
                    "rng": _rng_state(),
                    "matrix": matrix,
                    "metrics": metrics,
                    "elapsed": elapsed,
                },
                tmp,
            )
            os.replace(tmp, ckpt)

    complete = done == len(steps)
    result: dict[str, Any] = {
        "benchmark": cfg.benchmark,
        "strategy": cfg.strategy,
        "seed": cfg.seed,
        "complete": complete,
        "accuracy_matrix": matrix,
        "per_task": {str(k): v for k, v in sorted(metrics.items())},
        "wall_time_s": elapsed,
        "settings": settings,
        "config": asdict(cfg),
        "n_train_per_task": [len(t.train_x) for t in seq],
    }
    if matrix:
        result.update(_summarise(matrix, metrics, n_tasks if not strat.joint else 1))
    return _jsonable(result)


def _ckpt_key(cfg: RunConfig) -> dict[str, Any]:
    keep = ("benchmark", "strategy", "seed", "overrides", "n_train", "n_test")
    return {k: _jsonable(getattr(cfg, k)) for k in keep}


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
