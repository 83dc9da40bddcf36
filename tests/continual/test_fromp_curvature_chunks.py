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
from fromp.testing import dense_ggn
from tests.cases import tiny_cnn

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


# ------------------------------------------------- beyond one chunk of 1,024 examples
N_BIG = 1500  # one chunk of 1,024 and a second of 476


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)
    ).double()


def _big_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return torch.randn(N_BIG, 3, generator=g, dtype=F64), torch.arange(N_BIG) % 3


def _softmax_hessians(f: torch.Tensor) -> torch.Tensor:
    """``Lambda_n = diag(p_n) - p_n p_n^T`` ``[N, C, C]`` of the softmax cross-entropy."""
    p = f.softmax(-1)
    return torch.diag_embed(p) - p[:, :, None] * p[:, None, :]


def test_diag_ggn_beyond_one_chunk_equals_the_dense_ggn():
    """FROMP's GGN of 1,500 examples (two chunks) is the diagonal of ``sum_n J_n^T Lambda_n
    J_n``, with ``J_n`` per example by ``torch.func.jacrev`` (float64, no chunks)."""
    from torch.func import functional_call, jacrev, vmap

    net, (x, y) = _mlp(), _big_data()
    method = FROMPMethod(n_points=3, prior_precision=0.5, curvature_examples=None)
    method.learn_task(net, x, y, None)
    params = {n: p.detach() for n, p in net.named_parameters()}

    def f(w, xn):
        return functional_call(net, w, (xn[None],))[0]

    jac = vmap(jacrev(f), in_dims=(None, 0))(params, x)  # {name: [N, C, *shape]}
    j = torch.cat([jac[n].reshape(N_BIG, 3, -1) for n in params], -1)  # [N, C, P]
    with torch.no_grad():
        lam = _softmax_hessians(net(x))
    dense = torch.einsum("ncp,ncd,ndp->p", j, lam, j)  # the diagonal of sum_n J^T Lambda J
    got = torch.cat([g.reshape(-1) for g in method.ggn_terms[0].values()])
    torch.testing.assert_close(got, dense, rtol=1e-10, atol=1e-12)
    # the posterior FROMP's kernels use: the diagonal Laplace's 1 / (G + delta)
    torch.testing.assert_close(
        method.posterior_variance(net), 1 / (dense + 0.5), rtol=1e-10, atol=0
    )


def test_kron_beyond_one_chunk_equals_the_kfac_sum():
    """FROMP's Kronecker factors of 1,500 examples (two chunks) against the KFAC sums
    written out: for each layer ``A = mean_n a_n a_n^T`` (its inputs) and ``B = sum_n
    J_n^T Lambda_n J_n`` (``J_n``: the outputs' Jacobian in the layer's outputs), the bias
    block ``B`` as well."""
    net, (x, y) = _mlp(), _big_data()
    method = FROMPMethod(n_points=3, posterior="kron", curvature_examples=None)
    method.learn_task(net, x, y, None)
    (term,) = method.kron_terms.values()
    assert term.n == N_BIG
    w1, b1, w2 = net[0].weight.detach(), net[0].bias.detach(), net[2].weight.detach()
    with torch.no_grad():
        h = torch.tanh(x @ w1.T + b1)  # the second layer's inputs
        lam = _softmax_hessians(net(x))
    j1 = w2[None] * (1 - h * h)[:, None, :]  # d f / d z1 [N, C, 5]
    want = [
        (x.T @ x / N_BIG, torch.einsum("nci,ncd,ndj->ij", j1, lam, j1)),
        (h.T @ h / N_BIG, lam.sum(0)),  # the last layer: J = I
    ]
    for block, (a, b) in zip(term.blocks, want, strict=True):
        torch.testing.assert_close(block.A, a, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(block.B, b, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(block.B_bias, b, rtol=1e-10, atol=1e-12)
