"""VCL strategy: ELBO loss, posterior propagation, coresets, state round trip."""

from __future__ import annotations

import warnings

import pytest
import torch
from avalanche.core import SupervisedPlugin
from avalanche.evaluation.metrics import accuracy_metrics
from avalanche.training.plugins import EvaluationPlugin
from fromp_avalanche.models import as_avalanche_model
from fromp_avalanche.vcl import VCL, VCLPlugin
from fromp_bench.data import to_avalanche
from fromp_bench.settings import SETTINGS

from fromp.continual.bayesian import MeanFieldTwin
from fromp.models import MultiHeadMLP
from tests.cases import synthetic_split


def _strategy(net, **kw):
    model = as_avalanche_model(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    args = dict(train_mb_size=16, train_epochs=8, train_samples=3, test_samples=20)
    args.update(kw)
    with warnings.catch_warnings():  # the announcement of the log-variances' group
        warnings.filterwarnings("ignore", message="VCL: the posterior")
        return VCL(
            model=model,
            optimizer=opt,
            eval_mb_size=64,
            evaluator=EvaluationPlugin(accuracy_metrics(experience=True), loggers=[]),
            **args,
        )


def _accs(res):
    return [v for k, v in sorted(res.items()) if k.startswith("Top1_Acc_Exp")]


def _state_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_vcl_multi_head_posterior_propagation_and_round_trip():
    seq = synthetic_split(n_tasks=3, input_shape=(1, 4, 4), train_size=100, test_size=20)
    scenario = to_avalanche(seq)
    torch.manual_seed(0)
    net = MultiHeadMLP(16, (12,), n_heads=3, head_size=2)
    strat = _strategy(net, ml_init_epochs=5, seed=1, mean_init_std=0.1)
    assert strat.model.net is net  # the user's model, in fromp's Avalanche adapter
    q = strat.method.mean_field
    assert isinstance(q, MeanFieldTwin) and q.model is net
    # means re-drawn in the user's network as in the reference code: truncated N(0, 0.1^2)
    assert max(float(p.detach().abs().max()) for p in net.parameters()) <= 0.2
    # the optimizer trains the model's parameters (group 0) and the log-variances (group 1)
    strat.train(scenario.train_stream[0])
    groups = [{id(p) for p in g["params"]} for g in strat.optimizer.param_groups]
    assert groups == [{id(p) for p in net.parameters()}, {id(p) for p in q.logvars.values()}]
    assert strat.plugin.method.seen_heads == {0} and strat.plugin.method.task_count == 1
    # the posterior became the prior for the body and head 0; head 2 keeps N(0, 1)
    assert q.kl([0]).abs() < 1e-5
    assert torch.all(q.prior_variance["heads.2.weight"] == 1.0)
    assert torch.all(q.prior_mean["heads.2.weight"] == 0.0)
    # log-variances moved away from the initial -6 only where trained
    assert not torch.allclose(q.variance("heads.0.weight").log(), torch.tensor(-6.0))
    assert torch.all(q.logvars["heads__2__weight"] == -6.0)
    strat.train(scenario.train_stream[1])
    assert strat.plugin.method.seen_heads == {0, 1}
    accs = _accs(strat.eval(scenario.test_stream[:2]))
    assert len(accs) == 2 and min(accs) > 0.7

    state = strat.plugin.state_dict()
    assert "logvars" in state["mean_field"] and not any("_mu" in k for k in state["mean_field"])
    torch.manual_seed(5)
    other_net = MultiHeadMLP(16, (12,), n_heads=3, head_size=2)
    other = _strategy(other_net)
    other.plugin.load_state_dict(state)
    other_q = other.method.mean_field
    assert _state_equal(dict(other_q.logvars.items()), dict(q.logvars.items()))
    assert _state_equal(other_q.prior_mean, q.prior_mean)
    assert other.plugin.method.seen_heads == {0, 1} and other.plugin.method.task_count == 2
    with pytest.raises(ValueError, match="missing"):
        other.plugin.load_state_dict({"mean_field": state["mean_field"]})


def test_vcl_loss_is_mc_nll_plus_kl_over_n():
    seq = synthetic_split(n_tasks=2, input_shape=(1, 4, 4), train_size=30, test_size=10)
    scenario = to_avalanche(seq)
    torch.manual_seed(0)
    strat = _strategy(MultiHeadMLP(16, (8,), n_heads=2, head_size=2), train_epochs=1)
    seen = {}

    class Probe(SupervisedPlugin):
        def after_backward(self, strategy, **kwargs):
            if "loss" not in seen:
                logits = strategy._mc_logits.detach()
                s, n, k = logits.shape
                nll = torch.nn.functional.cross_entropy(
                    logits.reshape(s * n, k), strategy.mb_y.repeat(s)
                )
                kl = strategy.method.mean_field.kl([0]).detach() / strategy.plugin.method.ess
                seen["loss"], seen["ref"] = strategy.loss.detach(), nll + kl

    strat.plugins.append(Probe())
    strat.train(scenario.train_stream[0])
    torch.testing.assert_close(seen["loss"].reshape(()), seen["ref"])
    assert strat.plugin.method.ess == 30


def test_vcl_coreset_kept_out_and_posterior_restored_after_eval():
    seq = synthetic_split(n_tasks=2, input_shape=(1, 4, 4), train_size=100, test_size=20)
    scenario = to_avalanche(seq)
    torch.manual_seed(0)
    net = MultiHeadMLP(16, (12,), n_heads=2, head_size=2)
    strat = _strategy(net, coreset_size=6, coreset_method="kcenter", coreset_epochs=3)
    assert strat.model.net is net
    trained_on = []

    class Record(SupervisedPlugin):
        def before_training_iteration(self, strategy, **kwargs):
            trained_on.append(
                (strategy.clock.train_exp_counter, strategy.mb_x.reshape(len(strategy.mb_x), -1))
            )

    strat.plugins.append(Record())
    for exp in scenario.train_stream:
        strat.train(exp)
    plugin = strat.plugin
    assert [h for h, _, _ in plugin.method.coresets] == [0, 1]
    assert all(len(x) == 6 for _, x, _ in plugin.method.coresets)
    assert plugin.method.ess == 100 - 6  # the task's 100 examples minus its coreset
    for t in (0, 1):
        cx = plugin.method.coresets[t][1].reshape(6, -1)
        tx = seq[t].train_x.reshape(len(seq[t].train_x), -1)
        # k-center picks the first example first, as the reference code
        assert torch.equal(cx[0], tx[0])
        assert (cx[:, None] == tx[None]).all(-1).any(1).all()  # coreset points come from D_t
        seen_x = torch.cat([x for e, x in trained_on if e == t])
        assert len(seen_x) == 94 * strat.train_epochs
        assert not (cx[:, None] == seen_x[None]).all(-1).any()  # ... but are not trained on
    q = strat.method.mean_field
    before = {k: v.clone() for k, v in q.state_dict().items()}
    accs = _accs(strat.eval(scenario.test_stream))
    assert len(accs) == 2 and min(accs) > 0.7
    assert _state_equal(q.state_dict(), before)  # propagated posterior restored

    # the eval-time coreset training changes the posterior used for prediction: the user's
    # model holds the tuned means while its task is evaluated
    snap = {}

    class Peek(SupervisedPlugin):
        def before_eval_iteration(self, strategy, **kwargs):
            snap.setdefault(
                strategy.experience.current_experience,
                {k: v.clone() for k, v in strategy.model.net.state_dict().items()},
            )

    strat.plugins.append(Peek())
    strat.eval(scenario.test_stream)
    assert not torch.equal(snap[0]["heads.0.weight"], before["model.heads.0.weight"])
    assert torch.equal(net.heads[0].weight, before["model.heads.0.weight"])  # restored after


def test_vcl_single_head_random_coreset():
    seq = synthetic_split(
        n_tasks=2, input_shape=(8,), train_size=100, test_size=20, multi_head=False
    )
    scenario = to_avalanche(seq)
    torch.manual_seed(0)
    net = MultiHeadMLP(8, (10,), n_heads=1, head_size=2)
    strat = _strategy(net, coreset_size=4, coreset_method="random", ml_init_epochs=0)
    assert strat.model is net  # single head: no Avalanche multi-task wrapper
    for exp in scenario.train_stream:
        strat.train(exp)
    assert [h for h, _, _ in strat.plugin.method.coresets] == [0, 0]
    accs = _accs(strat.eval(scenario.test_stream))
    assert len(accs) == 2 and min(accs) > 0.6


@pytest.mark.parametrize(
    "bad",
    [
        {"coreset_size": 5},
        {"coreset_size": -1},
        {"train_samples": 0},
        {"ml_init_epochs": -1},
    ],
)
def test_bad_arguments(bad):
    with pytest.raises(ValueError, match=next(iter(bad)).split("_")[0]):
        _strategy(MultiHeadMLP(4, (3,), n_heads=2, head_size=2), **bad)


def test_defaults_follow_the_contract():
    for name in ("vcl", "vcl-coreset"):
        for bench in ("split-mnist", "permuted-mnist", "split-cifar", "split-fashion-mnist"):
            d = SETTINGS[name][bench]
            assert {"optimizer", "lr", "train_epochs", "train_mb_size", "kwargs"} <= set(d)
    assert SETTINGS["vcl-coreset"]["split-mnist"]["kwargs"]["coreset_size"] == 40
    assert SETTINGS["vcl-coreset"]["permuted-mnist"]["kwargs"]["coreset_size"] == 200


def test_runner_resume_matches_uninterrupted_run(tmp_path):
    """Checkpoint after 2 experiences and resume in a fresh strategy: same results."""
    from fromp_bench.runner import RunConfig, run

    kw = dict(
        seed=0,
        progress=False,
        train_size=60,
        test_size=30,
        overrides={"train_epochs": 2, "kwargs": {"coreset_epochs": 3, "test_samples": 5}},
    )
    full = run(RunConfig("split-digits", "vcl-coreset", **kw))
    ck = str(tmp_path / "vcl.pt")
    run(RunConfig("split-digits", "vcl-coreset", checkpoint=ck, stop_after=2, **kw))
    resumed = run(RunConfig("split-digits", "vcl-coreset", checkpoint=ck, resume=True, **kw))
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    assert len(full["accuracy_matrix"]) == 5


def test_the_strategy_takes_every_setting_of_the_method():
    import inspect

    from fromp_avalanche.vcl import METHOD_SETTINGS

    from fromp.continual.vcl import VCLMethod

    params = inspect.signature(VCL).parameters
    assert set(METHOD_SETTINGS) == set(inspect.signature(VCLMethod).parameters) - {"net"}
    assert set(METHOD_SETTINGS) <= set(params) and "prior_var" not in params
    strat = _strategy(MultiHeadMLP(4, (3,), n_heads=2, head_size=2), prior_precision=4.0)
    assert strat.method.prior_precision == 4.0
    assert torch.all(strat.method.mean_field.prior_variance["heads.1.weight"] == 0.25)
    # an optimizer of several groups keeps them: the log-variances come as one more
    model = MultiHeadMLP(4, (3,), n_heads=2, head_size=2)
    opt = torch.optim.SGD([{"params": [p], "lr": 0.1 * (i + 1)} for i, p in
                           enumerate(model.parameters())], lr=0.5)  # fmt: skip
    n = len(opt.param_groups)
    with pytest.warns(UserWarning, match=f"parameter group {n}"):
        strat = VCL(model=as_avalanche_model(model), optimizer=opt)
    assert strat.optimizer is opt and len(opt.param_groups) == n + 1
    assert [g["lr"] for g in opt.param_groups] == [0.1 * (i + 1) for i in range(n)] + [0.5]
    with pytest.raises(ValueError, match=r"optimizer must be a torch\.optim\.Optimizer"):
        VCL(model=as_avalanche_model(model), optimizer=object())


def test_vcl_coreset_on_any_module_through_the_twin():
    """Coresets on a plain module (a MeanFieldTwin): kept out of training, trained on before
    evaluation, and the propagated posterior restored afterwards."""
    from torch import nn

    seq = synthetic_split(
        n_tasks=2, input_shape=(8,), train_size=60, test_size=20, multi_head=False
    )
    scenario = to_avalanche(seq)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 10), nn.ReLU(), nn.Linear(10, 2))
    strat = _strategy(net, coreset_size=4, coreset_method="random", coreset_epochs=2, seed=0)
    q = strat.method.mean_field
    assert isinstance(q, MeanFieldTwin) and type(strat.plugin) is VCLPlugin
    assert strat.model is net and q.model is net
    for exp in scenario.train_stream:
        strat.train(exp)
    assert [h for h, _, _ in strat.plugin.method.coresets] == [0, 0]
    assert strat.plugin.method.ess == 56
    before = {k: v.clone() for k, v in q.state_dict().items()}
    tuned = {}

    class Peek(SupervisedPlugin):
        def before_eval_iteration(self, strategy, **kwargs):
            tuned.setdefault("w", strategy.model[2].weight.detach().clone())

    strat.plugins.append(Peek())
    accs = _accs(strat.eval(scenario.test_stream))
    assert len(accs) == 2 and min(accs) > 0.6
    assert not torch.equal(tuned["w"], before["model.2.weight"])  # trained on the coreset
    assert _state_equal(q.state_dict(), before)  # ... and restored
