"""The runner's ``optimizer_state``: ``"reset"`` clears the optimizer's state (Adam's moment
estimates and step count) before each experience, keeps the step size, survives a resumed
run, and is refused for optimizers whose state is their posterior."""

from __future__ import annotations

import pytest
import torch
from avalanche.benchmarks.scenarios.deprecated.generators import tensors_benchmark
from avalanche.core import SupervisedPlugin
from avalanche.training import Naive
from avalanche.training.plugins import EvaluationPlugin
from fromp_bench.plugins import (
    _ResetOptimizerState,
    _RestoreOptimizer,
    _StepSchedule,
    optimizer_state_plugins,
)
from fromp_bench.runner import SettingsError, run
from torch import nn

from tests.conftest import quick_run_config


class _Record(SupervisedPlugin):
    """Adam's step count and first moment of the weight at the first iteration of each
    experience (before the step) and after its last one."""

    def __init__(self) -> None:
        super().__init__()
        self.first: list[tuple[float, torch.Tensor | None]] = []
        self.last: list[float] = []
        self.lr: list[float] = []

    def before_training_iteration(self, strategy, *args, **kwargs) -> None:
        if strategy.clock.train_exp_iterations == 0:
            st = strategy.optimizer.state.get(strategy.model.weight, {})
            m = st.get("exp_avg")
            self.first.append((float(st.get("step", 0)), None if m is None else m.clone()))

    def after_training_iteration(self, strategy, *args, **kwargs) -> None:
        self.lr.append(strategy.optimizer.param_groups[0]["lr"])

    def after_training_exp(self, strategy, *args, **kwargs) -> None:
        self.last.append(float(strategy.optimizer.state[strategy.model.weight]["step"]))


def _experience(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.arange(n) % 3


def _train(
    plugins: list[SupervisedPlugin], lr: float = 0.05, shuffle: bool = True
) -> tuple[_Record, nn.Linear]:
    # three experiences of 40, 24 and 16 examples in batches of 8: 5, 3 and 2 batches, 2 epochs
    bench = tensors_benchmark(
        [_experience(40, 0), _experience(24, 1), _experience(16, 3)],
        [_experience(8, 2)] * 3,
        task_labels=[0, 0, 0],
    )
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    rec = _Record()
    strategy = Naive(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=lr),
        criterion=nn.CrossEntropyLoss(),
        train_mb_size=8,
        train_epochs=2,
        plugins=[*plugins, rec],
        evaluator=EvaluationPlugin(loggers=[]),
    )
    for exp in bench.train_stream:
        strategy.train(exp, shuffle=shuffle)
    return rec, model


def test_reset_restarts_adams_state_at_every_experience():
    kept, w_kept = _train([])
    reset, w_reset = _train([_ResetOptimizerState()])
    # iterations per experience: 10, 6, 4; kept: the step count runs on over the stream
    assert kept.last == [10.0, 16.0, 20.0]
    assert reset.last == [10.0, 6.0, 4.0]
    # each experience starts from an empty state (no moment estimate before its first step)
    assert [s for s, _ in reset.first] == [0.0, 0.0, 0.0]
    assert all(m is None for _, m in reset.first)
    assert [s for s, _ in kept.first] == [0.0, 10.0, 16.0]
    assert kept.first[1][1] is not None and kept.first[1][1].abs().sum() > 0
    # the step size is kept; the first experience trains alike, the later ones do not
    assert reset.lr == kept.lr == [0.05] * 20
    assert not torch.equal(w_kept.weight, w_reset.weight)


def test_reset_equals_a_fresh_optimizer_per_experience():
    # the expected weights from a plain loop, without the plugin: a new Adam for each
    # experience on the same model (both loops unshuffled, so the same batches in order)
    _, w_reset = _train([_ResetOptimizerState()], shuffle=False)
    _, w_kept = _train([], shuffle=False)
    torch.manual_seed(0)
    model = nn.Linear(6, 3)
    for n, seed in ((40, 0), (24, 1), (16, 3)):
        x, y = _experience(n, seed)
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        for _ in range(2):
            for i in range(0, n, 8):
                opt.zero_grad()
                nn.functional.cross_entropy(model(x[i : i + 8]), y[i : i + 8]).backward()
                opt.step()
    torch.testing.assert_close(w_reset.weight, model.weight, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(w_kept.weight, model.weight, rtol=1e-4, atol=1e-5)


def test_reset_comes_after_a_restored_state_and_keeps_the_cosine_step():
    # a resumed run loads the checkpointed state, then the reset clears it, as the
    # uninterrupted run clears its own state at the same experience
    restore = _RestoreOptimizer()
    model = nn.Linear(6, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    restore.pending = opt.state_dict()
    rec, _ = _train([restore, _StepSchedule(0.05), _ResetOptimizerState()])
    assert [s for s, _ in rec.first] == [0.0, 0.0, 0.0]
    assert rec.lr[0] == pytest.approx(0.05) and rec.lr[9] < 0.05 * 0.03


def test_names_and_optimizers_are_checked():
    assert optimizer_state_plugins("keep", "adam") == []
    (plugin,) = optimizer_state_plugins("reset", "sgd")
    assert isinstance(plugin, _ResetOptimizerState)
    with pytest.raises(ValueError, match="optimizer_state must be one of keep, reset"):
        optimizer_state_plugins("clear", "adam")
    for name in ("vogn", "ivon"):
        with pytest.raises(ValueError, match=f"needs optimizer adam or sgd, got '{name}'"):
            optimizer_state_plugins("reset", name)


def _cfg(tmp_path, **kw):
    kw.setdefault("overrides", {"train_epochs": 2, "train_mb_size": 32, "optimizer_state": "reset"})
    return quick_run_config(tmp_path, **kw)


def test_runner_applies_it_and_a_resumed_run_equals_the_uninterrupted_one(tmp_path):
    reset = run(_cfg(tmp_path / "a"))
    assert reset["settings"]["optimizer_state"] == "reset"
    kept = run(_cfg(tmp_path / "k", overrides={"train_epochs": 2, "train_mb_size": 32}))
    assert "optimizer_state" not in kept["settings"]  # earlier runs keep their settings ids
    # the first task trains alike; a later one differs
    assert kept["accuracy_matrix"][0] == reset["accuracy_matrix"][0]
    assert kept["accuracy_matrix"] != reset["accuracy_matrix"]
    part = run(_cfg(tmp_path / "b", stop_after=2))
    assert not part["complete"]
    resumed = run(_cfg(tmp_path / "b", resume=True))
    assert resumed["accuracy_matrix"] == reset["accuracy_matrix"]
    assert resumed["per_task"] == reset["per_task"]


def test_runner_refuses_before_loading_data(tmp_path):
    none = str(tmp_path / "none")
    bad = _cfg(tmp_path, overrides={"optimizer_state": "drop"}, data_root=none)
    with pytest.raises(SettingsError, match="optimizer_state must be one of keep, reset"):
        run(bad)
    ivon = _cfg(
        tmp_path,
        overrides={"optimizer": "ivon", "optimizer_state": "reset"},
        data_root=none,
    )
    with pytest.raises(SettingsError, match="needs optimizer adam or sgd"):
        run(ivon)


def test_report_labels_a_run_without_the_key_as_keep():
    from fromp_bench.report import _labels, group_key

    runs = [
        {"strategy": "fromp", "settings": {"lr": 1e-3, "kwargs": {"tau": 0.3}}},
        {
            "strategy": "fromp",
            "settings": {"lr": 1e-3, "optimizer_state": "reset", "kwargs": {"tau": 0.3}},
        },
    ]
    labels = _labels({group_key(r): [r] for r in runs})
    assert sorted(labels.values()) == [
        "fromp [optimizer_state=keep]",
        "fromp [optimizer_state=reset]",
    ]
