"""FROMP's ``"auto"`` settings on class-incremental streams (issue 56): an experience that
brings classes to a head trained before, or a head that grows with the classes, turns the
coreset on (with the logits' penalty under the per-point kernel on every stored point; the
context term stays off), a coreset turned off by the user is named once at the start of
each such experience, and task- and domain-incremental streams keep the paper's settings.
The coreset's weights against their closed form, the replay loss's estimator against the
full sum in expectation, and the penalty (per-class kernels on the first ``k`` points of each
set, per-point kernels) against dense float64 ones."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fromp import FROMPMethod
from fromp.continual.methods import CI_TAU
from fromp.continual.regularizer import FROMPRegularizer
from fromp.models import MultiHeadMLP
from tests.cases import tiny_mlp

D = torch.float64


def _data(classes: list[int], n: int = 24, d: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    y = torch.tensor(classes)[torch.arange(n) % len(classes)]
    return torch.randn(n, d, generator=g, dtype=D) + 0.3 * y[:, None].to(D), y


def _loop(method: FROMPMethod, net: nn.Module, stream, *, tell: bool = True, **facts):
    """A plain loop (one step per experience, batch 8): ``(warnings per experience,
    whether the stream was class-incremental at each step)``."""
    opt = torch.optim.SGD(net.parameters(), lr=1e-2)
    caught, flags = [], []
    for e, (x, y, task) in enumerate(stream):
        head = (lambda v, t=task: net(v, task=t)) if task is not None else net
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            if tell:
                classes = y.unique().tolist()
                method.begin_task(net, task=task, experience=e, ess=len(x), classes=classes,
                                  **facts)  # fmt: skip
            else:
                method.begin_task(net, task=task, experience=e)
        caught.append([str(m.message) for m in w if "FROMP" in str(m.message)])
        flags.append(method.class_incremental)
        out = head(x[:8])
        loss = F.cross_entropy(out, y[:8])
        loss = loss + method.loss_terms(net, x[:8], out, task=task, loss=loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        method.learn_task(net, x, y, task, experience=e)
    return caught, flags


def _ci_stream():
    return [(*_data([2 * e, 2 * e + 1], seed=e), None) for e in range(3)]


def _resolved(method: FROMPMethod) -> tuple:
    return (method.tau, method.replay, method.replay_weight, method.context_tau,
            method.select, method.memory_points(8), method.kernel)  # fmt: skip


PAPER = (10.0, False, 1.0, 0.0, "descending", None, "per_class")
UNSET = (*PAPER[:-1], "auto")  # before the first experience: the kernel not chosen yet
# per-set weights, no context term, every point under the per-point kernel
CI = (CI_TAU, True, None, 0.0, "random", None, "per_point")


@pytest.mark.parametrize("tell", [True, False], ids=["classes-told", "plain-loop"])
def test_new_global_labels_on_a_fixed_head_turn_the_coreset_on(tell):
    """A fixed 6-way head whose first experience brings 2 classes: class-incremental from
    the first learn_task (the labels do not fill the head), told or not."""
    method = FROMPMethod(n_points=6)
    assert _resolved(method) == UNSET and method.function == "auto"
    caught, flags = _loop(method, tiny_mlp(4, 5, 6, seed=0), _ci_stream(), tell=tell)
    assert flags == [False, True, True] and method.class_incremental
    assert _resolved(method) == CI and method.function == "logits"
    assert caught == [[], [], []]  # the coreset is on: nothing to say
    assert method.previous is None  # no context term: no copy of the network kept
    # the penalty and the replay loss cover every point, each point its own [C, C] kernel
    memories = method.regularizer.memories
    assert [m.n_penalised for m in memories] == [6, 6, 6]
    assert [tuple(m.chol.shape) for m in memories] == [(6, 6, 6)] * 3  # the 6 units seen


def test_a_growing_head_turns_the_coreset_on_from_its_first_experience():
    method = FROMPMethod(n_points=6)
    method.begin_task(tiny_mlp(4, 5, 2, seed=0), experience=0, classes=[0, 1], growing_head=True)
    assert method.class_incremental and _resolved(method) == CI
    assert method.function == "logits"  # chosen now: the first experience fills the head


def test_new_classes_on_a_trained_head_turn_it_on_at_begin_task():
    """One head that the first experience fills (a domain-incremental start), then a head
    grown by the loop itself (no ``growing_head``) and labels beyond those trained."""
    method = FROMPMethod(n_points=6)
    method.learn_task(tiny_mlp(4, 5, 4, seed=0), *_data([0, 1, 2, 3]), None, experience=0)
    assert not method.class_incremental and method.function == "logits"
    grown = tiny_mlp(4, 5, 6, seed=0)
    method.begin_task(grown, experience=1, classes=[0, 1])  # classes trained before
    assert not method.class_incremental
    method.begin_task(grown, experience=1, classes=[4, 5])
    # the kernel was chosen with the first set (the paper's): the penalty's points bounded
    assert method.class_incremental and _resolved(method) == (*CI[:5], 8, "per_class")


def test_replay_turned_off_is_named_once_at_the_start_of_each_experience_with_new_classes():
    method = FROMPMethod(n_points=6, replay=False)
    caught, flags = _loop(method, tiny_mlp(4, 5, 6, seed=0), _ci_stream())
    assert flags == [False, True, True]
    assert [len(c) for c in caught] == [0, 1, 1]  # the first experience has no old classes
    for c in caught[1:]:
        assert "replay=False" in c[0] and "class-incremental" in c[0]
    assert not method.replay and method.function == "probs"  # no coreset: the probabilities
    assert method.tau == CI_TAU and method.context_tau == 0.0
    # whose [C, C] covariance per point is singular: the per-class kernel, on B points a set
    assert method.kernel == "per_class" and method.memory_points(8) == 8


@pytest.mark.parametrize("norm", [nn.BatchNorm1d, nn.LayerNorm, None])
def test_running_statistics_on_a_class_incremental_stream_are_named_once(norm):
    """Batch norm's running statistics with the coreset replayed in its own pass: a warning
    once, at the first experience known to be class-incremental, naming the layer and the
    normalisations without batch statistics; none for LayerNorm or no normalisation, and
    none on a task-incremental stream."""
    torch.manual_seed(0)
    layers = [nn.Linear(4, 5), *([norm(5)] if norm else []), nn.Tanh(), nn.Linear(5, 6)]
    method = FROMPMethod(n_points=6)
    caught, _ = _loop(method, nn.Sequential(*layers).to(D), _ci_stream())
    if norm is not nn.BatchNorm1d:
        assert caught == [[], [], []]
        return
    assert [len(c) for c in caught] == [0, 1, 0]  # class-incremental from learn_task 0
    assert "1 normalisation layers with running statistics (BatchNorm1d)" in caught[1][0]
    assert "LayerNorm, GroupNorm" in caught[1][0]
    heads = MultiHeadMLP(4, (5,), n_heads=3, head_size=2).to(D)
    first = next(i for i, m in enumerate(heads.body) if isinstance(m, nn.Linear))
    heads.body.insert(first + 1, nn.BatchNorm1d(5).to(D))
    caught, _ = _loop(FROMPMethod(n_points=6), heads, [(*_data([0, 1], seed=t), t)
                                                       for t in range(3)])  # fmt: skip
    assert caught == [[], [], []]


def test_explicit_settings_are_kept_on_a_class_incremental_stream():
    method = FROMPMethod(n_points=6, tau=2.0, replay_weight=7.0, context_tau=0.0,
                         memory_batch=None, select="descending")  # fmt: skip
    _loop(method, tiny_mlp(4, 5, 6, seed=0), _ci_stream())
    assert method.class_incremental
    assert _resolved(method) == (2.0, True, 7.0, 0.0, "descending", None, "per_point")
    assert method.set_weights() is None  # a given weight: the same on every set
    assert [m.n_penalised for m in method.regularizer.memories] == [6, 6, 6]


@pytest.mark.parametrize("layout", ["task-incremental", "domain-incremental"])
def test_task_and_domain_incremental_streams_keep_the_papers_settings(layout):
    if layout == "task-incremental":
        net = MultiHeadMLP(4, (5,), n_heads=3, head_size=2).to(D)
        stream = [(*_data([0, 1], seed=t), t) for t in range(3)]
    else:
        net = tiny_mlp(4, 5, 4, seed=0)
        stream = [(*_data([0, 1, 2, 3], seed=t), None) for t in range(3)]
    method = FROMPMethod(n_points=8)
    caught, flags = _loop(method, net, stream)
    assert flags == [False] * 3 and caught == [[], [], []]
    assert _resolved(method) == PAPER and method.previous is None
    assert method.set_weights() is None
    assert all(m.penalised is None for m in method.regularizer.memories)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"replay": "yes"}, TypeError, "replay must be True, False or 'auto'"),
        ({"tau": "big"}, TypeError, "tau must be a number or 'auto'"),
        ({"context_tau": -1.0}, ValueError, "context_tau must be a finite number >= 0, got"),
        ({"context_tau": "auto"}, TypeError, "context_tau must be a number, got str"),
        ({"replay_weight": 0.0}, ValueError, "replay_weight must be a finite number > 0"),
        ({"replay": False, "replay_weight": 2.0}, ValueError, "replay_weight=2.0"),
        ({"memory_batch": 0}, ValueError, "memory_batch must be a positive int or None"),
        ({"memory_batch": "all"}, ValueError, "memory_batch must be a positive int or None"),
        ({"select": "best"}, ValueError, "select must be None or one of"),
        ({"kernel": "diagonal"}, ValueError, "kernel must be 'auto' or one of"),
    ],
)
def test_bad_settings_refused_naming_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        FROMPMethod(**kwargs)


def test_state_keeps_the_resolution_and_refuses_other_settings():
    method = FROMPMethod(n_points=6)
    _loop(method, tiny_mlp(4, 5, 6, seed=0), _ci_stream())
    state = method.state_dict()
    assert state["tau"] == "auto" and state["class_incremental"] is True
    fresh = FROMPMethod(n_points=6)
    fresh.load_state_dict(state)
    assert fresh.class_incremental and _resolved(fresh) == CI
    assert fresh.examples == method.examples
    with pytest.raises(ValueError, match="memory_batch"):
        FROMPMethod(n_points=6, memory_batch=16).load_state_dict(state)
    with pytest.raises(ValueError, match="kernel='per_point', method has 'per_class'"):
        FROMPMethod(n_points=6, kernel="per_class").load_state_dict(state)
    unset = FROMPMethod(n_points=6).state_dict()  # saved before the first experience
    assert unset["kernel"] == "auto"
    chosen = FROMPMethod(n_points=6, kernel="joint")
    chosen.load_state_dict(unset)  # "auto" not chosen yet matches any kernel
    assert chosen.kernel == "joint"


# ---------------------------------------------------------------------- derived weights
def test_coreset_weights_follow_the_experiences_sizes():
    """``b_s = N_s / (S M_s)``: each replayed point weighs as the ``N_s / M_s`` examples of
    its experience it stands for, in the units of the current experience's mean loss."""
    method = FROMPMethod(n_points=6)
    net = tiny_mlp(4, 5, 6, seed=0)
    sizes = [30, 18, 24]
    for e, n in enumerate(sizes):
        x, y = _data([2 * e, 2 * e + 1], n=n, seed=e)
        method.begin_task(net, experience=e, ess=n, classes=[2 * e, 2 * e + 1])
        method.learn_task(net, x, y, None, experience=e)
    method.begin_task(net, experience=3, ess=12, classes=[0, 1])
    assert [len(m.inputs) for m in method.regularizer.memories] == [6, 6, 6]
    expected = torch.tensor([30 / 18, 18 / 18, 24 / 18], dtype=D)  # N_s / (3 sets x 6)
    torch.testing.assert_close(method.set_weights(), expected)
    # the new experience's size does not enter: each set stands for its own experience
    method.begin_task(net, experience=3, ess=500, classes=[0, 1])
    torch.testing.assert_close(method.set_weights(), expected)
    # sizes not counted (a state saved without them): as of the new experience's size,
    # else each set standing for its own points (weight 1 / S per set)
    counted, method.examples = dict(method.examples), {}
    method.begin_task(net, experience=3, ess=12, classes=[0, 1])
    torch.testing.assert_close(method.set_weights(), torch.full((3,), 12 / 18, dtype=D))
    method.begin_task(net, experience=3, classes=[0, 1])
    torch.testing.assert_close(method.set_weights(), torch.full((3,), 1 / 3, dtype=D))
    method.examples = counted
    method.begin_task(net, experience=3, ess=12, classes=[0, 1])
    # the replay loss is their weighted sum of the sets' mean NLLs, exactly (all points)
    method._memory_batch = None
    with torch.no_grad():
        _, rep = method.terms(net)
        want = sum(
            w * F.cross_entropy(net(m.inputs), m.labels)
            for w, m in zip(expected.tolist(), method.regularizer.memories)
        )
    torch.testing.assert_close(rep, want)


def test_the_default_replays_every_stored_point_exactly_and_an_int_draws():
    """``memory_batch="auto"`` on a class-incremental stream: a training step's coreset loss
    is the weighted sum over every stored point, exactly (no draws: estimates from draws at
    these weights are noisy enough to slow the newest classes down), and the penalty covers
    every point (per-point kernels); an int ``memory_batch = n`` draws ``ceil(n / S)``
    points per set and bounds the penalty to as many."""

    def no_draw(per_set: int) -> torch.Tensor:
        raise AssertionError(f"drew {per_set} points per set")

    for given, draws in (("auto", None), (6, 2)):
        method = FROMPMethod(n_points=6, memory_batch=given)
        net = tiny_mlp(4, 5, 6, seed=0)
        _loop(method, net, _ci_stream())  # three experiences, steps of batch 8
        memories = method.regularizer.memories
        penalised = [6, 6, 6] if given == "auto" else [2, 2, 2]  # all, ceil(6 / 3)
        assert [m.n_penalised for m in memories] == penalised
        method.begin_task(net, experience=3, ess=24, classes=[0, 1])
        assert method.replay_draws() == draws
        st = method.regularizer._stack()
        calls: list[int] = []
        st.draw = no_draw if draws is None else (lambda k, c=calls: c.append(k) or torch.arange(6))
        x, _ = _data([0, 1], n=8, seed=9)
        method.loss_terms(net, x, net(x))
        del st.draw
        if draws is not None:
            assert calls == [2]
            continue
        b = 24 / (3 * 6)  # b_s = N_s / (S M_s): 24 examples per experience, 3 sets of 6
        with torch.no_grad():
            want = sum(b * F.cross_entropy(net(m.inputs), m.labels) for m in memories)
        torch.testing.assert_close(method.last_terms["replay"], want)


# ---------------------------------------------------------------------- the estimator
def _regularizer(
    sizes=(5, 3, 4),
    c: int = 6,
    points: int | None = None,
    kernel: str = "per_class",
    seen: list[int] | None = None,
):
    torch.manual_seed(0)
    net = tiny_mlp(4, 5, c, seed=0)
    reg = FROMPRegularizer(kernel, function="logits")
    if seen is not None:  # the classes trained so far: the sets keep these units only
        reg.classes_seen[None] = seen
    for s, m in enumerate(sizes):
        x, y = _data([(2 * s) % c, (2 * s + 1) % c], n=m, seed=s)
        var = torch.full((sum(p.numel() for p in net.parameters()),), 0.1, dtype=D)
        reg.add_task(net, x, None, var, labels=y, penalty_points=points)
    return net, reg


def test_replay_estimator_is_unbiased_for_the_full_sum():
    """``b`` draws per set with replacement: the mean over all ``M_s^b`` equally likely
    draws of the estimate is the exact replay loss (checked by enumeration for ``b = 1``
    and in Monte Carlo for ``b = 2``), its gradient too; the penalty does not depend on the
    draws."""
    net, reg = _regularizer()
    weights = torch.tensor([1.0, 2.5, 0.5], dtype=D)
    exact_pen, exact = reg.terms(net, replay=True, replay_weights=weights)
    st = reg._stack()
    # b = 1: enumerate every draw (one point per set) through the estimator's own path
    total, count = torch.zeros((), dtype=D), 0
    for i0 in range(5):
        for i1 in range(3):
            for i2 in range(4):
                drawn = torch.tensor([i0, 5 + i1, 8 + i2])
                st.draw = lambda per_set, d=drawn: d  # type: ignore[method-assign]
                pen, rep = reg.terms(net, replay=True, replay_points=1, replay_weights=weights)
                torch.testing.assert_close(pen, exact_pen)
                total, count = total + rep.double(), count + 1
    del st.draw
    torch.testing.assert_close(total / count, exact.double(), rtol=1e-10, atol=1e-12)
    # b = 2, Monte Carlo: within 5 standard errors, the gradient too
    torch.manual_seed(1)
    params = list(net.parameters())
    g_exact = torch.autograd.grad(exact, params)
    reps, grads = [], []
    for _ in range(2000):
        _, rep = reg.terms(net, replay=True, replay_points=2, replay_weights=weights)
        reps.append(rep.detach())
        grads.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(rep, params)]))
    reps_t, grads_t = torch.stack(reps), torch.stack(grads)
    se = reps_t.std() / math.sqrt(len(reps_t))
    assert abs(float(reps_t.mean() - exact.detach())) < 5 * float(se)
    g_mean, g_se = grads_t.mean(0), grads_t.std(0) / math.sqrt(len(grads_t))
    g_want = torch.cat([g.reshape(-1) for g in g_exact])
    assert bool(((g_mean - g_want).abs() <= 5 * g_se + 1e-9).all())


def test_draws_cover_each_set_uniformly():
    _, reg = _regularizer(sizes=(5, 3))
    torch.manual_seed(0)
    idx = torch.cat([reg._stack().draw(4) for _ in range(4000)])
    counts = torch.bincount(idx, minlength=8).double()
    assert counts.sum() == 4000 * 8
    torch.testing.assert_close(counts[:5] / counts[:5].sum(), torch.full((5,), 0.2, dtype=D),
                               atol=0.02, rtol=0)  # fmt: skip
    torch.testing.assert_close(counts[5:] / counts[5:].sum(), torch.full((3,), 1 / 3, dtype=D),
                               atol=0.02, rtol=0)  # fmt: skip


@pytest.mark.parametrize("kernel", ["per_class", "per_point"])
def test_penalty_on_the_first_points_of_each_set_matches_dense_float64(kernel):
    """``penalty_points=k``: targets and kernels on each set's first ``k`` inputs, on the
    units of the classes seen (5 of the head's 6), the replay loss on all: per class ``K_c
    = J_c Sigma J_c^T`` ``[k, k]``, per point ``K_m = J(x_m) Sigma J(x_m)^T`` ``[C_s,
    C_s]``, by dense float64 autograd."""
    net, reg = _regularizer(points=2, kernel=kernel, seen=[0, 1, 2, 3, 4])
    assert [m.n_penalised for m in reg.memories] == [2, 2, 2]
    assert all(m.units.tolist() == [0, 1, 2, 3, 4] for m in reg.memories)
    names = [n for n, _ in net.named_parameters()]
    base = {n: p.detach().clone() for n, p in net.named_parameters()}
    flat = torch.cat([base[n].reshape(-1) for n in names])

    def logits(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        d, i = {}, 0
        for n in names:
            d[n] = w[i : i + base[n].numel()].view_as(base[n])
            i += base[n].numel()
        return torch.func.functional_call(net, d, (x,))

    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.1 * torch.randn_like(p))
    now = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    want = torch.zeros((), dtype=D)
    for m in reg.memories:
        x = m.inputs[:2]
        jac = torch.autograd.functional.jacobian(lambda w, x=x: logits(w, x), flat)
        r = logits(now, x) - logits(flat, x)
        u = m.units
        if kernel == "per_point":
            for i in range(2):
                k = 0.1 * jac[i, u] @ jac[i, u].T + m.jitter * torch.eye(len(u), dtype=D)
                want = want + 0.5 * r[i, u] @ torch.linalg.solve(k, r[i, u])
            continue
        for c in u.tolist():
            k = 0.1 * jac[:, c] @ jac[:, c].T + m.jitter * torch.eye(2, dtype=D)
            want = want + 0.5 * r[:, c] @ torch.linalg.solve(k, r[:, c])
    pen, rep = reg.terms(net, replay=True)
    torch.testing.assert_close(pen, want)
    with torch.no_grad():
        full = sum(F.cross_entropy(net(m.inputs), m.labels) for m in reg.memories)
    torch.testing.assert_close(rep, full)


def test_count_arguments_refused_naming_them():
    net, reg = _regularizer()
    with pytest.raises(ValueError, match="replay_points must be a positive int or None"):
        reg.terms(net, replay=True, replay_points=0)
    with pytest.raises(ValueError, match="penalty_points must be a positive int or None"):
        var = torch.full((sum(p.numel() for p in net.parameters()),), 0.1, dtype=D)
        reg.update(net, var, penalty_points=1.5)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- the runner's recipe
def test_the_runners_split_mnist_ci_recipe_keeps_its_exact_settings():
    """``fromp-bench split-mnist-ci``'s fromp-coreset entry (93.03 % before the defaults)
    sets every resolved setting: on a class-incremental stream it keeps one coreset weight
    ``c = 30`` on every set and every stored point every step, not the defaults."""
    from fromp_bench.settings import settings_for

    kw = dict(settings_for("fromp-coreset", "split-mnist-ci")["kwargs"])
    kw.pop("n_points")
    method = FROMPMethod(n_points=6, **kw)
    _loop(method, tiny_mlp(4, 5, 6, seed=0), _ci_stream())
    assert method.class_incremental and method.function == "logits"
    assert _resolved(method) == (0.1, True, 30, 0.3, "random", None, "per_class")
    assert method.set_weights() is None
    assert all(m.penalised is None for m in method.regularizer.memories)
