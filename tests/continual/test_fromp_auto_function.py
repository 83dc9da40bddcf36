"""FROMP's default ``function="auto"``: the function the penalty keeps is chosen at the first
``learn_task`` from the head's layout, the logits on one head that the first experience
fills (every later experience shares its classes: permuted MNIST) and on one head whose
classes arrive over the experiences (class-incremental, Avalanche's ``IncrementalClassifier``
too) with the coreset, the probabilities with a head per task or class-incremental without
the coreset. Once chosen it does not change, it is saved and
restored, and the penalty after tasks 1-3 is the one of the explicit choice."""

from __future__ import annotations

import warnings

import pytest
import torch
from avalanche.benchmarks.scenarios.deprecated.generators import tensors_benchmark
from avalanche.evaluation.metrics import accuracy_metrics
from avalanche.models import IncrementalClassifier, MTSimpleMLP
from avalanche.training.plugins import EvaluationPlugin
from fromp_avalanche.fromp import FROMP
from torch import nn

from fromp import FROMPMethod
from fromp.models import MultiHeadMLP
from tests.cases import tiny_mlp

D = torch.float64


def _task(t: int, classes: list[int], n: int = 24, d: int = 4):
    g = torch.Generator().manual_seed(10 + t)
    y = torch.tensor(classes)[torch.arange(n) % len(classes)]
    return torch.randn(n, d, generator=g, dtype=D) + 0.5 * t, y


def _move(net: nn.Module) -> None:
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.05 * torch.randn_like(p))


def _penalties(function: str, tasks: list[list[int]], multihead: bool = False) -> tuple:
    """(method, R after each of the tasks) for a method built with ``function``."""
    torch.manual_seed(0)
    if multihead:
        net = MultiHeadMLP(4, (5,), n_heads=len(tasks), head_size=3).to(D)
    else:
        net = tiny_mlp(4, 5, 4, seed=0)
    method = FROMPMethod(n_points=8, function=function)
    torch.manual_seed(1)
    values = []
    for t, classes in enumerate(tasks):
        method.learn_task(net, *_task(t, classes), t if multihead else None)
        _move(net)
        values.append(method.penalty(net).detach())
    return method, values


@pytest.mark.parametrize(
    ("tasks", "multihead", "chosen"),
    [
        ([[0, 1, 2, 3]] * 3, False, "logits"),  # one head, every task fills it
        ([[0, 1], [2, 3], [0, 3]], False, "logits"),  # one head, classes arrive: coreset
        ([[0, 1, 2, 3], [0, 1], [2, 3]], False, "logits"),  # the first task decides
        ([[0, 1, 2]] * 3, True, "probs"),  # a head per task, each filled
    ],
    ids=["domain-incremental", "class-incremental", "first-task-decides", "multi-head"],
)
def test_auto_keeps_the_chosen_function_and_its_penalty(tasks, multihead, chosen):
    auto, got = _penalties("auto", tasks, multihead)
    assert auto.function == chosen
    assert auto.state_dict()["function"] == chosen
    _, expected = _penalties(chosen, tasks, multihead)
    other = "probs" if chosen == "logits" else "logits"
    _, wrong = _penalties(other, tasks, multihead)
    for t, (a, b, w) in enumerate(zip(got, expected, wrong)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=0.0)
        assert not torch.isclose(a, w, rtol=1e-3), f"after task {t + 1} both functions agree"


def test_class_incremental_without_the_coreset_keeps_probs():
    """Classes arriving on one head with the coreset turned off: the probabilities, whose
    penalty keeps some of the old classes where the logits' keeps none."""
    torch.manual_seed(0)
    net = tiny_mlp(4, 5, 4, seed=0)
    method = FROMPMethod(n_points=8, replay=False)
    method.learn_task(net, *_task(0, [0, 1]), None)
    assert method.class_incremental and method.function == "probs"


def test_auto_is_pending_until_the_first_task_and_a_bernoulli_head_keeps_probs():
    method = FROMPMethod(n_points=4, likelihood="bernoulli")
    assert method.function == "auto"
    net = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1)).to(D)
    x = torch.randn(20, 4, dtype=D)
    method.learn_task(net, x, torch.arange(20) % 2, None)
    assert method.function == "probs"  # one output: the two labels do not "fill" it


def test_resolve_function_before_and_after_the_choice():
    method = FROMPMethod(n_points=8)
    with pytest.raises(ValueError, match="function must be one of"):
        method.resolve_function("auto")
    method.resolve_function("probs")
    assert method.function == "probs"
    method.resolve_function("probs")  # the same: nothing to do
    with pytest.raises(ValueError, match="keeps 'probs' already"):
        method.resolve_function("logits")
    # resolved before the first task: the task's layout no longer decides
    net = tiny_mlp(4, 5, 4, seed=0)
    method.learn_task(net, *_task(0, [0, 1, 2, 3]), None)
    assert method.function == "probs"


def test_state_before_the_choice_leaves_the_loader_free_and_after_it_binds():
    pending = FROMPMethod(n_points=8).state_dict()
    assert pending["function"] == "auto"
    explicit = FROMPMethod(n_points=8, function="logits")
    explicit.load_state_dict(pending)  # nothing chosen there: the explicit choice stays
    assert explicit.function == "logits" and explicit.regularizer.function == "logits"
    auto = FROMPMethod(n_points=8)
    auto.load_state_dict(pending)
    assert auto.function == "auto"
    net = tiny_mlp(4, 5, 4, seed=0)
    auto.learn_task(net, *_task(0, [0, 1, 2, 3]), None)
    chosen = auto.state_dict()
    with pytest.raises(ValueError, match="function='logits'"):
        FROMPMethod(n_points=8, function="probs").load_state_dict(chosen)


# ------------------------------------------------------------------ the Avalanche strategy
def _stream(classes_per_task: list[list[int]]):
    g = torch.Generator().manual_seed(0)
    train, test = [], []
    for t, classes in enumerate(classes_per_task):
        y = torch.tensor(classes)[torch.arange(48) % len(classes)]
        x = torch.randn(48, 6, generator=g) + t
        train.append((x, y))
        test.append((x[:12], y[:12]))
    return train, test


def _fit(model: nn.Module, classes_per_task, task_labels, **kwargs) -> FROMP:
    train, test = _stream(classes_per_task)
    bench = tensors_benchmark(train, test, task_labels=task_labels)
    strategy = FROMP(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), 1e-3),
        n_points=8,
        train_mb_size=16,
        train_epochs=1,
        eval_mb_size=16,
        **kwargs,
        evaluator=EvaluationPlugin(accuracy_metrics(experience=True), loggers=[]),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for exp in bench.train_stream[:2]:
            strategy.train(exp)
    return strategy


def test_strategy_keeps_logits_on_a_fixed_head_every_experience_fills():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))
    strategy = _fit(net, [[0, 1, 2, 3]] * 2, [0, 0])
    assert strategy.plugin.method.function == "logits"


@pytest.mark.parametrize(("replay", "chosen"), [("auto", "logits"), (False, "probs")])
def test_strategy_on_a_fixed_head_whose_classes_arrive(replay, chosen):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))
    strategy = _fit(net, [[0, 1], [2, 3]], [0, 0], replay=replay)
    assert strategy.plugin.method.function == chosen


@pytest.mark.parametrize(("replay", "chosen"), [("auto", "logits"), (False, "probs")])
def test_strategy_on_a_growing_head_its_first_experience_fills(replay, chosen):
    """``IncrementalClassifier`` has exactly the first experience's units after it: the
    layout alone would say "logits" for a domain-incremental stream; the plugin knows the
    head grows (a class-incremental stream: the coreset's logits, or the probabilities
    without it)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.ReLU())
    model = nn.Sequential(net, IncrementalClassifier(8, initial_out_features=2))
    assert FROMPMethod.auto_function(model, torch.randn(4, 6), torch.tensor([0, 1, 0, 1])) == (
        "logits"
    )
    strategy = _fit(model, [[0, 1], [2, 3]], [0, 0], replay=replay)
    assert strategy.plugin.method.function == chosen
    assert strategy.plugin.method.class_incremental


def test_strategy_keeps_probs_with_a_head_per_task():
    torch.manual_seed(0)
    model = MTSimpleMLP(input_size=6, hidden_size=8)
    strategy = _fit(model, [[0, 1], [0, 1]], [0, 1])
    assert strategy.plugin.method.function == "probs"
    assert not strategy.plugin.method.class_incremental  # its heads grow per task
