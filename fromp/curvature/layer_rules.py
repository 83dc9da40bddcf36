r"""The per-layer rules: what one call of a layer contributes, written once per layer type and
asked by everything in fromp that works layer by layer (layer capture and its diagonal GGN
and Fisher, :mod:`fromp.curvature.capture`; the Kronecker factors,
:mod:`fromp.curvature.kron`; the structured kernel, :mod:`fromp.gp.kernel`; the Laplace
structures; VOGN's statistics, :mod:`fromp.optim._stats`).

For a call ``z = layer(a)`` with input ``a [B, ...]`` and the gradient ``g = d(v^T f)/dz`` of
the network's outputs in a direction ``v`` (one backward pass gives every example's ``g_n``,
since example ``n``'s output depends on its own row alone in eval mode), the gradient of
``v_n^T f_n`` in the layer's parameters *for example n alone* follows from ``a_n`` and
``g_n``:

==================  ===============================  ==========================================
layer               per-example gradient             sum over examples of its square
==================  ===============================  ==========================================
``Linear`` [B, in]  ``g_n a_n^T``, bias ``g_n``       ``(g^2)^T (a^2)`` (one GEMM)
``Linear`` [B,T,i]  ``sum_t g_nt a_nt^T``,           formed per example (``[B, out, in]``), in
                    bias ``sum_t g_nt``              sub-chunks within the memory budget
``Conv1d/2d``       ``sum_l g_nl u_nl^T``, bias      ``L`` small: ``sum_{n,l,l'} (g g^T)_{ll'}
                    ``sum_l g_nl`` (``u_nl`` the      (u u^T)_{ll'}`` (one GEMM, no per-example
                    unfolded input patch at output   gradient); else per-example weight
                    position ``l``)                  gradients of one grouped convolution (the
                                                     batch as groups) or of one batched GEMM
norm affine         ``sum_l g_nl xhat_nl``, bias     squared and summed (``[B, C]``)
                    ``sum_l g_nl``
==================  ===============================  ==========================================

*Outer-product layers* (``Linear``, ``Conv1d``, ``Conv2d``) compute ``z_l = W u_l + b`` at each
of ``L`` positions (the ``T`` positions of a sequence, the output positions of a
convolution, one for a ``Linear`` on ``[B, in]``). :meth:`LayerRule.input_rows` gives the
rows ``u_nl`` ``[B, L, J]`` (``J = in``, or ``C_in k_h k_w`` in the order of the flattened
kernel; with ``groups = G``, group ``i`` reads columns ``i J/G : (i+1) J/G``) and
:meth:`LayerRule.output_rows` the ``g_nl`` ``[B, L, O]``: the Kronecker factors and the
structured kernel are built from these two. *Norm layers*: ``BatchNorm1d/2d/3d`` with running
statistics in eval mode, ``LayerNorm``, ``GroupNorm``; ``xhat`` is the normalised input,
recomputed from ``a``. Convolutions: any stride, dilation, padding (numbers or strings),
padding mode and ``groups``.

Exact types only (a subclass may change ``forward``). A layer of any other type has no rule:
:func:`rule_for` raises, so that a caller routes its parameters to per-example Jacobians or
refuses them by name; no layer contributes nothing in silence. Only the parameters a call
asks for are computed (``names``; by default the layer's trainable ones): a frozen weight
beside a trainable bias is neither formed nor asked for.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "BATCH_NORM",
    "DEFAULT_MEMORY_BUDGET",
    "ConvRule",
    "LayerRule",
    "LinearRule",
    "NormRule",
    "input_rows",
    "is_batch_norm",
    "output_rows",
    "per_example_entries",
    "per_example_layer_grads",
    "rule_for",
    "squared_grad_sums",
    "supported_layer",
    "trainable_names",
]

DEFAULT_MEMORY_BUDGET = 2 * 1024**3
"""Default working-memory budget in bytes (2 GiB) from which chunk sizes are derived."""

BATCH_NORM: tuple[type[nn.Module], ...] = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
"""The batch-norm layers with a rule (in eval mode, with running statistics)."""


def is_batch_norm(m: nn.Module) -> bool:
    """Whether ``m`` is a batch-norm layer of any kind (:data:`BATCH_NORM`, ``SyncBatchNorm``,
    the lazy ones): in training mode it normalises with the batch's statistics, which couple
    the examples, so per-example passes run it in eval mode."""
    return isinstance(m, nn.modules.batchnorm._BatchNorm)


def trainable_names(m: nn.Module) -> tuple[str, ...]:
    """The names of ``m``'s own trainable parameters (``requires_grad``), in registration
    order (``weight`` before ``bias``)."""
    return tuple(n for n, p in m._parameters.items() if p is not None and p.requires_grad)


# ------------------------------------------------------------------------------ the registry


class LayerRule:
    """The rule of one layer (bound to it: ``rule_for(m).per_example(a, g)``).

    Shapes: ``a [B, ...]`` the layer's input; ``g [B, *z.shape[1:]]`` an output gradient, or
    ``[K, B, ...]`` with leading column dimensions where a method says so. ``names``: the
    parameters to compute (None: :func:`trainable_names`)."""

    types: ClassVar[tuple[type[nn.Module], ...]] = ()
    outer: ClassVar[bool] = False
    """Whether the layer is an outer-product layer (``input_rows`` / ``output_rows``)."""

    def __init__(self, m: nn.Module) -> None:
        self.m = m

    def applies(self, *, assume_eval: bool = False) -> bool:
        """Whether the rule holds for this layer in its present mode (``assume_eval``: the
        caller runs the per-example pass in eval mode)."""
        return True

    @property
    def kfac(self) -> bool:
        """Whether the layer gets Kronecker factors (:mod:`fromp.curvature.kron`)."""
        return False

    @property
    def groups(self) -> int:
        """``G``: the groups of a grouped convolution (1 otherwise)."""
        return 1

    def names(self, names: Iterable[str] | None) -> tuple[str, ...]:
        return trainable_names(self.m) if names is None else tuple(names)

    def input_rows(self, a: Tensor) -> Tensor:
        """``u [B, L, J]``: the rows ``u_nl`` with ``z_nl = W u_nl + b``."""
        raise ValueError(f"{type(self.m).__name__} is not an outer-product layer (no input rows)")

    def output_rows(self, g: Tensor) -> Tensor:
        """``[B, L, O]``: an output gradient ``g [B, ...]`` as the rows ``g_nl``."""
        raise ValueError(f"{type(self.m).__name__} is not an outer-product layer (no output rows)")

    def per_example(
        self, a: Tensor, g: Tensor, names: Iterable[str] | None = None
    ) -> dict[str, Tensor]:
        """``{name: [*lead, B, *param.shape]}``: per-example gradients; ``g`` may carry
        leading column dimensions ``[*lead, B, ...]``."""
        raise NotImplementedError

    def squared_sums(
        self,
        a: Tensor,
        gs: Tensor,
        names: Iterable[str] | None = None,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
    ) -> dict[str, Tensor]:
        """``{name: sum_{k, n} (per-example gradient)^2}`` for ``gs [K, B, ...]``: by default
        from per-example gradients of ``(k, n)`` pairs in sub-chunks that hold at most
        ``memory_budget`` bytes."""
        names = self.names(names)
        n_k, bsz = gs.shape[:2]
        p_layer = sum(getattr(self.m, n).numel() for n in names)
        step = max(1, int(memory_budget // (3 * max(1, p_layer) * gs.element_size())))
        acc: dict[str, Tensor] = {}
        flat_g = gs.reshape(n_k * bsz, *gs.shape[2:])
        for s in range(0, n_k * bsz, step):
            idx = torch.arange(s, min(s + step, n_k * bsz), device=gs.device)
            for name, t in self.per_example(a[idx % bsz], flat_g[idx], names).items():
                sq = t.pow(2).sum(0)
                acc[name] = sq if name not in acc else acc[name] + sq
        return acc

    def entries(self, a: Tensor, g: Tensor, attr: str, local: Tensor) -> Tensor:
        """``[B, k]``: per-example gradients of the entries ``local`` ``[k]`` (flat offsets)
        of parameter ``attr``, for ``g [B, ...]``."""
        return self.per_example(a, g, (attr,))[attr].reshape(len(a), -1)[:, local]


class LinearRule(LayerRule):
    """``nn.Linear`` on ``[B, ..., in]``: every leading position ``t`` is a row, ``u_nt =
    a_nt``, ``g_nt``; per-example gradients ``sum_t g_nt a_nt^T`` and ``sum_t g_nt``."""

    types = (nn.Linear,)
    outer = True

    @property
    def kfac(self) -> bool:
        return True

    def input_rows(self, a: Tensor) -> Tensor:
        return a.reshape(a.shape[0], -1, a.shape[-1])

    def output_rows(self, g: Tensor) -> Tensor:
        return g.reshape(g.shape[0], -1, g.shape[-1])

    def per_example(self, a, g, names=None):
        names = self.names(names)
        bsz = a.shape[0]
        a3 = self.input_rows(a)
        lead = g.shape[: g.ndim - a.ndim]
        out: dict[str, Tensor] = {}
        if not lead:
            g3 = self.output_rows(g)
            if "weight" in names:
                out["weight"] = torch.bmm(g3.transpose(1, 2), a3)
            if "bias" in names:
                out["bias"] = g3.sum(1)
            return out
        g4 = g.reshape(-1, bsz, a3.shape[1], g.shape[-1])  # K, B, T, O
        if "weight" in names:
            w = torch.einsum("knto,nti->knoi", g4, a3)
            out["weight"] = w.reshape(*lead, bsz, *self.m.weight.shape)
        if "bias" in names:
            out["bias"] = g4.sum(2).reshape(*lead, bsz, g.shape[-1])
        return out

    def squared_sums(self, a, gs, names=None, memory_budget=DEFAULT_MEMORY_BUDGET):
        if a.ndim != 2:  # a sequence: per-example gradients, sub-chunked
            return super().squared_sums(a, gs, names, memory_budget)
        names = self.names(names)
        g2 = gs.pow(2).sum(0)  # B, out
        out: dict[str, Tensor] = {}
        if "weight" in names:
            out["weight"] = g2.T @ a.pow(2)
        if "bias" in names:
            out["bias"] = g2.sum(0)
        return out

    def entries(self, a, g, attr, local):
        """A weight entry ``(o, i)`` is ``sum_t g[t, o] a[t, i]`` over the positions ``t``."""
        if attr != "weight":
            return super().entries(a, g, attr, local)
        width = self.m.weight.shape[1]
        o, i = local // width, local % width
        a3, g3 = self.input_rows(a), self.output_rows(g)
        return (g3[:, :, o] * a3[:, :, i]).sum(1)


class ConvRule(LayerRule):
    """``nn.Conv1d`` / ``nn.Conv2d`` (``Conv1d`` as a 2-d convolution of height 1): the rows
    ``u_nl`` are the unfolded patches of the explicitly padded input (any padding mode),
    channel-major then kernel position, as the flattened kernel ``W [O, C_in/G k_h k_w]``."""

    types = (nn.Conv1d, nn.Conv2d)
    outer = True

    @property
    def kfac(self) -> bool:
        return type(self.m) is nn.Conv2d and self.m.groups == 1

    @property
    def groups(self) -> int:
        return self.m.groups

    def geometry(self, a: Tensor, g: Tensor | None = None) -> tuple[Tensor, Tensor | None, dict]:
        """``a`` padded explicitly, ``a`` and ``g`` as 2-d convolutions' (``Conv1d``: height
        1), and the kernel, stride and dilation to use."""
        m = self.m
        mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
        pad = m._reversed_padding_repeated_twice
        if any(pad):
            a = F.pad(a, pad, mode=mode)
        if isinstance(m, nn.Conv1d):
            a = a.unsqueeze(-2)
            g = None if g is None else g.unsqueeze(-2)
            geo = {"kernel": (1, *m.kernel_size), "stride": (1, *m.stride), "dil": (1, *m.dilation)}
        else:
            geo = {"kernel": tuple(m.kernel_size), "stride": tuple(m.stride), "dil": m.dilation}
        return a, g, geo

    def unfold(self, a: Tensor) -> Tensor:
        """``[B, J, L]``: the input's patches as columns (the one unfolding in fromp)."""
        ap, _, geo = self.geometry(a)
        return F.unfold(ap, geo["kernel"], dilation=geo["dil"], stride=geo["stride"])

    def input_rows(self, a: Tensor) -> Tensor:
        return self.unfold(a).transpose(1, 2)

    def output_rows(self, g: Tensor) -> Tensor:
        return g.flatten(2).transpose(1, 2)

    def per_example(self, a, g, names=None):
        names = self.names(names)
        lead = g.shape[: g.ndim - a.ndim]
        bsz, cout = a.shape[0], g.shape[len(lead) + 1]
        out: dict[str, Tensor] = {}
        if "weight" in names:
            if lead:  # the columns as more examples of the same inputs
                k = math.prod(lead)
                a_k = a.unsqueeze(0).expand(k, *a.shape).reshape(k * bsz, *a.shape[1:])
                w = self._per_example_weight(a_k, g.reshape(k * bsz, *g.shape[len(lead) + 1 :]))
                out["weight"] = w.view(*lead, bsz, *self.m.weight.shape)
            else:
                out["weight"] = self._per_example_weight(a, g)
        if "bias" in names:
            out["bias"] = g.reshape(*lead, bsz, cout, -1).sum(-1)
        return out

    def _per_example_weight(self, a: Tensor, g: Tensor) -> Tensor:
        """Per-example weight gradients ``[B, *weight.shape]`` from ``a [B, Cin, H, W]`` and
        ``g [B, Cout, Ho, Wo]``: stacking the batch along the channels turns the ``B``
        problems into one convolution with ``groups = B * groups`` whose weight gradient
        holds the per-example gradients."""
        m = self.m
        a, g, geo = self.geometry(a, g)
        assert g is not None
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

    def squared_sums(self, a, gs, names=None, memory_budget=DEFAULT_MEMORY_BUDGET):
        names = self.names(names)
        n_k, bsz = gs.shape[:2]
        out: dict[str, Tensor] = {}
        if "bias" in names:
            out["bias"] = gs.reshape(n_k, bsz, gs.shape[2], -1).sum(3).pow(2).sum((0, 1))
        if "weight" in names:
            if _gram_route(gs, n_k):
                out["weight"] = _conv_gram(self.m, a, gs)
            else:
                out["weight"] = _conv_squares(self.m, a, gs, memory_budget)
        return out

    def entries(self, a, g, attr, local):
        """A weight entry ``(o, c, r)`` is ``sum_l g[o, l] U[c r, l]`` over the output
        positions ``l`` of the unfolded input ``U`` (``c`` counted in ``o``'s group)."""
        if attr != "weight":
            return super().entries(a, g, attr, local)
        m, w = self.m, self.m.weight
        bsz = a.shape[0]
        cols = self.unfold(a)  # B, Cin kk, L
        cout, cpg = w.shape[0], w.shape[1]
        kk = math.prod(w.shape[2:])
        o, rest = local // (cpg * kk), local % (cpg * kk)
        channel = (o // (cout // m.groups)) * cpg + rest // kk  # the input channel
        rows = channel * kk + rest % kk  # unfold's rows: channel-major, then the kernel
        gl = g.reshape(bsz, cout, -1)  # [B, Cout, L]
        return (gl[:, o, :] * cols[:, rows, :]).sum(-1)


class NormRule(LayerRule):
    """The affine map ``xhat * w + b`` of a norm layer: ``BatchNorm1d/2d/3d`` with running
    statistics in eval mode, ``LayerNorm``, ``GroupNorm``."""

    types = (*BATCH_NORM, nn.LayerNorm, nn.GroupNorm)

    def applies(self, *, assume_eval: bool = False) -> bool:
        m = self.m
        if type(m) in BATCH_NORM:
            stats = m.running_mean is not None and m.running_var is not None
            return stats and (assume_eval or not m.training)
        return True

    def xhat(self, a: Tensor) -> Tensor:
        """The normalised input (the layer's output before the affine map)."""
        m = self.m
        if isinstance(m, nn.LayerNorm):
            return F.layer_norm(a, m.normalized_shape, None, None, m.eps)
        if isinstance(m, nn.GroupNorm):
            return F.group_norm(a, m.num_groups, None, None, m.eps)
        return F.batch_norm(a, m.running_mean, m.running_var, None, None, False, 0.0, m.eps)

    def per_example(self, a, g, names=None):
        names = self.names(names)
        m = self.m
        if isinstance(m, nn.LayerNorm):
            k = len(m.normalized_shape)
            lead = g.ndim - a.ndim + 1  # column dims + batch
            dims = tuple(range(lead, g.ndim - k))
        else:  # channel dimension right after the batch
            lead = g.ndim - a.ndim + 2
            dims = tuple(range(lead, g.ndim))
        out: dict[str, Tensor] = {}
        if "weight" in names:
            prod = g * self.xhat(a)
            out["weight"] = prod.sum(dims) if dims else prod
        if "bias" in names:
            out["bias"] = g.sum(dims) if dims else g
        return out

    def squared_sums(self, a, gs, names=None, memory_budget=DEFAULT_MEMORY_BUDGET):
        return {n: t.pow(2).sum((0, 1)) for n, t in self.per_example(a, gs, names).items()}


_RULES: dict[type[nn.Module], type[LayerRule]] = {
    t: rule for rule in (LinearRule, ConvRule, NormRule) for t in rule.types
}


def rule_for(m: nn.Module) -> LayerRule:
    """The rule of layer ``m`` (exact type), bound to it; ``ValueError`` naming the type when
    it has none."""
    rule = _RULES.get(type(m))
    if rule is None:
        raise ValueError(
            f"{type(m).__name__} has no layer rule (rules: Linear, Conv1d, Conv2d, "
            "BatchNorm1d/2d/3d in eval mode, LayerNorm, GroupNorm); its parameters need "
            "per-example Jacobians"
        )
    return rule(m)


def supported_layer(m: nn.Module, *, assume_eval: bool = False) -> bool:
    """Whether ``m``'s own parameters can be handled from its input and output gradient: a
    layer of :func:`rule_for`'s types, batch norm with running statistics and in eval mode
    (or ``assume_eval``: the caller runs it in eval mode)."""
    rule = _RULES.get(type(m))
    return rule is not None and rule(m).applies(assume_eval=assume_eval)


def per_example_layer_grads(
    m: nn.Module, a: Tensor, g: Tensor, names: Iterable[str] | None = None
) -> dict[str, Tensor]:
    """``{param name: [*lead, B, *param.shape]}``: per-example gradients of one layer call
    from its input ``a [B, ...]`` and output gradient ``g [*lead, B, ...]``
    (:meth:`LayerRule.per_example`)."""
    return rule_for(m).per_example(a, g, names)


def per_example_entries(m: nn.Module, a: Tensor, g: Tensor, attr: str, local: Tensor) -> Tensor:
    """``[B, k]``: per-example gradients of the entries ``local`` ``[k]`` (flat offsets into
    ``m.<attr>``) of one layer call, read directly where the rule can (a ``Linear`` or
    convolution weight entry) without the layer's whole per-example gradient
    (:meth:`LayerRule.entries`)."""
    return rule_for(m).entries(a, g, attr, local)


def input_rows(m: nn.Module, a: Tensor) -> Tensor:
    """``u [B, L, J]``: the input rows of an outer-product layer (:meth:`LayerRule.input_rows`:
    a ``Linear``'s positions, a convolution's unfolded patches)."""
    return rule_for(m).input_rows(a)


def output_rows(m: nn.Module, g: Tensor) -> Tensor:
    """``[B, L, O]``: an output gradient ``g [B, ...]`` of an outer-product layer as rows."""
    return rule_for(m).output_rows(g)


def squared_grad_sums(
    m: nn.Module,
    a: Tensor,
    gs: Tensor,
    *,
    names: Iterable[str] | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> dict[str, Tensor]:
    """``{param name: sum_{k, n} (d(v_{nk}^T f_n)/d theta)^2}`` of one layer call.

    Args:
        m: a layer with a rule (:func:`rule_for`).
        a: its input ``[B, ...]`` for the chunk.
        gs: output gradients for ``K`` columns, ``[K, B, *z.shape[1:]]``.
        names: the parameters to compute (None: the layer's trainable ones).
        memory_budget: bytes allowed for per-example gradients formed at once (they are
            formed, for convolutions with many output positions and sequence linear layers,
            in sub-chunks of ``(k, n)`` pairs).

    Returns:
        Tensors shaped like the parameters (summed over ``K`` and ``B``).
    """
    return rule_for(m).squared_sums(a, gs, names, memory_budget)


# ---------------------------------------------------------------- convolutions' squared sums


def _gram_route(gs: Tensor, k: int) -> bool:
    """Whether the ``L^2`` Gram contraction of a convolution is cheaper than forming its
    per-example gradients for ``k`` columns (``L`` output positions of ``g [K, B, Cout,
    *spatial]``): ``L^2 <= k (L + 1)``."""
    positions = math.prod(gs.shape[3:])
    return positions * positions <= k * (positions + 1)


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
    examples (:meth:`ConvRule._per_example_weight`); sub-chunks hold at most
    ``memory_budget`` bytes."""
    n_k, bsz = gs.shape[:2]
    rule = ConvRule(m)
    step = max(1, int(memory_budget // (2 * m.weight.numel() * gs.element_size())))
    acc = torch.zeros_like(m.weight, dtype=gs.dtype)
    for k in range(n_k):
        for s in range(0, bsz, step):
            acc += rule._per_example_weight(a[s : s + step], gs[k, s : s + step]).pow_(2).sum(0)
    return acc


def _conv_unfold_squares(m: nn.Module, a: Tensor, gs: Tensor, memory_budget: int) -> Tensor:
    """``sum_{k,n} (per-example weight gradient)^2`` of a convolution with per-example
    gradients ``g_{kn} u_n^T`` formed by one batched GEMM per sub-chunk of examples
    (``[K Cout/G, L] @ [L, Cin/G kk]`` per example and group, the ``K`` columns stacked so
    that the unfolded input ``u_n`` is shared), squared and summed; sub-chunks hold at most
    ``memory_budget`` bytes of gradients."""
    n_k, bsz = gs.shape[:2]
    u = ConvRule(m).unfold(a)  # B, Cin kk, L
    grp, pos = m.groups, u.shape[-1]
    u = u.reshape(bsz * grp, -1, pos).transpose(1, 2)  # B G, L, J
    g = gs.reshape(n_k, bsz, grp, -1, pos).permute(1, 2, 0, 3, 4)  # B, G, K, O, L
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
    u = ConvRule(m).unfold(a)  # B, Cin kk, L
    grp = m.groups
    pos = u.shape[-1]
    u = u.reshape(bsz, grp, -1, pos)  # B, G, J, L
    g = gs.reshape(n_k, bsz, grp, -1, pos)  # K, B, G, O, L
    gg = torch.einsum("kngol,kngom->ngolm", g, g)  # B, G, O, L, L
    uu = torch.einsum("ngjl,ngjm->ngjlm", u, u)  # B, G, J, L, L
    w = torch.einsum("ngolm,ngjlm->goj", gg, uu)
    return w.reshape(m.weight.shape)
