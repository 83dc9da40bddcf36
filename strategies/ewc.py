"""Elastic weight consolidation (EWC; Kirkpatrick et al., 2017) with a per-example Fisher.

Avalanche's ``EWCPlugin`` uses as importance the mean over mini-batches of the *squared
mini-batch gradient* (avalanche issue #1224). That is not the Fisher: for a mini-batch of
``B`` examples near a minimum it is about ``F_bar / B`` (``F_bar`` the per-example Fisher
diagonal) and it depends on the batch size. Here the importance of task ``t`` is

    ``F_t = (1 / N_t) sum_n diag(g_n g_n^T)``,   ``g_n = grad_w -log p(y_n | f_w(x_n))``,

the per-example Fisher diagonal averaged over the task's ``N_t`` training examples, with
``y_n`` sampled from the model (``fisher="sampled"``, the true Fisher, Monte Carlo), the
observed labels (``"empirical"``) or its exact expectation, the GGN diagonal (``"exact"``);
computed by :mod:`fromp.curvature` through the task's head (multi-head models). The loss
on task ``T`` is

    ``CE_T(w) + (lambda / 2) sum_{t < T} sum_p F_{t,p} (w_p - w*_{t,p})^2``       (separate)
    ``CE_T(w) + (lambda / 2) sum_p F~_p (w_p - w*_{T-1,p})^2``,
    ``F~ = gamma F~ + F_{T-1}``                                                   (online)

with ``w*_t`` the weights after task ``t``. Because ``CE`` is the mean over the batch, this
is the Laplace-approximation objective divided by ``N`` when ``lambda = N_t``; ``lambda`` is
per example. Comparison with Avalanche's ``ewc_lambda`` (penalty
``lambda_av * sum_p I_p (w_p - w*_p)^2`` with ``I ~ F_bar / B``): the two penalties match
when ``lambda = 2 * lambda_av / B``, e.g. Avalanche's ``lambda_av = 1e4`` with batches of
``B = 128`` corresponds to ``lambda ~ 156``.
"""

from __future__ import annotations

import torch
from avalanche.training.plugins import SupervisedPlugin
from avalanche.training.plugins.evaluation import default_evaluator
from avalanche.training.templates import SupervisedTemplate
from torch import Tensor, nn

from fromp.curvature import diag_ef, diag_fisher, diag_ggn
from fromp.jacobian import flat_params
from fromp.models import with_task
from strategies.models import unwrap
from strategies.vcl import dataset_tensors

__all__ = ["EWC", "EWCPlugin", "ewc_penalty"]

_FISHERS = ("sampled", "empirical", "exact")


def ewc_penalty(
    w: Tensor, anchors: list[Tensor], importances: list[Tensor], ewc_lambda: float
) -> Tensor:
    """``(lambda / 2) sum_t sum_p F_{t,p} (w_p - w*_{t,p})^2`` for flat ``w [P]``,
    ``anchors`` and ``importances`` lists of ``[P]`` tensors (a scalar)."""
    if len(anchors) != len(importances):
        raise ValueError(
            f"anchors and importances must have equal lengths, got {len(anchors)} "
            f"and {len(importances)}"
        )
    total = w.new_zeros(())
    for a, f in zip(anchors, importances):
        total = total + (f * (w - a) ** 2).sum()
    return 0.5 * ewc_lambda * total


def _flat_live(model: nn.Module) -> Tensor:
    """The trainable parameters as one differentiable ``[P]`` vector (named_parameters order)."""
    return torch.cat([p.reshape(-1) for p in model.parameters() if p.requires_grad])


class EWCPlugin(SupervisedPlugin):
    """EWC with a per-example Fisher diagonal (see the module docstring).

    Args:
        net: the fromp network inside the strategy's model (its parameters are the model's).
        ewc_lambda: ``lambda`` of the penalty ``(lambda / 2) sum F (w - w*)^2``.
        mode: ``"separate"`` (one penalty per past task) or ``"online"`` (one decayed sum).
        decay_factor: ``gamma`` of the online mode (ignored for ``"separate"``).
        fisher: ``"sampled"`` (default) | ``"empirical"`` | ``"exact"``.
        fisher_samples: labels drawn per example for ``"sampled"``.
        max_examples: use at most this many (randomly chosen) training examples for the
            Fisher (None: all).
        chunk_size: examples per vectorised per-example-gradient call.
    """

    def __init__(
        self,
        net: nn.Module,
        ewc_lambda: float,
        *,
        mode: str = "separate",
        decay_factor: float = 1.0,
        fisher: str = "sampled",
        fisher_samples: int = 1,
        max_examples: int | None = None,
        chunk_size: int = 128,
    ) -> None:
        super().__init__()
        if ewc_lambda < 0:
            raise ValueError(f"ewc_lambda must be >= 0, got {ewc_lambda}")
        if mode not in ("separate", "online"):
            raise ValueError(f"mode must be 'separate' or 'online', got {mode!r}")
        if not 0.0 <= decay_factor <= 1.0:
            raise ValueError(f"decay_factor must be in [0, 1], got {decay_factor}")
        if fisher not in _FISHERS:
            raise ValueError(f"fisher must be one of {_FISHERS}, got {fisher!r}")
        if fisher_samples < 1:
            raise ValueError(f"fisher_samples must be >= 1, got {fisher_samples}")
        if max_examples is not None and max_examples < 1:
            raise ValueError(f"max_examples must be >= 1 or None, got {max_examples}")
        self.net = net
        self.ewc_lambda, self.mode, self.decay_factor = float(ewc_lambda), mode, decay_factor
        self.fisher, self.fisher_samples = fisher, int(fisher_samples)
        self.max_examples, self.chunk_size = max_examples, int(chunk_size)
        self.anchors: list[Tensor] = []  # w*_t [P]
        self.importances: list[Tensor] = []  # F_t [P] (online: a single decayed sum)
        self.task_count = 0

    def penalty(self) -> Tensor:
        """The current penalty (scalar, differentiable in the network's parameters)."""
        w = _flat_live(self.net)
        if not self.anchors:
            return w.new_zeros(())
        return ewc_penalty(w, self.anchors, self.importances, self.ewc_lambda)

    def before_backward(self, strategy, **kwargs):
        if self.anchors and self.ewc_lambda > 0:
            strategy.loss += self.penalty()

    @torch.no_grad()
    def fisher_diagonal(self, x: Tensor, y: Tensor, task: int | None) -> Tensor:
        """Per-example-averaged Fisher diagonal ``[P]`` of ``(x, y)`` through head ``task``."""
        model = with_task(self.net, task)
        was_training = self.net.training
        self.net.eval()
        try:
            with torch.enable_grad():
                if self.fisher == "sampled":
                    f = diag_fisher(
                        model,
                        (x, y),
                        "categorical",
                        n_samples=self.fisher_samples,
                        chunk_size=self.chunk_size,
                    )
                elif self.fisher == "empirical":
                    f = diag_ef(model, (x, y), "categorical", chunk_size=self.chunk_size)
                else:
                    f = diag_ggn(model, x, "categorical", chunk_size=self.chunk_size)
        finally:
            self.net.train(was_training)
        return f / len(x)

    def after_training_exp(self, strategy, **kwargs):
        x, y, t = dataset_tensors(strategy.experience.dataset)
        if self.max_examples is not None and len(x) > self.max_examples:
            idx = torch.randperm(len(x))[: self.max_examples]
            x, y, t = x[idx], y[idx], t[idx]
        device = next(self.net.parameters()).device
        task = int(t[0]) if getattr(self.net, "n_heads", 1) > 1 else None
        f = self.fisher_diagonal(x.to(device), y.to(device), task).detach()
        w = flat_params(self.net).detach().clone()
        if self.mode == "separate":
            self.anchors.append(w)
            self.importances.append(f)
        else:
            prev = self.importances[0] * self.decay_factor if self.importances else 0.0
            self.anchors = [w]
            self.importances = [prev + f]
        self.task_count += 1

    def state_dict(self) -> dict:
        """Anchors, importances and the task counter."""
        return {
            "anchors": [a.detach().cpu().clone() for a in self.anchors],
            "importances": [f.detach().cpu().clone() for f in self.importances],
            "task_count": self.task_count,
            "mode": self.mode,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        missing = {"anchors", "importances", "task_count"} - set(state)
        if missing:
            raise ValueError(f"state is missing keys {sorted(missing)}")
        if state.get("mode", self.mode) != self.mode:
            raise ValueError(
                f"state was saved with mode={state['mode']!r}, plugin has {self.mode!r}"
            )
        device = next(self.net.parameters()).device
        self.anchors = [a.to(device) for a in state["anchors"]]
        self.importances = [f.to(device) for f in state["importances"]]
        self.task_count = int(state["task_count"])


class EWC(SupervisedTemplate):
    """EWC with a per-example Fisher as an Avalanche strategy (keyword arguments of
    :class:`EWCPlugin` besides the standard ones)."""

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        criterion: nn.Module | None = None,
        train_mb_size: int = 128,
        train_epochs: int = 1,
        eval_mb_size: int = 1000,
        device: str | torch.device = "cpu",
        plugins: list | None = None,
        evaluator=default_evaluator,
        eval_every: int = -1,
        ewc_lambda: float = 100.0,
        mode: str = "separate",
        decay_factor: float = 1.0,
        fisher: str = "sampled",
        fisher_samples: int = 1,
        max_examples: int | None = None,
    ) -> None:
        self.plugin = EWCPlugin(
            unwrap(model),
            ewc_lambda,
            mode=mode,
            decay_factor=decay_factor,
            fisher=fisher,
            fisher_samples=fisher_samples,
            max_examples=max_examples,
        )
        super().__init__(
            model=model,
            optimizer=optimizer,
            criterion=criterion if criterion is not None else nn.CrossEntropyLoss(),
            train_mb_size=train_mb_size,
            train_epochs=train_epochs,
            eval_mb_size=eval_mb_size,
            device=device,
            plugins=[self.plugin, *(plugins or [])],
            evaluator=evaluator,
            eval_every=eval_every,
        )
