"""Per-parameter state by name and the helpers the continual methods share: flat vectors
split by parameter (0-dim parameters included), state of parameters that grew, label checks
against a head, and the batch-norm running statistics swapped in and out of a network."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from fromp._checks import probe_outputs

__all__ = ["Named", "by_name", "fit_shape", "to_flat"]

#: Per-parameter state: ``{parameter name: tensor of the parameter's shape}``.
Named = dict[str, Tensor]


def by_name(net: nn.Module, value: Tensor | Named) -> Named:
    """Per-parameter state of ``net`` as detached clones keyed by parameter name: a flat
    ``[P]`` vector (trainable parameters in ``named_parameters()`` order) is split by
    parameter; a dict is copied as it is."""
    if isinstance(value, Tensor):
        named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
        sizes = [p.numel() for _, p in named]
        if value.ndim != 1 or value.numel() != sum(sizes):
            raise ValueError(
                f"a flat state must be a [P]=[{sum(sizes)}] vector, got {tuple(value.shape)}"
            )
        # reshape(p.shape) (a torch.Size) also fits 0-dim parameters (a learnt temperature)
        value = {n: v.reshape(p.shape) for (n, p), v in zip(named, value.detach().split(sizes))}
    return {n: v.detach().clone() for n, v in value.items()}


def fit_shape(v: Tensor, shape: torch.Size | tuple[int, ...], fill: float) -> Tensor:
    """``v`` in ``shape``: ``v`` itself when the shapes agree, else a tensor of ``fill``
    with ``v`` in its leading slice (a parameter that grew, e.g. a classifier's weight
    ``[C, D] -> [C', D]`` after new classes). Refuses a parameter that shrank."""
    if v.shape == shape:
        return v
    if v.ndim != len(shape) or any(a > b for a, b in zip(v.shape, shape)):
        raise ValueError(
            f"stored state of shape {tuple(v.shape)} does not fit the parameter's shape "
            f"{tuple(shape)}: parameters may only grow"
        )
    out = v.new_full(tuple(shape), fill)
    out[tuple(slice(0, s) for s in v.shape)] = v
    return out


def to_flat(value: Tensor | Named, net: nn.Module | None, fill: float) -> Tensor:
    """``value`` (a dict by parameter name; a flat vector is returned as it is) as one
    ``[P]`` vector in ``net``'s parameter order, ``fill`` for parameters (or, for grown
    parameters, entries) it lacks (``net=None``: the dict's order)."""
    if isinstance(value, Tensor):
        return value
    if net is None:
        return torch.cat([v.reshape(-1) for v in value.values()])
    ref = next(iter(value.values()))
    return torch.cat(
        [
            fit_shape(value[n], p.shape, fill).reshape(-1)
            if n in value
            else torch.full((p.numel(),), fill, dtype=ref.dtype, device=ref.device)
            for n, p in net.named_parameters()
            if p.requires_grad
        ]
    )


def _check_labels(head: nn.Module, x: Tensor, y: Tensor, likelihood: str = "categorical") -> None:
    """Refuse (``ValueError`` naming ``y``) labels that are not ``[N]`` integers indexing
    the head's output units (``"categorical"``; 0 or 1 for a one-output ``"bernoulli"``
    head); the head's width is read from a forward of two examples."""
    if not isinstance(y, Tensor):
        raise TypeError(f"y must be a tensor of labels, got {type(y).__name__}")
    if y.shape != (len(x),) or y.is_floating_point() or y.dtype == torch.bool:
        raise ValueError(
            f"y must be [N]=[{len(x)}] integer class labels, got {tuple(y.shape)} {y.dtype}"
        )
    width = probe_outputs(head, x).shape[-1]
    if likelihood == "bernoulli":
        width = max(width, 2)
    lo, hi = int(y.min()), int(y.max())
    if lo < 0 or hi >= width:
        raise ValueError(
            f"y must hold labels in [0, {width}) (the head's output units), got labels in "
            f"[{lo}, {hi}]"
        )


def _norm_buffers(net: nn.Module) -> Named:
    """Clones of the running statistics (``running_mean``, ``running_var``) of ``net``'s
    normalisation layers (batch norm), by buffer name."""
    out: Named = {}
    for name, mod in net.named_modules():
        if isinstance(mod, nn.modules.batchnorm._NormBase) and mod.track_running_stats:
            for b in ("running_mean", "running_var"):
                t = getattr(mod, b, None)
                if isinstance(t, Tensor):
                    out[f"{name}.{b}" if name else b] = t.detach().clone()
    return out


@contextlib.contextmanager
def _swapped_buffers(net: nn.Module, buffers: Named) -> Iterator[None]:
    """Within the block, ``net``'s buffers named in ``buffers`` are those tensors (swapped
    as objects: the originals are never written, and autograd keeps the swapped-in ones)."""
    saved = []
    try:
        for name, t in buffers.items():
            path, _, attr = name.rpartition(".")
            mod = net.get_submodule(path)
            old = mod._buffers.get(attr)
            if old is None or old.shape != t.shape:
                continue
            saved.append((mod, attr, old))
            mod._buffers[attr] = t.to(old.device)
        yield
    finally:
        for mod, attr, old in reversed(saved):
            mod._buffers[attr] = old


def _clock(device: torch.device) -> float:
    """``time.perf_counter()`` after the work queued on ``device`` has finished (CUDA runs
    kernels asynchronously: without the synchronisation a phase's time would be the time to
    queue it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
