"""VCL strategy: ELBO loss, posterior propagation, coresets, state round trip."""

from __future__ import annotations

import pytest
import torch
from _synthetic import synthetic_split
from avalanche.core import SupervisedPlugin
from avalanche.evaluation.metrics import accuracy_metrics
from avalanche.training.plugins import EvaluationPlugin
from fromp_avalanche.models import as_avalanche_model
from fromp_avalanche.vcl import VCL, VCLPlugin
from fromp_bench.data import to_avalanche
from fromp_bench.settings import SETTINGS

from fromp.continual.bayesian import BayesMultiHeadModel
from fromp.models import MultiHeadMLP


def _strategy(net, **kw):
    model = as_avalanche_model(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    args = dict(train_mb_size=16, train_epochs=8, train_samples=3, test_samples=20)
    args.update(kw)
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
    seq = synthetic_split(n_tasks=3, input_shape=(1, 4, 4), n_train=100, n_test=20)
    scenario = to_avalanche(seq)
    torch.manual_seed(0)
    net = MultiHeadMLP(16, (12,), n_heads=3, head_size=2)
    strat = _strategy(net, ml_init_epochs=5, seed=1)
    bnet = strat.net
    assert isinstance(bnet, BayesMultiHeadModel)
    # means re-drawn as in the reference code: truncated N(0, 0.1^2)
    assert max(float(p.detach().abs().max()) for p in bnet.mean_parameters()) <= 0.2
    # the optimizer trains the Bayesian parameters (Avalanche re-points it)
    strat.train(scenario.train_stream[0])
    opt_params = {id(p) for g in strat.optimizer.param_groups for p in g["params"]}
    assert opt_params == {id(p) for p in strat.model.parameters()}
    assert strat.plugin.method.seen_heads == {0} and strat.plugin.method.task_count == 1
    # the posterior became the prior for the body and head 0; head 2 keeps N(0, 1)
    assert bnet.kl([0]).abs() < 1e-5
    assert torch.all(bnet.heads[2].weight_prior_var == 1.0)
    # log-variances moved away from the initial -6 only where trained
    assert not torch.allclose(
        bnet.heads[0].weight_logvar, torch.full_like(bnet.heads[0].weight_logvar, -6.0)
    )
    assert torch.all(bnet.heads[2].weight_logvar == -6.0)
    strat.train(scenario.train_stream[1])
    assert strat.plugin.method.seen_heads == {0, 1}
    accs = _accs(strat.eval(scenario.test_stream[:2]))
    assert len(accs) == 2 and min(accs) > 0.7

    state = strat.plugin.state_dict()
    torch.manual_seed(5)
    other = _strategy(MultiHeadMLP(16, (12,), n_heads=3, head_size=2))
    other.plugin.load_state_dict(state)
    assert _state_equal(other.net.state_dict(), bnet.state_dict())
    assert other.plugin.method.seen_heads == {0, 1} and other.plugin.method.task_count == 2
    with pytest.raises(ValueError, match="missing"):
        other.plugin.load_state_dict({"net": state["net"]})


def test_vcl_loss_is_mc_nll_plus_kl_over_n():
    seq = synthetic_split(n_tasks=2, input_shape=(1, 4, 4), n_train=30, n_test=10)
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
                kl = strategy.net.kl([0]).detach() / strategy.plugin.method.ess
                seen["loss"], seen["ref"] = strategy.loss.detach(), nll + kl

    strat.plugins.append(Probe())
    strat.train(scenario.train_stream[0])
    torch.testing.assert_close(seen["loss"].reshape(()), seen["ref"])
    assert strat.plugin.method.ess == 30


def test_vcl_coreset_kept_out_and_posterior_restored_after_eval():
    seq = synthetic_split(n_tasks=2, input_shape=(1, 4, 4), n_train=100, n_test=20)
    scenario = to_avalanche(seq)
    torch.manual_seed(0)
    net = MultiHeadMLP(16, (12,), n_heads=2, head_size=2)
    strat = _strategy(net, coreset_size=6, coreset_method="kcenter", coreset_epochs=3)
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
    before = {k: v.clone() for k, v in strat.net.state_dict().items()}
    accs = _accs(strat.eval(scenario.test_stream))
    assert len(accs) == 2 and min(accs) > 0.7
    assert _state_equal(strat.net.state_dict(), before)  # propagated posterior restored

    # the eval-time coreset training changes the posterior used for prediction
    snap = {}

    class Peek(SupervisedPlugin):
        def before_eval_iteration(self, strategy, **kwargs):
            snap.setdefault(
                strategy.experience.current_experience,
                {k: v.clone() for k, v in strategy.net.state_dict().items()},
            )

    strat.plugins.append(Peek())
    strat.eval(scenario.test_stream)
    assert not torch.equal(snap[0]["heads.0.weight_mu"], before["heads.0.weight_mu"])


def test_vcl_single_head_random_coreset():
    seq = synthetic_split(n_tasks=2, input_shape=(8,), n_train=100, n_test=20, multi_head=False)
    scenario = to_avalanche(seq)
    torch.manual_seed(0)
    net = MultiHeadMLP(8, (10,), n_heads=1, head_size=2)
    strat = _strategy(net, coreset_size=4, coreset_method="random", ml_init_epochs=0)
    assert strat.model is strat.net  # single head: no Avalanche multi-task wrapper
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
        n_train=60,
        n_test=30,
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
    assert torch.all(strat.net.heads[1].weight_prior_var == 0.25)
    model = MultiHeadMLP(4, (3,), n_heads=2, head_size=2)
    opt = torch.optim.SGD([{"params": [p]} for p in model.parameters()], lr=0.1)
    with pytest.raises(ValueError, match="single parameter group"):
        VCL(model=as_avalanche_model(model), optimizer=opt)


def test_vcl_coreset_on_any_module_through_the_twin():
    """Coresets on a plain module (a MeanFieldTwin): kept out of training, trained on before
    evaluation, and the propagated posterior restored afterwards."""
    from torch import nn

    from fromp.continual.bayesian import MeanFieldTwin

    seq = synthetic_split(n_tasks=2, input_shape=(8,), n_train=60, n_test=20, multi_head=False)
    scenario = to_avalanche(seq)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 10), nn.ReLU(), nn.Linear(10, 2))
    strat = _strategy(net, coreset_size=4, coreset_method="random", coreset_epochs=2, seed=0)
    assert isinstance(strat.net, MeanFieldTwin) and type(strat.plugin) is VCLPlugin
    for exp in scenario.train_stream:
        strat.train(exp)
    assert [h for h, _, _ in strat.plugin.method.coresets] == [0, 0]
    assert strat.plugin.method.ess == 56
    before = {k: v.clone() for k, v in strat.net.state_dict().items()}
    tuned = {}

    class Peek(SupervisedPlugin):
        def before_eval_iteration(self, strategy, **kwargs):
            tuned.setdefault("w", strategy.net.state_dict()["model.2.weight"].clone())

    strat.plugins.append(Peek())
    accs = _accs(strat.eval(scenario.test_stream))
    assert len(accs) == 2 and min(accs) > 0.6
    assert not torch.equal(tuned["w"], before["model.2.weight"])  # trained on the coreset
    assert _state_equal(strat.net.state_dict(), before)  # ... and restored
