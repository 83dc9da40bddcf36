"""EWC with a per-example Fisher: importance vs brute force, penalty, strategy and state."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _synthetic import synthetic_split
from avalanche.evaluation.metrics import accuracy_metrics
from avalanche.training.plugins import EvaluationPlugin
from fromp_avalanche.ewc import EWC, EWCPlugin, ewc_penalty
from fromp_avalanche.models import as_avalanche_model
from fromp_bench.data import to_avalanche
from fromp_bench.settings import SETTINGS

from fromp.continual.ewc import EWCMethod
from fromp.curvature.jacobian import flat_params
from fromp.models import MultiHeadMLP


def _net():
    torch.manual_seed(0)
    return MultiHeadMLP(6, (5,), n_heads=2, head_size=3).double()


def _grad(net, x, y, task):
    loss = F.cross_entropy(net(x[None], task=task), y.view(1))
    g = torch.autograd.grad(loss, list(net.parameters()), allow_unused=True)
    return torch.cat(
        [
            (torch.zeros_like(p) if gi is None else gi).reshape(-1)
            for gi, p in zip(g, net.parameters())
        ]
    )


def _brute_force(net, x, y, task, kind):
    """Per-example loop: empirical (observed labels) or true Fisher (exact expectation over
    labels drawn from the model), averaged over examples."""
    out = torch.zeros_like(flat_params(net))
    for n in range(len(x)):
        if kind == "empirical":
            out += _grad(net, x[n], y[n], task) ** 2
        else:
            with torch.no_grad():
                p = net(x[n : n + 1], task=task).softmax(-1)[0]
            for c in range(len(p)):
                out += p[c] * _grad(net, x[n], torch.tensor(c), task) ** 2
    return out / len(x)


@pytest.mark.parametrize("task", [0, 1])
def test_fisher_matches_per_example_loop(task):
    net = _net()
    x = torch.rand(12, 6, dtype=torch.float64)
    y = torch.randint(0, 3, (12,))
    method = EWCMethod(1.0, fisher="empirical", chunk_size=5)
    torch.testing.assert_close(
        method.fisher_diagonal(net, x, y, task), _brute_force(net, x, y, task, "empirical")
    )
    true_f = _brute_force(net, x, y, task, "true")
    method.fisher = "exact"
    torch.testing.assert_close(method.fisher_diagonal(net, x, y, task), true_f)
    # the other head's parameters get no importance
    other = net.heads[1 - task]
    offset = sum(p.numel() for n, p in net.named_parameters() if not n.startswith("heads"))
    offset += sum(p.numel() for p in net.heads[: 1 - task].parameters())
    size = sum(p.numel() for p in other.parameters())
    assert torch.all(true_f[offset : offset + size] == 0)
    # sampled labels: unbiased Monte Carlo estimate of the true Fisher
    if task == 0:
        method.fisher, method.fisher_samples = "sampled", 150
        torch.manual_seed(1)
        est = method.fisher_diagonal(net, x, y, task)
        assert (est - true_f).abs().max() < 0.25 * true_f.abs().max()


def test_penalty_value_and_online_accumulation():
    w = torch.randn(10, dtype=torch.float64)
    anchors = [torch.randn(10, dtype=torch.float64) for _ in range(2)]
    imps = [torch.rand(10, dtype=torch.float64) for _ in range(2)]
    # Avalanche's form: lambda sum F (w - w*)^2, no 1/2
    ref = 3.0 * sum((f * (w - a) ** 2).sum() for a, f in zip(anchors, imps))
    torch.testing.assert_close(ewc_penalty(w, anchors, imps, 3.0), ref)
    with pytest.raises(ValueError, match="equal lengths"):
        ewc_penalty(w, anchors, imps[:1], 1.0)

    net = _net()
    method = EWCMethod(2.0, batch_size=4)
    assert method.penalty(net) == 0
    method.anchors = [flat_params(net).detach() + 0.1]
    method.importances = [torch.full_like(method.anchors[0], 0.5)]
    expected = 2.0 / 4 * (0.5 * 0.01 * method.anchors[0].numel())  # (lambda / B) sum F d^2
    torch.testing.assert_close(method.penalty(net), torch.tensor(expected, dtype=torch.float64))
    old_scale = EWCMethod(per_example_lambda=2.0, batch_size=4)  # (lambda' / 2) sum F d^2
    old_scale.anchors, old_scale.importances = method.anchors, method.importances
    want = 0.5 * 2.0 * (0.5 * 0.01 * method.anchors[0].numel())
    torch.testing.assert_close(old_scale.penalty(net), torch.tensor(want, dtype=torch.float64))
    method.penalty(net).backward()  # differentiable in the live parameters
    assert net.body[1].weight.grad is not None


@pytest.mark.parametrize("bad", [{"mode": "x"}, {"fisher": "x"}, {"decay_factor": 2.0}])
def test_plugin_rejects_bad_arguments(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        EWCPlugin(1.0, **bad)


def _strategy(net, **kw):
    model = as_avalanche_model(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return EWC(
        model=model,
        optimizer=opt,
        train_mb_size=16,
        train_epochs=10,
        eval_mb_size=64,
        evaluator=EvaluationPlugin(accuracy_metrics(experience=True), loggers=[]),
        **kw,
    )


@pytest.mark.parametrize("mode", ["separate", "online"])
def test_strategy_on_synthetic_split_and_state_round_trip(mode):
    seq = synthetic_split(n_tasks=3, input_shape=(1, 4, 4), n_train=40, n_test=20)
    scenario = to_avalanche(seq)
    torch.manual_seed(0)
    net = MultiHeadMLP(16, (12,), n_heads=3, head_size=2)
    strat = _strategy(net, ewc_lambda=50.0, mode=mode, decay_factor=0.9)
    for exp in scenario.train_stream[:2]:
        strat.train(exp)
    res = strat.eval(scenario.test_stream[:2])
    accs = [v for k, v in res.items() if k.startswith("Top1_Acc_Exp")]
    assert len(accs) == 2 and min(accs) > 0.6
    n_expected = 2 if mode == "separate" else 1
    m = strat.plugin.method
    assert len(m.anchors) == n_expected and m.task_count == 2
    # importance of task 1 (head 1) is the per-example average; head 2 is untouched
    assert all(torch.all(v >= 0) for v in m.importances[-1].values())
    state = strat.plugin.state_dict()
    fresh = EWCPlugin(50.0, batch_size=16, mode=mode, decay_factor=0.9)
    fresh.load_state_dict(state)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.05)
    torch.testing.assert_close(fresh.method.penalty(net), m.penalty(net))
    assert fresh.method.penalty(net) > 0
    with pytest.raises(ValueError, match="missing"):
        fresh.load_state_dict({"anchors": []})


def test_single_head_strategy_runs():
    seq = synthetic_split(n_tasks=2, input_shape=(8,), n_train=30, n_test=10, multi_head=False)
    scenario = to_avalanche(seq)
    net = MultiHeadMLP(8, (6,), n_heads=1, head_size=2)
    strat = _strategy(net, ewc_lambda=10.0, fisher="exact")
    for exp in scenario.train_stream:
        strat.train(exp)
    assert len(strat.plugin.method.importances) == 2
    assert sum(v.sum() for v in strat.plugin.method.importances[0].values()) > 0


def test_defaults_follow_the_contract():
    for bench in ("split-mnist", "permuted-mnist", "split-cifar", "split-fashion-mnist"):
        d = SETTINGS["ewc"][bench]
        assert {"optimizer", "lr", "train_epochs", "train_mb_size", "kwargs"} <= set(d)


def _task_data(t: int, n: int = 10):
    g = torch.Generator().manual_seed(10 + t)
    return torch.rand(n, 6, dtype=torch.float64, generator=g), torch.randint(
        0, 3, (n,), generator=g
    )


def _exp(net, x, y, t):
    """What the plugin's after_training_exp reads of a strategy."""
    from types import SimpleNamespace

    from torch.utils.data import TensorDataset

    ds = TensorDataset(x, y, torch.full((len(x),), t))
    exp = SimpleNamespace(dataset=ds, current_experience=t)
    return SimpleNamespace(model=net, optimizer=None, experience=exp)


def test_fisher_of_task_t_goes_through_head_t():
    """Learning task 2 of a three-head model stores the Fisher of head 2 (brute force), so
    heads 0 and 1 get zero importance and head 2 a positive one: using another head for
    task ``t``'s Fisher fails here."""
    torch.manual_seed(0)
    net = MultiHeadMLP(6, (5,), n_heads=3, head_size=3).double()
    plugin = EWCPlugin(1.0, fisher="exact")
    x, y = _task_data(2)
    plugin.after_training_exp(_exp(net, x, y, 2))
    imp = plugin.method.importances[0]
    expected = _brute_force(net, x, y, 2, "true")
    got = torch.cat([imp[n].reshape(-1) for n, _ in net.named_parameters()])
    torch.testing.assert_close(got, expected)
    for h in (0, 1):
        assert all(float(imp[f"heads.{h}.{k}"].abs().sum()) == 0 for k in "weight bias".split())
    assert float(imp["heads.2.weight"].abs().sum()) > 0


def test_online_decay_is_applied_once_per_new_task():
    """Online EWC after three tasks at fixed weights: ``F~ = g^2 F_0 + g F_1 + F_2`` exactly,
    each ``F_t`` through head ``t``; decaying one time too many or too few fails here."""
    torch.manual_seed(0)
    net = MultiHeadMLP(6, (5,), n_heads=3, head_size=3).double()
    gamma = 0.5
    plugin = EWCPlugin(1.0, mode="online", decay_factor=gamma, fisher="exact")
    m = plugin.method
    fishers = []
    for t in range(3):
        x, y = _task_data(t)
        fishers.append(m.fisher_diagonal(net, x, y, t))
        plugin.after_training_exp(_exp(net, x, y, t))
        expected = sum(gamma ** (t - s) * f for s, f in enumerate(fishers))
        got = torch.cat([m.importances[0][n].reshape(-1) for n, _ in net.named_parameters()])
        assert len(m.importances) == 1 and len(m.anchors) == 1
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)
