"""Coreset selection for VCL (Nguyen et al., 2018): random and greedy k-center.

Both return the indices ``[size]`` (long) of the selected examples; the caller keeps them
out of the training set and stores them as the task's coreset.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["kcenter_coreset", "random_coreset", "select_coreset"]


def _check(n: int, size: int) -> None:
    if n < 1:
        raise ValueError(f"cannot select a coreset from empty data (n={n})")
    if not 1 <= size <= n:
        raise ValueError(f"size must be in [1, n={n}], got {size}")


def random_coreset(n: int, size: int, generator: torch.Generator | None = None) -> Tensor:
    """``size`` distinct indices drawn uniformly from ``range(n)`` ``[size]``."""
    _check(int(n), int(size))
    return torch.randperm(int(n), generator=generator)[: int(size)]


@torch.no_grad()
def kcenter_coreset(x: Tensor, size: int, *, first: int = 0, chunk_size: int = 4096) -> Tensor:
    """Greedy k-center selection on ``x [N, ...]`` (flattened, Euclidean distance).

    As in the VCL reference code: start from example ``first`` (index 0), then repeatedly
    add the example farthest from the current centres, ``argmax_i min_{c} ||x_i - x_c||``
    (ties: the smallest index). Cost ``O(N * D * size)``, memory ``O(N)`` beyond ``x``.

    Returns:
        ``[size]`` long indices in selection order.
    """
    n = len(x)
    _check(n, int(size))
    if not 0 <= first < n:
        raise ValueError(f"first must be in [0, {n}), got {first}")
    flat = x.reshape(n, -1)
    if not flat.is_floating_point():
        flat = flat.float()
    sq = flat.pow(2).sum(1)

    def dist_to(i: int) -> Tensor:
        c = flat[i]
        out = torch.empty(n, dtype=flat.dtype, device=flat.device)
        for s in range(0, n, chunk_size):
            block = flat[s : s + chunk_size]
            out[s : s + chunk_size] = (sq[s : s + chunk_size] - 2 * block @ c + sq[i]).clamp_min(0)
        return out

    idx = [int(first)]
    dists = dist_to(first)
    dists[first] = 0.0
    for _ in range(1, int(size)):
        i = int(torch.argmax(dists))
        idx.append(i)
        dists = torch.minimum(dists, dist_to(i))
        dists[i] = 0.0
    return torch.tensor(idx, dtype=torch.long, device=x.device)


def select_coreset(
    x: Tensor, size: int, method: str, generator: torch.Generator | None = None
) -> Tensor:
    """Dispatch on ``method`` (``"random"`` | ``"kcenter"``); returns indices ``[size]``."""
    if method == "random":
        return random_coreset(len(x), size, generator).to(x.device)
    if method == "kcenter":
        return kcenter_coreset(x, size)
    raise ValueError(f"method must be 'random' or 'kcenter', got {method!r}")
