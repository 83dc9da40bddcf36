r"""The per-layer rules of layer capture: for one call of a supported layer, its per-example
parameter gradients and their squared sums from the layer input ``a`` and the output
gradients ``g`` alone (:mod:`fromp.curvature.capture` records both and routes the rest).

==================  ==============================  ==========================================
layer               per-example gradient            sum over examples of its square
==================  ==============================  ==========================================
``Linear`` [B, in]  ``g_n a_n^T``                   ``(g^2)^T (a^2)`` (one GEMM)
``Linear`` [B,T,i]  ``sum_t g_nt a_nt^T``           formed per example (``[B, out, in]``)
``Conv1d/2d``       ``sum_l g_{n,:,l} u_{n,:,l}^T``  ``L == 1`` or small: ``sum_{n,l,l'} (g g^T)
                    (``u`` = unfolded input,         _{ll'} (u u^T)_{ll'}`` (one GEMM, no
                    ``L`` output positions)          per-example gradient); else per-example
                                                     weight gradients of one grouped convolution
                                                     (the batch as groups), squared and summed
norm affine         ``sum_l g_nl xhat_nl``, bias     squared and summed (``[B, C]``)
                    ``sum_l g_nl``
==================  ==============================  ==========================================

Norm layers: ``BatchNorm1d/2d/3d`` in eval mode (running statistics), ``LayerNorm``,
``GroupNorm``; ``xhat`` is the normalised input, recomputed from ``a``. Convolutions: any
stride, dilation, padding (numbers or strings) and padding mode, any ``groups``.

"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "per_example_entries",
    "per_example_layer_grads",
    "squared_grad_sums",
    "supported_layer",
]

DEFAULT_MEMORY_BUDGET = 2 * 1024**3
"""Default working-memory budget in bytes (2 GiB) from which chunk sizes are derived."""

_BN = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_CONV = (nn.Conv1d, nn.Conv2d)


def supported_layer(m: nn.Module) -> bool:
    """Whether ``m``'s own parameters can be handled from its input and output gradient.

    Exact types only (a subclass may change ``forward``): ``Linear``, ``Conv1d/2d``, batch
    norm with running statistics in eval mode, ``LayerNorm``, ``GroupNorm``."""
    t = type(m)
    if t is nn.Linear or t in _CONV or t is nn.LayerNorm or t is nn.GroupNorm:
        return True
    if t in _BN:
        return (not m.training) and m.running_mean is not None and m.running_var is not None
    return False


# ----------------------------------------------------------------------------- per layer


def conv_geometry(m: nn.Module, a: Tensor, g: Tensor) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """``a`` padded explicitly (any padding mode) and ``a``, ``g`` as 2-d convolutions
    (``Conv1d`` as height 1), with the kernel, stride and dilation to use."""
    mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
    pad = m._reversed_padding_repeated_twice
    if any(pad):
        a = F.pad(a, pad, mode=mode)
    if isinstance(m, nn.Conv1d):
        a, g = a.unsqueeze(-2), g.unsqueeze(-2)
        geo = {"kernel": (1, *m.kernel_size), "stride": (1, *m.stride), "dil": (1, *m.dilation)}
    else:
        geo = {"kernel": tuple(m.kernel_size), "stride": tuple(m.stride), "dil": m.dilation}
    return a, g, geo


def _conv_per_example(m: nn.Module, a: Tensor, g: Tensor) -> Tensor:
    """Per-example weight gradients ``[B, *weight.shape]`` of a convolution from its
    input ``a [B, Cin, H, W]`` and output gradient ``g [B, Cout, Ho, Wo]``: stacking the
    batch along the channels turns the ``B`` problems into one convolution with
    ``groups = B * groups`` whose weight gradient holds the per-example gradients."""
    a, g, geo = conv_geometry(m, a, g)
    bsz, cout = g.shape[:2]
    cin = a.shape[1]
    per = torch.nn.grad.conv2d_weight(
        a.reshape(1, bsz * cin, *a.shape[2:]),
        (bsz * cout, cin // m.groups, *geo["kernel"]),
        g.reshape(1, bsz * cout, *g.shape[2:]),
        stride=geo["stride"],
        padding=0,
        dilation=geo["dil"],
        groups=bsz * m.groups,
    )
    return per.view(bsz, *m.weight.shape)


def _norm_xhat(m: nn.Module, a: Tensor) -> Tensor:
    """The normalised input of a norm layer (its output before the affine map)."""
    if isinstance(m, nn.LayerNorm):
        return F.layer_norm(a, m.normalized_shape, None, None, m.eps)
    if isinstance(m, nn.GroupNorm):
        return F.group_norm(a, m.num_groups, None, None, m.eps)
    return F.batch_norm(a, m.running_mean, m.running_var, None, None, False, 0.0, m.eps)


def per_example_layer_grads(m: nn.Module, a: Tensor, g: Tensor) -> dict[str, Tensor]:
    """``{param name: [B, *param.shape]}``: per-example gradients of one layer call from its
    input ``a [B, ...]`` and output gradient ``g [B, ...]`` (the layer types of
    :func:`supported_layer`)."""
    out: dict[str, Tensor] = {}
    bsz = a.shape[0]
    if isinstance(m, nn.Linear):
        a3, g3 = a.reshape(bsz, -1, a.shape[-1]), g.reshape(bsz, -1, g.shape[-1])
        out["weight"] = torch.bmm(g3.transpose(1, 2), a3)
        if m.bias is not None:
            out["bias"] = g3.sum(1)
    elif isinstance(m, _CONV):
        out["weight"] = _conv_per_example(m, a, g)
        if m.bias is not None:
            out["bias"] = g.reshape(bsz, g.shape[1], -1).sum(2)
    else:
        w_per, b_per = norm_per_example(m, a, g)
        if m.weight is not None:
            out["weight"] = w_per
        if m.bias is not None:
            out["bias"] = b_per
    return out


def per_example_entries(m: nn.Module, a: Tensor, g: Tensor, attr: str, local: Tensor) -> Tensor:
    """``[B, k]``: per-example gradients of the entries ``local`` ``[k]`` (flat offsets into
    ``m.<attr>``) of one layer call, from its input ``a`` and output gradient ``g``, without
    the layer's whole per-example gradient where the entries can be read directly: a
    ``Linear`` weight entry ``(o, i)`` is ``sum_t g[t, o] a[t, i]`` over the positions ``t``
    of a sequence, a convolution's ``(o, c, r)`` is ``sum_l g[o, l] U[c r, l]`` over the
    output positions ``l`` of the unfolded input ``U`` (``c`` counted in ``o``'s group).
    Biases and normalisation layers are read from :func:`per_example_layer_grads`."""
    bsz = a.shape[0]
    w = m.weight
    if attr == "weight" and isinstance(m, nn.Linear):
        o, i = local // w.shape[1], local % w.shape[1]
        a3, g3 = a.reshape(bsz, -1, a.shape[-1]), g.reshape(bsz, -1, g.shape[-1])
        return (g3[:, :, o] * a3[:, :, i]).sum(1)
    if attr == "weight" and isinstance(m, _CONV):
        a2, g2, geo = conv_geometry(m, a, g)
        cols = F.unfold(a2, geo["kernel"], dilation=geo["dil"], stride=geo["stride"])
        cout, cpg = w.shape[0], w.shape[1]
        kk = geo["kernel"][0] * geo["kernel"][1]
        o, rest = local // (cpg * kk), local % (cpg * kk)
        channel = (o // (cout // m.groups)) * cpg + rest // kk  # the input channel
        rows = channel * kk + rest % kk  # unfold's rows: channel-major, then the kernel
        gl = g2.reshape(bsz, cout, -1)  # [B, Cout, L]
        return (gl[:, o, :] * cols[:, rows, :]).sum(-1)
    return per_example_layer_grads(m, a, g)[attr].reshape(bsz, -1)[:, local]


def norm_per_example(m: nn.Module, a: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """Per-example ``(d weight, d bias)`` of a norm layer's affine map ``xhat * w + b``;
    ``g`` may carry leading column dimensions ``[..., B, ...]``."""
    xhat = _norm_xhat(m, a)
    prod = g * xhat
    if isinstance(m, nn.LayerNorm):
        k = len(m.normalized_shape)
        lead = g.ndim - a.ndim + 1  # column dims + batch
        dims = tuple(range(lead, g.ndim - k))
    else:  # channel dimension right after the batch
        lead = g.ndim - a.ndim + 2
        dims = tuple(range(lead, g.ndim))
    if dims:
        return prod.sum(dims), g.sum(dims)
    return prod, g


def _gram_route(m: nn.Module, a: Tensor, g: Tensor, k: int) -> bool:
    """Whether the ``L^2`` Gram contraction of a convolution is cheaper than forming its
    per-example gradients for ``k`` columns (``L`` output positions of ``g [K, B, Cout,
    *spatial]``): ``L^2 <= k (L + 1)``."""
    positions = math.prod(g.shape[3:])
    return positions * positions <= k * (positions + 1)


def squared_grad_sums(
    m: nn.Module, a: Tensor, gs: Tensor, *, memory_budget: int = DEFAULT_MEMORY_BUDGET
) -> dict[str, Tensor]:
    """``{param name: sum_{k, n} (d(v_{nk}^T f_n)/d theta)^2}`` of one layer call.

    Args:
        m: a layer of :func:`supported_layer`.
        a: its input ``[B, ...]`` for the chunk.
        gs: output gradients for ``K`` columns, ``[K, B, *z.shape[1:]]``.
        memory_budget: bytes allowed for per-example gradients formed at once (they are
            formed, for convolutions with many output positions and sequence linear layers,
            in sub-chunks of ``(k, n)`` pairs).

    Returns:
        Tensors shaped like the parameters (summed over ``K`` and ``B``).
    """
    n_k, bsz = gs.shape[:2]
    out: dict[str, Tensor] = {}
    if isinstance(m, nn.Linear) and a.ndim == 2:
        g2 = gs.pow(2).sum(0)  # B, out
        out["weight"] = g2.T @ a.pow(2)
        if m.bias is not None:
            out["bias"] = g2.sum(0)
        return out
    if isinstance(m, (*_BN, nn.LayerNorm, nn.GroupNorm)):
        w_per, b_per = norm_per_example(m, a, gs)
        red = tuple(range(2))
        if m.weight is not None:
            out["weight"] = w_per.pow(2).sum(red)
        if m.bias is not None:
            out["bias"] = b_per.pow(2).sum(red)
        return out
    if isinstance(m, _CONV):
        if m.bias is not None:
            out["bias"] = gs.reshape(n_k, bsz, gs.shape[2], -1).sum(3).pow(2).sum((0, 1))
        if _gram_route(m, a, gs, n_k):
            out["weight"] = _conv_gram(m, a, gs)
        else:
            out["weight"] = _conv_squares(m, a, gs, memory_budget)
        return out
    # per-example gradients of (k, n) pairs, in sub-chunks bounded by the budget
    p_layer = sum(p.numel() for p in m.parameters(recurse=False))
    step = max(1, int(memory_budget // (3 * p_layer * gs.element_size())))
    acc: dict[str, Tensor] = {}
    flat_g = gs.reshape(n_k * bsz, *gs.shape[2:])
    for s in range(0, n_k * bsz, step):
        idx = torch.arange(s, min(s + step, n_k * bsz), device=gs.device)
        per = per_example_layer_grads(m, a[idx % bsz], flat_g[idx])
        for name, t in per.items():
            if name in out:
                continue
            sq = t.pow(2).sum(0)
            acc[name] = sq if name not in acc else acc[name] + sq
    out.update(acc)
    return out


_CONV_ROUTE: dict[tuple, str] = {}


def _conv_squares(m: nn.Module, a: Tensor, gs: Tensor, memory_budget: int) -> Tensor:
    """``sum_{k,n} (per-example weight gradient)^2`` of a convolution by the faster of
    :func:`_conv_unfold_squares` and :func:`_conv_grouped_squares` for this layer geometry
    (both exact; timed once per geometry, batch size and device, then remembered)."""
    key = (
        type(m), tuple(m.weight.shape), tuple(a.shape), tuple(gs.shape), m.stride, m.dilation,
        m.groups, a.dtype, a.device.type,
    )  # fmt: skip
    route = _CONV_ROUTE.get(key)
    if route is not None:
        fn = _conv_unfold_squares if route == "unfold" else _conv_grouped_squares
        return fn(m, a, gs, memory_budget)
    times, result = {}, None
    for name, fn in (("unfold", _conv_unfold_squares), ("grouped", _conv_grouped_squares)):
        if a.is_cuda:
            torch.cuda.synchronize(a.device)
        t0 = time.perf_counter()
        result = fn(m, a, gs, memory_budget)
        if a.is_cuda:
            torch.cuda.synchronize(a.device)
        times[name] = time.perf_counter() - t0
    _CONV_ROUTE[key] = min(times, key=times.__getitem__)
    assert result is not None
    return result


def _conv_grouped_squares(m: nn.Module, a: Tensor, gs: Tensor, memory_budget: int) -> Tensor:
    """``sum_{k,n} (per-example weight gradient)^2`` of a convolution from per-example
    gradients of one grouped weight-gradient convolution per column and sub-chunk of
    examples (:func:`_conv_per_example`); sub-chunks hold at most ``memory_budget`` bytes."""
    n_k, bsz = gs.shape[:2]
    step = max(1, int(memory_budget // (2 * m.weight.numel() * gs.element_size())))
    acc = torch.zeros_like(m.weight, dtype=gs.dtype)
    for k in range(n_k):
        for s in range(0, bsz, step):
            acc += _conv_per_example(m, a[s : s + step], gs[k, s : s + step]).pow_(2).sum(0)
    return acc


def _conv_unfold_squares(m: nn.Module, a: Tensor, gs: Tensor, memory_budget: int) -> Tensor:
    """``sum_{k,n} (per-example weight gradient)^2`` of a convolution with per-example
    gradients ``g_{kn} u_n^T`` formed by one batched GEMM per sub-chunk of examples
    (``[K Cout/G, L] @ [L, Cin/G kk]`` per example and group, the ``K`` columns stacked so
    that the unfolded input ``u_n`` is shared), squared and summed; sub-chunks hold at most
    ``memory_budget`` bytes of gradients."""
    n_k, bsz = gs.shape[:2]
    ap, g2d, geo = conv_geometry(m, a, gs.reshape(n_k * bsz, *gs.shape[2:]))
    u = F.unfold(ap, geo["kernel"], dilation=geo["dil"], stride=geo["stride"])  # B, Cin kk, L
    grp, pos = m.groups, u.shape[-1]
    u = u.reshape(bsz * grp, -1, pos).transpose(1, 2)  # B G, L, J
    g = g2d.reshape(n_k, bsz, grp, -1, pos).permute(1, 2, 0, 3, 4)  # B, G, K, O, L
    g = g.reshape(bsz * grp, -1, pos)  # B G, K O, L
    per_ex = n_k * m.weight.numel() * gs.element_size()
    step = max(1, int(memory_budget // (2 * per_ex))) * grp
    acc = None
    for s in range(0, bsz * grp, step):
        per = torch.bmm(g[s : s + step], u[s : s + step])  # b G, K O, J
        sq = per.view(-1, grp, n_k, per.shape[1] // n_k, per.shape[2]).pow_(2).sum((0, 2))
        acc = sq if acc is None else acc + sq
    assert acc is not None
    return acc.reshape(m.weight.shape)


def _conv_gram(m: nn.Module, a: Tensor, gs: Tensor) -> Tensor:
    """``sum_{k,n} (per-example weight gradient)^2`` of a convolution as
    ``sum_{n,l,l'} [sum_k g_{knol} g_{knol'}] u_{njl} u_{njl'}`` per group: one batched GEMM
    of ``[Cout/G, B L^2]`` by ``[B L^2, Cin/G kk]``, no per-example gradient formed."""
    n_k, bsz = gs.shape[:2]
    ap, g2d, geo = conv_geometry(m, a, gs.reshape(n_k * bsz, *gs.shape[2:]))
    u = F.unfold(ap, geo["kernel"], dilation=geo["dil"], stride=geo["stride"])  # B, Cin kk, L
    grp = m.groups
    pos = u.shape[-1]
    u = u.reshape(bsz, grp, -1, pos)  # B, G, J, L
    g = g2d.reshape(n_k, bsz, grp, -1, pos)  # K, B, G, O, L
    gg = torch.einsum("kngol,kngom->ngolm", g, g)  # B, G, O, L, L
    uu = torch.einsum("ngjl,ngjm->ngjlm", u, u)  # B, G, J, L, L
    w = torch.einsum("ngolm,ngjlm->goj", gg, uu)
    return w.reshape(m.weight.shape)
