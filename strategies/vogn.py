"""VOGN inside Avalanche: :class:`VOGNPlugin` turns Avalanche's ``backward();
optimizer.step()`` loop into :class:`fromp.optim.VOGN` steps (``before_forward``: a draw
``w ~ q``, ``w = mu`` for OGN; after the backward pass, ``.grad`` the mean gradient ``g``:
the per-example curvature ``h`` of the *data* loss at ``w`` handed to the optimizer, from
Avalanche's own forward pass when that is exact, else a separate pass grouped by task
label, :func:`fromp.optim.vogn.minibatch_curvature`; ``optimizer.step()`` then writes
``mu`` back, so evaluation happens at the posterior mean). One draw per iteration
(``mc_samples`` 0 or 1); the criterion must be the mean of the optimizer's per-example loss.
Terms other plugins add to the loss (e.g. FROMP's) enter ``g`` only, on the scale of the
mean per-example loss. :class:`VOGNStrategy`: naive continual VOGN (each experience's
posterior the next prior; ``m``, ``s`` and the step count restart, ``mu`` kept, ``N`` the
new experience's size). Checkpoints: :class:`~fromp_avalanche.posterior.
PosteriorOptimizerPlugin`.
"""

from __future__ import annotations

from typing import Any

import torch
from fromp_avalanche.models import unwrap
from fromp_avalanche.posterior import PosteriorOptimizerPlugin
from fromp_avalanche.template import MethodStrategy, require_optimizer_on
from torch import Tensor, nn

from fromp.optim.vogn import (
    VOGN,
    LayerCapture,
    OutputCapture,
    minibatch_curvature,
    recorded_curvature,
)

__all__ = ["VOGNPlugin", "VOGNStrategy"]


class VOGNPlugin(PosteriorOptimizerPlugin):
    """Drives a :class:`fromp.optim.VOGN` ``optimizer`` (given so that :meth:`state_dict`
    works before training) from Avalanche's training loop. ``continual``: make each
    experience's posterior the next prior. ``reuse_forward``: the squared per-example
    gradients from Avalanche's own forward pass (:class:`fromp.optim.vogn.LayerCapture`, one
    partial backward), else (or where not exact: batch norm in training mode, other layers,
    a layer called twice, ``hess_approx="ggn"``) a separate pass."""

    optimizer_class = VOGN
    state_key = "vogn"

    def __init__(
        self,
        optimizer: VOGN | None = None,
        *,
        continual: bool = True,
        reuse_forward: bool = True,
    ) -> None:
        super().__init__(optimizer, continual=continual)
        self.reuse_forward = bool(reuse_forward)
        self._capture: LayerCapture | None = None
        self._outputs: OutputCapture | None = None
        self._curv: Tensor | None = None
        self.n_reused = 0  # mini-batches whose curvature came from the training forward

    def _opt(self, strategy: Any) -> VOGN:
        opt = super()._opt(strategy)
        if opt.mc_samples > 1:
            raise ValueError(
                f"VOGNPlugin draws one posterior sample per mini-batch: the optimizer's "
                f"mc_samples must be 0 or 1, got {opt.mc_samples}"
            )
        return opt

    # -------------------------------------------------------------- hooks
    def before_training_exp(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        super().before_training_exp(strategy, *args, **kwargs)  # a resumed run's state
        opt = self._opt(strategy)
        opt.ess = len(strategy.experience.dataset)

    def before_forward(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        opt = self._opt(strategy)
        n = len(strategy.experience.dataset)
        if opt.ess != n:
            opt.ess = n
        opt.sample_params(copy=False)
        self._curv = None
        # the model's own call (Avalanche's model(x, task_labels): its heads, its padding)
        self._outputs = OutputCapture(strategy.model).__enter__()
        if self.reuse_forward and opt.hess_approx == "ef":
            capture = LayerCapture(strategy.model)
            if capture.supported:
                self._capture = capture.__enter__()

    def after_forward(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        if self._outputs is not None:
            self._outputs.__exit__()
        capture, self._capture = self._capture, None
        if capture is None:
            return
        capture.__exit__()
        opt = self._opt(strategy)
        losses = opt.loss_fn(strategy.mb_output, strategy.mb_y)
        self._curv = capture.squared_grads(losses)

    def after_backward(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        opt = self._opt(strategy)
        h, self._curv = self._curv, None
        outputs, self._outputs = self._outputs, None
        if h is not None:
            self.n_reused += 1
        elif outputs is not None and any(c[2] is strategy.mb_output for c in outputs.calls):
            h = recorded_curvature(outputs, strategy.mb_output, strategy.mb_y, opt)
        else:
            net = unwrap(strategy.model)
            h = minibatch_curvature(net, strategy.mb_x, strategy.mb_y, strategy.mb_task_id, opt)
        opt.set_curvature(h, len(strategy.mb_y))

    def after_training_epoch(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        self._opt(strategy).load_mean()

    def after_training_exp(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        opt = self._opt(strategy)
        opt.load_mean()
        q = opt.posterior()
        self._end_experience(strategy, q, lambda: opt.set_prior(q, reset=True))


class VOGNStrategy(MethodStrategy):
    """Naive continual VOGN: each experience fitted by VOGN with the previous posterior as
    the prior. ``optimizer``: a :class:`fromp.optim.VOGN` built on ``model`` (its ``ess`` set
    per experience). ``continual``: make the posterior the next prior; ``reuse_forward``:
    see :class:`VOGNPlugin`; the rest: :class:`fromp_avalanche.template.MethodStrategy`'s."""

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        continual: bool = True,
        reuse_forward: bool = True,
        **template_kwargs: Any,
    ) -> None:
        require_optimizer_on(model, optimizer, VOGN)
        plugin = VOGNPlugin(optimizer, continual=continual, reuse_forward=reuse_forward)
        super().__init__(
            method_plugins=[plugin],
            model=model,
            optimizer=optimizer,
            **template_kwargs,
        )
