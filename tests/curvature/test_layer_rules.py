"""The per-layer rule registry (fromp.curvature.layer_rules), one layer type at a time, against
per-example gradients from torch.func (``vmap(grad)`` of ``<g_n, layer(a_n)>`` over the layer
alone) in float64: per-example gradients with and without leading column dimensions, squared
sums at every memory budget, single entries, the input and output rows of the outer-product
layers (whose ``sum_l g_l u_l^T`` is the weight gradient), a subset of parameters, and the
refusal of every layer without a rule. Shapes break symmetry: 3+ channels, rectangular
kernels, stride, padding (each mode), dilation and groups."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from fromp.curvature.layer_rules import (
    BATCH_NORM,
    input_rows,
    is_batch_norm,
    output_rows,
    per_example_entries,
    per_example_layer_grads,
    rule_for,
    squared_grad_sums,
    supported_layer,
    trainable_names,
)

F64 = torch.float64


def _randomise_norm(m: nn.Module) -> nn.Module:
    with torch.no_grad():
        if getattr(m, "running_mean", None) is not None:
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
        if getattr(m, "weight", None) is not None:
            m.weight.uniform_(0.5, 1.5)
        if getattr(m, "bias", None) is not None:
            m.bias.uniform_(-0.5, 0.5)
    return m


#: id -> (layer factory, input shape of one example)
LAYERS = {
    "linear": (lambda: nn.Linear(5, 3), (5,)),
    "linear-seq": (lambda: nn.Linear(4, 3), (6, 4)),
    "linear-2pos": (lambda: nn.Linear(4, 5, bias=False), (2, 3, 4)),
    "conv1d-stride-dil": (lambda: nn.Conv1d(3, 4, 3, stride=2, padding=2, dilation=2), (3, 11)),
    "conv1d-groups-reflect": (
        lambda: nn.Conv1d(4, 6, 3, padding=1, groups=2, padding_mode="reflect"),
        (4, 7),
    ),
    "conv2d-rect": (
        lambda: nn.Conv2d(3, 5, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2)),
        (3, 7, 6),
    ),
    "conv2d-groups-circular": (
        lambda: nn.Conv2d(6, 9, 3, padding="same", groups=3, padding_mode="circular"),
        (6, 5, 4),
    ),
    "conv2d-replicate-nobias": (
        lambda: nn.Conv2d(3, 4, 2, stride=2, padding=1, padding_mode="replicate", bias=False),
        (3, 5, 5),
    ),
    "conv2d-one-position": (lambda: nn.Conv2d(3, 4, 4), (3, 4, 4)),
    "bn1d": (lambda: nn.BatchNorm1d(3), (3,)),
    "bn1d-seq": (lambda: nn.BatchNorm1d(3), (3, 5)),
    "bn2d": (lambda: nn.BatchNorm2d(3), (3, 4, 5)),
    "bn3d": (lambda: nn.BatchNorm3d(3), (3, 2, 3, 4)),
    "layernorm-2d": (lambda: nn.LayerNorm((4, 5)), (3, 4, 5)),
    "layernorm": (lambda: nn.LayerNorm(5), (5,)),
    "groupnorm": (lambda: nn.GroupNorm(3, 6), (6, 4)),
}


def _layer(key: str, seed: int = 0) -> tuple[nn.Module, tuple[int, ...]]:
    make, shape = LAYERS[key]
    torch.manual_seed(seed)
    return _randomise_norm(make()).double().eval(), shape


def _reference(m: nn.Module, a: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{name: [B, *shape]}``: ``d <g_n, m(a_n)> / d theta`` for each example alone."""
    params = {n: p.detach() for n, p in m.named_parameters()}
    buffers = dict(m.named_buffers())

    def one(p, ai, gi):
        return (functional_call(m, (p, buffers), (ai.unsqueeze(0),)) * gi.unsqueeze(0)).sum()

    return vmap(grad(one), in_dims=(None, 0, 0))(params, a, g)


def _inputs(m: nn.Module, shape: tuple[int, ...], n: int, k: int):
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(n, *shape, generator=gen, dtype=F64)
    with torch.no_grad():
        z = m(a)
    gs = torch.randn(k, *z.shape, generator=gen, dtype=F64)
    return a, gs


@pytest.mark.parametrize("key", sorted(LAYERS))
def test_rule_matches_torch_func_per_example_gradients(key):
    m, shape = _layer(key)
    a, gs = _inputs(m, shape, n=5, k=3)
    refs = [_reference(m, a, g) for g in gs]
    names = [n for n, _ in m.named_parameters()]
    assert trainable_names(m) == tuple(names)
    # per-example gradients, one column and with leading column dimensions
    got = per_example_layer_grads(m, a, gs[1])
    assert sorted(got) == sorted(names)
    for n in names:
        torch.testing.assert_close(got[n], refs[1][n], rtol=1e-10, atol=1e-12)
    lead = per_example_layer_grads(m, a, gs.view(1, 3, *gs.shape[1:]))
    for n in names:
        want = torch.stack([r[n] for r in refs]).unsqueeze(0)
        torch.testing.assert_close(lead[n], want, rtol=1e-10, atol=1e-12)
    # squared sums over columns and examples, at a one-byte and a large budget
    for budget in (1, 2**30):
        sq = squared_grad_sums(m, a, gs, memory_budget=budget)
        for n in names:
            want = sum(r[n].pow(2).sum(0) for r in refs)
            torch.testing.assert_close(sq[n], want, rtol=1e-10, atol=1e-12)
    # every entry read alone, in a shuffled order
    for n in names:
        local = torch.randperm(getattr(m, n).numel())
        got_e = per_example_entries(m, a, gs[0], n, local)
        torch.testing.assert_close(got_e, refs[0][n].reshape(len(a), -1)[:, local])


@pytest.mark.parametrize("key", sorted(k for k in LAYERS if k.startswith(("linear", "conv"))))
def test_outer_product_rows_give_the_weight_and_bias_gradients(key):
    """``sum_l g_nl u_nl^T`` per group is the per-example weight gradient and ``sum_l g_nl``
    the bias gradient: the rows the Kronecker factors and the structured kernel use."""
    m, shape = _layer(key)
    a, gs = _inputs(m, shape, n=4, k=1)
    ref = _reference(m, a, gs[0])
    rule = rule_for(m)
    assert rule.outer
    u, g = input_rows(m, a), output_rows(m, gs[0])  # [B, L, J], [B, L, O]
    assert u.shape[:2] == g.shape[:2] and g.shape[2] == m.weight.shape[0]
    grp = rule.groups
    o_g, j_g = m.weight.shape[0] // grp, u.shape[2] // grp
    blocks = [
        torch.einsum(
            "nlo,nlj->noj", g[..., i * o_g : (i + 1) * o_g], u[..., i * j_g : (i + 1) * j_g]
        )
        for i in range(grp)
    ]
    weight = torch.cat(blocks, 1).reshape(len(a), *m.weight.shape)
    torch.testing.assert_close(weight, ref["weight"], rtol=1e-10, atol=1e-12)
    if m.bias is not None:
        torch.testing.assert_close(g.sum(1), ref["bias"], rtol=1e-10, atol=1e-12)
    assert rule.kfac == (type(m) is nn.Linear or (type(m) is nn.Conv2d and m.groups == 1))


@pytest.mark.parametrize("key", ["linear", "linear-seq", "conv2d-rect", "bn2d", "groupnorm"])
def test_frozen_parameters_are_neither_formed_nor_returned(key):
    """By default only the trainable parameters; ``names`` picks any subset; the values are
    those of the whole layer's."""
    m, shape = _layer(key)
    a, gs = _inputs(m, shape, n=4, k=2)
    whole = squared_grad_sums(m, a, gs)
    m.weight.requires_grad_(False)
    assert trainable_names(m) == ("bias",)
    assert set(per_example_layer_grads(m, a, gs[0])) == {"bias"}
    part = squared_grad_sums(m, a, gs)
    assert set(part) == {"bias"}
    torch.testing.assert_close(part["bias"], whole["bias"])
    m.weight.requires_grad_(True)
    m.bias.requires_grad_(False)
    assert set(squared_grad_sums(m, a, gs)) == {"weight"}
    assert set(per_example_layer_grads(m, a, gs[0], names=("bias",))) == {"bias"}


class _MyLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


@pytest.mark.parametrize(
    "layer",
    [
        nn.Conv3d(3, 4, 2),
        _MyLinear(3, 2),
        nn.Embedding(5, 3),
        nn.PReLU(),
        nn.ConvTranspose2d(3, 3, 2),
    ],
    ids=["conv3d", "subclass", "embedding", "prelu", "convtranspose"],
)
def test_a_layer_without_a_rule_is_refused_by_name(layer):
    assert not supported_layer(layer)
    with pytest.raises(ValueError, match=type(layer).__name__ + " has no layer rule"):
        rule_for(layer)
    with pytest.raises(ValueError, match="has no layer rule"):
        per_example_layer_grads(layer, torch.zeros(1, 3), torch.zeros(1, 3))


def test_batch_norm_has_a_rule_in_eval_mode_with_running_statistics_only():
    bn = nn.BatchNorm2d(3)
    assert not supported_layer(bn)  # training mode: batch statistics couple the examples
    assert supported_layer(bn, assume_eval=True)
    assert supported_layer(bn.eval())
    assert not supported_layer(nn.BatchNorm2d(3, track_running_stats=False).eval())
    assert set(BATCH_NORM) == {nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d}
    assert is_batch_norm(nn.SyncBatchNorm(3)) and not is_batch_norm(nn.LayerNorm(3))
    assert not supported_layer(nn.SyncBatchNorm(3).eval())  # no rule: its own forward
    with pytest.raises(ValueError, match="LayerNorm is not an outer-product layer"):
        rule_for(nn.LayerNorm(3)).input_rows(torch.zeros(1, 3))
