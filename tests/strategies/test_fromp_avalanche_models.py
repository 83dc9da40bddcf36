"""FROMP with models and arguments as Avalanche users write them: MTSimpleCNN (squeezes a
batch of one), grown heads and the optimizer, 0-dim parameters, refused settings and labels,
Avalanche's argument order, the penalty as a metric beside the loss without it (CSVLogger
included), and one forward per head for all memorable points."""

from __future__ import annotations

import csv
import math
import warnings

import pytest
import torch
from avalanche.benchmarks.scenarios.deprecated.generators import nc_benchmark
from avalanche.benchmarks.utils import _make_taskaware_tensor_classification_dataset
from avalanche.evaluation.metrics import loss_metrics
from avalanche.logging import CSVLogger, TextLogger
from avalanche.models import IncrementalClassifier, MTSimpleCNN, MTSimpleMLP, MultiHeadClassifier
from avalanche.training.plugins import EvaluationPlugin
from fromp_avalanche.ewc import EWC
from fromp_avalanche.fromp import FROMP, FROMPPenaltyMetric
from torch import nn

from fromp import FROMPMethod, select_memorable
from fromp.continual.methods import by_name

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _bench(shape=(1, 28, 28), n_exp=3, order=(5, 2, 0, 4, 3, 1), task_labels=True, n=60):
    """Split stream with Avalanche's default (global) labels in a shuffled class order."""

    def ds(k: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        y = torch.arange(k) % (2 * n_exp)
        x = 0.3 * torch.randn(k, *shape, generator=g)
        x.view(k, -1)[torch.arange(k), y * 10] += 3.0
        return _make_taskaware_tensor_classification_dataset(x, y, targets=y.tolist())

    return nc_benchmark(
        ds(n, 0), ds(n // 2, 1), n_exp, task_labels, shuffle=False, fixed_class_order=list(order)
    )


def _optimizer_holds_model(strategy) -> bool:
    held = {id(p) for g in strategy.optimizer.param_groups for p in g["params"]}
    return {id(p) for p in strategy.model.parameters()} <= held


def test_mtsimplecnn_trains_and_regularises_after_tasks_2_and_3():
    bm = _bench(shape=(3, 16, 16))
    torch.manual_seed(0)
    model = MTSimpleCNN()
    # heads as wide as the global labels: Avalanche pads narrower heads with unmasked zeros
    # (refused: tests/strategies/test_multihead_masks.py)
    model.classifier = MultiHeadClassifier(64, initial_out_features=6)
    strategy = FROMP(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), 1e-3),
        n_points=4,
        train_mb_size=16,
        evaluator=None,
    )
    for i, exp in enumerate(bm.train_stream):
        strategy.train(exp)
        if i >= 1:
            penalty = float(strategy.plugin.method.last_penalty)
            assert penalty > 0 and math.isfinite(penalty)
            assert len(strategy.plugin.method.regularizer) == i + 1
            assert _optimizer_holds_model(strategy)
    # every set through its own head, on the units that head has switched on (its task's
    # classes; MultiHeadClassifier masks the others)
    units = [m.units.tolist() for m in strategy.plugin.method.regularizer.memories]
    assert units == [[2, 5], [0, 4], [1, 3]]


def test_optimizer_follows_heads_grown_by_an_adaptation_outside_training():
    # Avalanche refreshes the optimizer only before training; an adaptation done elsewhere
    # (here: as load_checkpoint does, experience by experience) must refresh it too
    bm = _bench(task_labels=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(784, 8), nn.ReLU(), IncrementalClassifier(8))
    strategy = FROMP(
        model=model, optimizer=torch.optim.Adam(model.parameters(), 1e-3), evaluator=None
    )
    for exp in list(bm.train_stream)[:2]:
        strategy.experience = exp
        strategy.model = strategy.model_adaptation()
        assert _optimizer_holds_model(strategy)
    n_groups = len(strategy.optimizer.param_groups[0]["params"])
    assert n_groups == len(list(strategy.model.parameters()))


class _Temperature(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(784, 6)
        self.t = nn.Parameter(torch.tensor(1.0))  # a 0-dim parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l(x.flatten(1)) / self.t


def test_zero_dim_parameter_state_by_name():
    net = _Temperature()
    flat = torch.arange(sum(p.numel() for p in net.parameters()), dtype=torch.float32)
    named = by_name(net, flat)
    assert [n for n, _ in net.named_parameters()] == ["t", "l.weight", "l.bias"]
    assert named["t"].shape == () and float(named["t"]) == 0.0
    assert named["l.weight"].shape == (6, 784)
    torch.testing.assert_close(named["l.weight"].reshape(-1), flat[1 : 1 + 6 * 784])
    torch.testing.assert_close(named["l.bias"], flat[-6:])


def test_zero_dim_parameter_strategies_after_experience_0():
    bm = _bench(task_labels=False)
    for cls, kw in ((FROMP, {"n_points": 4}), (EWC, {})):
        torch.manual_seed(0)
        net = _Temperature()
        s = cls(model=net, optimizer=torch.optim.Adam(net.parameters(), 1e-3), evaluator=None, **kw)
        for exp in list(bm.train_stream)[:2]:
            s.train(exp)


def test_settings_refused_before_anything():
    with pytest.raises(ValueError, match="prior_precision"):
        FROMPMethod(prior_precision=float("inf"))
    with pytest.raises(ValueError, match="grad_clip_norm"):
        FROMPMethod(grad_clip_norm=float("nan"))
    with pytest.raises(TypeError, match="tau must be a number"):
        FROMPMethod(nn.CrossEntropyLoss())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="replay"):
        FROMPMethod(replay="yes")  # type: ignore[arg-type]


def test_load_state_dict_refuses_other_settings_and_changes_nothing():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    x, y = torch.randn(30, 4), torch.arange(30) % 3
    m = FROMPMethod(tau=10.0, n_points=6, kernel="identity")
    m.learn_task(net, x, y, None)
    state = m.state_dict()
    for kw, name in (
        ({"tau": 30.0, "kernel": "identity"}, "tau"),
        ({"kernel": "per_class"}, "kernel"),
        ({"kernel": "identity", "prior_precision": 1.0}, "prior_precision"),
        ({"kernel": "identity", "replay": True}, "replay"),
    ):
        other = FROMPMethod(n_points=6, **{"tau": 10.0, **kw})  # tau: as saved
        with pytest.raises(ValueError, match=name):
            other.load_state_dict(state)
        assert len(other.regularizer) == 0 and other.task_count == 0
    same = FROMPMethod(tau=10.0, n_points=6, kernel="identity")
    same.load_state_dict(state)
    assert float(same.penalty(net)) == float(m.penalty(net))


@pytest.mark.parametrize("labels", [[5], [3], [-1]])
def test_labels_outside_the_head_refused_naming_y(labels):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3))
    x = torch.randn(12, 4)
    y = torch.tensor(labels * 12)
    m = FROMPMethod(n_points=2)
    with pytest.raises(ValueError, match="y must"):
        m.learn_task(net, x, y, None)
    assert m.task_count == 0 and m.ggn_sum is None
    with pytest.raises(ValueError, match="y must"):
        select_memorable(net, x, y, n_per_class=2)


def test_learn_task_again_with_the_same_key_replaces():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3))
    x, y = torch.randn(30, 4), torch.arange(30) % 3
    m = FROMPMethod(n_points=6)
    m.learn_task(net, x, y, None, experience=0)
    g = {k: v.clone() for k, v in m.ggn_sum.items()}
    m.learn_task(net, x, y, None, experience=0)
    assert len(m.regularizer) == 1 and m.regularizer.num_points == 6
    for k in g:
        torch.testing.assert_close(m.ggn_sum[k], g[k])


def test_avalanche_argument_order_and_defaults():
    from avalanche.training import Naive

    net = MTSimpleMLP()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    crit = nn.CrossEntropyLoss(label_smoothing=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = FROMP(net, opt, crit, evaluator=None)  # Avalanche's legacy positional order
        ref = Naive(model=net, optimizer=opt, evaluator=None)
    assert s._criterion is crit and s.plugin.method.tau == 10.0
    assert (s.train_mb_size, s.eval_mb_size) == (ref.train_mb_size, ref.eval_mb_size)


def _dominated(evaluator, train_epochs: int, **kwargs):
    """``(benchmark, FROMP)``: one 6-way head on a class-incremental stream (Avalanche's
    default labels) with ``tau = 1e6``, so that the penalty dominates from experience 2."""
    bm = _bench(task_labels=False, n=120)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(784, 16), nn.ReLU(), nn.Linear(16, 6))
    strategy = FROMP(
        model=net,
        optimizer=torch.optim.Adam(net.parameters(), 1e-2),
        train_mb_size=16,
        train_epochs=train_epochs,
        evaluator=evaluator,
        tau=1e6,
        n_points=4,
        **kwargs,
    )
    return bm, strategy


def test_penalty_metric_and_loss_without_it_in_the_loggers(tmp_path):
    text = tmp_path / "log.txt"
    with open(text, "w") as fh:
        ev = EvaluationPlugin(
            loss_metrics(epoch=True),
            loggers=[CSVLogger(str(tmp_path / "csv")), TextLogger(fh)],
        )
        # the coreset's loss is part of the logged loss: weight 1, so that it stays a few nats
        bm, strategy = _dominated(ev, train_epochs=2, replay_weight=1.0)
        assert sum(isinstance(m, FROMPPenaltyMetric) for m in ev.metrics) == 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for exp in list(bm.train_stream)[:2]:
                strategy.train(exp)
    dominated = [w for w in caught if "dominates" in str(w.message)]
    assert len(dominated) == 1  # once
    log = text.read_text()
    assert "FROMP_Penalty_Epoch" in log
    pen = [float(line.split("=")[-1]) for line in log.splitlines() if "FROMP_Penalty" in line]
    assert pen[0] == 0.0 and pen[-1] > 10.0  # tau * R during experience 2
    with open(tmp_path / "csv" / "training_results.csv") as fh:
        rows = list(csv.DictReader(fh))
    # CSVLogger's training loss is the loss without the penalty: a cross-entropy over 6
    # classes, far below the penalty logged beside it
    losses = [float(r["training_loss"]) for r in rows]
    assert len(losses) == 4 and max(losses) < 5.0 < pen[-1]


def test_memorable_points_of_all_tasks_in_one_forward_per_head():
    calls = []

    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(len(x))
            return self.l(x)

    torch.manual_seed(0)
    net = Counting()
    m = FROMPMethod(n_points=6)
    for _ in range(10):
        m.learn_task(net, torch.randn(30, 4), torch.arange(30) % 3, None)
    calls.clear()
    m.penalty(net)
    assert calls == [60]  # 10 tasks x 6 points, one call


def test_one_call_per_head_for_modules_taking_task_labels():
    from avalanche.models.utils import avalanche_model_adaptation
    from fromp_avalanche.benchmarks import experience_tensors

    torch.manual_seed(0)
    model = MTSimpleMLP()
    calls = []
    model.register_forward_pre_hook(lambda mod, args: calls.append(len(args[0])))
    m = FROMPMethod(n_points=4)
    for exp in _bench().train_stream:
        model.train()
        avalanche_model_adaptation(model, exp)
        x, y, t = experience_tensors(exp.dataset)
        m.learn_task(model, x, y, int(t[0]))
    calls.clear()
    m.penalty(model)
    assert calls == [4, 4, 4]  # one call per head with all its points


def test_batched_penalty_equals_the_per_task_loop_after_tasks_1_2_3():
    from fromp.continual.regularizer import task_fn
    from fromp.models import MultiHeadMLP

    torch.manual_seed(0)
    net = MultiHeadMLP(6, (8,), n_heads=3, head_size=3).double()
    m = FROMPMethod(n_points=6)
    for t in range(3):
        m.learn_task(net, torch.randn(30, 6, dtype=torch.float64), torch.arange(30) % 3, t)
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.1 * torch.randn_like(p))
        batched = m.penalty(net)
        net.eval()
        # one call per set, each through its head, and the per-set quadratic forms summed
        loop = sum(
            0.5 * (r.T.unsqueeze(-1) * torch.cholesky_solve(r.T.unsqueeze(-1), mem.chol)).sum()
            for r, mem in zip(m.regularizer.residuals(task_fn(net)), m.regularizer.memories)
        )
        net.train()
        torch.testing.assert_close(batched, loop, rtol=1e-12, atol=1e-14)
        assert float(batched) > 0


def test_ewc_strategy_trained_twice_on_an_experience_keeps_one_anchor():
    """Audit S22: the EWC strategy's ``train(exp)`` on the same experience twice keeps one
    anchor for it (the second replaces the first), as FROMP does; two experiences, two."""
    from avalanche.models import SimpleMLP

    bm = _bench(task_labels=False)
    exps = list(bm.train_stream)
    torch.manual_seed(0)
    net = SimpleMLP(num_classes=6, input_size=784, hidden_size=16)
    s = EWC(model=net, optimizer=torch.optim.SGD(net.parameters(), 0.0), evaluator=None,
            train_mb_size=16)  # fmt: skip
    s.train(exps[0])
    once = float(s.plugins[0].method.penalty(net))
    s.train(exps[0])  # lr 0: the same weights, the same Fisher
    assert len(s.plugins[0].method.anchors) == 1
    assert float(s.plugins[0].method.penalty(net)) == pytest.approx(once, abs=1e-12)
    s.train(exps[1])
    assert len(s.plugins[0].method.anchors) == 2


@pytest.mark.parametrize("replay", [False, True, "auto"])
def test_class_incremental_warning_names_replay_false_at_the_start_of_the_experience(replay):
    """Class-incremental (Avalanche's default labels, one head): with the coreset turned off
    the second experience starts with one warning naming replay=False (before any step);
    the dominance warning stays one line and no longer carries it."""
    bm, strategy = _dominated(None, train_epochs=1, replay=replay)
    messages = []
    for exp in list(bm.train_stream)[:2]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            strategy.train(exp)
        messages.append([str(w.message) for w in caught if "FROMP" in str(w.message)])
    named = [[m for m in ms if "replay=False" in m] for ms in messages]
    assert [len(n) for n in named] == [0, 1 if replay is False else 0]
    assert all("\n" not in m for ms in messages for m in ms)
    assert not any("replay=" in m for ms in messages for m in ms if "dominates" in m)


def test_the_class_incremental_warning_follows_the_classes_begin_task_gives():
    """The method itself knows which classes an experience brings to a head trained before
    (begin_task's ``classes``): with replay=False it names the setting for new classes on a
    head that holds others, not for the first experience, the same classes again, a stream
    that does not say, or a new head; with the coreset on it says nothing."""
    from fromp import FROMPMethod
    from fromp.models import MultiHeadMLP

    def named(method, net, **facts) -> bool:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            method.begin_task(net, **facts)
        return any("replay=False" in str(c.message) for c in caught)

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4))
    x = torch.randn(40, 4)
    for replay in (False, True, "auto"):
        m = FROMPMethod(n_points=4, replay=replay)
        assert not named(m, net, task=0, classes=[0, 1])  # the first experience
        m.learn_task(net, x, torch.arange(40) % 2, 0)
        assert named(m, net, task=0, classes=[2, 3]) is (replay is False)
        assert not named(m, net, task=0, classes=[0, 1])  # the same classes again
        assert not named(m, net, task=0)  # the stream does not say
    multi = MultiHeadMLP(4, (6,), n_heads=2, head_size=2)
    m = FROMPMethod(n_points=4, replay=False)
    m.learn_task(multi, x, torch.arange(40) % 2, 0)
    assert not named(m, multi, task=1, classes=[0, 1])  # a new head
