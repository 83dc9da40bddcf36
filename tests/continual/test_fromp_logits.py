"""FROMP's penalty on the logits (``function="logits"``): ``r = f(X; w) - f(X; w_old)`` and
``K_c = (df_c/dw) Sigma (df_c/dw)^T``, against the dense float64 formula of
:func:`fromp.testing.dense_fromp_penalty` (``link="identity"``), after tasks 1, 2 and 3; the
choice is kept in the state and a state of the other choice is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fromp import FROMPMethod
from fromp.continual.regularizer import FROMPRegularizer
from fromp.testing import flat
from tests.cases import dense_fromp_penalty, tiny_mlp


def _step(net: nn.Module, scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


@pytest.mark.parametrize("update", [False, True])
@pytest.mark.parametrize("kernel", ["per_class", "joint"])
def test_logit_penalty_equals_dense_after_tasks_1_2_3(kernel, update):
    """Without ``update_previous`` each task's set keeps its targets and kernel from the
    weights after that task; with it (FROMP's use) every set is rebuilt at the weights of
    the latest task. The penalty is the sum of the dense per-set formulas at those weights.
    Killed bugs: the kernel or the residual still taken through the softmax, a dropped 1/2,
    a set's targets refreshed (or not) against the rule."""
    net = tiny_mlp(4, 6, 3, seed=0).double()
    reg = FROMPRegularizer(kernel, jitter=1e-8, function="logits")
    g = torch.Generator().manual_seed(1)
    var = torch.rand(sum(p.numel() for p in net.parameters()), generator=g, dtype=torch.float64)
    var = 0.05 + var
    stored = []
    for t in range(3):
        x = torch.randn(5, 4, generator=g, dtype=torch.float64)
        reg.add_task(net, x, None, var, update_previous=update)
        stored.append((x, flat(net).clone()))
        if update:
            stored = [(xs, flat(net).clone()) for xs, _ in stored]
        _step(net, 0.1, seed=10 + t)
        w = flat(net)
        expected = sum(
            dense_fromp_penalty(net, xs, w_old, var, w, kernel=kernel, jitter=1e-8,
                                link="identity")
            for xs, w_old in stored
        )  # fmt: skip
        probs = sum(
            dense_fromp_penalty(net, xs, w_old, var, w, kernel=kernel, jitter=1e-8)
            for xs, w_old in stored
        )
        got = reg.penalty(net)
        torch.testing.assert_close(got, expected, rtol=1e-7, atol=1e-10)
        assert not torch.allclose(got, probs, rtol=1e-3)  # the option is not ignored


def test_logit_penalty_gradient_equals_dense():
    net = tiny_mlp(4, 6, 3, seed=2).double()
    reg = FROMPRegularizer("per_class", jitter=1e-8, function="logits")
    var = torch.full((sum(p.numel() for p in net.parameters()),), 0.3, dtype=torch.float64)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    reg.add_task(net, x, None, var)
    w_old = flat(net).clone()
    _step(net, 0.2, seed=4)
    w = flat(net).clone().requires_grad_(True)
    dense = dense_fromp_penalty(net, x, w_old, var, w, kernel="per_class", jitter=1e-8,
                                link="identity")  # fmt: skip
    # dense_fromp_penalty takes r without gradient: differentiate the quadratic form by hand
    from fromp.testing import forward_at

    gj = torch.autograd.functional.jacobian(lambda v: forward_at(net, v, x), w_old)  # [M,C,P]
    r = (forward_at(net, w.detach(), x) - forward_at(net, w_old, x)).detach()
    grad = torch.zeros_like(w_old)
    for c in range(r.shape[1]):
        k = gj[:, c] @ torch.diag(var) @ gj[:, c].T + 1e-8 * torch.eye(len(x), dtype=torch.float64)
        alpha = torch.linalg.solve(k, r[:, c])  # K^{-1} r_c
        jc = torch.autograd.functional.jacobian(
            lambda v, c=c: forward_at(net, v, x)[:, c], w.detach()
        )
        grad = grad + jc.T @ alpha
    net.zero_grad()
    reg.penalty(net).backward()
    got = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
    assert dense.item() > 0
    torch.testing.assert_close(got, grad, rtol=1e-6, atol=1e-9)


def test_logit_kernel_keeps_its_scale_on_confident_points():
    """The reason for the option: on a confidently classified point the softmax's Jacobian
    vanishes, so the probabilities' kernel is tiny, the logits' is not."""
    net = nn.Sequential(nn.Linear(2, 3)).double()
    with torch.no_grad():
        net[0].weight.copy_(torch.tensor([[20.0, 0.0], [0.0, 0.0], [-20.0, 0.0]]))
        net[0].bias.zero_()
    x = torch.tensor([[1.0, 0.5], [0.9, -0.3]], dtype=torch.float64)  # class 0, p ~ 1
    var = torch.ones(9, dtype=torch.float64)
    kp = FROMPRegularizer("per_class", function="probs").kernel_matrix(net, x, None, var)
    kf = FROMPRegularizer("per_class", function="logits").kernel_matrix(net, x, None, var)
    # logits' kernel: f = W x + b, df_c/dw = [x, 1] in row c, so K_c = x x'^T + 1 exactly
    xa = torch.cat([x, torch.ones(2, 1, dtype=torch.float64)], 1)
    for c in range(3):
        torch.testing.assert_close(kf[c], xa @ xa.T)
    smallest_logit = float(kf.diagonal(dim1=1, dim2=2).min())
    assert float(kp.diagonal(dim1=1, dim2=2).max()) < 1e-12 * smallest_logit


def test_masked_units_left_out_and_zero_penalty_at_old_weights():
    """An incremental head's masked units (logit -1000) are not regularised (their logits
    are constants, their probabilities 0), and the penalty is 0 at the weights it was stored
    at, after tasks 2 and 3."""

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 4)
            self.active = [0, 1]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            f = self.lin(x)
            mask = torch.full((4,), -1000.0, dtype=f.dtype)
            mask[self.active] = 0.0
            return torch.where(mask == 0, f, mask)

    torch.manual_seed(0)
    net = Masked().double()
    reg = FROMPRegularizer("per_class", function="logits")
    var = torch.full((16,), 0.5, dtype=torch.float64)
    for active in [[0, 1], [0, 1, 2], [0, 1, 2, 3]]:
        net.active = active
        reg.add_task(net, torch.randn(4, 3, dtype=torch.float64), None, var, update_previous=True)
        assert reg.memories[-1].units.tolist() == active
        assert float(reg.penalty(net).detach()) == pytest.approx(0.0, abs=1e-12)
    _step(net, 0.1, seed=5)
    assert float(reg.penalty(net).detach()) > 0


def test_method_state_keeps_the_function_and_refuses_the_other():
    net = tiny_mlp(4, 6, 3, seed=0)
    x, y = torch.randn(30, 4, dtype=torch.float64), torch.arange(30) % 3
    m = FROMPMethod(n_points=6, function="logits")
    m.learn_task(net, x, y, None)
    state = m.state_dict()
    assert state["function"] == "logits" and state["regularizer"]["function"] == "logits"
    again = FROMPMethod(n_points=6, function="logits")
    again.load_state_dict(state)
    torch.testing.assert_close(again.penalty(net), m.penalty(net))
    with pytest.raises(ValueError, match="function='logits'"):
        FROMPMethod(n_points=6, function="probs").load_state_dict(state)
    auto = FROMPMethod(n_points=6)  # "auto", not chosen yet: takes the state's choice
    auto.load_state_dict(state)
    assert auto.function == "logits"
    torch.testing.assert_close(auto.penalty(net), m.penalty(net))
    old = {k: v for k, v in FROMPMethod(n_points=6).state_dict().items() if k != "function"}
    with pytest.raises(ValueError, match=r"missing keys \['function'\]"):  # no older forms
        FROMPMethod(n_points=6).load_state_dict(old)


@pytest.mark.parametrize("bad", ["softmax", "", None, 1])
def test_bad_function_refused_naming_it(bad):
    with pytest.raises(ValueError, match="function must be 'auto' or one of"):
        FROMPMethod(function=bad)
    with pytest.raises(ValueError, match="function must be one of"):
        FROMPRegularizer(function=bad)
