"""FROMP and EWC on users' own Avalanche models, trained by Avalanche on small synthetic
streams built like ``SplitMNIST`` (``nc_benchmark``): ``MTSimpleMLP`` (a ``MultiTaskModule``
with a ``MultiHeadClassifier``, task labels, the labels counted from zero in each
experience: Avalanche's default global labels are refused, tests/strategies/test_multihead_masks.py)
and ``SimpleMLP`` (one head, class-incremental, global labels), checked after tasks 2 and 3
against dense float64 brute force through the head of each task (the models train in
float32, as Avalanche's multi-task forward requires; the references use float64 copies)."""

from __future__ import annotations

import copy

import pytest
import torch
from avalanche.benchmarks.scenarios.deprecated.generators import nc_benchmark
from avalanche.benchmarks.utils import _make_taskaware_tensor_classification_dataset
from avalanche.core import SupervisedPlugin
from avalanche.models import MTSimpleMLP, SimpleMLP
from fromp_avalanche.ewc import EWC
from fromp_avalanche.fromp import FROMP
from torch import nn

from fromp.likelihood import get_likelihood
from fromp.models import TaskView, is_multitask, with_task
from fromp.testing import dense_ggn

N_CLASSES, D_IN = 6, 8
LIK = get_likelihood("categorical")


def _dataset(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % N_CLASSES
    x = torch.randn(n, D_IN, generator=g)
    x[:, :N_CLASSES] += 2.0 * nn.functional.one_hot(y, N_CLASSES).float()
    return _make_taskaware_tensor_classification_dataset(x, y, targets=y.tolist())


def _benchmark(task_labels: bool, global_labels: bool = False):
    """Three experiences of two classes each: with task labels 0 and 1 in each experience
    (a head per task; ``global_labels``: 0..5, Avalanche's default), else global labels
    0..5 on one head."""
    return nc_benchmark(
        _dataset(60, 0),
        _dataset(30, 1),
        n_experiences=3,
        task_labels=task_labels,
        shuffle=False,
        fixed_class_order=list(range(N_CLASSES)),
        class_ids_from_zero_in_each_exp=task_labels and not global_labels,
    )


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mt":
        return MTSimpleMLP(input_size=D_IN, hidden_size=6)
    return SimpleMLP(num_classes=N_CLASSES, input_size=D_IN, hidden_size=6)


class _Snapshots(SupervisedPlugin):
    """After each experience (after the method's plugin): a copy of the model."""

    def __init__(self) -> None:
        super().__init__()
        self.models: list[nn.Module] = []

    def after_training_exp(self, strategy, **kwargs):
        self.models.append(copy.deepcopy(strategy.model).double().eval())


def _train(kind: str, method: str, **kwargs):
    bm = _benchmark(task_labels=kind == "mt")
    model = _model(kind)
    snaps = _Snapshots()
    cls = FROMP if method == "fromp" else EWC
    strategy = cls(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        train_mb_size=10,
        train_epochs=1,
        evaluator=None,
        plugins=[snaps],
        **kwargs,
    )
    return bm, strategy, snaps


def _xy(exp):
    from fromp_avalanche.benchmarks import experience_tensors

    x, y, t = experience_tensors(exp.dataset)
    return x.double(), y, int(t[0])


def _named(net: nn.Module, v: torch.Tensor) -> dict[str, torch.Tensor]:
    out, i = {}, 0
    for n, p in net.named_parameters():
        out[n] = v[i : i + p.numel()].view_as(p)
        i += p.numel()
    return out


@pytest.mark.parametrize("kind", ["mt", "single"])
def test_fromp_on_avalanche_models_after_tasks_2_and_3(kind):
    """The GGN sum is ``sum_t G_t`` with ``G_t`` the dense GGN diagonal of experience ``t``
    through head ``t`` at the weights after ``t`` (by parameter name: heads added later get
    zero); every memorable target is the softmax of its own head at the latest weights."""
    bm, strategy, snaps = _train(
        kind, "fromp", tau=1.0, n_points=4, prior_precision=0.5, function="probs"
    )
    plugin = strategy.plugin
    for e, exp in enumerate(bm.train_stream):
        strategy.train(exp)
        if e == 0:
            continue
        net = strategy.model
        expected = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in net.named_parameters()}
        for s in range(e + 1):
            x, _, t = _xy(bm.train_stream[s])
            snap = snaps.models[s]
            head = with_task(snap, t if is_multitask(snap) else None)
            g = torch.diagonal(dense_ggn(head, x, LIK))
            for n, v in _named(snap, g).items():
                expected[n][tuple(slice(0, k) for k in v.shape)] += v
        for n in expected:
            torch.testing.assert_close(
                plugin.method.ggn_sum[n].double(), expected[n], rtol=1e-4, atol=1e-6
            )
        mems = plugin.method.regularizer.memories
        assert len(mems) == e + 1
        # one head: no task label (a head per task: its label)
        assert [m.task for m in mems] == ([0, 1, 2][: e + 1] if kind == "mt" else [None] * (e + 1))
        net.eval()
        for m in mems:
            head = with_task(net, m.task if is_multitask(net) else None)
            with torch.no_grad():
                p = torch.softmax(head(m.inputs), -1)
            # on the classes trained so far through that head (read from the stream),
            # which MultiHeadClassifier also leaves unmasked
            seen = sorted(
                {
                    int(c)
                    for s in range(e + 1)
                    for c in _xy(bm.train_stream[s])[1].unique()
                    if kind != "mt" or s == m.task
                }
            )
            assert m.units.tolist() == seen
            assert bool((p[:, m.units].amax(0) > 0).all())
            torch.testing.assert_close(m.targets, p[:, m.units].double())
        # the heads differ, so a target taken through the wrong head would be caught
        if kind == "mt":
            x0 = mems[0].inputs
            with torch.no_grad():
                assert not torch.allclose(TaskView(net, 0)(x0), TaskView(net, 1)(x0)[:, :2])
        assert float(plugin.method.penalty(net).detach()) == pytest.approx(0.0, abs=1e-8)


@pytest.mark.parametrize("kind", ["mt", "single"])
def test_ewc_on_avalanche_models_after_tasks_2_and_3(kind):
    """Each stored importance is the dense GGN diagonal (``fisher="exact"``) of its
    experience through its own head at the anchor, divided by N, keyed by name: a head
    added later is absent from the earlier tasks' importances."""
    bm, strategy, snaps = _train(kind, "ewc", ewc_lambda=1.0, fisher="exact")
    plugin = strategy.plugin
    for e, exp in enumerate(bm.train_stream):
        strategy.train(exp)
        if e == 0:
            continue
        assert len(plugin.method.importances) == e + 1
        for s in range(e + 1):
            x, _, t = _xy(bm.train_stream[s])
            snap = snaps.models[s]
            head = with_task(snap, t if is_multitask(snap) else None)
            g = _named(snap, torch.diagonal(dense_ggn(head, x, LIK)) / len(x))
            assert set(plugin.method.importances[s]) == set(g)
            for n, v in g.items():
                torch.testing.assert_close(
                    plugin.method.importances[s][n].double(), v, rtol=1e-4, atol=1e-7
                )
                anchor = dict(snap.named_parameters())[n]
                torch.testing.assert_close(plugin.method.anchors[s][n].double(), anchor)
        penalty = plugin.method.penalty(strategy.model)
        assert penalty.requires_grad and float(penalty.detach()) > 0  # the weights moved since


def test_vcl_twin_kl_sampling_and_prior_after_tasks_2_and_3():
    """VCL on ``MTSimpleMLP``: the KL is the closed form over the Linear weights and biases;
    samples with a vanishing variance are the model's own head-``t`` outputs; after each
    task every head trained so far has its posterior as prior and the head of the next task,
    created by Avalanche's adaptation, starts from ``N(0, prior_var)``."""
    from fromp_avalanche.vcl import VCL

    bm = _benchmark(task_labels=True)
    model = _model("mt")
    strategy = VCL(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
        train_mb_size=10,
        train_epochs=1,
        evaluator=None,
        train_samples=2,
        test_samples=3,
        prior_precision=2.0,  # prior variance 0.5
        seed=0,
    )
    twin = strategy.method.mean_field
    assert strategy.model is model and twin.model is model
    for e, exp in enumerate(bm.train_stream):
        strategy.train(exp)
        head_names = [n for n in twin.names if n.startswith("classifier.")]
        assert len(head_names) == 2 * (e + 1)  # weight and bias of each head seen
        params = dict(model.named_parameters())
        for n in twin.names:
            torch.testing.assert_close(twin.prior_mean[n], params[n].detach())
            torch.testing.assert_close(twin.prior_variance[n], twin.variance(n).detach())
        assert float(twin.kl().detach()) == pytest.approx(0.0, abs=1e-5)
        if e == 0:
            continue
        # the KL after moving the means: the closed form
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        expected = sum(
            0.5
            * (
                torch.log(twin.prior_variance[n] / twin.variance(n))
                + (twin.variance(n) + (params[n] - twin.prior_mean[n]) ** 2)
                / twin.prior_variance[n]
                - 1
            ).sum()
            for n in twin.names
        )
        torch.testing.assert_close(twin.kl(), expected)
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.01)
        # vanishing variance: samples are the model's own outputs through head t
        x, _, _ = _xy(bm.train_stream[e])
        x = x.float()
        saved = {k: v.detach().clone() for k, v in twin.logvars.items()}
        with torch.no_grad():
            for v in twin.logvars.values():
                v.fill_(-80.0)
            model.eval()
            for t in range(e + 1):
                torch.testing.assert_close(twin.sample_logits(x, t, 2)[1], model(x, t))
            for k, v in twin.logvars.items():
                v.copy_(saved[k])
    # the head of a task not yet seen: Avalanche's adaptation creates it, the twin gives it
    # the initial prior N(0, prior_var) and the initial log-variance
    model.classifier.classifiers["7"] = copy.deepcopy(model.classifier.classifiers["0"])
    twin.sync()
    n = "classifier.classifiers.7.classifier.weight"
    assert torch.all(twin.prior_mean[n] == 0) and torch.all(twin.prior_variance[n] == 0.5)
    assert torch.all(twin.variance(n) == torch.exp(torch.tensor(-6.0)))


@pytest.mark.parametrize("kind", ["mt", "single"])
def test_vcl_trains_avalanche_models_and_resumes(kind):
    """VCL trains both Avalanche models through three experiences; its state (log-variances,
    priors, counter) with the model's (the means) round-trips into a fresh strategy."""
    from fromp_avalanche.vcl import VCL

    bm = _benchmark(task_labels=kind == "mt")

    def make():
        model = _model(kind)
        return VCL(
            model=model,
            optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
            train_mb_size=10,
            evaluator=None,
            train_samples=2,
            test_samples=2,
            seed=0,
        )

    strategy = make()
    for exp in list(bm.train_stream)[:2]:
        strategy.train(exp)
    state = strategy.plugin.state_dict()
    fresh = make()
    for exp in list(bm.train_stream)[:2]:  # the same adaptation: the same parameters
        fresh.experience = exp
        fresh.model_adaptation()
    fresh.model.load_state_dict(strategy.model.state_dict())
    fresh.plugin.load_state_dict(state)
    assert fresh.plugin.method.task_count == 2
    torch.testing.assert_close(fresh.method.mean_field.kl(), strategy.method.mean_field.kl())
    strategy.train(bm.train_stream[2])
    assert strategy.plugin.method.task_count == 3


@pytest.mark.parametrize("kind", ["mt", "single"])
def test_vcl_keeps_the_users_model_and_optimizer_and_its_eval_is_the_models(kind):
    """VCL with Avalanche's models and the user's Adam: after every experience
    ``strategy.model is model`` and ``strategy.optimizer is opt``; the user's optimizer made
    every update (one step per mini-batch, nothing else moved the parameters: no
    maximum-likelihood fit by default) of the model's parameters and of the log-variances
    (its group 1); and ``strategy.eval``'s accuracy and loss per experience are those of the
    user's model evaluated directly, ``model(x, t)`` (the posterior means)."""
    import math

    from avalanche.evaluation.metrics import accuracy_metrics, loss_metrics
    from avalanche.training.plugins import EvaluationPlugin
    from fromp_avalanche.vcl import VCL

    bm = _benchmark(task_labels=kind == "mt")
    model = _model(kind)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    steps = []
    opt.register_step_post_hook(lambda o, args, kwargs: steps.append(o))
    with pytest.warns(UserWarning, match="added to your optimizer as parameter group 1"):
        strategy = VCL(
            model=model,
            optimizer=opt,
            train_mb_size=8,
            eval_mb_size=7,
            evaluator=EvaluationPlugin(
                accuracy_metrics(experience=True), loss_metrics(experience=True), loggers=[]
            ),
            train_samples=2,
            seed=0,
        )
    logvars = strategy.method.variance_parameters()
    assert logvars and all(not any(lv is p for p in model.parameters()) for lv in logvars)
    n_steps = 0
    for e, exp in enumerate(bm.train_stream):
        before = [p.detach().clone() for p in model.parameters()]
        lv_before = [lv.detach().clone() for lv in strategy.method.variance_parameters()]
        strategy.train(exp)
        assert strategy.model is model and strategy.optimizer is opt
        n_steps += math.ceil(len(exp.dataset) / 8)
        assert len(steps) == n_steps and all(o is opt for o in steps)
        groups = opt.param_groups
        assert [id(p) for p in groups[0]["params"]] == [id(p) for p in model.parameters()]
        assert [id(p) for p in groups[1]["params"]] == [
            id(p) for p in strategy.method.variance_parameters()
        ]
        # trained: the means in place, the log-variances through the optimizer
        moved = [
            not torch.equal(b, p) for b, p in zip(before, model.parameters()) if b.shape == p.shape
        ]
        assert any(moved)
        lv_now = strategy.method.variance_parameters()
        assert any(not torch.equal(b, v) for b, v in zip(lv_before, lv_now) if b.shape == v.shape)

        res = strategy.eval(bm.test_stream[: e + 1])
        model.eval()
        for k, test in enumerate(bm.test_stream[: e + 1]):
            x, y, t = _xy(test)
            with torch.no_grad():
                out = model(x.float(), t) if kind == "mt" else model(x.float())
            acc = int((out.argmax(1) == y).sum()) / len(y)
            loss = float(nn.functional.cross_entropy(out, y))
            name = f"eval_phase/test_stream/Task{t if kind == 'mt' else 0:03d}/Exp{k:03d}"
            assert res[f"Top1_Acc_Exp/{name}"] == pytest.approx(acc, abs=1e-9), (e, k)
            assert res[f"Loss_Exp/{name}"] == pytest.approx(loss, rel=1e-5), (e, k)


_DEVICES = [
    "cpu",
    "cpu:0",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    ),
]


def _user_strategy(method: str, kind: str, device: str):
    from fromp_avalanche.vcl import VCL

    torch.manual_seed(0)
    model = _model(kind).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    common = dict(
        model=model, optimizer=opt, train_mb_size=10, train_epochs=1, evaluator=None, device=device
    )
    if method == "fromp":
        return FROMP(tau=1.0, n_points=4, **common)
    if method == "ewc":
        return EWC(ewc_lambda=1.0, **common)
    return VCL(train_samples=2, test_samples=2, seed=0, **common)


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("method", ["fromp", "ewc", "vcl"])
def test_checkpoint_in_a_user_loop_resumes_exactly(method, device, tmp_path):
    """A user's loop saves after two experiences; a fresh strategy (fresh model, optimizer
    and plugin, RNG moved on) loads the file (read on the CPU, moved to ``device``) and
    trains experience 3 to the very same weights as the uninterrupted run."""
    from fromp_avalanche.checkpoint import load_checkpoint, save_checkpoint

    bm = _benchmark(task_labels=True)
    stream = bm.train_stream
    path = tmp_path / "ckpt.pt"
    strategy = _user_strategy(method, "mt", device)
    for i, exp in enumerate(stream):
        strategy.train(exp)
        if i == 1:
            save_checkpoint(strategy, path, experiences_done=i + 1)
    reference = {k: v.detach().clone() for k, v in strategy.model.state_dict().items()}

    torch.manual_seed(123)  # a fresh process: other RNG state, other initial weights
    resumed = _user_strategy(method, "mt", device)
    start = load_checkpoint(resumed, path, stream)
    assert start == 2
    for exp in list(stream)[start:]:
        resumed.train(exp)
    got = resumed.model.state_dict()
    assert set(got) == set(reference)
    for k, v in reference.items():
        assert got[k].device == v.device
        torch.testing.assert_close(got[k], v, rtol=0, atol=0, msg=k)


def test_checkpoint_of_a_grown_model_without_the_stream_says_to_pass_it(tmp_path):
    """A grown head loaded into a fresh (ungrown) model without ``stream=``: refused, naming
    the argument, before anything is changed."""
    from fromp_avalanche.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    stream = _benchmark(task_labels=True).train_stream
    path = tmp_path / "ckpt.pt"
    strategy = _user_strategy("fromp", "mt", "cpu")
    for exp in list(stream)[:2]:
        strategy.train(exp)
    save_checkpoint(strategy, path, experiences_done=2)
    fresh = _user_strategy("fromp", "mt", "cpu")
    before = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"stream=") as err:
        load_checkpoint(fresh, path)
    assert str(path) in str(err.value)
    after = fresh.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert load_checkpoint(fresh, path, stream) == 2  # with the stream it loads


@pytest.mark.parametrize("method", ["fromp", "ewc", "vcl"])
def test_global_labels_with_fixed_two_unit_heads_say_what_to_pass(method):
    """A fromp two-unit-per-task model with Avalanche's default global labels is refused
    before training the second experience with one line naming the argument to pass."""
    from fromp_avalanche.models import as_avalanche_model
    from fromp_avalanche.vcl import VCL

    from fromp.models import MultiHeadMLP

    bm = _benchmark(task_labels=True, global_labels=True)
    model = as_avalanche_model(MultiHeadMLP(D_IN, (6,), n_heads=3, head_size=2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    common = dict(model=model, optimizer=opt, train_mb_size=10, evaluator=None)
    cls, kw = {
        "fromp": (FROMP, {"n_points": 4}),
        "ewc": (EWC, {"ewc_lambda": 1.0}),
        "vcl": (VCL, {"train_samples": 1, "ml_init_epochs": 0}),
    }[method]
    strategy = cls(**common, **kw)
    strategy.train(bm.train_stream[0])
    with pytest.raises(ValueError, match="class_ids_from_zero_in_each_exp=True"):
        strategy.train(bm.train_stream[1])


@pytest.mark.parametrize("method", ["fromp", "ewc", "vcl"])
@pytest.mark.slow
def test_torchvision_resnet18_on_a_cifar_shaped_stream(method):
    """A torchvision ResNet-18 (batch norm, in eval mode for curvature) trains with each
    method on two CIFAR-shaped experiences; VCL makes every conv and linear parameter
    Gaussian and keeps the batch-norm parameters deterministic."""
    torchvision = pytest.importorskip("torchvision")
    from fromp_avalanche.vcl import VCL

    def ds(n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        y = torch.arange(n) % 4
        return _make_taskaware_tensor_classification_dataset(
            torch.randn(n, 3, 32, 32, generator=g), y, targets=y.tolist()
        )

    bm = nc_benchmark(ds(16, 0), ds(8, 1), 2, False, shuffle=False, fixed_class_order=[0, 1, 2, 3])
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=4)
    common = dict(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        train_mb_size=8,
        evaluator=None,
    )
    if method == "fromp":
        strategy = FROMP(n_points=2, curvature_examples=2, chunk_size=1, **common)
    elif method == "ewc":
        strategy = EWC(ewc_lambda=1.0, max_examples=4, **common)
    else:
        strategy = VCL(train_samples=1, test_samples=1, ml_init_epochs=0, **common)
    for exp in bm.train_stream:
        strategy.train(exp)
    plugin = strategy.plugin
    if method == "fromp":
        assert len(plugin.method.regularizer) == 2
        assert float(plugin.method.penalty(model).detach()) == pytest.approx(0.0, abs=1e-6)
    elif method == "ewc":
        assert len(plugin.method.importances) == 2 and "fc.weight" in plugin.method.importances[1]
    else:
        names = set(strategy.method.mean_field.names)
        assert "conv1.weight" in names and "fc.bias" in names
        assert not any(n.startswith("bn1") for n in names)
        assert plugin.method.task_count == 2


def test_label_check_leaves_the_rng_where_it_was():
    """The label check runs a forward pass before each experience; a Bayesian model samples
    weights in its forward, so the check must not move the global RNG (else a VCL run with
    the check differs from the same run without it)."""
    from fromp_avalanche.template import check_labels_fit

    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(D_IN, 2)

        def forward(self, x):
            return self.lin(x) + torch.randn(x.shape[0], 2)

    bm = _benchmark(task_labels=False)
    model = Noisy()
    torch.manual_seed(3)
    before = torch.get_rng_state()
    check_labels_fit(model, bm.train_stream[0], "cpu")
    assert torch.equal(torch.get_rng_state(), before)
