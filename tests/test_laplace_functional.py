"""FunctionalLaplace (laplace-torch's ``hessian_structure="gp"``) against closed forms:
Bayesian linear regression (predictive and evidence), and the weight-space full Laplace on
the subset of data (Woodbury: the GP on ``M`` points with prior variance ``M / (N delta)``
is the weight-space Laplace with ``G_M + (N delta / M) I``), per output for
``independent_outputs``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import fromp
from fromp import FunctionalLaplace, Laplace
from fromp.testing import dense_jacobian

F64 = torch.float64


def test_bayesian_linear_regression_predictive_and_evidence():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(25, 3, dtype=F64, generator=g)
    noise = 0.3 * torch.randn(25, 1, dtype=F64, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=F64) + noise
    model = nn.Linear(3, 1).double().eval()
    la = Laplace(model, "regression", "all", "gp", n_subset=25, sigma_noise=0.4,
                 prior_precision=2.0)  # fmt: skip
    assert isinstance(la, FunctionalLaplace)
    la.fit([(x[:10], y[:10]), (x[10:], y[10:])])
    phi = torch.cat([x, torch.ones(25, 1, dtype=F64)], 1)
    cov = torch.linalg.inv(phi.T @ phi / 0.16 + 2.0 * torch.eye(4, dtype=F64))
    xs = torch.randn(4, 3, dtype=F64, generator=g)
    ps = torch.cat([xs, torch.ones(4, 1, dtype=F64)], 1)
    mu, var = la(xs)
    torch.testing.assert_close(mu, model(xs).detach())
    torch.testing.assert_close(var[:, 0, 0], torch.einsum("np,pq,nq->n", ps, cov, ps),
                               rtol=1e-10, atol=1e-12)  # fmt: skip
    _, jcov = la(xs, joint=True)
    torch.testing.assert_close(jcov, ps @ cov @ ps.T, rtol=1e-10, atol=1e-12)
    # evidence: log N(y | 0, Phi Phi^T / delta + s^2 I) (prior mean 0: m(x) = 0 for a linear model)
    k = phi @ phi.T / 2.0 + 0.16 * torch.eye(25, dtype=F64)
    want = torch.distributions.MultivariateNormal(torch.zeros(25, dtype=F64), k).log_prob(y[:, 0])
    torch.testing.assert_close(la.log_marginal_likelihood(), want, rtol=1e-10, atol=1e-10)
    # differentiable in (delta, sigma) and the values are stored (laplace-torch's)
    d = torch.tensor(1.5, dtype=F64, requires_grad=True)
    s = torch.tensor(0.5, dtype=F64, requires_grad=True)
    lml = la.log_marginal_likelihood(d, s)
    gd, gs = torch.autograd.grad(lml, (d, s))
    d2, s2 = d.detach().clone().requires_grad_(True), s.detach().clone().requires_grad_(True)
    k2 = phi @ phi.T / d2 + s2**2 * torch.eye(25, dtype=F64)
    ref = torch.distributions.MultivariateNormal(torch.zeros(25, dtype=F64), k2).log_prob(y[:, 0])
    gd2, gs2 = torch.autograd.grad(ref, (d2, s2))
    torch.testing.assert_close((gd, gs), (gd2, gs2), rtol=1e-9, atol=1e-10)
    assert float(la.prior_precision) == 1.5 and la.sigma_noise.item() == 0.5


def _mlp(c=3):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, c)).double().eval()


@pytest.mark.parametrize("n_subset", [30, 12])
def test_classification_is_the_weight_space_laplace_of_the_subset(n_subset):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(30, 2, dtype=F64, generator=g)
    y = torch.randint(0, 3, (30,), generator=g)
    model = _mlp()
    la = FunctionalLaplace(model, "classification", n_subset=n_subset, prior_precision=0.7,
                           full_output_hessian=True, seed=3).fit([(x, y)])  # fmt: skip
    idx = torch.as_tensor(np.random.default_rng(3).choice(30, n_subset, replace=False))
    jac = dense_jacobian(model, x[idx])
    with torch.no_grad():
        p = torch.softmax(model(x[idx]), -1)
    lam = torch.diag_embed(p) - torch.einsum("nc,nd->ncd", p, p)
    ggn = torch.einsum("ncp,ncd,ndq->pq", jac, lam, jac)
    delta = 0.7 * 30 / n_subset
    prec = ggn + delta * torch.eye(len(ggn), dtype=F64)
    xs = torch.randn(5, 2, dtype=F64, generator=g)
    js = dense_jacobian(model, xs)
    var_ref = torch.einsum("ncp,pq,ndq->ncd", js, torch.linalg.inv(prec), js)
    torch.testing.assert_close(la.functional_variance(la.backend.jacobians(xs)[0]), var_ref,
                               rtol=1e-8, atol=1e-10)  # fmt: skip
    kappa = torch.sqrt(1 + math.pi / 8 * torch.diagonal(var_ref, 0, 1, 2))
    torch.testing.assert_close(la(xs), torch.softmax(model(xs).detach() / kappa, -1))
    # the log-determinant term: log det(I + W K W) = log det(G + delta I) - P log delta
    want = torch.logdet(prec) - len(ggn) * math.log(delta)
    torch.testing.assert_close(la.log_det_ratio, want, rtol=1e-9, atol=1e-9)


def test_independent_outputs_and_the_diagonal_output_hessian():
    """``independent_outputs``: one GP per output with ``Lambda_cc`` (laplace-torch's
    diagonal): output ``c``'s variance is ``J_c (J_Mc^T Lambda_cc J_Mc + delta I)^{-1} J_c^T``,
    and the covariance across outputs is zero."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(20, 2, dtype=F64, generator=g)
    y = torch.randint(0, 3, (20,), generator=g)
    model = _mlp()
    la = FunctionalLaplace(model, "classification", n_subset=20, prior_precision=1.3,
                           independent_outputs=True).fit([(x, y)])  # fmt: skip
    jac = dense_jacobian(model, x)
    with torch.no_grad():
        p = torch.softmax(model(x), -1)
    xs = torch.randn(4, 2, dtype=F64, generator=g)
    js = dense_jacobian(model, xs)
    var = la.functional_variance(la.backend.jacobians(xs)[0])
    for c in range(3):
        lam_c = p[:, c] * (1 - p[:, c])
        eye = torch.eye(jac.shape[2], dtype=F64)
        prec = jac[:, c].T @ (lam_c[:, None] * jac[:, c]) + 1.3 * eye
        ref = torch.einsum("np,pq,nq->n", js[:, c], torch.linalg.inv(prec), js[:, c])
        torch.testing.assert_close(var[:, c, c], ref, rtol=1e-8, atol=1e-10)
    off = var - torch.diag_embed(torch.diagonal(var, 0, 1, 2))
    assert float(off.abs().max()) == 0.0


def test_prior_refusals_and_marglik():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(15, 2, dtype=F64, generator=g)
    y = torch.randint(0, 3, (15,), generator=g)
    with pytest.raises(ValueError, match="prior_precision must be a scalar"):
        FunctionalLaplace(_mlp(), "classification", n_subset=5,
                          prior_precision=torch.ones(3, dtype=F64))  # fmt: skip
    with pytest.raises(ValueError, match="n_subset=20 exceeds"):
        FunctionalLaplace(_mlp(), "classification", n_subset=20).fit([(x, y)])
    la = FunctionalLaplace(_mlp(), "classification", n_subset=15).fit([(x, y)])
    before = la.log_marginal_likelihood(torch.tensor(1.0, dtype=F64))
    la.optimize_prior_precision(n_steps=200)
    assert float(la.log_marginal_likelihood()) >= float(before)
    with pytest.raises(ValueError, match="pred_type='gp'"):
        la(x, pred_type="nn")


def test_constructor_takes_laplace_torchs_arguments():
    lt_args = ["model", "likelihood", "n_subset", "sigma_noise", "prior_precision", "prior_mean",
               "temperature", "enable_backprop", "dict_key_x", "dict_key_y", "backend",
               "backend_kwargs", "independent_outputs", "seed"]  # fmt: skip
    la = FunctionalLaplace(*[{"model": _mlp(), "likelihood": "classification",
                              "n_subset": 3}[a] for a in lt_args[:3]],
                           sigma_noise=1.0, prior_precision=2.0, prior_mean=0.0,
                           temperature=1.0, enable_backprop=False, dict_key_x="x",
                           dict_key_y="y", backend=None, backend_kwargs=None,
                           independent_outputs=True, seed=1)  # fmt: skip
    assert isinstance(la, fromp.laplace.BaseLaplace) and float(la.prior_precision) == 2.0
    with pytest.raises(ValueError, match="diag_ef"):
        FunctionalLaplace(_mlp(), "classification", n_subset=3, backend="CurvlinopsEF")


def test_fit_refuses_a_subset_jacobian_larger_than_free_memory_before_any_work(monkeypatch):
    """On the GPU the 'gp' structure ran out of memory after its forward passes on
    ResNet-18 (M = 500, C = 10, P = 11.2 M: 224 GB). The fit now compares M C P numbers
    with the memory free on the device first, and names n_subset and the size that fits."""
    import importlib

    functional = importlib.import_module("fromp.laplace.functional")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double().eval()
    x, y = torch.randn(40, 3, dtype=torch.float64), torch.arange(40) % 2
    p = sum(q.numel() for q in model.parameters())  # 26
    need = 30 * 2 * p * 8  # M C P float64 numbers
    la = FunctionalLaplace(model, "classification", n_subset=30)
    calls = []
    monkeypatch.setattr(la, "_jacobians", lambda *a, **k: calls.append(1))
    monkeypatch.setattr(functional, "free_memory", lambda device=None: need - 1)
    with pytest.raises(ValueError, match=r"n_subset=30: .*\[30, 2, 26\].*n_subset <= 29"):
        la.fit([(x, y)])
    assert calls == []  # refused before any Jacobian
    monkeypatch.setattr(functional, "free_memory", lambda device=None: need)
    monkeypatch.undo()
    la = FunctionalLaplace(model, "classification", n_subset=30).fit([(x, y)])
    assert la._jm.shape == (30, 2, p)


def test_free_memory_reads_the_cpu():
    from fromp.curvature.jacobian import free_memory

    free = free_memory("cpu")
    assert free is None or free > 0
    assert free_memory(torch.device("meta")) is None
