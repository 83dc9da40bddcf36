"""FROMP and EWC on users' own Avalanche models, trained by Avalanche on small synthetic
streams built like ``SplitMNIST`` (``nc_benchmark``, Avalanche's default global labels):
``MTSimpleMLP`` (a ``MultiTaskModule`` with a ``MultiHeadClassifier``, task labels) and
``SimpleMLP`` (one head, class-incremental), checked after tasks 2 and 3 against dense
float64 brute force through the head of each task (the models train in float32, as
Avalanche's multi-task forward requires; the references use float64 copies)."""

from __future__ import annotations

import copy

import pytest
import torch
from _dense import dense_ggn
from avalanche.benchmarks.scenarios.deprecated.generators import nc_benchmark
from avalanche.benchmarks.utils import _make_taskaware_tensor_classification_dataset
from avalanche.core import SupervisedPlugin
from avalanche.models import MTSimpleMLP, SimpleMLP
from torch import nn

from fromp.likelihood import get_likelihood
from fromp.models import TaskView, is_multitask, with_task
from strategies.ewc import EWC
from strategies.fromp import FROMP

N_CLASSES, D_IN = 6, 8
LIK = get_likelihood("categorical")


def _dataset(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % N_CLASSES
    x = torch.randn(n, D_IN, generator=g)
    x[:, :N_CLASSES] += 2.0 * nn.functional.one_hot(y, N_CLASSES).float()
    return _make_taskaware_tensor_classification_dataset(x, y, targets=y.tolist())


def _benchmark(task_labels: bool):
    """Three experiences of two classes each, global labels 0..5 (Avalanche's default)."""
    return nc_benchmark(
        _dataset(60, 0),
        _dataset(30, 1),
        n_experiences=3,
        task_labels=task_labels,
        shuffle=False,
        fixed_class_order=list(range(N_CLASSES)),
    )


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mt":
        return MTSimpleMLP(input_size=D_IN, hidden_size=6)
    return SimpleMLP(num_classes=N_CLASSES, input_size=D_IN, hidden_size=6)


class _Snapshots(SupervisedPlugin):
    """After each experience (after the method's plugin): a copy of the model."""

    def __init__(self) -> None:
        super().__init__()
        self.models: list[nn.Module] = []

    def after_training_exp(self, strategy, **kwargs):
        self.models.append(copy.deepcopy(strategy.model).double().eval())


def _train(kind: str, method: str, **kwargs):
    bm = _benchmark(task_labels=kind == "mt")
    model = _model(kind)
    snaps = _Snapshots()
    cls = FROMP if method == "fromp" else EWC
    strategy = cls(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        train_mb_size=10,
        train_epochs=1,
        evaluator=None,
        plugins=[snaps],
        **kwargs,
    )
    return bm, strategy, snaps


def _xy(exp):
    from strategies.benchmarks import experience_tensors

    x, y, t = experience_tensors(exp.dataset)
    return x.double(), y, int(t[0])


def _named(net: nn.Module, v: torch.Tensor) -> dict[str, torch.Tensor]:
    out, i = {}, 0
    for n, p in net.named_parameters():
        out[n] = v[i : i + p.numel()].view_as(p)
        i += p.numel()
    return out


@pytest.mark.parametrize("kind", ["mt", "single"])
def test_fromp_on_avalanche_models_after_tasks_2_and_3(kind):
    """The GGN sum is ``sum_t G_t`` with ``G_t`` the dense GGN diagonal of experience ``t``
    through head ``t`` at the weights after ``t`` (by parameter name: heads added later get
    zero); every memorable target is the softmax of its own head at the latest weights."""
    bm, strategy, snaps = _train(kind, "fromp", tau=1.0, n_points=4, prior_precision=0.5)
    plugin = strategy.plugin
    for e, exp in enumerate(bm.train_stream):
        strategy.train(exp)
        if e == 0:
            continue
        net = strategy.model
        expected = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in net.named_parameters()}
        for s in range(e + 1):
            x, _, t = _xy(bm.train_stream[s])
            snap = snaps.models[s]
            head = with_task(snap, t if is_multitask(snap) else None)
            g = torch.diagonal(dense_ggn(head, x, LIK))
            for n, v in _named(snap, g).items():
                expected[n][tuple(slice(0, k) for k in v.shape)] += v
        for n in expected:
            torch.testing.assert_close(
                plugin.ggn_sum[n].double(), expected[n], rtol=1e-4, atol=1e-6
            )
        mems = plugin.regularizer.memories
        assert len(mems) == e + 1
        assert [m.task for m in mems] == ([0, 1, 2][: e + 1] if kind == "mt" else [0] * (e + 1))
        net.eval()
        for m in mems:
            head = with_task(net, m.task if is_multitask(net) else None)
            with torch.no_grad():
                p = torch.softmax(head(m.inputs), -1)
            torch.testing.assert_close(m.targets, p[:, : m.targets.shape[1]].double())
        # the heads differ, so a target taken through the wrong head would be caught
        if kind == "mt":
            x0 = mems[0].inputs
            with torch.no_grad():
                assert not torch.allclose(TaskView(net, 0)(x0), TaskView(net, 1)(x0)[:, :2])
        assert float(plugin.penalty(net).detach()) == pytest.approx(0.0, abs=1e-8)


@pytest.mark.parametrize("kind", ["mt", "single"])
def test_ewc_on_avalanche_models_after_tasks_2_and_3(kind):
    """Each stored importance is the dense GGN diagonal (``fisher="exact"``) of its
    experience through its own head at the anchor, divided by N, keyed by name: a head
    added later is absent from the earlier tasks' importances."""
    bm, strategy, snaps = _train(kind, "ewc", ewc_lambda=1.0, fisher="exact")
    plugin = strategy.plugin
    for e, exp in enumerate(bm.train_stream):
        strategy.train(exp)
        if e == 0:
            continue
        assert len(plugin.importances) == e + 1
        for s in range(e + 1):
            x, _, t = _xy(bm.train_stream[s])
            snap = snaps.models[s]
            head = with_task(snap, t if is_multitask(snap) else None)
            g = _named(snap, torch.diagonal(dense_ggn(head, x, LIK)) / len(x))
            assert set(plugin.importances[s]) == set(g)
            for n, v in g.items():
                torch.testing.assert_close(
                    plugin.importances[s][n].double(), v, rtol=1e-4, atol=1e-7
                )
                anchor = dict(snap.named_parameters())[n]
                torch.testing.assert_close(plugin.anchors[s][n].double(), anchor)
        penalty = plugin.penalty()
        assert penalty.requires_grad and float(penalty) > 0  # the weights moved since


@pytest.mark.parametrize("method", ["fromp", "ewc"])
def test_default_global_labels_train_multi_head(method):
    """Avalanche's default labels (global 0..5) train a ``MTSimpleMLP`` through three
    experiences with no ``class_ids_from_zero_in_each_exp`` (the heads grow to the labels,
    unused units masked) and every experience is evaluated."""
    kwargs = {"tau": 1.0, "n_points": 4} if method == "fromp" else {"ewc_lambda": 1.0}
    bm, strategy, _ = _train("mt", method, **kwargs)
    for exp in bm.train_stream:
        strategy.train(exp)
    res = strategy.eval(bm.test_stream)
    assert res == {} or all(v == v for v in res.values())
