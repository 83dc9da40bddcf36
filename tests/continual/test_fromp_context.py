"""FROMP's context term (``context_tau``): on each training mini-batch, ``1/2 mean_b
||g(x_b; w)_S - g(x_b; w_prev)_S||^2`` over the units ``S`` trained before the experience,
``w_prev`` the weights at the last ``learn_task``. Checked against a hand computation from a
snapshot of the network, after tasks 2 and 3, in a plain loop and through the Avalanche
plugin; batch-norm networks are compared at the batch's own statistics; the frozen copy is
saved, reloaded into a grown head and never trained."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from avalanche.benchmarks.scenarios.deprecated.generators import tensors_benchmark
from fromp_avalanche.fromp import FROMP
from torch import nn

from fromp import FROMPMethod
from tests.strategies.probe import LossProbe

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ORDER = [[4, 1], [0, 5], [2, 3]]  # classes per experience, one 6-way head


def _data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    means = 2.0 * torch.randn(6, 5, generator=g)

    def make(k: int, e: int):
        y = torch.tensor(ORDER[e])[torch.arange(k) % 2]
        return means[y] + 0.7 * torch.randn(k, 5, generator=g), y

    return [make(24, e) for e in range(3)], [make(10, e) for e in range(3)]


def _net(batch_norm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    norm = [nn.BatchNorm1d(8)] if batch_norm else []
    return nn.Sequential(nn.Linear(5, 8), *norm, nn.Tanh(), nn.Linear(8, 6))


def _expected(output, x, previous, units, function):
    """The term by hand: the snapshot evaluated with the batch's statistics."""
    prev = copy.deepcopy(previous).train()  # a throwaway copy: its buffers may move
    with torch.no_grad():
        old = prev(x)
    new = output
    if function == "probs":
        old, new = torch.softmax(old, -1), torch.softmax(new, -1)
    r = new[:, units] - old[:, units]
    return 0.5 * (r**2).sum(1).mean()


@pytest.mark.parametrize("function", ["probs", "logits"])
@pytest.mark.parametrize("batch_norm", [False, True])
def test_context_penalty_equals_hand_computation_after_tasks_2_and_3(function, batch_norm):
    """Killed bugs: the units of the current experience regularised (its classes are new),
    the copy taken at the wrong time (not the last learn_task), the copy evaluated with the
    running statistics while the training forward uses the batch's, a dropped 1/2 or mean."""
    train, _ = _data()
    net = _net(batch_norm)
    m = FROMPMethod(tau=1.0, n_points=4, function=function, context_tau=0.5)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for e, (x, y) in enumerate(train):
        if e > 0:
            snapshot = copy.deepcopy(net)
            units = sorted(c for cls in ORDER[:e] for c in cls)
            net.train()
            out = net(x)
            got = m.context_penalty(out, x, None)
            assert float(got) == pytest.approx(0.0, abs=1e-10)  # at w_prev: no change
            for _ in range(3):
                loss = F.cross_entropy(net(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            buffers = {k: v.clone() for k, v in m.previous.state_dict().items()}
            out = net(x)
            got = m.context_penalty(out, x, None)
            torch.testing.assert_close(got, _expected(out, x, snapshot, units, function))
            assert float(got) > 0
            got.backward()
            assert all(p.grad is None for p in m.previous.parameters())  # frozen
            for k, v in m.previous.state_dict().items():  # running buffers untouched
                torch.testing.assert_close(v, buffers[k])
        net.train()
        for _ in range(5):
            loss = F.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        m.learn_task(net, x, y, None)


def test_no_copy_and_zero_term_when_off_or_before_the_first_task():
    train, _ = _data()
    net = _net()
    off = FROMPMethod(n_points=4, context_tau=0.0)  # off (also the default)
    on = FROMPMethod(n_points=4, context_tau=1.0)
    x, y = train[0]
    assert float(on.context_penalty(net(x), x, None)) == 0.0  # nothing learnt yet
    off.learn_task(net, x, y, None)
    on.learn_task(net, x, y, None)
    assert off.previous is None and on.previous is not None
    assert float(off.context_penalty(net(x) + 1.0, x, None)) == 0.0


def test_state_round_trip_into_a_grown_head_and_refusals():
    """The frozen copy is saved; a fresh method rebuilds it into a model whose head has
    since grown (the saved units lead), and refuses to run before it is attached."""
    train, _ = _data()
    net = _net()
    m = FROMPMethod(n_points=4, function="logits", context_tau=1.0)
    for x, y in train[:2]:
        m.learn_task(net, x, y, None)
    state = copy.deepcopy(m.state_dict())
    x = train[2][0]
    out = net(x) + 0.3 * torch.randn(len(x), 6, generator=torch.Generator().manual_seed(1))
    expected = m.context_penalty(out, x, None)

    grown = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 9))
    with torch.no_grad():
        grown[0].load_state_dict(net[0].state_dict())
        grown[2].weight[:6] = net[2].weight
        grown[2].bias[:6] = net[2].bias
    again = FROMPMethod(n_points=4, function="logits", context_tau=1.0)
    again.load_state_dict(state)
    wide = torch.cat([out, torch.zeros(len(x), 3)], 1)
    with pytest.raises(RuntimeError, match="attach_previous"):
        again.context_penalty(wide, x, None)
    again.attach_previous(grown)
    torch.testing.assert_close(again.context_penalty(wide, x, None), expected)
    with pytest.raises(ValueError, match="context_tau"):
        FROMPMethod(n_points=4, function="logits", context_tau=2.0).load_state_dict(state)
    small = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4))
    fresh = FROMPMethod(n_points=4, function="logits", context_tau=1.0)
    fresh.load_state_dict(state)
    with pytest.raises(ValueError, match="leading block"):
        fresh.attach_previous(small)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_bad_context_tau_refused(bad):
    with pytest.raises(ValueError, match="context_tau must be a finite number >= 0"):
        FROMPMethod(context_tau=bad)
    with pytest.raises(TypeError, match="context_tau must be a number"):
        FROMPMethod(context_tau=True)


class _PenaltyProbe(LossProbe):
    """Also records FROMP's ``tau * R`` of the step (its plugin runs first)."""

    def before_backward(self, strategy, **kwargs):
        super().before_backward(strategy, **kwargs)
        self.steps[-1]["tau_r"] = float(strategy.plugin.method.last_terms.get("penalty", 0.0))


@pytest.mark.parametrize("tau", [0.0, 1.0])
def test_plugin_adds_context_tau_times_the_term_after_tasks_2_and_3(tau):
    """Through the Avalanche strategy: the loss handed to the backward pass is CE + tau * R
    + context_tau * term, the term by hand from a snapshot of the network after the
    previous experience (tau = 0: the context term alone; tau = 1: both, neither dropped)."""
    train, test = _data()
    net = _net()
    probe = _PenaltyProbe()
    strategy = FROMP(
        model=net,
        optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
        train_mb_size=8,
        train_epochs=1,
        eval_mb_size=50,
        evaluator=None,
        plugins=[probe],
        tau=tau,
        n_points=4,
        function="logits",
        context_tau=0.7,
        replay=False,  # the penalty and the context term alone (no coreset's loss)
    )
    bm = tensors_benchmark(train, test, task_labels=[0] * 3)
    snapshots = []
    for exp in bm.train_stream:
        strategy.train(exp)
        snapshots.append(copy.deepcopy(net))
    for e in (1, 2):
        units = sorted(c for cls in ORDER[:e] for c in cls)
        steps = [s for s in probe.steps if s["exp"] == e]
        assert len(steps) == 3
        for s in steps[1:]:  # the weights have moved since learn_task
            term = _expected(s["out"], s["x"], snapshots[e - 1], units, "logits")
            assert float(term) > 0
            assert (s["tau_r"] > 0) == (tau > 0)
            expected = s["ce"] + s["tau_r"] + 0.7 * float(term)
            assert s["loss"] == pytest.approx(expected, rel=1e-5)
