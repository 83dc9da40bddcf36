"""``optimize_prior_precision(method="marglik")`` keeps the better of its start and the
optimiser's result: an optimiser step that lowers the evidence (forced here by replacing
L-BFGS's step) leaves the starting ``delta``; one that raises it is kept. Checked for every
(subset x structure) class, against evidences computed at the two candidates."""

from __future__ import annotations

import math

import pytest
import torch
from test_laplace_refusals import CASES, IDS, X, Y, make, mlp


def _forced_step(log_delta: float):
    """An L-BFGS ``step`` that sets the optimised ``log delta`` to ``log_delta``."""

    def step(self, closure):
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    p.fill_(log_delta)
        return closure()

    return step


@pytest.mark.parametrize(("subset", "structure"), CASES, ids=IDS)
def test_marglik_keeps_the_start_when_the_optimiser_lowers_the_evidence(
    subset, structure, monkeypatch
):
    la = make(mlp(), "classification", subset, structure).fit([(X, Y)])
    start = la.optimize_prior_precision(n_steps=50, optimizer="lbfgs").clone()  # near the optimum
    worse = math.log(float(start) * 1e4)
    with torch.no_grad():
        assert la.log_marginal_likelihood(math.exp(worse)) < la.log_marginal_likelihood(start)
    monkeypatch.setattr(torch.optim.LBFGS, "step", _forced_step(worse))
    kept = la.optimize_prior_precision(n_steps=5, optimizer="lbfgs")
    torch.testing.assert_close(kept, start)
    torch.testing.assert_close(la.prior_precision, start)


@pytest.mark.parametrize(("subset", "structure"), CASES[:3], ids=IDS[:3])
def test_marglik_keeps_a_result_that_raises_the_evidence(subset, structure, monkeypatch):
    la = make(mlp(), "classification", subset, structure, prior_precision=1e3).fit([(X, Y)])
    best = la.optimize_prior_precision(n_steps=100, optimizer="lbfgs").clone()
    la.prior_precision = 1e3
    monkeypatch.setattr(torch.optim.LBFGS, "step", _forced_step(math.log(float(best))))
    torch.testing.assert_close(la.optimize_prior_precision(n_steps=5, optimizer="lbfgs"), best)
