"""One continual-method protocol (:class:`fromp.continual.ContinualMethod`) for FROMP, EWC
and VCL, and a plain PyTorch loop over a method that runs what the Avalanche strategy runs.

For FROMP (Adam; IVON with its penalty at the mean; a coreset and the context term on one
growing set of classes), EWC and VCL, the same three-experience stream goes through a plain
loop written here (the loop a user writes: ``begin_task``, ``loss_terms``, ``before_update``,
``learn_task``) and through the Avalanche strategy, from the same initial weights and seeds,
in float64: the losses of every step and the weights after every experience agree. The
weights of the loss terms (tau, the coreset's weight, context_tau) and the clipping are also
checked against closed forms written out here, so that a factor applied twice in the method
(which both routes would share) fails too."""

from __future__ import annotations

import copy
import inspect
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fromp import EWCMethod, FROMPMethod, VCLMethod
from fromp.continual import ContinualMethod
from fromp.continual.protocol import HOOKS, PROTOCOL, TaskStart
from fromp.models import MultiHeadMLP, with_task

D = torch.float64
METHODS = (FROMPMethod, EWCMethod, VCLMethod)


@pytest.fixture
def float64():
    """Float64 as the default dtype: Avalanche's loss starts as ``torch.zeros(1)``."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(D)
    yield
    torch.set_default_dtype(old)


def _shape(fn) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_every_method_implements_the_one_protocol():
    """The public calls are the base class's (one signature, one bookkeeping): a method
    implements the hooks, with the base's hook signatures, and its own state_dict /
    load_state_dict with the base's signatures."""
    own = {"state_dict", "load_state_dict"}
    for name in PROTOCOL:
        want = _shape(getattr(ContinualMethod, name))
        for cls in METHODS:
            assert _shape(getattr(cls, name)) == want, (cls.__name__, name)
            inherited = getattr(cls, name) is getattr(ContinualMethod, name)
            assert inherited is (name not in own), (cls.__name__, name)
    for name in HOOKS:
        want = _shape(getattr(ContinualMethod, name))
        for cls in METHODS:
            assert _shape(getattr(cls, name)) == want, (cls.__name__, name)
    assert ContinualMethod.__abstractmethods__ == {
        "_begin", "_loss_terms", "_learn", "state_dict", "load_state_dict"
    }  # fmt: skip
    for method in (FROMPMethod(), EWCMethod(1.0), VCLMethod(nn.Linear(3, 2))):
        assert isinstance(method, ContinualMethod)
        assert method.task_count == 0 and method.last_terms == {}
    import fromp

    assert fromp.ContinualMethod is ContinualMethod


# ----------------------------------------------------------------------- the two routes
def _tasks(class_incremental: bool, n: int = 24, d: int = 6) -> list[tuple]:
    """Three experiences ``(x [n, d], y [n], task label)``: two classes each, labels 0 and 1
    with a head per task, or global labels 0-5 on one head (class-incremental)."""
    g = torch.Generator().manual_seed(3)
    protos = torch.randn(6, d, generator=g, dtype=D)
    out = []
    for t in range(3):
        local = torch.arange(n) % 2
        x = protos[2 * t + local] + 0.5 * torch.randn(n, d, generator=g, dtype=D)
        out.append(
            (x, local + 2 * t if class_incremental else local, 0 if class_incremental else t)
        )
    return out


def _benchmark(tasks):
    from avalanche.benchmarks.scenarios.dataset_scenario import benchmark_from_datasets
    from avalanche.benchmarks.scenarios.supervised import with_classes_timeline
    from avalanche.benchmarks.scenarios.task_aware import with_task_labels
    from avalanche.benchmarks.utils import _make_taskaware_tensor_classification_dataset

    data = [
        _make_taskaware_tensor_classification_dataset(x, y, task_labels=t, targets=y.tolist())
        for x, y, t in tasks
    ]
    return with_classes_timeline(with_task_labels(benchmark_from_datasets(train=data, test=data)))


class _Recorder:
    """Seeds the global RNG before every training step (the draws of IVON and VCL) and
    records the loss handed to the backward pass and the weights after each experience."""

    def __init__(self, net: nn.Module):
        self.net, self.step, self.losses, self.weights = net, 0, [], []

    def seed(self) -> None:
        torch.manual_seed(100 + self.step)
        self.step += 1

    def loss(self, value: torch.Tensor) -> None:
        self.losses.append(float(value.detach().reshape(())))

    def done(self) -> None:
        self.weights.append([p.detach().clone() for p in self.net.parameters()])


def _avalanche_recorder(rec: _Recorder):
    from avalanche.core import SupervisedPlugin

    class Plugin(SupervisedPlugin):
        def before_training_iteration(self, strategy, **kwargs):
            rec.seed()

        def before_backward(self, strategy, **kwargs):  # after the method's plugin
            rec.loss(strategy.loss)

        def after_training_exp(self, strategy, **kwargs):
            rec.done()

    return Plugin()


def _same(plain: _Recorder, avalanche: _Recorder) -> None:
    assert len(plain.losses) == len(avalanche.losses) > 0
    torch.testing.assert_close(
        torch.tensor(plain.losses), torch.tensor(avalanche.losses), rtol=1e-12, atol=1e-14
    )
    assert len(plain.weights) == len(avalanche.weights) == 3
    for e, (a, b) in enumerate(zip(plain.weights, avalanche.weights)):
        for p, q in zip(a, b, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12, msg=f"experience {e}")


BS, EPOCHS = 8, 2


def _plain_loop(method, net, tasks, opt, rec, *, ivon=False, head=True):
    """The loop a user writes over a continual method (docs/avalanche.md, "Without
    Avalanche"); ``ivon``: IVON's draw and restore around each step, as its plugin drives it."""
    for e, (x, y, t) in enumerate(tasks):
        if ivon:
            opt.ess = len(x)
        method.begin_task(net, task=t, experience=e, ess=len(x), classes=sorted(set(y.tolist())))
        model = with_task(net, t) if head else net
        for _ in range(EPOCHS):
            for s in range(0, len(x), BS):
                rec.seed()
                xb, yb = x[s : s + BS], y[s : s + BS]
                opt.zero_grad()
                if ivon:
                    opt.draw()
                out = model(xb)
                loss = F.cross_entropy(out, yb)
                loss = loss + method.loss_terms(net, xb, out, task=t, loss=loss)
                rec.loss(loss)
                loss.backward()
                method.before_update(net, opt)
                if ivon and opt.sampled:
                    opt.restore(accumulate=True)
                opt.step()
        method.learn_task(net, x, y, t, optimizer=opt, experience=e)
        rec.done()


def _fromp_routes(tasks, multi_head, make_opt, **kw):
    from fromp_avalanche import FROMP
    from fromp_avalanche.models import as_avalanche_model

    torch.manual_seed(0)
    net = MultiHeadMLP(6, (10,), n_heads=3 if multi_head else 1, head_size=2 if multi_head else 6)
    twin = copy.deepcopy(net)
    plain, aval = _Recorder(net), _Recorder(twin)
    ivon = kw.get("posterior") == "ivon"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(1)
        _plain_loop(FROMPMethod(**kw), net, tasks, make_opt(net), plain, ivon=ivon)
        model = as_avalanche_model(twin)
        strategy = FROMP(
            model=model,
            optimizer=make_opt(model),
            train_mb_size=BS,
            train_epochs=EPOCHS,
            evaluator=None,
            plugins=[_avalanche_recorder(aval)],
            **kw,
        )
        torch.manual_seed(1)
        for exp in _benchmark(tasks).train_stream:
            strategy.train(exp, shuffle=False)
    _same(plain, aval)
    return strategy.plugin.method


def test_fromp_with_adam_plain_loop_equals_the_strategy(float64):
    tasks = _tasks(class_incremental=False)
    method = _fromp_routes(
        tasks,
        True,
        lambda m: torch.optim.Adam(m.parameters(), lr=0.02),
        tau=0.5,
        n_points=6,
        grad_clip_norm=0.05,  # tau * grad_clip_norm: clips most steps
    )
    assert method.task_count == 3 and float(method.last_penalty) > 0


def test_fromp_with_ivon_plain_loop_equals_the_strategy(float64):
    from fromp.optim import IVON

    tasks = _tasks(class_incremental=False)
    method = _fromp_routes(
        tasks,
        True,
        lambda m: IVON(m.parameters(), lr=0.05, ess=24, hess_init=0.5),
        tau=0.5,
        n_points=6,
        grad_clip_norm=1.0,
        posterior="ivon",
    )
    assert method.task_count == 3 and "penalty" in method.last_terms


def test_fromp_coreset_and_context_plain_loop_equals_the_strategy(float64):
    tasks = _tasks(class_incremental=True)
    method = _fromp_routes(
        tasks,
        False,
        lambda m: torch.optim.Adam(m.parameters(), lr=0.02),
        tau=0.25,
        n_points=6,
        function="logits",
        replay=True,
        replay_weight=2.0,
        context_tau=0.5,
    )
    assert set(method.last_terms) == {"penalty", "replay", "context"}


def test_fromp_class_incremental_defaults_plain_loop_equals_the_strategy(float64):
    """Nothing but ``n_points`` on a class-incremental stream: the plain loop (told the
    classes) and the strategy resolve the same ``"auto"`` settings in ``begin_task`` (the
    coreset weighted by the experiences' sizes and replayed whole, the penalty on every point
    under the per-point kernel; no context term) and train to the same weights."""
    from fromp.continual.methods import CI_TAU

    sizes = (24, 16, 20)  # experiences of different sizes: b_s = N_s / (S M_s) differ
    tasks = [(x[:n], y[:n], t) for (x, y, t), n in zip(_tasks(class_incremental=True), sizes)]
    method = _fromp_routes(
        tasks, False, lambda m: torch.optim.Adam(m.parameters(), lr=0.02), n_points=6
    )
    assert method.class_incremental and method.function == "logits"
    assert (method.tau, method.replay, method.replay_weight, method.context_tau) == (
        CI_TAU,
        True,
        None,  # per-set weights
        0.0,
    )
    assert method.kernel == "per_point" and method.memory_points() is None  # every point
    assert method.replay_draws() is None  # exact coreset
    weights = [n / (3 * 6) for n in sizes]  # 3 sets of n_points = 6 after the last task
    torch.testing.assert_close(method.set_weights().tolist(), weights)
    assert set(method.last_terms) == {"penalty", "replay"}


def test_ewc_plain_loop_equals_the_strategy(float64):
    from fromp_avalanche import EWC
    from fromp_avalanche.models import as_avalanche_model

    tasks = _tasks(class_incremental=False)
    torch.manual_seed(0)
    net = MultiHeadMLP(6, (10,), n_heads=3, head_size=2)
    twin = copy.deepcopy(net)
    plain, aval = _Recorder(net), _Recorder(twin)
    kw = dict(ewc_lambda=50.0, fisher="exact")
    opt = torch.optim.Adam(net.parameters(), lr=0.02)
    _plain_loop(EWCMethod(batch_size=BS, **kw), net, tasks, opt, plain)
    model = as_avalanche_model(twin)
    strategy = EWC(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.02),
        train_mb_size=BS,
        train_epochs=EPOCHS,
        evaluator=None,
        plugins=[_avalanche_recorder(aval)],
        **kw,
    )
    for exp in _benchmark(tasks).train_stream:
        strategy.train(exp, shuffle=False)
    _same(plain, aval)
    assert strategy.plugin.method.task_count == 3


def test_vcl_plain_loop_equals_the_strategy(float64):
    from fromp_avalanche import VCL

    tasks = _tasks(class_incremental=False)
    settings = dict(
        train_samples=2,
        ml_init_epochs=1,
        ml_lr=0.01,
        prior_precision=2.0,
        mean_init_std=0.1,
        seed=4,
    )
    torch.manual_seed(0)
    net = MultiHeadMLP(6, (10,), n_heads=3, head_size=2)
    twin = copy.deepcopy(net)

    torch.manual_seed(5)  # mean_init_std re-draws the means
    method = VCLMethod(net, **settings)
    plain = _Recorder(method.mean_field)  # the means (net's parameters) and log-variances
    opt = torch.optim.Adam(method.parameters(), lr=0.01)
    for e, (x, y, t) in enumerate(tasks):
        method.begin_task(net, task=t, experience=e, ess=len(x))
        method.ml_init(x, y, epochs=EPOCHS, lr=0.01, batch_size=BS)  # task 1 only
        for _ in range(EPOCHS):
            for s in range(0, len(x), BS):
                plain.seed()
                xb, yb = x[s : s + BS], y[s : s + BS]
                nll, logits = method.nll(xb, yb, t)
                loss = nll + method.loss_terms(net, xb, logits, task=t, loss=nll)
                plain.loss(loss)
                opt.zero_grad()
                loss.backward()
                method.before_update(net, opt)
                opt.step()
        assert opt.state  # Adam's moments of the experience ...
        method.learn_task(net, x, y, t, optimizer=opt, experience=e)
        assert not opt.state  # ... cleared: a fresh Adam per task, as the reference code
        plain.done()

    torch.manual_seed(5)
    user_opt = torch.optim.Adam(twin.parameters(), lr=0.01)
    with pytest.warns(UserWarning, match="log-variance"):
        strategy = VCL(
            model=twin,
            optimizer=user_opt,
            train_mb_size=BS,
            train_epochs=EPOCHS,
            evaluator=None,
            plugins=[],
            **settings,
        )
    assert strategy.model is twin and strategy.optimizer is user_opt
    aval = _Recorder(strategy.method.mean_field)
    strategy.plugins.append(_avalanche_recorder(aval))
    for exp in _benchmark(tasks).train_stream:
        strategy.train(exp, shuffle=False)
    _same(plain, aval)
    assert strategy.method.task_count == 3 and strategy.method.seen_heads == {0, 1, 2}
    # the user's model is the posterior means
    for p, q in zip(twin.parameters(), net.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def test_begin_tasks_experience_is_learn_tasks_default_key():
    net, x, y = _trained_one_head()
    methods = (
        (FROMPMethod(n_points=4), net),
        (EWCMethod(1.0, fisher="exact"), net),
        (VCLMethod(nn.Linear(5, 4).double(), train_samples=1), None),
    )
    for method, model in methods:
        model = method.model if model is None else model
        for key in (5, 2, 5):  # 5 learnt again: counted once
            method.begin_task(model, task=None, experience=key, ess=len(x))
            method.learn_task(model, x, y, None)
        assert method.experiences == [2, 5] and method.task_count == 2, type(method)
        method.learn_task(model, x, y, None)  # no begin_task key now: a new one
        assert method.experiences == [2, 5, 6]


# ------------------------------------------------------------- weights by closed forms
def _trained_one_head():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    x = torch.randn(40, 5, dtype=D)
    y = torch.arange(40) % 2
    return net, x, y


def test_fromp_loss_terms_are_the_weighted_closed_forms():
    """``loss_terms = tau R + w sum_s mean NLL(X_s, Y_s) + kappa 1/2 mean_b ||dp_S||^2``,
    each part written out here (identity kernel: ``R = 1/2 ||p(X; w) - p(X; w_old)||^2``)
    and its entry in ``last_terms`` the weighted part; tau = 0 drops the penalty only."""
    net, x, y = _trained_one_head()
    tau, w, kappa = 3.0, 2.5, 0.7
    settings = dict(kernel="identity", replay=True, replay_weight=w, context_tau=kappa, jitter=0.0,
                    function="probs", memory_batch=None)  # fmt: skip
    method = FROMPMethod(tau, 6, **settings)
    method.learn_task(net, x, y, None)
    old = copy.deepcopy(net)
    xm, ym = method.regularizer.memories[0].inputs, method.regularizer.memories[0].labels
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.3 * torch.randn_like(p))
    xb = torch.randn(9, 5, dtype=D)
    out = net(xb)
    loss = torch.tensor(0.8, dtype=D)
    method.begin_task(net, task=0, classes=[2, 3])
    got = method.loss_terms(net, xb, out, task=0, loss=loss)
    with torch.no_grad():
        r = (net(xm).softmax(-1) - old(xm).softmax(-1))[:, :2]  # the units trained: 0, 1
        penalty = 0.5 * (r * r).sum()
        replay = F.cross_entropy(net(xm), ym)
        dp = out.softmax(-1)[:, :2] - old(xb).softmax(-1)[:, :2]
        context = 0.5 * (dp * dp).sum(1).mean()
    want = tau * penalty + w * replay + kappa * context
    torch.testing.assert_close(got.detach(), want, rtol=1e-10, atol=0)
    for key, part in (
        ("penalty", tau * penalty),
        ("replay", w * replay),
        ("context", kappa * context),
    ):
        torch.testing.assert_close(method.last_terms[key], part, rtol=1e-10, atol=0)
    torch.testing.assert_close(method.last_penalty, penalty, rtol=1e-10, atol=0)
    free = FROMPMethod(0.0, 6, **settings)
    free.load_state_dict({**method.state_dict(), "tau": 0.0})
    free.attach_previous(old)
    got0 = free.loss_terms(net, xb, out, task=0, loss=loss)
    torch.testing.assert_close(got0.detach(), w * replay + kappa * context, rtol=1e-10, atol=0)
    assert "penalty" not in free.last_terms


@pytest.mark.parametrize(("tau", "clip"), [(4.0, 0.01), (0.0, 0.05), (4.0, 1e6)])
def test_before_update_clips_at_tau_times_grad_clip_norm(tau, clip):
    """The gradient after ``before_update`` is ``g * min(1, c / ||g||)`` with ``c = tau *
    grad_clip_norm`` (``grad_clip_norm`` when tau = 0), torch's clipping rule written out."""
    net, x, y = _trained_one_head()
    method = FROMPMethod(tau, 6, grad_clip_norm=clip)
    F.cross_entropy(net(x), y).backward()
    g = torch.cat([p.grad.reshape(-1) for p in net.parameters()]).clone()
    method.before_update(net, torch.optim.SGD(net.parameters(), lr=0.1))
    after = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
    c = clip * (tau if tau > 0 else 1.0)
    scale = min(1.0, c / (float(g.norm()) + 1e-6))
    assert (scale < 1) is (clip < 1)  # the cases clip, and do not clip
    torch.testing.assert_close(after, g * scale, rtol=1e-12, atol=0)


def test_ewc_loss_terms_are_the_weighted_quadratic_and_vcl_the_kl_over_n():
    net, x, y = _trained_one_head()
    ewc = EWCMethod(6.0, batch_size=4, fisher="exact")
    ewc.learn_task(net, x, y, None)
    anchor = [p.detach().clone() for p in net.parameters()]
    fisher = ewc.importances[0]
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.1)
    ewc.begin_task(net)
    got = ewc.loss_terms(net, x, net(x))
    want = sum(
        (fisher[n] * (p - a) ** 2).sum()
        for (n, p), a in zip(net.named_parameters(), anchor, strict=True)
    )
    torch.testing.assert_close(got.detach(), 6.0 / 4 * want.detach(), rtol=1e-12, atol=0)

    vcl = VCLMethod(nn.Sequential(nn.Linear(5, 3)).double(), prior_precision=2.0)
    vcl.begin_task(vcl.model, task=None, ess=40)
    with torch.no_grad():
        for m, lv, _, _ in vcl.mean_field.gaussian_sites():
            m.add_(0.2)
            lv.add_(0.5)
    kl = 0.0
    for m, lv, m0, v0 in vcl.mean_field.gaussian_sites():
        v = lv.exp()
        kl = kl + 0.5 * (torch.log(v0 / v) + (v + (m - m0) ** 2) / v0 - 1).sum()
    got = vcl.loss_terms(vcl.model, x, x)
    torch.testing.assert_close(got.detach(), kl.detach() / 40, rtol=1e-12, atol=0)


# ------------------------------------------------------------ the base class's bookkeeping
class _L2(ContinualMethod):
    """A user's own method: an L2 pull towards the weights after each experience."""

    def __init__(self, weight: float) -> None:
        super().__init__()
        self.weight, self.anchor, self.starts = weight, None, []

    def _begin(self, net, start):
        self.starts.append(start)

    def _loss_terms(self, net, x, output, task, loss):
        if self.anchor is None:
            return output.new_zeros(())
        value = self.weight * sum(
            ((p - a) ** 2).sum() for p, a in zip(net.parameters(), self.anchor, strict=True)
        )
        self.last_terms["l2"] = value.detach()
        return value

    def _learn(self, net, x, y, task, optimizer, key):
        self.anchor = [p.detach().clone() for p in net.parameters()]
        return key

    def state_dict(self):
        return {"anchor": self.anchor}

    def load_state_dict(self, state, *, device=None):
        self.anchor = state["anchor"]


def test_a_users_method_gets_the_bookkeeping_from_the_base_class():
    class Half(ContinualMethod):  # hooks missing: refused at construction
        def _begin(self, net, start):
            pass

    with pytest.raises(TypeError, match="abstract"):
        Half()
    net, x, y = _trained_one_head()
    method = _L2(2.0)
    assert isinstance(method, ContinualMethod)
    method.begin_task(net, task=None, experience=np.int64(3), ess=40, classes=torch.tensor([0, 1]))
    start = method.starts[-1]
    assert start == TaskStart(task=None, experience=3, ess=40, classes=(0, 1), growing_head=False)
    assert type(start.experience) is int and all(type(c) is int for c in start.classes)
    assert method.learn_task(net, x, y, None) == 3  # begin_task's key, the hook's value
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.1)
    out = net(x)
    got = method.loss_terms(net, x, out)
    n = sum(p.numel() for p in net.parameters())
    torch.testing.assert_close(got.detach(), torch.tensor(2.0 * n * 0.01, dtype=D))
    assert set(method.last_terms) == {"l2"}
    method.begin_task(net, experience=3, ess=40)  # learnt again: counted once
    assert method.last_terms == {}  # emptied for the new experience
    method.learn_task(net, x, y, None)
    method.learn_task(net, x, y, None)  # no key from begin_task now: a new one
    assert method.experiences == [3, 4] and method.task_count == 2


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(ess=0), "ess"),
        (dict(ess=2.5), "ess"),
        (dict(experience=True), "experience"),
        (dict(experience="a"), "experience"),
        (dict(classes=["a"]), "classes"),
    ],
)
def test_begin_task_refuses_bad_arguments_by_name_before_any_change(kwargs, name):
    net = _trained_one_head()[0]
    methods = (
        (FROMPMethod(n_points=4), net),
        (EWCMethod(1.0, fisher="exact"), net),
        (VCLMethod(nn.Linear(5, 4).double(), train_samples=1), None),
        (_L2(1.0), net),
    )
    for method, model in methods:
        model = method.model if model is None else model
        method.begin_task(model, experience=7, ess=40)
        method.last_terms["x"] = torch.zeros(())
        with pytest.raises(ValueError, match=name):
            method.begin_task(model, **{"ess": 40, **kwargs})
        assert method._experience == 7 and "x" in method.last_terms, type(method)
