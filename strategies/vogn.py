"""VOGN inside Avalanche: a plugin that turns Avalanche's ``backward(); optimizer.step()``
loop into VOGN steps, and naive continual VOGN as a strategy.

Per training iteration (:class:`VOGNPlugin`, optimizer a :class:`fromp.optim.VOGN`):

* ``before_forward``: ``w ~ q`` is written into the model (``w = mu`` for OGN);
* Avalanche computes the loss at ``w`` (plus whatever other plugins add, e.g. FROMP's
  function-space regulariser) and back-propagates it: ``.grad`` is the mean gradient ``g``;
* ``after_forward`` / ``after_backward``: the per-example curvature ``h`` of the *data*
  loss only (squared per-example gradients, or the per-example GGN diagonal, see
  :mod:`fromp.optim.vogn`) at ``w`` is handed to the optimizer. By default it is computed
  from Avalanche's own forward pass (layer inputs recorded, one partial backward of the
  per-example data losses); when that is not exact (batch norm in training mode, other
  parametrised layers, ``curvature="ggn"``) a separate per-example pass is run (examples
  grouped by task label, each group through its head);
* ``optimizer.step()`` then applies the VOGN update with ``g`` (from ``.grad``) and ``h``
  and writes ``mu`` back into the model, so evaluation happens at the posterior mean.

One posterior sample per iteration: the optimizer's ``mc_samples`` must be 0 (OGN) or 1.
The criterion must be the mean over the mini-batch of the optimizer's per-example loss
(``nn.CrossEntropyLoss()`` with the categorical likelihood), so that ``.grad`` and ``h``
are on the same per-example scale. Batch norm: see :mod:`fromp.optim.vogn` (per-example
curvature uses the running statistics; ``g`` comes from the training-mode pass).

The posterior state (``mu, s, m``, step, prior) is torch's ``optimizer.state``, ``N`` the
groups' ``"ess"``; parameters that Avalanche adds (a new head) get theirs at their first
step. The plugin's ``state_dict`` holds the optimizer's state dict with the per-experience
posteriors, so that a run can be resumed in a fresh process (loaded again after Avalanche's
first reset of ``optimizer.state``, :class:`~fromp_avalanche.template.
PosteriorOptimizerPlugin`).

VOGN as the optimizer of another method (e.g. FROMP): add ``VOGNPlugin(optimizer)`` to the
strategy's plugins and use a :class:`fromp.optim.VOGN` optimizer. Terms that other plugins
add to ``strategy.loss`` (computed at the sampled weights, which the parameters hold
between ``before_forward`` and ``optimizer.step()``) enter ``g`` through ``.grad`` and never
``h``. They must be on the scale of the mean per-example loss: a term ``R`` of the
objective ``sum_n nll_n + R`` is added as ``R / N``.

Naive continual VOGN (:class:`VOGNStrategy`): after each experience the posterior becomes
the prior of the next one, ``m``, ``s`` and the step count restart, ``mu`` is kept and
``N`` becomes the size of the new experience.
"""

from __future__ import annotations

from typing import Any

import torch
from fromp_avalanche.models import unwrap
from fromp_avalanche.posterior import PosteriorOptimizerPlugin
from fromp_avalanche.template import MethodStrategy, require_optimizer_on
from torch import Tensor, nn

from fromp.models import is_multitask, with_task
from fromp.optim.vogn import VOGN, LayerCapture, OutputCapture, per_example_grad_stats

__all__ = ["VOGNPlugin", "VOGNStrategy", "minibatch_curvature"]


def minibatch_curvature(
    model: nn.Module, x: Tensor, y: Tensor, task_labels: Tensor | None, opt: VOGN
) -> Tensor:
    """``h = (1/M) sum_i h_i`` ``[P]`` of the data loss on a mini-batch at the model's
    current weights, examples grouped by task label (each group through its head).

    Args:
        model: an Avalanche model (or a fromp model); its parameters must be those of ``opt``
            in the same order.
        x: ``[M, ...]``. y: ``[M]``. task_labels: ``[M]`` or None (single head).
        opt: supplies the likelihood, the curvature type and the chunk size.
    """
    net = unwrap(model)
    multi = is_multitask(net)  # fromp multi-head models and Avalanche MultiTaskModules
    if not multi or task_labels is None:
        if multi:
            raise ValueError("task_labels are required for a multi-head model")
        groups = [(None, slice(None))]
    else:
        groups = [(int(t), task_labels == t) for t in torch.unique(task_labels)]
    total = None
    for t, rows in groups:
        stats = per_example_grad_stats(
            with_task(net, t),
            x[rows],
            y[rows],
            opt.likelihood,
            curvature=opt.curvature,
            chunk_size=opt.chunk_size,
            method=opt.method,
            need_grad=False,
        )
        part = stats.curv * stats.n
        total = part if total is None else total + part
    assert total is not None
    return total / len(x)


class VOGNPlugin(PosteriorOptimizerPlugin):
    """Drives a :class:`fromp.optim.VOGN` optimizer from Avalanche's training loop.

    Args:
        optimizer: the strategy's optimizer (also found as ``strategy.optimizer`` in the
            hooks; given here so that :meth:`state_dict` works before training).
        continual: at the end of each experience make the posterior the next prior
            (naive continual VOGN) and restart ``m``, ``s`` and the step count.
        reuse_forward: compute the squared per-example gradients from Avalanche's own
            forward pass (layer inputs recorded by :class:`fromp.optim.vogn.LayerCapture`,
            one extra partial backward of the data loss) instead of a separate pass; falls
            back to the separate pass when that is not exact (batch norm in training mode,
            layers outside Linear/Conv2d/batch norm, a layer called twice,
            ``curvature="ggn"``).
    """

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
        if self.reuse_forward and opt.curvature == "ef":
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
            h = self._recorded_curvature(outputs, strategy, opt)
        else:
            h = minibatch_curvature(
                strategy.model, strategy.mb_x, strategy.mb_y, strategy.mb_task_id, opt
            )
        opt.set_curvature(h, len(strategy.mb_y))

    @staticmethod
    def _recorded_curvature(outputs: OutputCapture, strategy: Any, opt: VOGN) -> Tensor:
        """``h`` of the data loss ``loss_fn(f, y)`` at the output ``f`` of Avalanche's own
        forward call (whatever else was back-propagated): per-example output gradients of
        that loss, per-example Jacobians of the same call (its task labels, heads and
        padding), :class:`fromp.optim._stats.OutputCapture`."""
        # Avalanche's call: the one whose output is strategy.mb_output (another plugin may
        # have called the model inside the window, e.g. on memorable points)
        outputs.calls = [c for c in outputs.calls if c[2] is strategy.mb_output][:1]
        f = outputs.calls[0][2].detach().requires_grad_(True)
        with torch.enable_grad():
            losses = opt.loss_fn(f, strategy.mb_y)
            (r,) = torch.autograd.grad(losses.sum(), f)
        lik = opt.likelihood if opt.curvature == "ggn" else None
        named = outputs.curvature(lik, opt.curvature, opt.chunk_size, output_grads=[r])  # at w
        assert named is not None
        return opt._named_to_flat(named) if opt.model is not None else named

    def after_training_epoch(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        self._opt(strategy).load_mean()

    def after_training_exp(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        opt = self._opt(strategy)
        opt.load_mean()
        q = opt.posterior()
        self._end_experience(strategy, q, lambda: opt.set_prior(q, reset=True))

    # -------------------------------------------------------------- checkpoints
    # state_dict / load_state_dict: PosteriorOptimizerPlugin's ("vogn": the optimizer's
    # state dict, or fromp 0.5's flat posterior state; loading writes mu into the model's
    # parameters, again after Avalanche's first reset of optimizer.state).


class VOGNStrategy(MethodStrategy):
    """Naive continual VOGN: each experience is fitted by VOGN with the previous posterior
    as the prior (multi-head through the task labels, or single-head).

    ``optimizer`` must be a :class:`fromp.optim.VOGN` built on ``model`` (its
    ``ess`` is set per experience). ``criterion`` must be the mean of the
    optimizer's per-example loss (the default cross-entropy for the categorical likelihood).

    Args:
        continual: make the posterior the next prior (False: the prior stays the initial one).
        reuse_forward: see :class:`VOGNPlugin`.
        **template_kwargs: Avalanche's template arguments (``criterion``, ``train_mb_size``,
            ...), as in :class:`fromp_avalanche.template.MethodStrategy`.
    """

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
