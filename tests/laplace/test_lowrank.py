"""``fromp.Laplace(..., "all", "lowrank", low_rank=k)`` against dense float64 autograd on a
small MLP and a small CNN: with ``k >= rank(G)`` it is the full Laplace exactly; with a
smaller ``k`` it is the dense ``U_k diag(lam_k) U_k^T + D`` built from the dense GGN's top
``k`` eigenpairs (compared as matrices, so signs and rotations do not matter): eigenvalues
(summed over the data, divided by ``s^2 T``), evidence, covariance, variances, functional
variance, probit predictive, kernel, samples; per-tensor and per-parameter priors;
``override=False``; the state round trip; the prior search; the GGN-matrix product; the
refusals."""

from __future__ import annotations

import math

import pytest
import torch

from fromp import Laplace
from fromp.curvature.ggn import ggn_matmat
from fromp.likelihood import CategoricalLikelihood
from tests.laplace.test_base import cnn, data, dense_ggn_blocks, mlp

F64 = torch.float64
MODELS = {"mlp": (mlp, (4,)), "cnn": (cnn, (1, 5, 5))}
METHODS = {"gram": 1e-9, "subspace": 1e-6}  # eig_method: tolerance of the comparisons


def dense(model, x):
    names = [n for n, _ in model.named_parameters()]
    return dense_ggn_blocks(model, x, names)


def top_k(g, k):
    lam, u = torch.linalg.eigh(g)
    return u[:, -k:], lam[-k:]


def assert_close(a, b, tol):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol * max(1.0, float(b.abs().max())))


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("eig_method", METHODS)
def test_full_rank_equals_the_full_laplace(model_name, eig_method):
    """10 examples, 3 classes: ``rank(G) = 20 < P``; ``k = 30`` keeps all of it."""
    make, shape = MODELS[model_name]
    model = make()
    x, y = data(shape)
    tol = METHODS[eig_method]
    low = Laplace(model, "classification", "all", "lowrank", low_rank=30,
                  eig_method=eig_method, prior_precision=0.7).fit((x, y))  # fmt: skip
    full = Laplace(model, "classification", "all", "full", prior_precision=0.7).fit((x, y))
    assert low.rank == 20  # numerical zeros dropped
    for d in (0.7, 0.05, 4.0):
        assert_close(low.log_marginal_likelihood(d), full.log_marginal_likelihood(d), tol)
    assert_close(low.posterior_covariance, full.posterior_covariance, tol)
    assert_close(low.posterior_variance, full.posterior_variance, tol)
    assert_close(low.functional_variance_at(x), full.functional_variance_at(x), tol)
    assert_close(low(x), full(x), tol)
    assert_close(low.gp().kernel(x[:3], x[3:7]), full.gp().kernel(x[:3], x[3:7]), tol)


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("eig_method", METHODS)
def test_truncated_against_dense_top_k(model_name, eig_method):
    make, shape = MODELS[model_name]
    model = make()
    x, y = data(shape)
    tol = METHODS[eig_method]
    g, jac, flat, f = dense(model, x)
    p = len(flat)
    k = 5
    la = Laplace(model, "classification", "all", "lowrank", low_rank=k, eig_method=eig_method,
                 prior_precision=0.7).fit([(x[:4], y[:4]), (x[4:], y[4:])])  # fmt: skip
    u, lam = top_k(g, k)
    (got_u, got_lam), d = la.posterior_precision
    assert got_u.shape == (p, k)
    assert_close(got_lam.sort().values, lam, tol)  # summed over the data, not averaged
    assert_close(got_u.T @ got_u, torch.eye(k, dtype=F64), tol)
    prec = u @ torch.diag(lam) @ u.T + 0.7 * torch.eye(p, dtype=F64)
    assert_close(got_u @ torch.diag(got_lam) @ got_u.T + torch.diag(d), prec, tol)
    cov = torch.linalg.inv(prec)
    assert_close(la.posterior_covariance, cov, tol)
    assert_close(la.posterior_variance, torch.diagonal(cov), tol)
    with torch.no_grad():
        nll = CategoricalLikelihood().nll(model(x), y).sum()
    want = -nll - 0.5 * 0.7 * (flat**2).sum() - 0.5 * (torch.logdet(prec) - p * math.log(0.7))
    assert_close(la.log_marginal_likelihood(), want, tol)
    fvar = torch.einsum("ncp,pq,ndq->ncd", jac, cov, jac)
    assert_close(la.functional_variance_at(x), fvar, tol)
    probit = torch.softmax(f / torch.sqrt(1 + math.pi / 8 * torch.diagonal(fvar, 0, 1, 2)), 1)
    assert_close(la(x, link_approx="probit"), probit, tol)
    assert_close(la.gp().kernel(x[:3], x[3:7]),
                 torch.einsum("ncp,pq,mdq->ncmd", jac[:3], cov, jac[3:7]), tol)  # fmt: skip


def test_regression_noise_temperature_and_per_tensor_priors():
    """Eigenvalues enter as ``lam / (s^2 T)``; a ``[n_layers]`` and a ``[P]`` ``delta``
    go through the general (diagonal) Woodbury form."""
    model = mlp()
    x, _ = data((4,), n=8)
    yr = torch.randn(8, 3, generator=torch.Generator().manual_seed(0), dtype=F64)
    _, jac, flat, _ = dense(model, x)
    g_reg = torch.einsum("ncp,ncq->pq", jac, jac)  # regression: Lambda = I
    p, k, s, t = len(flat), 4, 0.4, 1.5
    u, lam = top_k(g_reg, k)
    sizes = [q.numel() for q in model.parameters()]
    for delta in (torch.tensor([0.5, 1.0, 2.0, 3.0], dtype=F64),
                  torch.linspace(0.2, 2.0, p, dtype=F64)):  # fmt: skip
        la = Laplace(model, "regression", "all", "lowrank", low_rank=k, sigma_noise=s,
                     temperature=t, prior_precision=delta).fit((x, yr))  # fmt: skip
        d = delta if len(delta) == p else torch.repeat_interleave(delta, torch.tensor(sizes))
        prec = u @ torch.diag(lam / (s**2 * t)) @ u.T + torch.diag(d)
        cov = torch.linalg.inv(prec)
        torch.testing.assert_close(la.posterior_covariance, cov)
        with torch.no_grad():
            sse = ((model(x) - yr) ** 2).sum()
        loglik = -(sse / (2 * s**2) + 24 * (math.log(s) + 0.5 * math.log(2 * math.pi))) / t
        want = loglik - 0.5 * (d * flat**2).sum() - 0.5 * (torch.logdet(prec) - d.log().sum())
        torch.testing.assert_close(la.log_marginal_likelihood(), want)
        torch.testing.assert_close(la(x)[1], torch.einsum("ncp,pq,ndq->ncd", jac, cov, jac))
        gen = torch.Generator().manual_seed(0)
        draws = la.sample(40_000, generator=gen)
        torch.testing.assert_close(torch.cov(draws.T), cov, atol=0.03 * cov.diagonal().max(),
                                   rtol=0)  # fmt: skip
    # differentiable in sigma_noise and delta: finite differences
    s_t = torch.tensor(0.5, dtype=F64, requires_grad=True)
    d_t = torch.tensor(0.8, dtype=F64, requires_grad=True)
    gs, gd = torch.autograd.grad(la.log_marginal_likelihood(d_t, s_t), [s_t, d_t])
    eps = 1e-6
    fd_s = la.log_marginal_likelihood(0.8, 0.5 + eps) - la.log_marginal_likelihood(0.8, 0.5 - eps)
    fd_d = la.log_marginal_likelihood(0.8 + eps, 0.5) - la.log_marginal_likelihood(0.8 - eps, 0.5)
    torch.testing.assert_close(gs, fd_s / (2 * eps), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gd, fd_d / (2 * eps), rtol=1e-5, atol=1e-7)


def test_sample_moments():
    model = cnn()
    x, y = data((1, 5, 5), n=6)
    la = Laplace(model, "classification", "all", "lowrank", low_rank=4,
                 prior_precision=3.0).fit((x, y))  # fmt: skip
    cov = la.posterior_covariance
    s = la.sample(40_000, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(s.mean(0), la.mean, atol=4 * cov.diagonal().sqrt().max() / 200,
                               rtol=0)  # fmt: skip
    torch.testing.assert_close(torch.cov(s.T), cov, atol=0.03 * cov.diagonal().max(), rtol=0)


def test_override_false_adds_data():
    model = mlp()
    x, y = data((4,), n=12)
    # k above the total rank (24): the same as one fit
    one = Laplace(model, "classification", "all", "lowrank", low_rank=30).fit((x, y))
    two = Laplace(model, "classification", "all", "lowrank", low_rank=30).fit((x[:5], y[:5]))
    two.fit((x[5:], y[5:]), override=False)
    assert two.n_data == 12 and two.rank == 24
    torch.testing.assert_close(two.log_marginal_likelihood(0.3), one.log_marginal_likelihood(0.3))
    torch.testing.assert_close(two(x), one(x))
    # a smaller k: the top k of the sum of the two truncations
    k = 6
    two = Laplace(model, "classification", "all", "lowrank", low_rank=k).fit((x[:5], y[:5]))
    g1, *_ = dense(model, x[:5])
    g2, *_ = dense(model, x[5:])
    two.fit((x[5:], y[5:]), override=False)
    u1, l1 = top_k(g1, k)
    u2, l2 = top_k(g2, k)
    u, lam = top_k(u1 @ torch.diag(l1) @ u1.T + u2 @ torch.diag(l2) @ u2.T, k)
    (got_u, got_lam), _ = two.posterior_precision
    torch.testing.assert_close(got_u @ torch.diag(got_lam) @ got_u.T, u @ torch.diag(lam) @ u.T)


def test_state_round_trip_and_marglik():
    model = mlp()
    x, y = data((4,), n=30)
    la = Laplace(model, "classification", "all", "lowrank", low_rank=8,
                 prior_precision=50.0).fit((x, y))  # fmt: skip
    for prior_structure in ("scalar", "layerwise", "diag"):
        la.prior_precision = 50.0
        before = la.log_marginal_likelihood()
        d = la.optimize_prior_precision(method="marglik", prior_structure=prior_structure)
        after = la.log_marginal_likelihood()
        assert after > before + 1e-3
        for f in (0.9, 1.1):
            assert la.log_marginal_likelihood(d * f) <= after + 1e-8
    fresh = Laplace(mlp(), "classification", "all", "lowrank", low_rank=8)
    fresh.load_state_dict(la.state_dict())
    torch.testing.assert_close(fresh.log_marginal_likelihood(), la.log_marginal_likelihood())
    torch.testing.assert_close(fresh(x), la(x))
    with pytest.raises(ValueError, match="structure"):
        Laplace(mlp(), "classification", "all", "full").load_state_dict(la.state_dict())


def test_ggn_matmat_and_backend_kwargs():
    model = cnn()
    x, y = data((1, 5, 5), n=5)
    g, *_ = dense(model, x)
    v = torch.randn(len(g), 3, generator=torch.Generator().manual_seed(0), dtype=F64)
    got = ggn_matmat(model, [x[:2], x[2:]], CategoricalLikelihood(), v)
    torch.testing.assert_close(got, g @ v)
    la = Laplace(model, "classification", "all", "lowrank", backend_kwargs={"low_rank": 3})
    assert la.fit((x, y)).rank == 3
    assert Laplace(model, "classification", "all", "lowrank").low_rank == 10  # laplace-torch's


def test_refusals():
    model = mlp()
    with pytest.raises(ValueError, match=r"not available; supported"):
        Laplace(model, "classification", "last_layer", "lowrank")
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="low_rank must be a positive int"):
            Laplace(model, "classification", "all", "lowrank", low_rank=bad)
    with pytest.raises(ValueError, match="backend_kwargs takes only 'low_rank'"):
        Laplace(model, "classification", "all", "lowrank", backend_kwargs={"rank": 3})
    with pytest.raises(ValueError, match="eig_method"):
        Laplace(model, "classification", "all", "lowrank", eig_method="lanczos")
