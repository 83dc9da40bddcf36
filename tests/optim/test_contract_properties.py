"""Property-based tests (hypothesis) of the optimizers' hyperparameters, set after
construction as a scheduler or an edit of ``param_groups`` would: accepted values never write
NaN into the weights; refused ones leave the weights and the optimizer state unchanged."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

from fromp import IVON, VOGN

SETTINGS = settings(max_examples=25, deadline=None)
X = torch.randn(12, 4, generator=torch.Generator().manual_seed(0))
Y = torch.randint(0, 3, (12,), generator=torch.Generator().manual_seed(1))

#: any float, the special values included
ANY = st.one_of(
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1.0, -1.0, 1.5]),
    st.floats(-10.0, 10.0),
)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def _closure(opt, model):
    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(X), Y)
        loss.backward()
        return loss

    return closure


def _snapshot(opt, model):
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return a == b


def _ivon_valid(h) -> bool:
    return (
        math.isfinite(h["lr"]) and h["lr"] >= 0
        and 0 <= h["betas"][0] < 1 and 0 <= h["betas"][1] < 1
        and math.isfinite(h["prior_precision"]) and h["prior_precision"] >= 0
        and math.isfinite(h["ess"]) and h["ess"] > 0
        and h["ess"] ** -0.5 <= torch.finfo(torch.float32).max  # sigma's scale 1/sqrt(N)
        and h["prior_precision"] / h["ess"] <= torch.finfo(torch.float32).max  # delta / N
        and math.isfinite(h["hess_init"]) and h["hess_init"] > 0
    )  # fmt: skip


def _check_step(opt, model, valid, step):
    weights, state = _snapshot(opt, model)
    if valid:
        step()
        assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    else:
        with pytest.raises(ValueError):
            step()
        assert all(torch.equal(p.detach(), w) for p, w in zip(model.parameters(), weights))
        assert _same(opt.state_dict()["state"], state["state"])


@SETTINGS
@given(
    lr=st.one_of(ANY, st.floats(1e-4, 2.0)),
    beta1=st.one_of(ANY, st.floats(0.0, 0.999)),
    beta2=st.one_of(ANY, st.floats(0.5, 0.99999)),
    prior_precision=st.one_of(ANY, st.floats(0.0, 100.0)),
    ess=st.one_of(ANY, st.floats(1.0, 1e4)),
    hess_init=st.one_of(ANY, st.floats(1e-3, 10.0)),
)
def test_ivon_hyperparameters_never_nan_and_refusals_change_nothing(
    lr, beta1, beta2, prior_precision, ess, hess_init
):
    model = _mlp()
    opt = IVON(model.parameters(), lr=0.1, ess=12)
    opt.step(_closure(opt, model))
    h = dict(lr=lr, betas=(beta1, beta2), prior_precision=prior_precision, ess=ess,
             hess_init=hess_init)  # fmt: skip
    opt.param_groups[0].update(h)
    _check_step(opt, model, _ivon_valid(h), lambda: opt.step(_closure(opt, model)))


@SETTINGS
@given(
    lr=st.one_of(ANY, st.floats(1e-4, 1.0)),
    beta1=st.one_of(ANY, st.floats(0.0, 0.999)),
    beta2=st.one_of(ANY, st.floats(0.5, 0.9999)),
    kl_weight=st.one_of(ANY, st.floats(1e-3, 10.0)),
)
def test_vogn_hyperparameters_never_nan_and_refusals_change_nothing(lr, beta1, beta2, kl_weight):
    # a kl_weight so small that N / kl_weight overflows float32 has its own test below
    assume(not (0 < kl_weight < 1e-30))
    model = _mlp()
    opt = VOGN(model, lr=0.05, ess=12, hess_init=1e-2)
    opt.step(_closure(opt, model))
    opt.param_groups[0].update(lr=lr, betas=(beta1, beta2), kl_weight=kl_weight)
    valid = (
        math.isfinite(lr) and lr >= 0
        and 0 <= beta1 < 1 and 0 <= beta2 < 1
        and math.isfinite(kl_weight) and kl_weight > 0
    )  # fmt: skip
    _check_step(opt, model, valid, lambda: opt.step(_closure(opt, model)))


@SETTINGS
@given(beta2=ANY, lr=ANY)
def test_loading_a_state_with_any_hyperparameters_is_all_or_nothing(beta2, lr):
    model = _mlp()
    opt = IVON(model.parameters(), lr=0.1, ess=12)
    opt.step(_closure(opt, model))
    state = copy.deepcopy(opt.state_dict())
    state["param_groups"][0].update(betas=(0.9, beta2), lr=lr)
    before = copy.deepcopy(opt.state_dict())
    valid = 0 <= beta2 < 1 and math.isfinite(lr) and lr >= 0
    if valid:
        opt.load_state_dict(state)
        assert opt.param_groups[0]["betas"] == (0.9, beta2)
    else:
        with pytest.raises(ValueError):
            opt.load_state_dict(state)
        assert _same(opt.state_dict(), before)


def test_vogn_kl_weight_that_overflows_the_precision_is_refused():
    """``N / kl_weight`` beyond float32 (kl_weight 1e-58, found by the property test above):
    refused naming kl_weight, the weights and the state unchanged."""
    model = _mlp()
    opt = VOGN(model, lr=0.05, ess=12, hess_init=1e-2)
    opt.step(_closure(opt, model))
    before = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict())
    opt.param_groups[0].update(kl_weight=1.3e-58)
    with pytest.raises(ValueError, match=r"kl_weight=1\.3e-58 makes the posterior precision"):
        opt.step(_closure(opt, model))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    after = opt.state_dict()
    assert all(
        torch.equal(after["state"][k], v) if isinstance(v, torch.Tensor) else True
        for k, v in state["state"].items()
    )
