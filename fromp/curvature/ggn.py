"""The full generalised Gauss-Newton matrix (small models) and GGN-vector products.

For per-example Jacobians ``J_n = d f(x_n) / d w`` ``[C, P]`` and output Hessians
``Lambda_n = Lambda(f(x_n)) = L_n L_n^T`` (:mod:`fromp.likelihood`), the GGN is

    ``G = sum_n J_n^T Lambda_n J_n = sum_n (L_n^T J_n)^T (L_n^T J_n)``  ``[P, P]``.

:func:`ggn` forms ``G`` densely, which costs ``P^2`` numbers of memory and
``N * K * P^2`` operations: it is meant for small models (exactness tests, the full-covariance
Laplace of :mod:`fromp.laplace`, evidence of small models) and refuses ``P > max_params``.
:func:`ggn_vp` computes ``G v`` with one forward-mode and one reverse-mode pass per batch
and never forms ``J`` or ``G``; it works for any model size.
The diagonal ``diag(G)`` is :func:`fromp.curvature.diag_ggn`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap
from torch.func import jvp as func_jvp
from torch.func import vjp as func_vjp

from fromp._checks import check_model_output, check_vector, device_dtype
from fromp.curvature.diagonal import DataArg, iter_batches
from fromp.curvature.jacobian import (
    iter_jacobians,
    jvp,
    num_params,
    trainable_params,
    unflatten,
    vjp_sum,
)
from fromp.likelihood import Likelihood, get_likelihood
from fromp.models import uncompiled

__all__ = ["ggn", "ggn_matmat", "ggn_vp"]


def ggn(
    model: nn.Module,
    data: DataArg,
    likelihood: str | Likelihood,
    *,
    chunk_size: int = 32,
    max_params: int = 20_000,
) -> Tensor:
    """The full GGN ``G = sum_n J_n^T Lambda(f_n) J_n`` of a SMALL model, ``[P, P]``.

    Accumulated chunk by chunk as ``(L^T J)^T (L^T J)`` with ``J`` of ``chunk_size``
    examples at a time (``chunk_size * C * P`` numbers) plus the ``P x P`` result, which is
    why ``P`` is capped: ``P = 20 000`` in float64 already needs 3.2 GB.

    Args:
        model: ``[N, ...] -> [N, C]`` (fix a multi-head model's head with
            :func:`fromp.models.with_task`); batch norm / dropout in eval mode.
        data: inputs ``[N, ...]``, ``(x, ...)`` or an iterable of batches (targets unused).
        likelihood: a :class:`~fromp.likelihood.Likelihood` or its name.
        chunk_size: examples per Jacobian chunk.
        max_params: refuse models with more than this many trainable parameters.

    Returns:
        ``[P, P]`` symmetric PSD, summed (not averaged) over examples, in the model's dtype.

    Raises:
        ValueError: if ``P > max_params`` or the inputs are not finite.
    """
    model = uncompiled(model)
    p_total = num_params(model)
    if p_total > max_params:
        raise ValueError(
            f"model has P={p_total} trainable parameters > max_params={max_params}: the full "
            "GGN needs P*P numbers; use fromp.curvature.diag_ggn or fromp.ggn_vp instead, "
            "or raise max_params"
        )
    lik = get_likelihood(likelihood)
    device, dtype = device_dtype(model)
    out = torch.zeros(p_total, p_total, device=device, dtype=dtype)
    for x, _ in iter_batches(data):
        x = x.to(device)
        with torch.no_grad():
            f = check_model_output(model(x))
        sqrt_lam = lik.sqrt_hessian(f)  # N, C, K
        for rows, jac in iter_jacobians(model, x, chunk_size=chunk_size):
            ltj = torch.einsum("nck,ncp->nkp", sqrt_lam[rows], jac).reshape(-1, p_total)
            out += ltj.T @ ltj
    return out


def ggn_vp(model: nn.Module, x: DataArg, likelihood: str | Likelihood, v: Tensor) -> Tensor:
    """GGN-vector product ``G v = sum_n J_n^T Lambda(f_n) J_n v`` ``[P]``, matrix-free.

    Per batch: ``(f, J v) = jvp(model, x, v)`` (forward mode), ``u_n = Lambda(f_n) (J v)_n``,
    then ``sum_n J_n^T u_n`` (reverse mode). Memory is that of two passes over the batch;
    neither ``J`` nor ``G`` is formed.

    Args:
        model: ``[N, ...] -> [N, C]``.
        x: inputs ``[N, ...]`` (or ``(x, ...)`` / an iterable of batches; products summed).
        likelihood: a :class:`~fromp.likelihood.Likelihood` or its name.
        v: direction ``[P]``.

    Returns:
        ``[P]`` in the model's dtype.
    """
    lik = get_likelihood(likelihood)
    device, dtype = device_dtype(model)
    p_total = num_params(model)
    check_vector(v, p_total, "v")
    v = v.to(device=device, dtype=dtype)
    out = torch.zeros(p_total, device=device, dtype=dtype)
    for xb, _ in iter_batches(x):
        xb = xb.to(device)
        f, jv = jvp(model, xb, v)
        u = torch.einsum("ncd,nd->nc", lik.hessian(f.detach()), jv.detach())
        out += vjp_sum(model, xb, u)
    return out


def ggn_matmat(
    model: nn.Module, batches: list[Tensor], likelihood: Likelihood, v: Tensor
) -> Tensor:
    """``G V = sum_n J_n^T Lambda_n (J_n V)`` ``[P, m]`` for ``V`` ``[P, m]`` (:func:`ggn_vp`
    for several directions at once, over a list of input batches): per batch
    one forward-mode pass per column (vectorised) and one reverse-mode pullback per column
    (vectorised); ``J`` and ``G`` are never formed."""
    model = uncompiled(model)
    params = trainable_params(model)
    buffers = dict(model.named_buffers())
    tangents = unflatten(model, v.T.to(next(iter(params.values())).dtype))  # [m, ...] each
    out = torch.zeros_like(v)
    for x in batches:

        def fwd(p: dict[str, Tensor], x: Tensor = x) -> Tensor:
            return functional_call(model, (p, buffers), (x,))

        f, pullback = func_vjp(fwd, params)
        lam = likelihood.hessian(check_model_output(f).detach())  # [N, C, C]
        jv = vmap(lambda t, fwd=fwd: func_jvp(fwd, (params,), (t,))[1])(tangents)  # [m, N, C]
        u = torch.einsum("ncd,mnd->mnc", lam, jv)
        (g,) = vmap(pullback)(u)
        out += torch.cat([t.reshape(len(u), -1) for t in g.values()], 1).T
    return out
