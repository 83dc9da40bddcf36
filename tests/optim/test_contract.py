"""One contract for the optimizers that keep a posterior (:class:`fromp.IVON`,
:class:`fromp.VOGN`): a step with a closure, NaN losses and bad hyperparameters refused with
the weights and the state unchanged (also when the hyperparameters change after
construction: a scheduler, an edit of ``param_groups``, a loaded state), exact state-dict
round trips, ``zero_grad`` and parameter groups. Every optimizer added later joins
``OPTIMIZERS``."""

from __future__ import annotations

import copy
import math
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fromp import IVON, VOGN
from fromp.optim.vogn import LayerCapture, per_example_grad_stats

X = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
Y = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(1))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def _ivon(model: nn.Module, **kw):
    return IVON(model.parameters(), **{"lr": 0.1, "ess": 16, **kw})


def _vogn(model: nn.Module, **kw):
    return VOGN(model, **{"lr": 0.05, "ess": 16, **kw})


OPTIMIZERS = {"ivon": _ivon, "vogn": _vogn}


def _hess(opt) -> torch.Tensor:
    """The curvature estimate of ``opt.state`` (``"hess"``), flat in the optimizer's order."""
    return torch.cat([opt.state[p]["hess"].reshape(-1) for p in opt.params])


def _closure(opt, model: nn.Module, loss_scale: float = 1.0):
    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(X), Y) * loss_scale
        loss.backward()
        return loss

    return closure


def _step(opt, model: nn.Module, loss_scale: float = 1.0):
    """One step through the optimizer's standard closure API."""
    return opt.step(_closure(opt, model, loss_scale))


def _snapshot(opt, model):
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())


def _assert_unchanged(opt, model, snap):
    weights, state = snap
    for p, w in zip(model.parameters(), weights):
        assert torch.equal(p.detach(), w), "the weights changed"
    _assert_states_equal(opt.state_dict(), state)


def _assert_states_equal(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            _assert_states_equal(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            _assert_states_equal(u, v)
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b)
    else:
        assert a == b


@pytest.fixture(params=sorted(OPTIMIZERS))
def make(request):
    return OPTIMIZERS[request.param]


def test_step_with_closure_moves_the_weights_and_returns_the_loss(make):
    model = _mlp()
    opt = make(model)
    before = [p.detach().clone() for p in model.parameters()]
    loss = _step(opt, model)
    assert loss is not None and torch.isfinite(torch.as_tensor(loss))
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_nan_loss_refused_with_weights_and_state_unchanged(make):
    model = _mlp()
    opt = make(model)
    _step(opt, model)
    snap = _snapshot(opt, model)
    with pytest.raises(FloatingPointError, match="unchanged"):
        _step(opt, model, loss_scale=float("nan"))
    _assert_unchanged(opt, model, snap)
    _step(opt, model)  # and it still works afterwards
    assert all(torch.isfinite(p).all() for p in model.parameters())


BAD_GROUP_VALUES = [
    ("lr", float("nan")),
    ("lr", float("inf")),
    ("lr", -0.1),
    ("lr", True),
]


@pytest.mark.parametrize(("key", "value"), BAD_GROUP_VALUES)
def test_bad_lr_set_after_construction_refused_at_step(make, key, value):
    model = _mlp()
    opt = make(model)
    _step(opt, model)
    snap = _snapshot(opt, model)
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match=rf"param_groups\[0\].*{key}"):
        _step(opt, model)
    opt.param_groups[0][key] = snap[1]["param_groups"][0][key]
    _assert_unchanged(opt, model, snap)


def test_lr_zero_from_a_scheduler_is_a_step_that_does_not_move_the_mean(make):
    model = _mlp()
    opt = make(model)
    _step(opt, model)
    before = [p.detach().clone() for p in model.parameters()]
    opt.param_groups[0]["lr"] = 0.0
    _step(opt, model)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("betas", (0.9, 1.5)),
        ("betas", (-0.1, 0.9)),
        ("betas", (0.9, float("nan"))),
        ("ess", 0),
        ("ess", float("inf")),
        ("ess", 1e-100),  # the posterior scale 1 / sqrt(ess) overflows float32
        ("prior_precision", float("nan")),
        ("prior_precision", float("inf")),
        ("prior_precision", -1.0),
        ("hess_init", 0.0),
        ("mc_samples", 0),
    ],
)
def test_ivon_bad_group_hyperparameters_refused_naming_them(key, value):
    model = _mlp()
    opt = _ivon(model)
    _step(opt, model)
    snap = _snapshot(opt, model)
    old = opt.param_groups[0][key]
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match=key):
        _step(opt, model)
    with pytest.raises(ValueError, match=key):  # the two-phase path too
        with opt.sampled_params(train=True):
            pass
    opt.param_groups[0][key] = old
    _assert_unchanged(opt, model, snap)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("betas", (0.9, 1.5)),
        ("betas", (float("nan"), 0.9)),
        ("betas", (0.9,)),
        ("kl_weight", 0.0),
        ("kl_weight", float("inf")),
        ("mc_samples", -1),
    ],
)
def test_vogn_bad_group_hyperparameters_refused_naming_them(key, value):
    model = _mlp()
    opt = _vogn(model)
    _step(opt, model)
    snap = _snapshot(opt, model)
    old = opt.param_groups[0][key]
    opt.param_groups[0][key] = value
    zeros = torch.zeros(sum(p.numel() for p in opt.params))
    with pytest.raises(ValueError, match=key):
        opt.update(zeros, zeros)
    with pytest.raises(ValueError, match=key):
        _step(opt, model)
    opt.param_groups[0][key] = old
    _assert_unchanged(opt, model, snap)


@pytest.mark.parametrize(
    ("key", "value", "name"),
    [("betas", (0.9, 1.5), "ivon"), ("lr", float("nan"), "ivon"), ("betas", (0.9, 1.5), "vogn"),
     ("lr", -1.0, "vogn")],
)  # fmt: skip
def test_load_state_dict_with_bad_hyperparameters_refused_before_any_change(key, value, name):
    model = _mlp()
    opt = OPTIMIZERS[name](model)
    _step(opt, model)
    bad = copy.deepcopy(opt.state_dict())
    bad["param_groups"][0][key] = value
    _step(opt, model)
    snap = _snapshot(opt, model)
    with pytest.raises(ValueError, match=key):
        opt.load_state_dict(bad)
    _assert_unchanged(opt, model, snap)
    assert opt.param_groups[0][key] == snap[1]["param_groups"][0][key]


def test_state_dict_round_trip_is_exact(make):
    model = _mlp()
    opt = make(model)
    for _ in range(3):
        _step(opt, model)
    state = copy.deepcopy(opt.state_dict())
    weights = copy.deepcopy(model.state_dict())
    torch.manual_seed(5)
    _step(opt, model)
    after_a = [p.detach().clone() for p in model.parameters()]

    model2 = _mlp()
    model2.load_state_dict(weights)
    opt2 = make(model2)
    opt2.load_state_dict(state)
    _assert_states_equal(opt2.state_dict(), state)
    torch.manual_seed(5)
    _step(opt2, model2)
    for a, b in zip(after_a, model2.parameters()):
        assert torch.equal(a, b.detach())


def test_state_is_visible_in_self_state(make):
    model = _mlp()
    opt = make(model)
    _step(opt, model)
    for p in model.parameters():
        st = opt.state[p]
        assert st, "self.state[p] is empty"
        tensors = [v for v in st.values() if isinstance(v, torch.Tensor) and v.shape == p.shape]
        assert tensors, "self.state[p] shows no tensor of p's shape"


def test_all_the_state_is_in_self_state_and_a_reset_restarts_it(make):
    """Every optimizer of the registry keeps all its state in torch's ``self.state``: its
    state dict is torch's two entries, one per-index entry per parameter, each tensor
    shaped like its parameter; a reset of ``self.state`` (torch's meaning, Avalanche's
    ``reset_optimizer_state``) restarts it: the next step and the state after it are those
    of a new optimizer built on the current weights."""
    model = _mlp()
    opt = make(model)
    for _ in range(3):
        _step(opt, model)
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups"}
    assert sorted(sd["state"]) == list(range(len(opt.params)))
    for i, p in enumerate(opt.params):
        for k, v in sd["state"][i].items():
            assert not isinstance(v, torch.Tensor) or v.shape == p.shape, k
    weights = copy.deepcopy(model.state_dict())
    opt.state = defaultdict(dict)  # nothing kept elsewhere survives: the restart is exact
    torch.manual_seed(5)
    _step(opt, model)
    model2 = _mlp()
    model2.load_state_dict(weights)
    opt2 = make(model2)
    torch.manual_seed(5)
    _step(opt2, model2)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    _assert_states_equal(opt.state_dict(), opt2.state_dict())
    assert all(opt.state[p]["step"] == 1 for p in opt.params)


def test_zero_grad_clears_the_gradients(make):
    model = _mlp()
    opt = make(model)
    F.cross_entropy(model(X), Y).backward()
    opt.zero_grad()
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def test_param_groups_lr_zero_group_is_refused_and_two_groups_step(make):
    model = _mlp()
    groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 0.01}]
    if make is _vogn:
        opt = VOGN(groups, lr=0.05, ess=16)
    else:
        opt = IVON(groups, lr=0.1, ess=16)
    assert len(opt.param_groups) == 2
    assert opt.param_groups[1]["lr"] == 0.01

    def closure():  # VOGN over parameter groups has no model: the closure gives h
        opt.zero_grad()
        with LayerCapture(model) as cap:
            losses = F.cross_entropy(model(X), Y, reduction="none")
        if make is _vogn:
            opt.set_curvature(cap.squared_grads(losses))
        loss = losses.mean()
        loss.backward()
        return loss

    opt.step(closure)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    snap = _snapshot(opt, model)
    opt.param_groups[1]["lr"] = float("nan")
    with pytest.raises(ValueError, match=r"param_groups\[1\]"):
        opt.step(closure)
    opt.param_groups[1]["lr"] = 0.01
    _assert_unchanged(opt, model, snap)


# ----------------------------------------------------------------------------- IVON closures
def test_ivon_closure_without_backward_refused_weights_unchanged():
    model = _mlp()
    opt = _ivon(model, mc_samples=2)
    _step(opt, model)
    snap = _snapshot(opt, model)

    def closure():
        opt.zero_grad()
        return F.cross_entropy(model(X), Y)  # no backward()

    with pytest.raises(RuntimeError, match="backward"):
        opt.step(closure)
    _assert_unchanged(opt, model, snap)
    _step(opt, model)  # nothing left accumulated: the next step works


def test_ivon_closure_returning_none_refused_clearly():
    model = _mlp()
    opt = _ivon(model)
    snap = _snapshot(opt, model)

    def closure():
        opt.zero_grad()
        F.cross_entropy(model(X), Y).backward()

    with pytest.raises(TypeError, match="returned None"):
        opt.step(closure)
    _assert_unchanged(opt, model, snap)


def test_ivon_prior_precision_nan_blames_prior_precision_not_the_loss():
    model = _mlp()
    opt = _ivon(model)
    opt.param_groups[0]["prior_precision"] = float("nan")
    with pytest.raises(ValueError, match="prior_precision") as err:
        _step(opt, model)
    assert "loss" not in str(err.value)


def test_ivon_group_ess_zero_is_a_clear_error():
    model = _mlp()
    opt = _ivon(model)
    opt.param_groups[0]["ess"] = 0
    with pytest.raises(ValueError, match="ess"):
        _step(opt, model)


# ----------------------------------------------------------------------------- VOGN closures
def test_vogn_closure_finds_the_per_example_curvature_itself():
    """step(closure) of a mean loss, without set_curvature: the same update as a closure
    that sets the curvature of per_example_grad_stats (whose squared per-example gradients
    are checked against loops over examples in test_vogn.py), and the same h as a
    brute-force loop."""
    m1, m2 = _mlp().double(), _mlp().double()
    xd = X.double()
    o1 = VOGN(m1, lr=0.05, ess=16)
    o2 = VOGN(m2, lr=0.05, ess=16)

    def given():
        o1.set_curvature(per_example_grad_stats(m1, xd, Y, "categorical").curv)
        return _mean_loss_backward(o1, m1, xd)

    for _ in range(3):
        torch.manual_seed(3)
        o1.step(given)
        torch.manual_seed(3)

        def closure():
            o2.zero_grad()
            loss = F.cross_entropy(m2(xd), Y)
            loss.backward()
            return loss

        o2.step(closure)
        for a, b in zip(m1.parameters(), m2.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(_hess(o1), _hess(o2), rtol=1e-12, atol=1e-14)
    # brute force: s after one step from zero is (1 - beta2) (1/M) sum_i g_i^2 at the draw
    m3 = _mlp().double()
    o3 = VOGN(m3, lr=0.05, ess=16, mc_samples=0)
    o3.step(lambda: _mean_loss_backward(o3, m3, xd))
    gs = []
    m4 = _mlp().double()
    for i in range(len(xd)):
        m4.zero_grad()
        F.cross_entropy(m4(xd[i : i + 1]), Y[i : i + 1]).backward()
        gs.append(torch.cat([p.grad.reshape(-1) for p in m4.parameters()]))
    h = torch.stack(gs).pow(2).mean(0)
    torch.testing.assert_close(_hess(o3), (1 - 0.999) * h, rtol=1e-10, atol=1e-14)


def _mean_loss_backward(opt, model, x):
    opt.zero_grad()
    loss = F.cross_entropy(model(x), Y)
    loss.backward()
    return loss


def test_vogn_closure_old_way_with_set_curvature_still_works():
    model = _mlp()
    opt = _vogn(model)

    def closure():
        opt.zero_grad()
        with LayerCapture(model) as cap:
            losses = F.cross_entropy(model(X), Y, reduction="none")
        opt.set_curvature(cap.squared_grads(losses))
        loss = losses.mean()
        loss.backward()
        return loss

    opt.step(closure)
    assert opt.state[opt.params[0]]["step"] == 1


def test_vogn_closure_without_backward_or_returning_none_refused():
    model = _mlp()
    opt = _vogn(model)
    _step(opt, model)
    snap = _snapshot(opt, model)
    with pytest.raises(RuntimeError, match="backward"):
        opt.step(lambda: F.cross_entropy(model(X), Y))
    with pytest.raises(TypeError, match="returned None"):
        opt.step(lambda: F.cross_entropy(model(X), Y).backward())
    _assert_unchanged(opt, model, snap)


# ----------------------------------------------------------------------------- vocabulary
def test_one_name_for_the_data_size():
    """``ess`` in both constructors (``train_set_size`` is gone)."""
    for make in (_ivon, _vogn):
        model = _mlp()
        new = make(model, ess=16)
        assert new.ess == 16
    with pytest.raises(TypeError, match="train_set_size"):
        VOGN(_mlp(), lr=0.05, train_set_size=16)
    with pytest.raises(TypeError, match="train_set_size"):
        IVON(_mlp().parameters(), lr=0.1, train_set_size=16)
    with pytest.raises(ValueError, match="ess is required"):
        IVON(_mlp().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="ess"):
        VOGN(_mlp(), ess=0)


# ----------------------------------------------------------------------------- the contract
def _convex_setup():
    """Multinomial logistic regression (a linear model): the mean cross-entropy is convex in
    the weights."""
    torch.manual_seed(0)
    return nn.Linear(4, 3)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_step_with_closure_decreases_a_convex_loss(name):
    model = _convex_setup()
    opt = OPTIMIZERS[name](model)
    with torch.no_grad():
        before = F.cross_entropy(model(X), Y).item()
    torch.manual_seed(0)
    for _ in range(30):
        _step(opt, model)
    with torch.no_grad():
        after = F.cross_entropy(model(X), Y).item()
    assert after < before - 0.05, (before, after)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_lr_schedulers_drive_the_step(name):
    """A LambdaLR that brings lr to 0 stops the mean; OneCycleLR with cycle_momentum edits
    ``betas`` (both optimizers keep torch's ``betas`` form) and the steps stay finite."""
    model = _mlp()
    opt = OPTIMIZERS[name](model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 if t < 1 else 0.0)
    _step(opt, model)
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.0
    before = [p.detach().clone() for p in model.parameters()]
    _step(opt, model)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))

    model = _mlp()
    opt = OPTIMIZERS[name](model)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=6)
    b1 = opt.param_groups[0]["betas"][0]
    for _ in range(3):
        _step(opt, model)
        sched.step()
    assert opt.param_groups[0]["betas"][0] != b1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _blr():
    """Bayesian linear regression in float64: ``y = X w + noise``, unit noise variance,
    prior ``N(0, I / delta)``: the posterior precision is ``A = X^T X + delta I`` and its
    mean ``A^{-1} X^T y`` (closed form, by torch.linalg.solve); the mean-field Gaussian
    closest to it (the fixed point of VOGN and IVON) has that mean and precision
    ``diag(A)``."""
    g = torch.Generator().manual_seed(0)
    n = 24
    x = torch.randn(n, 2, generator=g, dtype=torch.float64)
    x = x @ torch.tensor([[1.0, 0.3], [0.0, 0.7]], dtype=torch.float64)  # correlated
    y = x @ torch.tensor([1.5, -0.5], dtype=torch.float64)
    y = (y + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)).unsqueeze(1)
    delta = 3.0
    a = x.T @ x + delta * torch.eye(2, dtype=torch.float64)
    mean = torch.linalg.solve(a, x.T @ y).squeeze(1)
    return x, y, delta, mean, torch.diag(a)


def _fit_blr(opt, model, x, y, steps):
    def closure():
        opt.zero_grad()
        loss = 0.5 * (model(x) - y).pow(2).sum(1).mean()
        loss.backward()
        return loss

    tail = []
    for t in range(steps):
        opt.step(closure)
        if t >= steps // 2:
            tail.append(model.weight.detach().reshape(-1).clone())
    return torch.stack(tail).mean(0)


def _linear():
    model = nn.Linear(2, 1, bias=False).double()
    nn.init.zeros_(model.weight)
    return model


def test_vogn_ggn_recovers_the_bayesian_linear_regression_posterior():
    """VOGN with the GGN (exact for a linear model) and the Gaussian likelihood: the
    precision ``N s^ + delta`` equals ``diag(X^T X) + delta`` at every step (bias-corrected
    ``s`` from zero), the mean converges to the exact posterior mean without sampling
    (OGN), and when the same optimizer then draws 4 samples per step (``mc_samples`` edited
    in ``param_groups``) the mean stays there: the tail average within 2 %."""
    x, y, delta, mean, prec = _blr()
    kw = dict(lr=0.1, ess=len(x), prior_precision=delta, likelihood="gaussian", hess_approx="ggn")
    model = _linear()
    opt = VOGN(model, mc_samples=0, **kw)
    _fit_blr(opt, model, x, y, 400)
    torch.testing.assert_close(model.weight.detach().reshape(-1), mean, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(opt.posterior().precision, prec, rtol=1e-12, atol=0)
    opt.param_groups[0]["mc_samples"] = 4
    torch.manual_seed(0)
    avg = _fit_blr(opt, model, x, y, 60)
    torch.testing.assert_close(avg, mean, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(opt.posterior().precision, prec, rtol=1e-12, atol=0)


def test_ivon_stationary_point_is_the_bayesian_linear_regression_posterior():
    """IVON's Hessian estimate is unbiased for ``diag(X^T X) / N`` on a quadratic loss, so
    its posterior precision ``N h + delta`` settles near ``diag(A)`` (within 6 %: Monte Carlo
    noise and the small Riemannian correction) and the mean near the exact posterior mean."""
    x, y, delta, mean, prec = _blr()
    model = _linear()
    opt = IVON(model.parameters(), lr=0.05, ess=len(x), prior_precision=delta,
               betas=(0.9, 0.998), mc_samples=2, antithetic=True)  # fmt: skip
    torch.manual_seed(0)
    avg = _fit_blr(opt, model, x, y, 1500)
    torch.testing.assert_close(avg, mean, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(opt.posterior(model).precision, prec, rtol=0.06, atol=0)


def test_the_shared_vocabulary_means_the_same_posterior():
    """``VOGN(ess=N, prior_precision=delta, hess_init=h0)`` and ``IVON(ess=N,
    prior_precision=delta, hess_init=h0)`` start from one posterior: precision ``N h0 +
    delta`` (written out here), mean the weights; the priors are both ``N(0, 1 / delta)``."""
    n, delta, h0 = 16, 2.5, 0.3
    model = _mlp()
    vogn = VOGN(model, lr=0.05, ess=n, prior_precision=delta, hess_init=h0)
    ivon = IVON(model.parameters(), lr=0.1, ess=n, prior_precision=delta, hess_init=h0)
    p = sum(q.numel() for q in model.parameters())
    want = torch.full((p,), n * h0 + delta)
    torch.testing.assert_close(vogn.posterior().precision, want)
    torch.testing.assert_close(ivon.posterior(model).precision, want)
    torch.testing.assert_close(vogn.prior().precision, torch.full((p,), delta))
    torch.testing.assert_close(ivon.prior(model).precision, torch.full((p,), delta))


def _run_ivon(steps=3, groups=False, **kw):
    model = _mlp()
    params = model.parameters()
    if groups:
        params = [{"params": model[0].parameters()}, {"params": model[2].parameters(), **groups}]
    opt = IVON(params, **kw)
    torch.manual_seed(4)
    for _ in range(steps):
        _step(opt, model)
    return [p.detach().clone() for p in model.parameters()], opt


def test_ivon_default_prior_is_the_papers_weight_decay():
    _, opt = _run_ivon(steps=0, lr=0.1, ess=50)
    assert opt.param_groups[0]["prior_precision"] == pytest.approx(1e-4 * 50)


def test_vogn_closure_of_any_model_finds_ggn_and_ef_by_brute_force():
    """A model outside the layer-capture set (a parameter used outside a layer) and the
    GGN: the closure's h equals loops over examples (ef: squared per-example gradients;
    ggn: ``sum_k (J_i^T L_ik)^2``, ``L`` from softmax's Hessian by hand), after one step
    from zero (``s = (1 - beta2) h``), with mc_samples=0 (h at the mean)."""

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = _mlp()
            self.scale = nn.Parameter(torch.tensor(1.3))

        def forward(self, x):
            return self.body(x) * self.scale

    xd = X.double()
    for curvature in ("ef", "ggn"):
        torch.manual_seed(0)
        model = Scaled().double()
        ref = copy.deepcopy(model)
        opt = VOGN(model, lr=0.05, ess=16, mc_samples=0, hess_approx=curvature)
        opt.step(lambda opt=opt, model=model: _mean_loss_backward(opt, model, xd))
        rows = []
        for i in range(len(xd)):
            f = ref(xd[i : i + 1])[0]
            jac = torch.stack([
                torch.cat([g.reshape(-1) for g in torch.autograd.grad(f[c], list(ref.parameters()),
                                                                      retain_graph=True)])
                for c in range(3)
            ])  # fmt: skip
            p = torch.softmax(f.detach(), 0)
            if curvature == "ef":
                r = p - F.one_hot(Y[i], 3).double()
                rows.append((jac.T @ r).pow(2))
            else:
                hess = torch.diag(p) - torch.outer(p, p)
                rows.append(torch.einsum("cp,cd,dp->p", jac, hess, jac))
        h = torch.stack(rows).mean(0)
        torch.testing.assert_close(_hess(opt), (1 - 0.999) * h, rtol=1e-9, atol=1e-14)


def test_vogn_group_prior_precision_edited_mid_run_is_the_prior_of_the_next_step():
    """A VOGN group's ``prior_precision`` edited between steps becomes the prior precision
    of that group's parameters: the next step is that of a VOGN whose state holds it (bit
    for bit), and not the step without the edit."""
    xd = X.double()
    model = _mlp().double()
    body, head = list(model[0].parameters()), list(model[2].parameters())
    opt = VOGN([{"params": body}, {"params": head}], model=model, lr=0.05, ess=16,
               prior_precision=2.0)  # fmt: skip
    for _ in range(2):
        opt.step(lambda: _mean_loss_backward(opt, model, xd))
    saved = copy.deepcopy(opt.state_dict())
    twins = []
    for delta_head in (7.0, 2.0):
        m = _mlp().double()
        m.load_state_dict(model.state_dict())
        o = VOGN([{"params": list(m[0].parameters())}, {"params": list(m[2].parameters())}],
                 model=m, lr=0.05, ess=16)  # fmt: skip
        state = copy.deepcopy(saved)
        for i in (2, 3):  # the head's weight and bias
            state["state"][i]["prior_precision"].fill_(delta_head)
        o.load_state_dict(state)
        twins.append((o, m))
    opt.param_groups[1]["prior_precision"] = 7.0
    for o, m in [(opt, model), *twins]:
        torch.manual_seed(5)
        o.step(lambda o=o, m=m: _mean_loss_backward(o, m, xd))
    (fresh, m_fresh), (_, m_unedited) = twins
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), m_fresh.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), m_unedited.parameters()))
    torch.testing.assert_close(opt.prior().precision, fresh.prior().precision, rtol=0, atol=0)


def test_vogn_groups_in_another_order_than_the_model_find_the_same_curvature():
    """Groups listed head first (the flat state in group order, the model's calls in its
    own order): the closure's per-example curvature is put in the groups' order, so the
    steps are those of ``VOGN(model)`` (no draws: ``mc_samples=0``)."""
    xd = X.double()
    m_a, m_b = _mlp().double(), _mlp().double()
    o_a = VOGN(m_a, lr=0.05, ess=16, mc_samples=0)
    groups = [{"params": list(m_b[2].parameters())}, {"params": list(m_b[0].parameters())}]
    o_b = VOGN(groups, model=m_b, lr=0.05, ess=16, mc_samples=0)
    for _ in range(2):
        o_a.step(lambda: _mean_loss_backward(o_a, m_a, xd))
        o_b.step(lambda: _mean_loss_backward(o_b, m_b, xd))
    for a, b in zip(m_a.parameters(), m_b.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)
    for p, q in zip(m_a.parameters(), m_b.parameters(), strict=True):
        torch.testing.assert_close(o_a.state[p]["hess"], o_b.state[q]["hess"], rtol=1e-13, atol=0)
