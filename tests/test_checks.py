"""The shared input checks: a non-tensor is a TypeError, a wrong shape, an empty batch or a
NaN/inf entry a ValueError; every message names the argument."""

from __future__ import annotations

import pytest
import torch

from fromp._checks import check_batch, check_vector, device_dtype
from fromp.memorable import select_memorable
from fromp.regularizer import FROMPRegularizer


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_entries_are_refused_by_name(bad):
    x = torch.zeros(3, 2)
    x[1, 0] = bad
    with pytest.raises(ValueError, match="x_mem has non-finite entries"):
        check_batch(x, "x_mem")
    with pytest.raises(ValueError, match="posterior_variance has non-finite"):
        check_vector(x.reshape(-1), 6, "posterior_variance")


def test_types_shapes_and_signs():
    with pytest.raises(TypeError, match=r"x must be a Tensor of shape \[N, \.\.\.\], got list"):
        check_batch([[1.0]], "x")
    with pytest.raises(ValueError, match="x must be a non-empty"):
        check_batch(torch.zeros(0, 2), "x")
    with pytest.raises(ValueError, match="x must be a non-empty"):
        check_batch(torch.tensor(1.0), "x")
    with pytest.raises(TypeError, match="v must be a Tensor"):
        check_vector(1.0, 3, "v")
    with pytest.raises(ValueError, match=r"v must have shape \[P\]=\[3\], got \(2,\)"):
        check_vector(torch.ones(2), 3, "v")
    with pytest.raises(ValueError, match="v must be finite and non-negative"):
        check_vector(-torch.ones(3), 3, "v", nonnegative=True)
    with pytest.raises(ValueError, match="v must be finite and strictly positive"):
        check_vector(torch.zeros(3), 3, "v", positive=True)
    x = torch.ones(2, 3, dtype=torch.int64)
    assert check_batch(x, "x") is x  # integer inputs pass unchanged
    net = torch.nn.Linear(2, 2).double()
    assert device_dtype(net) == (torch.device("cpu"), torch.float64)
    net.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        device_dtype(net)


def test_library_functions_use_the_shared_rules():
    net = torch.nn.Linear(2, 3)
    x, y = torch.randn(6, 2), torch.arange(6) % 3
    with pytest.raises(TypeError, match="x must be a Tensor"):
        select_memorable(net, x.tolist(), y, n_per_class=1)
    with pytest.raises(TypeError, match="y must be a Tensor"):
        select_memorable(net, x, y.tolist(), n_per_class=1)
    inf = x.clone()
    inf[0, 0] = float("inf")
    with pytest.raises(ValueError, match="x has non-finite"):
        select_memorable(net, inf, y, n_per_class=1)
    reg = FROMPRegularizer()
    with pytest.raises(ValueError, match="x_mem has non-finite"):
        reg.add_task(net, inf, 0, torch.ones(9))
    with pytest.raises(TypeError, match="posterior_variance must be a Tensor"):
        reg.add_task(net, x, 0, [1.0] * 9)
    assert len(reg) == 0
