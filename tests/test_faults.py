"""Bad input refused before any work, with the argument named (defects of the third audit
that used to give numbers): labels of the wrong shape or kind for a likelihood,
``select_memorable`` on a network with NaN weights or with negative or fractional labels,
IVON on a NaN loss (``tests/test_ivon.py``), and property-based checks of the likelihoods'
input validation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fromp import select_memorable
from fromp.likelihood import CategoricalLikelihood, GaussianLikelihood


def test_gaussian_likelihood_refuses_class_labels_against_several_outputs():
    f = torch.randn(6, 3)
    with pytest.raises(ValueError, match=r"outputs' shape \(6, 3\)"):
        GaussianLikelihood().nll(f, torch.randint(0, 3, (6,)))  # broadcast to [6, 6] before
    # [N] targets for one output are fine and equal the [N, 1] form
    g = torch.randn(6, 1)
    y = torch.randn(6)
    torch.testing.assert_close(
        GaussianLikelihood().nll(g, y), GaussianLikelihood().nll(g, y[:, None])
    )


def test_categorical_likelihood_refuses_fractional_and_misshaped_labels():
    f = torch.randn(4, 3)
    with pytest.raises(ValueError, match="fractional"):
        CategoricalLikelihood().nll(f, torch.tensor([0.0, 1.5, 2.0, 1.0]))  # truncated before
    with pytest.raises(ValueError, match=r"\[N\]=\[4\]"):
        CategoricalLikelihood().nll(f, torch.zeros(4, 1, dtype=torch.long))
    whole = torch.tensor([0.0, 1.0, 2.0, 1.0])  # integral floats are class indices
    torch.testing.assert_close(CategoricalLikelihood().nll(f, whole),
                               CategoricalLikelihood().nll(f, whole.long()))  # fmt: skip


def test_select_memorable_refuses_nan_weights_and_bad_labels():
    net = nn.Linear(3, 2)
    x, y = torch.randn(10, 3), torch.arange(10) % 2
    with torch.no_grad():
        net.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="weights weight are not finite"):
        select_memorable(net, x, y, n_per_class=2)
    net = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="non-negative integer"):
        select_memorable(net, x, y - 1, n_per_class=2)
    with pytest.raises(ValueError, match="non-negative integer"):
        select_memorable(net, x, y.float() + 0.5, n_per_class=2)
    assert len(select_memorable(net, x, y, n_per_class=2)) == 4


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 5),
    c=st.integers(1, 4),
    extra=st.sampled_from([(), (1,), (2,)]),
)
def test_likelihoods_accept_only_the_documented_target_shapes(n, c, extra):
    f = torch.zeros(n, c)
    y = torch.zeros(n, *extra)
    gauss_ok = tuple(y.shape) in ((n, c), (n,) if c == 1 else None)
    if gauss_ok:
        assert GaussianLikelihood().nll(f, y).shape == (n,)
    else:
        with pytest.raises(ValueError, match="shape"):
            GaussianLikelihood().nll(f, y)
    if extra == ():
        assert CategoricalLikelihood().nll(f, y.long()).shape == (n,)
    else:
        with pytest.raises(ValueError, match=r"\[N\]"):
            CategoricalLikelihood().nll(f, y.long())
