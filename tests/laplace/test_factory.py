"""One class per (subset, structure) under laplace-torch's names, built by the factory from
each class's ``_key``; each argument checked once; laplace-torch's types (a scalar
``prior_mean`` kept scalar, ``to_matrix()`` on the Kronecker objects); and the fifth audit's
Laplace defects (N3, N9-N12, N15), each refused at the entry point naming the argument."""

from __future__ import annotations

import importlib
import types

import pytest
import torch
from torch import nn

import fromp
import fromp.laplace
from fromp import Laplace
from fromp.laplace.factory import laplace_classes
from fromp.testing import dense_ggn

F64 = torch.float64
#: laplace-torch 0.3's classes (``laplace.__all__``) that fromp offers, by its names
LT_CLASSES = {
    ("all", "diag"): "DiagLaplace",
    ("all", "kron"): "KronLaplace",
    ("all", "full"): "FullLaplace",
    ("all", "lowrank"): "LowRankLaplace",
    ("all", "gp"): "FunctionalLaplace",
    ("last_layer", "diag"): "DiagLLLaplace",
    ("last_layer", "kron"): "KronLLLaplace",
    ("last_layer", "full"): "FullLLLaplace",
    ("subnetwork", "diag"): "DiagSubnetLaplace",
    ("subnetwork", "full"): "FullSubnetLaplace",
}
BASES = ["BaseLaplace", "ParametricLaplace", "LLLaplace", "SubnetLaplace"]


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3)).to(F64).eval()


def data(n: int = 10):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 3, dtype=F64, generator=g), torch.randint(0, 3, (n,), generator=g)


def build(model, subset, structure, **kw):
    if structure == "gp":
        kw.setdefault("n_subset", 4)
    if subset == "subnetwork":
        kw.setdefault("subnetwork_indices", torch.tensor([0, 4, 17, 30]))
    return Laplace(model, "classification", subset, structure, **kw)


# ------------------------------------------------------------------------------ names


@pytest.mark.parametrize(("subset", "structure"), list(LT_CLASSES))
def test_the_factory_returns_the_class_of_laplace_torchs_name(subset, structure):
    name = LT_CLASSES[subset, structure]
    la = build(mlp(), subset, structure)
    assert type(la) is getattr(fromp, name) is getattr(fromp.laplace, name)
    assert type(la)._key == (subset, structure) and isinstance(la, fromp.BaseLaplace)


def test_every_class_is_found_by_its_key_and_the_bases_are_exported():
    assert {k: c.__name__ for k, c in laplace_classes().items()} == LT_CLASSES
    for name in BASES:
        assert getattr(fromp, name) is getattr(fromp.laplace, name)
    assert issubclass(fromp.FunctionalLaplace, fromp.BaseLaplace)
    assert not issubclass(fromp.FunctionalLaplace, fromp.ParametricLaplace)
    for name in ("LaplaceDiag", "LaplaceFull", "laplace_full", "accumulate_ggn"):
        assert not hasattr(fromp, name) and not hasattr(fromp.laplace, name)


def test_no_module_and_function_share_a_name():
    """``import fromp.laplace as L`` is the subpackage; no public name of ``fromp`` or of
    ``fromp.laplace`` is both a submodule and something else."""
    import pkgutil

    import fromp.laplace as L

    assert isinstance(L, types.ModuleType) and L.__name__ == "fromp.laplace"
    for pkg in (fromp, fromp.laplace):
        for sub in pkgutil.iter_modules(pkg.__path__):
            if sub.name.startswith("_") or not hasattr(pkg, sub.name):
                continue
            assert getattr(pkg, sub.name) is importlib.import_module(
                f"{pkg.__name__}.{sub.name}"
            ), f"{pkg.__name__}.{sub.name} is not its module"
    assert callable(fromp.marglik_training) and callable(fromp.laplace.marglik_training)


# ------------------------------------------------------------------------------ one check


def test_one_prior_precision_check_on_the_one_call_path(monkeypatch):
    import fromp.laplace.base as base

    calls = []
    real = base.check_prior_precision

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(base, "check_prior_precision", counted)
    x, y = data()
    fromp.fit_laplace(mlp(), (x, y), "categorical", 0.5)
    assert calls == [0.5]
    calls.clear()
    fromp.fit_laplace(mlp(), (x, y), "categorical", 0.5, hessian_structure="full")
    assert calls == [0.5]


@pytest.mark.parametrize(("subset", "structure"), list(LT_CLASSES))
def test_temperature_one_rule_positive_and_finite(subset, structure):
    for bad in (0.0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="temperature must be"):
            build(mlp(), subset, structure, temperature=bad)


def test_functional_laplace_inherits_the_prior_setter_and_its_check():
    la = build(mlp(), "all", "gp")
    with pytest.raises(ValueError, match="prior_precision must be finite and strictly positive"):
        la.prior_precision = -1.0
    with pytest.raises(ValueError, match="prior_precision must be a scalar"):
        la.prior_precision = torch.ones(3, dtype=F64)
    assert type(la).prior_precision is fromp.BaseLaplace.prior_precision


# ------------------------------------------------------------------------------ types


@pytest.mark.parametrize(
    ("value", "shape"), [(0.5, ()), (torch.tensor(0.5), (1,)), (torch.tensor([0.5]), (1,))]
)
def test_a_scalar_prior_mean_is_kept_scalar(value, shape):
    """laplace-torch's forms: a float stays a 0-dim tensor, a 0-dim tensor becomes ``[1]``;
    the evidence equals that of the ``[P]`` vector of the same value."""
    x, y = data()
    la = build(mlp(), "all", "diag", prior_mean=value).fit((x, y))
    assert la.prior_mean.shape == shape
    p = la.num_params
    ref = build(mlp(), "all", "diag", prior_mean=torch.full((p,), 0.5, dtype=F64)).fit((x, y))
    assert ref.prior_mean.shape == (p,)
    torch.testing.assert_close(la.log_marginal_likelihood(), ref.log_marginal_likelihood())
    assert la.state_dict()["prior_mean"].shape == shape


@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_kron_objects_have_to_matrix(subset):
    """``H.to_matrix()`` is the block diagonal of ``B (x) A`` (weights) and the exact bias
    blocks, in the subset's parameter order; ``posterior_precision.to_matrix()`` adds
    ``delta`` and equals the dense inverse of ``posterior_covariance``."""
    model = mlp()
    x, y = data()
    la = build(model, subset, "kron", prior_precision=0.7).fit((x, y))
    h = la.H.to_matrix()
    assert h.shape == (la.num_params, la.num_params)
    prec = la.posterior_precision.to_matrix()
    torch.testing.assert_close(prec, h + 0.7 * torch.eye(len(h), dtype=F64))
    torch.testing.assert_close(torch.linalg.inv(prec), la.posterior_covariance)
    if subset == "last_layer":  # exact for a single output layer's bias block
        full = build(model, "last_layer", "full").fit((x, y)).H
        k = model[2].weight.numel()
        torch.testing.assert_close(h[k:, k:], full[k:, k:])
    else:  # the KFAC blocks' diagonal blocks of the bias equal the GGN's
        g = dense_ggn(model, x, fromp.CategoricalLikelihood())
        torch.testing.assert_close(h[15:20, 15:20], g[15:20, 15:20])


# ------------------------------------------------------------------------------ audit


class _Tuple(nn.Module):
    def __init__(self, net: nn.Module, kind: str) -> None:
        super().__init__()
        self.net, self.kind = net, kind

    def forward(self, x):
        f = self.net(x)
        return (f, x) if self.kind == "tuple" else {"logits": f}


@pytest.mark.parametrize(("subset", "structure"), list(LT_CLASSES))
@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_a_model_returning_a_tuple_or_a_dict_is_named_at_fit(subset, structure, kind):
    """N12: ``AttributeError: 'tuple' object has no attribute 'ndim'`` before."""
    x, y = data()
    la = build(_Tuple(mlp(), kind), subset, structure)
    with pytest.raises(
        ValueError,
        match=rf"must return a \[N, C\] tensor of outputs, got a {kind} on train_loader x: wrap",
    ):
        la.fit((x, y))


@pytest.mark.parametrize(("subset", "structure"), list(LT_CLASSES))
def test_x_of_the_wrong_dtype_or_shape_is_named_at_fit_and_predict(subset, structure):
    """N15: ``mat1 and mat2 must have the same dtype`` / ``shapes cannot be multiplied``."""
    x, y = data()
    la = build(mlp(), subset, structure)
    with pytest.raises(ValueError, match=r"train_loader x is torch.float32, the model "):
        la.fit((x.float(), y))
    with pytest.raises(ValueError, match=r"cannot be called on train_loader x of shape \(10, 2\)"):
        la.fit((x[:, :2], y))
    la.fit((x, y))
    with pytest.raises(ValueError, match=r"^x is torch.float32, the model torch.float64"):
        la(x.float())
    with pytest.raises(ValueError, match=r"cannot be called on x of shape \(10, 2\)"):
        la(x[:, :2])


@pytest.mark.parametrize("structure", ["gp", "diag"])
def test_labels_outside_the_head_are_named_for_the_gp_structure(structure):
    """N11: ``IndexError: Target 7 is out of bounds`` from FunctionalLaplace before."""
    x, y = data()
    y[3] = 7
    with pytest.raises(ValueError, match=r"train_loader targets y must hold class indices"):
        build(mlp(), "all", structure).fit((x, y))


@pytest.mark.parametrize(("subset", "structure"), list(LT_CLASSES))
def test_a_compiled_model_fits_and_predicts_as_its_module(subset, structure):
    """N3: ``torch.compile``d models crashed the diagonal (autograd), kron (``NoneType``) and
    last-layer (no ``nn.Linear`` in ``OptimizedModule``) fits: the curvature passes run on
    the original module (:func:`fromp.models.uncompiled`)."""
    x, y = data()
    plain = build(mlp(), subset, structure).fit((x, y))
    model = mlp()
    la = build(torch.compile(model), subset, structure).fit((x, y))
    assert la.model is model
    torch.testing.assert_close(la.log_marginal_likelihood(), plain.log_marginal_likelihood())
    torch.testing.assert_close(la(x[:3]), plain(x[:3]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_epochs": 0}, "n_epochs must be an int >= 1"),
        ({"n_epochs": -1}, "n_epochs must be an int >= 1"),
        ({"prior_prec_init": 0.0}, "prior_prec_init must be a positive"),
        ({"temperature": 0.0}, "temperature must be a positive"),
        ({"marglik_frequency": 0}, "marglik_frequency must be an int >= 1"),
        ({"n_hypersteps": 0}, "n_hypersteps must be an int >= 1"),
        ({"lr_hyp": float("nan")}, "lr_hyp must be a positive"),
        ({"sigma_noise_init": -1.0}, "sigma_noise_init must be a positive"),
    ],
)
def test_marglik_training_refuses_bad_arguments_before_any_step(kwargs, message):
    """N9 / N10: ``n_epochs=0`` returned an untrained model; the others raised math domain,
    modulo-by-zero or index errors."""
    x, y = data()
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=message):
        fromp.marglik_training(model, [(x, y)], **{"n_epochs": 1, **kwargs})
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


class _OnMapping(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, batch):
        return self.net(batch["input_ids"])


def test_marglik_training_counts_and_trains_on_mapping_batches():
    """N10: a list of mapping batches failed with ``KeyError: 1`` (counted as tuples); the
    model is called on the whole mapping, as laplace-torch calls it, and trains as on the
    equal tuple batches."""
    x, y = data()
    kw = {"n_epochs": 2, "hessian_structure": "diag", "optimizer_kwargs": {"lr": 1e-2}}
    la_a, _, ml_a, loss_a = fromp.marglik_training(mlp(), [(x[:5], y[:5]), (x[5:], y[5:])], **kw)
    batches = [{"input_ids": x[:5], "labels": y[:5]}, {"input_ids": x[5:], "labels": y[5:]}]
    la_b, _, ml_b, loss_b = fromp.marglik_training(_OnMapping(mlp()), batches, **kw)
    assert la_b.n_data == la_a.n_data == 10
    torch.testing.assert_close(torch.tensor(loss_b), torch.tensor(loss_a))
    torch.testing.assert_close(torch.tensor(ml_b), torch.tensor(ml_a))
    with pytest.raises(ValueError, match="train_loader is empty"):
        fromp.marglik_training(mlp(), [], n_epochs=1)
    with pytest.raises(ValueError, match="called on the whole mapping"):
        fromp.marglik_training(mlp(), batches, n_epochs=1)
