"""Options that the other tests leave at their defaults: a non-zero prior mean in the
Laplace evidence and VOGN with several posterior samples per step, against dense float64
references."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from fromp import VOGN, log_marginal_likelihood
from fromp.laplace.one_call import log_evidence_grid
from fromp.likelihood import CategoricalLikelihood
from fromp.testing import dense_ggn, flat
from tests.cases import tiny_mlp

D = torch.float64


def _data(n: int = 20, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g, dtype=D), torch.randint(0, 3, (n,), generator=g)


def _dense_evidence(net, x, y, delta, m0, curvature):
    """``-sum nll + P/2 log delta - delta/2 ||w - m0||^2 - 1/2 log det(G + delta I)``."""
    w = flat(net)
    with torch.no_grad():
        nll = F.cross_entropy(net(x), y, reduction="sum")
    g = dense_ggn(net, x, CategoricalLikelihood())
    if curvature == "diag":
        logdet = torch.log(torch.diagonal(g) + delta).sum()
    else:
        logdet = torch.linalg.slogdet(g + delta * torch.eye(len(w), dtype=D))[1]
    p = w.numel()
    return (
        -nll
        + 0.5 * p * torch.log(torch.tensor(delta, dtype=D))
        - 0.5 * delta * ((w - m0) ** 2).sum()
        - 0.5 * logdet
    )


@pytest.mark.parametrize("curvature", ["diag", "full"])
def test_evidence_with_a_nonzero_prior_mean(curvature):
    torch.manual_seed(0)
    net = tiny_mlp().eval()
    x, y = _data()
    m0 = 0.5 * torch.randn(flat(net).numel(), dtype=D)
    for delta in (0.3, 4.0):
        got = log_marginal_likelihood(
            net, (x, y), "categorical", delta, prior_mean=m0, hessian_structure=curvature
        )
        want = _dense_evidence(net, x, y, delta, m0, curvature)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # the optimum moves with the prior mean, and is the grid's argmax of the dense formula
    grid = torch.logspace(-2, 2, 17, dtype=D)
    dense = torch.stack([_dense_evidence(net, x, y, float(d), m0, curvature) for d in grid])
    deltas, values = log_evidence_grid(
        net, (x, y), "categorical", grid, prior_mean=m0, hessian_structure=curvature
    )
    best = float(deltas[int(torch.argmax(values))])
    assert best == pytest.approx(float(grid[int(torch.argmax(dense))]))
    zero = torch.stack(
        [_dense_evidence(net, x, y, float(d), torch.zeros_like(m0), curvature) for d in grid]
    )
    assert int(torch.argmax(zero)) != int(torch.argmax(dense))  # the check is not vacuous


def _per_example_grads(net, x, y):
    rows = []
    for n in range(len(x)):
        loss = F.cross_entropy(net(x[n : n + 1]), y[n : n + 1])
        g = torch.autograd.grad(loss, list(net.parameters()))
        rows.append(torch.cat([gi.reshape(-1) for gi in g]))
    return torch.stack(rows)  # [N, P]


def test_vogn_step_averages_several_posterior_samples():
    """``mc_samples = 3``: ``g`` and ``h`` are the means over three draws ``w_s ~ q`` of the
    mini-batch mean gradient and squared per-example gradients at ``w_s``; the returned loss
    is the mean data loss over the draws."""
    torch.manual_seed(0)
    net = tiny_mlp()
    ref_net = copy.deepcopy(net)
    x, y = _data(8, seed=3)
    kw = dict(lr=0.1, ess=50, prior_precision=2.0, mc_samples=3)
    opt, ref = VOGN(net, **kw), VOGN(ref_net, **kw)
    mu0 = ref.posterior().mean.clone()

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        return loss

    torch.manual_seed(11)
    loss = opt.step(closure)

    torch.manual_seed(11)
    gs, hs, losses, ws = [], [], [], []
    for _ in range(3):
        ws.append(ref.sample_params())
        pe = _per_example_grads(ref_net, x, y)
        gs.append(pe.mean(0))
        hs.append((pe**2).mean(0))
        with torch.no_grad():
            losses.append(F.cross_entropy(ref_net(x), y))
    assert not torch.equal(ws[0], ws[1]) and not torch.equal(ws[1], ws[2])
    g, h = torch.stack(gs).mean(0), torch.stack(hs).mean(0)
    dt = 2.0 / 50
    want = mu0 - 0.1 * (g + dt * mu0) / (h + dt)  # first step, bias-corrected
    torch.testing.assert_close(opt.posterior().mean, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(opt.posterior().precision, 50 * h + 2.0, rtol=1e-10, atol=0)
    torch.testing.assert_close(loss.detach(), torch.stack(losses).mean(), rtol=1e-12, atol=0)
    # one draw would give another update: the test tells the draws apart
    assert not torch.allclose(
        want, mu0 - 0.1 * (gs[0] + dt * mu0) / (hs[0] + dt), rtol=1e-6, atol=0
    )
