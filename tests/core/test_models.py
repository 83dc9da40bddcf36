"""The FROMP paper's networks, as plain modules and as Avalanche multi-task models."""

from __future__ import annotations

import pytest
import torch
from fromp_avalanche.models import AvalancheMultiHead, as_avalanche_model, unwrap
from torch import nn

from fromp.models import CifarCNN, LeNet5, MultiHeadMLP, with_task


def _n(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_paper_architectures():
    split = MultiHeadMLP(784, (256, 256), n_heads=5, head_size=2)
    assert _n(split) == 784 * 256 + 256 + 256 * 256 + 256 + 5 * (256 * 2 + 2)
    perm = MultiHeadMLP(784, (100, 100), n_heads=1, head_size=10)
    assert _n(perm) == 784 * 100 + 100 + 100 * 100 + 100 + 100 * 10 + 10
    cnn = CifarCNN(3, n_heads=6, head_size=10)
    convs = [m for m in cnn.modules() if isinstance(m, nn.Conv2d)]
    assert [c.out_channels for c in convs] == [32, 32, 64, 64]
    assert cnn(torch.rand(2, 3, 32, 32), task=5).shape == (2, 10)
    assert LeNet5()(torch.rand(3, 1, 28, 28)).shape == (3, 10)


def test_heads_are_selected_by_task():
    net = MultiHeadMLP(12, (8,), n_heads=3, head_size=2)
    x = torch.rand(6, 12)
    h = net.features(x)
    for t in range(3):
        assert torch.allclose(net(x, task=t), net.heads[t](h))
        assert torch.allclose(with_task(net, t)(x), net.heads[t](h))
    tasks = torch.tensor([0, 1, 2, 2, 1, 0])
    mixed = net(x, task=tasks)
    for i, t in enumerate(tasks.tolist()):
        assert torch.allclose(mixed[i], net.heads[t](h[i]))


def test_bad_task_arguments():
    net = MultiHeadMLP(12, (8,), n_heads=3, head_size=2)
    x = torch.rand(4, 12)
    with pytest.raises(ValueError, match="task is required"):
        net(x)
    with pytest.raises(ValueError, match=r"task must be in \[0, 3\)"):
        net(x, task=3)
    with pytest.raises(ValueError, match="shape"):
        net(x, task=torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="n_heads"):
        MultiHeadMLP(12, (8,), n_heads=0, head_size=2)


def test_single_head_needs_no_task():
    net = MultiHeadMLP(12, (8,), n_heads=1, head_size=4)
    x = torch.rand(5, 12)
    assert net(x).shape == (5, 4)
    assert as_avalanche_model(net) is net and with_task(net, 3) is net


def test_avalanche_wrapper_routes_task_labels():
    net = LeNet5(n_heads=2, head_size=3)
    model = as_avalanche_model(net)
    assert isinstance(model, AvalancheMultiHead) and unwrap(model) is net
    assert [p for p in model.parameters()] == [p for p in net.parameters()]
    x = torch.rand(4, 1, 28, 28)
    labels = torch.tensor([1, 0, 1, 0])
    out = model(x, labels)
    for i, t in enumerate(labels.tolist()):
        assert torch.allclose(out[i], net(x[i : i + 1], task=t)[0], atol=1e-6)
    assert torch.allclose(model(x, torch.ones(4, dtype=torch.long)), net(x, task=1))


def test_naive_strategy_trains_on_split_digits():
    from avalanche.training import Naive
    from avalanche.training.plugins import EvaluationPlugin
    from fromp_bench.data import split_digits, to_avalanche

    seq = split_digits().subsample(200, 100)
    bench = to_avalanche(seq)
    model = as_avalanche_model(MultiHeadMLP(64, (32,), n_heads=5, head_size=2))
    strategy = Naive(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
        train_mb_size=32,
        train_epochs=3,
        eval_mb_size=100,
        evaluator=EvaluationPlugin(loggers=[]),
    )
    for exp in bench.train_stream[:2]:
        assert exp.task_label == exp.current_experience
        strategy.train(exp)
    net = unwrap(model).eval()
    for t in range(2):
        acc = (net(seq[t].test_x, task=t).argmax(1) == seq[t].test_y).float().mean()
        assert acc > 0.9, f"task {t}: accuracy {acc:.2f}"


def test_uncompiled_returns_the_module_torch_compile_wraps():
    from fromp.models import uncompiled

    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    compiled = torch.compile(net)
    assert compiled is not net
    assert uncompiled(compiled) is net
    assert uncompiled(net) is net
    # the parameters are shared: the names lose the wrapper's prefix only
    assert [n for n, _ in uncompiled(compiled).named_parameters()] == [
        n.removeprefix("_orig_mod.") for n, _ in compiled.named_parameters()
    ]
