"""Fitted Laplace posteriors (DiagLaplace / FullLaplace): evidence against dense float64
terms, its gradient in delta against finite differences, per-layer delta, the closed form of
Bayesian linear regression, prior-precision search, posterior / GP / predictive, state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fromp import DiagLaplace, FullLaplace, fit_laplace
from fromp.laplace.one_call import log_marginal_likelihood
from fromp.likelihood import CategoricalLikelihood, GaussianLikelihood
from fromp.testing import dense_ggn, flat
from tests.cases import tiny_cnn, tiny_mlp

F64 = torch.float64


def _data(make):
    model = make()
    shape = (4,) if make is tiny_mlp else (1, 6, 6)
    x = torch.randn(8, *shape, dtype=F64)
    y = torch.randint(0, 3, (8,))
    return model, x, y


def _dense_evidence(model, x, y, lik, delta_vec, m0, full):
    g = dense_ggn(model, x, lik)
    if not full:
        g = torch.diag(torch.diagonal(g))
    w = flat(model) - m0
    with torch.no_grad():
        nll = lik.nll(model(x), y).sum()
    logdet = torch.logdet(g + torch.diag(delta_vec))
    return -nll - 0.5 * (delta_vec * w**2).sum() - 0.5 * (logdet - delta_vec.log().sum())


@pytest.mark.parametrize("make", [tiny_mlp, tiny_cnn], ids=["mlp", "cnn_bn"])
@pytest.mark.parametrize("cls", [DiagLaplace, FullLaplace], ids=["diag", "full"])
def test_evidence_matches_dense_for_scalar_layer_and_parameter_delta(make, cls):
    model, x, y = _data(make)
    lik = CategoricalLikelihood()
    m0 = 0.1 * torch.randn(flat(model).numel(), dtype=F64)
    la = cls(model, lik, prior_mean=m0).fit([(x[:5], y[:5]), (x[5:], y[5:])])
    sizes = [p.numel() for p in model.parameters()]
    layer = torch.rand(len(sizes), dtype=F64) + 0.2
    deltas = {
        "scalar": (torch.tensor(0.7, dtype=F64), torch.full((sum(sizes),), 0.7, dtype=F64)),
        "layer": (layer, torch.repeat_interleave(layer, torch.tensor(sizes))),
        "param": (torch.rand(sum(sizes), dtype=F64) + 0.2,) * 2,
    }
    for d, vec in deltas.values():
        want = _dense_evidence(model, x, y, lik, vec, m0, full=cls is FullLaplace)
        torch.testing.assert_close(la.log_marginal_likelihood(d), want, rtol=1e-10, atol=1e-9)
    # the three named terms
    d = deltas["layer"][0]
    lml = la.log_likelihood - 0.5 * (la.scatter_at(d) + la.log_det_ratio_at(d))
    torch.testing.assert_close(la.log_marginal_likelihood(d), lml)


@pytest.mark.parametrize("cls", [DiagLaplace, FullLaplace], ids=["diag", "full"])
def test_evidence_gradient_matches_finite_differences(cls):
    model, x, y = _data(tiny_mlp)
    la = cls(model, "categorical").fit((x, y))
    for d0 in (torch.tensor(0.8, dtype=F64), torch.rand(4, dtype=F64) + 0.3):
        d = d0.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(la.log_marginal_likelihood(d), d)
        eps = 1e-6
        for i in range(d0.numel()):
            e = torch.zeros_like(d0).reshape(-1)
            e[i] = eps
            e = e.reshape(d0.shape)
            fd = (la.log_marginal_likelihood(d0 + e) - la.log_marginal_likelihood(d0 - e)) / (
                2 * eps
            )
            assert abs(float(grad.reshape(-1)[i] - fd)) < 1e-6 * max(1.0, abs(float(fd)))


def test_closed_form_linear_regression_and_gradient_optimum():
    """Linear-Gaussian model at its exact MAP: FullLaplace's evidence is the exact
    log N(y | 0, sigma^2 I + X X^T / delta), and the gradient search finds the delta that
    maximises the exact evidence over a fine grid."""
    n, d, sigma, delta = 15, 3, 0.4, 1.7
    x, y = torch.randn(n, d, dtype=F64), torch.randn(n, dtype=F64)
    precision = x.T @ x / sigma**2 + delta * torch.eye(d, dtype=F64)
    w = torch.linalg.solve(precision, x.T @ y / sigma**2)
    model = nn.Linear(d, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(w[None])
    la = FullLaplace(model, GaussianLikelihood(sigma)).fit((x, y))
    cov = sigma**2 * torch.eye(n, dtype=F64) + x @ x.T / delta
    exact = torch.distributions.MultivariateNormal(torch.zeros(n, dtype=F64), cov).log_prob(y)
    torch.testing.assert_close(la.log_marginal_likelihood(delta), exact, rtol=1e-9, atol=1e-7)
    best = float(la.optimize_prior_precision(optimizer="lbfgs"))
    grid = torch.logspace(-3, 3, 601, dtype=F64)
    vals = torch.stack([la.log_marginal_likelihood(g) for g in grid])
    assert la.log_marginal_likelihood(best) >= vals.max() - 1e-9
    assert abs(best - float(grid[vals.argmax()])) / best < 0.03


def test_optimize_layerwise_improves_on_scalar_and_sets_prior():
    model, x, y = _data(tiny_mlp)
    la = DiagLaplace(model, "categorical").fit((x, y))
    scalar = la.optimize_prior_precision(optimizer="lbfgs")
    assert scalar.ndim == 0 and torch.equal(la.prior_precision, scalar)
    v_scalar = float(la.log_marginal_likelihood())
    layer = la.optimize_prior_precision(prior_structure="layerwise", optimizer="lbfgs")
    assert layer.shape == (4,)
    assert float(la.log_marginal_likelihood()) >= v_scalar - 1e-9
    with pytest.raises(ValueError, match="prior_structure"):
        la.optimize_prior_precision(prior_structure="blocks")


def test_posterior_gp_predictive_and_state_dict():
    model, x, y = _data(tiny_cnn)
    la = DiagLaplace(model, "categorical", prior_precision=0.5).fit((x, y))
    ref = fit_laplace(model, x, "categorical", 0.5)
    torch.testing.assert_close(la.posterior.precision, ref.precision)
    torch.testing.assert_close(la.posterior.mean, ref.mean)
    probs = la.predictive(x[:3])
    torch.testing.assert_close(probs, la.gp().predictive(x[:3]))
    assert probs.shape == (3, 3)
    full = FullLaplace(model, "categorical", prior_precision=0.5).fit((x, y))
    torch.testing.assert_close(
        full.posterior.precision,
        fit_laplace(model, x, "categorical", 0.5, hessian_structure="full").precision,
    )
    state = la.state_dict()
    other = DiagLaplace(model, "categorical")
    other.load_state_dict(state)
    torch.testing.assert_close(other.log_marginal_likelihood(), la.log_marginal_likelihood())
    with pytest.raises(ValueError, match=r"kind|diag"):
        FullLaplace(model, "categorical").load_state_dict(state)
    with pytest.raises(ValueError, match="fitted with"):
        DiagLaplace(model, GaussianLikelihood(1.0)).load_state_dict(state)
    old = {k: v for k, v in state.items() if k != "n_targets"}  # a fromp 0.3 state
    with pytest.raises(ValueError, match=r"missing \['n_targets'\].*0\.3"):
        DiagLaplace(model, "categorical").load_state_dict(old)


def test_fit_accumulates_and_errors():
    model, x, y = _data(tiny_mlp)
    la = DiagLaplace(model, "categorical").fit((x[:4], y[:4]))
    la.fit((x[4:], y[4:]), override=False)
    both = DiagLaplace(model, "categorical").fit((x, y))
    torch.testing.assert_close(la.H, both.H)
    torch.testing.assert_close(la.log_marginal_likelihood(), both.log_marginal_likelihood())
    assert la.n_data == 8
    no_targets = DiagLaplace(model, "categorical").fit(x)
    with pytest.raises(ValueError, match="targets"):
        no_targets.log_marginal_likelihood()
    with pytest.raises(ValueError, match="fit"):
        DiagLaplace(model, "categorical").log_marginal_likelihood()
    with pytest.raises(ValueError, match="prior_precision"):
        la.log_marginal_likelihood(torch.ones(5, dtype=F64))
    with pytest.raises(ValueError, match="prior_precision"):
        la.log_marginal_likelihood(-1.0)
    # the one-call function agrees with the fitted object
    lml = log_marginal_likelihood(model, (x, y), "categorical", 0.9)
    torch.testing.assert_close(lml, both.log_marginal_likelihood(0.9))
