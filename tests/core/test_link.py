"""Tests written for the planted bugs a first run of ``studies.planted_bugs`` did
not catch with the tests it named: each checks one behaviour against the dense float64
references of :mod:`fromp.testing` (plain autograd), without real data."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fromp import Laplace
from fromp.link import probit_scale
from fromp.testing import dense_ggn, dense_posterior_covariance, dense_predictive
from tests.cases import tiny_mlp, toy_classification

F64 = torch.float64


class _SoftmaxNLL:
    def nll(self, f, y):
        return nn.functional.cross_entropy(f, y, reduction="none")


def test_probit_scale_is_one_over_sqrt_one_plus_pi_over_8_var():
    var = torch.diag_embed(torch.tensor([[0.0, 1.0, 4.0]], dtype=F64))
    want = [[1.0, 1 / math.sqrt(1 + math.pi / 8), 1 / math.sqrt(1 + math.pi / 2)]]
    torch.testing.assert_close(probit_scale(var), torch.tensor(want, dtype=F64), rtol=1e-14, atol=0)


def test_laplace_probit_predictive_against_the_dense_glm():
    """``softmax(f / sqrt(1 + pi/8 diag(J Sigma J^T)))`` with ``Sigma = (G + delta I)^{-1}``,
    ``G`` the dense GGN: the full Laplace predictive of a tiny MLP."""
    model = tiny_mlp(seed=0)
    x, y = toy_classification(12, 4, 3, seed=1)
    delta = 0.7
    la = Laplace(model, "classification", "all", "full", prior_precision=delta).fit((x, y))
    cov = dense_posterior_covariance(dense_ggn(model, x, _SoftmaxNLL(), y=y), delta)
    xs = torch.randn(5, 4, dtype=F64)
    mean, var = dense_predictive(model, xs, cov)
    kappa = 1 / torch.sqrt(1 + math.pi / 8 * torch.diagonal(var, dim1=1, dim2=2))
    want = torch.softmax(mean * kappa, -1)
    got = la(xs, pred_type="glm", link_approx="probit")
    torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)
    assert not torch.allclose(got, torch.softmax(mean, -1), atol=1e-4)  # the variance matters


def test_online_ewc_anchors_at_the_last_task_and_sums_decayed_fishers_against_dense():
    """Online EWC after tasks 1, 2 and 3: ``lambda sum_p F_p (w_p - w*_3,p)^2`` with ``F =
    gamma (gamma F_1 + F_2) + F_3``, ``F_t = diag(G_t) / N_t`` the dense GGN diagonal of
    task ``t`` at its own weights ``w*_t``; the anchor is the last task's weights."""
    from fromp.continual.ewc import EWCMethod
    from fromp.testing import flat
    from tests.cases import dense_ewc_penalty

    model = tiny_mlp(seed=2)
    lam, gamma = 3.0, 0.5
    method = EWCMethod(lam, fisher="exact", mode="online", decay_factor=gamma)
    fisher = torch.zeros(flat(model).numel(), dtype=F64)
    for t in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.3 * torch.randn_like(p))  # "training" on task t moves the weights
        x, y = toy_classification(10, 4, 3, seed=10 + t)
        method.learn_task(model, x, y, None, experience=t)
        g = torch.diagonal(dense_ggn(model, x, _SoftmaxNLL(), y=y)) / len(x)
        fisher = gamma * fisher + g
        anchor = flat(model)
        assert float(method.penalty(model).detach()) == pytest.approx(0.0, abs=1e-12), t
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    want = dense_ewc_penalty(flat(model), [anchor], [fisher], lam)
    torch.testing.assert_close(method.penalty(model).detach(), want, rtol=1e-9, atol=1e-12)
