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

from typing import Any

import torch
from avalanche.training.plugins import SupervisedPlugin
from torch import Tensor, nn

from fromp._checks import device_dtype
from fromp.curvature import diag_ef, diag_fisher, diag_ggn
from fromp.jacobian import unflatten
from fromp.likelihood import Likelihood, get_likelihood
from fromp.models import with_task
from strategies.benchmarks import experience_tensors
from strategies.models import Named, by_name, unwrap
from strategies.template import MethodStrategy

__all__ = ["EWC", "EWCPlugin", "ewc_penalty"]

_FISHERS = ("sampled", "empirical", "exact")


def ewc_penalty(
    w: Tensor | Named,
    anchors: list[Tensor] | list[Named],
    importances: list[Tensor] | list[Named],
    ewc_lambda: float,
) -> Tensor:
    """``(lambda / 2) sum_t sum_p F_{t,p} (w_p - w*_{t,p})^2`` (a scalar).

    ``w``, each anchor ``w*_t`` and each importance ``F_t`` are either flat ``[P]`` vectors
    or dicts ``{parameter name: tensor}``; with dicts, a parameter that a task's importance
    does not name (e.g. a head added after that task) gets no penalty from that task."""
    if len(anchors) != len(importances):
        raise ValueError(
            f"anchors and importances must have equal lengths, got {len(anchors)} "
            f"and {len(importances)}"
        )
    terms = []
    for a, f in zip(anchors, importances):
        if isinstance(w, dict):
            terms.append(
                torch.cat([(f[n] * (p - a[n]) ** 2).reshape(-1) for n, p in w.items() if n in f])
            )
        else:
            terms.append(f * (w - a) ** 2)
    total = (next(iter(w.values())) if isinstance(w, dict) else w).new_zeros(())
    for t in terms:
        total = total + t.sum()
    return 0.5 * ewc_lambda * total


def _live(model: nn.Module) -> Named:
    """The trainable parameters by name (differentiable)."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


class EWCPlugin(SupervisedPlugin):
    """EWC with a per-example Fisher diagonal (see the module docstring).

    The state, anchors ``w*_t`` and importances ``F_t``, is kept per parameter name
    (``{name: tensor}`` per task), so parameters added later (a new head) are simply not
    penalised by the earlier tasks.

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
        likelihood: the likelihood of the outputs (a :class:`fromp.likelihood.Likelihood`
            or its name; ``"categorical"``: softmax and cross-entropy).
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
        likelihood: str | Likelihood = "categorical",
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
        self.likelihood = get_likelihood(likelihood)
        self.anchors: list[Named] = []  # w*_t by parameter name
        self.importances: list[Named] = []  # F_t by name (online: a single decayed sum)
        self.task_count = 0

    def penalty(self) -> Tensor:
        """The current penalty (scalar, differentiable in the network's parameters)."""
        w = _live(self.net)
        if not self.anchors:
            return next(iter(w.values())).new_zeros(())

        def named(v: Tensor | Named) -> Named:  # flat [P] vectors assigned by hand
            return unflatten(self.net, v) if isinstance(v, Tensor) else v

        anchors = [named(a) for a in self.anchors]
        importances = [named(f) for f in self.importances]
        return ewc_penalty(w, anchors, importances, self.ewc_lambda)

    def before_backward(self, strategy, **kwargs):
        if self.anchors and self.ewc_lambda > 0:
            strategy.loss += self.penalty()

    @torch.no_grad()
    def fisher_diagonal(self, x: Tensor, y: Tensor, task: int | None) -> Tensor:
        """Per-example-averaged Fisher diagonal ``[P]`` of ``(x, y)`` through head ``task``."""
        model = with_task(self.net, task)
        lik = self.likelihood
        was_training = self.net.training
        self.net.eval()
        try:
            with torch.enable_grad():
                if self.fisher == "sampled":
                    f = diag_fisher(
                        model,
                        (x, y),
                        lik,
                        n_samples=self.fisher_samples,
                        chunk_size=self.chunk_size,
                    )
                elif self.fisher == "empirical":
                    f = diag_ef(model, (x, y), lik, chunk_size=self.chunk_size)
                else:
                    f = diag_ggn(model, x, lik, chunk_size=self.chunk_size)
        finally:
            self.net.train(was_training)
        return f / len(x)

    def after_training_exp(self, strategy, **kwargs):
        x, y, t = experience_tensors(strategy.experience.dataset, eval_transforms=False)
        if self.max_examples is not None and len(x) > self.max_examples:
            idx = torch.randperm(len(x))[: self.max_examples]
            x, y, t = x[idx], y[idx], t[idx]
        device, _ = device_dtype(self.net)
        task = int(t[0]) if getattr(self.net, "n_heads", 1) > 1 else None
        f = by_name(self.net, self.fisher_diagonal(x.to(device), y.to(device), task))
        w = by_name(self.net, _live(self.net))
        if self.mode == "separate":
            self.anchors.append(w)
            self.importances.append(f)
        else:
            prev = self.importances[0] if self.importances else {}
            decayed = {n: v * self.decay_factor for n, v in prev.items()}
            self.anchors = [w]
            self.importances = [{**decayed, **{n: decayed.get(n, 0.0) + v for n, v in f.items()}}]
        self.task_count += 1

    def state_dict(self) -> dict:
        """Anchors and importances (``{name: tensor}`` per task), the task counter, the mode."""
        return {
            "anchors": [{n: v.cpu().clone() for n, v in a.items()} for a in self.anchors],
            "importances": [{n: v.cpu().clone() for n, v in f.items()} for f in self.importances],
            "task_count": self.task_count,
            **self._settings(),
        }

    def _settings(self) -> dict:
        """The settings a checkpoint must be resumed with."""
        return {
            "mode": self.mode,
            "decay_factor": self.decay_factor,
            "fisher": self.fisher,
            "fisher_samples": self.fisher_samples,
            "likelihood": self.likelihood.name,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned (flat ``[P]`` anchors and importances of
        older checkpoints are read in the network's parameter order). Refuses a state saved
        with other settings (mode, decay, Fisher type and samples, likelihood)."""
        missing = {"anchors", "importances", "task_count"} - set(state)
        if missing:
            raise ValueError(f"state is missing keys {sorted(missing)}")
        for key, value in self._settings().items():  # keys absent in older checkpoints
            if state.get(key, value) != value:
                raise ValueError(
                    f"state was saved with {key}={state[key]!r}, plugin has {value!r}: "
                    "resume with the settings of the run"
                )
        device, _ = device_dtype(self.net)

        def load(items: list) -> list[Named]:
            return [{n: v.to(device) for n, v in by_name(self.net, d).items()} for d in items]

        self.anchors = load(state["anchors"])
        self.importances = load(state["importances"])
        self.task_count = int(state["task_count"])


class EWC(MethodStrategy):
    """EWC with a per-example Fisher as an Avalanche strategy: the keyword arguments of
    :class:`EWCPlugin`, and Avalanche's template arguments (``criterion``,
    ``train_mb_size``, ...) as in :class:`strategies.template.MethodStrategy`."""

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        ewc_lambda: float = 100.0,
        mode: str = "separate",
        decay_factor: float = 1.0,
        fisher: str = "sampled",
        fisher_samples: int = 1,
        max_examples: int | None = None,
        likelihood: str | Likelihood = "categorical",
        **template_kwargs: Any,
    ) -> None:
        plugin = EWCPlugin(
            unwrap(model),
            ewc_lambda,
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
            **template_kwargs,
        )
