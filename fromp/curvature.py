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

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn

from fromp.jacobian import iter_jacobians, num_params, per_example_grads
from fromp.likelihood import Likelihood, get_likelihood

__all__ = ["DataArg", "diag_ef", "diag_fisher", "diag_ggn", "diag_ggn_linear", "iter_batches"]

DataArg = Tensor | tuple | list | Iterable


def iter_batches(
    data: DataArg, *, need_targets: bool = False
) -> Iterator[tuple[Tensor, Tensor | None]]:
    """Normalise ``data`` into ``(x, y)`` batches (``y`` None when absent).

    ``data`` is one batch, a tensor ``x`` or a *tuple* ``(x,)`` / ``(x, y, ...)`` of tensors,
    or an iterable of batches (a DataLoader, a *list* of tensors or of tuples). A list is
    always a sequence of batches, so ``[x1, x2]`` is two batches of inputs, never ``(x, y)``.
    """
    if isinstance(data, Tensor):
        if need_targets:
            raise ValueError("data must include targets, e.g. (x, y) or a DataLoader of (x, y)")
        yield data, None
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
        yield data[0], y
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
        yield x, y
    if empty:
        raise ValueError("data is empty: expected at least one batch")


def _device_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    p = next(p for p in model.parameters() if p.requires_grad)
    return p.device, p.dtype


def diag_ggn(
    model: nn.Module,
    data: DataArg,
    likelihood: str | Likelihood,
    *,
    chunk_size: int = 32,
) -> Tensor:
    """Exact diagonal of the GGN, ``diag(sum_n J_n^T Lambda(f_n) J_n)``, shape ``[P]``.

    Args:
        model: ``[N, ...] -> [N, C]`` (fix a multi-head model's head with
            :func:`fromp.models.with_task`); batch norm / dropout must be in eval mode.
        data: inputs, ``(x, ...)`` or an iterable of batches.
        likelihood: a :class:`~fromp.likelihood.Likelihood` or its name.
        chunk_size: examples per Jacobian chunk; memory is ``chunk_size * C * P`` numbers.

    Returns:
        ``[P]`` in the model's dtype, summed (not averaged) over examples.
    """
    lik = get_likelihood(likelihood)
    device, dtype = _device_dtype(model)
    out = torch.zeros(num_params(model), device=device, dtype=dtype)
    for x, _ in iter_batches(data):
        x = x.to(device)
        with torch.no_grad():
            f = model(x)
        sqrt_lam = lik.sqrt_hessian(f)  # N, C, K
        for rows, jac in iter_jacobians(model, x, chunk_size=chunk_size):
            ltj = torch.einsum("nck,ncp->nkp", sqrt_lam[rows], jac)
            out += ltj.pow(2).sum(dim=(0, 1))
    return out


def diag_ef(
    model: nn.Module,
    data: DataArg,
    likelihood: str | Likelihood,
    *,
    chunk_size: int = 64,
) -> Tensor:
    """Diagonal of the empirical Fisher ``sum_n g_n g_n^T``, ``g_n = grad nll(y_n | f(x_n))``,
    from exact per-example gradients. Shape ``[P]``; needs targets."""
    lik = get_likelihood(likelihood)
    device, dtype = _device_dtype(model)
    out = torch.zeros(num_params(model), device=device, dtype=dtype)
    for x, y in iter_batches(data, need_targets=True):
        g = per_example_grads(model, x.to(device), y.to(device), lik.nll, chunk_size=chunk_size)
        out += g.pow(2).sum(0)
    return out


def diag_fisher(
    model: nn.Module,
    data: DataArg,
    likelihood: str | Likelihood,
    *,
    n_samples: int = 1,
    generator: torch.Generator | None = None,
    chunk_size: int = 64,
) -> Tensor:
    """Monte Carlo diagonal of the (true) Fisher ``sum_n E_{y ~ p(y|f_n)} g_n(y) g_n(y)^T``
    with ``n_samples`` labels drawn per example. Shape ``[P]``. Its expectation equals
    :func:`diag_ggn` for the likelihoods of :mod:`fromp.likelihood` (canonical links)."""
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    lik = get_likelihood(likelihood)
    device, dtype = _device_dtype(model)
    out = torch.zeros(num_params(model), device=device, dtype=dtype)
    for x, _ in iter_batches(data):
        x = x.to(device)
        with torch.no_grad():
            f = model(x)
        for _ in range(n_samples):
            y = lik.sample(f, generator=generator)
            g = per_example_grads(model, x, y, lik.nll, chunk_size=chunk_size)
            out += g.pow(2).sum(0) / n_samples
    return out


def diag_ggn_linear(
    model: nn.Module,
    data: DataArg,
    likelihood: str | Likelihood,
) -> Tensor:
    """Exact GGN diagonal, as :func:`diag_ggn`, for networks whose trainable parameters all
    belong to ``nn.Linear`` layers (MLPs, multi-head MLPs), without per-example Jacobians.

    For a linear layer ``z = W a + b`` on per-example inputs ``a_n`` the per-example
    gradient of ``v^T f(x_n)`` is ``g_n a_n^T`` with ``g_n = dz_n`` (back-propagated ``v``),
    so ``diag(G)_W = sum_n sum_k (g_{n,k})^2 (a_n^2)^T`` and ``diag(G)_b = sum_n sum_k
    g_{n,k}^2``, where ``g_{n,k}`` is back-propagated from ``v = L_n[:, k]``
    (``Lambda_n = L_n L_n^T``). Cost: ``K`` batched backward passes per batch.

    Raises:
        ValueError: a trainable parameter outside an ``nn.Linear``, a linear layer applied
            twice in one forward pass, or a linear layer input that is not ``[B, in]``.
    """
    lik = get_likelihood(likelihood)
    device, dtype = _device_dtype(model)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    owned = {id(p) for m in linears for p in m.parameters()}
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in owned:
            raise ValueError(f"parameter {name!r} is not in an nn.Linear layer; use diag_ggn")
    acc = {id(p): torch.zeros_like(p) for p in model.parameters() if p.requires_grad}
    store: dict[nn.Module, tuple[Tensor, Tensor]] = {}

    def hook(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        if module in store:
            raise ValueError("an nn.Linear layer is applied twice in one forward; use diag_ggn")
        if inputs[0].ndim != 2:
            raise ValueError("nn.Linear inputs must be [B, in] for diag_ggn_linear; use diag_ggn")
        store[module] = (inputs[0].detach(), output)

    handles = [m.register_forward_hook(hook) for m in linears]
    try:
        for x, _ in iter_batches(data):
            store.clear()
            with torch.enable_grad():
                f = model(x.to(device))
            sqrt_lam = lik.sqrt_hessian(f.detach())  # B, C, K
            mods = list(store)
            outs = [store[m][1] for m in mods]
            n_k = sqrt_lam.shape[-1]
            for k in range(n_k):
                grads = torch.autograd.grad(
                    f, outs, grad_outputs=sqrt_lam[:, :, k], retain_graph=k < n_k - 1
                )
                for m, g in zip(mods, grads):
                    g2 = g.pow(2)
                    if m.weight.requires_grad:
                        acc[id(m.weight)] += g2.T @ store[m][0].pow(2)
                    if m.bias is not None and m.bias.requires_grad:
                        acc[id(m.bias)] += g2.sum(0)
    finally:
        for h in handles:
            h.remove()
        store.clear()
    out = torch.cat([acc[id(p)].reshape(-1) for p in model.parameters() if p.requires_grad])
    return out.to(device=device, dtype=dtype)
