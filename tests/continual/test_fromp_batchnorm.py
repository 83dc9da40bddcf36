"""FROMP on batch-norm networks: the function the penalty regularises does not drift with the
running statistics, the penalty's forward never writes them, and on small single-head streams
whose tasks differ in their input statistics FROMP keeps the old tasks at least as well as
Naive after tasks 2 and 3 (Avalanche's SlimResNet18 blocks and torchvision's BasicBlock, tiny
widths)."""

from __future__ import annotations

import warnings

import pytest
import torch
from avalanche.benchmarks.scenarios.deprecated.generators import tensors_benchmark
from avalanche.evaluation.metrics import accuracy_metrics
from avalanche.training import Naive
from avalanche.training.plugins import EvaluationPlugin
from fromp_avalanche.fromp import FROMP
from torch import nn

from fromp import FROMPMethod

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _small_bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1),
        nn.BatchNorm2d(3),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(2),
        nn.Flatten(),
        nn.Linear(12, 5),
        nn.BatchNorm1d(5),
        nn.ReLU(),
        nn.Linear(5, 3),
    )


def _buffers(net: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in net.named_buffers()}


def _learnt(bn_statistics: str) -> tuple[nn.Module, FROMPMethod, torch.Tensor, torch.Tensor]:
    net = _small_bn_net()
    x, y = torch.randn(30, 1, 6, 6), torch.arange(30) % 3
    net.train()
    net(x)  # running statistics of "task 1"
    method = FROMPMethod(tau=1.0, n_points=6, bn_statistics=bn_statistics)
    method.learn_task(net, x, y, None)
    net.train()
    with torch.no_grad():
        net(3.0 * torch.randn(30, 1, 6, 6) + 2.0)  # training on "task 2" moves the statistics
    return net, method, x, y


@pytest.mark.parametrize("bn_statistics", ["stored", "batch", "live"])
def test_penalty_never_writes_running_buffers_nor_the_mode(bn_statistics):
    net, method, _, _ = _learnt(bn_statistics)
    before = _buffers(net)
    pen = method.penalty(net)
    pen.backward()  # the swapped statistics stay what autograd saved
    after = _buffers(net)
    assert net.training and all(m.training for m in net.modules())
    assert before.keys() == after.keys()
    for n in before:
        assert torch.equal(before[n], after[n]), n


@pytest.mark.parametrize("bn_statistics", ["stored", "batch"])
def test_penalty_is_zero_at_the_task_weights_whatever_the_running_statistics(bn_statistics):
    # the running statistics moved after learn_task; the weights did not: R(w_t) = 0
    net, method, _, _ = _learnt(bn_statistics)
    assert abs(float(method.penalty(net))) < 1e-12
    # ... and the weights moving makes it positive
    with torch.no_grad():
        net[8].bias[0].add_(0.5)  # the last layer (a bias before batch norm has no effect)
    assert float(method.penalty(net)) > 1e-6


def test_live_statistics_move_the_penalty_at_the_task_weights():
    # what "stored" protects against: with the running statistics of the moment the
    # penalty is not 0 at the old weights (the test above would fail with them)
    net, method, _, _ = _learnt("live")
    assert float(method.penalty(net)) > 1e-6


def test_stored_statistics_are_those_of_learn_task_and_checkpointed():
    net = _small_bn_net()
    x, y = torch.randn(30, 1, 6, 6), torch.arange(30) % 3
    net.train()
    net(x)
    method = FROMPMethod(tau=1.0, n_points=6)
    method.learn_task(net, x, y, None)
    assert set(method.bn_buffers) == {
        "1.running_mean",
        "1.running_var",
        "6.running_mean",
        "6.running_var",
    }
    torch.testing.assert_close(method.bn_buffers["1.running_mean"], net[1].running_mean)
    fresh = FROMPMethod(tau=1.0, n_points=6)
    fresh.load_state_dict(method.state_dict())
    net.train()
    net(5.0 * x)
    assert float(fresh.penalty(net)) == float(method.penalty(net))


def test_bn_statistics_refused_when_unknown():
    with pytest.raises(ValueError, match="bn_statistics"):
        FROMPMethod(bn_statistics="running")


# ---------------------------------------------------------------------- old tasks vs Naive
def _stream(n_tasks: int = 3, n: int = 96, n_test: int = 48, c: int = 4, seed: int = 0):
    """Single-head stream: ``c`` class prototypes, each task with its own pixel permutation
    and input shift (the tasks differ in their input statistics, which batch norm tracks)."""
    g = torch.Generator().manual_seed(seed)
    d = 3 * 32 * 32
    protos = torch.randn(c, d, generator=g)
    train, test = [], []
    for _ in range(n_tasks):
        perm = torch.randperm(d, generator=g)
        shift = 2.0 * torch.randn(d, generator=g)

        def make(k: int, perm=perm, shift=shift) -> tuple[torch.Tensor, torch.Tensor]:
            y = torch.arange(k) % c
            x = protos[y][:, perm] + shift + torch.randn(k, d, generator=g)
            return x.view(k, 3, 32, 32), y

        train.append(make(n))
        test.append(make(n_test))
    return tensors_benchmark(train, test, task_labels=[0] * n_tasks)


def _slim() -> nn.Module:
    from avalanche.models.slim_resnet18 import BasicBlock, ResNet

    return ResNet(BasicBlock, [1, 1, 1, 1], 4, nf=2)  # SlimResNet18's blocks, width 2


class _TVResNet(nn.Module):
    """A torchvision ResNet at tiny width: stem conv-bn-relu, torchvision's BasicBlocks
    (one with a strided 1x1 conv-bn shortcut, as in torchvision), pooling, linear head."""

    def __init__(self, c: int = 4, w: int = 4) -> None:
        from torchvision.models.resnet import BasicBlock

        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, w, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(w), nn.ReLU()
        )
        down = nn.Sequential(nn.Conv2d(w, 2 * w, 1, stride=2, bias=False), nn.BatchNorm2d(2 * w))
        self.blocks = nn.Sequential(BasicBlock(w, w), BasicBlock(w, 2 * w, 2, down))
        self.fc = nn.Linear(2 * w, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.blocks(self.stem(x)).mean((2, 3)))


def _old_task_accuracy(strategy_name: str, make_net) -> list[float]:
    """Mean test accuracy on the earlier tasks after tasks 2 and 3."""
    bm = _stream()
    torch.manual_seed(0)
    net = make_net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ev = EvaluationPlugin(accuracy_metrics(experience=True), loggers=[])
    common = dict(
        model=net, optimizer=opt, train_mb_size=16, train_epochs=3, eval_mb_size=64, evaluator=ev
    )
    if strategy_name == "fromp":
        strategy = FROMP(**common, n_points=16)
    else:
        strategy = Naive(**common)
    out = []
    for i, exp in enumerate(bm.train_stream):
        strategy.train(exp)
        if i == 0:
            continue
        res = strategy.eval(bm.test_stream[:i])
        acc = [float(v) for k, v in sorted(res.items()) if k.startswith("Top1_Acc_Exp")]
        out.append(sum(acc) / len(acc))
    return out


@pytest.mark.parametrize("make_net", [_slim, _TVResNet], ids=["slim-resnet", "tv-resnet"])
def test_fromp_keeps_old_tasks_at_least_as_well_as_naive(make_net):
    naive = _old_task_accuracy("naive", make_net)
    fromp = _old_task_accuracy("fromp", make_net)
    assert len(fromp) == 2  # after tasks 2 and 3
    for f, n in zip(fromp, naive):
        assert f >= n, (fromp, naive)
