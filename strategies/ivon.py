"""IVON inside Avalanche: a plugin that turns Avalanche's ``backward(); optimizer.step()``
loop into IVON steps, and continual IVON as a strategy.

Per training iteration (:class:`IVONPlugin`, optimizer a :class:`fromp.optim.IVON`):

* ``before_forward``: ``theta ~ q`` is written into the model (:meth:`IVON.draw`);
* Avalanche computes the loss at ``theta`` (plus whatever other plugins add, e.g. FROMP's
  function-space regulariser) and back-propagates it;
* ``before_update`` (after the ``before_update`` of the plugins listed before this one, e.g.
  FROMP's gradient clipping): the gradient at ``theta`` is read from ``.grad`` and the mean is
  written back (:meth:`IVON.restore`), unless an earlier plugin did so (FROMP, which then adds
  its regulariser's gradient at the mean, :meth:`IVON.add_gradient`);
  ``optimizer.step()`` then applies the IVON update, so
  the model holds the mean outside the forward/backward window and evaluation happens at the
  posterior mean.

One posterior sample per iteration (``mc_samples`` of the optimizer is not used here). A draw
left in the parameters by an exception inside an iteration is discarded (the mean restored)
at the next iteration, epoch or experience boundary.

The IVON state (momentum, Hessian estimate, step count, prior) is torch's
``optimizer.state``; parameters that Avalanche adds (a new head of a ``MultiHeadClassifier``)
get theirs at their first step. The plugin's ``state_dict`` holds the optimizer's state dict
with the per-experience posteriors, so that a run can be resumed in a fresh process (loaded
again after Avalanche's first reset of ``optimizer.state``).

Continual IVON (:class:`IVONStrategy`): after each experience the posterior ``N(m, 1/(N (h +
delta)))`` becomes the prior of the next one (:meth:`IVON.set_prior`), the momentum, ``h``
and the step count restart, the mean is kept and ``N`` becomes the size of the new experience.
"""

from __future__ import annotations

from typing import Any

import torch
from fromp_avalanche.models import unwrap
from fromp_avalanche.posterior import PosteriorOptimizerPlugin
from fromp_avalanche.template import MethodStrategy, require_optimizer_on
from torch import nn

from fromp._checks import check_positive
from fromp.optim.ivon import IVON

__all__ = ["IVONPlugin", "IVONStrategy"]


class IVONPlugin(PosteriorOptimizerPlugin):
    """Drives a :class:`fromp.optim.IVON` optimizer from Avalanche's training loop.

    Args:
        optimizer: the strategy's optimizer (also found as ``strategy.optimizer`` in the
            hooks; given here so that :meth:`state_dict` works before training).
        continual: at the end of each experience make the posterior the next prior
            (continual IVON) and restart the momentum, ``h`` and the step count.
        set_ess: set the optimizer's ``ess`` to the size of each experience's training set.
        prior_scale: with ``continual``, the next prior is the posterior with its precision
            multiplied by this factor ``s > 0`` (a tempered prior,
            ``N(m, 1 / (s N (h + delta)))``: ``s < 1`` lets later experiences move the
            weights further, at the price of more forgetting, ``s > 1`` holds them closer,
            like EWC's ``lambda``); 1 is the posterior itself.
    """

    optimizer_class = IVON
    state_key = "ivon"

    def __init__(
        self,
        optimizer: IVON | None = None,
        *,
        continual: bool = True,
        set_ess: bool = True,
        prior_scale: float = 1.0,
    ) -> None:
        self.prior_scale = check_positive(prior_scale, "prior_scale")
        super().__init__(optimizer, continual=continual)
        self.set_ess = bool(set_ess)

    # checkpoints: PosteriorOptimizerPlugin's state_dict / load_state_dict (the optimizer's
    # torch state dict under "ivon")

    def _discard_draw(self, strategy: Any) -> None:
        opt = self._opt(strategy)
        if opt.sampled:
            opt.restore(accumulate=False)

    # -------------------------------------------------------------- hooks
    def before_training_exp(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        super().before_training_exp(strategy, *args, **kwargs)  # a resumed state again
        opt = self._opt(strategy)
        if self.set_ess:
            opt.ess = len(strategy.experience.dataset)

    def before_training_iteration(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        self._discard_draw(strategy)

    def before_forward(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        opt = self._opt(strategy)
        if self.set_ess:  # again here: a resumed run loads the optimizer after the hook above
            n = len(strategy.experience.dataset)
            if opt.ess != n:
                opt.ess = n
        opt.draw()

    def before_update(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        opt = self._opt(strategy)
        if opt.sampled:  # else an earlier plugin restored it (FROMP, ivon_penalty="mean")
            opt.restore(accumulate=True)

    def after_training_epoch(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        self._discard_draw(strategy)

    def after_training_exp(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        self._discard_draw(strategy)
        opt = self._opt(strategy)
        net = unwrap(strategy.model)
        q = opt.posterior(net)
        prior = q if self.prior_scale == 1.0 else q.with_precision(q.precision * self.prior_scale)
        self._end_experience(strategy, q, lambda: opt.set_prior(prior, model=net, reset=True))


class IVONStrategy(MethodStrategy):
    """Continual IVON: each experience is fitted by IVON with the previous posterior as the
    prior (multi-head through the task labels, or single-head).

    ``optimizer`` must be a :class:`fromp.optim.IVON` over exactly the model's trainable
    parameters (its ``ess`` is set per experience).

    Args:
        continual: make the posterior the next prior (False: the weight-decay prior stays).
        prior_scale: temper that prior, precision times ``prior_scale > 0``
            (:class:`IVONPlugin`).
        **template_kwargs: Avalanche's template arguments (``criterion``, ``train_mb_size``,
            ...), as in :class:`fromp_avalanche.template.MethodStrategy`.
    """

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        continual: bool = True,
        prior_scale: float = 1.0,
        **template_kwargs: Any,
    ) -> None:
        require_optimizer_on(model, optimizer, IVON)
        plugin = IVONPlugin(optimizer, continual=continual, prior_scale=prior_scale)  # type: ignore[arg-type]
        super().__init__(
            method_plugins=[plugin], model=model, optimizer=optimizer, **template_kwargs
        )
