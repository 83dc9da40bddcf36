"""Data parallelism on ``torch.distributed``: sums over the data held by every process.

A Laplace fit, a curvature or a statistic that is a sum over examples splits over processes
(ranks) that each hold a shard of the data (a ``DistributedSampler``): each rank computes its
shard's sum, and the functions here combine the shards so that every rank ends with the sum
over all the data, the same as one process on the whole data set. Nothing here runs when
``torch.distributed`` is not initialised or has one process: the functions return their input
unchanged, so library code calls them unconditionally.

* :func:`all_reduce_sum` sums tensors over the ranks in place (one flat buffer per dtype
  and device, one collective each).
* :func:`fold` gathers one Python object per rank (tensors inside are moved to the CPU and
  back) and folds them in rank order with a given combine function, so that sums that are
  not plain tensor sums (Kronecker factors averaged over the examples that reached a layer,
  low-rank eigenpairs) combine exactly as a sequential ``fit(..., override=False)`` would.

Launch with ``torchrun --nproc_per_node=N script.py`` (one machine) or
``torchrun --nnodes=M --nproc_per_node=N --rdzv_endpoint=HOST:PORT script.py`` (several);
``docs/library.md`` has the recipe.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

__all__ = [
    "all_reduce_sum",
    "fold",
    "gather",
    "is_distributed",
    "mean_over_ranks",
    "rank",
    "world_size",
]

T = TypeVar("T")


def is_distributed() -> bool:
    """Whether ``torch.distributed`` is initialised with more than one process."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    """The number of processes (1 without ``torch.distributed``)."""
    return torch.distributed.get_world_size() if is_distributed() else 1


def rank() -> int:
    """This process's rank (0 without ``torch.distributed``)."""
    return torch.distributed.get_rank() if is_distributed() else 0


def all_reduce_sum(tensors: Sequence[Tensor]) -> None:
    """Sum each tensor over the ranks, in place. Tensors of one dtype and device travel in one
    flat buffer (one collective per (dtype, device)); a no-op in a single process."""
    if not is_distributed() or not tensors:
        return
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for group in groups.values():
        flat = torch.cat([t.reshape(-1) for t in group])
        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
        offset = 0
        for t in group:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n


def _to(obj: Any, device: torch.device | None) -> Any:
    """``obj`` with every tensor inside moved to ``device`` (the CPU when ``None``)."""
    if isinstance(obj, Tensor):
        return obj.cpu() if device is None else obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        out = [_to(v, device) for v in obj]
        return type(obj)(out) if not hasattr(obj, "_fields") else type(obj)(*out)
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        clone = object.__new__(type(obj))
        clone.__dict__.update({k: _to(v, device) for k, v in vars(obj).items()})
        return clone
    return obj


def fold(obj: T, combine: Callable[[T, T], T], device: torch.device | None = None) -> T:
    """Every rank's ``obj`` combined in rank order: ``combine(...combine(o_0, o_1)..., o_R)``.

    ``obj`` may hold tensors (in containers or object attributes); they travel through the
    CPU and come back on ``device`` (default: the device of the first tensor found in
    ``obj``, else the CPU). Every rank gets the same result. A no-op in a single process."""
    if not is_distributed():
        return obj
    if device is None:
        device = _first_device(obj)
    gathered: list[Any] = [None] * world_size()
    torch.distributed.all_gather_object(gathered, _to(obj, None))
    out = _to(gathered[0], device)
    for other in gathered[1:]:
        out = combine(out, _to(other, device))
    return out


def _first_device(obj: Any) -> torch.device | None:
    if isinstance(obj, Tensor):
        return obj.device
    items: list[Any] = []
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        items = list(vars(obj).values())
    for v in items:
        d = _first_device(v)
        if d is not None:
            return d
    return None


def mean_over_ranks(tensors: Sequence[Tensor], n: float | Tensor = 1.0) -> None:
    """Replace each tensor, a mean over this rank's ``n`` examples, in place by the mean over
    the examples of all ranks: ``t <- sum_r n_r t_r / sum_r n_r``, so that ranks with
    different batch sizes weigh by their examples (with equal ``n`` on every rank, the plain
    mean over ranks). The tensors and the counts travel in one collective per dtype and
    device; the division stays on the device (no host sync). A no-op in a single process."""
    if not is_distributed() or not tensors:
        return
    total = torch.as_tensor(n, dtype=tensors[0].dtype, device=tensors[0].device).reshape(1).clone()
    for t in tensors:
        t.mul_(total.to(t))
    all_reduce_sum([*tensors, total])
    for t in tensors:
        t.div_(total.to(t))


def gather(obj: T, device: torch.device | None = None) -> list[T]:
    """Every rank's ``obj`` in rank order (tensors inside travel through the CPU and come back
    on ``device``, default: the device of the first tensor in ``obj``); ``[obj]`` in a
    single process. Every rank gets the same list."""
    if not is_distributed():
        return [obj]
    return fold([obj], lambda u, v: u + v, device)
