"""Layer capture (fromp.curvature.capture): GGN / empirical Fisher / sampled Fisher diagonals from
layer inputs and output gradients, against dense float64 brute force and the per-example Jacobian
route, for every supported layer type, the fallback routing and chunk boundaries."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fromp.curvature.capture import CapturePlan, capture_calls
from fromp.curvature.diagonal import diag_ef, diag_fisher, diag_ggn
from fromp.curvature.layer_rules import (
    _conv_gram,
    _conv_grouped_squares,
    _conv_unfold_squares,
    per_example_layer_grads,
    squared_grad_sums,
)
from fromp.likelihood import CategoricalLikelihood, GaussianLikelihood
from fromp.testing import (
    ConvZoo,
    Scale,
    conv_zoo,
    dense_ggn,
    dense_jacobian,
    flat,
    tiny_cnn,
    tiny_mlp,
)

F64 = torch.float64


CASES = {
    "mlp": (tiny_mlp, (4,)),
    "cnn_bn": (tiny_cnn, (1, 6, 6)),
    "conv_zoo": (conv_zoo, (2, 8, 8)),
}


@pytest.fixture(params=sorted(CASES))
def case(request):
    make, shape = CASES[request.param]
    return make(), torch.randn(7, *shape, dtype=F64)


def test_plan_routes_every_parameter_once():
    model = conv_zoo()
    plan = CapturePlan.build(model, torch.randn(2, 2, 8, 8, dtype=F64), n_columns=3)
    assert plan.fallback == ["scale.s"]
    assert "no capture rule" in plan.reasons["scale.s"]
    assert set(plan.captured_params) | set(plan.fallback) == set(plan.names)
    assert not set(plan.captured_params) & set(plan.fallback)
    with pytest.raises(ValueError, match=r"scale\.s"):
        CapturePlan.build(model, torch.randn(2, 2, 8, 8, dtype=F64), n_columns=3, method="capture")


@pytest.mark.parametrize("lik", [CategoricalLikelihood(), GaussianLikelihood(0.5)])
def test_diag_ggn_capture_matches_dense_and_jacobian(case, lik):
    model, x = case
    ref = torch.diagonal(dense_ggn(model, x, lik))
    got = diag_ggn(model, [x[:4], x[4:]], lik, chunk_size=3)
    jac = diag_ggn(model, x, lik, method="jacobian", chunk_size=2)
    torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(jac, ref, rtol=1e-9, atol=1e-12)


def test_result_independent_of_chunk_and_memory_budget():
    model, x = conv_zoo(), torch.randn(9, 2, 8, 8, dtype=F64)
    lik = CategoricalLikelihood()
    ref = diag_ggn(model, x, lik, chunk_size=9)
    for kw in ({"chunk_size": 1}, {"chunk_size": 4}, {"memory_budget": 1}, {}):
        torch.testing.assert_close(diag_ggn(model, x, lik, **kw), ref, rtol=1e-10, atol=1e-13)
    # a budget of one byte gives chunks of one example and per-example sub-chunks of one pair
    plan = CapturePlan.build(model, x[:2], n_columns=3)
    assert plan.chunk_size(1) == 1 and plan.chunk_size(2**40) > 9


def test_layer_rules_match_autograd_per_example():
    """Per-example gradients and their Gram / sub-chunked squared sums for each layer type
    against autograd example by example (catches a dropped factor or a wrong group)."""
    model = conv_zoo()
    x = torch.randn(3, 2, 8, 8, dtype=F64)
    mods = [m for m in model.modules() if type(m) is not ConvZoo and type(m) is not Scale]
    with torch.enable_grad(), capture_calls(mods) as calls:
        model(x)
    for c in calls:
        gs = torch.randn(2, *c.z.shape, dtype=F64)
        want = {n: torch.zeros_like(p) for n, p in c.module.named_parameters()}
        for k in range(2):
            for n in range(len(x)):
                z = c.module(c.a[n : n + 1])
                grads = torch.autograd.grad(z, list(c.module.parameters()), gs[k, n : n + 1])
                for (name, _), g in zip(c.module.named_parameters(), grads):
                    want[name] += g.pow(2)
        for budget in (1, 2**30):
            got = squared_grad_sums(c.module, c.a, gs, memory_budget=budget)
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12)
        if isinstance(c.module, nn.Conv1d | nn.Conv2d):  # the Gram route at any L
            torch.testing.assert_close(_conv_gram(c.module, c.a, gs), want["weight"])
            for budget in (1, 2**30):
                for fn in (_conv_unfold_squares, _conv_grouped_squares):
                    torch.testing.assert_close(fn(c.module, c.a, gs, budget), want["weight"])
        per = per_example_layer_grads(c.module, c.a, gs[0])
        for name, t in per.items():
            assert t.shape == (len(x), *getattr(c.module, name).shape)


def test_unsupported_or_repeated_layers_use_fallback_not_skipped():
    """A layer called twice, a weight shared between two layers, and a weight also used
    outside its layer's forward are all routed to the Jacobian fallback, with exact results."""

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.b = nn.Linear(3, 3)
            self.b.weight = self.a.weight  # shared
            self.c = nn.Linear(3, 3)
            self.d = nn.Linear(3, 2)

        def forward(self, x):
            h = torch.tanh(self.a(x)) + torch.tanh(self.b(x))
            h = torch.tanh(self.c(torch.tanh(self.c(h))))  # called twice
            return self.d(h) + (x @ self.d.weight[:, :3].T)  # d.weight also used outside

    model = Odd().double()
    x = torch.randn(6, 3, dtype=F64)
    plan = CapturePlan.build(model, x[:2], n_columns=2)
    assert {"a.weight", "c.weight", "c.bias", "d.weight", "d.bias"} <= set(plan.fallback)
    assert "d.weight" in plan.reasons and "autograd" in plan.reasons["d.weight"]
    assert "more than once" in plan.reasons["c.weight"]
    lik = CategoricalLikelihood()
    ref = torch.diagonal(dense_ggn(model, x, lik))
    torch.testing.assert_close(diag_ggn(model, x, lik), ref, rtol=1e-9, atol=1e-12)


def test_inplace_ops_after_layer_do_not_corrupt_capture():
    model = nn.Sequential(
        nn.Linear(4, 5), nn.ReLU(inplace=True), nn.Linear(5, 5), nn.ReLU(inplace=True),
        nn.Linear(5, 3),
    ).double()  # fmt: skip
    x = torch.randn(6, 4, dtype=F64)
    lik = CategoricalLikelihood()
    ref = torch.diagonal(dense_ggn(model, x, lik))
    torch.testing.assert_close(diag_ggn(model, x, lik), ref, rtol=1e-9, atol=1e-12)


def test_diag_ef_and_fisher_match_dense(case):
    model, x = case
    lik = CategoricalLikelihood()
    y = torch.randint(0, 3, (len(x),))
    jac = dense_jacobian(model, x)  # N, C, P
    with torch.no_grad():
        p = torch.softmax(model(x), -1)
    resid = p - torch.nn.functional.one_hot(y, 3).to(F64)
    g = torch.einsum("nc,ncp->np", resid, jac)
    torch.testing.assert_close(diag_ef(model, (x, y), lik, chunk_size=3), g.pow(2).sum(0))
    # sampled Fisher with a fixed generator equals the dense formula at the same labels
    gen = torch.Generator().manual_seed(3)
    got = diag_fisher(model, x, lik, n_samples=2, generator=gen, chunk_size=4)
    gen = torch.Generator().manual_seed(3)
    ys = [lik.sample(model(x).detach(), generator=gen) for _ in range(2)]
    want = (
        sum(
            torch.einsum("nc,ncp->np", p - torch.nn.functional.one_hot(ys_, 3).to(F64), jac)
            .pow(2)
            .sum(0)
            for ys_ in ys
        )
        / 2
    )
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(
        diag_ggn(model, x, lik, mc_samples=2, generator=torch.Generator().manual_seed(3)), want
    )


def test_bad_arguments_raise_clear_errors():
    model, x = tiny_mlp(), torch.randn(3, 4, dtype=F64)
    with pytest.raises(ValueError, match="memory_budget"):
        diag_ggn(model, x, "categorical", memory_budget=0)
    with pytest.raises(ValueError, match="chunk_size"):
        diag_ggn(model, x, "categorical", chunk_size=0)
    with pytest.raises(ValueError, match="method"):
        diag_ggn(model, x, "categorical", method="hooks")
    with pytest.raises(ValueError, match="mc_samples"):
        diag_ggn(model, x, "categorical", mc_samples=-1)
    assert flat(model).numel() == 43


def test_laplace_on_the_fromp_mlp_takes_the_capture_route(monkeypatch):
    """fromp.laplace on FROMP's multi-head MLP (a task view: the other heads are never
    called) must not touch the per-example Jacobian fallback."""
    import fromp.curvature.capture as capture
    from fromp import fit_laplace
    from fromp.models import MultiHeadMLP, with_task

    def forbidden(*args, **kwargs):
        raise AssertionError("the Jacobian fallback was used")

    monkeypatch.setattr(capture, "fallback_jacobian", forbidden)
    net = with_task(MultiHeadMLP(6, (5, 4), n_heads=3, head_size=2).double().eval(), 1)
    x = torch.randn(7, 6, dtype=F64)
    q = fit_laplace(net, x, "categorical", 1.0)
    ref = torch.diagonal(dense_ggn(net, x, CategoricalLikelihood())) + 1.0
    torch.testing.assert_close(q.precision, ref, rtol=1e-9, atol=1e-12)


class _Tied(nn.Module):
    """A weight registered in two layers (``enc`` and the never-called ``head``)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 3, dtype=F64)
        self.mid = nn.Linear(3, 3, dtype=F64)
        self.dec = nn.Linear(3, 4, dtype=F64)
        self.dec.weight = nn.Parameter(self.enc.weight.detach().T.clone())
        self.head = nn.Linear(4, 2, dtype=F64)
        self.head.weight = self.enc.weight

    def forward(self, x):
        return self.mid(torch.tanh(self.enc(x)))


def test_layer_map_reads_owners_shared_parameters_and_refreshes_on_freeze():
    """One reading of the layer structure for every capture user: shared parameters are
    flagged (not silently given to one layer), the exclusive layers exclude a layer holding
    a shared parameter, and freezing a parameter gives a new map rather than a stale one."""
    from fromp.curvature.capture import LayerMap, supported_layer

    net = _Tied()
    lm = LayerMap.of(net)
    assert list(lm.named) == [n for n, p in net.named_parameters()]
    assert lm.shared("enc.weight") and not lm.shared("mid.weight")
    assert {m for m, _ in lm.owners["enc.weight"]} == {net.enc, net.head}
    assert lm.exclusive_layers(supported_layer) == [net.mid, net.dec]
    assert lm.name_of()[(id(net.mid), "bias")] == "mid.bias"
    assert "enc.weight" not in lm.name_of().values()
    assert LayerMap.of(net) is lm  # cached while the trainable parameters are the same
    net.mid.bias.requires_grad_(False)
    lm2 = LayerMap.of(net)
    assert lm2 is not lm and "mid.bias" not in lm2.named


def test_every_capture_user_routes_a_shared_weight_away_from_capture():
    """The curvature plan sends the shared weight to the Jacobian fallback, VOGN's hook route
    declines, and KFAC refuses it by name (summing both layers' factors would be wrong)."""
    from fromp.curvature.kron import kron_layers
    from fromp.optim._stats import _layout

    net = _Tied()
    plan = CapturePlan.build(net, torch.randn(3, 4, dtype=F64), n_columns=2)
    assert "enc.weight" in plan.fallback and "shared" in plan.reasons["enc.weight"]
    assert "mid.weight" in plan.captured_params
    assert _layout(net)[0] is False
    with pytest.raises(ValueError, match=r"'enc\.weight' is shared"):
        kron_layers(net)


def test_per_example_entries_equal_the_layers_whole_per_example_gradients():
    """Every entry of every captured layer of the conv zoo (strided, dilated, grouped with
    circular padding, reflect padding, 1x1 output, Conv1d, a sequence Linear, batch, group
    and layer norm), read alone, equals the layer's whole per-example gradient there."""
    from fromp.curvature.capture import capture_calls
    from fromp.curvature.layer_rules import (
        per_example_entries,
        per_example_layer_grads,
        supported_layer,
    )
    from fromp.testing import conv_zoo

    torch.manual_seed(0)
    model = conv_zoo(3, seed=0).eval()
    x = torch.randn(5, 2, 8, 8, dtype=torch.float64)
    layers = [m for m in model.modules() if supported_layer(m) and len(list(m.parameters(False)))]
    with capture_calls(layers) as calls:
        f = model(x)
    gs = torch.autograd.grad(f[:, 1].sum(), [c.z for c in calls])
    seen = set()
    for call, g in zip(calls, gs):
        whole = per_example_layer_grads(call.module, call.a, g)
        for attr, p in call.module.named_parameters(recurse=False):
            local = torch.randperm(p.numel())  # every entry, in a shuffled order
            got = per_example_entries(call.module, call.a, g, attr, local)
            want = whole[attr].reshape(len(x), -1)[:, local]
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            seen.add(type(call.module).__name__)
    assert {"Conv2d", "Conv1d", "Linear", "BatchNorm2d", "GroupNorm", "LayerNorm"} <= seen
