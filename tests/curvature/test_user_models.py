"""Users' models through the curvature, Jacobian, kernel and last-layer functions: a frozen
weight beside a trainable bias and the reverse (every capture-based path against dense
float64 references), ``torch.compile``'d models (every entry point gives the uncompiled
numbers and never runs the compiled forward), tied weights (exact, or refused by name),
and models returning a tuple or a dict (refused, saying what to write)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fromp import DiagonalGaussian
from fromp.curvature.capture import CapturePlan, LayerMap
from fromp.curvature.diagonal import diag_ef, diag_fisher, diag_ggn, diag_ggn_linear
from fromp.curvature.ggn import ggn, ggn_matmat, ggn_vp
from fromp.curvature.jacobian import (
    forward_numel,
    iter_jacobians,
    jacobians,
    jvp,
    per_example_grads,
    vjp_sum,
)
from fromp.curvature.kron import kron_curvature, kron_curvature_tasks, kron_layers, kron_split
from fromp.curvature.last_layer import last_layer_features, last_layer_forward, last_linear
from fromp.gp import GP
from fromp.likelihood import CategoricalLikelihood
from fromp.memory.loo import last_layer_loo
from fromp.optim._stats import per_example_grad_stats
from fromp.testing import dense_ggn, dense_jacobian, dense_kernel, flat

F64 = torch.float64
LIK = CategoricalLikelihood()


class _Net(nn.Module):
    """Conv2d (stride, padding) -> BatchNorm2d (eval, random statistics) -> Linear ->
    Linear head; input ``[N, 3, 6, 6]``, 3 outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(36, 5)
        self.head = nn.Linear(5, 3)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        h = torch.tanh(self.bn(self.conv(x))).flatten(1)
        return self.head(torch.tanh(self.fc(h)))


def _net(frozen: str | None = None, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    net = _Net().double().eval()
    if frozen is not None:
        net.get_parameter(frozen).requires_grad_(False)
    return net


def _data(n: int = 6, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 6, 6, generator=gen, dtype=F64), torch.randint(
        0, 3, (n,), generator=gen
    )


FROZEN = [f"{layer}.{p}" for layer in ("conv", "bn", "fc", "head") for p in ("weight", "bias")]


# ------------------------------------------------------------------ frozen weight or bias


@pytest.mark.parametrize("frozen", FROZEN)
def test_a_frozen_tensor_is_skipped_by_the_diagonal_ggn_the_kernel_and_vogn_statistics(frozen):
    net = _net(frozen)
    x, y = _data()
    p = flat(net).numel()
    assert p == sum(q.numel() for q in net.parameters()) - net.get_parameter(frozen).numel()
    # the diagonal GGN by layer capture (FROMP's curvature, the diagonal Laplace)
    want = torch.diagonal(dense_ggn(net, x, LIK))
    torch.testing.assert_close(diag_ggn(net, x, LIK, method="capture"), want, rtol=1e-9, atol=1e-12)
    # the structured DNN2GP kernel and variances (FROMP's kernel, the Laplace predictive)
    prec = torch.linspace(0.5, 3.0, p, dtype=F64)
    gp = GP(net, DiagonalGaussian(flat(net), prec), LIK)
    jac = dense_jacobian(net, x)
    k_want = dense_kernel(jac, torch.diag(1 / prec), jac)
    torch.testing.assert_close(gp.kernel(x, method="structured"), k_want, rtol=1e-9, atol=1e-12)
    v_want = torch.stack([k_want[n, :, n] for n in range(len(x))])
    torch.testing.assert_close(gp.variance(x, method="structured"), v_want, rtol=1e-9, atol=1e-12)
    # VOGN's per-example squared gradients by layer capture, against a loop over examples
    stats = per_example_grad_stats(net, x, y, LIK, method="hooks")
    params = [q for q in net.parameters() if q.requires_grad]
    rows = []
    for n in range(len(x)):
        g = torch.autograd.grad(LIK.nll(net(x[n : n + 1]), y[n : n + 1]).sum(), params)
        rows.append(torch.cat([t.reshape(-1) for t in g]))
    rows = torch.stack(rows)
    torch.testing.assert_close(stats.curv, rows.pow(2).mean(0), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(stats.grad, rows.mean(0), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("frozen", FROZEN)
def test_kron_refuses_a_frozen_weight_by_name_and_leaves_out_a_frozen_bias(frozen):
    net = _net(frozen)
    x, _ = _data()
    layer, what = frozen.split(".")
    if layer in ("conv", "fc", "head") and what == "weight":
        with pytest.raises(ValueError, match=rf"'{layer}\.bias' trains while its layer's weight"):
            kron_layers(net)
        return
    kron, diag = kron_split(net)
    assert kron == [net.conv, net.fc, net.head] and diag == [net.bn]
    curv = kron_curvature(net, [(x, None)], LIK)
    names = [n for block in curv.names for n in block] + list(curv.diag)
    assert frozen not in names
    assert set(names) == {n for n, q in net.named_parameters() if q.requires_grad}
    for block, block_names in zip(curv.blocks, curv.names):
        assert (block.B_bias is None) == (len(block_names) == 1)
    # the batch-norm block is the exact GGN diagonal of its trainable tensor(s)
    dense = torch.diagonal(dense_ggn(net, x, LIK))
    offsets, i = {}, 0
    for n, q in net.named_parameters():
        if q.requires_grad:
            offsets[n] = slice(i, i + q.numel())
            i += q.numel()
    for n, t in curv.diag.items():
        torch.testing.assert_close(t, dense[offsets[n]], rtol=1e-9, atol=1e-12)


def test_the_audit_reproducer_fromp_and_the_diagonal_laplace_with_a_frozen_weight():
    """N2: FROMP's after-task step and the all-weights diagonal Laplace's predictive on a
    Linear whose weight is frozen and whose bias trains (KeyError: 'weight' before)."""
    from fromp import FROMPMethod, Laplace

    torch.manual_seed(0)
    xs = torch.randn(40, 4)
    ys = torch.arange(40) % 2

    def net():
        torch.manual_seed(0)
        n = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).eval()
        n[0].weight.requires_grad_(False)
        return n

    FROMPMethod(n_points=4).learn_task(net(), xs, ys, task=None)
    probs = Laplace(net(), "classification", "all", "diag").fit([(xs, ys)])(xs)
    assert probs.shape == (40, 2) and bool(torch.isfinite(probs).all())


# ---------------------------------------------------------------------------- compiled


def _never(gm, example_inputs):
    raise AssertionError("the compiled forward ran: the curvature passes must run eagerly")


def _mlp() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double().eval()


def _entry_points(x: torch.Tensor, y: torch.Tensor) -> dict:
    """name -> fn(model): every curvature / Jacobian / kernel / last-layer entry point."""

    def v(model):
        return torch.linspace(-1, 1, flat(model).numel(), dtype=F64)

    def gp(model):
        g = GP(model, DiagonalGaussian(flat(model), 2 + v(model)), LIK)
        return (
            g.mean(x),
            g.kernel(x, method="structured"),
            g.kernel(x, method="jacobian"),
            g.variance(x),
        )

    return {
        "diag_ggn": lambda m: diag_ggn(m, x, LIK),
        "diag_ggn_jacobian": lambda m: diag_ggn(m, x, LIK, method="jacobian"),
        "diag_ef": lambda m: diag_ef(m, (x, y), LIK),
        "diag_fisher": lambda m: diag_fisher(m, x, LIK, generator=torch.Generator().manual_seed(0)),
        "diag_ggn_linear": lambda m: diag_ggn_linear(m, x, LIK),
        "capture_plan": lambda m: CapturePlan.build(m, x[:2], n_columns=3).fallback,
        "layer_map": lambda m: list(LayerMap.of(m).layers()),
        "ggn": lambda m: ggn(m, x, LIK),
        "ggn_vp": lambda m: ggn_vp(m, x, LIK, v(m)),
        "ggn_matmat": lambda m: ggn_matmat(m, [x], LIK, torch.stack([v(m), v(m).flip(0)], 1)),
        "jacobians": lambda m: jacobians(m, x),
        "iter_jacobians": lambda m: torch.cat([j for _, j in iter_jacobians(m, x, chunk_size=2)]),
        "jvp": lambda m: jvp(m, x, v(m)),
        "vjp_sum": lambda m: vjp_sum(m, x, torch.ones(len(x), 3, dtype=F64)),
        "per_example_grads": lambda m: per_example_grads(m, x, y, LIK.nll),
        "forward_numel": lambda m: forward_numel(m, x[:1]),
        "kron_curvature": lambda m: _factors(kron_curvature(m, [(x, None)], LIK)),
        "kron_curvature_tasks": lambda m: _factors(kron_curvature_tasks(m, [(x, None)], LIK)),
        "last_layer_forward": lambda m: last_layer_forward(m, x)[:2],
        "last_layer_features": lambda m: last_layer_features(m, x)[0],
        "last_linear": lambda m: last_linear(m, x)[0],
        "last_layer_loo": lambda m: last_layer_loo(m, x, y, 1.0).perturbation.loo_logits,
        "gp": gp,
        "grad_stats_hooks": lambda m: vars(per_example_grad_stats(m, x, y, LIK, method="hooks")),
        "grad_stats_vmap": lambda m: vars(per_example_grad_stats(m, x, y, LIK, method="vmap")),
        "grad_stats_ggn": lambda m: vars(per_example_grad_stats(m, x, y, LIK, hess_approx="ggn")),
    }


def _factors(curv) -> dict:
    """A KFAC curvature's numbers, and its names as the uncompiled module's (a compiled
    model's carry the wrapper's ``_orig_mod.`` prefix, as its ``named_parameters()``)."""
    state = curv.state_dict()
    state["names"] = [[n.removeprefix("_orig_mod.") for n in b] for b in state["names"]]
    return state


_X = torch.randn(5, 4, generator=torch.Generator().manual_seed(2), dtype=F64)
_Y = torch.tensor([0, 2, 1, 1, 0])


@pytest.mark.parametrize("entry", sorted(_entry_points(_X, _Y)))
def test_a_compiled_model_gives_the_uncompiled_numbers_at_every_entry_point(entry):
    fn = _entry_points(_X, _Y)[entry]
    net = _mlp()
    want = fn(net)
    got = fn(torch.compile(net, backend=_never))
    _assert_same(got, want)


def _assert_same(got, want) -> None:
    """Equal structures with bitwise-equal tensors (names, counts, modules equal)."""
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            _assert_same(got[k], want[k])
    elif isinstance(want, list | tuple):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            _assert_same(a, b)
    elif isinstance(want, torch.Tensor):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    else:
        assert got == want, (got, want)


def test_the_audit_reproducer_laplace_on_a_compiled_model():
    """N3: the all-weights diagonal and Kronecker Laplace and the last-layer Laplace fit on a
    compiled model (raw autograd errors and "OptimizedModule has none" before, with
    AOTAutograd's compiled backward) and give the uncompiled model's evidence."""
    from fromp import Laplace

    x = torch.randn(20, 4, dtype=F64)
    y = torch.arange(20) % 3
    for subset, structure in [("all", "diag"), ("all", "kron"), ("last_layer", "full")]:
        net = _mlp()
        want = Laplace(net, "classification", subset, structure).fit([(x, y)])
        compiled = torch.compile(net, backend="aot_eager")
        got = Laplace(compiled, "classification", subset, structure)
        got.fit([(x, y)])
        torch.testing.assert_close(got.log_marginal_likelihood(), want.log_marginal_likelihood())


# ------------------------------------------------------------------------------ tied


class _Tied(nn.Module):
    """``enc`` and ``dec`` share one weight (an autoencoder-style tie, used twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.dec = nn.Linear(4, 4)
        self.dec.weight = self.enc.weight
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.dec(torch.tanh(self.enc(x)))))


class _TiedHead(nn.Module):
    """The output layer's weight is the input layer's (transposed use): tied embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 4, bias=False)
        self.head = nn.Linear(4, 3)
        self.head.weight = nn.Parameter(torch.randn(3, 4))
        self.inp.weight = self.head.weight  # [3, 4] used as [4, 3]^T below

    def forward(self, x):
        return self.head(torch.tanh(x @ self.inp.weight))


def test_tied_weights_are_exact_or_refused_by_name():
    torch.manual_seed(4)
    net = _Tied().double().eval()
    x, y = torch.randn(6, 4, dtype=F64), torch.tensor([0, 1, 2, 0, 1, 2])
    p = flat(net).numel()
    assert p == 16 + 4 + 4 + 15  # the shared weight counted once
    want = torch.diagonal(dense_ggn(net, x, LIK))
    torch.testing.assert_close(diag_ggn(net, x, LIK), want, rtol=1e-9, atol=1e-12)
    prec = torch.linspace(0.5, 3.0, p, dtype=F64)
    jac = dense_jacobian(net, x)
    gp = GP(net, DiagonalGaussian(flat(net), prec), LIK)
    k_want = dense_kernel(jac, torch.diag(1 / prec), jac)
    torch.testing.assert_close(gp.kernel(x), k_want, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(ggn(net, x, LIK), dense_ggn(net, x, LIK), rtol=1e-9, atol=1e-12)
    stats = per_example_grad_stats(net, x, y, LIK)  # hooks decline: per-example vmap
    rows = torch.stack([
        torch.cat([g.reshape(-1) for g in torch.autograd.grad(
            LIK.nll(net(x[n : n + 1]), y[n : n + 1]).sum(), list(net.parameters()))])
        for n in range(len(x))
    ])  # fmt: skip
    torch.testing.assert_close(stats.curv, rows.pow(2).mean(0), rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match=r"'enc\.weight' is shared between layers"):
        kron_curvature(net, [(x, None)], LIK)
    # the output layer's weight also used elsewhere: features are not fixed, refused
    head_tied = _TiedHead().double().eval()
    with pytest.raises(
        ValueError, match=r"output layer's weight \(parameter 'inp\.weight'\).*tied"
    ):
        last_layer_forward(head_tied, torch.randn(5, 3, dtype=F64))


# -------------------------------------------------------------------- tuple / dict outputs


class _Out(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.body = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))

    def forward(self, x):
        f = self.body(x)
        return (f, f.sum(1)) if self.kind == "tuple" else {"logits": f}


@pytest.mark.parametrize("kind", ["tuple", "dict"])
@pytest.mark.parametrize(
    "entry",
    sorted(set(_entry_points(_X, _Y)) - {"layer_map", "forward_numel", "last_linear"}),
)
def test_a_tuple_or_dict_output_is_refused_saying_what_to_write(kind, entry):
    torch.manual_seed(0)
    net = _Out(kind).double().eval()
    with pytest.raises(ValueError, match=rf"\[N, C\] tensor.*got a {kind}.*logits"):
        _entry_points(_X, _Y)[entry](net)
