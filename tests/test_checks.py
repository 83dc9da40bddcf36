"""The shared input checks: a non-tensor is a TypeError, a wrong shape, an empty batch or a
NaN/inf entry a ValueError; every message names the argument."""

from __future__ import annotations

import pytest
import torch

from fromp._checks import check_batch, check_finite, check_vector, device_dtype
from fromp.continual.memorable import select_memorable
from fromp.continual.regularizer import FROMPRegularizer


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


def test_every_module_applies_the_one_rule():
    """curvature, ggn, gp, laplace, jacobian, sensitivity and the optimisers: a non-tensor is
    a TypeError naming the argument, NaN and inf are both refused before any work."""
    from fromp import GP, DiagonalGaussian, diag_ggn, ggn_vp, jacobians, laplace
    from fromp.memory.sensitivity import memory_perturbation
    from fromp.optim import predict_mc
    from fromp.optim.vogn import per_example_grad_stats

    net = torch.nn.Sequential(torch.nn.Linear(2, 3)).double()
    x, y = torch.randn(4, 2, dtype=torch.float64), torch.arange(4) % 3
    q = DiagonalGaussian.isotropic(net, 1.0)
    gp = GP(net, q, "categorical")
    for bad in (float("nan"), float("inf")):
        xb = x.clone()
        xb[0, 1] = bad
        with pytest.raises(ValueError, match="x1 has non-finite"):
            gp.kernel(xb)
        with pytest.raises(ValueError, match="x has non-finite"):
            jacobians(net, xb)
        with pytest.raises(ValueError, match="x has non-finite"):
            per_example_grad_stats(net, xb, y)
        with pytest.raises(ValueError, match="x has non-finite"):
            memory_perturbation(net, q, xb, y, "categorical")
        with pytest.raises(ValueError, match="data input has non-finite"):
            laplace(net, (xb, y), "categorical", 1.0)
        with pytest.raises(ValueError, match="data input has non-finite"):
            diag_ggn(net, (xb, y), "categorical")
        v = torch.ones(9, dtype=torch.float64)
        v[2] = bad
        with pytest.raises(ValueError, match="v has non-finite"):
            ggn_vp(net, x, "categorical", v)
        with pytest.raises(ValueError, match="prior_mean has non-finite"):
            laplace(net, (x, y), "categorical", 1.0, prior_mean=v)
    with pytest.raises(TypeError, match=r"x must be a Tensor of shape \[N, \.\.\.\], got list"):
        jacobians(net, x.tolist())
    with pytest.raises(TypeError, match="x1 must be a Tensor"):
        gp.kernel(x.tolist())
    with pytest.raises(TypeError, match="x must be a Tensor"):
        per_example_grad_stats(net, x.tolist(), y)
    with pytest.raises(TypeError, match="y must be a Tensor"):
        per_example_grad_stats(net, x, y.tolist())
    with pytest.raises(TypeError, match="y must be a Tensor"):
        memory_perturbation(net, q, x, y.tolist(), "categorical")
    with pytest.raises(TypeError, match="v must be a Tensor"):
        ggn_vp(net, x, "categorical", [1.0] * 9)
    with pytest.raises(TypeError, match="prior_mean must be a Tensor"):
        laplace(net, (x, y), "categorical", 1.0, prior_mean=[0.0] * 9)
    with pytest.raises(TypeError, match="posterior must be a GaussianPosterior"):
        predict_mc(net, torch.zeros(9), x)


def test_check_finite_exact_when_the_sum_overflows_or_cancels():
    big = torch.tensor([3e38, 3e38, -1.0])  # finite entries whose float32 sum overflows
    assert check_finite(big, "x") is big
    for bad in ([1.0, float("nan")], [float("inf"), float("-inf")], [float("-inf"), 2.0]):
        with pytest.raises(ValueError, match="x has non-finite entries"):
            check_finite(torch.tensor(bad), "x")
    ints = torch.tensor([1, 2])  # integer tensors are never checked
    assert check_finite(ints, "x") is ints


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "4", [4]])
def test_chunk_size_rule_is_one_rule_everywhere(bad):
    """Every chunk_size argument goes through check_chunk_size: the same refusal, naming the
    argument, from the GP, the Jacobian, and VOGN."""
    from fromp._checks import check_chunk_size
    from fromp.curvature.jacobian import jacobians
    from fromp.optim import VOGN

    with pytest.raises(ValueError, match="chunk_size must be a positive int or None"):
        check_chunk_size(bad)
    net = torch.nn.Linear(3, 2)
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        jacobians(net, x, chunk_size=bad)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        VOGN(net, ess=4, chunk_size=bad)


def test_chunk_size_accepts_ints_and_none():
    from fromp._checks import check_chunk_size

    assert check_chunk_size(None) is None
    assert check_chunk_size(3) == 3
    assert type(check_chunk_size(torch.tensor(5).item())) is int
    with pytest.raises(ValueError, match="positive int, got None"):
        check_chunk_size(None, allow_none=False)
