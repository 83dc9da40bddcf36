"""FROMP regularises, with the right sign and weight: the method's loss terms are
``+tau * R(w)``, a gradient step on it moves the old task's outputs back towards their stored
values, and on a synthetic two-task stream the old task's predictions drift less than without
it.
Also the kernel of networks above the column-chunk size (every real run)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _synthetic import synthetic_split
from torch.func import functional_call

from fromp.continual.methods import FROMPMethod
from fromp.continual.regularizer import FROMPRegularizer
from fromp.curvature.jacobian import flat_params, num_params, unflatten
from fromp.models import MultiHeadMLP

D = torch.float64


def _two_tasks(seed: int = 0):
    seq = synthetic_split(n_tasks=2, input_shape=(8,), n_train=64, n_test=32, seed=seed)
    return [(t.train_x.to(D), t.train_y, t.test_x.to(D), t.task_id) for t in seq]


def _train(net, x, y, task, method=None, steps=150, lr=1e-2):
    """Adam on the task's cross-entropy, with the method's training step (its loss terms,
    its clipping)."""
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        out = net(x, task=task)
        loss = F.cross_entropy(out, y)
        if method is not None:
            loss = loss + method.loss_terms(net, x, out, task=task, loss=loss)
        loss.backward()
        if method is not None:
            method.before_update(net, opt)
        opt.step()


def test_loss_terms_are_plus_tau_times_penalty(make_net):
    case = make_net("multihead")
    net = case.net
    x = case.inputs(12)
    y = torch.arange(12) % 3
    tau = 7.0
    method = FROMPMethod(tau=tau, n_points=6)
    method.learn_task(net, x, y, 0)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.2 * torch.randn_like(p))
    pen = method.penalty(net).detach()
    assert pen > 0
    loss = torch.tensor(1.5, dtype=D)
    terms = method.loss_terms(net, x, net(x, task=0), task=0, loss=loss)
    torch.testing.assert_close((loss + terms).detach(), 1.5 + tau * pen, rtol=1e-12, atol=0)
    assert float(method.last_penalty) == pytest.approx(float(pen), rel=1e-12)


def test_penalty_gradient_step_moves_old_outputs_back(any_net):
    """One small step ``w - eta grad R`` reduces ``R`` and brings ``p(X_mem; w)`` closer to the
    stored targets (in the kernel's metric and, here, in plain distance too), for an MLP, a
    CNN, a multi-head MLP and a CNN with batch norm in eval mode."""
    net, task = any_net.net, (1 if any_net.n_heads > 1 else None)
    x = any_net.inputs(6)
    reg = FROMPRegularizer(jitter=1e-4)
    reg.add_task(net, x, task, torch.full((num_params(net),), 0.5, dtype=D))
    targets = reg.memories[0].targets
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.3 * torch.randn_like(p))
    w = flat_params(net)

    def probs(v):
        kw = {} if task is None else {"task": task}
        out = functional_call(net, (unflatten(net, v), dict(net.named_buffers())), (x,), kw)
        return torch.softmax(out, -1)

    pen = reg.penalty(net)
    grads = torch.autograd.grad(pen, list(net.parameters()))
    g = torch.cat([gi.reshape(-1) for gi in grads])
    assert g.abs().max() > 0
    eta = 1e-3 / float(g.norm())
    with torch.no_grad():
        dist0 = (probs(w) - targets).norm()
        dist1 = (probs(w - eta * g) - targets).norm()
        for p, gi in zip(net.parameters(), grads):
            p.sub_(eta * gi)
        pen1 = reg.penalty(net)
    assert pen1 < pen.detach()
    assert dist1 < dist0


def test_fromp_forgets_less_than_without_regulariser():
    """Two tasks through separate heads of one network: after learning task 2, task 1's
    predictions changed much less with FROMP (tau > 0) than with tau = 0."""
    (x0, y0, xt0, _), (x1, y1, _, _) = _two_tasks()
    torch.manual_seed(0)
    net = MultiHeadMLP(8, (16,), n_heads=2, head_size=2).double()
    _train(net, x0, y0, 0)
    net.eval()
    with torch.no_grad():
        before = torch.softmax(net(xt0, task=0), -1)
    drift = {}
    for tau in (0.0, 1.0):
        run = copy.deepcopy(net)
        method = FROMPMethod(tau=tau, n_points=20, prior_precision=1e-2, grad_clip_norm=1.0)
        method.learn_task(run, x0, y0, 0)
        _train(run, x1, y1, 1, method=method)
        run.eval()
        with torch.no_grad():
            drift[tau] = float((torch.softmax(run(xt0, task=0), -1) - before).abs().mean())
            assert (run(x1, task=1).argmax(1) == y1).double().mean() > 0.9  # task 2 learnt
    assert drift[0.0] > 0.05  # task 2 does disturb task 1 without the regulariser
    assert drift[1.0] < 0.1 * drift[0.0]


def test_kernel_above_the_column_chunk_matches_dense():
    """A network with more than 16,384 parameters (the kernel's column chunk) and more
    memorable points than ``chunk_size``: the per-class kernels equal the dense float64
    ``(dp_c/dw) diag(v) (dp_c/dw)^T``, and so does the joint kernel."""
    torch.manual_seed(0)
    net = MultiHeadMLP(120, (140,), n_heads=2, head_size=3).double()
    p = num_params(net)
    assert p > 16_384 + 100
    x = torch.randn(7, 120, dtype=D)
    v = torch.rand(p, dtype=D) + 0.1

    def probs(w):
        return torch.softmax(functional_call(net, unflatten(net, w), (x,), {"task": 1}), -1)

    g = torch.autograd.functional.jacobian(probs, flat_params(net))  # [M, C, P]
    dense = torch.stack([(g[:, c] * v) @ g[:, c].T for c in range(3)])
    got = FROMPRegularizer("per_class", chunk_size=3).kernel_matrix(net, x, 1, v)
    torch.testing.assert_close(got, dense, rtol=1e-12, atol=1e-15)
    gj = g.permute(1, 0, 2).reshape(21, p)
    joint = FROMPRegularizer("joint", chunk_size=3).kernel_matrix(net, x, 1, v)
    torch.testing.assert_close(joint[0], (gj * v) @ gj.T, rtol=1e-12, atol=1e-15)
    # a network whose parameters are not all in linear layers takes the other path
    conv = torch.nn.Sequential(
        torch.nn.Unflatten(1, (1, 120)),
        torch.nn.Conv1d(1, 2, 5),
        torch.nn.Flatten(),
        torch.nn.Tanh(),
        torch.nn.Linear(232, 80),
        torch.nn.Tanh(),
        torch.nn.Linear(80, 3),
    ).double()
    p = num_params(conv)
    assert p > 16_384 + 100
    v = torch.rand(p, dtype=D) + 0.1
    g = torch.autograd.functional.jacobian(
        lambda w: torch.softmax(functional_call(conv, unflatten(conv, w), (x,)), -1),
        flat_params(conv),
    )
    dense = torch.stack([(g[:, c] * v) @ g[:, c].T for c in range(3)])
    got = FROMPRegularizer("per_class", chunk_size=3).kernel_matrix(conv, x, None, v)
    torch.testing.assert_close(got, dense, rtol=1e-12, atol=1e-15)
