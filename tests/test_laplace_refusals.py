"""Bad input to a fitted Laplace is refused before any work, for every (subset x structure)
class, with a message naming the argument (the fourth audit's S7-S19, C1-C4, M2-M15):
non-finite, overflowing or empty predict batches; a model in train mode; labels the
likelihood cannot hold; non-finite targets and hyperparameters; prior searches that would
do nothing; states of another model; and a 0-dim parameter (a learnt temperature), which
works."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fromp
from fromp import Laplace
from fromp.likelihood import CategoricalLikelihood
from fromp.testing import dense_jacobian, dense_nll_hessians

CASES = [
    ("all", "diag"), ("all", "kron"), ("all", "full"), ("all", "lowrank"),
    ("last_layer", "diag"), ("last_layer", "kron"), ("last_layer", "full"),
    ("subnetwork", "diag"), ("subnetwork", "full"),
]  # fmt: skip
IDS = [f"{s}-{h}" for s, h in CASES]


def mlp(c: int = 3, width: int = 5, dropout: bool = False) -> nn.Module:
    torch.manual_seed(0)
    mid = nn.Dropout(0.5) if dropout else nn.Tanh()
    return nn.Sequential(nn.Linear(4, width), mid, nn.Linear(width, c)).eval()


def make(model: nn.Module, lik: str, subset: str, structure: str, **kw) -> object:
    """``fromp.Laplace`` of one class; a subnetwork of every third weight."""
    if subset == "subnetwork":
        n = sum(p.numel() for p in model.parameters())
        kw.setdefault("subnetwork_indices", torch.arange(0, n, 3))
    return Laplace(model, lik, subset, structure, **kw)


def data(n: int = 16, c: int = 3):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 4, generator=g), torch.randint(0, c, (n,), generator=g)


X, Y = data()
PAIRS = pytest.mark.parametrize(("subset", "structure"), CASES, ids=IDS)


def fitted(subset, structure, lik="classification", c=3, y=Y, **kw):
    return make(mlp(c), lik, subset, structure, **kw).fit([(X, y)])


# ----------------------------------------------------------------------------- predict (S7, S8, M7)


@PAIRS
def test_non_finite_x_refused_at_predict(subset, structure):
    la = fitted(subset, structure)
    for bad in (X[:2] * float("nan"), X[:2].clone().fill_(float("inf"))):
        for call in (la, la.functional_variance_at, la.predictive_samples):
            with pytest.raises(ValueError, match="x has non-finite entries"):
                call(bad)


@PAIRS
def test_overflowing_x_refused_at_predict(subset, structure):
    """``|x| = 1e30``: finite, but its square overflows float32 (kron returned NaN)."""
    la = fitted(subset, structure)
    with pytest.raises(ValueError, match="x has entries too large"):
        la(X[:2] * 1e30)
    assert torch.isfinite(la(X[:2] * 1e3)).all()  # large but representable: a number


@PAIRS
def test_overflowing_outputs_refused_at_predict(subset, structure):
    la = fitted(subset, structure)
    with torch.no_grad():
        la.model[2].bias[0] = float("inf")  # finite x, outputs that overflow
    with pytest.raises(ValueError, match="outputs at x are not finite"):
        la(X[:2])


@PAIRS
def test_train_mode_refused_at_predict(subset, structure):
    """Dropout on would make every call random (kron and last-layer returned samples)."""
    model = mlp(dropout=True)
    la = make(model, "classification", subset, structure).fit([(X, Y)])
    model.train()
    for call in (la, la.functional_variance_at, la.predictive_samples):
        with pytest.raises(ValueError, match=r"call model.eval\(\) first"):
            call(X[:2])
    model.eval()
    torch.testing.assert_close(la(X[:2]), la(X[:2]))


@PAIRS
def test_empty_batch_refused_at_predict(subset, structure):
    """One rule for every structure: an empty batch is refused (kron and last-layer raised
    a reshape error, subnetwork returned ``[0, C]``)."""
    la = fitted(subset, structure)
    for call in (la, la.functional_variance_at):
        with pytest.raises(ValueError, match="x must be a non-empty"):
            call(X[:0])


# ----------------------------------------------------------------------------- targets (S9-S11, M2)


@PAIRS
@pytest.mark.parametrize("label", [2, -1, 0.5])
def test_bernoulli_labels_outside_01_refused(subset, structure, label):
    y = torch.full((16,), label)
    with pytest.raises(ValueError, match="y must hold labels 0 or 1"):
        fitted(subset, structure, "bernoulli", c=1, y=y)


@PAIRS
def test_softmax_over_one_output_refused(subset, structure):
    y = torch.zeros(16, dtype=torch.long)
    with pytest.raises(ValueError, match="bernoulli"):
        fitted(subset, structure, c=1, y=y)


@PAIRS
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_regression_targets_refused(subset, structure, value):
    y = torch.randn(16)
    y[3] = value
    with pytest.raises(ValueError, match="targets y has non-finite entries"):
        fitted(subset, structure, "regression", c=1, y=y)


@PAIRS
@pytest.mark.parametrize("label", [5, 3, -1])
def test_labels_out_of_range_refused_at_fit(subset, structure, label):
    y = Y.clone()
    y[7] = label
    with pytest.raises(ValueError, match=r"y must hold class indices in \[0, C\)=\[0, 3\)"):
        fitted(subset, structure, y=y)


@PAIRS
def test_refused_fit_leaves_state_unchanged(subset, structure):
    """A refusal comes before any work: the earlier fit is kept as it was."""
    la = fitted(subset, structure)
    before = la.state_dict()
    with pytest.raises(ValueError, match="class indices"):
        la.fit([(X, torch.full((16,), 9))])
    after = la.state_dict()
    assert torch.equal(before["mean"], after["mean"]) and after["n_data"] == before["n_data"]


def test_refusal_covers_every_batch_and_one_shot_iterators():
    """The second batch's labels are checked too, and a generator of batches (iterable
    once) is checked without being consumed: the fit sees the same batches."""
    la = make(mlp(), "classification", "all", "diag")
    with pytest.raises(ValueError, match="class indices"):
        la.fit([(X[:8], Y[:8]), (X[8:], torch.full((8,), 4))])
    la.fit(b for b in [(X[:8], Y[:8]), (X[8:], Y[8:])])
    ref = make(mlp(), "classification", "all", "diag").fit([(X, Y)])
    assert la.n_data == 16
    torch.testing.assert_close(la.H, ref.H)
    torch.testing.assert_close(la.log_marginal_likelihood(), ref.log_marginal_likelihood())


# ----------------------------------------------------------------------------- hyperparameters


@PAIRS
def test_infinite_temperature_refused(subset, structure):
    with pytest.raises(ValueError, match="temperature must be finite"):
        make(mlp(), "classification", subset, structure, temperature=float("inf"))


@PAIRS
def test_nan_prior_mean_says_not_finite(subset, structure):
    with pytest.raises(ValueError, match=r"prior_mean.*finite"):
        make(mlp(), "classification", subset, structure, prior_mean=float("nan"))
    if subset == "all":
        p = sum(q.numel() for q in mlp().parameters())
        m0 = torch.zeros(p)
        m0[2] = float("nan")
        with pytest.raises(ValueError, match="prior_mean is not finite"):
            make(mlp(), "classification", subset, structure, prior_mean=m0)


@PAIRS
@pytest.mark.parametrize("n_steps", [0, -1, 2.5])
def test_prior_search_without_steps_refused(subset, structure, n_steps):
    la = fitted(subset, structure)
    with pytest.raises(ValueError, match="n_steps must be a positive int"):
        la.optimize_prior_precision(n_steps=n_steps)


@PAIRS
def test_gridsearch_refusals(subset, structure):
    la = fitted(subset, structure)
    delta = la.prior_precision.clone()
    with pytest.raises(ValueError, match="grid_size must be a positive int"):
        la.optimize_prior_precision(method="gridsearch", val_loader=[(X, Y)], grid_size=0)
    with pytest.raises(ValueError, match="fractional"):
        la.optimize_prior_precision(method="gridsearch", val_loader=[(X, torch.full((16,), 0.5))])
    with pytest.raises(ValueError, match=r"val_loader targets y must hold class indices in"):
        la.optimize_prior_precision(method="gridsearch", val_loader=[(X, torch.full((16,), 7))])
    for structure_ in ("layerwise", "diag"):
        with pytest.raises(ValueError, match="gridsearch' searches one scalar"):
            la.optimize_prior_precision(
                method="gridsearch", prior_structure=structure_, val_loader=[(X, Y)]
            )
    assert torch.equal(la.prior_precision, delta)  # nothing changed


def test_kron_prior_varying_inside_a_tensor_refused_at_construction():
    p = sum(q.numel() for q in mlp().parameters())
    with pytest.raises(ValueError, match="constant on each parameter tensor"):
        Laplace(mlp(), "classification", "all", "kron", prior_precision=torch.linspace(0.2, 3, p))
    # constant on each tensor: accepted, and equal to the [n_layers] form
    sizes = [q.numel() for q in mlp().parameters()]
    per = torch.tensor([0.5, 1.0, 2.0, 3.0])
    full = per.repeat_interleave(torch.tensor(sizes))
    a = Laplace(mlp(), "classification", "all", "kron", prior_precision=full).fit([(X, Y)])
    b = Laplace(mlp(), "classification", "all", "kron", prior_precision=per).fit([(X, Y)])
    torch.testing.assert_close(a.log_marginal_likelihood(), b.log_marginal_likelihood())


def test_kron_last_layer_prior_varying_inside_a_tensor_refused_at_fit():
    la = Laplace(mlp(), "classification", "last_layer", "kron",
                 prior_precision=torch.linspace(0.2, 3, 18))  # fmt: skip
    with pytest.raises(ValueError, match="constant on each parameter tensor"):
        la.fit([(X, Y)])
    assert la.H is None


# ------------------------------------------------------------- the model (M3, M11, M15)


@PAIRS
def test_no_trainable_parameters_refused(subset, structure):
    model = mlp()
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="model has no trainable parameters"):
        make(model, "classification", subset, structure)


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_frozen_last_layer_refused(structure):
    model = mlp()
    model[2].requires_grad_(False)
    la = Laplace(model, "classification", "last_layer", structure)
    with pytest.raises(ValueError, match=r"last layer \(2\) has no trainable parameters"):
        la.fit([(X, Y)])


@PAIRS
def test_meta_device_refused(subset, structure):
    model = mlp().to("meta")
    with pytest.raises(ValueError, match="meta device"):
        make(model, "classification", subset, structure)


def test_meta_device_refused_by_dnn2gp():
    model = mlp().to("meta")
    q = fromp.DiagonalGaussian(torch.zeros(43), torch.ones(43))
    with pytest.raises(ValueError, match=r"0\.weight is on the meta device"):
        fromp.dnn2gp(model, q, "categorical")


@PAIRS
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_refused_for_every_structure(subset, structure, dtype):
    """One rule: half-precision weights are refused in one line (kron, full, last-layer and
    lowrank raised torch's 'not implemented for Half', diag silently summed in bfloat16)."""
    with pytest.raises(ValueError, match=r"float32 or float64 weights \(call model.float\(\)\)"):
        make(mlp().to(dtype), "classification", subset, structure)


# ----------------------------------------------------------------------------- state (M5, M6)


@PAIRS
def test_state_dict_before_fit_says_fit_first(subset, structure):
    with pytest.raises(ValueError, match="call fit"):
        make(mlp(), "classification", subset, structure).state_dict()


@pytest.mark.parametrize(("subset", "structure"), CASES[:7], ids=IDS[:7])
def test_state_of_another_width_refused_at_load(subset, structure):
    a = make(mlp(width=5), "classification", subset, structure).fit([(X, Y)])
    b = make(mlp(width=7), "classification", subset, structure)
    p5, p7 = (43, 59) if subset == "all" else (18, 24)
    with pytest.raises(ValueError, match=rf"P={p5}.*P={p7}"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="call fit"):
        b(X[:2])  # nothing was loaded


@pytest.mark.parametrize("structure", ["diag", "full"])
def test_subnetwork_state_of_another_model_refused_at_load(structure):
    a = make(mlp(width=5), "classification", "subnetwork", structure).fit([(X, Y)])
    b = make(mlp(width=7), "classification", "subnetwork", structure)
    with pytest.raises(ValueError, match="subnetwork_indices"):
        b.load_state_dict(a.state_dict())


# ------------------------------------------------------------- C1: a learnt temperature


class Tempered(nn.Module):
    """An MLP with a learnt 0-dim temperature ``t`` inside: ``f = W2 tanh((W1 x + b1) / t)
    + b2`` (the head stays linear, so every subset applies)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(4, 5)
        self.t = nn.Parameter(torch.tensor(1.7))
        self.l2 = nn.Linear(5, 3)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x) / self.t))


def _dense_all_full(model, x, delta):
    """Dense float64 all-weights GGN posterior covariance ``(G + delta I)^{-1}``."""
    jac = dense_jacobian(model, x)
    with torch.no_grad():
        f = model(x)
    lam = dense_nll_hessians(CategoricalLikelihood(), f, torch.zeros(len(x), dtype=torch.long))
    g = torch.einsum("ncp,ncd,ndq->pq", jac, lam, jac)
    return torch.linalg.inv(g + delta * torch.eye(len(g), dtype=g.dtype))


def test_zero_dim_parameter_unflatten():
    model = Tempered()
    p = fromp.num_params(model)
    parts = fromp.unflatten(model, torch.arange(float(p)))
    # a module's own parameters come before its children's: t is entry 0
    assert parts["t"].shape == () and float(parts["t"]) == 0
    assert float(parts["l1.weight"][0, 0]) == 1 and float(parts["l2.bias"][-1]) == p - 1
    assert fromp.unflatten(model, torch.zeros(2, p))["t"].shape == (2,)


C1_CASES = [pytest.param(s, h, id=f"{s}-{h}") for s, h in CASES if (s, h) != ("all", "kron")]


@pytest.mark.parametrize(("subset", "structure"), C1_CASES)
def test_zero_dim_parameter_fit_and_predict(subset, structure):
    """Fit, evidence, predictive and functional variance with a 0-dim parameter; the
    all-weights variance against the dense float64 computation (the temperature included)."""
    model = Tempered().double().eval()
    x = X.double()
    kw = {"low_rank": fromp.num_params(model)} if structure == "lowrank" else {}
    la = make(model, "classification", subset, structure, prior_precision=0.7, **kw)
    la.fit([(x, Y)])
    assert torch.isfinite(la.log_marginal_likelihood())
    probs = la(x[:5])
    assert probs.shape == (5, 3) and torch.allclose(probs.sum(-1), torch.ones(5, dtype=x.dtype))
    var = la.functional_variance_at(x[:5])
    if (subset, structure) in (("all", "full"), ("all", "lowrank")):
        cov = _dense_all_full(model, x, 0.7)
        jac = dense_jacobian(model, x[:5])
        torch.testing.assert_close(var, torch.einsum("ncp,pq,ndq->ncd", jac, cov, jac))


def test_zero_dim_parameter_kron_refused_clearly():
    with pytest.raises(ValueError, match="hessian_structure='kron' covers"):
        Laplace(Tempered().eval(), "classification", "all", "kron").fit([(X, Y)])


def test_zero_dim_parameter_diag_ggn_and_dnn2gp():
    """The GGN diagonal against the dense one (the temperature's entry included), and the
    DNN2GP kernel of a diagonal posterior against ``J diag(v) J^T``."""
    model = Tempered().double().eval()
    x = X.double()
    jac = dense_jacobian(model, x)
    with torch.no_grad():
        f = model(x)
    lam = dense_nll_hessians(CategoricalLikelihood(), f, torch.zeros(len(x), dtype=torch.long))
    dense = torch.einsum("ncp,ncd,ndp->p", jac, lam, jac)
    torch.testing.assert_close(fromp.diag_ggn(model, x, "categorical"), dense)
    prec = dense + 0.5
    q = fromp.DiagonalGaussian(fromp.flat_params(model), prec)
    gp = fromp.dnn2gp(model, q, "categorical")
    expected = torch.einsum("ncp,p,mdp->ncmd", jac[:3], prec.reciprocal(), jac[:3])
    torch.testing.assert_close(gp.kernel(x[:3]), expected)


@PAIRS
def test_loading_a_state_fitted_at_other_weights_warns(subset, structure):
    """Audit S6: the predictive linearises at the model's current weights, so a state fitted
    at other weights (another initialisation of the same architecture) is loaded with a
    warning naming the difference; the fitted model itself loads silently."""
    import warnings

    la = fitted(subset, structure)
    state = la.state_dict()
    same = make(la.model, "classification", subset, structure)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_state_dict(state)  # the weights it was fitted at: no warning
    other = mlp()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.25)
    with pytest.warns(UserWarning, match="fitted at weights that differ from the model's"):
        make(other, "classification", subset, structure).load_state_dict(state)
