"""FROMP (Pan et al., NeurIPS 2020) as an Avalanche strategy: an adapter of
:class:`fromp.continual.methods.FROMPMethod`, which holds the whole training step and the
work after each experience. The plugin calls the continual-method protocol from Avalanche's
hooks and nothing else, so a plain PyTorch loop over the method runs the same algorithm."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from avalanche.evaluation import GenericPluginMetric
from avalanche.evaluation.metrics import Mean
from avalanche.models import IncrementalClassifier
from fromp_avalanche.benchmarks import experience_tensors
from fromp_avalanche.protocol import MethodPlugin
from fromp_avalanche.template import MethodStrategy, method_parameters, show_signature
from torch import Tensor, nn

from fromp.continual.methods import FROMPMethod

__all__ = ["FROMP", "FROMPPenaltyMetric", "FROMPPlugin", "experience_tensors"]


class FROMPPlugin(MethodPlugin):
    """FROMP as an Avalanche plugin: :class:`~fromp_avalanche.protocol.MethodPlugin` over
    :attr:`method`, a :class:`fromp.continual.methods.FROMPMethod` built from the keyword
    arguments (its own). ``begin_task`` also learns whether the head grows with the classes
    (Avalanche's ``IncrementalClassifier``: a class-incremental stream, which resolves the
    method's ``"auto"`` settings). What the loggers see: the penalty and context
    terms are taken out of ``strategy.loss`` (as a constant) after the backward pass, so
    Avalanche's loss metrics record the loss without them (the coreset's loss stays: it is
    part of the data term); :class:`FROMPPenaltyMetric` records ``tau R``."""

    def __init__(self, tau: float | str = "auto", n_points: int = 40, **kwargs: Any) -> None:
        super().__init__(FROMPMethod(tau, n_points, **kwargs))
        self._added: list[Tensor | None] = []

    def facts(self, strategy: Any) -> dict[str, Any]:
        grows = any(isinstance(m, IncrementalClassifier) for m in strategy.model.modules())
        return {**super().facts(strategy), "growing_head": grows}

    def before_backward(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        super().before_backward(strategy)
        self._added = [self.method.last_terms.get(k) for k in ("penalty", "context")]

    def after_backward(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        for term in self._added:  # the loggers' loss: without the penalty
            if term is not None:
                strategy.loss = strategy.loss - term
        self._added = []


class _DeviceMean(Mean):
    """Avalanche's weighted ``Mean`` whose sum stays a tensor on the values' device between
    reads: ``update`` runs on every training step and never waits for the GPU."""

    def __init__(self) -> None:
        super().__init__()
        self._sum: Tensor | float = 0.0

    def update(self, value: Tensor | float, weight: float = 1.0) -> None:
        if isinstance(value, Tensor):
            value = value.detach().double()
        self._sum = self._sum + value * float(weight)
        self.weight += float(weight)

    def result(self) -> float:
        return 0.0 if self.weight == 0 else float(self._sum) / self.weight

    def reset(self) -> None:
        super().reset()
        self._sum = 0.0


class FROMPPenaltyMetric(GenericPluginMetric[float, Mean]):
    """Avalanche metric: the mean of ``tau * R(w)`` over an epoch's training steps (weighted
    by mini-batch size; the method's ``last_terms["penalty"]``), emitted as
    ``FROMP_Penalty_Epoch`` after each training epoch. The :class:`FROMP` strategy adds it
    to its ``EvaluationPlugin``; with a :class:`FROMPPlugin` in another strategy pass it:
    ``EvaluationPlugin(loss_metrics(epoch=True), FROMPPenaltyMetric(), loggers=[...])``."""

    def __init__(self) -> None:
        super().__init__(_DeviceMean(), reset_at="epoch", emit_at="epoch", mode="train")

    def update(self, strategy: Any) -> None:
        plugin = next((p for p in strategy.plugins if isinstance(p, FROMPPlugin)), None)
        if plugin is not None:
            value = plugin.method.last_terms.get("penalty", 0.0)
            self._metric.update(value, len(strategy.mb_y))

    def __str__(self) -> str:
        return "FROMP_Penalty_Epoch"


class FROMP(MethodStrategy):
    """FROMP strategy: Avalanche's supervised template with a :class:`FROMPPlugin`.

    ``model`` is any classifier (a plain module, an Avalanche ``MultiTaskModule``, a
    :mod:`fromp` multi-head model). Method keyword arguments are those of
    :class:`fromp.continual.methods.FROMPMethod`; Avalanche's template arguments those of
    :class:`fromp_avalanche.template.MethodStrategy`. With ``posterior="vogn"`` / ``"ivon"``
    the optimizer must be a :class:`fromp.optim.VOGN` / :class:`fromp.optim.IVON`, driven by
    a :class:`fromp_avalanche.vogn.VOGNPlugin` (``vogn_continual``: the posterior becomes
    the next prior) / :class:`fromp_avalanche.ivon.IVONPlugin` (``ivon_continual``, default
    False), listed after FROMP's plugin: FROMP reads the experience's posterior before it
    becomes the next prior, and FROMP's clipping acts on the gradient the optimizer reads.
    """

    def __init__(
        self,
        *,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: nn.Module | Callable | None = None,
        vogn_continual: bool = True,
        ivon_continual: bool = False,
        **kwargs: Any,
    ) -> None:
        template_kwargs = {k: v for k, v in kwargs.items() if k not in _METHOD_PARAMS}
        method_kwargs = {k: v for k, v in kwargs.items() if k in _METHOD_PARAMS}
        if model is None or optimizer is None:
            raise TypeError("FROMP needs model= and optimizer=")
        plugin = FROMPPlugin(**method_kwargs)
        extra: list[Any] = []
        if plugin.method.posterior == "vogn":
            from fromp_avalanche.vogn import VOGNPlugin

            extra.append(VOGNPlugin(optimizer, continual=vogn_continual))
        elif plugin.method.posterior == "ivon":
            from fromp_avalanche.ivon import IVONPlugin

            extra.append(IVONPlugin(optimizer, continual=ivon_continual))
        if extra and not isinstance(optimizer, extra[0].optimizer_class):
            name = extra[0].optimizer_class.__name__
            raise TypeError(
                f"posterior={plugin.method.posterior!r} needs a fromp.optim.{name} optimizer, "
                f"got {type(optimizer)}"
            )
        super().__init__(method_plugins=[plugin, *extra], model=model, optimizer=optimizer,
                         criterion=criterion, **template_kwargs)  # fmt: skip
        metrics = getattr(self.evaluator, "metrics", None)
        if isinstance(metrics, list) and not any(
            isinstance(m, FROMPPenaltyMetric) for m in metrics
        ):
            metrics.append(FROMPPenaltyMetric())


_METHOD_PARAMS = method_parameters(FROMPMethod)
show_signature(FROMP, _METHOD_PARAMS, after=("vogn_continual", "ivon_continual"))
