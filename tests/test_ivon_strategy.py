"""IVON inside Avalanche: continual IVON (posterior -> prior across Avalanche's optimizer
resets, checkpoints, three tasks), FROMP with IVON's posterior as the kernel, and the
runner's ``ivon`` / ``fromp-ivon`` strategies."""

from __future__ import annotations

import warnings

import pytest
import torch
from _synthetic import synthetic_split
from avalanche.evaluation.metrics import accuracy_metrics
from avalanche.training.plugins import EvaluationPlugin, SupervisedPlugin
from fromp_avalanche.fromp import FROMP, FROMPPlugin
from fromp_avalanche.ivon import IVONPlugin, IVONStrategy
from fromp_avalanche.models import as_avalanche_model
from fromp_bench.data import to_avalanche

from fromp.curvature.jacobian import flat_params
from fromp.models import MultiHeadMLP
from fromp.optim import IVON

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _evaluator() -> EvaluationPlugin:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return EvaluationPlugin(accuracy_metrics(experience=True), loggers=[])


class _Probe(SupervisedPlugin):
    """Records the IVON state at the start of every experience (after Avalanche has reset
    the optimizer) and checks that the forward pass sees a draw and evaluation the mean."""

    def __init__(self):
        super().__init__()
        self.seen: list[dict] = []
        self.sampled_forwards = 0

    def before_training_epoch(self, strategy, **kwargs):
        if strategy.clock.train_exp_epochs == 0:
            opt = strategy.optimizer
            self.seen.append(
                {
                    "prior": opt.prior(strategy.model),
                    "mean": flat_params(strategy.model).clone(),
                    "step": opt.state[opt.params[0]]["step"],
                    "state": dict(opt.state),
                    "ess": opt.ess,
                }
            )

    def after_forward(self, strategy, **kwargs):
        self.sampled_forwards += int(strategy.optimizer.sampled)

    def before_eval_exp(self, strategy, **kwargs):
        assert not strategy.optimizer.sampled


def _setup(seed: int = 0, n_tasks: int = 3):
    torch.manual_seed(seed)
    seq = synthetic_split(n_tasks=n_tasks, input_shape=(1, 4, 4), n_train=48, n_test=24)
    net = MultiHeadMLP(16, (16,), n_heads=n_tasks, head_size=2)
    model = as_avalanche_model(net)
    opt = IVON(model.parameters(), lr=0.5, ess=1.0, hess_init=0.5, betas=(0.9, 0.99))
    probe = _Probe()
    strat = IVONStrategy(
        model=model,
        optimizer=opt,
        train_mb_size=16,
        train_epochs=8,
        plugins=[probe],
        evaluator=None,
    )
    return seq, to_avalanche(seq), net, model, opt, probe, strat


def test_continual_ivon_three_tasks_posterior_becomes_prior_and_resumes():
    seq, scenario, net, model, opt, probe, strat = _setup()
    strat.train(scenario.train_stream[0])
    q1 = strat.plugin.posteriors[0]
    assert opt.ess == 48 and probe.sampled_forwards == 8 * 3
    torch.testing.assert_close(q1.mean, flat_params(net), rtol=0, atol=0)  # mean restored
    torch.testing.assert_close(opt.prior(net).mean, q1.mean, rtol=0, atol=0)
    torch.testing.assert_close(opt.prior(net).precision, q1.precision, rtol=0, atol=0)
    ckpt = (
        strat.plugin.state_dict(),
        opt.state_dict(),
        {k: v.clone() for k, v in model.state_dict().items()},
    )

    torch.manual_seed(11)
    strat.train(scenario.train_stream[1])
    start2 = probe.seen[1]  # the prior of task 2 is the posterior of task 1, step restarted
    assert start2["step"] == 0
    p0 = opt.params[0]
    assert "prior_precision" in opt.state[p0]
    torch.testing.assert_close(start2["prior"].precision, q1.precision, rtol=0, atol=0)
    torch.testing.assert_close(start2["mean"], q1.mean, rtol=0, atol=0)
    q2 = strat.plugin.posteriors[1]
    assert not torch.equal(q2.mean, q1.mean)
    # precision N2 h + p0: it grows from task to task where the new data has curvature
    assert (q2.precision > q1.precision).float().mean() > 0.5
    strat.train(scenario.train_stream[2])
    assert strat.plugin.task_count == 3 and len(strat.plugin.posteriors) == 3
    net.eval()
    acc = [(net(t.test_x, t.task_id).argmax(-1) == t.test_y).float().mean().item() for t in seq]
    assert min(acc) > 0.6, acc

    # resume task 2 from the checkpoint in fresh objects: the same posterior
    _, scenario2, _, model2, opt2, _, strat2 = _setup(seed=123)
    model2.load_state_dict(ckpt[2])
    strat2.plugin.load_state_dict(ckpt[0])
    opt2.load_state_dict(ckpt[1])
    torch.manual_seed(11)
    strat2.train(scenario2.train_stream[1])
    torch.testing.assert_close(strat2.plugin.posteriors[1].mean, q2.mean, rtol=0, atol=0)
    torch.testing.assert_close(strat2.plugin.posteriors[1].precision, q2.precision)


def test_non_continual_keeps_weight_decay_prior_and_type_checks():
    seq = synthetic_split(n_tasks=2, input_shape=(1, 4, 4), n_train=32, n_test=8)
    net = MultiHeadMLP(16, (8,), n_heads=2, head_size=2)
    model = as_avalanche_model(net)
    opt = IVON(model.parameters(), lr=0.1, ess=1.0, prior_precision=1e-3)
    strat = IVONStrategy(
        model=model, optimizer=opt, train_mb_size=16, evaluator=None, continual=False
    )
    strat.train(to_avalanche(seq).train_stream[0])
    assert opt.prior().mean.abs().max() == 0 and opt.state[opt.params[0]]["step"] == 2
    with pytest.raises(TypeError, match="IVON"):
        IVONStrategy(model=net, optimizer=torch.optim.Adam(net.parameters()))
    with pytest.raises(ValueError, match="exactly"):
        IVONStrategy(model=net, optimizer=IVON(list(net.parameters())[:1], lr=0.1, ess=1))
    with pytest.raises(ValueError, match="no optimizer"):
        IVONPlugin().load_state_dict({})


def _fromp_ivon(ess: float, **kwargs):
    """Three synthetic tasks, a small multi-head MLP and FROMP on IVON (``kwargs``: FROMP's)."""
    seq = synthetic_split(n_tasks=3, input_shape=(1, 4, 4), n_train=40, n_test=16)
    torch.manual_seed(0)
    net = MultiHeadMLP(16, (8,), n_heads=3, head_size=2)
    model = as_avalanche_model(net)
    opt = IVON(model.parameters(), lr=0.1, ess=ess, hess_init=0.5, betas=(0.9, 0.99))
    strategy = FROMP(
        model=model, optimizer=opt, train_mb_size=16, train_epochs=2, evaluator=_evaluator(),
        n_points=4, posterior="ivon", **kwargs,
    )  # fmt: skip
    return to_avalanche(seq), net, opt, strategy


def test_fromp_ivon_kernel_uses_ivon_posterior_over_three_tasks():
    scenario, net, opt, strategy = _fromp_ivon(1.0, tau=1.0, grad_clip_norm=1.0)
    plugin = strategy.plugin
    strategy.train(scenario.train_stream[0])
    # Sigma is IVON's posterior variance 1 / (N (h + delta)) at the end of task 1
    torch.testing.assert_close(plugin.method.posterior_variance(net), opt.posterior(net).variance)
    assert opt.prior(net).mean.abs().max() == 0  # ivon_continual=False: weight-decay prior
    for t in (1, 2):
        strategy.train(scenario.train_stream[t])
        assert len(plugin.method.regularizer) == t + 1 and float(plugin.method.last_penalty) > 0
        variance = opt.posterior(net).variance
        torch.testing.assert_close(plugin.method.posterior_variance(net), variance)
    assert not opt.sampled
    fresh = FROMPPlugin(tau=1.0, n_points=4, grad_clip_norm=1.0, posterior="ivon")
    fresh.load_state_dict(plugin.state_dict())
    assert fresh.method.penalty(net).item() == plugin.method.penalty(net).item()
    with pytest.raises(TypeError, match="IVON"):
        FROMP(
            model=as_avalanche_model(MultiHeadMLP(16, (8,), 2, 2)),
            optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
            posterior="ivon",
        )


class _GradientProbe(SupervisedPlugin):
    """After the FROMP and IVON plugins: per training iteration, the mean ``m`` and the
    regulariser's gradient ``tau grad R(m)`` (before the draw), the data loss's gradient at
    the draw ``theta`` (recomputed here from the mini-batch, not read from the strategy's
    loss), and IVON's gradient estimate ``g^`` read back from the momentum update
    ``g <- b1 g + (1 - b1) g^``."""

    def __init__(self, plugin: FROMPPlugin):
        super().__init__()
        self.plugin = plugin
        self.rows: list[dict] = []

    def before_training_iteration(self, strategy, **kwargs):
        opt = strategy.optimizer
        row = {"task": strategy.clock.train_exp_counter, "pen": None}
        # the state of a parameter is created at its first step (torch's convention)
        row["mom"] = [opt.state[p].get("momentum", torch.zeros_like(p)).clone() for p in opt.params]
        if len(self.plugin.method.regularizer):
            with torch.enable_grad():
                pen = self.plugin.method.tau * self.plugin.method.penalty(strategy.model.net)
                row["pen"] = torch.autograd.grad(pen, opt.params, allow_unused=True)
        self.rows.append(row)

    def before_backward(self, strategy, **kwargs):
        from avalanche.models.utils import avalanche_forward

        assert strategy.optimizer.sampled
        with torch.enable_grad():
            out = avalanche_forward(strategy.model, strategy.mb_x, strategy.mb_task_id)
            loss = torch.nn.functional.cross_entropy(out, strategy.mb_y)
            params = strategy.optimizer.params
            grads = torch.autograd.grad(loss, params, allow_unused=True)
        self.rows[-1]["data"] = [
            torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)
        ]

    def after_update(self, strategy, **kwargs):
        opt, row = strategy.optimizer, self.rows[-1]
        b1 = opt.param_groups[0]["betas"][0]
        row["g_hat"] = [
            (st["momentum"] - b1 * old) / (1 - b1)
            for st, old in zip([opt.state[p] for p in opt.params], row["mom"])
        ]


@pytest.mark.parametrize("where", ["mean", "sample"])
def test_fromp_ivon_penalty_gradient_at_the_mean_after_tasks_2_and_3(where):
    """``ivon_penalty="mean"``: IVON's gradient estimate is the data gradient at the draw
    plus ``tau grad R(m)`` at the mean (sign, factor, where it is evaluated); ``"sample"``:
    the data gradient plus the regulariser's gradient at the draw, so it differs from both
    the data gradient alone and the mean form."""
    scenario, _, _, strategy = _fromp_ivon(40.0, tau=3.0, ivon_penalty=where, jitter=1e-2)
    probe = _GradientProbe(strategy.plugin)
    strategy.plugins.append(probe)
    for t in range(3):
        strategy.train(scenario.train_stream[t])
    checked = 0
    for row in probe.rows:
        data = row["data"]
        if row["pen"] is None:  # task 1: no regulariser, IVON's g^ is the data gradient
            for g, d in zip(row["g_hat"], data):
                torch.testing.assert_close(g, d, rtol=1e-4, atol=1e-6)
            continue
        pen = [torch.zeros_like(d) if r is None else r for r, d in zip(row["pen"], data)]
        size = sum(r.norm() ** 2 for r in pen).sqrt()
        if size < 1e-3:  # the first steps of a task: m still at the old solution
            continue
        excess = [g - d for g, d in zip(row["g_hat"], data)]
        gap = sum((e - r).norm() ** 2 for e, r in zip(excess, pen)).sqrt()
        if where == "mean":
            assert gap <= 1e-4 * size + 1e-6, (row["task"], gap, size)
        else:  # at the draw: a regulariser gradient, but not the one at the mean
            assert sum(e.norm() ** 2 for e in excess).sqrt() > 0.1 * size
            assert gap > 1e-3 * size
        checked += 1
    tasks = {row["task"] for row in probe.rows if row["pen"] is not None}
    assert tasks == {1, 2} and checked >= 4
    assert float(strategy.plugin.method.last_penalty) > 0
    with pytest.raises(ValueError, match="ivon_penalty"):
        FROMPPlugin(posterior="ivon", ivon_penalty="draw")


@pytest.mark.parametrize(
    ("strategy", "antithetic"), [("ivon", False), ("fromp-ivon", False), ("ivon", True)]
)
def test_runner_strategies_run_and_resume(tmp_path, strategy, antithetic):
    from fromp_bench.runner import RunConfig, run

    # antithetic: 3 steps per experience, so a checkpoint after an odd number of experiences
    # holds a pending mirror draw
    extra = {"optimizer_kwargs": {"antithetic": True}, "train_mb_size": 25} if antithetic else {}

    def cfg(path, **kw):
        return RunConfig(
            benchmark="split-digits",
            strategy=strategy,
            seed=0,
            overrides={"train_epochs": 1, "train_mb_size": 32, "kwargs": {}}
            | ({"kwargs": {"n_points": 10}} if strategy == "fromp-ivon" else {})
            | extra,
            n_train=60,
            n_test=30,
            checkpoint=str(path / "run.pt"),
            progress=False,
            **kw,
        )

    full = run(cfg(tmp_path / "a"))
    assert full["complete"] and full["settings"]["optimizer"] == "ivon"
    assert full["settings"]["optimizer_kwargs"].get("antithetic", False) == antithetic
    part = run(cfg(tmp_path / "b", stop_after=3 if antithetic else 2))  # 9 draws: odd
    assert not part["complete"]
    resumed = run(cfg(tmp_path / "b", resume=True))
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    assert resumed["mean_nll"] == full["mean_nll"]  # continuous in the weights: exact resume


def test_tempered_prior_scales_each_posterior_after_tasks_1_and_2():
    """``prior_scale``: after every experience the next prior is the posterior with its
    precision times the scale (same mean); the recorded posteriors are not tempered, and the
    second posterior's precision is built on the tempered first prior. Bad scales are refused
    by name."""
    torch.manual_seed(0)
    seq = synthetic_split(n_tasks=3, input_shape=(1, 4, 4), n_train=48, n_test=24)
    net = MultiHeadMLP(16, (16,), n_heads=3, head_size=2)
    model = as_avalanche_model(net)
    opt = IVON(model.parameters(), lr=0.5, ess=1.0, hess_init=0.5, betas=(0.9, 0.99))
    probe = _Probe()
    strat = IVONStrategy(model=model, optimizer=opt, train_mb_size=16, train_epochs=4,
                         prior_scale=0.25, plugins=[probe], evaluator=None)  # fmt: skip
    scenario = to_avalanche(seq)
    for t in range(2):
        strat.train(scenario.train_stream[t])
        q = strat.plugin.posteriors[t]
        torch.testing.assert_close(opt.prior(net).mean, q.mean, rtol=0, atol=0)
        torch.testing.assert_close(opt.prior(net).precision, 0.25 * q.precision)
    strat.train(scenario.train_stream[2])
    start2, start3 = probe.seen[1], probe.seen[2]
    q1, q2 = strat.plugin.posteriors[:2]
    torch.testing.assert_close(start2["prior"].precision, 0.25 * q1.precision)
    torch.testing.assert_close(start3["prior"].precision, 0.25 * q2.precision)
    # q2 = N2 (h + p0 / N2) with the tempered p0: its precision exceeds the tempered prior's
    assert (q2.precision > 0.25 * q1.precision).all()
    for bad in (0.0, -1.0, float("inf"), float("nan"), True, "0.5"):
        with pytest.raises(ValueError, match="prior_scale"):
            IVONStrategy(model=model, optimizer=opt, prior_scale=bad)
