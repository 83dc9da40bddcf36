"""VCL for any model: a mean-field Gaussian twin of a user's module.

Variational continual learning (Nguyen, Li, Bui & Turner, ICLR 2018) keeps a mean-field
Gaussian posterior ``q_t(w) = prod_p N(w_p; mu_p, sigma_p^2)`` over the weights and, on
task ``t`` with ``N_t`` examples, minimises the per-example negative ELBO

    ``L(q) = (1/S) sum_s mean_n CE(f_{w_s}(x_n), y_n) + KL(q || q_{t-1}) / N_t``,
    ``w_s = mu + sigma * eps_s``, ``eps_s ~ N(0, I)``,

with ``q_0 = N(0, prior_var)``. :class:`MeanFieldTwin` adds this posterior to an existing
module without changing its class: the module's own parameters are the means ``mu``, a
log-variance ``log sigma^2`` of the same shape is kept per parameter, and a sampled network
is evaluated with :func:`torch.func.functional_call`.

Which parameters are Gaussian: the weights and biases of every ``nn.Linear`` and
``nn.Conv2d`` (at any depth, including the heads of Avalanche's ``MultiHeadClassifier`` /
``IncrementalClassifier``). All other parameters (batch-norm affine, embeddings, ...) stay
deterministic: they are trained by the data term and enter no KL.

A parameter first seen after a task (a new head) starts from the prior ``N(0, prior_var)``
as its prior, its log-variance at ``init_logvar`` and its mean as the module initialised
it; a parameter that grew (new output units) keeps its old prior and variance in its
leading slice. Nothing here depends on Avalanche.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import functional_call

from fromp.continual.bayesian import gaussian_kl_flat
from fromp.continual.methods import fit_shape
from fromp.models import is_multitask, with_task

__all__ = ["MeanFieldTwin", "gaussian_names"]

_GAUSSIAN = (nn.Linear, nn.Conv2d)


def gaussian_names(model: nn.Module) -> list[str]:
    """Names (as in ``model.named_parameters()``) of the trainable weights and biases of its
    ``nn.Linear`` and ``nn.Conv2d`` layers: the parameters a :class:`MeanFieldTwin` makes
    Gaussian."""
    out = []
    for prefix, module in model.named_modules():
        if isinstance(module, _GAUSSIAN):
            for n, p in module.named_parameters(recurse=False):
                if p.requires_grad:
                    out.append(f"{prefix}.{n}" if prefix else n)
    return out


def _key(name: str) -> str:
    return name.replace(".", "__")


class MeanFieldTwin(nn.Module):
    """A mean-field Gaussian posterior over a module's ``Linear``/``Conv2d`` parameters.

    ``twin.parameters()`` are the module's parameters (the means) followed by the
    log-variances: give them to the optimizer. :meth:`sample_logits` draws ``S`` weight
    samples ``[S, N, K]``; :meth:`kl` is ``KL(q || prior)``; :meth:`set_prior_from_posterior`
    ends a task. Call :meth:`sync` after the module gained or grew parameters (an Avalanche
    dynamic module adapting to a new experience) and before building the optimizer.

    Args:
        model: the user's module: ``x -> logits``, a :mod:`fromp` multi-head model, or
            ``forward(x, task_labels)`` (Avalanche ``MultiTaskModule``).
        prior_var: variance of the initial prior ``N(0, prior_var)``.
        init_logvar: initial ``log sigma^2`` of every Gaussian parameter.

    Example:
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        >>> twin = MeanFieldTwin(net)
        >>> twin.sample_logits(torch.randn(5, 4), None, 2).shape
        torch.Size([2, 5, 3])
    """

    def __init__(self, model: nn.Module, *, prior_var: float = 1.0, init_logvar: float = -6.0):
        super().__init__()
        if not prior_var > 0:
            raise ValueError(f"prior_var must be > 0, got {prior_var!r}")
        self.model = model
        self.prior_var = float(prior_var)
        self.init_logvar = float(init_logvar)
        self.logvars = nn.ParameterDict()
        self.prior_mean: dict[str, Tensor] = {}
        self.prior_variance: dict[str, Tensor] = {}
        self.sync()

    @property
    def names(self) -> list[str]:
        """The Gaussian parameters' names in the model."""
        return gaussian_names(self.model)

    def sync(self) -> bool:
        """Give every Gaussian parameter a log-variance and a prior of its shape (new ones:
        ``init_logvar`` and ``N(0, prior_var)``; grown ones: padded). Returns whether
        anything changed."""
        changed = False
        params = dict(self.model.named_parameters())
        for n in self.names:
            p, k = params[n], _key(n)
            if k not in self.logvars or self.logvars[k].shape != p.shape:
                old = self.logvars[k].detach() if k in self.logvars else None
                lv = torch.full_like(p, self.init_logvar, requires_grad=False)
                if old is not None:
                    lv = fit_shape(old.to(p.device), p.shape, self.init_logvar)
                self.logvars[k] = nn.Parameter(lv.detach().clone())
                changed = True
            if n not in self.prior_mean:
                self.prior_mean[n] = torch.zeros_like(p).detach()
                self.prior_variance[n] = torch.full_like(p, self.prior_var).detach()
                changed = True
            elif self.prior_mean[n].shape != p.shape:
                self.prior_mean[n] = fit_shape(self.prior_mean[n], p.shape, 0.0)
                self.prior_variance[n] = fit_shape(self.prior_variance[n], p.shape, self.prior_var)
                changed = True
        return changed

    def forward(self, x: Tensor, task_labels: int | Tensor | None = None) -> Tensor:
        """The mean network's logits ``[N, K]`` (head ``task_labels`` for multi-task models;
        ignored otherwise)."""
        if not is_multitask(self.model):
            return self.model(x)
        if isinstance(task_labels, Tensor) and task_labels.ndim > 0:
            if not bool((task_labels == task_labels[0]).all()):
                raise ValueError("task_labels must hold one task for a MeanFieldTwin forward")
            task_labels = task_labels[0]
        task = None if task_labels is None else int(task_labels)
        return with_task(self.model, task)(x)

    def variance(self, name: str) -> Tensor:
        """``sigma^2`` of parameter ``name``."""
        return self.logvars[_key(name)].exp()

    def sample_params(self) -> dict[str, Tensor]:
        """One draw ``w = mu + sigma * eps`` of the Gaussian parameters (differentiable in
        ``mu`` and ``log sigma^2``), drawn on the parameters' device."""
        params = dict(self.model.named_parameters())
        out = {}
        for n in self.names:
            mu, lv = params[n], self.logvars[_key(n)]
            out[n] = mu + (0.5 * lv).exp() * torch.randn_like(mu)
        return out

    def sample_logits(self, x: Tensor, task: int | None, n_samples: int) -> Tensor:
        """Logits ``[S, N, K]`` of ``S = n_samples`` weight draws through head ``task``."""
        if n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {n_samples}")
        head = with_task(self.model, task)
        prefix = "model." if head is not self.model else ""
        outs = []
        for _ in range(n_samples):
            w = {prefix + n: v for n, v in self.sample_params().items()}
            outs.append(functional_call(head, w, (x,), strict=False))
        return torch.stack(outs)

    def kl(self) -> Tensor:
        """``KL(q || prior)`` summed over the Gaussian parameters (a scalar), in one pass
        over all of them (:func:`fromp.continual.bayesian.gaussian_kl_flat`)."""
        params = dict(self.model.named_parameters())
        names = self.names
        if not names:
            raise ValueError("the model has no Linear or Conv2d parameters to make Gaussian")
        return gaussian_kl_flat(
            (params[n], self.logvars[_key(n)], self.prior_mean[n], self.prior_variance[n])
            for n in names
        )

    @torch.no_grad()
    def set_prior_from_posterior(self) -> None:
        """End of a task: the posterior becomes the next task's prior."""
        params = dict(self.model.named_parameters())
        for n in self.names:
            self.prior_mean[n] = params[n].detach().clone()
            self.prior_variance[n] = self.variance(n).detach().clone()

    def method_state(self) -> dict:
        """Priors (the log-variances and means are in ``state_dict()``)."""
        return {
            "prior_mean": {n: v.detach().cpu().clone() for n, v in self.prior_mean.items()},
            "prior_variance": {n: v.detach().cpu().clone() for n, v in self.prior_variance.items()},
        }

    def load_method_state(self, state: dict) -> None:
        """Restore :meth:`method_state` on the model's device."""
        device = next(self.model.parameters()).device
        self.prior_mean = {n: v.to(device) for n, v in state["prior_mean"].items()}
        self.prior_variance = {n: v.to(device) for n, v in state["prior_variance"].items()}
