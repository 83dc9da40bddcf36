"""VOGN / OGN: closed-form Bayesian linear regression, exact per-example statistics against
brute-force loops, the update rule, checkpoints and the Avalanche integration."""

from __future__ import annotations

import copy
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from _synthetic import synthetic_split
from avalanche.models.dynamic_optimizers import update_optimizer
from avalanche.training.plugins import SupervisedPlugin
from fromp_avalanche.models import as_avalanche_model
from fromp_avalanche.vogn import VOGNStrategy
from fromp_bench.data import to_avalanche
from torch import nn

from fromp import IVON, OGN, VOGN
from fromp.likelihood import CategoricalLikelihood, GaussianLikelihood
from fromp.models import MultiHeadMLP, with_task
from fromp.optim.vogn import (
    LayerCapture,
    minibatch_curvature,
    per_example_grad_stats,
    predict_mc,
    predict_mean,
)
from fromp.posterior import DiagonalGaussian

D = torch.float64


def _blr(n: int = 50, d: int = 3, sigma: float = 0.5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=D)
    y = x @ torch.randn(d, generator=g, dtype=D) + sigma * torch.randn(n, generator=g, dtype=D)
    return x, y


def _closed_form(x, y, sigma, delta, tau=1.0):
    """Posterior of y = x w + eps, eps ~ N(0, sigma^2), w ~ N(0, I / delta), likelihood
    tempered by 1 / tau: precision (X^T X / sigma^2) / tau + delta."""
    a = x.T @ x / sigma**2 / tau + delta * torch.eye(x.shape[1], dtype=D)
    return torch.linalg.solve(a, x.T @ y / sigma**2 / tau), a


def _linear(d: int) -> nn.Module:
    return nn.Linear(d, 1, bias=False).to(D)


def _closure(opt, x, y, extra=None):
    """``opt.step``'s closure on the mini-batch ``(x, y)``: the mean of the optimizer's
    per-example loss over ``opt.model(x)``, ``extra()`` (a regulariser) inside
    :meth:`VOGN.extra_term`."""

    def closure():
        opt.zero_grad()
        loss = opt.loss_fn(opt.model(x), y).mean()
        if extra is not None:
            with opt.extra_term():
                loss = loss + extra()
        loss.backward()
        return loss

    return closure


@pytest.mark.parametrize("tau", [1.0, 2.0])
def test_ogn_ggn_recovers_exact_posterior_of_linear_regression(tau):
    x, y = _blr()
    sigma, delta = 0.5, 1.0
    mean, prec = _closed_form(x, y, sigma, delta, tau)
    opt = OGN(
        _linear(3),
        lr=0.3,
        ess=len(x),
        prior_precision=delta,
        kl_weight=tau,
        likelihood=GaussianLikelihood(sigma),
        curvature="ggn",
    )
    for _ in range(500):
        opt.step(_closure(opt, x, y))
    q = opt.posterior()
    # Deterministic full-batch iteration: converged to machine precision.
    torch.testing.assert_close(q.mean, mean, atol=1e-9, rtol=0)
    torch.testing.assert_close(q.precision, prec.diagonal(), atol=0, rtol=1e-9)


def test_vogn_ggn_linear_regression_mean_and_precision():
    """With sampling: the GGN of a linear model does not depend on w, so the precision is
    exact; the mean fluctuates around the exact one (Polyak average within 0.1 std)."""
    x, y = _blr()
    sigma, delta = 0.5, 1.0
    mean, prec = _closed_form(x, y, sigma, delta)
    opt = VOGN(
        _linear(3),
        lr=0.1,
        ess=len(x),
        prior_precision=delta,
        likelihood=GaussianLikelihood(sigma),
        curvature="ggn",
        mc_samples=1,
    )
    avg = torch.zeros(3, dtype=D)
    for i in range(500):
        opt.step(_closure(opt, x, y))
        if i >= 250:
            avg += opt.posterior().mean / 250
    q = opt.posterior()
    torch.testing.assert_close(q.precision, prec.diagonal(), atol=0, rtol=1e-9)
    std = prec.diagonal().rsqrt()
    assert ((avg - mean).abs() / std).max() < 0.1


def test_ogn_squared_gradients_fixed_point():
    """curvature='ef': s converges to the mean squared per-example gradient at the exact
    posterior mean (brute-force loop), the mean to the exact posterior mean."""
    x, y = _blr()
    sigma, delta = 0.5, 1.0
    mean, _ = _closed_form(x, y, sigma, delta)
    opt = OGN(
        _linear(3),
        lr=0.3,
        betas=(0.9, 0.9),
        ess=len(x),
        prior_precision=delta,
        likelihood=GaussianLikelihood(sigma),
    )
    for _ in range(600):
        opt.step(_closure(opt, x, y))
    q = opt.posterior()
    torch.testing.assert_close(q.mean, mean, atol=1e-9, rtol=0)
    sq = torch.stack([(xi * (xi @ mean - yi) / sigma**2) ** 2 for xi, yi in zip(x, y)])
    torch.testing.assert_close(q.precision, sq.sum(0) + delta, atol=0, rtol=1e-7)


class _TinyCNN(nn.Module):
    """Convolutions with weight sharing, a second conv with stride, a linear head."""

    def __init__(self, bn: bool = False, dropout: bool = False) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(1, 3, 3, padding=1)]
        if bn:
            layers.append(nn.BatchNorm2d(3))
        layers += [nn.Tanh(), nn.Conv2d(3, 2, 3, stride=2), nn.Tanh(), nn.Flatten()]
        if dropout:
            layers.append(nn.Dropout(0.3))
        layers.append(nn.Linear(2 * 3 * 3, 4))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class _OddCNN(nn.Module):
    """Convolutions whose per-example gradients are easy to get wrong: dilation with stride,
    a non-square kernel with "same" padding, reflect and circular padding, rectangular
    inputs whose size is not a multiple of the stride."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(2, 3, 3, stride=2, dilation=2, padding=1),
            nn.Tanh(),
            nn.Conv2d(3, 3, (3, 2), padding="same"),
            nn.Tanh(),
            nn.Conv2d(3, 2, 3, stride=(1, 2), padding=1, padding_mode="reflect"),
            nn.Tanh(),
            nn.Conv2d(2, 2, 2, padding=1, padding_mode="circular", bias=False),
            nn.Flatten(),
            nn.LazyLinear(4),
        )

    def forward(self, x):
        return self.net(x)


def _flat(grads, params):
    return torch.cat(
        [(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, params)]
    )


def _brute_stats(model, x, y, lik):
    params = [p for p in model.parameters() if p.requires_grad]
    gs, ggns = [], []
    for xi, yi in zip(x, y):
        loss = lik.nll(model(xi[None]), yi[None]).sum()
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        gs.append(_flat(grads, params))
        f = model(xi[None])
        rows = []
        for c in range(f.shape[1]):
            gc = torch.autograd.grad(f[0, c], params, retain_graph=True, allow_unused=True)
            rows.append(_flat(gc, params))
        jac = torch.stack(rows)  # C, P
        lam = lik.hessian(f.detach())[0]
        ggns.append(torch.einsum("cp,cd,dp->p", jac, lam, jac))
    g = torch.stack(gs)
    return g.mean(0), (g**2).mean(0), torch.stack(ggns).mean(0)


class _Twice(nn.Module):
    """One linear layer applied twice (parameter sharing across calls), optionally a
    LayerNorm: not supported by the hook path, handled by vmap."""

    def __init__(self, norm: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.norm = nn.LayerNorm(5) if norm else nn.Identity()
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        return self.out(self.norm(torch.tanh(self.lin(torch.tanh(self.lin(x))))))


def _case(arch):
    if arch == "mlp":
        net = with_task(MultiHeadMLP(12, (7, 5), n_heads=2, head_size=3).to(D), 1)
        return net, torch.rand(9, 12, dtype=D), torch.randint(0, 3, (9,))
    if arch in ("twice", "shared"):
        net = _Twice(norm=arch == "twice").to(D)
        return net, torch.randn(9, 5, dtype=D), torch.randint(0, 3, (9,))
    if arch == "groups-norm":  # grouped strided conv, GroupNorm, LayerNorm: hook path
        net = nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(),
            nn.Conv2d(4, 4, 3, stride=2, groups=2), nn.Flatten(), nn.LayerNorm(36),
            nn.Linear(36, 4),
        ).to(D)  # fmt: skip
        return net, torch.rand(9, 1, 8, 8, dtype=D), torch.randint(0, 4, (9,))
    if arch == "cnn-odd":
        net = _OddCNN()
        x = torch.rand(9, 2, 11, 13, dtype=D)
        net(x.float())  # materialise the lazy layer
        return net.to(D), x, torch.randint(0, 4, (9,))
    net = _TinyCNN(bn=arch == "cnn-bn").to(D)
    if arch == "cnn-bn":  # non-trivial running statistics and affine parameters
        bn = net.net[1]
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    return net, torch.rand(9, 1, 8, 8, dtype=D), torch.randint(0, 4, (9,))


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")
@pytest.mark.parametrize(
    "arch", ["mlp", "cnn", "cnn-bn", "cnn-odd", "groups-norm", "twice", "shared"]
)
def test_per_example_stats_match_brute_force(arch):
    """Both exact implementations (vmap; layer hooks for Linear/Conv2d/BatchNorm) against a
    loop over examples; batch norm is evaluated with its running statistics."""
    lik = CategoricalLikelihood()
    net, x, y = _case(arch)
    net.eval()
    g, sq, ggn = _brute_stats(net, x, y, lik)
    net.train()  # the per-example pass switches batch norm to eval mode by itself
    results = [
        per_example_grad_stats(net, x, y, lik, curvature="ef", method="vmap", chunk_size=4),
        per_example_grad_stats(net, x, y, lik, curvature="ef", method="auto", chunk_size=4),
    ]
    if arch not in ("twice", "shared"):
        results.append(per_example_grad_stats(net, x, y, lik, method="hooks", chunk_size=5))
    for ef in results:
        torch.testing.assert_close(ef.grad, g, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(ef.curv, sq, atol=1e-12, rtol=1e-10)
        net.eval()
        torch.testing.assert_close(ef.loss, lik.nll(net(x), y).mean(), atol=1e-12, rtol=0)
        net.train()
    gg = per_example_grad_stats(net, x, y, lik, curvature="ggn", chunk_size=5)
    torch.testing.assert_close(gg.grad, g, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(gg.curv, ggn, atol=1e-12, rtol=1e-10)
    assert sq.abs().max() > 0 and ggn.abs().max() > 0
    if arch in ("twice", "shared"):
        with pytest.raises(ValueError, match="hooks"):
            per_example_grad_stats(net, x, y, lik, method="hooks")


def test_one_step_formula_and_regulariser_only_in_gradient():
    torch.manual_seed(1)
    net = _TinyCNN().to(D)
    x, y = torch.rand(6, 1, 8, 8, dtype=D), torch.randint(0, 4, (6,))
    lik = CategoricalLikelihood()
    params = list(net.parameters())
    mu = torch.cat([p.detach().reshape(-1) for p in params]).clone()
    target = torch.randn_like(mu)

    def reg():
        w = torch.cat([p.reshape(-1) for p in params])
        return 0.5 * ((w - target) ** 2).sum() / 100

    g, sq, _ = _brute_stats(net, x, y, lik)
    loss0 = (lik.nll(net(x), y).mean() + reg()).detach()  # the closure's loss
    n, delta, lr, (b1, b2) = 40, 0.5, 0.01, (0.8, 0.7)
    opt = OGN(net, lr=lr, betas=(b1, b2), ess=n, prior_precision=delta)
    loss = opt.step(_closure(opt, x, y, reg))
    torch.testing.assert_close(loss, loss0, atol=1e-12, rtol=0)
    dt = delta / n
    g_tot = g + (mu - target) / 100 + dt * mu
    # bias-corrected: m^ = g_tot, s^ = h (squared data gradients only)
    want = mu - lr * g_tot / (sq + dt)
    torch.testing.assert_close(opt.posterior().mean, want, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(opt.posterior().precision, n * sq + delta, atol=0, rtol=1e-10)
    # the parameters hold mu after the step
    torch.testing.assert_close(torch.cat([p.detach().reshape(-1) for p in params]), want)

    # Two-phase API (as in Avalanche): same update from .grad and set_curvature.
    net2 = _TinyCNN().to(D)
    with torch.no_grad():
        for p2, v in zip(net2.parameters(), mu.split([p.numel() for p in params])):
            p2.copy_(v.view_as(p2))
    params = list(net2.parameters())
    opt2 = OGN(net2, lr=lr, betas=(b1, b2), ess=n, prior_precision=delta)
    opt2.sample_params()
    (lik.nll(net2(x), y).mean() + reg()).backward()
    opt2.set_curvature(per_example_grad_stats(net2, x, y, lik).curv)
    opt2.step()
    torch.testing.assert_close(opt2.posterior().mean, want, atol=1e-12, rtol=1e-10)
    with pytest.raises(ValueError, match="set_curvature"):
        opt2.step()


def test_sampling_uses_posterior_std_and_ogn_does_not_sample():
    net = _linear(4)
    opt = VOGN(net, ess=10, prior_precision=torch.tensor([1.0, 4.0, 16.0, 100.0]))
    ws = torch.stack([opt.sample_params() for _ in range(4000)])
    torch.testing.assert_close(
        ws.std(0), torch.tensor([1.0, 0.5, 0.25, 0.1], dtype=D), rtol=0.05, atol=0
    )
    torch.testing.assert_close(
        torch.cat([p.detach().reshape(-1) for p in net.parameters()]), ws[-1]
    )
    ogn = OGN(_linear(4), ess=10)
    assert torch.equal(ogn.sample_params(), ogn.posterior().mean)


def test_a_reset_of_state_restarts_vogn_and_the_round_trip_is_exact():
    """The state is torch's ``self.state``: a reset (Avalanche's ``reset_state=True``)
    restarts VOGN like a VOGN built on the current weights (the next step equals that
    optimizer's, bit for bit), and ``state_dict`` / ``load_state_dict`` into a fresh
    optimizer continue the run exactly (hyperparameters and ``ess`` included)."""
    x, y = torch.rand(16, 1, 8, 8, dtype=D), torch.randint(0, 4, (16,))
    torch.manual_seed(3)
    net = _TinyCNN().to(D)
    kw = dict(lr=0.01, ess=100, hess_init=1e-3, prior_precision=0.1)
    opt = VOGN(net, **kw)
    for _ in range(3):
        opt.step(_closure(opt, x, y))
    saved = copy.deepcopy(opt.state_dict())
    assert set(saved) == {"state", "param_groups"}
    assert saved["param_groups"][0]["ess"] == 100

    net2 = _TinyCNN().to(D)
    opt2 = VOGN(net2, lr=0.5, ess=1)
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["lr"] == 0.01 and opt2.ess == 100
    _assert_same_next_step(opt, opt2, x, y, seed=7)

    fresh_net = _TinyCNN().to(D)
    fresh_net.load_state_dict(net.state_dict())
    fresh = VOGN(fresh_net, **kw)
    update_optimizer(opt, dict(net.named_parameters()), None, reset_state=True)
    assert isinstance(opt.state, defaultdict) and len(opt.state) == 0
    p0 = opt.params[0]
    torch.testing.assert_close(opt.posterior().precision, fresh.posterior().precision)
    assert opt.state[p0]["step"] == 0 and opt.state[p0]["momentum"].abs().max() == 0
    _assert_same_next_step(opt, fresh, x, y, seed=5)

    bad = copy.deepcopy(saved)
    del bad["state"][0]["hess"]
    before = copy.deepcopy(opt2.state_dict())
    with pytest.raises(ValueError, match="hess"):
        opt2.load_state_dict(bad)
    assert torch.equal(opt2.state[opt2.params[0]]["hess"], before["state"][0]["hess"])


def test_batchnorm_cnn_trains_and_updates_running_stats():
    torch.manual_seed(0)
    net = _TinyCNN(bn=True, dropout=True)
    x, y = torch.rand(32, 1, 8, 8), torch.randint(0, 4, (32,))
    opt = VOGN(net, lr=1e-2, ess=3200, hess_init=1e-2)
    bn = net.net[1]
    mean0 = bn.running_mean.clone()

    def loss_at_mean():
        net.eval()
        out = torch.nn.functional.cross_entropy(net(x), y).item()
        net.train()
        return out

    before = loss_at_mean()
    for _ in range(30):
        assert torch.isfinite(opt.step(_closure(opt, x, y)))
    assert not torch.equal(bn.running_mean, mean0)
    assert net.training and bn.training  # modes restored
    q = opt.posterior()
    assert torch.isfinite(q.mean).all() and torch.isfinite(q.precision).all()
    assert loss_at_mean() < before - 0.1
    # Batch statistics couple the examples: no reuse of a training-mode forward pass.
    assert not LayerCapture(net).supported
    net.eval()
    assert LayerCapture(net).supported


def test_predict_helpers():
    net = MultiHeadMLP(5, (4,), n_heads=1, head_size=3).to(D)
    x = torch.rand(7, 5, dtype=D)
    q = DiagonalGaussian.isotropic(net, 1e12)
    torch.testing.assert_close(predict_mean(net, q, x), torch.softmax(net(x), -1))
    torch.testing.assert_close(
        predict_mc(net, q, x, 3), torch.softmax(net(x), -1), atol=1e-5, rtol=0
    )
    wide = DiagonalGaussian.isotropic(net, 1.0)
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    mc = predict_mc(net, wide, x, 4, generator=g1)
    want = 0
    for _ in range(4):
        w = wide.sample(generator=g2)
        net2 = MultiHeadMLP(5, (4,), n_heads=1, head_size=3).to(D)
        torch.nn.utils.vector_to_parameters(w, net2.parameters())
        want = want + torch.softmax(net2(x), -1) / 4
    torch.testing.assert_close(mc, want)
    with pytest.raises(ValueError, match="n_samples"):
        predict_mc(net, q, x, 0)


def test_bad_arguments():
    net = _linear(2)
    with pytest.raises(ValueError, match="lr"):
        VOGN(net, lr=-1.0)
    with pytest.raises(ValueError, match="betas"):
        VOGN(net, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="mc_samples"):
        OGN(net, mc_samples=2)
    with pytest.raises(ValueError, match="prior_precision"):
        VOGN(net, prior_precision=torch.ones(3))
    with pytest.raises(ValueError, match="prior_precision"):
        VOGN(net, prior_mean=DiagonalGaussian.isotropic(net, 2.0), prior_precision=1.0)
    with pytest.raises(ValueError, match="curvature"):
        VOGN(net, curvature="hessian")
    with pytest.raises(ValueError, match="ess is not set"):
        VOGN(net).step(_closure(VOGN(net), torch.randn(3, 2, dtype=D), torch.zeros(3, dtype=D)))
    prior = DiagonalGaussian(torch.ones(2, dtype=D), torch.full((2,), 3.0, dtype=D))
    opt = VOGN(net, prior_mean=prior, ess=5)
    torch.testing.assert_close(opt.posterior().precision, prior.precision)


class _Probe(SupervisedPlugin):
    """Records the optimizer's prior and mean when each experience starts training."""

    def __init__(self):
        super().__init__()
        self.seen: list[dict] = []

    def before_training_epoch(self, strategy, **kwargs):
        if strategy.clock.train_exp_epochs == 0:
            opt = strategy.optimizer
            self.seen.append(
                {"prior": opt.prior(), "mu": _flat_state(opt, "mean"), "state": opt.state}
            )


def _avalanche_setup(seed: int = 0):
    torch.manual_seed(seed)
    seq = synthetic_split(n_tasks=2, input_shape=(1, 6, 6), n_train=100, n_test=10)
    net = MultiHeadMLP(36, (16,), n_heads=2, head_size=2)
    model = as_avalanche_model(net)
    opt = VOGN(model, lr=2e-2, ess=1, hess_init=0.1, kl_weight=0.1)
    probe = _Probe()
    strat = VOGNStrategy(
        model=model,
        optimizer=opt,
        train_mb_size=32,
        train_epochs=3,
        plugins=[probe],
        evaluator=None,
    )
    return seq, to_avalanche(seq), model, opt, probe, strat


def test_vogn_strategy_two_experiences_checkpoint_and_resume():
    seq, scenario, model, opt, probe, strat = _avalanche_setup()
    strat.train(scenario.train_stream[0])
    q1 = strat.plugin.posteriors[0]
    assert strat.plugin.task_count == 1
    assert opt.ess == len(seq[0].train_x)
    torch.testing.assert_close(opt.prior().mean, q1.mean)  # posterior -> prior
    torch.testing.assert_close(opt.prior().precision, q1.precision)
    assert all(opt.state[p]["step"] == 0 for p in opt.params)
    assert _flat_state(opt, "momentum").abs().max() == 0
    ckpt_plugin = strat.plugin.state_dict()
    ckpt_model = {k: v.clone() for k, v in model.state_dict().items()}

    torch.manual_seed(11)
    strat.train(scenario.train_stream[1])
    # Avalanche rebuilt the optimizer state; the VOGN state was intact at the start of exp 2.
    start2 = probe.seen[1]
    torch.testing.assert_close(start2["prior"].mean, q1.mean, atol=0, rtol=0)
    torch.testing.assert_close(start2["prior"].precision, q1.precision, atol=0, rtol=0)
    torch.testing.assert_close(start2["mu"], q1.mean, atol=0, rtol=0)
    # the state is torch's: after exp 2 it holds the mean, the step count restarted by the
    # continual prior update
    st = opt.state[opt.params[0]]
    assert st["step"] == 0 and torch.equal(st["mean"], opt.params[0].detach())
    q2 = strat.plugin.posteriors[1]
    assert not torch.equal(q2.mean, q1.mean)
    assert (q2.precision >= q1.precision - 1e-6).float().mean() > 0.5
    acc = [(model(t.test_x, t.task_id).argmax(-1) == t.test_y).float().mean().item() for t in seq]
    assert min(acc) > 0.6, acc

    # Resume exp 2 from the checkpoint in a fresh process-like setup: identical result.
    _, scenario2, model2, opt2, _, strat2 = _avalanche_setup(seed=123)
    model2.load_state_dict(ckpt_model)
    strat2.plugin.load_state_dict(ckpt_plugin)  # the optimizer's state dict is in it
    assert set(ckpt_plugin["vogn"]) == {"state", "param_groups"}
    torch.testing.assert_close(opt2.posterior().mean, q1.mean, atol=0, rtol=0)
    torch.manual_seed(11)
    strat2.train(scenario2.train_stream[1])
    torch.testing.assert_close(strat2.plugin.posteriors[1].mean, q2.mean, atol=0, rtol=0)
    torch.testing.assert_close(strat2.plugin.posteriors[1].precision, q2.precision)
    assert strat2.plugin.task_count == 2


def test_vogn_strategy_rejects_other_optimizers():
    net = MultiHeadMLP(4, (3,), n_heads=1, head_size=2)
    with pytest.raises(TypeError, match="VOGN"):
        VOGNStrategy(model=net, optimizer=torch.optim.Adam(net.parameters()))
    with pytest.raises(ValueError, match="mc_samples"):
        _, scenario, _, opt, _, strat = _avalanche_setup()
        opt.param_groups[0]["mc_samples"] = 3
        strat.train(scenario.train_stream[0])


class _CurvatureCheck(SupervisedPlugin):
    """After the backward pass (weights still at the sample), compares the curvature the
    VOGN plugin handed to the optimizer with a separate per-example pass."""

    def __init__(self):
        super().__init__()
        self.checked = 0

    def after_backward(self, strategy, **kwargs):
        opt = strategy.optimizer
        want = minibatch_curvature(
            strategy.model, strategy.mb_x, strategy.mb_y, strategy.mb_task_id, opt
        )
        torch.testing.assert_close(opt._pending_curv, want, atol=1e-10, rtol=1e-5)
        assert want.abs().max() > 0
        self.checked += 1


@pytest.mark.parametrize("reuse_forward", [True, False])
def test_plugin_curvature_from_training_forward_is_exact(reuse_forward):
    torch.manual_seed(0)
    seq = synthetic_split(n_tasks=2, input_shape=(1, 6, 6), n_train=40, n_test=10)
    net = MultiHeadMLP(36, (8,), n_heads=2, head_size=2)
    model = as_avalanche_model(net)
    opt = VOGN(model, lr=1e-2, hess_init=0.1, kl_weight=0.1)
    check = _CurvatureCheck()
    strat = VOGNStrategy(
        model=model,
        optimizer=opt,
        train_mb_size=16,
        train_epochs=1,
        plugins=[check],
        evaluator=None,
        reuse_forward=reuse_forward,
    )
    strat.train(to_avalanche(seq).train_stream[1])
    assert check.checked == 3
    assert strat.plugin.n_reused == (3 if reuse_forward else 0)


def test_step_that_raises_restores_the_mean_weights():
    """A regulariser that fails after sampling must not leave a sample in the model."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    opt = VOGN(net, lr=0.1, ess=10, prior_precision=1.0, hess_init=1.0)
    x, y = torch.randn(5, 3, dtype=D), torch.randint(0, 2, (5,))
    opt.step(_closure(opt, x, y))
    mu = opt.posterior().mean

    def failing():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        opt.step(_closure(opt, x, y, failing))
    got = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    torch.testing.assert_close(got, mu, rtol=0, atol=0)


def test_closure_that_sets_the_curvature_matches_and_restores_the_mean():
    """``step(closure)`` (the ``torch.optim.Optimizer.step(closure=None)`` signature): with
    ``mc_samples=2``, a closure that gives the curvature by :meth:`VOGN.set_curvature` makes
    the update of one whose curvature VOGN finds itself, from the same draws; a closure that
    cannot give it, or raises, leaves the mean in the parameters."""
    lik = CategoricalLikelihood()
    x, y = torch.randn(7, 3, dtype=D), torch.randint(0, 2, (7,))

    def make():
        torch.manual_seed(3)
        net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
        opt = VOGN(net, lr=0.1, ess=20, prior_precision=1.0, hess_init=0.5)
        opt.param_groups[0]["mc_samples"] = 2
        return net, opt

    _, opt_a = make()
    torch.manual_seed(5)
    loss_a = opt_a.step(_closure(opt_a, x, y))

    net_b, opt_b = make()

    def closure():
        opt_b.zero_grad()
        loss = lik.nll(net_b(x), y).mean()
        loss.backward()
        opt_b.set_curvature(per_example_grad_stats(net_b, x, y, lik).curv)
        return loss

    torch.manual_seed(5)
    loss_b = opt_b.step(closure=closure)
    torch.testing.assert_close(loss_b, loss_a, atol=1e-12, rtol=0)
    torch.testing.assert_close(opt_b.posterior().mean, opt_a.posterior().mean, atol=1e-12, rtol=0)
    torch.testing.assert_close(opt_b.posterior().precision, opt_a.posterior().precision)
    mu = opt_b.posterior().mean

    def no_curvature():
        loss = lik.nll(net_b(x), y).mean()
        loss.backward()
        return loss

    def failing():
        raise RuntimeError("boom")

    # a closure without set_curvature: VOGN(model) finds h by itself (above); over bare
    # parameters it cannot
    bare = VOGN(list(net_b.parameters()), lr=0.1, ess=20)
    with pytest.raises(ValueError, match=r"VOGN\(param_groups, model=model\)"):
        bare.step(no_curvature)
    got = torch.cat([p.detach().reshape(-1) for p in net_b.parameters()])
    torch.testing.assert_close(got, mu, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="boom"):
        opt_b.step(failing)
    got = torch.cat([p.detach().reshape(-1) for p in net_b.parameters()])
    torch.testing.assert_close(got, mu, rtol=0, atol=0)
    with pytest.raises(TypeError, match="takes a closure"):
        opt_b.step("x")


def test_a_non_finite_loss_is_refused_and_changes_nothing():
    """A NaN loss gives NaN gradients (and curvature): the update raises with the mean, the
    momentum, the curvature estimate and the step count as they were; training goes on."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = VOGN(model, lr=0.1, ess=20, prior_precision=1.0)
    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    opt.step(_closure(opt, x, y))
    before = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict()["state"])
    p = sum(q.numel() for q in model.parameters())
    for grad, curv in ((torch.full((p,), float("nan")), torch.ones(p)),
                       (torch.zeros(p), torch.full((p,), float("inf")))):  # fmt: skip
        with pytest.raises(FloatingPointError, match="not finite"):
            opt.update(grad, curv)
    for q, b in zip(model.parameters(), before):
        assert torch.equal(q, b)
    after = opt.state_dict()["state"]
    for i, st in state.items():
        assert after[i]["step"] == st["step"]
        for k in ("mean", "momentum", "hess"):
            assert torch.equal(after[i][k], st[k]), k
    opt.step(_closure(opt, x, y))  # training goes on
    assert all(torch.isfinite(q).all() for q in model.parameters())


def test_parameter_groups_step_sizes_prior_precisions_and_schedulers():
    """Parameter groups: each group moves by the closed-form step with its own ``lr`` and
    its own slice of ``delta``; one group = the single-group optimizer exactly; a scheduler
    editing ``param_groups`` applies at the next step; keys that act on the whole posterior
    are refused per group, naming the key."""
    torch.manual_seed(3)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    body, head = list(net[0].parameters()), list(net[2].parameters())
    mu = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).clone()
    k = sum(p.numel() for p in body)
    g, h = torch.randn_like(mu), torch.rand_like(mu)
    n, lrs, deltas, b1 = 50, (0.1, 0.003), (2.0, 7.0), 0.9

    groups = [
        {"params": body, "lr": lrs[0], "prior_precision": deltas[0]},
        {"params": head, "lr": lrs[1], "prior_precision": deltas[1]},
    ]
    opt = OGN(groups, ess=n, betas=(b1, 0.99))
    delta = torch.cat([mu.new_full((k,), deltas[0]), mu.new_full((len(mu) - k,), deltas[1])])
    torch.testing.assert_close(opt.prior().precision, delta, atol=0, rtol=0)
    opt.update(g, h)
    lr = torch.cat([mu.new_full((k,), lrs[0]), mu.new_full((len(mu) - k,), lrs[1])])
    dt = delta / n
    want = mu - lr * (g + dt * mu) / (h + dt)  # bias-corrected first step: m^ = g_tot, s^ = h
    torch.testing.assert_close(opt.posterior().mean, want, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(opt.posterior().precision, n * h + delta, atol=0, rtol=1e-10)

    # equal groups: bit-identical to one group
    with torch.no_grad():
        for p, v in zip(net.parameters(), mu.split([p.numel() for p in net.parameters()])):
            p.copy_(v.view_as(p))
    one = OGN(list(net.parameters()), lr=0.01, ess=n)
    one.update(g, h)
    with torch.no_grad():
        for p, v in zip(net.parameters(), mu.split([p.numel() for p in net.parameters()])):
            p.copy_(v.view_as(p))
    two = OGN([{"params": body}, {"params": head}], lr=0.01, ess=n)
    two.update(g, h)
    assert torch.equal(one.posterior().mean, two.posterior().mean)

    # a scheduler that sets the head's lr to zero freezes the head at the next step
    sched = torch.optim.lr_scheduler.LambdaLR(two, [lambda e: 1.0, lambda e: 0.0])
    before = two.posterior().mean.clone()
    two.update(g, h)
    assert sched.get_last_lr() == [0.01, 0.0]
    assert torch.equal(two.posterior().mean[k:], before[k:])
    assert not torch.equal(two.posterior().mean[:k], before[:k])
    state = two.state_dict()
    assert [grp["lr"] for grp in state["param_groups"]] == [0.01, 0.0]

    with pytest.raises(ValueError, match=r"\['betas'\].*one betas for all parameter groups"):
        OGN([{"params": body, "betas": (0.5, 0.5)}, {"params": head}], ess=n)
    with pytest.raises(ValueError, match="unknown keys \\['momentum'\\]"):
        OGN([{"params": body, "momentum": 0.9}], ess=n)
    with pytest.raises(ValueError, match=r"params_or_model\[1\]\['lr'\] must be a positive"):
        OGN([{"params": body}, {"params": head, "lr": -1.0}], ess=n)
    with pytest.raises(ValueError, match="group key"):
        OGN(
            [{"params": body, "prior_precision": 1.0}, {"params": head}],
            prior_mean=DiagonalGaussian(mu, torch.ones_like(mu)),
            ess=n,
        )


def test_torch_per_parameter_state_holds_the_posterior():
    """``opt.state[p]`` is VOGN's state (torch's per-parameter convention), tensors of its
    own shaped like ``p`` (no views of a shared flat buffer): mean, momentum, ``s``, prior
    and step follow every step, :meth:`set_prior` and a load."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    opt = VOGN(net, lr=0.1, ess=20, prior_precision=3.0)
    x, y = torch.randn(8, 3, dtype=D), torch.randint(0, 2, (8,))
    g, h = torch.randn(opt.posterior().mean.numel(), dtype=D), torch.rand(26, dtype=D)
    mu0 = opt.posterior().mean
    opt.update(g, h)
    # by hand: m = (1 - b1)(g + dt mu0), s = (1 - b2) h, s^ = h, mu = mu0 - lr m / (1 - b1) / ...
    dt = 3.0 / 20
    m = 0.1 * (g + dt * mu0)
    want_mu = mu0 - 0.1 * (m / 0.1) / (h + dt)
    sizes = [p.numel() for p in net.parameters()]
    ptrs = set()
    for p, m_p, s_p, mu_p in zip(net.parameters(), m.split(sizes), (1e-3 * h).split(sizes),
                                 want_mu.split(sizes)):  # fmt: skip
        st = opt.state[p]
        assert set(st) == {"mean", "momentum", "hess", "prior_mean", "prior_precision", "step"}
        torch.testing.assert_close(st["momentum"], m_p.view_as(p), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(st["hess"], s_p.view_as(p), rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(st["mean"], mu_p.view_as(p), rtol=1e-12, atol=1e-14)
        assert torch.equal(st["mean"], p.detach()) and st["step"] == 1
        for v in st.values():
            if torch.is_tensor(v):
                assert v.shape == p.shape
                ptrs.add(v.untyped_storage().data_ptr())
    assert len(ptrs) == 5 * len(sizes)  # every tensor its own storage
    q = opt.posterior()
    opt.set_prior()
    p0 = next(net.parameters())
    assert torch.equal(opt.state[p0]["prior_precision"], q.precision[: p0.numel()].view_as(p0))
    assert opt.state[p0]["step"] == 0 and opt.state[p0]["momentum"].abs().max() == 0
    saved = copy.deepcopy(opt.state_dict())
    other = VOGN(net, lr=0.1, ess=20)
    other.load_state_dict(saved)
    assert other.state[p0]["step"] == 0
    assert torch.equal(other.state[p0]["prior_precision"], q.precision[: p0.numel()].view_as(p0))
    opt.state.clear()  # torch's meaning: the state restarts (the constructor's prior)
    opt.step(_closure(opt, x, y))
    assert opt.state[p0]["step"] == 1
    assert torch.equal(opt.prior().precision, torch.full_like(q.precision, 3.0))


def _assert_same_next_step(opt, other, x, y, seed):
    """Same weights now, and the same posterior, bit for bit, after one step of each with
    the same seed."""
    for a, b in zip(opt.params, other.params):
        assert torch.equal(a, b)
    for o in (opt, other):
        torch.manual_seed(seed)
        o.step(_closure(o, x, y))
    assert torch.equal(opt.posterior().mean, other.posterior().mean)
    assert torch.equal(opt.posterior().precision, other.posterior().precision)


def _flat_state(opt, key):
    """``opt.state[p][key]`` of every parameter, flat in the optimizer's order."""
    return torch.cat([opt.state[p][key].reshape(-1) for p in opt.params])


def test_minibatch_curvature_routes_an_avalanche_multitask_module_by_task_label():
    """An Avalanche ``MultiTaskModule`` (no ``n_heads``) is routed by task label like a fromp
    multi-head model: each group of the mini-batch through its own head."""
    from avalanche.models import MultiTaskModule

    class TwoHeads(MultiTaskModule):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(5, 4)
            self.heads = nn.ModuleList([nn.Linear(4, 2), nn.Linear(4, 2)])

        def forward_single_task(self, x, task_label):
            return self.heads[int(task_label)](torch.tanh(self.body(x)))

    torch.manual_seed(0)
    net = TwoHeads()
    x, y = torch.randn(8, 5), torch.randint(0, 2, (8,))
    tasks = torch.tensor([0, 1, 0, 1, 1, 0, 0, 1])
    opt = VOGN(net, lr=0.1, ess=8)
    got = minibatch_curvature(net, x, y, tasks, opt)
    want = torch.zeros_like(got)
    for t in (0, 1):
        rows = tasks == t
        stats = per_example_grad_stats(with_task(net, t), x[rows], y[rows], "categorical")
        want += stats.curv * int(rows.sum())
    assert want[-10:].abs().sum() > 0 and want[-20:-10].abs().sum() > 0  # both heads
    torch.testing.assert_close(got, want / 8)


class _CurvatureProbe(SupervisedPlugin):
    """After the VOGN plugin handed over ``h`` (before the update, the parameters still
    hold the draw ``w``): the squared per-example gradients of the loss Avalanche trains,
    ``cross_entropy(model(x_i, t_i), y_i)`` (its padded multi-task output), by a loop over
    examples at ``w``, beside the ``h`` handed over."""

    def __init__(self) -> None:
        super().__init__()
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []

    def before_update(self, strategy, **kwargs):
        opt, model = strategy.optimizer, strategy.model
        x, y, tl = strategy.mb_x, strategy.mb_y, strategy.mb_task_id
        if strategy.clock.train_exp_counter == 0:  # tasks 2 and 3 only
            return
        rows = []
        for i in range(len(x)):
            out = model(x[i : i + 1], tl[i : i + 1])
            loss = torch.nn.functional.cross_entropy(out, y[i : i + 1])
            grads = torch.autograd.grad(loss, opt.params, allow_unused=True)
            rows.append(torch.cat([
                (torch.zeros_like(p) if g is None else g).reshape(-1)
                for g, p in zip(grads, opt.params)
            ]))  # fmt: skip
        self.pairs.append((opt._pending_curv.clone(), torch.stack(rows).pow(2).mean(0)))


def test_vogn_and_ivon_train_avalanche_multitask_mlp_over_three_experiences():
    """Avalanche's ``MTSimpleMLP`` (a ``MultiTaskModule`` whose ``MultiHeadClassifier``
    adds a head per new task label, after the optimizers were built): VOGN and IVON follow
    the parameters added and replaced. In tasks 2 and 3, the curvature the VOGN plugin
    hands over for every mini-batch (from the layer capture or from the recorded call)
    equals the squared per-example gradients of the loss Avalanche trains,
    ``cross_entropy(model(x_i, t_i), y_i)`` with its output padded to all classes seen, by
    a loop over examples (the heads of other tasks get none; a head fixed by
    ``with_task`` gives the unpadded output, another loss); every posterior covers all the
    parameters the model has then."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from fromp_avalanche.ivon import IVONStrategy
    from test_avalanche_models import _benchmark, _model

    for name, reuse in (("vogn", False), ("vogn", True), ("ivon", None)):
        bm = _benchmark(True)
        model = _model("mt")
        model.features[2].p = 0.0  # no dropout: one function for both routes
        probe = _CurvatureProbe()
        if name == "vogn":
            opt = VOGN(model, lr=0.05, ess=20)
            strat = VOGNStrategy(
                model=model, optimizer=opt, train_mb_size=10, evaluator=None,
                reuse_forward=reuse, plugins=[probe],
            )  # fmt: skip
        else:
            opt = IVON(model.parameters(), lr=0.05, ess=20)
            strat = IVONStrategy(model=model, optimizer=opt, train_mb_size=10, evaluator=None)
        for exp in bm.train_stream:
            strat.train(exp)
            n_params = sum(p.numel() for p in model.parameters())
            q = strat.plugin.posteriors[-1]
            assert q.num_params == n_params and bool(torch.isfinite(q.precision).all())
        if name == "vogn":
            assert probe.pairs, "no mini-batch was checked"
            for h, want in probe.pairs:
                torch.testing.assert_close(h, want, rtol=1e-4, atol=1e-10)


def test_a_parameter_added_later_gets_its_state_at_its_first_step():
    """A parameter added after construction (a new head) has no state until the next step,
    which gives it mean its value, no momentum, ``s`` at ``hess_init``, the group's prior
    and the current step count; the state of the others is kept."""
    torch.manual_seed(0)
    body = nn.Linear(3, 2).to(D)
    opt = VOGN(list(body.parameters()), lr=0.1, ess=20, prior_precision=3.0, hess_init=0.5)
    g = torch.randn(8, dtype=D)
    opt.update(g, torch.rand(8, dtype=D))
    kept = {k: v.clone() for k, v in opt.state[body.weight].items() if torch.is_tensor(v)}
    head = nn.Parameter(torch.randn(2, dtype=D))
    opt.add_param_group({"params": [head], "prior_precision": 7.0})
    assert head not in opt.state
    start = head.detach().clone()
    opt.update(torch.zeros(10, dtype=D), torch.zeros(10, dtype=D))
    st = opt.state[head]
    assert st["step"] == 2 and opt.state[body.weight]["step"] == 2
    torch.testing.assert_close(st["prior_precision"], torch.full((2,), 7.0, dtype=D))
    torch.testing.assert_close(st["hess_init"], torch.full((2,), 0.5, dtype=D))
    # its first update from m = 0, s = 0.5: m = 0.1 * 7/20 * start, s = 0.999 * 0.5
    dt = 7.0 / 20
    m = 0.1 * dt * start
    torch.testing.assert_close(st["momentum"], m, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(st["hess"], torch.full((2,), 0.999 * 0.5, dtype=D))
    want = start - 0.1 * m / (1 - 0.9**2) / (0.999 * 0.5 + dt)
    torch.testing.assert_close(head.detach(), want, rtol=1e-12, atol=1e-15)
    # the body's state was kept: its momentum continues from step 1 (g = 0 now)
    want_m = 0.9 * kept["momentum"] + 0.1 * (3.0 / 20) * kept["mean"]
    torch.testing.assert_close(opt.state[body.weight]["momentum"], want_m, rtol=1e-12, atol=1e-15)


def test_plugin_refuses_a_state_without_its_keys_and_round_trips_its_own():
    """A VOGNPlugin state without its experience keys (an older plugin's) is refused naming
    what it lacks; a new one holds torch's state dict and round-trips."""
    from fromp_avalanche.vogn import VOGNPlugin

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    x, y = torch.randn(8, 3, dtype=D), torch.randint(0, 2, (8,))
    opt = VOGN(net, lr=0.1, ess=20, prior_precision=3.0)
    for _ in range(2):
        opt.step(_closure(opt, x, y))
    q = opt.posterior()
    old = {"vogn": opt.state_dict(), "posteriors": [q.state_dict()], "task_count": 1}
    net2 = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D)
    opt2 = VOGN(net2, lr=0.1, ess=1)
    plugin = VOGNPlugin(opt2)
    with pytest.raises(ValueError, match=r"missing keys \['experiences', 'continual'\]"):
        plugin.load_state_dict(old)
    plugin.optimizer = opt
    plugin.posteriors, plugin.experiences, plugin.task_count = [q], [0], 1
    new = plugin.state_dict()
    assert set(new["vogn"]) == {"state", "param_groups"} and new["experiences"] == [0]
    opt3 = VOGN(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(D), lr=0.1)
    back = VOGNPlugin(opt3)
    back.load_state_dict(new)
    assert back.task_count == 1 and back.experiences == [0]
    torch.testing.assert_close(back.posteriors[0].mean, q.mean, rtol=0, atol=0)
    _assert_same_next_step(opt, opt3, x, y, seed=3)
