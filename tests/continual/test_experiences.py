"""One task counter, ``task_count``, on every continual method and optimizer plugin, with
one meaning (the distinct experiences learnt), and one bookkeeping of the experience keys
(:mod:`fromp.continual.experiences`): the keys and the counter after tasks 1, 2 and 3 with an
experience learnt again, a state round trip, and no ``tasks_done`` name left."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fromp import FROMPMethod
from fromp.continual.ewc import EWCMethod
from fromp.continual.experiences import add_experience, experience_key, forget_experience
from fromp.continual.vcl import VCLMethod


def _task(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(24, 4, generator=g), torch.arange(24) % 3


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def _shift(net: nn.Module, by: float) -> None:
    """Move the weights, as training on a task would (each learnt entry then differs)."""
    with torch.no_grad():
        for p in net.parameters():
            p.add_(by)


# ------------------------------------------------------------------- the shared functions


def test_experience_key_defaults_to_the_next_key_and_checks_given_ones():
    assert experience_key([]) == 0
    assert experience_key([3, 1]) == 4  # after the largest, not after the count
    assert experience_key([3, 1], 1) == 1
    assert experience_key([], np.int64(7)) == 7 and type(experience_key([], np.int64(7))) is int
    for bad in (True, 1.0, "1", [1]):
        with pytest.raises(ValueError, match="experience must be an int key or None, got"):
            experience_key([], bad)


def test_forget_and_add_keep_the_keys_in_the_order_of_the_entries():
    keys: list[int] = []
    assert add_experience(keys, 0) == 1 and add_experience(keys, 1) == 2
    assert add_experience(keys, 2) == 3 and keys == [0, 1, 2]
    assert forget_experience(keys, 5) is None and keys == [0, 1, 2]  # a new key
    assert forget_experience(keys, 1) == 1 and keys == [0, 2]  # its entry was at 1
    assert add_experience(keys, 1) == 3 and keys == [0, 2, 1]
    assert forget_experience(keys, 1) == 2 and keys == [0, 2]  # the last one


# ------------------------------------------------------------------------------- FROMP


def test_fromp_keys_and_counter_over_three_tasks_with_one_learnt_again():
    net = _net()
    m = FROMPMethod(n_points=6, kernel="identity")
    inputs = []  # each call's memorable inputs (the tasks' data differ: they name the set)

    def held() -> list[int]:
        """Which call's memorable set each of the regulariser's sets is."""
        return [
            next(i for i, x in enumerate(inputs) if torch.equal(x, s.inputs))
            for s in m.regularizer.memories
        ]

    for step, key in enumerate([None, None, 0, None]):  # the third call learns 0 again
        _shift(net, 0.1)
        m.learn_task(net, *_task(step), None, experience=key)
        inputs.append(m.regularizer.memories[-1].inputs.clone())
        want_keys = [[0], [0, 1], [1, 0], [1, 0, 2]][step]
        assert m.experiences == want_keys and m.task_count == len(want_keys)
        # experience 0's first set is dropped, 1's kept in place, 0's new one last
        assert held() == [[0], [0, 1], [1, 2], [1, 2, 3]][step]


def test_fromp_state_round_trip_and_no_former_name():
    net = _net()
    m = FROMPMethod(n_points=6, kernel="identity")
    for step in range(3):
        _shift(net, 0.1)
        m.learn_task(net, *_task(step), None)
    m.learn_task(net, *_task(9), None, experience=1)
    state = m.state_dict()
    assert state["task_count"] == 3 and "tasks_done" not in state
    assert state["experiences"] == [0, 2, 1]
    back = FROMPMethod(n_points=6, kernel="identity")
    back.load_state_dict(state)
    assert back.task_count == 3 and back.experiences == [0, 2, 1]
    back.learn_task(net, *_task(3), None)  # the next key continues after the loaded ones
    assert back.experiences == [0, 2, 1, 3] and back.task_count == 4
    old = {k: v for k, v in state.items() if k != "task_count"} | {"tasks_done": 3}
    with pytest.raises(ValueError, match=r"missing keys \['task_count'\]"):
        FROMPMethod(n_points=6, kernel="identity").load_state_dict(old)
    assert not hasattr(m, "tasks_done")


def test_fromp_bad_key_refused_before_any_change():
    net = _net()
    m = FROMPMethod(n_points=6, kernel="identity")
    with pytest.raises(ValueError, match="experience must be an int key"):
        m.learn_task(net, *_task(0), None, experience="a")  # type: ignore[arg-type]
    assert m.task_count == 0 and m.experiences == [] and len(m.regularizer) == 0


# --------------------------------------------------------------------------------- EWC


def test_ewc_keys_and_counter_over_three_tasks_with_one_learnt_again():
    net = _net()
    m = EWCMethod(ewc_lambda=1.0, fisher="exact")
    anchors = []
    for step, key in enumerate([None, None, 0, None]):
        _shift(net, 0.1)
        m.learn_task(net, *_task(step), None, experience=key)
        anchors.append(m.anchors[-1])
        want_keys = [[0], [0, 1], [1, 0], [1, 0, 2]][step]
        assert m.experiences == want_keys and m.task_count == len(want_keys)
        assert len(m.anchors) == len(m.importances) == len(want_keys)
    kept = [anchors[1], anchors[2], anchors[3]]  # 0's first anchor replaced, in order
    assert len(m.anchors) == 3 and all(a is b for a, b in zip(m.anchors, kept))
    back = EWCMethod(ewc_lambda=1.0, fisher="exact")
    back.load_state_dict(m.state_dict())
    assert back.task_count == 3 and back.experiences == [1, 0, 2]
    torch.testing.assert_close(back.penalty(net), m.penalty(net))


def test_ewc_online_keys_and_counter():
    net = _net()
    m = EWCMethod(ewc_lambda=1.0, fisher="exact", mode="online", decay_factor=0.5)
    for step in range(3):
        _shift(net, 0.1)
        m.learn_task(net, *_task(step), None)
    assert m.experiences == [0, 1, 2] and m.task_count == 3 and len(m.anchors) == 1
    m.learn_task(net, *_task(2), None, experience=2)  # the last one again: replaced
    assert m.experiences == [0, 1, 2] and m.task_count == 3
    with pytest.warns(UserWarning, match="experience 0 learnt again after others"):
        m.learn_task(net, *_task(0), None, experience=0)
    assert m.experiences == [1, 2, 0] and m.task_count == 3


# ------------------------------------------------------------------------ one name


def test_every_method_counts_its_tasks_under_one_name():
    pytest.importorskip("avalanche")
    from fromp_avalanche import EWCPlugin, FROMPPlugin, IVONPlugin, VOGNPlugin

    for obj in (
        FROMPMethod(),
        EWCMethod(ewc_lambda=1.0),
        VCLMethod(_net()),
        FROMPPlugin().method,
        EWCPlugin(ewc_lambda=1.0).method,
        VOGNPlugin(),
        IVONPlugin(),
    ):
        assert obj.task_count == 0, type(obj).__name__


def test_vcl_and_the_optimizer_plugins_count_distinct_experiences():
    """An experience learnt again counts once in VCL and the optimizer plugins too (they
    counted calls before): VCL's keys, and a VOGN strategy training experience 0 twice."""
    from types import SimpleNamespace

    m = VCLMethod(_net(), train_samples=1)
    for key in (0, 1, 0):
        m.begin_task(m.model, task=None, experience=key, ess=24)
        m.learn_task(m.model, None, None, None)
    assert m.task_count == 2 and m.experiences == [1, 0]

    pytest.importorskip("avalanche")
    from fromp_avalanche import VOGNPlugin

    from fromp.posterior import DiagonalGaussian

    plugin = VOGNPlugin()
    for key in (0, 1, 0):
        q = DiagonalGaussian(torch.full((3,), float(key)), torch.ones(3))
        strategy = SimpleNamespace(experience=SimpleNamespace(current_experience=key))
        plugin._end_experience(strategy, q, lambda: None)
    assert plugin.task_count == 2 and plugin.experiences == [1, 0]
    assert [float(q.mean[0]) for q in plugin.posteriors] == [1.0, 0.0]
