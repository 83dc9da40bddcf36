r"""Layer capture: per-layer inputs and back-propagated output gradients, and the per-example
gradient statistics that follow from them without per-example Jacobians of the whole net.

For a layer ``z = op(a; theta)`` applied once per forward pass, the gradient of a scalar
``v_n^T f(x_n)`` with respect to ``theta`` *for example n alone* depends only on the layer's
input ``a_n`` and the back-propagated output signal ``g_n = d(v_n^T f_n)/dz_n`` (one backward
pass of ``sum_n v_n^T f_n`` gives every ``g_n``, since example ``n``'s output depends only on
its own row in eval mode):

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

Everything else is routed to the per-example Jacobian fallback (:func:`torch.func.jacrev`
over the fallback parameters only): a parametrised layer of another type, a supported layer
called more than once per forward pass, a parameter shared between layers, or a layer whose
captured gradient fails a one-time self-check against autograd (e.g. its weight is also used
outside its ``forward``). No parameter is ever skipped: :class:`CapturePlan` assigns each
trainable parameter to exactly one of the two routes.

Shapes: ``B`` examples of a chunk, ``K`` columns (output directions per example), ``C``
outputs, ``P`` trainable parameters flattened in ``named_parameters()`` order.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vmap

from fromp._checks import check_chunk_size

__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "CapturePlan",
    "ColumnFn",
    "LayerCall",
    "capture_calls",
    "per_example_layer_grads",
    "squared_grad_sums",
    "sum_squared_column_grads",
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


@dataclass
class LayerCall:
    """One recorded call: the layer, its input ``a`` (detached) and its output ``z`` (in
    the autograd graph; gradients are taken with respect to it)."""

    module: nn.Module
    a: Tensor
    z: Tensor


@contextmanager
def capture_calls(modules: list[nn.Module]) -> Iterator[list[LayerCall]]:
    """Record every call of ``modules`` inside the ``with`` block as a :class:`LayerCall`.

    The hook returns a copy of each output to the rest of the network, so that in-place
    operations after the layer (``ReLU(inplace=True)``, ``out += identity`` in ResNets) do
    not rewrite the recorded ``z``. Hooks are removed on exit, also after an error."""
    calls: list[LayerCall] = []

    def hook(m: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
        calls.append(LayerCall(m, inputs[0].detach(), output))
        return output.clone() if output.requires_grad else output

    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


# ----------------------------------------------------------------------------- per layer


def _conv_geometry(m: nn.Module, a: Tensor, g: Tensor) -> tuple[Tensor, Tensor, dict[str, Any]]:
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
    a, g, geo = _conv_geometry(m, a, g)
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
        w_per, b_per = _norm_per_example(m, a, g)
        if m.weight is not None:
            out["weight"] = w_per
        if m.bias is not None:
            out["bias"] = b_per
    return out


def _norm_per_example(m: nn.Module, a: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
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
        w_per, b_per = _norm_per_example(m, a, gs)
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
    ap, g2d, geo = _conv_geometry(m, a, gs.reshape(n_k * bsz, *gs.shape[2:]))
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
    ap, g2d, geo = _conv_geometry(m, a, gs.reshape(n_k * bsz, *gs.shape[2:]))
    u = F.unfold(ap, geo["kernel"], dilation=geo["dil"], stride=geo["stride"])  # B, Cin kk, L
    grp = m.groups
    pos = u.shape[-1]
    u = u.reshape(bsz, grp, -1, pos)  # B, G, J, L
    g = g2d.reshape(n_k, bsz, grp, -1, pos)  # K, B, G, O, L
    gg = torch.einsum("kngol,kngom->ngolm", g, g)  # B, G, O, L, L
    uu = torch.einsum("ngjl,ngjm->ngjlm", u, u)  # B, G, J, L, L
    w = torch.einsum("ngolm,ngjlm->goj", gg, uu)
    return w.reshape(m.weight.shape)


# ----------------------------------------------------------------------------- the plan


@dataclass
class CapturePlan:
    """Which trainable parameters of a model go through layer capture and which through
    per-example Jacobians, decided once from a probe forward pass.

    Attributes:
        names: trainable parameter names in ``named_parameters()`` order.
        captured: supported layers called exactly once, whose parameters passed the self
            check; their parameters are ``captured_params``.
        fallback: parameter names routed to the Jacobian fallback (with ``reasons``).
        bytes_per_example: estimated working memory per example of a chunk.
    """

    names: list[str]
    shapes: dict[str, torch.Size]
    captured: list[nn.Module] = field(default_factory=list)
    captured_params: dict[str, tuple[nn.Module, str]] = field(default_factory=dict)
    fallback: list[str] = field(default_factory=list)
    reasons: dict[str, str] = field(default_factory=dict)
    bytes_per_example: int = 0
    param_of: dict[tuple[int, str], str] = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        model: nn.Module,
        x0: Tensor,
        *,
        n_columns: int,
        method: str = "auto",
        check: bool = True,
    ) -> CapturePlan:
        """Probe ``model`` on a few examples ``x0`` and route every trainable parameter.

        ``method="jacobian"`` routes everything to the fallback; ``"capture"`` raises when
        a parameter cannot be captured; ``"auto"`` falls back per parameter."""
        if method not in ("auto", "capture", "jacobian"):
            raise ValueError(f"method must be 'auto', 'capture' or 'jacobian', got {method!r}")
        named = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if not named:
            raise ValueError("model has no trainable parameters")
        plan = cls(list(named), {n: p.shape for n, p in named.items()})
        owners: dict[int, list[tuple[nn.Module, str]]] = {}
        for mod in model.modules():
            for pn, p in mod._parameters.items():
                if p is not None and p.requires_grad:
                    owners.setdefault(id(p), []).append((mod, pn))
        by_id = {id(p): n for n, p in named.items()}
        candidates: dict[nn.Module, list[tuple[str, str]]] = {}
        for pid, own in owners.items():
            name = by_id[pid]
            if method == "jacobian":
                plan.reasons[name] = "method='jacobian'"
            elif len(own) > 1:
                plan.reasons[name] = "parameter shared between layers"
            elif not supported_layer(own[0][0]):
                plan.reasons[name] = f"{type(own[0][0]).__name__} has no capture rule"
            else:
                candidates.setdefault(own[0][0], []).append((name, own[0][1]))
        elt = x0.element_size() if x0.is_floating_point() else 4
        act = 0
        if candidates:
            mods = list(candidates)
            with torch.enable_grad(), capture_calls(mods) as calls:
                f = model(x0)
            if f.ndim != 2:
                raise ValueError(f"model output must have shape [N, C], got {tuple(f.shape)}")
            counts: dict[nn.Module, int] = {}
            for c in calls:
                counts[c.module] = counts.get(c.module, 0) + 1
            unused = [mod for mod in candidates if counts.get(mod, 0) == 0]
            idle = _unused_without_gradient(f, unused, named, candidates)
            for mod, plist in candidates.items():
                if mod in idle:  # never called, no gradient (another task's head): zero
                    for name, pn in plist:
                        plan.captured_params[name] = (mod, pn)
                        plan.param_of[(id(mod), pn)] = name
                elif counts.get(mod, 0) != 1:
                    why = "never called" if counts.get(mod, 0) == 0 else "called more than once"
                    for name, _ in plist:
                        plan.reasons[name] = f"{type(mod).__name__} {why} per forward pass"
            good = [c for c in calls if counts[c.module] == 1]
            act = sum(c.z[0].numel() + c.a[0].numel() for c in calls)
            if check and good:
                for mod in _self_check(f, good, named, candidates):
                    for name, _ in candidates[mod]:
                        plan.reasons[name] = (
                            f"{type(mod).__name__}: captured gradient differs from autograd"
                        )
            for c in good:
                if all(n not in plan.reasons for n, _ in candidates[c.module]):
                    plan.captured.append(c.module)
                    for name, pn in candidates[c.module]:
                        plan.captured_params[name] = (c.module, pn)
                        plan.param_of[(id(c.module), pn)] = name
            n_out = f.shape[1]
        else:
            with torch.no_grad():
                n_out = model(x0).shape[1]
        plan.fallback = [n for n in plan.names if n not in plan.captured_params]
        if method == "capture" and plan.fallback:
            first = plan.fallback[0]
            raise ValueError(
                f"method='capture' cannot capture parameter {first!r}: {plan.reasons[first]}"
            )
        p_fb = sum(plan.shapes[n].numel() for n in plan.fallback)
        x_numel = x0[0].numel()
        plan.bytes_per_example = elt * (
            (6 + 2 * n_columns) * act + 2 * x_numel + 3 * n_out * p_fb + n_columns * n_out
        )
        return plan

    def chunk_size(self, memory_budget: int) -> int:
        """Examples per chunk so that the estimated working memory stays within
        ``memory_budget`` bytes (half of it; the other half is for per-layer temporaries)."""
        return max(1, int(memory_budget // 2 // max(1, self.bytes_per_example)))


def _unused_without_gradient(
    f: Tensor,
    unused: list[nn.Module],
    params: dict[str, Tensor],
    candidates: dict[nn.Module, list[tuple[str, str]]],
) -> set[nn.Module]:
    """Layers never called in the probe whose parameters get no gradient from ``v^T f``
    either (e.g. the heads of other tasks): their curvature is exactly zero. A layer whose
    weight is used outside its ``forward`` has a gradient and goes to the fallback."""
    if not unused:
        return set()
    names = [n for m in unused for n, _ in candidates[m]]
    gen = torch.Generator(device="cpu").manual_seed(4321)
    v = torch.randn(f.shape, generator=gen, dtype=f.dtype).to(f.device)
    grads = dict(
        zip(
            names,
            torch.autograd.grad(
                f, [params[n] for n in names], v, retain_graph=True, allow_unused=True
            ),
        )
    )
    return {
        m
        for m in unused
        if all(grads[n] is None or not bool(grads[n].any()) for n, _ in candidates[m])
    }


def _self_check(
    f: Tensor,
    calls: list[LayerCall],
    params: dict[str, Tensor],
    candidates: dict[nn.Module, list[tuple[str, str]]],
) -> set[nn.Module]:
    """Layers whose per-example gradients, summed over the probe examples, differ from
    autograd's gradient of ``v^T f`` for a random ``v`` (e.g. a weight also used outside the
    layer's ``forward``)."""
    gen = torch.Generator(device="cpu").manual_seed(1234)
    v = torch.randn(f.shape, generator=gen, dtype=f.dtype).to(f.device)
    zs = [c.z for c in calls]
    names = [n for c in calls for n, _ in candidates[c.module]]
    prm = [params[n] for n in names]
    grads = torch.autograd.grad(f, zs + prm, grad_outputs=v, allow_unused=True)
    gz, gp = grads[: len(zs)], dict(zip(names, grads[len(zs) :]))
    tol = 1e-4 if f.dtype != torch.float64 else 1e-9
    bad: set[nn.Module] = set()
    for c, g in zip(calls, gz):
        if g is None:
            continue
        per = per_example_layer_grads(c.module, c.a, g.detach())
        for name, pn in candidates[c.module]:
            ref = gp[name]
            got = per[pn].sum(0)
            ref = torch.zeros_like(got) if ref is None else ref
            scale = float(ref.abs().max()) + float(got.abs().max()) + 1e-30
            if float((got - ref).abs().max()) > tol * scale:
                bad.add(c.module)
    return bad


# ----------------------------------------------------------------------------- the engine

ColumnFn = Callable[[Tensor, Any], Tensor]
"""``(f [B, C] detached, per-example extra or None) -> V [B, C, K]``: the output directions
whose per-example gradients are squared and summed."""


def _fallback_jacobian(model: nn.Module, names: list[str], x: Tensor) -> Tensor:
    """Per-example Jacobians ``[B, C, P_fb]`` of the outputs with respect to the fallback
    parameters ``names`` only (the others are the module's own)."""
    params = dict(model.named_parameters())
    sub = {n: params[n].detach() for n in names}
    buffers = dict(model.named_buffers())

    def single(p: dict[str, Tensor], xi: Tensor) -> Tensor:
        full = {**{k: v.detach() for k, v in params.items()}, **p}
        return functional_call(model, (full, buffers), (xi.unsqueeze(0),)).squeeze(0)

    jac = vmap(jacrev(single), in_dims=(None, 0))(sub, x)
    return torch.cat([jac[n].reshape(*jac[n].shape[:2], -1) for n in names], dim=-1)


def sum_squared_column_grads(
    model: nn.Module,
    batches: Iterator[tuple[Tensor, Any]],
    columns: ColumnFn,
    *,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    chunk_size: int | None = None,
    method: str = "auto",
) -> Tensor:
    r"""``sum_n sum_k (d (V_{n,:,k}^T f(x_n)) / dw)^2`` ``[P]``: the diagonal of
    ``sum_n J_n^T V_n V_n^T J_n`` for output directions ``V_n [C, K]`` chosen per example by
    ``columns`` (``V = L``, the square root of the output Hessian, gives the GGN diagonal;
    the gradient of the nll at the label gives the empirical Fisher; at sampled labels, the
    Monte-Carlo Fisher).

    Per chunk of ``B`` examples: one forward pass recording the captured layers' inputs and
    outputs, ``K`` backward passes to those outputs (never to the parameters), then the layer
    rules of :func:`squared_grad_sums`; parameters of :attr:`CapturePlan.fallback` use
    per-example Jacobians ``[B, C, P_fb]``.

    Memory: ``B`` is ``chunk_size`` or, when None, derived from ``memory_budget`` bytes via
    :meth:`CapturePlan.chunk_size` (activations and their ``K`` gradients of ``B`` examples,
    plus ``B * C * P_fb`` for the fallback); per-example gradients of a convolution are formed
    in sub-chunks within the budget. It is an estimate of the working set, not a hard cap.

    Args:
        model: ``[B, ...] -> [B, C]``.
        batches: ``(x [N, ...], extra)`` pairs; ``extra`` is None or a tensor ``[S, N, ...]``
            (e.g. ``S`` sampled label sets) sliced per chunk along dimension 1 and passed
            to ``columns``.
        columns: see :data:`ColumnFn`.
        method: ``"auto"`` (capture, fallback per parameter), ``"capture"`` (refuse
            fallback) or ``"jacobian"`` (per-example Jacobians for every parameter).
    """
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget < 1:
        raise ValueError(f"memory_budget must be a positive int (bytes), got {memory_budget!r}")
    chunk_size = check_chunk_size(chunk_size)
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not named:
        raise ValueError("model has no trainable parameters")
    p0 = next(iter(named.values()))
    device, dtype = p0.device, p0.dtype
    acc = {n: torch.zeros_like(p, memory_format=torch.contiguous_format) for n, p in named.items()}
    plan: CapturePlan | None = None
    for x, extra in batches:
        x = x.to(device)
        if plan is None:
            with torch.no_grad():
                f0 = model(x[:2])
            n_k = columns(f0, None if extra is None else extra[:, :2]).shape[-1]
            plan = CapturePlan.build(model, x[:2], n_columns=n_k, method=method)
        step = chunk_size or plan.chunk_size(memory_budget)
        for s in range(0, len(x), step):
            xc = x[s : s + step]
            ec = None if extra is None else extra[:, s : s + step]
            _accumulate_chunk(model, plan, xc, ec, columns, acc, memory_budget)
    assert plan is not None
    return torch.cat([acc[n].reshape(-1) for n in plan.names]).to(device=device, dtype=dtype)


def _accumulate_chunk(
    model: nn.Module,
    plan: CapturePlan,
    x: Tensor,
    extra: Tensor | None,
    columns: ColumnFn,
    acc: dict[str, Tensor],
    memory_budget: int,
) -> None:
    if plan.captured:
        with torch.enable_grad(), capture_calls(plan.captured) as calls:
            f = model(x)
        v = columns(f.detach(), extra)  # B, C, K
        zs = [c.z for c in calls]
        n_k = v.shape[-1]
        per_k = [
            torch.autograd.grad(f, zs, grad_outputs=v[:, :, k], retain_graph=k < n_k - 1)
            for k in range(n_k)
        ]
        del f
        for i, c in enumerate(calls):
            gs = torch.stack([g[i] for g in per_k])  # K, B, ...
            for pn, t in squared_grad_sums(
                c.module, c.a, gs, memory_budget=memory_budget // 2
            ).items():
                name = plan.param_of.get((id(c.module), pn))
                if name is not None:  # None: a shared weight of a captured layer
                    acc[name] += t
            del gs
        del per_k, calls, zs
    else:
        with torch.no_grad():
            v = columns(model(x), extra)
    if plan.fallback:
        jac = _fallback_jacobian(model, plan.fallback, x)  # B, C, P_fb
        sq = torch.einsum("nck,ncp->nkp", v.to(jac.dtype), jac).pow(2).sum((0, 1))
        i = 0
        for n in plan.fallback:
            k = plan.shapes[n].numel()
            acc[n] += sq[i : i + k].view(plan.shapes[n])
            i += k
