"""Curvature of the loss: generalised Gauss-Newton (GGN) and Fisher diagonals.

For per-example Jacobians ``J_n [C, P]`` and output Hessians ``Lambda_n = L_n L_n^T``
(:mod:`fromp.likelihood`), the GGN is ``G = sum_n J_n^T Lambda_n J_n``. Its diagonal is
computed without forming ``G`` and without a backward pass per class:
``diag(G) = sum_n sum_k (L_n^T J_n)_{k,:}^2``, with ``J`` evaluated in chunks of examples so
that peak memory is ``chunk_size * C * P`` numbers.

``data`` may be a tensor of inputs ``[N, ...]``, a tuple ``(x, y, ...)``, or an iterable of
such batches (a ``DataLoader``). The GGN needs only inputs; the empirical Fisher needs
targets.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from fromp._checks import check_batch, check_model_output, device_dtype
from fromp.curvature.capture import DEFAULT_MEMORY_BUDGET, sum_squared_column_grads
from fromp.likelihood import Likelihood, get_likelihood
from fromp.models import uncompiled

__all__ = ["DataArg", "diag_ef", "diag_fisher", "diag_ggn", "diag_ggn_linear", "iter_batches"]

DataArg = Tensor | tuple | list | Iterable


def iter_batches(
    data: DataArg, *, need_targets: bool = False
) -> Iterator[tuple[Tensor, Tensor | None]]:
    """Normalise ``data`` into ``(x, y)`` batches (``y`` None when absent).

    ``data`` is one batch, a tensor ``x`` or a *tuple* ``(x,)`` / ``(x, y, ...)`` of tensors,
    or an iterable of batches (a DataLoader, a *list* of tensors or of tuples). A list is
    always a sequence of batches, so ``[x1, x2]`` is two batches of inputs, never ``(x, y)``.
    Every ``x`` passes :func:`fromp._checks.check_batch` (``"data input"``: a non-empty tensor
    with finite entries) before it is yielded.
    """
    if isinstance(data, Tensor):
        if need_targets:
            raise ValueError("data must include targets, e.g. (x, y) or a DataLoader of (x, y)")
        yield check_batch(data, "data input"), None
        return
    if isinstance(data, tuple) and len(data) > 0 and isinstance(data[0], Tensor):
        if len(data) > 1 and (not isinstance(data[1], Tensor) or len(data[1]) != len(data[0])):
            raise ValueError(
                "data=(x, y) needs x and y with the same number of examples, got "
                f"{len(data[0])} and {len(data[1]) if isinstance(data[1], Tensor) else data[1]!r}"
            )
        y = data[1] if len(data) > 1 else None
        if need_targets and y is None:
            raise ValueError("data must include targets, e.g. (x, y)")
        yield check_batch(data[0], "data input"), y
        return
    empty = True
    for batch in data:
        empty = False
        if isinstance(batch, Tensor):
            x, y = batch, None
        else:
            x, y = batch[0], (batch[1] if len(batch) > 1 else None)
        if need_targets and y is None:
            raise ValueError("data batches must include targets (x, y, ...)")
        yield check_batch(x, "data input"), y
    if empty:
        raise ValueError("data is empty: expected at least one batch")


def _squared_nll_grads(
    model: nn.Module,
    batches: Iterable[tuple[Tensor, Tensor]],
    lik: Likelihood,
    **route: Any,
) -> Tensor:
    """``sum_n (1/S) sum_s g_n(y_ns)^2`` ``[P]``, ``g_n(y) = grad nll(y | f(x_n))``, over
    ``batches`` of ``(x [B, ...], ys [S, B, ...])``: the empirical Fisher's diagonal with the
    observed labels (``S = 1``), the Monte Carlo Fisher's with ``S`` sampled label sets.
    The columns ``V [B, C, S]`` (the nll's gradients in ``f``, scaled by ``1/sqrt(S)``) go
    to :func:`~fromp.curvature.capture.sum_squared_column_grads` with ``route``
    (``chunk_size``, ``memory_budget``, ``method``)."""

    def columns(f: Tensor, ys: Tensor) -> Tensor:
        cols = []
        for y in ys:
            ff = f.detach().requires_grad_(True)
            with torch.enable_grad():
                (g,) = torch.autograd.grad(lik.nll(ff, y.to(f.device)).sum(), ff)
            cols.append(g)
        return torch.stack(cols, dim=-1) / math.sqrt(len(ys))

    return sum_squared_column_grads(model, batches, columns, **route)


def diag_ggn(
    model: nn.Module,
    data: DataArg,
    likelihood: str | Likelihood,
    *,
    chunk_size: int | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    method: str = "auto",
    mc_samples: int = 0,
    generator: torch.Generator | None = None,
) -> Tensor:
    r"""Diagonal of the GGN, ``diag(sum_n J_n^T Lambda(f_n) J_n)``, shape ``[P]``.

    Exact (``mc_samples=0``): with ``Lambda_n = L_n L_n^T`` (``L_n [C, K]``,
    :meth:`~fromp.likelihood.Likelihood.sqrt_hessian`),
    ``diag(G) = sum_n sum_k (J_n^T L_{n,:,k})^2``: one backward pass per column ``k`` of
    ``L`` (``K = C`` for the categorical likelihood) per chunk of examples, to the outputs of
    the captured layers (:mod:`fromp.curvature.capture`: ``Linear``, ``Conv1d/2d``, batch norm in
    eval mode, ``LayerNorm``, ``GroupNorm``), whose parameters' squared per-example gradients
    follow from the layer inputs and those output gradients; any other trainable parameter
    goes through per-example Jacobians (never skipped). Cost per example: about ``K``
    backward passes; memory set by ``memory_budget``, independent of ``P * chunk``.

    Monte Carlo (``mc_samples = S > 0``): the same with ``V_n`` the nll gradients at ``S``
    labels drawn from the model's predictive (:func:`diag_fisher`): unbiased for the GGN for
    the likelihoods of :mod:`fromp.likelihood` (canonical links), ``S`` backward passes.

    Args:
        model: ``[N, ...] -> [N, C]`` (fix a multi-head model's head with
            :func:`fromp.models.with_task`); batch norm / dropout should be in eval mode
            (a batch-norm layer in training mode is not captured and goes through the
            per-example Jacobian route).
        data: inputs, ``(x, ...)`` or an iterable of batches.
        likelihood: a :class:`~fromp.likelihood.Likelihood` or its name.
        chunk_size: examples per chunk; None derives it from ``memory_budget``.
        memory_budget: working memory in bytes (default 2 GiB) from which the chunk size and
            the sub-chunks of per-example convolution gradients are derived: roughly
            ``chunk * (2K + 6) * activations + chunk * C * P_fallback`` numbers.
        method: ``"auto"``, ``"capture"`` (error if a parameter needs the fallback) or
            ``"jacobian"`` (per-example Jacobians of all parameters: the reference route).
        mc_samples: 0 for the exact diagonal, ``S > 0`` for the sampled one.
        generator: random numbers for ``mc_samples > 0``.

    Returns:
        ``[P]`` in the model's dtype, summed (not averaged) over examples.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
        ...                           torch.nn.Linear(4, 2))
        >>> diag_ggn(net, torch.randn(10, 3), "categorical").shape
        torch.Size([26])
    """
    if isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 0:
        raise ValueError(f"mc_samples must be an int >= 0, got {mc_samples!r}")
    if mc_samples > 0:
        return diag_fisher(
            model, data, likelihood, n_samples=mc_samples, generator=generator,
            chunk_size=chunk_size, memory_budget=memory_budget, method=method,
        )  # fmt: skip
    lik = get_likelihood(likelihood)
    device_dtype(model)
    batches = ((x, None) for x, _ in iter_batches(data))
    return sum_squared_column_grads(
        model,
        batches,
        lambda f, _: lik.sqrt_hessian(f),
        memory_budget=memory_budget,
        chunk_size=chunk_size,
        method=method,
    )


def diag_ef(
    model: nn.Module,
    data: DataArg,
    likelihood: str | Likelihood,
    *,
    chunk_size: int | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    method: str = "auto",
) -> Tensor:
    """Diagonal of the empirical Fisher ``sum_n g_n g_n^T``, ``g_n = grad nll(y_n | f(x_n))``,
    shape ``[P]``; needs targets. One backward pass per chunk (``V_n`` = the nll gradient
    in ``f``, see :func:`diag_ggn` for the routes, memory and arguments)."""
    lik = get_likelihood(likelihood)
    device_dtype(model)
    batches = ((x, y.unsqueeze(0)) for x, y in iter_batches(data, need_targets=True))
    return _squared_nll_grads(
        model, batches, lik, chunk_size=chunk_size, memory_budget=memory_budget, method=method
    )


def diag_fisher(
    model: nn.Module,
    data: DataArg,
    likelihood: str | Likelihood,
    *,
    n_samples: int = 1,
    generator: torch.Generator | None = None,
    chunk_size: int | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    method: str = "auto",
) -> Tensor:
    """Monte Carlo diagonal of the (true) Fisher ``sum_n E_{y ~ p(y|f_n)} g_n(y) g_n(y)^T``
    with ``n_samples`` labels drawn per example. Shape ``[P]``. Its expectation equals
    :func:`diag_ggn` for the likelihoods of :mod:`fromp.likelihood` (canonical links).
    Labels are drawn per batch from one no-grad forward pass, then ``n_samples`` backward
    passes per chunk (routes, memory and arguments as :func:`diag_ggn`)."""
    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    lik = get_likelihood(likelihood)
    model = uncompiled(model)  # the labels' forward pass runs eagerly too
    device, _ = device_dtype(model)

    def batches():
        for x, _ in iter_batches(data):
            x = x.to(device)
            with torch.no_grad():
                f = check_model_output(model(x))
            ys = torch.stack([lik.sample(f, generator=generator) for _ in range(n_samples)])
            yield x, ys

    return _squared_nll_grads(
        model, batches(), lik, chunk_size=chunk_size, memory_budget=memory_budget, method=method
    )


def diag_ggn_linear(
    model: nn.Module,
    data: DataArg,
    likelihood: str | Likelihood,
) -> Tensor:
    """Exact GGN diagonal for networks whose trainable parameters all belong to
    ``nn.Linear`` layers: :func:`diag_ggn` with ``method="capture"`` (kept for existing
    callers; :func:`diag_ggn` takes this route by itself).

    Raises:
        ValueError: a trainable parameter outside an ``nn.Linear`` layer, or a layer applied
            more than once per forward pass.
    """
    linear = {id(p) for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()}
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in linear:
            raise ValueError(f"parameter {name!r} is not in an nn.Linear layer; use diag_ggn")
    try:
        return diag_ggn(model, data, likelihood, method="capture")
    except ValueError as err:
        if "more than once" in str(err):
            raise ValueError(
                "an nn.Linear layer is applied twice in one forward; use diag_ggn"
            ) from err
        raise
