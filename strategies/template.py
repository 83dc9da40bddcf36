"""The Avalanche template every strategy of :mod:`strategies` is built on."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from avalanche.training.plugins.evaluation import default_evaluator
from avalanche.training.templates import SupervisedTemplate
from torch import nn

__all__ = ["MethodStrategy"]


class MethodStrategy(SupervisedTemplate):
    """Avalanche's ``SupervisedTemplate`` with a method's plugins in front of the user's.

    The method's plugins (e.g. :class:`strategies.fromp.FROMPPlugin`) run before those in
    ``plugins``; ``self.plugin`` is the first of them. The keyword arguments are Avalanche's,
    with the defaults every strategy here uses.

    Args:
        method_plugins: the method's plugins, in hook order.
        model: the Avalanche model (a multi-head :mod:`fromp` model wrapped by
            :func:`strategies.models.as_avalanche_model`).
        optimizer: its optimizer.
        criterion: the training loss (default ``nn.CrossEntropyLoss()``).
        train_mb_size, train_epochs, eval_mb_size, device, plugins, evaluator, eval_every:
            as in Avalanche.
        **base_kwargs: further ``SupervisedTemplate`` arguments.
    """

    def __init__(
        self,
        *,
        method_plugins: Sequence[Any],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        criterion: nn.Module | Callable | None = None,
        train_mb_size: int = 128,
        train_epochs: int = 1,
        eval_mb_size: int | None = 1000,
        device: str | torch.device = "cpu",
        plugins: list[Any] | None = None,
        evaluator: Any = default_evaluator,
        eval_every: int = -1,
        **base_kwargs: Any,
    ) -> None:
        if not method_plugins:
            raise ValueError("method_plugins must hold at least the method's plugin")
        self.plugin = method_plugins[0]
        super().__init__(
            model=model,
            optimizer=optimizer,
            criterion=nn.CrossEntropyLoss() if criterion is None else criterion,
            train_mb_size=train_mb_size,
            train_epochs=train_epochs,
            eval_mb_size=eval_mb_size,
            device=device,
            plugins=[*method_plugins, *(plugins or [])],
            evaluator=evaluator,
            eval_every=eval_every,
            **base_kwargs,
        )
