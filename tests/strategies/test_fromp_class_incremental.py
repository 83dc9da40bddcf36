"""Class-incremental FROMP with Avalanche's IncrementalClassifier (masking on, its default):
the kernel and the penalty cover the classes seen so far only, the memorable points of old
classes go through the current (grown) head, the penalty equals a dense float64 computation
after tasks 2 and 3, and the memorable set doubles as a labelled coreset (``replay=True``)."""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from avalanche.benchmarks.scenarios.deprecated.generators import tensors_benchmark
from avalanche.models import IncrementalClassifier
from fromp_avalanche.fromp import FROMP
from torch import nn

from tests.strategies.probe import LossProbe

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

N_EXP, D = 3, 8


class _Net(nn.Module):
    """A body and Avalanche's IncrementalClassifier (grows and unmasks units per class)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(D, 12), nn.Tanh())
        self.classifier = IncrementalClassifier(12, initial_out_features=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.body(x))


#: classes per experience, in a shuffled order (as SplitMNIST's): after experience 1 the
#: head has 5 units of which 0, 2 and 3 are masked; after experience 2, 6 with 2, 3 masked
ORDER = [[4, 1], [0, 5], [2, 3]]


def _stream(seed: int = 0):
    """Class-incremental: experience e holds classes ORDER[e] (global labels, one head)."""
    g = torch.Generator().manual_seed(seed)
    means = 2.0 * torch.randn(2 * N_EXP, D, generator=g, dtype=torch.float64)

    def make(k: int, e: int):
        y = torch.tensor(ORDER[e])[torch.arange(k) % 2]
        return means[y] + 0.7 * torch.randn(k, D, generator=g, dtype=torch.float64), y

    train = [make(40, e) for e in range(N_EXP)]
    test = [make(20, e) for e in range(N_EXP)]
    return tensors_benchmark(train, test, task_labels=[0] * N_EXP)


@contextlib.contextmanager
def _float64():
    """float64 by default (the heads IncrementalClassifier grows are built in it)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _train(
    tau: float = 10.0,
    replay: bool = False,
    n_points: int = 6,
    replay_weight: float | str = "auto",
    n_exp: int = N_EXP,
):
    """FROMP trained on the first ``n_exp`` experiences (seed 0), float64: ``(strategy, net,
    probe, snapshots, benchmark)``, ``snapshots`` the model right after each experience."""
    with _float64():
        torch.manual_seed(0)
        net = _Net().double()
        probe = LossProbe()
        strategy = FROMP(
            model=net,
            optimizer=torch.optim.Adam(net.parameters(), lr=1e-2),
            train_mb_size=10,
            train_epochs=2,
            eval_mb_size=50,
            evaluator=None,
            plugins=[probe],
            tau=tau,
            n_points=n_points,
            replay=replay,
            replay_weight=replay_weight,
            function="probs",  # the exact maths of the probabilities' penalty and of the
            kernel="per_class",  # coreset: every point every step (the class-incremental
            context_tau=0.0,  # defaults, their kernel and estimators:
            memory_batch=None,  # test_fromp_ci_defaults.py)
        )
        snapshots = []
        bm = _stream()
        for exp in list(bm.train_stream)[:n_exp]:
            strategy.train(exp)
            snapshots.append(copy.deepcopy(net))
        return strategy, net, probe, snapshots, bm


def _dense_penalty(net: nn.Module, at_task: nn.Module, strategy) -> torch.Tensor:
    """``1/2 sum_s sum_c r_sc^T (K_sc + jitter I)^{-1} r_sc`` by dense float64 autograd:
    ``K_sc = J_sc diag(Sigma) J_sc^T`` with ``J_sc = d softmax_c(f(X_s; w_t)) / dw`` at the
    weights ``w_t`` of the last learn_task (``at_task``), the units ``c`` those
    IncrementalClassifier had switched on then, targets ``softmax(f(X_s; w_t))``, and
    ``r = softmax(f(X_s; w))`` of ``net`` on those units."""
    method = strategy.plugin.method
    sigma = method.posterior_variance(at_task).double()
    units = torch.nonzero(at_task.classifier.active_units).squeeze(1)
    names = [n for n, p in at_task.named_parameters()]
    params = {n: p.detach().double() for n, p in at_task.named_parameters()}

    def probs(flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        d, i = {}, 0
        for n in names:
            d[n] = flat[i : i + params[n].numel()].view_as(params[n])
            i += params[n].numel()
        return torch.softmax(torch.func.functional_call(at_task, d, (x,)), -1)

    flat = torch.cat([params[n].reshape(-1) for n in names])
    total = torch.zeros((), dtype=torch.float64)
    for m in method.regularizer.memories:
        x = m.inputs.double()
        target = probs(flat, x)[:, units]
        jac = torch.autograd.functional.jacobian(lambda w, x=x: probs(w, x), flat)  # [M, C, P]
        p_now = torch.softmax(net(x).double(), -1)[:, units]
        for j, c in enumerate(units.tolist()):
            jc = jac[:, c]
            k = jc @ (sigma[:, None] * jc.T) + m.jitter * torch.eye(len(x), dtype=x.dtype)
            r = p_now[:, j] - target[:, j]
            total = total + 0.5 * r @ torch.linalg.solve(k, r)
    return total


@pytest.fixture(scope="module")
def trained():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _train()
    return (*out, caught)


def test_memorable_sets_cover_the_classes_seen_so_far(trained):
    strategy, net, _, snapshots, _, _ = trained
    mems = strategy.plugin.method.regularizer.memories
    assert len(mems) == N_EXP
    # after task 3 every set is regularised on the 6 classes seen, no masked unit left
    seen = torch.nonzero(net.classifier.active_units).squeeze(1).tolist()
    assert seen == list(range(2 * N_EXP))
    for m in mems:
        assert m.units.tolist() == seen
        # no unit with a kernel of jitter alone (a masked unit would have K = jitter I)
        kdiag = (m.chol**2).sum(-1)  # diag(L L^T) = diag(K + jitter I)
        assert float(kdiag.min()) > 100 * m.jitter
        assert m.labels is not None and sorted(set(m.labels.tolist())) == sorted(
            {int(c) for c in m.labels}
        )
    # old classes' points: labels of the experience they came from
    for m, classes in zip(mems, ORDER):
        assert sorted(set(m.labels.tolist())) == sorted(classes)
    # while experience 3 trained: two sets on the units switched on by then (masked units
    # 2 and 3 left out), read from IncrementalClassifier's own mask
    upto = _train_memories_upto(2)
    active = torch.nonzero(snapshots[1].classifier.active_units).squeeze(1).tolist()
    assert active == [0, 1, 4, 5]
    for m in upto.plugin.method.regularizer.memories:
        assert m.units.tolist() == active
        assert m.chol.shape[0] == 4 and float((m.chol**2).sum(-1).min()) > 100 * m.jitter


def test_penalty_matches_dense_float64_after_tasks_2_and_3(trained):
    strategy, _, probe, snapshots, _, _ = trained
    tau = strategy.plugin.method.tau
    # the second step of experiences 2 and 3 (the weights have moved once since learn_task):
    # the loss handed to the backward pass is CE + tau * R with R computed densely here
    method = strategy.plugin.method
    saved = list(method.regularizer.memories)
    for exp in (1, 2):
        step = [s for s in probe.steps if s["exp"] == exp][1]
        # the memorable sets as they were during experience `exp`: the first `exp` sets
        # recomputed at learn_task of experience exp - 1
        at_task = snapshots[exp - 1]
        fresh = _train_memories_upto(exp)
        method.regularizer.memories = fresh.plugin.method.regularizer.memories
        expected = step["ce"] + tau * float(_dense_penalty(step["net"], at_task, fresh))
        method.regularizer.memories = saved
        assert step["loss"] == pytest.approx(expected, rel=1e-6, abs=1e-9)
        assert step["loss"] - step["ce"] > 0


def _train_memories_upto(exp: int, replay: bool = False, replay_weight: float | str = "auto"):
    """The strategy trained on the first ``exp`` experiences (same seed): its memorable sets
    are those that were regularising experience ``exp``."""
    return _train(replay=replay, replay_weight=replay_weight, n_exp=exp)[0]


def test_penalty_is_finite_and_of_the_order_of_the_loss(trained):
    _, _, probe, _, _, caught = trained
    for exp in (1, 2):
        steps = [s for s in probe.steps if s["exp"] == exp]
        ratios = [(s["loss"] - s["ce"]) / s["ce"] for s in steps]
        assert all(torch.isfinite(torch.tensor(ratios)))
        assert max(ratios) < 100, max(ratios)
    assert not any("dominates" in str(w.message) for w in caught)


@pytest.mark.parametrize("weight", [1.0, 2.5])
def test_replay_adds_the_memorable_points_loss_under_their_labels(weight):
    strategy, net, probe, snapshots, _ = _train(replay=True, replay_weight=weight)
    method = strategy.plugin.method
    # each earlier task's coreset stands in for its data term (weight 1, as the current
    # task's mean loss): the sum over the sets of each set's mean cross-entropy
    sets = method.regularizer.memories
    assert len(sets) == 3
    expected = sum(F.cross_entropy(net(m.inputs), m.labels) for m in sets)
    torch.testing.assert_close(method.regularizer.replay_loss(net), expected)
    # the method's replay term carries replay_weight, the regulariser's does not
    torch.testing.assert_close(method.terms(net)[1], weight * expected)
    # in training: loss = CE(batch) + w * replay + tau * R, the replay part checked at the
    # second step of experiences 2 (one memorable set) and 3 (two sets)
    for exp in (1, 2):
        step = [s for s in probe.steps if s["exp"] == exp][1]
        upto = _train_memories_upto(exp, replay=True, replay_weight=weight)
        mems = upto.plugin.method.regularizer.memories
        assert len(mems) == exp
        replay = sum(float(F.cross_entropy(step["net"](m.inputs), m.labels)) for m in mems)
        pen = float(method.tau) * float(_dense_penalty(step["net"], snapshots[exp - 1], upto))
        assert step["loss"] == pytest.approx(step["ce"] + weight * replay + pen, rel=1e-6)


def test_replay_weight_is_checked_saved_and_refused_on_mismatch():
    from fromp import FROMPMethod

    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="replay_weight"):
            FROMPMethod(replay=True, replay_weight=bad)
    for bad in (True, "2", None):
        with pytest.raises(TypeError, match="replay_weight"):
            FROMPMethod(replay=True, replay_weight=bad)
    with pytest.raises(ValueError, match="replay=True"):
        FROMPMethod(replay=False, replay_weight=2.0)  # no coreset to weigh
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(D, 12), nn.Tanh(), nn.Linear(12, 2 * N_EXP)).double()
    method = FROMPMethod(n_points=6, replay=True, replay_weight=3.0, memory_batch=None)
    from fromp_avalanche.benchmarks import experience_tensors

    x, y, _ = experience_tensors(_stream().train_stream[0].dataset)
    method.learn_task(net, x, y, None)
    state = method.state_dict()
    assert state["replay_weight"] == 3.0
    same = FROMPMethod(n_points=6, replay=True, replay_weight=3.0, memory_batch=None)
    same.load_state_dict(state)
    torch.testing.assert_close(same.terms(net)[1], method.terms(net)[1])
    with pytest.raises(ValueError, match="replay_weight"):
        FROMPMethod(n_points=6, replay=True).load_state_dict(state)
    older = {k: v for k, v in state.items() if k != "replay_weight"}  # no older forms
    with pytest.raises(ValueError, match=r"missing keys \['replay_weight'\]"):
        FROMPMethod(n_points=6, replay=True, replay_weight=3.0).load_state_dict(older)


def test_fixed_head_regularised_on_the_classes_trained_so_far():
    # a fixed 6-way head (no masking): the units of classes not trained yet have small but
    # non-zero probabilities and kernels near the jitter; they are left out until trained
    from fromp_avalanche.benchmarks import experience_tensors

    from fromp import FROMPMethod

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(D, 12), nn.Tanh(), nn.Linear(12, 2 * N_EXP)).double()
    method = FROMPMethod(n_points=6)
    trained: set[int] = set()
    for e, exp in enumerate(_stream().train_stream):
        x, y, _ = experience_tensors(exp.dataset)
        method.learn_task(net, x, y, None)
        trained |= set(ORDER[e])
        for m in method.regularizer.memories:
            assert m.units.tolist() == sorted(trained)
            assert m.targets.shape[1] == len(trained)
    fresh = FROMPMethod(n_points=6)
    fresh.load_state_dict(method.state_dict())
    assert fresh.regularizer.classes_seen == {None: list(range(2 * N_EXP))}


def test_replay_defaults_to_a_random_class_balanced_coreset():
    # the points with the largest tr(Lambda) are the ambiguous ones: as a labelled coreset
    # they taught a class-incremental network much less than random points of each class
    # (split MNIST: 70.5 % against 90.9 %); replay=True draws at random unless told
    from fromp_avalanche.benchmarks import experience_tensors

    from fromp import FROMPMethod

    assert FROMPMethod().select == "descending"
    assert FROMPMethod(replay=True).select == "random"
    assert FROMPMethod(replay=True, select="descending").select == "descending"
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(D, 12), nn.Tanh(), nn.Linear(12, 2 * N_EXP)).double()
    x, y, _ = experience_tensors(_stream().train_stream[0].dataset)
    chosen = {}
    for select in (None, "descending"):
        method = FROMPMethod(n_points=10, replay=True, select=select)
        method.learn_task(net, x, y, None)
        m = method.regularizer.memories[0]
        assert sorted(m.labels.tolist()) == sorted(ORDER[0] * 5)  # 5 of each class
        chosen[select] = {tuple(v.tolist()) for v in m.inputs}
    # tr(Lambda) of softmax outputs by hand: sum_c p_c (1 - p_c); the 5 largest per class
    with torch.no_grad():
        p = torch.softmax(net(x), -1)
    score = (p * (1 - p)).sum(-1)
    top = set()
    for c in ORDER[0]:
        idx = torch.nonzero(y == c).squeeze(1)
        top |= {tuple(v.tolist()) for v in x[idx[score[idx].argsort(descending=True)[:5]]]}
    assert chosen["descending"] == top
    assert chosen[None] != top
