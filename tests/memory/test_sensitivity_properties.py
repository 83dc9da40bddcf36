"""Property-based tests (hypothesis) of the memory-perturbation forms on random small
linear-regression, logistic-regression and softmax-regression problems, against dense
float64 formulas written here: ``f + e v`` and ``f + V e``, the corrected forms, and for
Bayesian linear regression at its MAP the exact leave-one-out of ridge refits."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fromp.likelihood import GaussianLikelihood
from fromp.memory.sensitivity import memory_perturbation
from fromp.posterior import FullGaussian

D = torch.float64
SETTINGS = settings(max_examples=25, deadline=None)


def _ridge(x, y, sigma, delta):
    a = x.T @ x / sigma**2 + delta * torch.eye(x.shape[1], dtype=D)
    return torch.linalg.solve(a, x.T @ y / sigma**2), a


@SETTINGS
@given(
    n=st.integers(4, 14),
    d=st.integers(1, 4),
    sigma=st.floats(0.2, 2.0),
    delta=st.floats(0.05, 5.0),
    seed=st.integers(0, 10_000),
)
def test_linear_regression_corrected_loo_equals_ridge_refits(n, d, sigma, delta, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=D)
    y = x @ torch.randn(d, generator=g, dtype=D) + sigma * torch.randn(n, generator=g, dtype=D)
    w, prec = _ridge(x, y, sigma, delta)
    model = nn.Linear(d, 1, bias=False).to(D).eval()
    with torch.no_grad():
        model.weight.copy_(w[None])
    q = FullGaussian(w.clone(), prec)
    lik = GaussianLikelihood(sigma)
    f = x @ w
    v = torch.einsum("nd,de,ne->n", x, torch.linalg.inv(prec), x)
    e = (f - y) / sigma**2
    plain = memory_perturbation(model, q, x, y[:, None], lik)
    torch.testing.assert_close(plain.loo_logits[:, 0], f + e * v, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(plain.variance[:, 0], v, rtol=1e-9, atol=1e-12)
    exact = torch.stack(
        [
            x[i] @ _ridge(torch.cat([x[:i], x[i + 1 :]]), torch.cat([y[:i], y[i + 1 :]]),
                          sigma, delta)[0]
            for i in range(n)
        ]
    )  # fmt: skip
    for cov in ("diag", "full"):
        mp = memory_perturbation(model, q, x, y[:, None], lik, covariance=cov, correction=True)
        torch.testing.assert_close(mp.loo_logits[:, 0], exact, rtol=1e-8, atol=1e-10)
    nll = 0.5 * (y - exact) ** 2 / sigma**2 + math.log(sigma) + 0.5 * math.log(2 * math.pi)
    torch.testing.assert_close(mp.loo_nll(), nll, rtol=1e-8, atol=1e-10)


@SETTINGS
@given(
    n=st.integers(4, 14),
    d=st.integers(1, 3),
    delta=st.floats(0.1, 5.0),
    scale=st.floats(0.0, 3.0),
    seed=st.integers(0, 10_000),
)
def test_logistic_regression_forms_equal_the_dense_formulas(n, d, delta, scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=D)
    y = (torch.rand(n, generator=g, dtype=D) < 0.5).to(D)
    w = scale * torch.randn(d, generator=g, dtype=D)
    model = nn.Linear(d, 1, bias=False).to(D).eval()
    with torch.no_grad():
        model.weight.copy_(w[None])
    f = x @ w
    p = torch.sigmoid(f)
    lam = p * (1 - p)
    prec = x.T @ (lam[:, None] * x) + delta * torch.eye(d, dtype=D)
    q = FullGaussian(w.clone(), prec)
    v = torch.einsum("nd,de,ne->n", x, torch.linalg.inv(prec), x)
    e = p - y
    mp = memory_perturbation(model, q, x, y, "bernoulli")
    torch.testing.assert_close(mp.loo_logits[:, 0], f + e * v, rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(mp.sensitivity, (e * lam * v).abs(), rtol=1e-9, atol=1e-12)
    # the example's curvature is part of the precision: lambda v < 1, the corrected forms
    # are defined and agree (one output: diagonal = full)
    assert bool((lam * v < 1).all())
    corrected = f + e * v / (1 - lam * v)
    for cov in ("diag", "full"):
        mp_c = memory_perturbation(model, q, x, y, "bernoulli", covariance=cov, correction=True)
        torch.testing.assert_close(mp_c.loo_logits[:, 0], corrected, rtol=1e-8, atol=1e-10)
    want = nn.functional.binary_cross_entropy_with_logits(corrected, y, reduction="none")
    torch.testing.assert_close(mp_c.loo_nll(), want, rtol=1e-8, atol=1e-10)


@SETTINGS
@given(
    n=st.integers(3, 10),
    d=st.integers(1, 3),
    c=st.integers(2, 4),
    delta=st.floats(0.1, 5.0),
    seed=st.integers(0, 10_000),
)
def test_softmax_regression_full_forms_equal_the_dense_formulas(n, d, c, delta, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=D)
    y = torch.randint(0, c, (n,), generator=g)
    wmat = torch.randn(c, d, generator=g, dtype=D)
    model = nn.Linear(d, c, bias=False).to(D).eval()
    with torch.no_grad():
        model.weight.copy_(wmat)
    f = x @ wmat.T
    p = torch.softmax(f, -1)
    big_lam = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    jac = torch.einsum("ck,nd->nckd", torch.eye(c, dtype=D), x).reshape(n, c, c * d)
    prec = torch.einsum("ncp,nck,nkq->pq", jac, big_lam, jac) + delta * torch.eye(c * d, dtype=D)
    q = FullGaussian(wmat.reshape(-1).clone(), prec)
    big_v = torch.einsum("ncp,pq,nkq->nck", jac, torch.linalg.inv(prec), jac)
    e = p - nn.functional.one_hot(y, c).to(D)
    mp = memory_perturbation(model, q, x, y, "categorical", covariance="full")
    torch.testing.assert_close(mp.loo_logits, f + torch.einsum("nck,nk->nc", big_v, e),
                               rtol=1e-9, atol=1e-11)  # fmt: skip
    mp_c = memory_perturbation(model, q, x, y, covariance="full", correction=True)
    eye = torch.eye(c, dtype=D)
    want = torch.stack(
        [f[i] + big_v[i] @ torch.linalg.solve(eye - big_lam[i] @ big_v[i], e[i]) for i in range(n)]
    )
    torch.testing.assert_close(mp_c.loo_logits, want, rtol=1e-8, atol=1e-10)
