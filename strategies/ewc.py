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
the scale of 0.4 and earlier, ``(l / 2) sum_p F_p (w_p - w*_p)^2`` (``l = 2 lambda / B``;
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
from avalanche.training.plugins import SupervisedPlugin
from fromp_avalanche.benchmarks import experience_tensors
from fromp_avalanche.models import unwrap
from fromp_avalanche.template import MethodStrategy
from torch import Tensor, nn

from fromp import distributed
from fromp.continual.ewc import EWCMethod, ewc_penalty
from fromp.likelihood import Likelihood

__all__ = ["EWC", "EWCPlugin", "ewc_penalty"]


class EWCPlugin(SupervisedPlugin):
    """EWC as an Avalanche plugin: a thin driver of a :class:`fromp.continual.ewc.EWCMethod`
    (see the module docstring for the maths).

    ``before_backward`` adds the penalty; ``after_training_exp`` calls
    :meth:`~fromp.continual.ewc.EWCMethod.learn_task` with the experience's data and task label
    (the head of a multi-task model). The method's attributes (``anchors``,
    ``importances``, ``task_count``, ...) are readable on the plugin.

    Args:
        net: the network inside the strategy's model (its parameters are the model's).
        ewc_lambda, **kwargs: those of :class:`fromp.continual.ewc.EWCMethod` (pass
            ``batch_size=`` the strategy's ``train_mb_size`` for Avalanche's scale; the
            :class:`EWC` strategy does).
    """

    def __init__(self, net: nn.Module, ewc_lambda: float | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.net = net
        self.method = EWCMethod(ewc_lambda, **kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        # settings and state live on the method: plugin.x = v sets method.x
        method = self.__dict__.get("method")
        if method is not None and name not in ("net", "method") and hasattr(method, name):
            setattr(method, name, value)
        else:
            super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:
        if name == "method":
            raise AttributeError(name)
        return getattr(self.method, name)

    def penalty(self) -> Tensor:
        """The current penalty (scalar, differentiable in the network's parameters)."""
        return self.method.penalty(self.net)

    def fisher_diagonal(self, x: Tensor, y: Tensor, task: int | None) -> Tensor:
        """Per-example-averaged Fisher diagonal ``[P]`` of ``(x, y)`` through head ``task``."""
        return self.method.fisher_diagonal(self.net, x, y, task)

    def before_backward(self, strategy: Any, **kwargs: Any) -> None:
        if self.method.anchors and self.method.coefficient > 0:
            strategy.loss += self.penalty()

    def after_training_exp(self, strategy: Any, **kwargs: Any) -> None:
        x, y, t = experience_tensors(strategy.experience.dataset, eval_transforms=False)
        tasks = t.unique()
        if len(tasks) != 1:
            raise ValueError(f"an experience must hold one task label, got {tasks.tolist()}")
        # keyed by the experience: training it again replaces its anchor and Fisher
        experience = getattr(strategy.experience, "current_experience", None)
        key = None if experience is None else int(experience)
        self.method.learn_task(self.net, x, y, int(tasks[0]), experience=key)

    def state_dict(self) -> dict:
        """The method's state (:meth:`fromp.continual.ewc.EWCMethod.state_dict`)."""
        return self.method.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` on the network's device."""
        self.method.load_state_dict(state, self.net)


class EWC(MethodStrategy):
    """EWC with a per-example Fisher as an Avalanche strategy: the keyword arguments of
    :class:`EWCPlugin`, and Avalanche's template arguments (``criterion``,
    ``train_mb_size``, ...) as in :class:`fromp_avalanche.template.MethodStrategy`.
    ``ewc_lambda`` (default 100) is on Avalanche's scale with ``B = train_mb_size``;
    ``per_example_lambda`` the scale of 0.4 and earlier (give one of the two)."""

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        criterion: nn.Module | Callable | None = None,
        ewc_lambda: float | None = None,
        per_example_lambda: float | None = None,
        mode: str = "separate",
        decay_factor: float = 1.0,
        fisher: str = "sampled",
        fisher_samples: int = 1,
        max_examples: int | None = None,
        likelihood: str | Likelihood = "categorical",
        **template_kwargs: Any,
    ) -> None:
        if ewc_lambda is None and per_example_lambda is None:
            ewc_lambda = 100.0
        plugin = EWCPlugin(
            unwrap(model),
            ewc_lambda,
            per_example_lambda=per_example_lambda,
            # under torch.distributed a rank's mini-batch is its share of the global one
            batch_size=int(template_kwargs.get("train_mb_size", 1)) * distributed.world_size(),
            mode=mode,
            decay_factor=decay_factor,
            fisher=fisher,
            fisher_samples=fisher_samples,
            max_examples=max_examples,
            likelihood=likelihood,
        )
        super().__init__(
            method_plugins=[plugin],
            model=model,
            optimizer=optimizer,
            criterion=criterion,
            **template_kwargs,
        )
