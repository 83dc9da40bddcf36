"""EWC's consolidated penalty (one quadratic for all tasks) against the explicit per-task
sum in float64, after tasks 1, 2 and 3; an experience learnt again replaces its term;
wrapped models (``module.``, ``_orig_mod.``) keep their anchors; a renamed model, an infinite
lambda and labels outside the head are refused; the step cost does not grow with tasks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fromp import EWCMethod
from fromp.models import MultiHeadMLP

D = torch.float64


def _explicit(net: nn.Module, method: EWCMethod) -> torch.Tensor:
    """``(lambda / B) sum_t sum_p F_t (w - w*_t)^2`` written out, term by term (grown
    parameters penalised on their old entries)."""
    w = dict(net.named_parameters())
    total = torch.zeros((), dtype=D)
    for a, f in zip(method.anchors, method.importances):
        for n, fn in f.items():
            old = tuple(slice(0, k) for k in fn.shape)
            total = total + (fn * (w[n][old] - a[n]) ** 2).sum()
    return method.ewc_lambda / method.batch_size * total


def _data(task: int, n: int = 24):
    g = torch.Generator().manual_seed(10 + task)
    x = torch.randn(n, 6, generator=g, dtype=D)
    return x, torch.randint(0, 3, (n,), generator=g)


def _train(net, x, y, task, steps=5):
    opt = torch.optim.SGD(net.parameters(), lr=0.2)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(net(x, task=task), y).backward()
        opt.step()


@pytest.mark.parametrize("fisher", ["empirical", "exact"])
def test_consolidated_penalty_and_gradient_equal_the_per_task_sum_after_tasks_1_2_3(fisher):
    torch.manual_seed(0)
    net = MultiHeadMLP(6, (5,), n_heads=3, head_size=3).double()
    method = EWCMethod(ewc_lambda=7.0, fisher=fisher)
    for task in range(3):
        x, y = _data(task)
        _train(net, x, y, task)
        method.learn_task(net, x, y, task)
        with torch.no_grad():  # move away from the last anchor
            for p in net.parameters():
                p.add_(0.05 * torch.randn_like(p))
        got = method.penalty(net)
        ref = _explicit(net, method)
        assert float(ref.detach()) > 0
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
        g_got = torch.autograd.grad(got, list(net.parameters()), allow_unused=True)
        g_ref = torch.autograd.grad(_explicit(net, method), list(net.parameters()),
                                    allow_unused=True)  # fmt: skip
        left_out = 0
        for a, b in zip(g_got, g_ref):
            if a is None:  # a parameter of zero importance (a head no task used): left out
                assert b is None or not b.any()
                left_out += b is not None
            elif b is None:
                assert not a.any()
            else:
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        left = {n for n, v in method._terms(net).curvature.items()}
        used = {f"heads.{t}.{k}" for t in range(task + 1) for k in ("weight", "bias")}
        assert {n for n in left if n.startswith("heads.")} == used
        assert left_out == 2 * (3 - task - 1)  # the heads of tasks not yet learnt
    assert len(method.anchors) == 3


def test_consolidated_penalty_with_a_grown_head_matches_per_task_sum():
    """A parameter that grew (new output units) is penalised on its old entries only."""
    torch.manual_seed(0)
    small = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    x = torch.randn(20, 4, dtype=D)
    y = torch.randint(0, 2, (20,))
    method = EWCMethod(ewc_lambda=3.0, fisher="exact")
    method.learn_task(small, x, y, None)
    big = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 4)).double()
    with torch.no_grad():
        big[0].load_state_dict(small[0].state_dict())
        big[2].weight[:2] = small[2].weight + 0.1
        big[2].bias[:2] = small[2].bias - 0.1
    method.learn_task(big, x, torch.randint(0, 4, (20,)), None)
    with torch.no_grad():
        for p in big.parameters():
            p.add_(0.03)
    torch.testing.assert_close(method.penalty(big), _explicit(big, method), rtol=1e-12, atol=0)


@pytest.mark.parametrize("mode", ["separate", "online"])
def test_an_experience_learnt_again_replaces_its_term(mode):
    torch.manual_seed(0)
    net = MultiHeadMLP(6, (5,), n_heads=2, head_size=3).double()
    x0, y0 = _data(0)
    x1, y1 = _data(1)
    once = EWCMethod(ewc_lambda=5.0, fisher="exact", mode=mode, decay_factor=0.5)
    twice = EWCMethod(ewc_lambda=5.0, fisher="exact", mode=mode, decay_factor=0.5)
    once.learn_task(net, x0, y0, 0, experience=0)
    twice.learn_task(net, x0, y0, 0, experience=0)
    _train(net, x1, y1, 1)
    twice.learn_task(net, x1, y1, 1, experience=1)  # learnt, then learnt again
    _train(net, x1, y1, 1)
    once.learn_task(net, x1, y1, 1, experience=1)
    twice.learn_task(net, x1, y1, 1, experience=1)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.1)
    assert len(twice.anchors) == len(once.anchors) == (2 if mode == "separate" else 1)
    assert twice.task_count == once.task_count == 2
    torch.testing.assert_close(twice.penalty(net), once.penalty(net), rtol=1e-12, atol=0)
    # without a key every call is a new experience (the earlier behaviour)
    fresh = EWCMethod(ewc_lambda=5.0, fisher="exact")
    fresh.learn_task(net, x0, y0, 0)
    fresh.learn_task(net, x0, y0, 0)
    assert len(fresh.anchors) == 2


def test_state_dict_keeps_the_experience_keys():
    torch.manual_seed(0)
    net = MultiHeadMLP(6, (5,), n_heads=2, head_size=3).double()
    x0, y0 = _data(0)
    m = EWCMethod(ewc_lambda=2.0, fisher="exact")
    m.learn_task(net, x0, y0, 0, experience=4)
    m2 = EWCMethod(ewc_lambda=2.0, fisher="exact")
    m2.load_state_dict(m.state_dict())
    m2.learn_task(net, x0, y0, 0, experience=4)
    assert len(m2.anchors) == 1 and m2.experiences == [4]


class _Wrap(nn.Module):
    def __init__(self, inner: nn.Module, attr: str) -> None:
        super().__init__()
        setattr(self, attr, inner)
        self.attr = attr

    def forward(self, x):
        return getattr(self, self.attr)(x)


@pytest.mark.parametrize("attr", ["module", "_orig_mod"])
def test_penalty_of_a_wrapped_model_is_the_plain_penalty(attr):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    x = torch.randn(40, 4)
    y = (x[:, 0] > 0).long()
    e = EWCMethod(ewc_lambda=100.0)
    e.learn_task(net, x, y, None)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.3)
    plain = e.penalty(net)
    assert float(plain) > 0
    torch.testing.assert_close(e.penalty(_Wrap(net, attr)), plain)
    # learnt on the wrapped model, applied to the plain one
    e2 = EWCMethod(ewc_lambda=100.0)
    torch.manual_seed(1)
    e2.learn_task(_Wrap(net, attr), x, y, None)
    assert set(e2.anchors[0]) == {n for n, _ in net.named_parameters()}


def test_penalty_of_a_renamed_model_is_refused_not_zero():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    x = torch.randn(40, 4)
    e = EWCMethod(ewc_lambda=100.0)
    e.learn_task(net, x, (x[:, 0] > 0).long(), None)
    other = _Wrap(net, "backbone")
    with pytest.raises(ValueError, match="none of the"):
        e.penalty(other)


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -1.0, True])
def test_bad_ewc_lambda_refused(bad):
    with pytest.raises(ValueError, match="ewc_lambda"):
        EWCMethod(ewc_lambda=bad)


@pytest.mark.parametrize(("kw", "name"), [({"max_examples": 2.5}, "max_examples"),
                                          ({"chunk_size": 0}, "chunk_size"),
                                          ({"fisher_samples": 0}, "fisher_samples")])  # fmt: skip
def test_bad_settings_refused(kw, name):
    with pytest.raises(ValueError, match=name):
        EWCMethod(ewc_lambda=1.0, **kw)


def test_empirical_fisher_labels_outside_the_head_refused_naming_y():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    e = EWCMethod(ewc_lambda=1.0, fisher="empirical")
    with pytest.raises(ValueError, match="y holds label 5"):
        e.learn_task(net, torch.randn(8, 4), torch.full((8,), 5), None)
    with pytest.raises(ValueError, match="y holds label -1"):
        e.learn_task(net, torch.randn(8, 4), torch.full((8,), -1), None)
    assert not e.anchors
