"""Dense float64 references, to check ``fromp`` and code built on it against plain autograd.

Each function here builds its object the slow, obvious way, independently of ``fromp``'s
own engines (layer capture, ``torch.func`` batching, Kronecker factors, the GP and Laplace
classes): the Jacobian by :func:`torch.autograd.functional.jacobian` of the batched forward
pass in one flat weight vector, the output Hessians of the negative log-likelihood by
:func:`torch.autograd.functional.hessian`, the GGN, the DNN2GP kernel, the Laplace posterior
covariance and the linearised predictive by dense ``[P, P]`` algebra. They build ``P x P``
matrices: for networks of at most a few thousand weights, in float64. Use them to check a
fast path on your own model, as fromp's tests do::

    >>> import torch, fromp
    >>> from fromp.testing import dense_ggn
    >>> _ = torch.manual_seed(0)
    >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    >>> net, x = net.double(), torch.randn(5, 3, dtype=torch.float64)
    >>> likelihood = fromp.CategoricalLikelihood()
    >>> g = fromp.ggn(net, x, likelihood)  # fromp's GGN, [P, P]
    >>> torch.allclose(g, dense_ggn(net, x, likelihood))
    True

Shapes: ``N`` examples, ``C`` outputs, ``P`` trainable weights (in ``named_parameters()``
order, the order of :func:`flat` and of :func:`fromp.flat_params`). Nothing in ``fromp``
imports this module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

__all__ = [
    "dense_ggn",
    "dense_jacobian",
    "dense_kernel",
    "dense_nll_hessians",
    "dense_posterior_covariance",
    "dense_predictive",
    "flat",
    "forward_at",
    "split",
]


# ------------------------------------------------------------------------------ flat weights
def flat(model: nn.Module) -> Tensor:
    """Trainable parameters of ``model`` flattened in ``named_parameters()`` order ``[P]``."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])


def split(model: nn.Module, w: Tensor) -> dict[str, Tensor]:
    """A flat vector ``w [P]`` as a parameter dict of ``model`` (differentiable in ``w``)."""
    out, i = {}, 0
    for name, p in model.named_parameters():
        if p.requires_grad:
            out[name] = w[i : i + p.numel()].view_as(p)
            i += p.numel()
    if i != w.numel():
        raise ValueError(f"w has {w.numel()} entries, the model {i} trainable weights")
    return out


def forward_at(model: nn.Module, w: Tensor, x: Tensor) -> Tensor:
    """``f_w(x) [N, C]`` with the flat weights ``w [P]`` (buffers from the module)."""
    return functional_call(model, (split(model, w), dict(model.named_buffers())), (x,))


# ----------------------------------------------------------------------------- curvature
def dense_jacobian(model: nn.Module, x: Tensor, w: Tensor | None = None) -> Tensor:
    """``J[n, c, p] = d f_c(x_n) / d w_p`` ``[N, C, P]`` by
    ``torch.autograd.functional.jacobian`` of the batched forward pass (``w``: the model's
    weights when None)."""
    w = flat(model) if w is None else w
    return torch.autograd.functional.jacobian(lambda v: forward_at(model, v, x), w)


def dense_nll_hessians(likelihood: Any, f: Tensor, y: Tensor) -> Tensor:
    """``Lambda_n = d^2 nll(f_n, y_n) / d f_n^2`` ``[N, C, C]``, one autograd Hessian per
    example; ``likelihood`` is anything with ``nll(f [1, C], y [1, ...]) -> [1]`` (a
    :class:`fromp.likelihood.Likelihood`, or one of your own)."""
    return torch.stack(
        [
            torch.autograd.functional.hessian(
                lambda fi, yi=y[i : i + 1]: likelihood.nll(fi.unsqueeze(0), yi).sum(), f[i]
            )
            for i in range(len(f))
        ]
    )


def dense_ggn(
    model: nn.Module, x: Tensor, likelihood: Any, w: Tensor | None = None, y: Tensor | None = None
) -> Tensor:
    """The generalised Gauss-Newton ``G = sum_n J_n^T Lambda_n J_n`` ``[P, P]``, ``J_n
    [C, P]`` from :func:`dense_jacobian` and ``Lambda_n [C, C]`` from
    :func:`dense_nll_hessians`. Targets ``y`` default to ``likelihood.sample(f)``: the Hessian does
    not depend on them for the Gaussian, Bernoulli and categorical likelihoods."""
    w = flat(model) if w is None else w
    jac = dense_jacobian(model, x, w)
    with torch.no_grad():
        f = forward_at(model, w, x)
    y = likelihood.sample(f) if y is None else y
    lam = dense_nll_hessians(likelihood, f, y)
    out = torch.zeros(w.numel(), w.numel(), dtype=w.dtype)
    for n in range(len(x)):
        out += jac[n].T @ lam[n] @ jac[n]
    return out


# ---------------------------------------------------------------------- GP and posterior
def dense_kernel(j1: Tensor, cov: Tensor, j2: Tensor) -> Tensor:
    """``K[n, c, m, d] = J1[n, c] Sigma J2[m, d]^T`` ``[N, C, M, D]`` with a dense
    ``Sigma [P, P]``, ``J1 [N, C, P]``, ``J2 [M, D, P]``."""
    return torch.einsum("ncp,pq,mdq->ncmd", j1, cov, j2)


def dense_posterior_covariance(ggn: Tensor, prior_precision: float | Tensor) -> Tensor:
    """The Laplace posterior covariance ``Sigma = (G + diag(delta))^{-1}`` ``[P, P]`` from a
    dense curvature ``G [P, P]`` (e.g. :func:`dense_ggn`) and the prior precision ``delta``
    (a scalar or ``[P]``), by an explicit inverse in float64."""
    g = ggn.double()
    delta = torch.as_tensor(prior_precision, dtype=torch.float64)
    prec = g + torch.diag(delta.expand(g.shape[0]))
    return torch.linalg.inv(prec)


def dense_predictive(
    model: nn.Module, x: Tensor, cov: Tensor, w: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The linearised (GLM) predictive of the outputs under ``N(w, Sigma)``: mean
    ``f_w(x) [N, C]`` and covariance ``J(x_n) Sigma J(x_n)^T`` ``[N, C, C]`` per example."""
    w = flat(model) if w is None else w
    jac = dense_jacobian(model, x, w)
    with torch.no_grad():
        mean = forward_at(model, w, x)
    covs = torch.stack([jac[n] @ cov @ jac[n].T for n in range(len(x))])
    return mean, covs
