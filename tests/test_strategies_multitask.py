"""Multi-task behaviour of the FROMP and EWC plugins after tasks 2 and 3: the running GGN sum,
the head each task's memorable points, targets, kernels and Fisher go through, online-EWC
decay, and non-default settings across a checkpoint. Small synthetic streams, no training:
the weights are perturbed between tasks, as training would move them."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from _synthetic import synthetic_split
from fromp_avalanche.ewc import EWCPlugin
from fromp_avalanche.fromp import FROMPPlugin
from torch.utils.data import TensorDataset

from fromp.continual.memorable import select_memorable
from fromp.curvature.diagonal import diag_ggn
from fromp.curvature.jacobian import flat_params
from fromp.models import MultiHeadMLP, with_task

D = torch.float64


def _stream(n_tasks: int = 3, n_train: int = 24, seed: int = 0):
    seq = synthetic_split(n_tasks=n_tasks, input_shape=(6,), n_train=n_train, n_test=4, seed=seed)
    return [(t.train_x.to(D), t.train_y, t.task_id) for t in seq]


def _net(n_heads: int = 3, head_size: int = 2) -> MultiHeadMLP:
    torch.manual_seed(0)
    return MultiHeadMLP(6, (7,), n_heads=n_heads, head_size=head_size).double().eval()


def _move(net: torch.nn.Module, seed: int, scale: float = 0.3) -> None:
    """Stand-in for training on the next task: a seeded random move of every weight."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _kernel(net, x, task, var):
    """Dense per-class kernels ``[C, M, M]`` of ``softmax(f(x; w))`` through head ``task``."""
    w0 = flat_params(net)
    from torch.func import functional_call

    from fromp.curvature.jacobian import unflatten

    def probs(w):
        return torch.softmax(functional_call(net, unflatten(net, w), (x,), {"task": task}), -1)

    g = torch.autograd.functional.jacobian(probs, w0)  # [M, C, P]
    return torch.stack([(g[:, c] * var) @ g[:, c].T for c in range(g.shape[1])])


def test_fromp_three_tasks_ggn_sum_heads_targets_and_kernels():
    """After each of three tasks: ``Sigma = 1 / (sum_t G_t + delta)`` with ``G_t`` the diagonal
    GGN of task ``t``'s data through head ``t`` at the weights after task ``t``; task ``t``'s
    memorable points are the top-``tr Lambda`` points through head ``t``; every stored target
    and kernel is refreshed at the latest weights through its own head."""
    stream, net = _stream(), _net()
    delta = 0.5
    plugin = FROMPPlugin(tau=1.0, n_points=4, prior_precision=delta, jitter=1e-8)
    g_sum = torch.zeros_like(flat_params(net))
    expected_idx = []
    for x, y, t in stream:
        _move(net, seed=100 + t)
        g_sum = g_sum + diag_ggn(with_task(net, t), x, "categorical")
        expected_idx.append(select_memorable(with_task(net, t), x, y, "categorical", 2))
        plugin.method.learn_task(net, x, y, t)
        var = 1.0 / (g_sum + delta)
        torch.testing.assert_close(plugin.method.posterior_variance(net), var, rtol=1e-10, atol=0)
        reg = plugin.method.regularizer
        assert [m.task for m in reg.memories] == list(range(t + 1))
        for s, mem in enumerate(reg.memories):
            xs = stream[s][0][expected_idx[s]]
            torch.testing.assert_close(mem.inputs, xs, rtol=0, atol=0)
            with torch.no_grad():
                p = torch.softmax(net(xs, task=s), -1)
            torch.testing.assert_close(mem.targets, p, rtol=1e-12, atol=1e-14)
            k = mem.chol @ mem.chol.transpose(-1, -2)
            k = k - mem.jitter * torch.eye(k.shape[-1], dtype=D)
            torch.testing.assert_close(k, _kernel(net, xs, s, var), rtol=1e-7, atol=1e-12)
    assert plugin.method.task_count == 3
    # the heads give different rankings, so the check above could tell them apart
    other = select_memorable(with_task(net, 0), stream[2][0], stream[2][1], "categorical", 2)
    assert not torch.equal(other, expected_idx[2])


def _fake_strategy(net, x, y, t):
    """What a plugin's after_training_exp reads of a strategy."""
    ds = TensorDataset(x, y, torch.full_like(y, t))
    exp = SimpleNamespace(dataset=ds, current_experience=t)
    return SimpleNamespace(experience=exp, model=net, optimizer=None)


@pytest.mark.parametrize("mode", ["separate", "online"])
def test_ewc_three_tasks_fisher_through_each_head_and_online_decay(mode):
    """The penalty after three tasks equals the closed form with ``F_t`` the exact Fisher
    (the GGN diagonal, averaged over examples) of task ``t`` through head ``t`` at ``w*_t``:
    separate ``sum_t F_t (w - w*_t)^2``; online ``F~ = g^2 F_1 + g F_2 + F_3`` around
    ``w*_3``."""
    stream, net = _stream(), _net()
    lam, gamma = 3.0, 0.6
    plugin = EWCPlugin(per_example_lambda=lam, mode=mode, decay_factor=gamma, fisher="exact")
    anchors, fishers = [], []
    for x, y, t in stream:
        _move(net, seed=200 + t)
        fishers.append(diag_ggn(with_task(net, t), x, "categorical") / len(x))
        anchors.append(flat_params(net).clone())
        plugin.after_training_exp(_fake_strategy(net, x, y, t))
    _move(net, seed=300)
    w = flat_params(net)
    if mode == "separate":
        want = sum((f * (w - a) ** 2).sum() for f, a in zip(fishers, anchors))
    else:
        f_tilde = gamma**2 * fishers[0] + gamma * fishers[1] + fishers[2]
        want = (f_tilde * (w - anchors[2]) ** 2).sum()
    assert float(want) > 1e-3  # not vacuous
    got = plugin.method.penalty(net).detach()
    torch.testing.assert_close(got, 0.5 * lam * want, rtol=1e-10, atol=0)
    # a head's Fisher is zero on the other heads' parameters: task 3's importance is not
    # task 1's (a Fisher through a fixed head would give the same support every task)
    head2 = torch.cat([p.reshape(-1) for p in net.heads[2].parameters()])
    n_body = sum(p.numel() for p in net.body.parameters())
    n_head = head2.numel()
    assert fishers[0][n_body + 2 * n_head :].abs().max() == 0
    assert fishers[2][n_body + 2 * n_head :].abs().max() > 0


def test_fromp_nondefault_settings_survive_a_checkpoint():
    """A plugin restored from ``state_dict`` into one built with the same settings continues
    exactly like the original on task 3 (random selection, curvature subsample, joint kernel,
    prior precision and jitter all non-default)."""
    stream, net = _stream(), _net(head_size=1)  # one logit per task: Bernoulli
    kw = dict(
        kernel="joint",
        select="random",
        prior_precision=0.3,
        jitter=1e-5,
        curvature_examples=10,
        grad_clip_norm=2.0,
        chunk_size=5,
        likelihood="bernoulli",
        seed=7,
    )
    plugin = FROMPPlugin(tau=2.5, n_points=6, **kw)
    for x, y, t in stream[:2]:
        _move(net, seed=400 + t)
        plugin.method.learn_task(net, x, y, t)
    state = copy.deepcopy(plugin.state_dict())
    with pytest.raises(ValueError, match="settings of the run"):
        FROMPPlugin().load_state_dict(state)  # built with the defaults: refused
    fresh = FROMPPlugin(tau=2.5, n_points=6, **kw)
    fresh.load_state_dict(state)
    keys = ("tau", "n_points", "kernel", "select", "prior_precision", "grad_clip_norm")
    m, f = plugin.method, fresh.method
    for key in (*keys, "likelihood", "chunk_size"):
        assert getattr(f, key) == getattr(m, key), key
    assert f.regularizer.jitter == m.regularizer.jitter
    assert f.curvature_examples == m.curvature_examples
    net2 = copy.deepcopy(net)
    x, y, t = stream[2]
    _move(net, seed=500)
    _move(net2, seed=500)
    plugin.method.learn_task(net, x, y, t)
    f.learn_task(net2, x, y, t)
    torch.testing.assert_close(f.posterior_variance(net2), m.posterior_variance(net))
    for a, b in zip(m.regularizer.memories, f.regularizer.memories, strict=True):
        assert torch.equal(a.inputs, b.inputs) and a.task == b.task
        torch.testing.assert_close(a.chol, b.chol)
    _move(net, seed=600)
    _move(net2, seed=600)
    assert f.penalty(net2).item() == pytest.approx(m.penalty(net).item(), rel=1e-12)
    assert plugin.method.penalty(net).item() > 0


def test_ewc_nondefault_settings_survive_a_checkpoint():
    stream, net = _stream(), _net()
    kw = dict(mode="online", decay_factor=0.5, fisher="exact")
    plugin = EWCPlugin(4.0, **kw)
    for x, y, t in stream[:2]:
        _move(net, seed=700 + t)
        plugin.after_training_exp(_fake_strategy(net, x, y, t))
    fresh = EWCPlugin(4.0, **kw)
    fresh.load_state_dict(copy.deepcopy(plugin.state_dict()))
    x, y, t = stream[2]
    _move(net, seed=800)
    plugin.after_training_exp(_fake_strategy(net, x, y, t))
    fresh.after_training_exp(_fake_strategy(net, x, y, t))
    _move(net, seed=900)
    want = plugin.method.penalty(net).item()
    assert fresh.method.penalty(net).item() == pytest.approx(want, rel=1e-12)
    assert plugin.method.penalty(net).item() > 0
    with pytest.raises(ValueError, match="mode"):
        EWCPlugin(4.0).load_state_dict(plugin.state_dict())
    with pytest.raises(ValueError, match=r"decay_factor=0\.5"):
        EWCPlugin(4.0, **{**kw, "decay_factor": 0.9}).load_state_dict(plugin.state_dict())
    with pytest.raises(ValueError, match="fisher='exact'"):
        EWCPlugin(4.0, **{**kw, "fisher": "sampled"}).load_state_dict(plugin.state_dict())


def _add_head(net: MultiHeadMLP) -> None:
    torch.manual_seed(5)
    net.heads.append(torch.nn.Linear(net.heads[0].in_features, net.head_size).double())
    net.n_heads += 1


def test_fromp_and_ewc_state_survive_a_new_head():
    """State is keyed by parameter name: a head added after two tasks (a network grown per
    task) leaves the stored state valid; the new head starts at zero GGN / no EWC penalty."""
    stream, net = _stream(), _net(n_heads=2)
    plugin = FROMPPlugin(tau=1.0, n_points=4, prior_precision=0.5)
    fromp = plugin.method
    ewc_plugin = EWCPlugin(2.0, fisher="exact")
    ewc = ewc_plugin.method
    for x, y, t in stream[:2]:
        _move(net, seed=1000 + t)
        fromp.learn_task(net, x, y, t)
        ewc_plugin.after_training_exp(_fake_strategy(net, x, y, t))
    g_before = {n: v.clone() for n, v in fromp.ggn_sum.items()}
    ewc_before = ewc.penalty(net).item()
    _add_head(net)
    assert ewc.penalty(net).item() == pytest.approx(ewc_before, rel=1e-12)  # new head: no term
    var = fromp.posterior_variance(net)
    assert var.numel() == sum(p.numel() for p in net.parameters())
    assert torch.all(var[-sum(p.numel() for p in net.heads[2].parameters()) :] == 1 / 0.5)
    x, y, t = stream[2]
    fromp.learn_task(net, x, y, t)
    ewc_plugin.after_training_exp(_fake_strategy(net, x, y, t))
    new = diag_ggn(with_task(net, 2), x, "categorical")
    from fromp.curvature.jacobian import unflatten

    new = unflatten(net, new)
    for n, v in fromp.ggn_sum.items():
        want = g_before[n] + new[n] if n in g_before else new[n]
        torch.testing.assert_close(v, want, rtol=1e-12, atol=0)
    assert [m.task for m in fromp.regularizer.memories] == [0, 1, 2]
    assert len(ewc.anchors) == 3 and "heads.2.weight" in ewc.importances[2]
    assert "heads.2.weight" not in ewc.importances[0]


def test_strategy_package_exports_and_fromp_likelihood():
    import fromp_avalanche
    from fromp_avalanche.fromp import FROMP

    for name in ("EWC", "VCL", "FROMP", "VOGNStrategy", "experience_tensors"):
        assert name in fromp_avalanche.__all__ and hasattr(fromp_avalanche, name)
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    strategy = FROMP(model=net, optimizer=opt, evaluator=None, likelihood="bernoulli")
    assert strategy.plugin.method.regularizer.likelihood.name == "bernoulli"
    ewc = fromp_avalanche.EWC(model=net, optimizer=opt, evaluator=None, likelihood="bernoulli")
    assert ewc.plugin.method.likelihood.name == "bernoulli"


def test_learn_task_checks_its_inputs_first():
    stream, net = _stream(), _net()
    x, y, _ = stream[0]
    plugin = FROMPPlugin(n_points=4)
    with pytest.raises(TypeError, match="x must be a Tensor"):
        plugin.method.learn_task(net, x.tolist(), y, 0)
    bad = x.clone()
    bad[0, 0] = float("inf")
    with pytest.raises(ValueError, match="x has non-finite"):
        plugin.method.learn_task(net, bad, y, 0)
    vogn = FROMPPlugin(n_points=4, posterior="vogn").method
    with pytest.raises(TypeError, match=r"posterior='vogn' needs optimizer= a fromp\.optim\.VOGN"):
        vogn.learn_task(net, x, y, 0, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    assert plugin.method.task_count == 0 and vogn.task_count == 0
