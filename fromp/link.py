"""Link approximations of a Gaussian over a network's outputs, ``f ~ N(mu, var)`` per
example (``mu [N, C]``, ``var [N, C, C]``): Monte-Carlo draws, the Laplace bridge and the
probit approximation, and the sample covariance of output draws."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fromp.likelihood import randn_like_on

__all__ = ["PROBIT_SCALE", "glm_draws", "laplace_bridge", "probit_scale", "sample_cov"]

PROBIT_SCALE = math.pi / 8


def probit_scale(var: Tensor) -> Tensor:
    """``1 / sqrt(1 + pi/8 var_cc)`` ``[N, C]``: the probit approximation's scaling of the
    mean (MacKay 1992), per output."""
    return torch.rsqrt(1 + PROBIT_SCALE * torch.diagonal(var, dim1=-2, dim2=-1))


def sample_cov(f: Tensor) -> Tensor:
    """The unbiased covariance ``[N, C, C]`` of draws ``f [S, N, C]``."""
    d = f - f.mean(0)
    return torch.einsum("snc,snd->ncd", d, d) / max(len(f) - 1, 1)


def glm_draws(mu: Tensor, var: Tensor, n: int, generator: torch.Generator | None) -> Tensor:
    """``[n, N, C]`` draws of ``N(mu, var)`` per example (eigen square root: PSD ``var``)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n_samples must be a positive int, got {n!r}")
    evals, evecs = torch.linalg.eigh(0.5 * (var + var.transpose(1, 2)))
    root = evecs * evals.clamp_min(0).sqrt().unsqueeze(-2)
    eps = randn_like_on((n, *mu.shape), generator, mu.dtype, mu.device)
    return mu + torch.einsum("ncd,snd->snc", root, eps)


def laplace_bridge(mu: Tensor, var: Tensor) -> Tensor:
    """The Laplace bridge (Hobbhahn, Kristiadi & Hennig 2022): the Dirichlet matching
    ``N(mu, var)`` in the softmax basis after laplace-torch's zero-mean correction,
    ``alpha_k = (1 - 2/C + e^{mu_k} sum_l e^{-mu_l} / C^2) / var_kk``; returns its mean
    ``alpha / sum alpha`` ``[N, C]``."""
    s = var.sum(-1)  # [N, C]
    tot = var.sum(dim=(1, 2)).reshape(-1, 1)
    mu = mu - s * mu.sum(-1, keepdim=True) / tot
    var = var - torch.einsum("ni,nj->nij", s, var.sum(-2)) / tot.unsqueeze(-1)
    c = mu.shape[-1]
    v = torch.diagonal(var, dim1=1, dim2=2)
    alpha = (1 - 2 / c + mu.exp() / c**2 * torch.exp(-mu).sum(1, keepdim=True)) / v
    return torch.nan_to_num(alpha / alpha.sum(1, keepdim=True), nan=1.0)
