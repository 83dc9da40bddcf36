"""Laplace posteriors (diagonal and full) against dense GGNs and logistic-regression closed
forms; continual accumulation; FullGaussian algebra; errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fromp import DiagonalGaussian, FullGaussian, fit_laplace
from fromp.curvature.jacobian import unflatten
from fromp.likelihood import BernoulliLikelihood, CategoricalLikelihood
from fromp.models import MultiHeadMLP, with_task
from fromp.testing import dense_ggn, flat
from tests.cases import tiny_cnn, tiny_mlp


@pytest.mark.parametrize("make", [tiny_mlp, tiny_cnn], ids=["mlp", "cnn_bn"])
def test_laplace_precision_is_diag_ggn_plus_prior(make):
    model, lik = make(), CategoricalLikelihood()
    x = torch.randn(6, *((4,) if make is tiny_mlp else (1, 6, 6)), dtype=torch.float64)
    g = dense_ggn(model, x, lik)
    post = fit_laplace(model, x, lik, 0.5)
    assert isinstance(post, DiagonalGaussian)
    torch.testing.assert_close(post.mean, flat(model))
    torch.testing.assert_close(post.precision, torch.diagonal(g) + 0.5, rtol=1e-9, atol=1e-12)
    delta = torch.rand(g.shape[0], dtype=torch.float64) + 0.1
    post_v = fit_laplace(model, (x, torch.zeros(6)), lik, delta, chunk_size=4)
    torch.testing.assert_close(post_v.precision, torch.diagonal(g) + delta, rtol=1e-9, atol=1e-12)
    full = fit_laplace(model, x, lik, 0.5, hessian_structure="full")
    torch.testing.assert_close(full.precision, g + 0.5 * torch.eye(len(g)), rtol=1e-9, atol=1e-12)


def test_posterior_accumulates_ggns_over_tasks_with_one_prior():
    model, lik = tiny_mlp(), CategoricalLikelihood()
    x1, x2 = torch.randn(5, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    g1, g2 = dense_ggn(model, x1, lik), dense_ggn(model, x2, lik)
    post1 = fit_laplace(model, x1, lik, 2.0)
    with torch.no_grad():  # the network moves on task 2; the new mean is its weights
        for p in model.parameters():
            p.add_(0.01)
    g2 = dense_ggn(model, x2, lik)
    post2 = fit_laplace(model, x2, lik, None, posterior=post1)
    torch.testing.assert_close(post2.mean, flat(model))
    expect = torch.diagonal(g1) + torch.diagonal(g2) + 2.0
    torch.testing.assert_close(post2.precision, expect, rtol=1e-9, atol=1e-12)
    full1 = fit_laplace(model, x2, lik, 2.0, hessian_structure="full")
    full2 = fit_laplace(model, x2, lik, None, posterior=full1, hessian_structure="full")
    torch.testing.assert_close(
        full2.precision, 2 * g2 + 2.0 * torch.eye(len(g2)), rtol=1e-9, atol=1e-12
    )


def test_logistic_regression_closed_forms():
    n, d, delta = 20, 3, 0.7
    x = torch.randn(n, d, dtype=torch.float64)
    model = nn.Linear(d, 1).double()
    with torch.no_grad():
        p = torch.sigmoid(model(x))[:, 0]
    xt = torch.cat([x, torch.ones(n, 1, dtype=torch.float64)], 1)  # weight then bias
    r = p * (1 - p)
    post = fit_laplace(model, x, BernoulliLikelihood(), delta)
    torch.testing.assert_close(post.precision, (r[:, None] * xt**2).sum(0) + delta)
    full = fit_laplace(model, x, "bernoulli", delta, hessian_structure="full")
    torch.testing.assert_close(full.precision, xt.T @ (r[:, None] * xt) + delta * torch.eye(d + 1))


def test_multihead_other_heads_keep_the_prior():
    net = MultiHeadMLP(4, (5,), n_heads=3, head_size=2).double()
    post = fit_laplace(
        with_task(net, 2), torch.randn(6, 4, dtype=torch.float64), "categorical", 3.0
    )
    parts = unflatten(net, post.precision)
    for name, prec in parts.items():
        if name.startswith("heads.0") or name.startswith("heads.1"):
            assert torch.equal(prec, torch.full_like(prec, 3.0))
        else:
            assert (prec > 3.0).any()


def test_full_gaussian_algebra():
    a = torch.randn(4, 4, dtype=torch.float64)
    prec = a @ a.T + torch.eye(4, dtype=torch.float64)
    q = FullGaussian(torch.randn(4, dtype=torch.float64), prec)
    cov = torch.linalg.inv(prec)
    torch.testing.assert_close(q.covariance, cov)
    torch.testing.assert_close(q.variance, torch.diagonal(cov))
    torch.testing.assert_close(q.log_det_precision(), torch.logdet(prec))
    j = torch.randn(3, 2, 4, dtype=torch.float64)
    w = q.whiten(j)
    torch.testing.assert_close(
        torch.einsum("ncp,mdp->ncmd", w, w), torch.einsum("ncp,pq,mdq->ncmd", j, cov, j)
    )
    s = q.sample(20000, generator=torch.Generator().manual_seed(0))
    assert s.shape == (20000, 4) and q.sample().shape == (4,)
    torch.testing.assert_close(torch.cov(s.T), cov, rtol=0.08, atol=0.02)
    q2 = FullGaussian.from_state_dict(q.state_dict())
    torch.testing.assert_close(q2.precision, q.precision)


def test_errors_named():
    model = tiny_mlp()
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="prior_precision must be finite and strictly positive"):
        fit_laplace(model, x, "categorical", -1.0)
    with pytest.raises(
        ValueError,
        match=r"prior_precision must be a scalar or have shape \[n_layers\]=\[4\] or \[P\]",
    ):
        fit_laplace(model, x, "categorical", torch.ones(3))
    with pytest.raises(ValueError, match="prior_precision is required"):
        fit_laplace(model, x, "categorical", None)
    with pytest.raises(ValueError, match="input has non-finite entries"):
        fit_laplace(
            model, torch.full((3, 4), float("nan"), dtype=torch.float64), "categorical", 1.0
        )
    with pytest.raises(ValueError, match="posterior must be a DiagonalGaussian"):
        fit_laplace(
            model, x, "categorical", 1.0, posterior=DiagonalGaussian.isotropic(torch.zeros(3), 1.0)
        )
    with pytest.raises(
        ValueError, match=r"prior_mean must be a number or have shape \[1\] or \[P\]"
    ):
        fit_laplace(model, x, "categorical", 1.0, prior_mean=torch.zeros(2))
    for bad in ("kron", "diagonal", "Full", None):  # refused by name, before the data is read
        with pytest.raises(ValueError, match="hessian_structure must be 'diag' or 'full'"):
            fit_laplace(model, object(), "categorical", 1.0, hessian_structure=bad)
    diag = fit_laplace(model, x, "categorical", 1.0)
    with pytest.raises(ValueError, match=r"FullGaussian .*hessian_structure='full'"):
        fit_laplace(model, x, "categorical", None, posterior=diag, hessian_structure="full")
    full = fit_laplace(model, x, "categorical", 1.0, hessian_structure="full")
    assert type(diag) is DiagonalGaussian and type(full) is FullGaussian
    with pytest.raises(ValueError, match=r"DiagonalGaussian .*hessian_structure='diag'"):
        fit_laplace(model, x, "categorical", None, posterior=full)
    cnn = tiny_cnn().train()
    with pytest.raises(ValueError, match=r"training mode \(bn\); call model.eval\(\)"):
        fit_laplace(cnn, torch.randn(2, 1, 6, 6, dtype=torch.float64), "categorical", 1.0)
    with pytest.raises(ValueError, match="symmetric positive definite"):
        FullGaussian(torch.zeros(2), -torch.eye(2))
    with pytest.raises(ValueError, match=r"precision \[P, P\]"):
        FullGaussian(torch.zeros(2), torch.eye(3))
