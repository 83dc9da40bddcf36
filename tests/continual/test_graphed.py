"""The captured loss terms (:mod:`fromp.continual.graphed`): FROMP's memorable terms and EWC's
penalty computed with their gradient in one call (a CUDA graph on CUDA, the eager pair on
the CPU) equal the plain autograd terms in value and gradient in float64 after tasks 1, 2
and 3; the term is captured again exactly when what it reads changes (the memorable sets,
the consolidated anchors, the parameters, the loss dtype); a capture that fails falls back
to the plain path with one warning under ``cuda_graph="auto"`` and raises under ``"on"``; a
parameter changed in place between the forward and the backward is refused; the CUDA-graph
path itself (tests named ``cuda``) runs where a GPU is, skipped with the reason elsewhere."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fromp.continual.graphed as graphed
from fromp.continual.ewc import EWCMethod
from fromp.continual.graphed import StaticTerm, check_mode
from fromp.continual.methods import FROMPMethod
from fromp.models import MultiHeadMLP, with_task

D = torch.float64
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

FROMP_CASES = {
    "probs": {},
    "logits": {"function": "logits"},
    "replay": {"replay": True, "replay_weight": 2.0},
    "joint": {"kernel": "joint"},
    "identity": {"kernel": "identity"},
    "clip-context": {"grad_clip_norm": 0.5, "context_tau": 0.3},
}


def _method(name: str, mode: str):
    if name.startswith("ewc"):
        ewc_mode = name.split("-")[1]
        return EWCMethod(ewc_lambda=10.0, mode=ewc_mode, batch_size=4, cuda_graph=mode)
    return FROMPMethod(n_points=6, jitter=1e-5, cuda_graph=mode, **FROMP_CASES[name])


def _data(task: int, n: int = 30, dtype=D):
    g = torch.Generator().manual_seed(100 + task)
    return torch.randn(n, 6, generator=g, dtype=dtype), torch.arange(n) % 3


def _net(multihead: bool, device="cpu", dtype=D) -> nn.Module:
    torch.manual_seed(0)
    if multihead:
        return MultiHeadMLP(6, (8,), n_heads=4, head_size=3).to(device, dtype)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(device, dtype)


def _steps(name: str, mode: str, multihead: bool, device="cpu", scale: float = 3.0):
    """Three experiences; in experiences 2, 3 and 4 (after tasks 1, 2 and 3) two steps away
    from the old weights: per step the extra loss and every parameter's gradient of
    ``scale * (data loss + extra)`` (the scale reaches the term's backward as ``g``)."""
    net = _net(multihead, device)
    method = _method(name, mode)
    out = []
    for t in range(4):
        x, y = (v.to(device) for v in _data(t))
        head = t if multihead else None
        method.begin_task(net, task=head, experience=t, classes=[0, 1, 2])
        for s in range(2 if t else 0):
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            xb, yb = x[8 * s : 8 * s + 8], y[8 * s : 8 * s + 8]
            o = with_task(net, head)(xb)
            loss = F.cross_entropy(o, yb)
            term = method.loss_terms(net, xb, o, task=head, loss=loss)
            net.zero_grad()
            (scale * (loss + term)).backward()
            grads = [p.grad.clone() if p.grad is not None else None for p in net.parameters()]
            out.append((term.detach(), grads, dict(method.last_terms)))
        if t < 3:
            method.learn_task(net, x, y, head, experience=t)
    return out, method


@pytest.mark.parametrize("multihead", [False, True])
@pytest.mark.parametrize("name", [*FROMP_CASES, "ewc-separate", "ewc-online"])
def test_captured_terms_equal_the_plain_terms_in_value_and_gradient_after_tasks_1_2_3(
    name, multihead
):
    plain, _ = _steps(name, "off", multihead)
    captured, method = _steps(name, "on", multihead)
    assert len(plain) == len(captured) == 6
    assert method._captured["term"] is not None  # the captured path ran
    for (v0, g0, terms0), (v1, g1, terms1) in zip(plain, captured):
        torch.testing.assert_close(v1, v0, rtol=1e-10, atol=1e-13)
        assert [g is None for g in g0] == [g is None for g in g1]  # the same parameters
        for a, b in zip(g0, g1):
            if a is not None:
                torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-13)
        assert sorted(terms0) == sorted(terms1)
        for k in terms0:
            torch.testing.assert_close(terms1[k], terms0[k], rtol=1e-10, atol=1e-13)
    assert any(float(v) > 0 for v, _, _ in plain)  # not a comparison of zeros


def test_auto_on_the_cpu_is_the_plain_path():
    _, fromp = _steps("probs", "auto", True)
    _, ewc = _steps("ewc-separate", "auto", True)
    assert fromp._captured["term"] is None and ewc._captured["term"] is None


# ------------------------------------------------------------------------ bookkeeping
def _learnt(method, net, tasks=2):
    for t in range(tasks):
        method.begin_task(net, task=t, experience=t)
        method.learn_task(net, *_data(t), t, experience=t)


def _step(method, net, task=2):
    x, y = _data(task)
    method.begin_task(net, task=task, experience=task) if method._experience is None else None
    o = with_task(net, task)(x[:8])
    loss = F.cross_entropy(o, y[:8])
    term = method.loss_terms(net, x[:8], o, task=task, loss=loss)
    net.zero_grad()
    (loss + term).backward()
    return method._captured["term"]


@pytest.mark.parametrize("name", ["probs", "ewc-separate"])
def test_the_term_is_captured_again_exactly_when_what_it_reads_changes(name):
    net = _net(True)
    method = _method(name, "on")
    _learnt(method, net)
    first = _step(method, net)
    assert _step(method, net) is first  # the same state: the same term, no new capture
    method.learn_task(net, *_data(2), 2, experience=2)  # new memorable set / anchors
    second = _step(method, net, task=3)
    assert second is not first
    assert _step(method, net, task=3) is second
    if isinstance(method, FROMPMethod):  # the sets assigned by hand: a new stack
        method.regularizer.memories = method.regularizer.memories[:2]
        assert _step(method, net, task=3) is not second
    else:  # anchors assigned by hand: new consolidated terms
        method.anchors = [dict(a) for a in method.anchors]
        assert _step(method, net, task=3) is not second
    second = _step(method, net, task=3)
    method.load_state_dict(method.state_dict())  # the same state, new tensors
    third = _step(method, net, task=3)
    assert third is not second
    with torch.no_grad():  # a parameter replaced (a head rebuilt): read at begin_task
        net.heads[3].weight = nn.Parameter(net.heads[3].weight.clone())
    method.begin_task(net, task=3, experience=3)
    fourth = _step(method, net, task=3)
    assert fourth is not third and any(p is net.heads[3].weight for p in fourth.params)
    with torch.no_grad():  # a parameter's storage reassigned: its static address is stale
        net.body[1].weight.data = net.body[1].weight.data.clone()
    fifth = _step(method, net, task=3)
    assert fifth is not fourth
    x = _data(3)[0][:8]
    o = with_task(net, 3)(x)
    method.loss_terms(net, x, o.float(), task=3)  # another loss dtype
    assert method._captured["term"] is not fifth


def test_class_incremental_defaults_are_captured_with_their_set_weights_in_the_key():
    """On a class-incremental stream the default coreset is replayed whole (the same stored
    points at every step), so its term is captured, equal to the plain one; the sets'
    weights ``b_s`` are part of the key: new weights (sets of unknown size, another
    experience size) give a new term, with the new weights."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6)).to(D)
    captured = FROMPMethod(n_points=4, jitter=1e-5, cuda_graph="on")
    plain = FROMPMethod(n_points=4, jitter=1e-5, cuda_graph="off")

    def data(t):
        x, y = _data(t)
        return x, y % 2 + 2 * t  # classes 0/1, then 2/3, then 4/5: one growing set

    def step(method, ess):
        method.begin_task(net, experience=2, ess=ess, classes=[4, 5])
        x, y = data(2)
        o = net(x[:8])
        loss = F.cross_entropy(o, y[:8])
        term = method.loss_terms(net, x[:8], o, loss=loss)
        net.zero_grad()
        (loss + term).backward()
        return dict(method.last_terms), [p.grad.clone() for p in net.parameters()]

    for t in range(2):
        for method in (captured, plain):
            method.begin_task(net, experience=t, ess=30, classes=[2 * t, 2 * t + 1])
            method.learn_task(net, *data(t), None, experience=t)
    assert captured.class_incremental and captured.replay_draws() is None
    seen: list[StaticTerm] = []
    for ess in (30, 30, 90):
        if ess == 90:  # sets of unknown size stand for the new experience's size
            captured.examples, plain.examples = {}, {}
        terms, grads = step(captured, ess)
        term = captured._captured["term"]
        assert term is not None and (term in seen) == (len(seen) == 1)  # reused once
        seen.append(term)
        want, want_grads = step(plain, ess)
        assert plain._captured.get("term") is None
        for k in want:
            torch.testing.assert_close(terms[k], want[k])
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g, w)
    torch.testing.assert_close(captured.set_weights(), torch.full((2,), 90 / 8, dtype=D))


def test_a_parameter_changed_in_place_before_the_backward_is_refused():
    net = _net(True)
    method = _method("probs", "on")
    _learnt(method, net)
    method.begin_task(net, task=2, experience=2)
    x = _data(2)[0]
    o = with_task(net, 2)(x[:8])
    term = method.loss_terms(net, x[:8], o, task=2)
    with torch.no_grad():
        net.body[1].weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place between the captured"):
        term.backward()


@pytest.mark.parametrize("cls", [FROMPMethod, EWCMethod])
def test_a_capture_that_fails_falls_back_once_under_auto_and_raises_under_on(monkeypatch, cls):
    """The graph path forced (as on CUDA) with a capture that fails: ``"auto"`` warns once
    and then runs the plain path itself (the same gradients to the last bit as ``"off"``,
    also in the next experience, without a second attempt); ``"on"`` raises."""

    def fail(self):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphed, "uses_graph", lambda mode, params, net: mode != "off")
    monkeypatch.setattr(StaticTerm, "_capture", fail)
    kwargs = {"ewc_lambda": 10.0} if cls is EWCMethod else {"n_points": 6}
    runs = {}
    for mode in ("off", "auto"):
        net = _net(True)  # seeds the generator: both runs draw alike
        method = cls(**kwargs, cuda_graph=mode)
        _learnt(method, net)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _step(method, net)
            _step(method, net)
            method.learn_task(net, *_data(2), 2, experience=2)
            _step(method, net, task=3)  # a new key: no second attempt
        runs[mode] = (method, [p.grad for p in net.parameters()], caught)
    msgs = [str(w.message) for w in runs["auto"][2] if "could not be captured" in str(w.message)]
    assert len(msgs) == 1 and "cuda_graph='off'" in msgs[0]
    assert runs["auto"][0]._captured["term"] is None and runs["auto"][0]._captured["failed"]
    for a, b in zip(runs["off"][1], runs["auto"][1]):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, rtol=0, atol=0)
    strict, net = cls(**kwargs, cuda_graph="on"), _net(True)
    _learnt(strict, net)
    with pytest.raises(RuntimeError, match="stream is capturing"):
        _step(strict, net)


@pytest.mark.parametrize("cls", [FROMPMethod, EWCMethod])
def test_cuda_graph_setting_refuses_other_values_naming_it(cls):
    kwargs = {"ewc_lambda": 1.0} if cls is EWCMethod else {}
    with pytest.raises(ValueError, match="cuda_graph must be one of"):
        cls(**kwargs, cuda_graph="graph")
    assert check_mode("off") == "off"


def test_the_strategies_take_the_setting():
    from fromp_avalanche.ewc import EWC
    from fromp_avalanche.fromp import FROMP

    net = _net(False, dtype=torch.float32)
    opt = torch.optim.Adam(net.parameters())
    assert FROMP(model=net, optimizer=opt, cuda_graph="off").plugin.method.cuda_graph == "off"
    assert EWC(model=net, optimizer=opt, cuda_graph="on").plugin.method.cuda_graph == "on"


# -------------------------------------------------------------------------- CUDA graphs
@CUDA
@pytest.mark.parametrize("multihead", [False, True])
@pytest.mark.parametrize("name", ["probs", "replay", "joint", "ewc-separate"])
def test_cuda_graph_terms_equal_the_plain_terms_after_tasks_1_2_3(name, multihead):
    plain, _ = _steps(name, "off", multihead, device="cuda")
    captured, method = _steps(name, "auto", multihead, device="cuda")
    term = method._captured["term"]
    assert term is not None and term.graph and term.captures == 1
    for (v0, g0, _), (v1, g1, _) in zip(plain, captured):
        torch.testing.assert_close(v1, v0, rtol=1e-10, atol=1e-13)
        for a, b in zip(g0, g1):
            assert (a is None) == (b is None)
            if a is not None:
                torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-13)


@CUDA
@pytest.mark.parametrize("name", ["probs", "ewc-separate"])
def test_cuda_graph_static_buffers_follow_a_new_memorable_set(name):
    """After learn_task the graph is captured again (new static buffers); the replayed
    term is the plain one at the new state, not the old graph's."""
    net = _net(True, "cuda")
    method, plain = _method(name, "auto"), _method(name, "off")
    for t in range(3):
        x, y = (v.cuda() for v in _data(t))
        for m in (method, plain):
            m.begin_task(net, task=t, experience=t)
        if t:
            with torch.no_grad():
                net.heads[0].bias.add_(0.1)
            o = with_task(net, t)(x[:8])
            values = [m.loss_terms(net, x[:8], o, task=t) for m in (method, plain)]
            torch.testing.assert_close(values[0], values[1], rtol=1e-10, atol=1e-13)
            assert method._captured["term"].captures == 1
        for m in (method, plain):
            m.learn_task(net, x, y, t, experience=t)
    assert method._captured["term"].graph


@CUDA
def test_cuda_graph_is_not_used_with_hooks_under_auto():
    net = _net(True, "cuda")
    net.body[1].register_forward_hook(lambda *a: None)
    method = _method("probs", "auto")
    for t in range(2):
        x, y = (v.cuda() for v in _data(t))
        method.begin_task(net, task=t, experience=t)
        if t:
            o = with_task(net, t)(x[:8])
            method.loss_terms(net, x[:8], o, task=t)
        method.learn_task(net, x, y, t, experience=t)
    assert method._captured["term"] is None
