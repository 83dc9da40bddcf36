"""Likelihoods: output Hessians against autograd Hessians of the nll, square roots, closed
forms and errors."""

from __future__ import annotations

import math

import pytest
import torch

from fromp.likelihood import (
    BernoulliLikelihood,
    CategoricalLikelihood,
    GaussianLikelihood,
    get_likelihood,
)
from fromp.testing import dense_nll_hessians

LIKS = {
    "categorical": (CategoricalLikelihood(), 4),
    "bernoulli": (BernoulliLikelihood(), 1),
    "gaussian": (GaussianLikelihood(0.7), 3),
}


@pytest.mark.parametrize("name", sorted(LIKS))
def test_hessian_and_sqrt_match_autograd(name):
    lik, c = LIKS[name]
    f = 2 * torch.randn(6, c, dtype=torch.float64)
    y = lik.sample(f)
    ref = dense_nll_hessians(lik, f, y)
    torch.testing.assert_close(lik.hessian(f), ref, rtol=1e-10, atol=1e-12)
    root = lik.sqrt_hessian(f)
    torch.testing.assert_close(root @ root.transpose(-1, -2), ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        lik.hessian_trace(f), torch.diagonal(ref, dim1=-2, dim2=-1).sum(-1), rtol=1e-10, atol=0
    )


def test_categorical_hessian_is_expected_outer_product_of_gradients():
    """Fisher identity with canonical link: sum_y p(y) g_y g_y^T = Lambda (exact enumeration)."""
    lik = CategoricalLikelihood()
    f = torch.randn(1, 5, dtype=torch.float64)
    p = torch.softmax(f, -1)[0]
    fisher = torch.zeros(5, 5, dtype=torch.float64)
    for k in range(5):
        g = torch.autograd.functional.jacobian(
            lambda z, k=k: lik.nll(z, torch.tensor([k])).sum(), f
        )[0]
        fisher += p[k] * torch.outer(g, g)
    torch.testing.assert_close(lik.hessian(f)[0], fisher, rtol=1e-10, atol=1e-12)


def test_nll_closed_forms():
    f = torch.randn(5, 3, dtype=torch.float64)
    y = torch.randn(5, 3, dtype=torch.float64)
    gauss = GaussianLikelihood(0.5)
    ref = -torch.distributions.Normal(f, 0.5).log_prob(y).sum(-1)
    torch.testing.assert_close(gauss.nll(f, y), ref)
    k = torch.tensor([0, 2, 1, 1, 0])
    torch.testing.assert_close(
        CategoricalLikelihood().nll(f, k), -torch.log_softmax(f, -1)[torch.arange(5), k]
    )
    fb, yb = f[:, :1], torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    p = torch.sigmoid(fb[:, 0])
    torch.testing.assert_close(
        BernoulliLikelihood().nll(fb, yb), -(yb * p.log() + (1 - yb) * (1 - p).log())
    )
    assert math.isclose(float(gauss.hessian(f)[0, 1, 1]), 4.0)


def test_bad_inputs_named():
    with pytest.raises(ValueError, match="sigma"):
        GaussianLikelihood(-1.0)
    with pytest.raises(ValueError, match="sigma"):
        GaussianLikelihood(float("nan"))
    with pytest.raises(ValueError, match=r"\[N, 1\]"):
        BernoulliLikelihood().hessian(torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"f must have shape \[N, C\]"):
        CategoricalLikelihood().hessian(torch.zeros(3))
    with pytest.raises(ValueError, match="likelihood must be"):
        get_likelihood("poisson")
    assert isinstance(get_likelihood("classification"), CategoricalLikelihood)
