"""The cost of a training step on the host, held on the CPU. On a GPU a step at these sizes
is bound by kernel launches: the host's Python and dispatcher work to issue the step is its
time, and a value read back (or a tensor made from host data) stops the host from running
ahead of the GPU. Recorded on the CPU (dispatch and function modes, ``sys.setprofile``), so
what only a GPU pays for fails here:

* no training step of FROMP, EWC or VCL reads a value back or uploads host data: their
  penalties and backward passes, and their Avalanche iterations (the plugins' hooks,
  FROMP's penalty metric; ``tests.cases.host_syncs``);
* the penalties and their backward passes run the same operations after 1, 2 and 10 tasks;
* one whole training step of FROMP and of EWC after three experiences, in a plain loop over
  the method and through the Avalanche strategy (``tests.cases.StepRecorder``): nothing
  read back or uploaded from fromp's code, and the Python calls of fromp's code and the
  operations it dispatches outside the penalty within the bounds measured (numbers below,
  each with its reason).

The bugs these tests catch were on a GPU (H100, ``make gpu-check``): EWC's penalty made its
constant a tensor with ``new_tensor`` on every step, VCL's predictive did so with ``log S``,
and FROMP's penalty metric read ``tau * R`` back with ``float`` on every step; each is a
blocking copy, and on a launch-bound loop each step then waits for the GPU to drain. The
step's profile on split MNIST (``python -m studies.step_overhead``,
``benchmarks/results/gpu/step-overhead-cpu.md``) is where the bounds come from."""

from __future__ import annotations

import contextlib
import warnings
from functools import partial
from pathlib import Path

import fromp_avalanche
import pytest
import torch
import torch.nn.functional as F
from avalanche.benchmarks.scenarios.deprecated.generators import tensors_benchmark
from avalanche.core import SupervisedPlugin
from avalanche.evaluation.metrics import accuracy_metrics
from avalanche.training.plugins import EvaluationPlugin
from fromp_avalanche.ewc import EWC
from fromp_avalanche.fromp import FROMP, FROMPPenaltyMetric
from fromp_avalanche.vcl import VCL
from torch import nn

import fromp
from fromp.continual.ewc import EWCMethod
from fromp.continual.methods import FROMPMethod
from fromp.models import MultiHeadMLP, with_task
from tests.cases import StepRecorder, count_aten_ops, host_syncs, simulated_cuda_graphs

OURS = (str(Path(fromp.__file__).parent), str(Path(fromp_avalanche.__file__).parent))


# ------------------------------------------------------------------------ the recorder
def test_host_syncs_names_reads_uploads_and_data_dependent_shapes():
    a = torch.arange(4.0)
    assert host_syncs(lambda: a + 1) == []
    assert host_syncs(lambda: a * 2.5 + a.new_zeros(())) == []  # Python numbers: kernel args
    assert host_syncs(lambda: float(a.sum())) == ["_local_scalar_dense"]
    assert host_syncs(lambda: a.new_tensor(2.0)) == ["lift_fresh"]
    assert host_syncs(lambda: torch.tensor([1.0, 2.0])) == ["lift_fresh"]
    assert host_syncs(lambda: a[a > 1]) == ["index(boolean mask)"]
    assert host_syncs(lambda: a.nonzero()) == ["nonzero"]
    assert host_syncs(lambda: a[torch.tensor([0, 2])]) == ["lift_fresh"]  # the list, not the index


def test_host_syncs_within_counts_only_calls_from_the_named_code():
    a = torch.arange(4.0)
    here = str(Path(__file__))
    assert host_syncs(lambda: float(a.sum()), within=["/nowhere/"]) == []
    found = host_syncs(lambda: float(a.sum()), within=[here])
    assert len(found) == 1 and found[0].startswith(f"_local_scalar_dense@{here}:")


# ------------------------------------------------------------------ the methods' steps
def _data(task: int, n: int = 30):
    g = torch.Generator().manual_seed(100 + task)
    return torch.randn(n, 6, generator=g), torch.arange(n) % 3


def _net(multihead: bool) -> nn.Module:
    torch.manual_seed(0)
    if multihead:
        return MultiHeadMLP(6, (8,), n_heads=3, head_size=3)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _move(net: nn.Module) -> None:
    """Away from the weights just learnt, where the penalties and their gradients are 0."""
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.05 * torch.randn_like(p))


@pytest.mark.parametrize("multihead", [False, True])
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"replay": True}, {"function": "logits"}, {"kernel": "joint"}],
    ids=["probs", "replay", "logits", "joint"],
)
@pytest.mark.parametrize("n_tasks", [1, 2])
def test_fromp_penalty_step_never_syncs(kwargs, multihead, n_tasks):
    net = _net(multihead)
    method = FROMPMethod(n_points=6, **kwargs)
    for t in range(n_tasks):
        method.learn_task(net, *_data(t), t if multihead else None)
        _move(net)

    def step():
        net.zero_grad()
        pen, rep = method.terms(net)
        (pen + rep if rep is not None else pen).backward()

    step()  # the stacked state is built once per learnt task, outside the step
    assert host_syncs(step) == []
    assert sum(float(p.grad.abs().sum()) for p in net.parameters() if p.grad is not None) > 0


@pytest.mark.parametrize("mode", ["separate", "online"])
@pytest.mark.parametrize("n_tasks", [1, 2, 3])
def test_ewc_penalty_step_never_syncs_and_keeps_its_constant(mode, n_tasks):
    """The consolidated penalty ``S (w - a~)^2 + c``: no tensor made from ``c`` per step,
    and ``c`` still in the value (against the per-task sum written out here)."""
    net = _net(False)
    method = EWCMethod(ewc_lambda=10.0, mode=mode)
    for t in range(n_tasks):
        method.learn_task(net, *_data(t), None)
        _move(net)

    def step():
        net.zero_grad()
        method.penalty(net).backward()

    step()
    assert host_syncs(step) == []
    w = dict(net.named_parameters())
    expected = sum(
        (f[n].double() * (w[n].detach().double() - a[n].double()) ** 2).sum()
        for a, f in zip(method.anchors, method.importances)
        for n in f
    )
    got = method.penalty(net).detach().double() / method.coefficient
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-9)


# ------------------------------------------------------------- the Avalanche iterations
MARK = "<iteration>"


class _Marks(SupervisedPlugin):
    """Marks where each training iteration begins in the recorder's list."""

    def __init__(self) -> None:
        super().__init__()
        self.record: list[str] = []

    def before_training_iteration(self, strategy, **kwargs):
        self.record.append(MARK)


def _stream():
    g = torch.Generator().manual_seed(0)
    train, test = [], []
    for _ in range(2):
        x, y = torch.randn(256, 10, generator=g), torch.arange(256) % 4
        train.append((x, y))
        test.append((x[:32], y[:32]))
    return tensors_benchmark(train, test, task_labels=[0, 0])


def _strategy(name: str):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(net.parameters(), 1e-3)
    common = {
        "train_mb_size": 8,
        "train_epochs": 1,
        "eval_mb_size": 64,
        "evaluator": EvaluationPlugin(accuracy_metrics(experience=True), loggers=[]),
        "plugins": [_Marks()],
    }
    if name == "ewc":
        return EWC(model=net, optimizer=opt, ewc_lambda=10.0, **common)
    if name == "vcl":
        return VCL(model=net, optimizer=opt, **common)
    kwargs = {
        "fromp": {},
        "fromp-replay": {"replay": True},
        "fromp-clip": {"grad_clip_norm": 0.1},
        "fromp-logits": {"function": "logits", "tau": 1.0},
    }[name]
    return FROMP(model=net, optimizer=opt, n_points=8, **kwargs, **common)


@pytest.mark.parametrize(
    "name", ["fromp", "fromp-replay", "fromp-clip", "fromp-logits", "ewc", "vcl"]
)
def test_training_iterations_of_the_second_experience_never_sync(name):
    """Each iteration of the second experience after FROMP's first 20 (where it compares
    the penalty with the loss, to warn when it dominates) runs no host sync from fromp's
    code or its plugins: neither the penalty, nor its backward, nor the plugin's hooks,
    nor FROMP's penalty metric."""
    strategy = _strategy(name)
    bench = _stream()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        strategy.train(bench.train_stream[0])
        marks = next(p for p in strategy.plugins if isinstance(p, _Marks))
        marks.record.clear()  # the first experience's marks
        found = host_syncs(
            partial(strategy.train, bench.train_stream[1]), within=OURS, out=marks.record
        )
    iterations: list[list[str]] = []
    for op in found:
        if op == MARK:
            iterations.append([])
        elif iterations:
            iterations[-1].append(op)
    assert len(iterations) == 32, found[:4]  # 256 examples, mini-batches of 8
    late = [ops for ops in iterations[20:-1] if ops]  # the last also holds the epoch's end
    assert late == [], [(i, ops) for i, ops in enumerate(iterations) if ops][:4]
    if name.startswith("fromp"):  # the sanity of the check: the first 20 compare
        assert any(ops for ops in iterations[:20])


def test_penalty_metric_reports_the_mean_of_the_steps_penalties():
    """The metric accumulates ``tau * R`` on the device and reads it once an epoch: its
    value is the batch-weighted mean of the steps' penalties, read here step by step."""

    class Steps(SupervisedPlugin):
        def __init__(self):
            super().__init__()
            self.values: list[tuple[float, int]] = []

        def after_training_iteration(self, strategy, **kwargs):
            weighted = strategy.plugin.method.last_terms.get("penalty", 0.0)
            self.values.append((float(weighted), len(strategy.mb_y)))

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 4))
    steps = Steps()
    metric = FROMPPenaltyMetric()
    strategy = FROMP(
        model=net,
        optimizer=torch.optim.Adam(net.parameters(), 1e-3),
        n_points=8,
        train_mb_size=24,  # 256 = 10 x 24 + 16: one smaller batch, so weights matter
        train_epochs=1,
        evaluator=EvaluationPlugin(metric, loggers=[]),
        plugins=[steps],
    )
    bench = _stream()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        strategy.train(bench.train_stream[0])
        steps.values.clear()
        strategy.train(bench.train_stream[1])
        emitted = strategy.evaluator.get_all_metrics()
    key = next(k for k in emitted if k.startswith("FROMP_Penalty_Epoch"))
    total = sum(v * n for v, n in steps.values)
    count = sum(n for _, n in steps.values)
    assert count == 256 and total > 0
    assert emitted[key][1][-1] == pytest.approx(total / count, rel=1e-6)


# ------------------------------------------------------- the same operations after any tasks
def test_count_aten_ops_counts_each_operation():
    a, b, c = torch.ones(3), torch.ones(3), torch.ones(3)
    assert count_aten_ops(lambda: a + b) == 1
    assert count_aten_ops(lambda: a + b + c) == 2


@pytest.mark.parametrize("multihead", [False, True])
@pytest.mark.parametrize("replay", [False, True])
@pytest.mark.parametrize("kernel", ["per_class", "joint", "identity"])
def test_fromp_penalty_step_runs_the_same_operations_after_1_2_and_10_tasks(
    kernel, replay, multihead
):
    """``terms()`` and its backward dispatch the same aten operations whatever the number
    of tasks (a per-task loop of residuals, solves or replay terms adds operations with
    every task: 59 / 76 / 212 on one head with the per-class kernel before)."""
    counts = {}
    for n_tasks in (1, 2, 10):
        torch.manual_seed(0)
        net = MultiHeadMLP(6, (8,), n_heads=10, head_size=3) if multihead else _net(False)
        method = FROMPMethod(n_points=6, kernel=kernel, replay=replay)
        for t in range(n_tasks):
            method.learn_task(net, *_data(t), t if multihead else None)
            _move(net)

        def step(method=method, net=net):
            net.zero_grad()
            pen, rep = method.terms(net)
            (pen + rep if rep is not None else pen).backward()

        step()  # the stacked state is built once per learnt task, outside the step
        counts[n_tasks] = count_aten_ops(step)
    assert counts[1] == counts[2] == counts[10], counts


def test_ewc_penalty_step_runs_the_same_operations_after_1_2_and_10_tasks():
    """The consolidated penalty and its backward pass run the same operations whatever the
    number of tasks learnt (a per-task sum adds a pass over the parameters per task)."""
    net = _net(False)
    counts = {}
    for n_tasks in (1, 2, 10):
        method = EWCMethod(ewc_lambda=1.0, fisher="exact")
        for t in range(n_tasks):
            method.learn_task(net, *_data(t), None)
        method.penalty(net)  # consolidated once per learnt task, outside the step

        def step(method=method):
            net.zero_grad()
            method.penalty(net).backward()

        counts[n_tasks] = count_aten_ops(step)
    assert counts[1] == counts[2] == counts[10], counts


# --------------------------------------------------- one whole step after three experiences
class _Phases:
    """The step's phase for :class:`StepRecorder`: ``"penalty"`` inside the method's
    penalty (FROMP's ``terms``, EWC's ``_penalty``: its forward), ``"method"`` inside the
    rest of the method's and its plugin's per-step calls, ``"loop"`` elsewhere."""

    def __init__(self) -> None:
        self.stack: list[str] = []

    def __call__(self) -> str:
        return self.stack[-1] if self.stack else "loop"

    def wrap(self, obj: object, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        def wrapped(*args, **kwargs):
            self.stack.append(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stack.pop()

        setattr(obj, attr, wrapped)

    def install(self, method, plugin=None, metric=None) -> None:
        for attr in ("loss_terms", "before_update"):
            self.wrap(method, attr, "method")
        self.wrap(method, "terms" if hasattr(method, "terms") else "_penalty", "penalty")
        if plugin is not None:
            self.wrap(plugin, "after_backward", "method")
        if metric is not None:
            self.wrap(metric, "update", "method")


def _method(name: str, graph: str):
    if name == "fromp":  # the runner's split-MNIST settings, scaled down
        return FROMPMethod(tau=10.0, n_points=6, grad_clip_norm=0.1, cuda_graph=graph)
    return EWCMethod(ewc_lambda=10.0, batch_size=8, cuda_graph=graph)


def _graphs(graph: str):
    """``"replay"``: the CUDA-graph path with the replay simulated (the host work of a GPU
    step: :func:`tests.cases.simulated_cuda_graphs`); else the mode itself."""
    return simulated_cuda_graphs() if graph == "replay" else contextlib.nullcontext()


def _plain_step(net, opt, method, x, y, task) -> None:
    out = with_task(net, task)(x)
    loss = F.cross_entropy(out, y)
    loss = loss + method.loss_terms(net, x, out, task=task, loss=loss)
    opt.zero_grad()
    loss.backward()
    method.before_update(net, opt)
    opt.step()


def _recorded_plain_step(
    name: str, graph: str, learnt: int = 3
) -> tuple[StepRecorder, StepRecorder]:
    """One step of experience ``learnt + 1`` (``learnt`` tasks learnt, at most 3) on a
    multi-head MLP, after the first ``dominance_steps`` steps (FROMP's bounded reads): the
    operations of one step, the Python calls of the next."""
    torch.manual_seed(0)
    net = MultiHeadMLP(6, (16, 16), n_heads=4, head_size=3)
    opt = torch.optim.Adam(net.parameters(), 1e-3)
    method = _method(name, "auto" if graph == "replay" else graph)
    with warnings.catch_warnings(), _graphs(graph):
        warnings.simplefilter("ignore")
        for t in range(learnt + 1):
            x, y = _data(t, n=48)
            method.begin_task(net, task=t, experience=t, classes=[0, 1, 2])
            for s in range(0, 48, 8):
                _plain_step(net, opt, method, x[s : s + 8], y[s : s + 8], t)
            if t < learnt:
                method.learn_task(net, x, y, t, optimizer=opt, experience=t)
        for _ in range(getattr(method, "_checks_left", 0)):
            _plain_step(net, opt, method, x[:8], y[:8], learnt)
        phases = _Phases()
        phases.install(method)
        with StepRecorder(OURS, phases, what="ops") as ops:
            _plain_step(net, opt, method, x[8:16], y[8:16], learnt)
        with StepRecorder(OURS, phases, what="calls") as calls:
            _plain_step(net, opt, method, x[16:24], y[16:24], learnt)
    return ops, calls


class _Iteration(SupervisedPlugin):
    """Records the ``at``-th training iteration of the experience it is armed for."""

    def __init__(self, at: int, phases: _Phases) -> None:
        super().__init__()
        self.at, self.phases, self.armed, self.it = at, phases, False, 0
        # the operations in iteration `at`, the Python calls in the next one
        self.recs = {at: StepRecorder(OURS, phases, what="ops"),
                     at + 1: StepRecorder(OURS, phases, what="calls")}  # fmt: skip

    def before_training_exp(self, strategy, **kwargs):
        self.it = 0

    def before_training_iteration(self, strategy, **kwargs):
        self.it += 1
        if self.armed and self.it in self.recs:
            self.recs[self.it].start()

    def after_training_iteration(self, strategy, **kwargs):
        if self.armed and self.it in self.recs:
            self.recs[self.it].stop()


def _recorded_iteration(
    name: str, graph: str, learnt: int = 3
) -> tuple[StepRecorder, StepRecorder]:
    """Iteration 22 of experience ``learnt + 1`` (FROMP's reads end at 20) of the
    strategy on a one-head network (Avalanche's multi-head adapter reads the batch's task
    labels back, as Avalanche's own ``MultiTaskModule`` does: not the method's cost)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(net.parameters(), 1e-3)
    phases = _Phases()
    probe = _Iteration(22, phases)
    evaluator = EvaluationPlugin(accuracy_metrics(experience=True), loggers=[])
    common = {"train_mb_size": 8, "train_epochs": 1, "eval_mb_size": 64, "plugins": [probe],
              "evaluator": evaluator}  # fmt: skip
    mode = "auto" if graph == "replay" else graph
    if name == "ewc":
        strategy = EWC(model=net, optimizer=opt, ewc_lambda=10.0, cuda_graph=mode, **common)
    else:
        strategy = FROMP(model=net, optimizer=opt, n_points=8, grad_clip_norm=0.1,
                         cuda_graph=mode, **common)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(256, 10, generator=g), torch.arange(256) % 4) for _ in range(4)]
    bench = tensors_benchmark(data, [(x[:32], y[:32]) for x, y in data], task_labels=[0] * 4)
    metric = next((m for m in strategy.evaluator.metrics if isinstance(m, FROMPPenaltyMetric)),
                  None)  # fmt: skip
    phases.install(strategy.plugin.method, strategy.plugin if name == "fromp" else None, metric)
    with warnings.catch_warnings(), _graphs(graph):
        warnings.simplefilter("ignore")
        for e in range(learnt + 1):
            probe.armed = e == learnt
            strategy.train(bench.train_stream[e])
    assert probe.it == 32 and not any(r._modes for r in probe.recs.values())  # closed
    return probe.recs[22], probe.recs[23]


def _check(recs: tuple[StepRecorder, StepRecorder], where: str, name: str, graph: str,
           bounds: dict) -> None:  # fmt: skip
    ops, calls = recs
    assert ops.reads == [], ops.reads  # nothing read back from fromp's code
    assert ops.uploads == [], ops.uploads  # no tensor from host data, no device move
    got = {
        "python_calls": sum(calls.python_calls.values()),
        "method_calls": calls.all_calls["method"] + calls.all_calls["penalty"],
        "method_ops": ops.ops["method"],
    }
    for k, measured in bounds.items():
        most = int(SLACK * measured) + 2
        assert got[k] <= most, f"{where} {name} cuda_graph={graph}: {k} {got[k]} > {most} ({got})"
    if graph == "replay":  # the penalty's forward is replayed, not issued: no call, no op
        assert ops.ops["penalty"] == 0 and calls.all_calls["penalty"] == 0
    else:
        assert ops.ops["penalty"] > 0  # the sanity of the phases: the penalty ran here


# The counts measured on this code (torch 2.14.1, Python 3.11; plain loop: a 6-16-16 MLP with
# 4 three-way heads, 6 memorable points per task; Avalanche: a 10-16-4 MLP, one head, 8 points
# per task): "python_calls" counts the calls of fromp's and the strategies' functions in the
# whole step, "method_calls" every Python call (torch's included) made inside the method's
# per-step calls and its plugin's hooks, "method_ops" the aten operations those dispatch
# outside the penalty's own forward (its backward runs in the loop's backward, or inside
# loss_terms for the one-call path "on"). What they held before this guard (the step profile,
# benchmarks/results/gpu/step-overhead-cpu.md): FROMP's penalty switched the network to eval
# mode and back by traversing it (about 190 calls a step on this MLP, 330 with a signature
# read on split MNIST), its clipping traversed the parameters again, and a graph-replayed
# step did not exist (the penalty's ~140 forward and backward operations were issued one by
# one); EWC's penalty looped over the tasks in Python for its cache key on every step and
# carried the parameters of heads no task had used (zero importance: their operations and a
# zero gradient for the optimizer on every step). "replay": the host work of a CUDA-graph
# step (simulated: tests.cases.simulated_cuda_graphs), what a GPU step pays for FROMP and
# EWC besides the network's own. FROMP's class-incremental defaults (the settings resolved
# per experience, the memory's batch) added about 11 of fromp's calls per step.
PLAIN = {
    ("fromp", "off"): {"python_calls": 62, "method_calls": 246, "method_ops": 12},
    ("fromp", "on"): {"python_calls": 71, "method_calls": 292, "method_ops": 96},
    ("fromp", "replay"): {"python_calls": 42, "method_calls": 119, "method_ops": 17},
    ("ewc", "off"): {"python_calls": 23, "method_calls": 27, "method_ops": 1},
    ("ewc", "on"): {"python_calls": 32, "method_calls": 74, "method_ops": 56},
    ("ewc", "replay"): {"python_calls": 24, "method_calls": 14, "method_ops": 4},
}
AVALANCHE = {
    ("fromp", "off"): {"python_calls": 58, "method_calls": 186, "method_ops": 13},
    ("fromp", "on"): {"python_calls": 67, "method_calls": 216, "method_ops": 52},
    ("fromp", "replay"): {"python_calls": 42, "method_calls": 104, "method_ops": 18},
    ("ewc", "off"): {"python_calls": 20, "method_calls": 21, "method_ops": 1},
    ("ewc", "on"): {"python_calls": 29, "method_calls": 52, "method_ops": 26},
    ("ewc", "replay"): {"python_calls": 21, "method_calls": 14, "method_ops": 4},
}
#: a guard fails above ``SLACK`` times its measured count plus 2 (a helper call added or
#: split is not a regression; a traversal of the network or the parameters per step is)
SLACK = 1.1


@pytest.mark.parametrize("graph", ["off", "on", "replay"])
@pytest.mark.parametrize("name", ["fromp", "ewc"])
def test_a_plain_loop_step_after_three_experiences_stays_within_its_measured_host_work(name, graph):
    _check(_recorded_plain_step(name, graph), "plain", name, graph, PLAIN[(name, graph)])


@pytest.mark.parametrize("graph", ["off", "on", "replay"])
@pytest.mark.parametrize("name", ["fromp", "ewc"])
def test_an_avalanche_iteration_after_three_experiences_stays_within_its_measured_host_work(
    name, graph
):
    _check(_recorded_iteration(name, graph), "avalanche", name, graph, AVALANCHE[(name, graph)])


@pytest.mark.parametrize("graph", ["off", "replay"])
@pytest.mark.parametrize("name", ["fromp", "ewc"])
def test_an_iteration_does_the_same_host_work_after_one_and_three_experiences(name, graph):
    """The whole Avalanche iteration (the method's calls, its penalty, the plugin's hooks,
    the loop's backward and update) dispatches the same operations, by phase and by name,
    and makes the same Python calls after one learnt experience as after three: nothing in
    a step loops over the experiences seen. (One head: on a multi-head network EWC's
    penalty covers one more head's parameters with each task, FROMP's forward one more
    head's points; both bounded by the network, not by the stream.)"""
    one, three = _recorded_iteration(name, graph, 1), _recorded_iteration(name, graph, 3)
    assert one[0].reads == three[0].reads == [] and one[0].uploads == three[0].uploads == []
    assert one[0].op_names == three[0].op_names
    assert one[0].ops["loop"] > 0
    assert one[1].python_calls == three[1].python_calls
    assert one[1].all_calls == three[1].all_calls


def test_the_step_recorder_sees_a_read_back_and_an_upload_planted_in_the_method():
    """The guards' sanity: a ``float(tensor)`` or a ``new_tensor`` in the method's step is
    recorded with the file it is called from."""
    method = _method("ewc", "off")
    net = nn.Sequential(nn.Linear(6, 3))
    method.learn_task(net, *_data(0), None)
    penalty = method.penalty

    def leaky(net, *args, **kwargs):
        value = penalty(net, *args, **kwargs)
        return value * value.new_tensor(float(value.detach()) * 0 + 1.0)

    with StepRecorder([__file__]) as rec:
        leaky(net).backward()
    assert rec.reads and all(f"@{__file__}:" in r for r in rec.reads), rec.reads
    assert "_local_scalar_dense" in {r.split("@")[0] for r in rec.reads}
    assert "new_tensor" in {u.split("@")[0] for u in rec.uploads}, rec.uploads
