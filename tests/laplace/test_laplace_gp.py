"""One Laplace engine: ``fromp.laplace``, ``fit_laplace(..., hessian_structure="full")``,
``log_marginal_likelihood``, ``optimize_prior_precision`` and ``log_evidence_grid`` are calls
into the ``fromp.Laplace`` classes (same numbers, same checks); ``fromp.DiagLaplace`` /
``FullLaplace`` are laplace-torch's all-weights classes; one ``optimize_prior_precision``
vocabulary (earlier spellings warn and give the same result); one ``gp()`` type."""

from __future__ import annotations

import importlib
import warnings
from contextlib import contextmanager

import pytest
import torch
from torch import nn

import fromp
from fromp import DiagLaplace, FullLaplace, Laplace
from fromp.laplace.laplace_gp import LaplaceGP
from fromp.likelihood import CategoricalLikelihood, GaussianLikelihood
from fromp.testing import dense_ggn, flat
from tests.cases import tiny_mlp

F64 = torch.float64


def data(n=12, c=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g, dtype=F64), torch.randint(0, c, (n,), generator=g)


@contextmanager
def no_warnings():
    """The laplace-torch spellings: no DeprecationWarning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        yield


# ----------------------------------------------------------------------------- the same checks


@pytest.mark.parametrize(
    "call", ["laplace", "fit_laplace_hessian_full", "evidence", "optimize", "grid"]
)
def test_functional_path_refuses_what_the_classes_refuse(call):
    """The audit's case: Gaussian targets ``[N]`` for outputs ``[N, 3]``, and fractional
    class labels, are refused by the functions exactly as by ``fromp.Laplace``."""
    torch.manual_seed(0)
    net = tiny_mlp(4, 5, 3)
    x, y = data()
    fns = {
        "laplace": lambda d, lik: fromp.fit_laplace(net, d, lik, 1.0),
        "fit_laplace_hessian_full": lambda d, lik: fromp.fit_laplace(
            net, d, lik, 1.0, hessian_structure="full"
        ),
        "evidence": lambda d, lik: fromp.log_marginal_likelihood(net, d, lik, 1.0),
        "optimize": lambda d, lik: fromp.optimize_prior_precision(net, d, lik),
        "grid": lambda d, lik: fromp.log_evidence_grid(net, d, lik),
    }
    for d, lik in (((x, y.double()), "gaussian"), ((x, y + 0.5), "categorical")):
        with pytest.raises(ValueError) as by_class:
            Laplace(net, lik, "all", "diag").fit(d)
        with pytest.raises(ValueError) as by_function:
            fns[call](d, lik)
        assert str(by_function.value) == str(by_class.value)


def test_functional_path_refuses_train_mode_and_half_precision():
    net = nn.Sequential(nn.Linear(4, 5), nn.Dropout(0.2), nn.Linear(5, 3)).double().train()
    x, y = data()
    with pytest.raises(ValueError, match=r"call model.eval\(\) first"):
        fromp.fit_laplace(net, (x, y), "categorical", 1.0)
    with pytest.raises(ValueError, match="float32 or float64"):
        fromp.fit_laplace(
            net.eval().half(), (x.half(), y), "categorical", 1.0, hessian_structure="full"
        )


# ----------------------------------------------------------------------------- the same numbers


def test_laplace_is_the_class_posterior_and_the_dense_ggn():
    torch.manual_seed(0)
    net = tiny_mlp(4, 5, 3)
    x, y = data()
    q = fromp.fit_laplace(net, (x, y), "categorical", 0.7)
    la = Laplace(net, "classification", "all", "diag", prior_precision=0.7).fit((x, y))
    assert torch.equal(q.precision, la.posterior.precision) and torch.equal(q.mean, flat(net))
    g = dense_ggn(net, x, CategoricalLikelihood())
    torch.testing.assert_close(q.precision, torch.diagonal(g) + 0.7, rtol=1e-12, atol=1e-12)
    qf = fromp.fit_laplace(net, (x, y), "categorical", 0.7, hessian_structure="full")
    eye = torch.eye(len(g), dtype=F64)
    torch.testing.assert_close(qf.precision, g + 0.7 * eye, rtol=1e-12, atol=1e-12)
    # accumulation over two tasks: sum of the GGNs plus one prior
    x2, _ = data(seed=5)
    q2 = fromp.fit_laplace(net, x2, "categorical", None, posterior=qf, hessian_structure="full")
    g2 = dense_ggn(net, x2, CategoricalLikelihood())
    torch.testing.assert_close(q2.precision, g + g2 + 0.7 * eye, rtol=1e-12, atol=1e-12)


def test_gaussian_noise_enters_as_one_over_sigma_squared():
    torch.manual_seed(0)
    net = tiny_mlp(4, 5, 2)
    x, _ = data()
    y = torch.randn(len(x), 2, dtype=F64)
    lik = GaussianLikelihood(0.5)
    q = fromp.fit_laplace(net, (x, y), lik, 0.3)
    g = dense_ggn(net, x, lik)
    torch.testing.assert_close(q.precision, torch.diagonal(g) + 0.3, rtol=1e-12, atol=1e-12)
    q1 = fromp.fit_laplace(net, (x, y), lik, 0.3)
    q2 = fromp.fit_laplace(net, (x, y), lik, None, posterior=q1)
    torch.testing.assert_close(q2.precision, 2 * torch.diagonal(g) + 0.3, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("structure", ["diag", "full"])
def test_evidence_and_prior_search_equal_the_class(structure):
    torch.manual_seed(0)
    net = tiny_mlp(4, 5, 3)
    x, y = data()
    la = Laplace(net, "classification", "all", structure).fit((x, y))
    got = fromp.log_marginal_likelihood(
        net, (x, y), "categorical", 0.4, hessian_structure=structure
    )
    torch.testing.assert_close(got, la.log_marginal_likelihood(0.4).detach(), rtol=0, atol=0)
    with no_warnings():
        layer = fromp.optimize_prior_precision(
            net, (x, y), "categorical", "marglik", prior_structure="layerwise", n_steps=50,
            hessian_structure=structure,
        )  # fmt: skip
        want = la.optimize_prior_precision(prior_structure="layerwise", n_steps=50)
        la.prior_precision = 1.0
        torch.testing.assert_close(layer, want)
        scalar = fromp.optimize_prior_precision(
            net, (x, y), "categorical", hessian_structure=structure
        )
    assert isinstance(scalar, float)
    gs = fromp.optimize_prior_precision(
        net, (x, y), "categorical", "gridsearch", val_loader=[(x, y)], grid_size=5,
        hessian_structure=structure,
    )  # fmt: skip
    la.optimize_prior_precision(method="gridsearch", val_loader=[(x, y)], grid_size=5)
    assert gs == float(la.prior_precision)


# ----------------------------------------------------------------------------- the classes


def test_exported_classes_are_laplace_torch_classes():
    torch.manual_seed(0)
    net = tiny_mlp(4, 5, 3)
    x, y = data()
    assert importlib.import_module("fromp.laplace").DiagLaplace is DiagLaplace
    for cls, structure in ((DiagLaplace, "diag"), (FullLaplace, "full")):
        with no_warnings():
            a = cls(net, "classification", prior_precision=0.5).fit([(x, y)])
            b = Laplace(net, "classification", "all", structure, prior_precision=0.5)
            b.fit([(x, y)])
            torch.testing.assert_close(a(x[:3]), b(x[:3]), rtol=0, atol=0)
            torch.testing.assert_close(
                a(x[:3], pred_type="glm", link_approx="mc", n_samples=5,
                  generator=torch.Generator().manual_seed(0)),
                b(x[:3], pred_type="glm", link_approx="mc", n_samples=5,
                  generator=torch.Generator().manual_seed(0)),
            )  # fmt: skip
            torch.testing.assert_close(a.log_marginal_likelihood(), b.log_marginal_likelihood())
            assert type(a.gp()) is LaplaceGP is type(b.gp()) and type(b) is cls


def test_one_gp_type_with_gp_semantics():
    """``gp()`` is a :class:`LaplaceGP` for every structure, with :class:`fromp.GP`'s
    predictive: for regression ``(m, v + sigma^2 I)``, the predictive of ``y``."""
    torch.manual_seed(0)
    net = tiny_mlp(4, 5, 2)
    x, _ = data()
    y = torch.randn(len(x), 2, dtype=F64)
    la = Laplace(net, "regression", "all", "full", sigma_noise=0.5).fit((x, y))
    gp = la.gp()
    m, v = gp.predictive(x[:3])
    mu, var = la(x[:3])
    torch.testing.assert_close(m, mu)
    torch.testing.assert_close(v, var + 0.25 * torch.eye(2, dtype=F64))
    q = fromp.fit_laplace(net, (x, y), GaussianLikelihood(0.5), 1.0, hessian_structure="full")
    ref = fromp.GP(net, q, GaussianLikelihood(0.5)).predictive(x[:3])
    torch.testing.assert_close(gp.predictive(x[:3])[1], ref[1])
    with pytest.raises(ValueError, match="x has non-finite entries"):
        gp.kernel(x[:2] * float("nan"))
