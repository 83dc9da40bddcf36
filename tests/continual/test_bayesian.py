"""Mean-field Gaussian layers: KL, local reparameterisation, ELBO optimum, conversion."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributions import Normal, kl_divergence

from fromp.continual.bayesian import (
    BayesCifarCNN,
    BayesConv2d,
    BayesLinear,
    BayesMultiHeadMLP,
    gaussian_kl,
    to_bayesian,
)
from fromp.models import CifarCNN, MultiHeadMLP


def _randomise(layer, scale=0.5):
    with torch.no_grad():
        for m, lv, m0, v0 in layer._pairs():
            m.normal_(0, scale)
            lv.uniform_(-3, 0)
            m0.normal_(0, scale)
            v0.uniform_(0.2, 2.0)


def test_gaussian_kl_matches_torch_distributions():
    mu, mu0 = torch.randn(7, 3, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    var, var0 = torch.rand(7, 3, dtype=torch.float64) + 0.1, torch.rand(7, 3).double() + 0.1
    ref = kl_divergence(Normal(mu, var.sqrt()), Normal(mu0, var0.sqrt())).sum()
    torch.testing.assert_close(gaussian_kl(mu, var, mu0, var0), ref)
    assert gaussian_kl(mu, var, mu, var).abs() < 1e-12


def test_layer_kl_sums_weights_and_bias_and_vanishes_after_prior_update():
    layer = BayesLinear(4, 3).double()
    _randomise(layer)
    ref = sum(
        kl_divergence(Normal(m, lv.exp().sqrt()), Normal(m0, v0.sqrt())).sum()
        for m, lv, m0, v0 in layer._pairs()
    )
    torch.testing.assert_close(layer.kl(), ref)
    layer.set_prior_from_posterior()
    assert layer.kl().abs() < 1e-10
    layer.reset_prior(0.0, 1.0)
    assert torch.all(layer.weight_prior_var == 1.0) and torch.all(layer.bias_prior_mu == 0.0)


def test_defaults_follow_vcl():
    layer = BayesLinear(5, 2)
    assert torch.all(layer.weight_logvar == -6.0) and torch.all(layer.bias_logvar == -6.0)
    assert torch.all(layer.weight_prior_mu == 0.0) and torch.all(layer.weight_prior_var == 1.0)
    with pytest.raises(ValueError, match="prior_precision"):
        BayesLinear(5, 2, prior_precision=0.0)


def _mc_moments(samples):
    return samples.mean(0), samples.var(0)


@pytest.mark.parametrize("bias", [True, False])
def test_local_reparameterisation_moments_linear(bias):
    torch.manual_seed(1)
    layer = BayesLinear(6, 4, bias=bias).double()
    _randomise(layer)
    x = torch.randn(5, 6, dtype=torch.float64)
    s = 20000
    lrt = layer(x, n_samples=s)  # S, N, out
    assert lrt.shape == (s, 5, 4)
    # direct: sample the weights themselves
    w = layer.weight_mu + layer.weight_logvar.exp().sqrt() * torch.randn(s, 4, 6).double()
    direct = torch.einsum("ni,soi->sno", x, w)
    if bias:
        b = layer.bias_mu + layer.bias_logvar.exp().sqrt() * torch.randn(s, 4).double()
        direct = direct + b[:, None, :]
    mean = x @ layer.weight_mu.T + (layer.bias_mu if bias else 0)
    var = (x**2) @ layer.weight_logvar.exp().T + (layer.bias_logvar.exp() if bias else 0)
    with torch.no_grad():
        for samples in (lrt, direct):
            m, v = _mc_moments(samples)
            # MC tolerance: a few standard errors of the mean / variance
            assert torch.all((m - mean).abs() < 5 * (var / s).sqrt())
            torch.testing.assert_close(v, var, rtol=0.06, atol=0)


def test_local_reparameterisation_moments_conv():
    torch.manual_seed(2)
    layer = BayesConv2d(2, 3, 3, padding=1).double()
    _randomise(layer, scale=0.3)
    x = torch.randn(2, 2, 5, 5, dtype=torch.float64)
    s = 8000
    lrt = layer(x, n_samples=s)
    w = layer.weight_mu + layer.weight_logvar.exp().sqrt() * torch.randn(s, 3, 2, 3, 3).double()
    b = layer.bias_mu + layer.bias_logvar.exp().sqrt() * torch.randn(s, 3).double()
    direct = torch.stack(
        [nn.functional.conv2d(x, w[i], b[i], padding=1) for i in range(s)]
    )  # S, N, C, H, W
    mean = nn.functional.conv2d(x, layer.weight_mu, layer.bias_mu, padding=1)
    var = nn.functional.conv2d(x**2, layer.weight_logvar.exp(), layer.bias_logvar.exp(), padding=1)
    with torch.no_grad():
        for samples in (lrt, direct):
            m, v = _mc_moments(samples)
            assert torch.all((m - mean).abs() < 5 * (var / s).sqrt())
            torch.testing.assert_close(v, var, rtol=0.1, atol=0)


def _regression_problem():
    g = torch.Generator().manual_seed(0)
    n, d, sigma, prior_var = 40, 3, 0.5, 2.0
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    w_true = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    y = x @ w_true + sigma * torch.randn(n, generator=g, dtype=torch.float64)
    prec = x.T @ x / sigma**2 + torch.eye(d, dtype=torch.float64) / prior_var
    mean = torch.linalg.solve(prec, x.T @ y / sigma**2)
    return x, y, sigma, prior_var, mean, 1.0 / torch.diagonal(prec)


def test_elbo_optimum_is_exact_mean_and_mean_field_variances():
    """Gaussian likelihood: the ELBO's expected log-likelihood is closed form given the
    pre-activation moments, so the optimum is deterministic: means = exact posterior mean,
    variances = 1 / diag(posterior precision)."""
    x, y, sigma, prior_var, mean, mf_var = _regression_problem()
    layer = BayesLinear(3, 1, bias=False, prior_precision=1 / prior_var).double()
    opt = torch.optim.LBFGS(
        layer.parameters(),
        lr=1,
        max_iter=200,
        tolerance_grad=1e-12,
        tolerance_change=1e-15,
        line_search_fn="strong_wolfe",
    )

    def closure():
        opt.zero_grad()
        m, s = layer._mean_std(x)  # moments of the pre-activations
        v = s**2
        nll = (((y[:, None] - m) ** 2 + v) / (2 * sigma**2)).sum()
        loss = nll + layer.kl()
        loss.backward()
        return loss

    for _ in range(2):
        opt.step(closure)
    torch.testing.assert_close(layer.weight_mu.detach()[0], mean, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(layer.weight_logvar.exp().detach()[0], mf_var, rtol=1e-5, atol=0)


def test_elbo_monte_carlo_training_reaches_the_optimum():
    """Stochastic ELBO (local reparameterisation samples, Adam) ends near the same optimum
    (loose tolerance: MC noise and finite steps)."""
    torch.manual_seed(3)
    x, y, sigma, prior_var, mean, mf_var = _regression_problem()
    layer = BayesLinear(3, 1, bias=False, prior_precision=1 / prior_var, init_logvar=-2.0)
    layer = layer.double()
    opt = torch.optim.Adam(layer.parameters(), lr=0.02)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 if k < 1000 else 0.1)
    for _ in range(1500):
        a = layer(x, n_samples=16)[..., 0]  # S, N
        loss = ((y - a) ** 2).mean(0).sum() / (2 * sigma**2) + layer.kl()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    torch.testing.assert_close(layer.weight_mu.detach()[0], mean, rtol=0, atol=0.02)
    torch.testing.assert_close(layer.weight_logvar.exp().detach()[0], mf_var, rtol=0.15, atol=0)


def test_to_bayesian_keeps_means_and_architecture():
    net = MultiHeadMLP(20, (8, 6), n_heads=3, head_size=2).double()
    bnet = to_bayesian(net)
    x = torch.rand(4, 20, dtype=torch.float64)
    with bnet.mean_mode():
        for t in range(3):
            torch.testing.assert_close(bnet(x, task=t), net(x, task=t))
    assert not bnet.heads[0].use_mean  # the context restores sampling
    assert len(bnet.mean_parameters()) == len(list(net.parameters()))
    cnn = CifarCNN(3, n_heads=2, head_size=4, dropout=False).double().eval()
    bcnn = to_bayesian(cnn)
    xi = torch.rand(2, 3, 32, 32, dtype=torch.float64)
    with bcnn.mean_mode():
        torch.testing.assert_close(bcnn(xi, task=1), cnn(xi, task=1))
    with pytest.raises(ValueError, match="already Bayesian"):
        to_bayesian(bnet)
    with pytest.raises(ValueError, match="MultiHeadModel"):
        to_bayesian(nn.Linear(2, 2))


def test_multihead_forward_shapes_and_sampling():
    net = BayesMultiHeadMLP(12, (8,), n_heads=3, head_size=2)
    x = torch.rand(5, 12)
    assert net(x, task=1).shape == (5, 2)
    out = net(x, task=1, n_samples=4)
    assert out.shape == (4, 5, 2)
    assert not torch.allclose(out[0], out[1])  # different weight samples
    tasks = torch.tensor([0, 1, 2, 0, 1])
    mixed = net(x, task=tasks, n_samples=3)
    assert mixed.shape == (3, 5, 2)
    with net.mean_mode():
        det = net(x, task=tasks, n_samples=2)
        torch.testing.assert_close(det[0, 2], net(x[2:3], task=2)[0])
    probs = net.predict_proba(x, task=0, n_samples=7)
    torch.testing.assert_close(probs.sum(1), torch.ones(5))
    with pytest.raises(ValueError, match="task is required"):
        net(x)
    with pytest.raises(ValueError, match="n_samples"):
        net(x, task=0, n_samples=0)
    cnn = BayesCifarCNN(3, n_heads=2, head_size=3)
    assert cnn(torch.rand(2, 3, 32, 32), task=1, n_samples=2).shape == (2, 2, 3)


def test_kl_and_prior_update_by_heads():
    net = BayesMultiHeadMLP(6, (4,), n_heads=3, head_size=2)
    body = sum(layer.kl() for layer in net.body_layers())
    torch.testing.assert_close(net.kl([1]), body + net.heads[1].kl())
    torch.testing.assert_close(net.kl(), body + sum(h.kl() for h in net.heads))
    net.set_prior_from_posterior([0])
    assert net.kl([0]).abs() < 1e-6
    assert net.heads[2].kl() > 1.0  # untouched head keeps N(0, 1)
    with pytest.raises(ValueError, match="heads"):
        net.kl([5])


def test_load_mean_from_checks_shapes():
    layer = BayesLinear(3, 2)
    src = nn.Linear(3, 2)
    layer.load_mean_from(src)
    torch.testing.assert_close(layer.weight_mu.detach(), src.weight.detach())
    with pytest.raises(ValueError, match="shape"):
        layer.load_mean_from(nn.Linear(4, 2))


def test_redraw_means_is_truncated_normal():
    layer = BayesLinear(200, 100)
    layer.redraw_means(0.1)
    w = layer.weight_mu.detach()
    assert w.abs().max() <= 0.2 and layer.bias_mu.abs().max() <= 0.2
    # std of N(0, 0.1^2) truncated at 2 std is 0.088
    assert abs(float(w.std()) - 0.088) < 0.005
    with pytest.raises(ValueError, match="std"):
        layer.redraw_means(0.0)


def test_twin_and_bayesian_layers_are_one_mean_field_implementation():
    """A fromp network converted to Bayesian layers and a MeanFieldTwin of the same network,
    given equal means, log-variances and priors: equal sites, equal KL (against the closed
    form written out here), the same prior recursion, and at a vanishing variance both
    sample the mean network."""
    from fromp.continual.bayesian import MeanFieldTwin

    torch.manual_seed(0)
    net = MultiHeadMLP(5, (4,), n_heads=1, head_size=3).double()
    bnet = to_bayesian(net, prior_precision=2.0, init_logvar=-2.0)
    twin = MeanFieldTwin(net, prior_precision=2.0, init_logvar=-2.0)
    with torch.no_grad():
        for (m, lv, _, _), (tm, tlv, _, _) in zip(bnet.gaussian_sites(), twin.gaussian_sites()):
            lv.uniform_(-3, -1)
            tlv.copy_(lv)
            torch.testing.assert_close(m, tm, rtol=0, atol=0)  # the same means, same order
    want = 0.0
    for m, lv, m0, v0 in bnet.gaussian_sites():
        v = lv.exp()
        want = want + 0.5 * (torch.log(v0 / v) + (v + (m - m0) ** 2) / v0 - 1).sum()
    torch.testing.assert_close(bnet.kl(), want)
    torch.testing.assert_close(twin.kl(), want)
    bnet.set_prior_from_posterior()
    twin.set_prior_from_posterior()
    for a, b in zip(bnet.gaussian_sites(), twin.gaussian_sites()):
        torch.testing.assert_close(a[2], b[2], rtol=0, atol=0)
        torch.testing.assert_close(a[3], b[3], rtol=0, atol=0)
        torch.testing.assert_close(a[3], a[1].exp(), rtol=0, atol=0)
    assert float(bnet.kl().detach()) == 0.0 and float(twin.kl().detach()) == 0.0
    with torch.no_grad():
        for site in (*bnet.gaussian_sites(), *twin.gaussian_sites()):
            site[1].fill_(-80.0)
    x = torch.rand(6, 5, dtype=torch.float64)
    for model in (bnet, twin):
        out = model.sample_logits(x, None, 2)
        assert out.shape == (2, 6, 3)
        torch.testing.assert_close(out[1], net(x))
    bnet.reset_prior(0.0, prior_precision=0.5)  # the variance 1 / 0.5
    assert all(torch.all(s[3] == 2.0) and torch.all(s[2] == 0) for s in bnet.gaussian_sites())


def test_bayesian_networks_take_their_deterministic_arguments():
    net = BayesMultiHeadMLP(12, (8,), n_heads=3, head_size=2, prior_precision=2.0, init_logvar=-3.0)
    assert net.n_heads == 3 and net.body[1].in_features == 12 and net.head_size == 2
    assert torch.all(net.heads[2].weight_prior_var == 0.5)
    assert torch.all(net.body[1].weight_logvar == -3.0)
    assert BayesMultiHeadMLP().heads[0].in_features == 256  # MultiHeadMLP's defaults
    cnn = BayesCifarCNN(1, n_heads=2, head_size=3, prior_mean=0.1)
    assert cnn.n_heads == 2 and torch.all(cnn.body[0].weight_prior_mu == 0.1)
    assert all(m.p == 0.0 for m in cnn.modules() if isinstance(m, nn.Dropout))
    with pytest.raises(ValueError, match="prior_precision"):
        BayesMultiHeadMLP(4, (3,), prior_precision=-1.0)
    with pytest.raises(ValueError, match="heads must be None"):
        BayesLinear(3, 2).kl([0])
