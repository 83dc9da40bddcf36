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
    from fromp import GP, DiagonalGaussian, diag_ggn, fit_laplace, ggn_vp, jacobians
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
        with pytest.raises(ValueError, match="input has non-finite"):
            fit_laplace(net, (xb, y), "categorical", 1.0)
        with pytest.raises(ValueError, match="input has non-finite"):
            diag_ggn(net, (xb, y), "categorical")
        v = torch.ones(9, dtype=torch.float64)
        v[2] = bad
        with pytest.raises(ValueError, match="v has non-finite"):
            ggn_vp(net, x, "categorical", v)
        with pytest.raises(ValueError, match="prior_mean is not finite"):
            fit_laplace(net, (x, y), "categorical", 1.0, prior_mean=v)
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
    with pytest.raises(TypeError, match="prior_mean must be a number or a tensor"):
        fit_laplace(net, (x, y), "categorical", 1.0, prior_mean=[0.0] * 9)
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
    from fromp import Laplace
    from fromp.continual.regularizer import FROMPRegularizer
    from fromp.laplace.functional import FunctionalLaplace

    with pytest.raises(ValueError, match="chunk_size must be a positive int, got"):
        FROMPRegularizer(chunk_size=bad)  # type: ignore[arg-type]
    for structure in ("diag", "kron", "full"):  # refused at construction, before a fit
        with pytest.raises(ValueError, match="chunk_size must be a positive int or None"):
            Laplace(net, "classification", hessian_structure=structure, chunk_size=bad)
    with pytest.raises(ValueError, match="chunk_size must be a positive int or None"):
        FunctionalLaplace(net, "classification", n_subset=4, chunk_size=bad)


def test_chunk_size_accepts_ints_and_none():
    from fromp._checks import check_chunk_size

    assert check_chunk_size(None) is None
    assert check_chunk_size(3) == 3
    assert type(check_chunk_size(torch.tensor(5).item())) is int
    with pytest.raises(ValueError, match="positive int, got None"):
        check_chunk_size(None, allow_none=False)


# ----------------------------------------------------------------------- prior precision


def test_prior_precision_accepted_shapes_and_returned_types():
    from fromp._checks import check_prior_precision

    out = check_prior_precision(2)  # an int: a float
    assert type(out) is float and out == 2.0
    assert check_prior_precision(0.0, allow_zero=True) == 0.0
    like = torch.zeros(5, dtype=torch.float64)
    sizes = {"n_layers": 2, "P": 5}
    d = check_prior_precision(3.0, sizes=sizes, like=like)
    assert d.shape == () and d.dtype == torch.float64 and float(d) == 3.0
    for shape in [(), (2,), (5,)]:
        d = check_prior_precision(torch.full(shape, 0.5), sizes=sizes, like=like)
        assert d.shape == shape and d.dtype == torch.float64 and bool((d == 0.5).all())
    # laplace-torch's scalar form [1] is [] unless 1 is an allowed length
    assert check_prior_precision(torch.ones(1), sizes=sizes, like=like).shape == ()
    assert check_prior_precision(torch.ones(1), sizes={"P": 1}, like=like).shape == (1,)
    assert check_prior_precision(torch.ones(1), sizes={}).shape == ()
    # without a reference a tensor comes back as it is (dtype kept); with one, differentiable
    t = torch.ones(5, dtype=torch.float32)
    assert check_prior_precision(t, sizes=sizes) is t
    leaf = torch.tensor(2.0, requires_grad=True)
    (check_prior_precision(leaf, sizes={}, like=like) * 3).backward()
    assert float(leaf.grad) == 3.0


@pytest.mark.parametrize("bad", [True, "1.0", [1.0], None])
def test_prior_precision_wrong_types_are_refused_as_type_and_value_errors(bad):
    from fromp._checks import check_prior_precision

    sizes = {"n_layers": 2, "P": 5}
    msg = r"prior_precision must be a positive number or a tensor of shape \[\], "
    msg += r"\[n_layers\]=\[2\] or \[P\]=\[5\], got "
    with pytest.raises(TypeError, match=msg) as err:
        check_prior_precision(bad, sizes=sizes)
    assert isinstance(err.value, ValueError)  # callers that caught ValueError still do
    with pytest.raises(TypeError, match=r"delta must be a number >= 0, got"):
        check_prior_precision(bad, allow_zero=True, name="delta")
    with pytest.raises(TypeError, match=r"tensor of shape \[\], got"):
        check_prior_precision(bad, sizes={})


def test_prior_precision_tensor_refused_where_only_a_number_is_taken():
    from fromp._checks import check_prior_precision

    with pytest.raises(TypeError, match="prior_precision must be a positive number, got Tensor"):
        check_prior_precision(torch.tensor(1.0))


@pytest.mark.parametrize("shape", [(3,), (2, 5), (1, 1)])
def test_prior_precision_shapes_outside_the_allowed_ones_are_named(shape):
    from fromp._checks import check_prior_precision

    sizes = {"n_layers": 2, "P": 5}
    msg = r"prior_precision must be a scalar or have shape \[n_layers\]=\[2\] or \[P\]=\[5\], "
    with pytest.raises(ValueError, match=msg + rf"got shape \({shape[0]},"):
        check_prior_precision(torch.ones(shape), sizes=sizes)
    with pytest.raises(ValueError, match=r"prior_precision must be a scalar, got shape"):
        check_prior_precision(torch.ones(shape), sizes={})


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), -float("inf")])
def test_prior_precision_values_finite_and_positive(bad):
    from fromp._checks import check_prior_precision

    msg = "prior_precision must be finite and strictly positive"
    with pytest.raises(ValueError, match=msg):
        check_prior_precision(bad)
    v = torch.ones(5)
    v[3] = bad
    with pytest.raises(ValueError, match=msg):
        check_prior_precision(v, sizes={"P": 5}, like=v)
    with pytest.raises(ValueError, match=msg):
        check_prior_precision(torch.tensor(bad), sizes={})
    if bad == 0.0:  # allowed where no prior is a choice (IVON's group key)
        assert check_prior_precision(bad, allow_zero=True) == 0.0
        assert check_prior_precision(v, sizes={"P": 5}, allow_zero=True) is v
    else:
        with pytest.raises(ValueError, match="prior_precision must be finite and >= 0"):
            check_prior_precision(bad, allow_zero=True)


@pytest.mark.parametrize("bad", [-1.0, float("inf"), True])
def test_every_prior_precision_argument_goes_through_the_one_check(bad):
    """The same refusal, with the same words, from every entry point that takes a prior
    precision: the Laplace classes and setter, the one-call functions, the functional
    Laplace, FROMP, VCL, VOGN (argument and group key), IVON, the leave-one-out tools."""
    from fromp import FROMPMethod, Laplace, fit_laplace
    from fromp.continual.vcl import VCLMethod
    from fromp.laplace.functional import FunctionalLaplace
    from fromp.memory.loo import LOOTracker, last_layer_loo, last_layer_remove
    from fromp.optim import IVON, VOGN

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(2, 3))
    x, y = torch.randn(6, 2), torch.arange(6) % 3
    msg = "must be finite and strictly positive" if bad is not True else "must be a positive"
    calls = [
        lambda: Laplace(net, "classification", subset_of_weights="all", prior_precision=bad),
        lambda: Laplace(net, "classification", subset_of_weights="last_layer", prior_precision=bad),
        lambda: fit_laplace(net, (x, y), "categorical", bad),
        lambda: FunctionalLaplace(net, "classification", n_subset=4, prior_precision=bad),
        lambda: FROMPMethod(prior_precision=bad),
        lambda: VCLMethod(net, prior_precision=bad),
        lambda: VOGN(net, ess=6, prior_precision=bad),
        lambda: VOGN([{"params": list(net.parameters()), "prior_precision": bad}], ess=6),
        lambda: LOOTracker(prior_precision=bad),
        lambda: last_layer_loo(net, x, y, bad),
        lambda: last_layer_remove(net, x, y, torch.zeros(6, dtype=torch.bool), bad, x),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="prior_precision.*" + msg):
            call()
    ivon_msg = msg.replace("strictly positive", ">= 0").replace("positive", "number >= 0")
    with pytest.raises(ValueError, match="prior_precision " + ivon_msg):  # 0: no prior
        IVON(net.parameters(), 0.1, ess=6, prior_precision=bad)
    la = Laplace(net, "classification", subset_of_weights="all", hessian_structure="diag")
    with pytest.raises(ValueError, match="prior_precision " + msg):
        la.prior_precision = bad
    assert float(la.prior_precision) == 1.0  # unchanged


def test_ivon_zero_prior_precision_trains_but_has_no_prior_distribution():
    """IVON's group key may be 0 (no prior: plain variational learning), so the check takes
    ``allow_zero`` there; ``prior()`` needs a proper prior and refuses it by name."""
    from fromp.optim import IVON

    net = torch.nn.Linear(2, 3)
    opt = IVON(net.parameters(), 0.1, ess=6, prior_precision=0.0)
    assert opt.param_groups[0]["prior_precision"] == 0.0
    with pytest.raises(ValueError, match=r"prior\(\): prior_precision \(0: an improper prior\)"):
        opt.prior(net)
    opt.param_groups[0]["prior_precision"] = 2.0
    torch.testing.assert_close(opt.prior(net).precision, torch.full((9,), 2.0))
