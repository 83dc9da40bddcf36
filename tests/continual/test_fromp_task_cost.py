"""FROMP's batched penalty and its gradient equal a per-task dense float64 loop (Jacobians
by autograd, dense solves) after tasks 1, 2 and 3, also with sets of different sizes and
units (its per-step cost, the same operations after 1, 2 and 10 tasks, is held in
tests/continual/test_step_cost.py). The after-task step builds one GP per head and factorises all
kernels of a size at once; wrong inputs are refused before any work."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fromp.continual.regularizer as regmod
from fromp.continual.methods import FROMPMethod
from fromp.continual.regularizer import FROMPRegularizer
from fromp.curvature.jacobian import num_params
from fromp.models import MultiHeadMLP, with_task
from fromp.testing import flat, forward_at

D = torch.float64


def _data(task: int, n: int = 30, d: int = 6, c: int = 3, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + task)
    return torch.randn(n, d, generator=g, dtype=dtype), torch.arange(n) % c


def _moved(net: nn.Module, scale: float = 0.05) -> None:
    with torch.no_grad():
        for p in net.parameters():
            p.add_(scale * torch.randn_like(p))


def _net(multihead: bool, dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    if multihead:
        return MultiHeadMLP(6, (8,), n_heads=10, head_size=3).to(dtype)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


# ---------------------------------------------------------------- (c) dense float64 loop
def _dense_set_penalty(view, x, w_old, variance, units, jitter, kernel, w_new):
    """One set's ``1/2 r^T (K + jitter I)^{-1} r`` from its formula, differentiable in
    ``w_new``: ``G = d softmax(f(x; w))/dw`` at ``w_old`` by autograd ``[M, C, P]``, ``K``
    per class or joint (class-major) on ``units``, dense solves."""

    def probs(w):
        return torch.softmax(forward_at(view, w, x), -1)[:, units]

    g = torch.autograd.functional.jacobian(probs, w_old)  # [M, C_s, P]
    r = probs(w_new) - probs(w_old).detach()  # [M, C_s]
    m, c = r.shape
    if kernel == "identity":
        return 0.5 * (r * r).sum()
    if kernel == "per_class":
        total = torch.zeros((), dtype=D)
        for k in range(c):
            kk = g[:, k] @ torch.diag(variance) @ g[:, k].T + jitter * torch.eye(m, dtype=D)
            total = total + 0.5 * r[:, k] @ torch.linalg.solve(kk, r[:, k])
        return total
    gj = g.permute(1, 0, 2).reshape(c * m, -1)
    kk = gj @ torch.diag(variance) @ gj.T + jitter * torch.eye(c * m, dtype=D)
    rj = r.T.reshape(-1)
    return 0.5 * rj @ torch.linalg.solve(kk, rj)


def _grad(value, net):
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(value, list(net.parameters()))])


@pytest.mark.parametrize("kernel", ["per_class", "joint", "identity"])
def test_batched_penalty_and_gradient_equal_a_dense_per_task_loop_after_tasks_1_2_3(kernel):
    torch.manual_seed(0)
    net = MultiHeadMLP(5, (7,), n_heads=3, head_size=3).double()
    method = FROMPMethod(n_points=6, kernel=kernel, jitter=1e-5)
    for t in range(3):
        x, y = _data(t, d=5, dtype=D)
        method.learn_task(net, x, y, t)
        w_old, variance = flat(net), method.posterior_variance(net)  # all sets taken here
        _moved(net, 0.1)
        got = method.penalty(net)
        w_new = flat(net).requires_grad_(True)
        ref = sum(
            _dense_set_penalty(with_task(net, m.task), m.inputs, w_old, variance,
                               torch.arange(3), m.jitter, kernel, w_new)
            for m in method.regularizer.memories
        )  # fmt: skip
        assert len(method.regularizer) == t + 1 and float(ref.detach()) > 0
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-14)
        (ref_grad,) = torch.autograd.grad(ref, w_new)
        torch.testing.assert_close(_grad(got, net), ref_grad, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("kernel", ["per_class", "joint", "identity"])
def test_sets_of_different_sizes_and_units_are_padded_exactly(kernel):
    """Set 0 (4 points, units {0, 1}: the classes seen then) and set 1 (3 points, all 4
    units), each stored at its own weights and ``Sigma`` (no update): blocks of different
    sizes in one stack; the penalty equals the dense per-set sum."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4)).double()
    reg = FROMPRegularizer(kernel, jitter=1e-5)
    stored = []
    for x, seen in (
        (torch.randn(4, 5, dtype=D), [0, 1]),
        (torch.randn(3, 5, dtype=D), [0, 1, 2, 3]),
    ):
        reg.classes_seen[None] = seen
        v = torch.rand(num_params(net), dtype=D) + 0.1
        reg.add_task(net, x, None, v, update_previous=False)
        stored.append((x, flat(net), v, torch.tensor(seen)))
        _moved(net, 0.2)
    assert [m.units.tolist() for m in reg.memories] == [[0, 1], [0, 1, 2, 3]]
    got = reg.penalty(net)
    w_new = flat(net).requires_grad_(True)
    ref = sum(
        _dense_set_penalty(net, x, w, v, u, m.jitter, kernel, w_new)
        for (x, w, v, u), m in zip(stored, reg.memories)
    )
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-14)
    (ref_grad,) = torch.autograd.grad(ref, w_new)
    torch.testing.assert_close(_grad(got, net), ref_grad, rtol=1e-8, atol=1e-12)


def test_heads_of_different_widths_through_a_function_equal_the_dense_loop():
    """``model_fn(x, task)`` with a 2-way head for task 0 and a 4-way head for task 1:
    the probabilities are zero-padded to the wider head, each set keeps its own units."""
    torch.manual_seed(0)
    nets = [nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, c)).double() for c in (2, 4)]
    reg = FROMPRegularizer(jitter=1e-5)
    xs = [torch.randn(4, 5, dtype=D), torch.randn(3, 5, dtype=D)]
    vs = [torch.rand(num_params(n), dtype=D) + 0.1 for n in nets]
    for t, (n, x, v) in enumerate(zip(nets, xs, vs)):
        reg.add_task(n, x, t, v, update_previous=False)
    w_old = [flat(n) for n in nets]
    for n in nets:
        _moved(n, 0.2)
    got = reg.penalty(lambda x, t: nets[t](x))
    ref = sum(
        _dense_set_penalty(n, x, w, v, torch.arange(c), m.jitter, "per_class", flat(n))
        for n, x, w, v, c, m in zip(nets, xs, w_old, vs, (2, 4), reg.memories)
    )
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-14)


# ------------------------------------------------------------------- the stacked state
def test_a_new_memories_list_or_update_is_seen_by_the_next_penalty():
    torch.manual_seed(0)
    net = _net(False, D)
    v = torch.rand(num_params(net), dtype=D) + 0.1
    a, b = FROMPRegularizer(), FROMPRegularizer()
    a.add_task(net, torch.randn(5, 6, dtype=D), None, v)
    b.add_task(net, torch.randn(4, 6, dtype=D), None, v)
    b.add_task(net, torch.randn(3, 6, dtype=D), None, v)
    _moved(net, 0.2)
    before = a.penalty(net)  # a's stack built
    a.memories = b.memories
    torch.testing.assert_close(a.penalty(net), b.penalty(net), rtol=0, atol=0)
    assert float(before.detach()) != float(a.penalty(net).detach())
    b.update(net, v)  # the targets move to the present weights: R = 0
    assert float(b.penalty(net).detach()) == 0.0


# ----------------------------------------------------------------------------- refusals
def test_a_head_narrower_than_a_stored_set_is_refused_naming_the_task():
    torch.manual_seed(0)
    wide = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    reg = FROMPRegularizer()
    reg.add_task(wide, torch.randn(5, 6, dtype=D), 7, torch.full((num_params(wide),), 0.1, dtype=D))
    narrow = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    with pytest.raises(ValueError, match="head of task 7 has 3 outputs, fewer than the 4"):
        reg.penalty(narrow)


def test_replay_without_labels_is_refused_before_the_forward():
    torch.manual_seed(0)
    net = _net(False, D)
    reg = FROMPRegularizer()
    reg.add_task(net, torch.randn(5, 6, dtype=D), 2, torch.full((num_params(net),), 0.1, dtype=D))
    calls = []
    net.register_forward_pre_hook(lambda *_: calls.append(1))
    with pytest.raises(ValueError, match="set of task 2 has no labels"):
        reg.replay_loss(net)
    assert calls == []


# ------------------------------------------------------------------------ the after-task step
def test_update_of_ten_sets_builds_one_gp_per_head_and_one_factorisation(monkeypatch):
    """The work of an update that does not depend on the set: the GP (its structured
    evaluator and one-example check) once per head, the Cholesky factorisation of all
    kernels of a size in one call; the kernels themselves per set (their arithmetic)."""
    net = _net(True)
    method = FROMPMethod(n_points=6)
    for t in range(10):
        method.learn_task(net, *_data(t), t % 2)  # 10 sets on 2 heads
    gps, factorisations = [], []
    prob_gp, cholesky_ex = regmod._prob_gp, torch.linalg.cholesky_ex
    monkeypatch.setattr(regmod, "_prob_gp", lambda *a: gps.append(1) or prob_gp(*a))
    monkeypatch.setattr(torch.linalg, "cholesky_ex", lambda *a, **k: factorisations.append(1)
                        or cholesky_ex(*a, **k))  # fmt: skip
    method.regularizer.update(net, method.posterior_variance(net))
    assert len(gps) == 2 and len(factorisations) == 1
    assert len(method.regularizer) == 10
