"""Jacobians of a network's outputs with respect to its parameters, and their products.

For a module ``f_w: x -> f(x) in R^C`` with trainable parameters ``w in R^P`` (flattened in
``model.named_parameters()`` order, skipping those with ``requires_grad=False``), the
per-example Jacobian is ``J(x) = df(x)/dw in R^{C x P}``.

Everything is built on :mod:`torch.func`: ``jacrev`` vectorised over examples with ``vmap``
for dense Jacobians, ``jvp``/``vjp`` for products that never form ``J``. Buffers (batch-norm
statistics) are passed through unchanged; models with batch norm or dropout must be in
``eval()`` mode, since a per-example forward pass cannot use batch statistics.

Shapes: ``N`` examples, ``C`` outputs, ``P`` parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vjp, vmap
from torch.func import jvp as _jvp

from fromp._checks import check_batch, check_chunk_size, check_model_output
from fromp.curvature.hooks import forward_hooks
from fromp.models import uncompiled

__all__ = [
    "CPU_MEMORY_BUDGET",
    "CUDA_MEMORY_CAP",
    "CUDA_MEMORY_FRACTION",
    "check_memory_budget",
    "default_memory_budget",
    "flat_params",
    "forward_numel",
    "iter_jacobians",
    "jacobians",
    "jvp",
    "num_params",
    "over_examples",
    "per_example_grads",
    "resolve_memory_budget",
    "row_chunks",
    "rows_per_chunk",
    "set_default_memory_budget",
    "trainable_params",
    "unflatten",
    "vjp_sum",
]


def trainable_params(model: nn.Module) -> dict[str, Tensor]:
    """The trainable parameters of ``model`` by name, detached, in registration order."""
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def num_params(model: nn.Module) -> int:
    """``P``: the number of trainable scalars of ``model``."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def flat_params(model: nn.Module) -> Tensor:
    """The trainable parameters of ``model`` as one detached vector ``[P]``."""
    return torch.cat([p.reshape(-1) for p in trainable_params(model).values()])


def unflatten(model: nn.Module, vec: Tensor) -> dict[str, Tensor]:
    """Split a ``[P]`` vector (or ``[..., P]``) into tensors shaped like the trainable
    parameters of ``model``; leading dimensions are kept."""
    params = trainable_params(model)
    total = sum(p.numel() for p in params.values())
    if vec.shape[-1] != total:
        raise ValueError(f"vec must have last dimension P={total}, got {tuple(vec.shape)}")
    out, i = {}, 0
    lead = vec.shape[:-1]
    for name, p in params.items():
        out[name] = vec[..., i : i + p.numel()].reshape((*lead, *p.shape))  # 0-dim p too
        i += p.numel()
    return out


def _stack(outs: list[Any]) -> Any:
    if isinstance(outs[0], dict):
        return {k: torch.stack([o[k] for o in outs]) for k in outs[0]}
    return torch.stack(outs)


def over_examples(fn: Callable[..., Any], in_dims: tuple[int | None, ...]) -> Callable[..., Any]:
    """``vmap(fn, in_dims)`` over a batch of examples (dimension 0 of the arguments whose
    ``in_dims`` entry is 0), or, for a module that ``vmap`` cannot batch, ``fn`` called once
    per example and the results stacked (same values, one call per example).

    ``nn.GRU`` and ``nn.RNN`` write their hidden state in place into a tensor without the
    vmapped dimension (``RuntimeError: output with shape [1, H] doesn't match the broadcast
    shape [B, 1, H]``); ``jacrev`` of one example batches over the outputs only and works.
    The fallback is taken when the batched call raises a ``RuntimeError`` and then kept for
    the later calls of the returned function; an error of the per-example call is raised as
    it is (a real error, not a batching limit)."""
    batched = vmap(fn, in_dims=in_dims)
    state = {"loop": False}

    def call(*args: Any) -> Any:
        if not state["loop"]:
            try:
                return batched(*args)
            except RuntimeError as err:
                if "random" in str(err):  # dropout in train mode: not a batching limit
                    raise
                state["loop"] = True
        n = next(len(a) for a, d in zip(args, in_dims) if d is not None)
        outs = [fn(*[a if d is None else a[i] for a, d in zip(args, in_dims)]) for i in range(n)]
        return _stack(outs)

    return call


def flatten_leading(d: dict[str, Tensor], n_lead: int) -> Tensor:
    return torch.cat([t.reshape(*t.shape[:n_lead], -1) for t in d.values()], dim=-1)


def _check_model_input(model: nn.Module, x: Tensor) -> None:
    check_batch(x, "x")
    if num_params(model) == 0:
        raise ValueError("model has no trainable parameters")


def single_output_fn(model: nn.Module) -> Callable[[dict[str, Tensor], Tensor], Tensor]:
    buffers = dict(model.named_buffers())

    def f(params: dict[str, Tensor], xi: Tensor) -> Tensor:
        out = functional_call(model, (params, buffers), (xi.unsqueeze(0),))
        return check_model_output(out, " for one example").squeeze(0)

    return f


def iter_jacobians(
    model: nn.Module, x: Tensor, *, chunk_size: int | None = None
) -> Iterator[tuple[slice, Tensor]]:
    """Yield ``(rows, J[rows])`` with ``J[rows]`` of shape ``[n, C, P]``, ``n <= chunk_size``.

    Peak memory is that of one chunk's Jacobian (``chunk_size * C * P`` numbers) plus the
    ``jacrev`` intermediates of ``chunk_size`` examples; consumers that reduce over examples
    (GGN diagonals, kernels) stay memory-bounded for any ``N``.
    """
    model = uncompiled(model)
    _check_model_input(model, x)
    params = trainable_params(model)
    jac_fn = over_examples(jacrev(single_output_fn(model)), (None, 0))
    n = len(x)
    chunk_size = check_chunk_size(chunk_size)
    step = n if chunk_size is None else chunk_size
    for start in range(0, n, step):
        rows = slice(start, min(start + step, n))
        yield rows, flatten_leading(jac_fn(params, x[rows]), 2)


def jacobians(model: nn.Module, x: Tensor, *, chunk_size: int | None = None) -> Tensor:
    """Per-example Jacobians ``J[n] = d f(x_n) / d w``.

    Args:
        model: a module mapping ``[N, ...] -> [N, C]`` (fix a multi-head model's head with
            :func:`fromp.models.with_task`).
        x: inputs ``[N, ...]``.
        chunk_size: examples per ``vmap(jacrev)`` call; bounds the intermediate memory.

    Returns:
        ``[N, C, P]``, parameters flattened in ``named_parameters()`` order.

    Example:
        >>> import torch
        >>> net = torch.nn.Linear(3, 2)
        >>> jacobians(net, torch.randn(5, 3)).shape
        torch.Size([5, 2, 8])
    """
    return torch.cat([j for _, j in iter_jacobians(model, x, chunk_size=chunk_size)], dim=0)


def _batch_fn(model: nn.Module, x: Tensor) -> Callable[[dict[str, Tensor]], Tensor]:
    buffers = dict(model.named_buffers())

    def f(params: dict[str, Tensor]) -> Tensor:
        return check_model_output(functional_call(model, (params, buffers), (x,)))

    return f


def jvp(model: nn.Module, x: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Jacobian-vector product: ``(f(x) [N, C], J(x) v [N, C])`` for a direction ``v [P]``.

    One forward-mode pass; ``J`` is never formed.
    """
    model = uncompiled(model)
    _check_model_input(model, x)
    params = trainable_params(model)
    tangents = unflatten(model, v.to(next(iter(params.values())).dtype))
    return _jvp(_batch_fn(model, x), (params,), (tangents,))


def vjp_sum(model: nn.Module, x: Tensor, u: Tensor) -> Tensor:
    """Vector-Jacobian product summed over examples: ``sum_n J(x_n)^T u_n`` ``[P]`` for
    ``u [N, C]``. One reverse-mode pass; ``J`` is never formed."""
    model = uncompiled(model)
    _check_model_input(model, x)
    out, pullback = vjp(_batch_fn(model, x), trainable_params(model))
    if u.shape != out.shape:
        raise ValueError(f"u must have the output's shape {tuple(out.shape)}, got {tuple(u.shape)}")
    (g,) = pullback(u.to(out.dtype))
    return flatten_leading(g, 0)


def per_example_grads(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    loss: Callable[[Tensor, Tensor], Tensor],
    *,
    chunk_size: int | None = None,
) -> Tensor:
    """Per-example gradients ``g_n = d loss(f(x_n), y_n) / d w``, ``[N, P]``.

    Args:
        loss: ``(f [B, C], y [B]) -> [B]`` per-example losses (e.g. a likelihood's ``nll``).
        chunk_size: examples per ``vmap(grad)`` call.

    Exact for any architecture, convolutions with weight sharing included.
    """
    model = uncompiled(model)
    _check_model_input(model, x)
    if len(y) != len(x):
        raise ValueError(f"y must have N={len(x)} entries, got {len(y)}")
    params = trainable_params(model)
    f = single_output_fn(model)

    def single(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return loss(f(p, xi).unsqueeze(0), yi.unsqueeze(0)).sum()

    grad_fn = over_examples(torch.func.grad(single), (None, 0, 0))
    step = len(x) if chunk_size is None else int(chunk_size)
    outs = [
        flatten_leading(grad_fn(params, x[s : s + step], y[s : s + step]), 1)
        for s in range(0, len(x), step)
    ]
    return torch.cat(outs, dim=0)


# ---------------------------------------------------------------------- memory budget
#: The working-memory budget on a CPU when none is given (bytes).
CPU_MEMORY_BUDGET = 2 * 1024**3
#: The fraction of the device's free memory (``torch.cuda.mem_get_info``) taken as the
#: budget on CUDA when none is given, at most ``CUDA_MEMORY_CAP`` bytes (larger chunks of
#: test inputs are no faster: the work is per input).
CUDA_MEMORY_FRACTION = 0.5
CUDA_MEMORY_CAP = 4 * 1024**3
_user_default: list[int | None] = [None]


def check_memory_budget(value: object, name: str = "memory_budget") -> int:
    """``value`` as a positive ``int`` number of bytes, else a ``ValueError`` naming
    ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int (bytes), got {value!r}")
    return int(value)


def set_default_memory_budget(value: int | None) -> None:
    """Set the budget (bytes) every predictive, kernel and sampling path uses when neither
    the call nor the object names one; None restores the derived default
    (:func:`default_memory_budget`)."""
    _user_default[0] = None if value is None else check_memory_budget(value)


def default_memory_budget(device: torch.device | str | None = None) -> int:
    """The working-memory budget in bytes when none is given: the value of
    :func:`set_default_memory_budget` if set; on a CUDA device ``CUDA_MEMORY_FRACTION``
    (0.5) of its free memory (``torch.cuda.mem_get_info``), at most ``CUDA_MEMORY_CAP``
    (4 GiB); else ``CPU_MEMORY_BUDGET`` (2 GiB)."""
    if _user_default[0] is not None:
        return _user_default[0]
    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda" and torch.cuda.is_available():
        free = free_memory(device)
        return max(1, min(CUDA_MEMORY_CAP, int(free * CUDA_MEMORY_FRACTION)))
    return CPU_MEMORY_BUDGET


def free_memory(device: torch.device | str | None = None) -> int | None:
    """Bytes free on ``device`` now: ``torch.cuda.mem_get_info`` on a CUDA device, the
    available physical memory (``os.sysconf``) on the CPU; None where neither can tell."""
    import os

    device = torch.device("cpu" if device is None else device)
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "cpu":
        try:
            return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            return None
    return None


def resolve_memory_budget(*given: int | None, device: torch.device | str | None = None) -> int:
    """The first of ``given`` that is not None (each checked: a positive int), else
    :func:`default_memory_budget` of ``device``."""
    for value in given:
        if value is not None:
            return check_memory_budget(value)
    return default_memory_budget(device)


def rows_per_chunk(bytes_per_row: int, budget: int) -> int:
    """How many rows (test inputs) of ``bytes_per_row`` working memory fit ``budget``
    bytes: ``max(1, budget // bytes_per_row)``."""
    return max(1, int(budget) // max(1, int(bytes_per_row)))


def row_chunks(n: int, step: int) -> list[slice]:
    """``[0, n)`` as consecutive slices of ``step`` rows (the last one shorter)."""
    return [slice(s, min(s + step, n)) for s in range(0, n, max(1, step))]


def forward_numel(model: nn.Module, x0: Tensor) -> tuple[int, int, int]:
    """``(A, U, C)`` for one example ``x0`` ``[1, ...]``: ``A`` the numbers the forward pass
    produces in all leaf modules (what autograd keeps for a backward pass, at most), ``U``
    the largest unfolded convolution input ``L * in_channels * kh * kw`` (a Kronecker
    factor's per-example input rows), ``C`` the output's last dimension. One forward pass
    without gradients."""
    sizes: list[int] = []
    unfold = [0]

    def hook(m: nn.Module, inputs: Any, out: Any) -> None:
        if isinstance(out, Tensor):
            sizes.append(out.numel())
            if isinstance(m, nn.Conv1d | nn.Conv2d | nn.Conv3d):
                spatial = out[0, 0].numel() if out.ndim > 2 else 1
                unfold[0] = max(unfold[0], spatial * m.weight[0].numel())

    model = uncompiled(model)
    leaves = [m for m in model.modules() if not list(m.children())]
    with forward_hooks(leaves, hook), torch.no_grad():
        out = model(x0)
    if not isinstance(out, Tensor):
        check_model_output(out)
    sizes.append(out.numel())
    return sum(sizes), unfold[0], out.shape[-1]
