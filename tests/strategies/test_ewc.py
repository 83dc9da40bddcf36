"""``ewc_lambda`` on Avalanche's scale: fromp's EWC with ``fisher="minibatch"`` and Avalanche
0.6's ``EWCPlugin`` with the same ``ewc_lambda`` and mini-batch size give the same
importances and the same penalty (value and gradient), after tasks 2 and 3. Avalanche's own
code is the reference."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from avalanche.training.plugins import EWCPlugin as AvalancheEWCPlugin
from avalanche.training.utils import copy_params_dict
from fromp_avalanche.ewc import EWC
from torch import nn
from torch.utils.data import TensorDataset

from fromp.continual.ewc import EWCMethod

LAMBDA, B, N = 37.0, 4, 10  # N not a multiple of B: the last mini-batch is smaller


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))


def _task(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + t)
    return torch.randn(N, 5, generator=g), torch.randint(0, 3, (N,), generator=g)


def _train(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    opt = torch.optim.SGD(net.parameters(), lr=0.3)
    for _ in range(5):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()


def _avalanche_penalty(plugin: AvalancheEWCPlugin, net: nn.Module, tasks_done: int):
    strategy = SimpleNamespace(
        clock=SimpleNamespace(train_exp_counter=tasks_done),
        model=net,
        device="cpu",
        loss=torch.zeros(()),
    )
    plugin.before_backward(strategy)
    return strategy.loss


@pytest.mark.parametrize("mode", ["separate", "online"])
def test_minibatch_fisher_and_penalty_equal_avalanche_ewc(mode):
    net = _net()
    decay = 0.7 if mode == "online" else None
    theirs = AvalancheEWCPlugin(LAMBDA, mode=mode, decay_factor=decay)
    ours = EWCMethod(LAMBDA, fisher="minibatch", batch_size=B, mode=mode, decay_factor=decay or 1.0)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    for t in range(3):
        x, y = _task(t)
        _train(net, x, y)
        data = TensorDataset(x, y, torch.zeros(N, dtype=torch.long))
        imps = theirs.compute_importances(net, nn.CrossEntropyLoss(), opt, data, "cpu", B)
        theirs.update_importances(imps, t)
        theirs.saved_params[t] = copy_params_dict(net)
        ours.learn_task(net, x, y, None, experience=t)
        if t == 0:
            continue
        # importances: Avalanche's I_t is ours / B (ours are on the per-example scale)
        last = ours.importances[-1]
        for name, imp in theirs.importances[t].items():
            torch.testing.assert_close(last[name] / B, imp.data, rtol=1e-5, atol=1e-8)
        # the penalty and its gradient at weights moved off the anchors
        moved = _net()
        with torch.no_grad():
            for p, q in zip(moved.parameters(), net.parameters()):
                p.copy_(q + 0.1 * torch.randn_like(q))
        want = _avalanche_penalty(theirs, moved, t + 1)
        (g_want,) = torch.autograd.grad(want, [moved[0].weight])
        got = ours.penalty(moved)
        (g_got,) = torch.autograd.grad(got, [moved[0].weight])
        assert float(want.detach()) > 1e-3
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
        torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-7)  # float32 sums


def test_per_example_lambda_keeps_the_former_scale_and_refusals():
    net = _net()
    x, y = _task(0)
    new = EWCMethod(ewc_lambda=6400.0, batch_size=128, fisher="exact")
    old = EWCMethod(per_example_lambda=100.0, batch_size=128, fisher="exact")
    for m in (new, old):
        m.learn_task(net, x, y, None)
    with torch.no_grad():
        net[0].weight.add_(0.2)
    # 6400 / 128 = 100 / 2: the same penalty to the last bit
    assert torch.equal(new.penalty(net), old.penalty(net))
    assert old.ewc_lambda == 6400.0 and old.coefficient == 50.0
    with pytest.raises(ValueError, match="give one of ewc_lambda"):
        EWCMethod(ewc_lambda=1.0, per_example_lambda=1.0)
    assert EWCMethod().ewc_lambda == 100.0  # neither: Avalanche's scale, 100
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="batch_size"):
            EWCMethod(1.0, batch_size=bad)
    with pytest.raises(ValueError, match="per_example_lambda"):
        EWCMethod(per_example_lambda=float("nan"))


def test_strategy_takes_its_train_mb_size_as_the_scale():
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    s = EWC(model=net, optimizer=opt, ewc_lambda=64.0, train_mb_size=16)
    assert s.plugin.method.batch_size == 16 and s.plugin.method.coefficient == 4.0
    s = EWC(model=net, optimizer=opt, per_example_lambda=8.0, train_mb_size=16)
    assert s.plugin.method.coefficient == 4.0
