"""Predictive distributions of a network under a Gaussian weight posterior.

:func:`predict_mc` averages ``inverse_link(f(x; w_s))`` over draws ``w_s ~ q`` (the
predictive VOGN and IVON are evaluated with); :func:`predict_mean` evaluates at ``w = mean``.
``q`` is any :class:`~fromp.posterior.GaussianPosterior` over the model's ``P`` trainable
parameters (``VOGN.posterior()``, ``IVON.posterior(model)``, :func:`fromp.laplace`, ...). The
model's own parameters are never modified: the weights go in through
:func:`torch.func.functional_call`. Memory: one set of weights at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.func import functional_call

from fromp.curvature.jacobian import trainable_params, unflatten
from fromp.likelihood import Likelihood, get_likelihood
from fromp.posterior import GaussianPosterior

__all__ = ["predict_mc", "predict_mean"]


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Evaluate ``model`` in eval mode (no dropout, batch norm with running statistics) and
    restore its mode afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


def _check_posterior(model: nn.Module, posterior: GaussianPosterior) -> dict[str, Tensor]:
    if not isinstance(posterior, GaussianPosterior):
        raise TypeError(
            f"posterior must be a GaussianPosterior (e.g. DiagonalGaussian), got "
            f"{type(posterior).__name__}"
        )
    params = trainable_params(model)
    total = sum(p.numel() for p in params.values())
    if posterior.num_params != total:
        raise ValueError(f"posterior has P={posterior.num_params}, model has {total}")
    return params


def _weights(model: nn.Module, params: dict[str, Tensor], vec: Tensor) -> dict[str, Tensor]:
    """``vec [P]`` split like ``model``'s trainable parameters, each cast like its parameter."""
    return {n: t.to(params[n]) for n, t in unflatten(model, vec).items()}


@torch.no_grad()
def predict_mc(
    model: nn.Module,
    posterior: GaussianPosterior,
    x: Tensor,
    n_samples: int = 10,
    *,
    likelihood: Likelihood | str = "categorical",
    generator: torch.Generator | None = None,
) -> Tensor:
    """Monte-Carlo predictive ``(1/S) sum_s inverse_link(f(x; w_s))``, ``w_s ~ posterior``.

    Args:
        model: maps ``[N, ...] -> [N, C]``; its parameters are not modified; it is
            evaluated in eval mode (its mode is restored afterwards).
        posterior: over the model's trainable parameters (``[P]``).
        x: ``[N, ...]``. n_samples: ``S >= 1``.

    Returns:
        ``[N, C]`` (class probabilities for classification).
    """
    if not (isinstance(n_samples, int) and n_samples >= 1):
        raise ValueError(f"n_samples must be a positive int, got {n_samples!r}")
    params = _check_posterior(model, posterior)
    lik = get_likelihood(likelihood)
    buffers = dict(model.named_buffers())
    acc = None
    with _eval_mode(model):
        for _ in range(n_samples):
            w = _weights(model, params, posterior.sample(generator=generator))
            p = lik.inverse_link(functional_call(model, (w, buffers), (x,)))
            acc = p if acc is None else acc + p
    assert acc is not None
    return acc / n_samples


@torch.no_grad()
def predict_mean(
    model: nn.Module,
    posterior: GaussianPosterior,
    x: Tensor,
    *,
    likelihood: Likelihood | str = "categorical",
) -> Tensor:
    """``inverse_link(f(x; posterior.mean))`` ``[N, C]``."""
    params = _check_posterior(model, posterior)
    w = _weights(model, params, posterior.mean)
    with _eval_mode(model):
        f = functional_call(model, (w, dict(model.named_buffers())), (x,))
    return get_likelihood(likelihood).inverse_link(f)
