"""No training step of FROMP, EWC or VCL makes the host wait for the GPU: their penalties
and backward passes, and what their Avalanche plugins and metrics do on every iteration,
read nothing back and upload no host value (``fromp.testing.host_syncs``, recorded on the
CPU by a dispatch mode, so a per-step sync that only a GPU pays for fails here).

The bugs these tests catch were on a GPU (H100, ``make gpu-check``): EWC's penalty made its
constant a tensor with ``new_tensor`` on every step, VCL's predictive did so with ``log S``,
and FROMP's penalty metric read ``tau * R`` back with ``float`` on every step; each is a
blocking copy, and on a launch-bound loop each step then waits for the GPU to drain."""

from __future__ import annotations

import warnings
from functools import partial
from pathlib import Path

import fromp_avalanche
import pytest
import torch
from avalanche.benchmarks.scenarios.deprecated.generators import tensors_benchmark
from avalanche.core import SupervisedPlugin
from avalanche.evaluation.metrics import accuracy_metrics
from avalanche.training.plugins import EvaluationPlugin
from fromp_avalanche.ewc import EWC
from fromp_avalanche.fromp import FROMP, FROMPPenaltyMetric
from fromp_avalanche.vcl import VCL
from torch import nn

import fromp
from fromp.continual.ewc import EWCMethod
from fromp.continual.methods import FROMPMethod
from fromp.models import MultiHeadMLP
from tests.cases import host_syncs

OURS = (str(Path(fromp.__file__).parent), str(Path(fromp_avalanche.__file__).parent))


# ------------------------------------------------------------------------ the recorder
def test_host_syncs_names_reads_uploads_and_data_dependent_shapes():
    a = torch.arange(4.0)
    assert host_syncs(lambda: a + 1) == []
    assert host_syncs(lambda: a * 2.5 + a.new_zeros(())) == []  # Python numbers: kernel args
    assert host_syncs(lambda: float(a.sum())) == ["_local_scalar_dense"]
    assert host_syncs(lambda: a.new_tensor(2.0)) == ["lift_fresh"]
    assert host_syncs(lambda: torch.tensor([1.0, 2.0])) == ["lift_fresh"]
    assert host_syncs(lambda: a[a > 1]) == ["index(boolean mask)"]
    assert host_syncs(lambda: a.nonzero()) == ["nonzero"]
    assert host_syncs(lambda: a[torch.tensor([0, 2])]) == ["lift_fresh"]  # the list, not the index


def test_host_syncs_within_counts_only_calls_from_the_named_code():
    a = torch.arange(4.0)
    here = str(Path(__file__))
    assert host_syncs(lambda: float(a.sum()), within=["/nowhere/"]) == []
    found = host_syncs(lambda: float(a.sum()), within=[here])
    assert len(found) == 1 and found[0].startswith(f"_local_scalar_dense@{here}:")


# ------------------------------------------------------------------ the methods' steps
def _data(task: int, n: int = 30):
    g = torch.Generator().manual_seed(100 + task)
    return torch.randn(n, 6, generator=g), torch.arange(n) % 3


def _net(multihead: bool) -> nn.Module:
    torch.manual_seed(0)
    if multihead:
        return MultiHeadMLP(6, (8,), n_heads=3, head_size=3)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _move(net: nn.Module) -> None:
    """Away from the weights just learnt, where the penalties and their gradients are 0."""
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.05 * torch.randn_like(p))


@pytest.mark.parametrize("multihead", [False, True])
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"replay": True}, {"function": "logits"}, {"kernel": "joint"}],
    ids=["probs", "replay", "logits", "joint"],
)
@pytest.mark.parametrize("n_tasks", [1, 2])
def test_fromp_penalty_step_never_syncs(kwargs, multihead, n_tasks):
    net = _net(multihead)
    method = FROMPMethod(n_points=6, **kwargs)
    for t in range(n_tasks):
        method.learn_task(net, *_data(t), t if multihead else None)
        _move(net)

    def step():
        net.zero_grad()
        pen, rep = method.terms(net)
        (pen + rep if rep is not None else pen).backward()

    step()  # the stacked state is built once per learnt task, outside the step
    assert host_syncs(step) == []
    assert sum(float(p.grad.abs().sum()) for p in net.parameters() if p.grad is not None) > 0


@pytest.mark.parametrize("mode", ["separate", "online"])
@pytest.mark.parametrize("n_tasks", [1, 2, 3])
def test_ewc_penalty_step_never_syncs_and_keeps_its_constant(mode, n_tasks):
    """The consolidated penalty ``S (w - a~)^2 + c``: no tensor made from ``c`` per step,
    and ``c`` still in the value (against the per-task sum written out here)."""
    net = _net(False)
    method = EWCMethod(ewc_lambda=10.0, mode=mode)
    for t in range(n_tasks):
        method.learn_task(net, *_data(t), None)
        _move(net)

    def step():
        net.zero_grad()
        method.penalty(net).backward()

    step()
    assert host_syncs(step) == []
    w = dict(net.named_parameters())
    expected = sum(
        (f[n].double() * (w[n].detach().double() - a[n].double()) ** 2).sum()
        for a, f in zip(method.anchors, method.importances)
        for n in f
    )
    got = method.penalty(net).detach().double() / method.coefficient
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-9)


# ------------------------------------------------------------- the Avalanche iterations
MARK = "<iteration>"


class _Marks(SupervisedPlugin):
    """Marks where each training iteration begins in the recorder's list."""

    def __init__(self) -> None:
        super().__init__()
        self.record: list[str] = []

    def before_training_iteration(self, strategy, **kwargs):
        self.record.append(MARK)


def _stream():
    g = torch.Generator().manual_seed(0)
    train, test = [], []
    for _ in range(2):
        x, y = torch.randn(256, 10, generator=g), torch.arange(256) % 4
        train.append((x, y))
        test.append((x[:32], y[:32]))
    return tensors_benchmark(train, test, task_labels=[0, 0])


def _strategy(name: str):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(net.parameters(), 1e-3)
    common = {
        "train_mb_size": 8,
        "train_epochs": 1,
        "eval_mb_size": 64,
        "evaluator": EvaluationPlugin(accuracy_metrics(experience=True), loggers=[]),
        "plugins": [_Marks()],
    }
    if name == "ewc":
        return EWC(model=net, optimizer=opt, ewc_lambda=10.0, **common)
    if name == "vcl":
        return VCL(model=net, optimizer=opt, **common)
    kwargs = {
        "fromp": {},
        "fromp-replay": {"replay": True},
        "fromp-clip": {"grad_clip_norm": 0.1},
        "fromp-logits": {"function": "logits", "tau": 1.0},
    }[name]
    return FROMP(model=net, optimizer=opt, n_points=8, **kwargs, **common)


@pytest.mark.parametrize(
    "name", ["fromp", "fromp-replay", "fromp-clip", "fromp-logits", "ewc", "vcl"]
)
def test_training_iterations_of_the_second_experience_never_sync(name):
    """Each iteration of the second experience after FROMP's first 20 (where it compares
    the penalty with the loss, to warn when it dominates) runs no host sync from fromp's
    code or its plugins: neither the penalty, nor its backward, nor the plugin's hooks,
    nor FROMP's penalty metric."""
    strategy = _strategy(name)
    bench = _stream()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        strategy.train(bench.train_stream[0])
        marks = next(p for p in strategy.plugins if isinstance(p, _Marks))
        marks.record.clear()  # the first experience's marks
        found = host_syncs(
            partial(strategy.train, bench.train_stream[1]), within=OURS, out=marks.record
        )
    iterations: list[list[str]] = []
    for op in found:
        if op == MARK:
            iterations.append([])
        elif iterations:
            iterations[-1].append(op)
    assert len(iterations) == 32, found[:4]  # 256 examples, mini-batches of 8
    late = [ops for ops in iterations[20:-1] if ops]  # the last also holds the epoch's end
    assert late == [], [(i, ops) for i, ops in enumerate(iterations) if ops][:4]
    if name.startswith("fromp"):  # the sanity of the check: the first 20 compare
        assert any(ops for ops in iterations[:20])


def test_penalty_metric_reports_the_mean_of_the_steps_penalties():
    """The metric accumulates ``tau * R`` on the device and reads it once an epoch: its
    value is the batch-weighted mean of the steps' penalties, read here step by step."""

    class Steps(SupervisedPlugin):
        def __init__(self):
            super().__init__()
            self.values: list[tuple[float, int]] = []

        def after_training_iteration(self, strategy, **kwargs):
            weighted = strategy.plugin.method.last_terms.get("penalty", 0.0)
            self.values.append((float(weighted), len(strategy.mb_y)))

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 4))
    steps = Steps()
    metric = FROMPPenaltyMetric()
    strategy = FROMP(
        model=net,
        optimizer=torch.optim.Adam(net.parameters(), 1e-3),
        n_points=8,
        train_mb_size=24,  # 256 = 10 x 24 + 16: one smaller batch, so weights matter
        train_epochs=1,
        evaluator=EvaluationPlugin(metric, loggers=[]),
        plugins=[steps],
    )
    bench = _stream()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        strategy.train(bench.train_stream[0])
        steps.values.clear()
        strategy.train(bench.train_stream[1])
        emitted = strategy.evaluator.get_all_metrics()
    key = next(k for k in emitted if k.startswith("FROMP_Penalty_Epoch"))
    total = sum(v * n for v, n in steps.values)
    count = sum(n for _, n in steps.values)
    assert count == 256 and total > 0
    assert emitted[key][1][-1] == pytest.approx(total / count, rel=1e-6)
