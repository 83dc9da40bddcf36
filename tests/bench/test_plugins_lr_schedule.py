"""The runner's ``lr_schedule`` and ``lr_warmup``: a cosine (or constant) step size within each
experience after an optional linear warm-up, restarted at the next, that survives a resumed
run and refuses unknown names and impossible warm-ups before any work."""

from __future__ import annotations

import math

import pytest
import torch
from avalanche.benchmarks.scenarios.deprecated.generators import tensors_benchmark
from avalanche.core import SupervisedPlugin
from avalanche.training import Naive
from avalanche.training.plugins import EvaluationPlugin
from fromp_bench.plugins import _StepSchedule, lr_schedule_plugins
from fromp_bench.runner import SettingsError, run
from torch import nn

from tests.conftest import quick_run_config


class _Record(SupervisedPlugin):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[float]] = []

    def before_training_exp(self, strategy, *args, **kwargs) -> None:
        self.seen.append([])

    def after_training_iteration(self, strategy, *args, **kwargs) -> None:
        self.seen[-1].append(strategy.optimizer.param_groups[0]["lr"])


def _experience(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.arange(n) % 3


def test_cosine_within_each_experience_restarted_at_the_next():
    # experiences of 40 and 24 examples in batches of 8: 5 and 3 batches, 2 epochs each
    bench = tensors_benchmark(
        [_experience(40, 0), _experience(24, 1)], [_experience(8, 2)] * 2, task_labels=[0, 0]
    )
    model = nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.4)
    rec = _Record()
    strategy = Naive(
        model=model,
        optimizer=opt,
        criterion=nn.CrossEntropyLoss(),
        train_mb_size=8,
        train_epochs=2,
        plugins=[_StepSchedule(0.4), rec],
        evaluator=EvaluationPlugin(loggers=[]),
    )
    for exp in bench.train_stream:
        strategy.train(exp)
    for got, total in zip(rec.seen, (10, 6), strict=True):
        want = [0.2 * (1 + math.cos(math.pi * t / total)) for t in range(total)]
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    # the first step of each experience at the full step size, the last one close to 0
    assert rec.seen[1][0] == pytest.approx(0.4) and rec.seen[1][-1] < 0.4 * 0.07


def _train_two(plugin: SupervisedPlugin) -> list[list[float]]:
    """The step sizes of every iteration of two experiences (10 and 6 iterations)."""
    bench = tensors_benchmark(
        [_experience(40, 0), _experience(24, 1)], [_experience(8, 2)] * 2, task_labels=[0, 0]
    )
    model = nn.Linear(6, 3)
    rec = _Record()
    strategy = Naive(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.4),
        criterion=nn.CrossEntropyLoss(),
        train_mb_size=8,
        train_epochs=2,
        plugins=[plugin, rec],
        evaluator=EvaluationPlugin(loggers=[]),
    )
    for exp in bench.train_stream:
        strategy.train(exp)
    return rec.seen


def test_warmup_rises_linearly_then_follows_the_cosine_over_the_rest():
    seen = _train_two(_StepSchedule(0.4, warmup=0.25))
    # 10 iterations: W = floor(2.5) = 2 warm-up steps, then the cosine over the other 8
    want = [0.2, 0.4] + [0.2 * (1 + math.cos(math.pi * s / 8)) for s in range(8)]
    assert seen[0] == pytest.approx(want, rel=1e-12, abs=1e-15)
    # 6 iterations: W = max(1, floor(1.5)) = 1 (the full step size at once), cosine over 5
    want = [0.4] + [0.2 * (1 + math.cos(math.pi * s / 5)) for s in range(5)]
    assert seen[1] == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_warmup_with_the_constant_schedule_then_stays_at_lr():
    (plugin,) = lr_schedule_plugins("constant", 0.4, 0.3)
    seen = _train_two(plugin)
    assert seen[0] == pytest.approx([0.4 / 3, 0.8 / 3] + [0.4] * 8, rel=1e-12)
    assert seen[1] == pytest.approx([0.4] * 6, rel=1e-12)


@pytest.mark.parametrize("bad", [1.0, -0.1, "0.1", True, float("nan")])
def test_impossible_warmups_are_refused(bad):
    with pytest.raises(ValueError, match=r"lr_warmup must be a number in \[0, 1\)"):
        lr_schedule_plugins("cosine", 1e-3, bad)


def test_constant_adds_no_plugin_and_unknown_names_are_refused():
    assert lr_schedule_plugins("constant", 1e-3) == []
    (plugin,) = lr_schedule_plugins("cosine", 1e-3)
    assert isinstance(plugin, _StepSchedule) and plugin.lr == 1e-3 and plugin.warmup == 0
    with pytest.raises(ValueError, match="lr_schedule must be one of constant, cosine"):
        lr_schedule_plugins("linear", 1e-3)


def _cfg(tmp_path, **kw):
    kw.setdefault("overrides", {"train_epochs": 2, "train_mb_size": 32, "lr_schedule": "cosine"})
    return quick_run_config(tmp_path, **kw)


def test_runner_applies_it_and_a_resumed_run_follows_it(tmp_path):
    cosine = run(_cfg(tmp_path / "a"))
    assert cosine["settings"]["lr_schedule"] == "cosine"
    constant = run(_cfg(tmp_path / "c", overrides={"train_epochs": 2, "train_mb_size": 32}))
    assert "lr_schedule" not in constant["settings"]  # earlier runs keep their settings ids
    assert constant["accuracy_matrix"] != cosine["accuracy_matrix"]
    # the checkpointed optimizer holds the last (near-zero) step size: the resumed run must
    # restart the schedule, not train the remaining experiences at that step size
    part = run(_cfg(tmp_path / "b", stop_after=2))
    assert not part["complete"]
    resumed = run(_cfg(tmp_path / "b", resume=True))
    assert resumed["accuracy_matrix"] == cosine["accuracy_matrix"]
    assert resumed["per_task"] == cosine["per_task"]


def test_runner_applies_the_warmup_and_a_resumed_run_follows_it(tmp_path):
    over = {"train_epochs": 2, "train_mb_size": 32, "lr_schedule": "cosine", "lr_warmup": 0.2}
    warm = run(_cfg(tmp_path / "w", overrides=over))
    assert warm["settings"]["lr_warmup"] == 0.2
    cosine = run(_cfg(tmp_path / "c"))
    assert "lr_warmup" not in cosine["settings"]  # earlier runs keep their settings ids
    assert warm["accuracy_matrix"] != cosine["accuracy_matrix"]
    assert not run(_cfg(tmp_path / "r", overrides=over, stop_after=2))["complete"]
    resumed = run(_cfg(tmp_path / "r", overrides=over, resume=True))
    assert resumed["accuracy_matrix"] == warm["accuracy_matrix"]


def test_runner_refuses_an_impossible_warmup_before_loading_data(tmp_path):
    cfg = _cfg(tmp_path, overrides={"lr_warmup": 1.5}, data_root=str(tmp_path / "none"))
    with pytest.raises(SettingsError, match="lr_warmup must be a number in"):
        run(cfg)


def test_runner_refuses_an_unknown_schedule_before_loading_data(tmp_path):
    cfg = _cfg(tmp_path, overrides={"lr_schedule": "step"}, data_root=str(tmp_path / "none"))
    with pytest.raises(SettingsError, match="lr_schedule must be one of constant, cosine"):
        run(cfg)


def test_report_labels_a_run_without_the_key_as_constant():
    from fromp_bench.report import _labels, group_key

    runs = [
        {"strategy": "fromp", "settings": {"lr": 1e-3, "kwargs": {"tau": 0.3}}},
        {
            "strategy": "fromp",
            "settings": {"lr": 1e-3, "lr_schedule": "cosine", "kwargs": {"tau": 0.3}},
        },
    ]
    labels = _labels({group_key(r): [r] for r in runs})
    assert sorted(labels.values()) == [
        "fromp [lr_schedule=constant]",
        "fromp [lr_schedule=cosine]",
    ]
