"""Memorable-past selection against a brute-force sort."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fromp.continual.memorable import memorability_scores, select_memorable
from fromp.testing import dense_jacobian


def _setup(n: int = 60, c: int = 3):
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, c)).double()
    x = torch.randn(n, 4, dtype=torch.float64)
    y = torch.arange(n) % c
    return net, x, y


def test_scores_are_trace_of_softmax_hessian():
    net, x, _ = _setup()
    p = torch.softmax(net(x), -1).detach()
    brute = torch.stack([torch.trace(torch.diag(pi) - torch.outer(pi, pi)) for pi in p])
    torch.testing.assert_close(memorability_scores(net, x, batch_size=7), brute)


def test_scores_bernoulli():
    net = nn.Linear(3, 1).double()
    x = torch.randn(10, 3, dtype=torch.float64)
    p = torch.sigmoid(net(x)).detach()[:, 0]
    torch.testing.assert_close(memorability_scores(net, x, "bernoulli"), p * (1 - p))


@pytest.mark.parametrize("order", ["descending", "ascending"])
def test_selection_matches_brute_force_sort(order):
    net, x, y = _setup()
    k = 5
    idx = select_memorable(net, x, y, n_per_class=k, order=order, batch_size=16)
    p = torch.softmax(net(x), -1).detach()
    s = (p * (1 - p)).sum(-1)
    expected = []
    for c in range(3):
        members = [i for i in range(len(x)) if int(y[i]) == c]
        members.sort(key=lambda i: float(s[i]), reverse=order == "descending")
        expected += members[:k]
    assert idx.dtype == torch.long
    assert idx.tolist() == expected
    # balanced per class, grouped in class order
    assert y[idx].tolist() == [c for c in range(3) for _ in range(k)]


def test_selection_random_is_balanced_distinct_and_seeded():
    net, x, y = _setup()
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = select_memorable(net, x, y, n_per_class=4, order="random", generator=g1)
    b = select_memorable(net, x, y, n_per_class=4, order="random", generator=g2)
    assert a.tolist() == b.tolist()
    assert len(set(a.tolist())) == 12
    assert torch.bincount(y[a], minlength=3).tolist() == [4, 4, 4]


def test_selection_classes_argument_orders_and_restricts():
    net, x, y = _setup()
    idx = select_memorable(net, x, y, n_per_class=2, classes=[2, 0])
    assert y[idx].tolist() == [2, 2, 0, 0]


def test_selection_errors():
    net, x, y = _setup(n=9)
    with pytest.raises(ValueError, match="class 0 has 3 examples, fewer than n_per_class=4"):
        select_memorable(net, x, y, n_per_class=4)
    with pytest.raises(ValueError, match="empty"):
        select_memorable(net, x[:0], y[:0], n_per_class=1)
    bad = x.clone()
    bad[2, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        select_memorable(net, bad, y, n_per_class=1)
    with pytest.raises(ValueError, match="order"):
        select_memorable(net, x, y, n_per_class=1, order="largest")
    with pytest.raises(ValueError, match="y must be"):
        select_memorable(net, x, y[:-1], n_per_class=1)
    with pytest.raises(ValueError, match="n_per_class"):
        select_memorable(net, x, y, n_per_class=0)
    with pytest.raises(ValueError, match="class 7 has 0 examples"):
        select_memorable(net, x, y, n_per_class=1, classes=[0, 7])


def test_sensitivity_order_keeps_largest_memory_perturbation_sensitivity_per_class():
    from fromp.memory.sensitivity import memory_perturbation
    from fromp.posterior import DiagonalGaussian

    net, x, y = _setup()
    net.eval()
    g = torch.Generator().manual_seed(0)
    p = sum(t.numel() for t in net.parameters())
    mean = torch.cat([t.detach().reshape(-1) for t in net.parameters()])
    q = DiagonalGaussian(mean, torch.rand(p, generator=g, dtype=torch.float64) + 0.1)
    idx = select_memorable(net, x, y, n_per_class=4, order="sensitivity", posterior=q, chunk_size=7)
    # brute force: s_n = sum_k |e_nk lambda_nk v_nk| with v from the dense J Sigma J^T
    jac = dense_jacobian(net, x, mean)
    v = torch.einsum("ncp,p,ncp->nc", jac, q.variance, jac)
    prob = torch.softmax(net(x), -1).detach()
    e = prob - nn.functional.one_hot(y, 3).double()
    s = (e * prob * (1 - prob) * v).abs().sum(-1)
    torch.testing.assert_close(memory_perturbation(net, q, x, y).sensitivity, s)
    for c in range(3):
        members = torch.nonzero(y == c).squeeze(1)
        best = members[torch.argsort(s[members], descending=True)[:4]]
        assert idx[4 * c : 4 * c + 4].tolist() == best.tolist()
    lam_idx = select_memorable(net, x, y, n_per_class=4)
    assert idx.tolist() != lam_idx.tolist()  # a different criterion
    with pytest.raises(ValueError, match="posterior"):
        select_memorable(net, x, y, n_per_class=4, order="sensitivity")
