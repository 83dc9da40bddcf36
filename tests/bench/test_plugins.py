"""The runner's guard and progress plugins: a NaN loss is found without reading the loss
on the host at every step (checked every ``every`` iterations and at the epoch's end, the
message naming the iterations), and progress written to a file is one line per task."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch
from fromp_bench.plugins import NonFiniteError, _Guard, _Progress


def _strategy():
    clock = SimpleNamespace(train_epoch_iterations=0, train_exp_epochs=0)
    exp = SimpleNamespace(current_experience=1)
    model = torch.nn.Linear(2, 2)
    return SimpleNamespace(clock=clock, loss=None, experience=exp, model=model,
                           train_epochs=1, dataloader=[0] * 4)  # fmt: skip


def _iterate(guard, strategy, losses):
    guard.before_training_epoch(strategy)
    for i, value in enumerate(losses):
        strategy.loss = torch.tensor(value)
        strategy.clock.train_epoch_iterations = i
        guard.after_training_iteration(strategy)
    strategy.clock.train_epoch_iterations = len(losses)
    guard.after_training_epoch(strategy)


def test_guard_finds_a_nan_between_checks_and_names_the_iterations():
    s = _strategy()
    with pytest.raises(NonFiniteError, match=r"epoch 1, iteration 3-4"):
        _iterate(_Guard(every=2), s, [1.0, 1.0, float("nan"), 1.0, 1.0])
    # checked only at the epoch's end when `every` is larger than the epoch
    with pytest.raises(NonFiniteError, match="not finite"):
        _iterate(_Guard(every=50), _strategy(), [1.0, float("inf"), 1.0])
    _iterate(_Guard(every=2), _strategy(), [1.0, 2.0, 3.0])  # finite: no error


def test_guard_reads_the_device_flag_only_every_few_iterations(monkeypatch):
    reads = []
    real = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: reads.append(1) or real(t))
    _iterate(_Guard(every=10), _strategy(), [1.0] * 35)
    assert len(reads) == 4  # iterations 10, 20, 30, and the last 5 at the epoch's end


def test_progress_in_a_log_is_one_line_per_task():
    stream = io.StringIO()
    s = _strategy()
    p = _Progress("fromp/seed0", True, stream=stream)
    p.before_training_exp(s)
    for _ in range(4):
        s.loss = torch.tensor(0.5)
        p.after_training_iteration(s)
    p.after_training_exp(s)
    text = stream.getvalue()
    assert text.count("\n") == 1 and "\r" not in text
    assert "fromp/seed0 task 2: 4 iterations, last loss 0.5000" in text
    quiet = io.StringIO()
    q = _Progress("x", False, stream=quiet)
    q.before_training_exp(s)
    q.after_training_exp(s)
    assert quiet.getvalue() == ""
