"""Coreset selection: random and greedy k-center against a brute-force reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fromp.continual.coreset import kcenter_coreset, random_coreset, select_coreset


def _kcenter_brute_force(x: np.ndarray, size: int) -> list[int]:
    """The VCL reference algorithm: loop over points, update min distances."""
    dists = np.full(len(x), np.inf)
    idx = [0]
    for i in range(len(x)):
        dists[i] = min(dists[i], np.linalg.norm(x[i] - x[0]))
    for _ in range(1, size):
        cur = int(np.argmax(dists))
        idx.append(cur)
        for i in range(len(x)):
            dists[i] = min(dists[i], np.linalg.norm(x[i] - x[cur]))
    return idx


@pytest.mark.parametrize("shape", [(60, 5), (40, 1, 3, 3)])
def test_kcenter_matches_brute_force(shape):
    x = torch.randn(*shape, dtype=torch.float64)
    for size in (1, 7, 20):
        got = kcenter_coreset(x, size, chunk_size=16).tolist()
        assert got == _kcenter_brute_force(x.reshape(len(x), -1).numpy(), size)


def test_kcenter_covers_clusters():
    centres = torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0], [10.0, 10.0]])
    x = centres.repeat_interleave(25, 0) + 0.1 * torch.randn(100, 2)
    idx = kcenter_coreset(x, 4)
    clusters = {int(i) // 25 for i in idx}
    assert clusters == {0, 1, 2, 3}
    assert len(set(idx.tolist())) == 4


def test_random_coreset_distinct_and_reproducible():
    a = random_coreset(50, 10, torch.Generator().manual_seed(3))
    b = random_coreset(50, 10, torch.Generator().manual_seed(3))
    assert a.tolist() == b.tolist()
    assert len(set(a.tolist())) == 10 and int(a.max()) < 50 and int(a.min()) >= 0
    assert sorted(random_coreset(5, 5).tolist()) == [0, 1, 2, 3, 4]


def test_errors():
    with pytest.raises(ValueError, match="size"):
        random_coreset(5, 6)
    with pytest.raises(ValueError, match="size"):
        random_coreset(5, 0)
    with pytest.raises(ValueError, match="empty"):
        random_coreset(0, 1)
    with pytest.raises(ValueError, match="size"):
        kcenter_coreset(torch.randn(3, 2), 4)
    with pytest.raises(ValueError, match="empty"):
        kcenter_coreset(torch.empty(0, 2), 1)
    with pytest.raises(ValueError, match="method"):
        select_coreset(torch.randn(4, 2), 2, "greedy")
    assert select_coreset(torch.randn(9, 2), 3, "kcenter").shape == (3,)
