"""studies.sensitivity refuses a training or retraining that did not converge: its
estimates assume a minimum, so such a run must not produce numbers."""

from __future__ import annotations

import pytest
import torch

from studies.sensitivity import _minimise, _require_converged


def test_converged_minimum_is_accepted_and_a_stalled_or_nan_one_refused():
    target = torch.tensor([1.0, -2.0], dtype=torch.float64)

    def fn(w):
        return ((w - target) ** 2).sum() + 0.1 * (w**4).sum()

    w, _, gmax = _minimise(fn, torch.zeros(2, dtype=torch.float64), 100, 1e-10)
    _require_converged("training", w, gmax, 1e-6)
    w1, _, g1 = _minimise(fn, torch.zeros(2, dtype=torch.float64), 1, 1e-10)  # one iteration
    assert g1 > 1e-6
    with pytest.raises(RuntimeError, match="retraining without example 3 did not converge"):
        _require_converged("retraining without example 3", w1, g1, 1e-6)
    with pytest.raises(RuntimeError, match="finite weights: False"):
        _require_converged("training", torch.tensor([float("nan"), 0.0]), 0.0, 1e-6)
    with pytest.raises(RuntimeError, match="did not converge"):
        _require_converged("training", w, float("nan"), 1e-6)
