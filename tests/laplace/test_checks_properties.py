"""Property-based tests (hypothesis) over the fitted Laplace's hyperparameters and inputs:
for any positive prior precision and temperature the evidence is the dense float64 formula
and the diagonal evidence never exceeds the full one (Hadamard's inequality); any label
outside the likelihood's range and any non-positive or non-finite hyperparameter is refused
before the fit changes anything."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fromp import Laplace
from fromp.likelihood import CategoricalLikelihood
from fromp.testing import dense_jacobian, dense_nll_hessians, flat
from tests.cases import tiny_mlp

F64 = torch.float64
SETTINGS = settings(max_examples=25, deadline=None)


def _problem():
    torch.manual_seed(0)
    model = tiny_mlp(4, 5, 3)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, 4, generator=g, dtype=F64)
    y = torch.randint(0, 3, (10,), generator=g)
    jac = dense_jacobian(model, x)
    with torch.no_grad():
        f = model(x)
    lam = dense_nll_hessians(CategoricalLikelihood(), f, y)
    ggn = torch.einsum("ncp,ncd,ndq->pq", jac, lam, jac)
    nll = float(torch.nn.functional.cross_entropy(f, y, reduction="sum"))
    full = Laplace(model, "classification", "all", "full").fit([(x, y)])
    diag = Laplace(model, "classification", "all", "diag").fit([(x, y)])
    return model, x, y, ggn, nll, full, diag


MODEL, X, Y, GGN, NLL, FULL, DIAG = _problem()
P = len(GGN)
positive = st.floats(1e-3, 1e3, allow_nan=False, allow_infinity=False)


def dense_evidence(delta: float, temperature: float, m0: float, diagonal: bool) -> float:
    g = torch.diag(torch.diagonal(GGN)) if diagonal else GGN
    theta = flat(MODEL) - m0
    logdet = torch.logdet(g / temperature + delta * torch.eye(P, dtype=F64)) - P * math.log(delta)
    return -NLL / temperature - 0.5 * delta * float(theta @ theta) - 0.5 * float(logdet)


@SETTINGS
@given(delta=positive, temperature=st.floats(0.1, 10.0), m0=st.floats(-1.0, 1.0))
def test_evidence_is_the_dense_formula(delta, temperature, m0):
    for la, diagonal in ((FULL, False), (DIAG, True)):
        la.temperature = temperature
        la.prior_mean = torch.full((P,), m0, dtype=F64)
        got = float(la.log_marginal_likelihood(delta))
        want = dense_evidence(delta, temperature, m0, diagonal)
        assert got == pytest.approx(want, rel=1e-9, abs=1e-9)
    assert float(DIAG.log_marginal_likelihood(delta)) <= float(FULL.log_marginal_likelihood(delta))
    for la in (FULL, DIAG):
        la.temperature, la.prior_mean = 1.0, torch.zeros(P, dtype=F64)


@SETTINGS
@given(bad=st.one_of(st.floats(max_value=0.0), st.just(math.inf), st.just(math.nan)))
def test_non_positive_or_non_finite_hyperparameters_refused(bad):
    with pytest.raises(ValueError, match="prior_precision"):
        FULL.log_marginal_likelihood(bad)
    with pytest.raises(ValueError, match="temperature"):
        Laplace(MODEL, "classification", "all", "diag", temperature=bad)


@SETTINGS
@given(
    label=st.integers(-(2**63), 2**63 - 1).filter(lambda v: v < 0 or v >= 3),
    where=st.integers(0, 9),
)
def test_any_class_label_outside_the_head_refused_before_the_fit(label, where):
    y = Y.clone()
    y[where] = label
    la = Laplace(MODEL, "classification", "all", "diag").fit([(X, Y)])
    before = la.H.clone()
    with pytest.raises(ValueError, match=r"y must hold class indices in \[0, C\)"):
        la.fit([(X, y)])
    assert torch.equal(la.H, before)


@SETTINGS
@given(label=st.floats(allow_nan=True).filter(lambda v: v not in (0.0, 1.0)))
def test_any_bernoulli_label_outside_01_refused(label):
    torch.manual_seed(0)
    model = tiny_mlp(4, 5, 1)
    y = torch.zeros(10, dtype=F64)
    y[3] = label
    with pytest.raises(ValueError, match="y must hold labels 0 or 1"):
        Laplace(model, "bernoulli", "all", "diag").fit([(X, y)])
