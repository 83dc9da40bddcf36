"""FROMP as an Avalanche strategy: runs, checkpoints, and forgets less than Naive."""

from __future__ import annotations

import warnings

import pytest
import torch
from avalanche.evaluation.metrics import accuracy_metrics
from avalanche.training import Naive
from avalanche.training.plugins import EvaluationPlugin
from fromp_avalanche.fromp import FROMP, FROMPPlugin
from fromp_avalanche.models import as_avalanche_model, unwrap
from fromp_bench.data import permuted_mnist, to_avalanche
from fromp_bench.settings import SETTINGS

from fromp.models import MultiHeadMLP
from tests.cases import synthetic_split

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _evaluator() -> EvaluationPlugin:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return EvaluationPlugin(accuracy_metrics(experience=True), loggers=[])


def _accuracies(results: dict) -> list[float]:
    keys = sorted(k for k in results if k.startswith("Top1_Acc_Exp/eval_phase/test_stream"))
    return [float(results[k]) for k in keys]


def _fromp(net, lr=1e-2, epochs=2, mb=32, **kw):
    model = as_avalanche_model(net)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    return FROMP(
        model=model,
        optimizer=opt,
        train_mb_size=mb,
        train_epochs=epochs,
        evaluator=_evaluator(),
        **kw,
    )


@pytest.mark.parametrize("multi_head", [True, False])
def test_runs_and_checkpoint_restores_identical_penalty(multi_head):
    seq = synthetic_split(
        n_tasks=3, input_shape=(1, 6, 6), train_size=48, test_size=16, multi_head=multi_head
    )
    heads = 3 if multi_head else 1
    net = MultiHeadMLP(36, (16,), n_heads=heads, head_size=2)
    strategy = _fromp(net, tau=1.0, n_points=8, grad_clip_norm=1.0)
    scenario = to_avalanche(seq)
    for exp in list(scenario.train_stream)[:2]:
        strategy.train(exp)
    plugin = strategy.plugin
    assert plugin.method.task_count == 2 and len(plugin.method.regularizer) == 2
    assert plugin.method.regularizer.num_points == 16
    tasks = [m.task for m in plugin.method.regularizer.memories]
    assert tasks == ([0, 1] if multi_head else [None, None])  # one head: no task label
    assert float(plugin.method.last_penalty) > 0  # the regulariser was active on task 2
    assert set(plugin.method.timings[0]) == {"select_s", "curvature_s", "kernel_s"}

    # checkpoint -> fresh process-like objects -> identical method state
    state = plugin.state_dict()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.05 * torch.randn_like(p))
    # a state saved with other settings is refused, the method left as it was
    other = FROMPPlugin(tau=123.0, n_points=8, grad_clip_norm=1.0)
    with pytest.raises(ValueError, match=r"tau=1\.0"):
        other.load_state_dict(state)
    assert other.method.tau == 123.0 and other.method.task_count == 0
    assert len(other.method.regularizer) == 0
    fresh = FROMPPlugin(tau=1.0, n_points=8, grad_clip_norm=1.0)
    fresh.load_state_dict(state)
    m, f = plugin.method, fresh.method
    assert f.tau == 1.0 and f.n_points == 8 and f.task_count == 2
    assert f.penalty(net).item() == m.penalty(net).item() > 0
    torch.testing.assert_close(f.posterior_variance(net), m.posterior_variance(net))

    strategy.train(list(scenario.train_stream)[2])
    acc = _accuracies(strategy.eval(scenario.test_stream))
    assert len(acc) == 3 and min(acc) > 0.6


def test_curvature_is_sum_of_task_ggns_and_identity_kernel():
    from fromp.continual.named_state import to_flat
    from fromp.curvature.diagonal import diag_ggn
    from fromp.models import with_task

    seq = synthetic_split(n_tasks=2, input_shape=(1, 4, 4), train_size=20, test_size=8)
    net = MultiHeadMLP(16, (8,), n_heads=2, head_size=2)
    strategy = _fromp(net, epochs=1, tau=1.0, n_points=4, kernel="identity")
    scenario = to_avalanche(seq)
    strategy.train(scenario.train_stream[0])
    net.eval()
    g0 = diag_ggn(with_task(net, 0), seq[0].train_x, "categorical")
    m = strategy.plugin.method
    torch.testing.assert_close(to_flat(m.ggn_sum, net, 0.0), g0)
    assert m.regularizer.memories[0].chol is None
    torch.testing.assert_close(m.posterior_variance(net), 1 / (g0 + m.prior_precision))


def test_plugin_argument_errors():
    with pytest.raises(ValueError, match="select must be None or one of"):
        FROMPPlugin(select="top")
    with pytest.raises(ValueError, match="n_points"):
        FROMPPlugin(n_points=0)
    with pytest.raises(ValueError, match="tau"):
        FROMPPlugin(tau=-1.0)
    with pytest.raises(ValueError, match="posterior must be one of"):
        FROMPPlugin(posterior="laplace")
    with pytest.raises(ValueError, match="kernel must be 'auto' or one of"):
        FROMPPlugin(kernel="rbf")
    assert set(SETTINGS["fromp"]) >= {
        "split-mnist",
        "permuted-mnist",
        "split-cifar",
        "split-fashion-mnist",
        "split-digits",
    }
    for bench, d in SETTINGS["fromp"].items():
        assert {"optimizer", "lr", "train_epochs", "train_mb_size", "kwargs"} <= set(d)
        if bench.endswith("-ci"):  # class-incremental: FROMP with Adam only (and a coreset)
            assert SETTINGS["fromp-coreset"][bench]["kwargs"]["replay"] is True
            continue
        assert SETTINGS["fromp-vogn"][bench]["optimizer"] == "vogn"
        assert SETTINGS["fromp-vogn"][bench]["kwargs"]["posterior"] == "vogn"
        assert SETTINGS["fromp-ivon"][bench]["optimizer"] == "ivon"
        assert SETTINGS["fromp-ivon"][bench]["kwargs"]["posterior"] == "ivon"


@pytest.mark.slow
def test_forgets_less_than_naive_on_real_permuted_mnist(mnist_root):
    """Two permuted-MNIST tasks, 2000 training examples each: FROMP forgets task 1 (its
    accuracy right after task 1 minus its accuracy after task 2) clearly less than plain
    fine-tuning, and still learns task 2."""
    seq = permuted_mnist(mnist_root, n_tasks=2, download=False).subsample(2000, 1000, seed=0)
    scenario = to_avalanche(seq)
    results, forgetting = {}, {}
    for name in ("naive", "fromp"):
        torch.manual_seed(0)
        net = MultiHeadMLP(784, (100, 100), n_heads=1, head_size=10)
        model = as_avalanche_model(net)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        common = dict(train_mb_size=128, train_epochs=5, evaluator=_evaluator())
        if name == "naive":
            strategy = Naive(model=model, optimizer=opt, **common)
        else:
            strategy = FROMP(
                model=model,
                optimizer=opt,
                tau=0.5,
                n_points=200,
                prior_precision=1e-5,
                jitter=1e-5,
                grad_clip_norm=0.01,
                **common,
            )
        first, second = scenario.train_stream
        strategy.train(first)
        before = _accuracies(strategy.eval(scenario.test_stream[:1]))[0]
        strategy.train(second)
        results[name] = _accuracies(strategy.eval(scenario.test_stream))
        forgetting[name] = before - results[name][0]
        assert unwrap(model) is net
    assert forgetting["fromp"] < forgetting["naive"] - 0.02, (forgetting, results)
    assert results["fromp"][1] > 0.85, results


def test_fromp_vogn_uses_vogn_posterior_and_checkpoints():
    from fromp.optim import VOGN

    seq = synthetic_split(n_tasks=2, input_shape=(1, 4, 4), train_size=32, test_size=16)
    net = MultiHeadMLP(16, (8,), n_heads=2, head_size=2)
    model = as_avalanche_model(net)
    opt = VOGN(model, lr=1e-2, ess=32, prior_precision=1e-2, mc_samples=1)
    strategy = FROMP(
        model=model,
        optimizer=opt,
        train_mb_size=16,
        train_epochs=2,
        evaluator=_evaluator(),
        tau=1.0,
        n_points=4,
        posterior="vogn",
    )
    scenario = to_avalanche(seq)
    strategy.train(scenario.train_stream[0])
    plugin = strategy.plugin
    q_var = plugin.method.posterior_variance(net).clone()
    # Sigma is VOGN's posterior variance at the end of task 1 (VOGN then made it the prior)
    torch.testing.assert_close(q_var, 1 / opt.prior().precision)
    strategy.train(scenario.train_stream[1])
    assert len(plugin.method.regularizer) == 2 and float(plugin.method.last_penalty) > 0
    fresh = FROMPPlugin(tau=1.0, n_points=4, posterior="vogn")
    fresh.load_state_dict(plugin.state_dict())
    assert fresh.method.penalty(net).item() == plugin.method.penalty(net).item()
    with pytest.raises(TypeError, match="VOGN"):
        FROMP(
            model=as_avalanche_model(MultiHeadMLP(16, (8,), 2, 2)),
            optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
            posterior="vogn",
        )


def test_sensitivity_selection_uses_the_task_posterior_after_tasks_1_to_3():
    from fromp.curvature.diagonal import diag_ggn
    from fromp.curvature.jacobian import flat_params
    from fromp.memory.sensitivity import memory_perturbation
    from fromp.models import with_task
    from fromp.posterior import DiagonalGaussian

    seq = synthetic_split(n_tasks=3, input_shape=(1, 4, 4), train_size=30, test_size=8)
    torch.manual_seed(0)
    net = MultiHeadMLP(16, (8,), n_heads=3, head_size=2)
    strategy = _fromp(net, epochs=1, tau=1.0, n_points=6, select="sensitivity")
    scenario = to_avalanche(seq)
    ggn_sum = None
    for t in range(3):
        strategy.train(scenario.train_stream[t])
        net.eval()
        head = with_task(net, t)
        x, y = seq[t].train_x, seq[t].train_y
        g = diag_ggn(head, x, "categorical")
        ggn_sum = g if ggn_sum is None else ggn_sum + g
        q = DiagonalGaussian(flat_params(net), ggn_sum + strategy.plugin.method.prior_precision)
        s = memory_perturbation(head, q, x, y).sensitivity
        want = []
        for c in (0, 1):
            members = torch.nonzero(y == c).squeeze(1)
            want += members[torch.argsort(s[members], descending=True)[:3]].tolist()
        mem = strategy.plugin.method.regularizer.memories[t]
        assert mem.task == t
        torch.testing.assert_close(mem.inputs, x[want])


def test_training_the_same_experience_twice_is_idempotent():
    """Training experience 0 again replaces its GGN term and memorable set: the GGN sum is
    not doubled and the memorable set not duplicated (weights kept fixed by lr=0)."""
    seq = synthetic_split(n_tasks=2, input_shape=(1, 6, 6), train_size=32, test_size=8)
    net = MultiHeadMLP(36, (8,), n_heads=2, head_size=2)
    strategy = _fromp(net, lr=0.0, epochs=1, tau=1.0, n_points=4)
    exp0 = to_avalanche(seq).train_stream[0]
    strategy.train(exp0)
    plugin = strategy.plugin
    var_once = plugin.method.posterior_variance(net).clone()
    inputs_once = plugin.method.regularizer.memories[0].inputs.clone()
    strategy.train(exp0)
    assert len(plugin.method.regularizer) == 1 and plugin.method.regularizer.num_points == 4
    torch.testing.assert_close(plugin.method.posterior_variance(net), var_once, rtol=0, atol=0)
    torch.testing.assert_close(plugin.method.regularizer.memories[0].inputs, inputs_once)


def test_keyword_only_signature_and_positional_forms_in_its_order():
    import inspect

    from avalanche.training.templates.base import PositionalArgumentsDeprecatedWarning

    from fromp.continual.methods import FROMPMethod

    net = torch.nn.Sequential(torch.nn.Linear(4, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    crit = torch.nn.CrossEntropyLoss(reduction="sum")
    sig = inspect.signature(FROMP)
    method_args = list(inspect.signature(FROMPMethod).parameters)
    names = ["model", "optimizer", "criterion", *method_args, "vogn_continual"]
    assert list(sig.parameters)[: len(names)] == names
    for n in names:
        assert sig.parameters[n].kind == inspect.Parameter.KEYWORD_ONLY, n
    # FROMPMethod's defaults are FROMP's (written once)
    for n in method_args:
        assert sig.parameters[n].default == inspect.signature(FROMPMethod).parameters[n].default
    with warnings.catch_warnings():
        warnings.simplefilter("error", PositionalArgumentsDeprecatedWarning)
        warnings.simplefilter("error", DeprecationWarning)
        s = FROMP(
            model=net,
            optimizer=opt,
            criterion=crit,
            tau=2.0,
            n_points=6,
            train_mb_size=7,
            evaluator=None,
        )
    m = s.plugin.method
    assert (s._criterion, m.tau, m.n_points, s.train_mb_size) == (crit, 2.0, 6, 7)
    # by position: the signature's order (criterion, then tau, n_points), with a warning
    with pytest.warns(PositionalArgumentsDeprecatedWarning):
        s = FROMP(net, opt, crit, 3.0, 8, evaluator=None)
    assert (s._criterion, s.plugin.method.tau, s.plugin.method.n_points) == (crit, 3.0, 8)
    with pytest.raises(TypeError, match="model= and optimizer="):
        FROMP(model=net)
