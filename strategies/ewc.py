"""Elastic weight consolidation (EWC; Kirkpatrick et al., 2017) with a per-example Fisher,
``ewc_lambda`` on Avalanche's scale.

Avalanche's ``EWCPlugin`` uses as importance the mean over mini-batches of the *squared
mini-batch gradient* (avalanche issue #1224). That is not the Fisher: for a mini-batch of
``B`` examples near a minimum it is about ``F_bar / B`` (``F_bar`` the per-example Fisher
diagonal) and it depends on the batch size. Here the importance of task ``t`` is

    ``F_t = (1 / N_t) sum_n diag(g_n g_n^T)``,   ``g_n = grad_w -log p(y_n | f_w(x_n))``,

the per-example Fisher diagonal averaged over the task's ``N_t`` training examples, with
``y_n`` sampled from the model (``fisher="sampled"``, the true Fisher, Monte Carlo), the
observed labels (``"empirical"``) or its exact expectation, the GGN diagonal (``"exact"``);
computed by :mod:`fromp.curvature` through the task's head (multi-head models), or
Avalanche's own importance (``fisher="minibatch"``, times ``B``). With ``B`` the strategy's
``train_mb_size``, the loss on task ``T`` is

    ``CE_T(w) + (lambda / B) sum_{t < T} sum_p F_{t,p} (w_p - w*_{t,p})^2``       (separate)
    ``CE_T(w) + (lambda / B) sum_p F~_p (w_p - w*_{T-1,p})^2``,
    ``F~ = gamma F~ + F_{T-1}``                                                   (online)

with ``w*_t`` the weights after task ``t``: ``ewc_lambda`` is Avalanche's (its penalty is
``lambda sum_p I_p (w_p - w*_p)^2`` with ``I ~ F_bar / B``), so ``EWC(ewc_lambda=x)`` and
``avalanche.training.EWC(ewc_lambda=x)`` weigh their penalties alike, and with
``fisher="minibatch"`` they are the same penalty (tested). ``per_example_lambda=l`` keeps
the scale of 0.3, ``(l / 2) sum_p F_p (w_p - w*_p)^2`` (``l = 2 lambda / B``;
because ``CE`` is the mean over the batch, this is the Laplace-approximation objective
divided by ``N`` when ``l = N_t``).

Under ``torch.distributed`` each rank passes its shard of the experience (the runner's
data-parallel mode gives each rank its shard as the experience) and the Fisher sums over
all of them (:class:`fromp.continual.ewc.EWCMethod`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from fromp_avalanche.protocol import MethodPlugin
from fromp_avalanche.template import MethodStrategy, method_parameters, show_signature
from torch import nn

from fromp import distributed
from fromp.continual.ewc import EWCMethod, ewc_penalty

__all__ = ["EWC", "EWCPlugin", "ewc_penalty"]


class EWCPlugin(MethodPlugin):
    """EWC as an Avalanche plugin: :class:`~fromp_avalanche.protocol.MethodPlugin` over
    :attr:`method`, a :class:`fromp.continual.ewc.EWCMethod` built from the keyword
    arguments (pass ``batch_size=`` the strategy's ``train_mb_size`` for Avalanche's scale;
    the :class:`EWC` strategy does); the Fisher is taken with the training transforms."""

    eval_transforms = False

    def __init__(self, ewc_lambda: float | None = None, **kwargs: Any) -> None:
        super().__init__(EWCMethod(ewc_lambda, **kwargs))


class EWC(MethodStrategy):
    """EWC with a per-example Fisher as an Avalanche strategy: the keyword arguments of
    :class:`fromp.continual.ewc.EWCMethod` (``ewc_lambda``, default 100, on Avalanche's
    scale with ``B = train_mb_size``; or ``per_example_lambda``; ``cuda_graph``: how a step
    evaluates the penalty), and Avalanche's template arguments (``criterion``,
    ``train_mb_size``, ...) as in :class:`fromp_avalanche.template.MethodStrategy`."""

    def __init__(
        self,
        *,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: nn.Module | Callable | None = None,
        **kwargs: Any,
    ) -> None:
        template_kwargs = {k: v for k, v in kwargs.items() if k not in _METHOD_PARAMS}
        method_kwargs = {k: v for k, v in kwargs.items() if k in _METHOD_PARAMS}
        if model is None or optimizer is None:
            raise TypeError("EWC needs model= and optimizer=")
        # Avalanche's scale: under torch.distributed a rank's mini-batch is its share of B
        batch_size = int(template_kwargs.get("train_mb_size", 1)) * distributed.world_size()
        plugin = EWCPlugin(batch_size=batch_size, **method_kwargs)
        super().__init__(method_plugins=[plugin], model=model, optimizer=optimizer,
                         criterion=criterion, **template_kwargs)  # fmt: skip


_METHOD_PARAMS = method_parameters(EWCMethod, "batch_size")
show_signature(EWC, _METHOD_PARAMS)
