"""FROMP's diagonal GGN on a network that is not an MLP (layer capture): equal to the dense
float64 GGN's diagonal, whatever chunks the memory budget gives, and its chunks taken from
the device's memory budget rather than the kernels' Jacobian chunk (``chunk_size``)."""

from __future__ import annotations

import pytest
import torch

import fromp.continual.methods as methods
from fromp import FROMPMethod
from fromp.curvature import diagonal
from fromp.curvature.jacobian import set_default_memory_budget
from fromp.likelihood import CategoricalLikelihood
from fromp.testing import dense_ggn, tiny_cnn

F64 = torch.float64


def _data(n: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 1, 6, 6, generator=g, dtype=F64), torch.arange(n) % 3


@pytest.fixture
def budget():
    """Set the process's default memory budget for one test, then restore the derived one."""
    yield set_default_memory_budget
    set_default_memory_budget(None)


@pytest.mark.parametrize("bytes_", [None, 4096])  # derived (one chunk) / a few examples each
def test_conv_ggn_equals_dense_for_any_budget(budget, bytes_):
    net = tiny_cnn(3, batch_norm=True, seed=0)
    x, y = _data()
    budget(bytes_)
    method = FROMPMethod(n_points=3, prior_precision=0.5, curvature_examples=None, chunk_size=2)
    method.learn_task(net, x, y, None)
    dense = torch.diagonal(dense_ggn(net, x, CategoricalLikelihood()))
    got = torch.cat([g.reshape(-1) for g in method.ggn_terms[0].values()])
    torch.testing.assert_close(got, dense, rtol=1e-10, atol=1e-12)


def test_ggn_chunks_come_from_the_memory_budget(budget, monkeypatch):
    """The GGN is asked for with the process's budget and no chunk of its own: FROMP's
    ``chunk_size`` (64 by default) bounds ``[chunk, C, P]`` Jacobians, and imposed on layer
    capture it ran each backward pass on 64 examples (1.5 s for 1,000 examples of a
    ResNet-18 on an H100, benchmarks/results/gpu/)."""
    seen: list[dict] = []

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return diagonal.diag_ggn(*args, **kwargs)

    monkeypatch.setattr(methods, "diag_ggn", spy)
    budget(12345)
    net = tiny_cnn(3, batch_norm=True, seed=0)
    x, y = _data()
    FROMPMethod(n_points=3, curvature_examples=None, chunk_size=2).learn_task(net, x, y, None)
    assert len(seen) == 1
    assert seen[0].get("memory_budget") == 12345
    assert seen[0].get("chunk_size") is None
