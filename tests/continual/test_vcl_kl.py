"""VCL's KL term in one pass over all parameters (issue: per-step cost): the flat closed form
equals the per-parameter sum of ``torch.distributions`` KLs in float64, with its gradient,
for ``BayesMultiHeadModel`` (body and any set of heads) and ``MeanFieldTwin``, after the prior
has become a previous posterior (tasks 2 and 3); one evaluation per call."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributions import Normal, kl_divergence

import fromp.continual.bayesian as bayesian
from fromp.continual.bayesian import MeanFieldTwin, to_bayesian
from fromp.models import MultiHeadMLP

D = torch.float64


def _reference(quads) -> torch.Tensor:
    total = torch.zeros((), dtype=D)
    for mu, logvar, mu0, var0 in quads:
        q = Normal(mu, (0.5 * logvar).exp())
        p = Normal(mu0, var0.sqrt())
        total = total + kl_divergence(q, p).sum()
    return total


def _perturb(params, scale=0.1):
    with torch.no_grad():
        for p in params:
            p.add_(scale * torch.randn_like(p))


@pytest.mark.parametrize("heads", [None, [0], [0, 2]])
def test_bayes_multihead_kl_equals_per_parameter_sum_after_tasks_1_2_3(heads):
    torch.manual_seed(0)
    net = to_bayesian(MultiHeadMLP(5, (6, 4), n_heads=3, head_size=2).double())
    counter = {"n": 0}
    flat = bayesian.gaussian_kl_flat

    def counted(quads):
        counter["n"] += 1
        return flat(quads)

    for task in range(3):
        _perturb(net.parameters())
        layers = net._selected(heads)
        quads = [q for layer in layers for q in layer._pairs()]
        bayesian.gaussian_kl_flat = counted
        try:
            got = net.kl(heads)
        finally:
            bayesian.gaussian_kl_flat = flat
        assert counter["n"] == task + 1  # one pass per call, whatever the layers
        want = _reference(quads)
        assert float(want.detach()) > 0
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        params = [p for q in quads for p in q[:2]]
        g1 = torch.autograd.grad(got, params)
        g2 = torch.autograd.grad(_reference(quads), params)
        for a, b in zip(g1, g2):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        net.set_prior_from_posterior(heads)  # the next task's prior: this posterior


def test_mean_field_twin_kl_equals_per_parameter_sum_after_tasks_1_2_3():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    twin = MeanFieldTwin(model, prior_precision=1 / 0.7).double()
    calls = {"n": 0}
    flat = bayesian.gaussian_kl_flat

    def counted(quads):
        calls["n"] += 1
        return flat(quads)

    for task in range(3):
        _perturb(list(model.parameters()) + list(twin.logvars.parameters()))
        params = dict(model.named_parameters())
        quads = [
            (params[n], twin.logvars[bayesian._key(n)], twin.prior_mean[n], twin.prior_variance[n])
            for n in twin.names
        ]
        bayesian.gaussian_kl_flat = counted
        try:
            got = twin.kl()
        finally:
            bayesian.gaussian_kl_flat = flat
        assert calls["n"] == task + 1
        torch.testing.assert_close(got, _reference(quads), rtol=1e-12, atol=1e-12)
        twin.set_prior_from_posterior()


def test_the_twin_lives_in_bayesian_only():
    import fromp.continual.vcl as vcl

    for name in ("MeanFieldTwin", "gaussian_names"):  # one import path: no moved names
        assert not hasattr(vcl, name)
