"""The runner's ``lr_schedule``: a cosine step size within each experience, restarted at the
next, that survives a resumed run and refuses unknown names before any work."""

from __future__ import annotations

import math

import pytest
import torch
from avalanche.benchmarks.scenarios.deprecated.generators import tensors_benchmark
from avalanche.core import SupervisedPlugin
from avalanche.training import Naive
from avalanche.training.plugins import EvaluationPlugin
from conftest import quick_run_config
from fromp_bench.plugins import _CosineLR, lr_schedule_plugins
from fromp_bench.runner import SettingsError, run
from torch import nn


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
        plugins=[_CosineLR(0.4), rec],
        evaluator=EvaluationPlugin(loggers=[]),
    )
    for exp in bench.train_stream:
        strategy.train(exp)
    for got, total in zip(rec.seen, (10, 6), strict=True):
        want = [0.2 * (1 + math.cos(math.pi * t / total)) for t in range(total)]
        assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    # the first step of each experience at the full step size, the last one close to 0
    assert rec.seen[1][0] == pytest.approx(0.4) and rec.seen[1][-1] < 0.4 * 0.07


def test_constant_adds_no_plugin_and_unknown_names_are_refused():
    assert lr_schedule_plugins("constant", 1e-3) == []
    (plugin,) = lr_schedule_plugins("cosine", 1e-3)
    assert isinstance(plugin, _CosineLR) and plugin.lr == 1e-3
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
