r"""Structured DNN2GP kernel blocks ``J(x) Sigma J(x')^T`` for a diagonal ``Sigma`` from the
layer structure of the Jacobian (:class:`_CaptureStructure`), used by :class:`fromp.gp.GP`.

Each layer captured by :mod:`fromp.curvature.capture` (its input ``a`` and the output gradients
``g_c = df_c / dz`` of one forward and ``C`` backward passes per chunk) contributes to the
kernel without per-example Jacobians of the whole network: outer-product layers through
``sum_o g_co(x) g_do(x') [sum_j s_oj u_j(x) u_j(x')]``, those with several positions
(convolutions, a ``Linear`` on sequences) through whitened Jacobian columns per block of
output channels and one Gram GEMM, other layers through their own small per-example
Jacobians; the rows ``u`` and ``g`` and the per-example gradients are the layer's rule's
(:mod:`fromp.curvature.layer_rules`). :class:`_Gram` accumulates the blocks,
:class:`_Marginal` the per-example ``[C, C]`` variances.
"""

from __future__ import annotations

import itertools
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev

from fromp._checks import check_model_output
from fromp.curvature.capture import LayerCall, LayerMap, capture_calls
from fromp.curvature.jacobian import flatten_leading, over_examples, unflatten
from fromp.curvature.layer_rules import per_example_layer_grads, rule_for, supported_layer

__all__: list[str] = []


class _GPView(Protocol):
    """What the structured kernel reads of its :class:`fromp.gp.process.GP` (a protocol, so
    that this module does not import the GP's: no import circle, type-only included)."""

    model: nn.Module
    posterior: Any
    memory_budget: int
    _dtype: torch.dtype
    _device: torch.device
    _buffers: Any


class _NotStructured(Exception):
    """The model does not have the layer structure the structured kernel needs."""


def _nbytes(obj: Any) -> int:
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict | tuple | list):
        items = obj.values() if isinstance(obj, dict) else obj
        return sum(_nbytes(o) for o in items)
    return 0


class _CaptureStructure:
    """Kernel blocks ``J(x) Sigma J(x')^T`` (diagonal ``Sigma``) from the layer structure of
    the Jacobian, after Novak et al. (2022), "Fast finite width neural tangent kernel": for a
    layer captured by :mod:`fromp.curvature.capture` with input ``a`` and output gradients
    ``g_c = df_c / dz`` (one forward pass and ``C`` backward passes per chunk),

    * *outer* layers (``Linear`` on ``[N, in]`` inputs, convolutions with one output position,
      ``u`` the layer's input rows): ``J_c = g_c u^T``, so their kernel term is
      ``sum_o g_co(x) g_do(x') [sum_j s_oj u_j(x) u_j(x') + s^b_o]``: one ``[n m, J] @ [J, O]``
      product per block, independent of ``C``;
    * outer-product layers with ``L > 1`` positions (convolutions, ``Linear`` on sequences):
      whitened Jacobian columns of a block of output channels at a time, ``[C o, L] @ [L,
      J]`` per example, then one Gram GEMM per block (:func:`_positions_into`); input
      columns that are zero for every example dropped;
    * *dense* layers (norm layers, and a layer whose weight is frozen): the layer's
      per-example Jacobians ``[n, C, P_layer]`` (small) and their Gram product;
    * parameters of other layers: per-example Jacobians (``vmap(jacrev)``) of those alone.

    Features per example are ``O(C * activations)`` numbers instead of ``C * P``."""

    def __init__(self, gp: _GPView) -> None:
        self.gp = gp
        model = gp.model
        var = unflatten(model, gp.posterior.variance.detach().to(gp._dtype))
        layer_map = LayerMap.of(model)
        self.layers: dict[str, nn.Module] = {}
        self.var: dict[str, dict[str, Tensor]] = {}
        self.std: dict[str, dict[str, Tensor]] = {}
        captured: set[str] = set()
        own_params = layer_map.layers()
        for mod in layer_map.exclusive_layers(supported_layer):
            mname = layer_map.module_names[mod]
            self.layers[mname] = mod
            self.var[mname] = {pn: var[name] for name, pn in own_params[mod]}
            self.std[mname] = {pn: v.sqrt() for pn, v in self.var[mname].items()}
            captured.update(name for name, _ in own_params[mod])
        if not self.layers:
            raise _NotStructured("the model has no layer with a capture rule")
        self.other = [n for n in gp._params if n not in captured]
        std = unflatten(model, gp.posterior.std.detach().to(gp._dtype))
        self.other_std = torch.cat([std[n].reshape(-1) for n in self.other]) if self.other else None
        self._name_of = {id(m): k for k, m in self.layers.items()}

    def features(self, x: Tensor, rows: slice) -> tuple[dict[str, tuple], Any, int, int]:
        """``({layer: (kind, u or a, g [C, n, ...])}, A_other [n, C, P_other] or None, n,
        C)``:
        one forward pass and one batched backward pass of the ``C`` outputs per chunk."""
        gp = self.gp
        xr = x[rows]
        n = len(xr)
        params = {k: v.detach().requires_grad_(True) for k, v in gp._params.items()}
        with torch.enable_grad(), capture_calls(list(self.layers.values())) as calls:
            out = check_model_output(functional_call(gp.model, (params, gp._buffers), (xr,)))
        seen: dict[str, LayerCall] = {}
        for call in calls:
            name = self._name_of[id(call.module)]
            if name in seen:
                raise _NotStructured(f"layer {name!r} is called more than once per forward")
            seen[name] = call
        # layers never called (other task heads) contribute nothing; the one-example check
        # against the Jacobian way catches parameters used outside their layer's forward
        c = out.shape[1]
        basis = torch.eye(c, dtype=gp._dtype, device=gp._device)[:, None, :].expand(c, n, c)
        zs = [call.z for call in seen.values()]
        grads = torch.autograd.grad(
            out, zs, grad_outputs=basis, is_grads_batched=True, allow_unused=True
        )  # each [C, n, ...]
        feats = {}
        for (name, call), g in zip(seen.items(), grads):
            if g is None:  # a layer that does not reach the outputs
                g = torch.zeros(c, *call.z.shape, dtype=gp._dtype, device=gp._device)
            feats[name] = _layer_features(call.module, call.a, g.detach(), self.var[name])
        a_other = None
        if self.other:
            other = {k: gp._params[k] for k in self.other}

            def single(p: dict[str, Tensor], xi: Tensor) -> Tensor:
                full = {**gp._params, **p}
                return functional_call(gp.model, (full, gp._buffers), (xi.unsqueeze(0),))[0]

            jac = over_examples(jacrev(single), (None, 0))(other, xr)
            a_other = flatten_leading(jac, 2).detach() * self.other_std
        return feats, a_other, n, c

    def block(
        self, f1: tuple, f2: tuple, diagonal_outputs: bool, budget: int | None = None
    ) -> Tensor:
        """Kernel block ``[C, n, m]`` (per-output) or ``[n, C, m, C]`` between two feature
        sets, accumulated layer by layer into one output (:class:`_Gram`); ``budget`` bytes
        (default half the GP's ``memory_budget``) bound each layer's temporaries."""
        (lay1, o1, n1, c), (lay2, o2, n2, _) = f1, f2
        same = f1 is f2
        budget = self.gp.memory_budget // 2 if budget is None else budget
        acc = _Gram(c, n1, n2, diagonal_outputs, same, self.gp._dtype, self.gp._device)
        contributed = o1 is not None
        if o1 is not None:
            acc.add_rows(o1, o1 if same else o2)
        for name, ft1 in lay1.items():
            ft2 = lay2.get(name)
            if ft2 is None:
                continue
            contributed = True
            m = self.layers[name]
            if ft1[0] == "outer":
                _outer_into(acc, ft1, ft1 if same else ft2, self.var[name], budget)
            elif ft1[0] == "positions":
                _positions_into(acc, m, ft1, ft1 if same else ft2, self.std[name], budget)
            else:
                j1 = _dense_jacobian(m, ft1, self.std[name])
                acc.add_rows(j1, j1 if same else _dense_jacobian(m, ft2, self.std[name]))
        if not contributed:
            raise _NotStructured("no layer contributes")
        return acc.result()

    def marginal(self, f: tuple, budget: int | None = None) -> Tensor:
        """Per-example blocks ``J(x_i) Sigma J(x_i)^T`` ``[n, C, C]`` of one feature set
        (the diagonal of :meth:`block` without the ``n x n`` products): outer-product layers
        by ``sum_o g_co g_do [sum_j s_oj u_j^2 + s^b_o]``, convolutions by the Gram products
        of their whitened columns per example, dense layers and other parameters by their
        per-example Jacobians."""
        lay, o, n, c = f
        budget = self.gp.memory_budget // 2 if budget is None else budget
        acc = _Marginal(n, c, self.gp._dtype, self.gp._device)
        contributed = o is not None
        if o is not None:
            acc.add_rows(o, o)
        for name, ft in lay.items():
            contributed = True
            m = self.layers[name]
            if ft[0] == "outer":
                _, u, g = ft
                grp, jg = u.shape[1:]
                sw = self.var[name]["weight"].reshape(grp, -1, jg)
                t = torch.einsum("ngj,goj->ngo", u * u, sw).reshape(n, -1)  # n, O
                if "bias" in self.var[name]:
                    t = t + self.var[name]["bias"]
                acc.out += torch.einsum("cno,no,dno->ncd", g, t, g)
            elif ft[0] == "positions":
                _positions_into(acc, m, ft, ft, self.std[name], budget)
            else:
                j = _dense_jacobian(m, ft, self.std[name])
                acc.add_rows(j, j)
        if not contributed:
            raise _NotStructured("no layer contributes")
        return acc.out

    def example_chunk(self, bytes_per_example: int) -> int:
        """Examples per feature chunk: a third of the memory budget for the chunk's features
        (the backward pass that produces them needs about as much again)."""
        return max(1, self.gp.memory_budget // (3 * max(1, bytes_per_example)))


_GRAM_MIN_ROWS = 128
"""Rows per example range of a symmetric :class:`_Gram` block, at least."""


class _Gram:
    """Accumulator of a kernel block ``sum_layers A1 A2^T``.

    The block is stored as ``[C, n, m]`` (``diagonal_outputs``) or ``[n C, m C]`` (rows
    ordered example-major, viewed as ``[n, C, m, C]``). For a symmetric block (both feature
    sets the same) the examples are split into up to four ranges and only the upper
    range pairs are computed (5/8 of the products for four ranges); :meth:`result` mirrors
    the rest."""

    def __init__(
        self, c: int, n: int, m: int, diag: bool, same: bool, dtype: torch.dtype, device
    ) -> None:
        self.c, self.n, self.m, self.diag, self.same = c, n, m, diag, same
        shape = (c, n, m) if diag else (n * c, m * c)
        self.out = torch.zeros(shape, dtype=dtype, device=device)
        nb = max(1, min(4, (n if diag else n * c) // _GRAM_MIN_ROWS)) if same else 1
        cuts = [round(i * n / nb) for i in range(nb + 1)]
        self.ranges = [slice(a, b) for a, b in itertools.pairwise(cuts) if b > a]

    def pairs(self) -> list[tuple[slice, slice]]:
        """Example ranges ``(rows, cols)`` to compute."""
        if not self.same:
            return [(slice(0, self.n), slice(0, self.m))]
        return [(r, q) for i, r in enumerate(self.ranges) for q in self.ranges[i:]]

    def view4(self) -> Tensor:
        """The block as ``[C, n, m]`` or ``[n, C, m, C]`` (a view)."""
        return self.out if self.diag else self.out.view(self.n, self.c, self.m, self.c)

    def add_rows(self, j1: Tensor, j2: Tensor) -> None:
        """Add ``A1 A2^T`` for per-example rows ``j1 [n, C, k]``, ``j2 [m, C, k]`` (``j2 is
        j1`` for a symmetric block)."""
        if self.diag:
            a1 = j1.transpose(0, 1).contiguous()  # C, n, k
            a2 = a1 if j2 is j1 else j2.transpose(0, 1).contiguous()
        else:
            a1 = j1.reshape(-1, j1.shape[-1])
            a2 = a1 if j2 is j1 else j2.reshape(-1, j2.shape[-1])
        self.add(a1, a2)

    def add(self, a1: Tensor, a2: Tensor) -> None:
        """Add ``A1 A2^T`` for ``a [C, n, k]`` (per-output) or ``[n C, k]`` (rows
        example-major), one GEMM per range pair into the output in place."""
        c = self.c
        if self.diag:
            for r, q in self.pairs():
                self.out[:, r, q].baddbmm_(a1[:, r], a2[:, q].transpose(1, 2))
        else:
            for r, q in self.pairs():
                rr, qq = slice(r.start * c, r.stop * c), slice(q.start * c, q.stop * c)
                self.out[rr, qq].addmm_(a1[rr], a2[qq].T)

    def result(self) -> Tensor:
        """The block (lower range pairs mirrored from the upper ones when symmetric)."""
        out = self.view4()
        if self.same:
            for i, r in enumerate(self.ranges):
                for q in self.ranges[i + 1 :]:
                    if self.diag:
                        out[:, q, r] = out[:, r, q].transpose(1, 2)
                    else:
                        out[q, :, r, :] = out[r, :, q, :].permute(2, 3, 0, 1)
        return out


class _Marginal:
    """Accumulator of per-example blocks ``sum_layers A_i A_i^T`` ``[n, C, C]``, with the
    interface of :class:`_Gram` that :func:`_positions_into` uses (rows example-major)."""

    diag = False
    same = True

    def __init__(self, n: int, c: int, dtype: torch.dtype, device) -> None:
        self.n, self.c = n, c
        self.out = torch.zeros(n, c, c, dtype=dtype, device=device)

    def add_rows(self, j1: Tensor, j2: Tensor) -> None:
        """Add ``A_i A_i^T`` for per-example rows ``j [n, C, k]`` (``j2`` is ``j1``)."""
        self.out.baddbmm_(j1, j1.transpose(1, 2))

    def add(self, a1: Tensor, a2: Tensor) -> None:
        """Add ``A_i A_i^T`` for rows ``a [n C, k]`` (example-major)."""
        a = a1.view(self.n, self.c, -1)
        self.out.baddbmm_(a, a.transpose(1, 2))


def _nonzero_columns(u1: Tensor, u2: Tensor) -> Tensor | None:
    """Indices of the last-dimension columns that are nonzero somewhere in both ``u1`` and
    ``u2`` (None when all are): a column that is zero for every example and position of
    either side (a kernel tap that only ever sees zero padding, a dead channel) contributes
    exactly zero to the kernel and is dropped."""
    k = u1.shape[-1]
    nz = u1.reshape(-1, k).ne(0).any(0)
    if u2 is not u1:
        nz = nz & u2.reshape(-1, k).ne(0).any(0)
    if bool(nz.all()):
        return None
    return nz.nonzero().squeeze(1)


_OUTER_STEP_BYTES = 1 << 25
"""Temporaries of one row step of :func:`_outer_into`, at most (32 MiB: larger steps are
no fewer flops but slower, memory-bound on fresh allocations)."""

_OUTER_ROWS = 256
"""Product rows (``x1`` rows times ``x2`` rows) of one row step of :func:`_outer_into` on a
CPU, at least: steps of one or a few ``x1`` rows leave few columns nonzero in the step's rows
(see :data:`_SPARSE_KEEP`)."""

_SPARSE_KEEP = 0.75
"""A row step of :func:`_outer_into` drops the input columns that are zero in all of its
``x1`` rows or in all of ``x2`` when fewer than this share of the columns is left."""


def _outer_into(acc: _Gram, ft1: tuple, ft2: tuple, var: dict[str, Tensor], budget: int) -> None:
    """Add ``sum_o g1_co g2_do [sum_j s_oj u1_j u2_j + s^b_o]`` of an outer-product layer
    (``u [n, G, J/G]``, ``g [C, n, O]``, ``s`` the weight variances ``[O, J/G]``).

    The inner sums ``t [n, m, O]`` are ``[n m, J] @ [J, O]`` products (independent of ``C``;
    ``N1 N2 P_layer`` multiply-adds), then contracted with ``g``. Rows of ``x1`` are taken a
    few at a time (about :data:`_OUTER_ROWS` product rows per step on a CPU; temporaries
    within ``budget`` bytes and 32 MiB, :data:`_OUTER_STEP_BYTES`), and a step keeps only
    the columns ``j`` that are nonzero in one of its ``x1`` rows and one ``x2`` row: the
    others add exactly zero. For sparse inputs this cuts the products by the sparsity (an
    MNIST image has about 150 nonzero pixels of 784, a ReLU layer about half its units);
    the selection costs one host synchronisation per step, so on a GPU steps are as large
    as the memory allows and only columns zero for whole chunks are dropped."""
    _, u1, g1 = ft1
    _, u2, g2 = ft2
    same = ft2 is ft1
    grp, jg = u1.shape[1:]
    c, _, o = g1.shape
    sw = var["weight"].reshape(grp, o // grp, jg)
    idx = _nonzero_columns(u1, u2)
    if idx is not None:
        u1, sw = u1.index_select(2, idx), sw.index_select(2, idx)
        u2 = u1 if same else u2.index_select(2, idx)
    jk = u1.shape[2]
    sb = var.get("bias")
    out = acc.view4()
    elt = u1.element_size()
    g2t = None if acc.diag else g2.permute(1, 0, 2).contiguous()  # m, C, O
    sparse = u1.device.type == "cpu" and jk > 1
    if sparse:
        nz1 = u1.ne(0).any(1)  # n, J: column j of example n is nonzero in some group
        nz2 = nz1 if same else u2.ne(0).any(1)
    if grp == 1:  # columns as rows: selecting them gathers whole rows
        swt = sw[0].T.contiguous()  # J, O
    for r, q in acc.pairs():
        mc = q.stop - q.start
        per_row = mc * (grp * jk + o + c * o) * elt * 2  # product, t, z
        step = max(1, min(budget, _OUTER_STEP_BYTES) // max(1, per_row))
        if sparse:
            step = min(step, -(-_OUTER_ROWS // mc))
            any2 = nz2[q].any(0)
        if grp == 1:
            u2qt = u2[q, 0].T.contiguous()  # J, mc
        for s in range(r.start, r.stop, step):
            rr = slice(s, min(s + step, r.stop))
            ri = rr.stop - rr.start
            cols = None
            if sparse:
                keep = nz1[rr].any(0) & any2
                if int(keep.sum()) < _SPARSE_KEEP * jk:
                    cols = keep.nonzero().squeeze(1)
            if grp == 1:
                # t[r, m, o] = sum_j u2[m, j] (u1[r, j] s[o, j]): one [mc, k] @ [k, ri O]
                a, bt, wt = u1[rr, 0], u2qt, swt
                if cols is not None:
                    a = a.index_select(1, cols)
                    bt, wt = bt.index_select(0, cols), wt.index_select(0, cols)
                w = (a.T[:, :, None] * wt[:, None, :]).reshape(-1, ri * o)  # k, ri O
                t = (bt.T @ w).view(mc, ri, o).transpose(0, 1)  # ri, mc, O
                del w
            else:
                a, b, sws = u1[rr], u2[q], sw
                if cols is not None:
                    a, b = a.index_select(2, cols), b.index_select(2, cols)
                    sws = sws.index_select(2, cols)
                prod = (a[:, None] * b[None]).reshape(ri * mc, grp, a.shape[2])
                t = torch.einsum("xgj,goj->xgo", prod, sws).reshape(ri, mc, o)
                del prod
            if sb is not None:
                t = t + sb
            if acc.diag:
                z = t.unsqueeze(0) * g2[:, None, q, :]  # C, ri, mc, O
                out[:, rr, q] += torch.matmul(z, g1[:, rr, :, None]).squeeze(-1)
            else:
                z = t.unsqueeze(2) * g2t[None, q]  # ri, mc, C, O
                res = torch.bmm(g1[:, rr].transpose(0, 1), z.reshape(ri, mc * c, o).transpose(1, 2))
                out[rr, :, q, :] += res.view(ri, c, mc, c)


def _positions_into(
    acc: _Gram | _Marginal,
    m: nn.Module,
    ft1: tuple,
    ft2: tuple,
    std: dict[str, Tensor],
    budget: int,
) -> None:
    """Add ``A1 A2^T`` of an outer-product layer with ``L > 1`` positions (a convolution, a
    ``Linear`` on sequences), ``A`` its whitened per-example Jacobians ``sum_l g_l u_l^T``,
    formed from ``u [n G, L, J/G]`` and ``g [n G, C O/G, L]`` by one
    batched ``[C o, L] @ [L, J/G]`` product per example for a block of ``o`` output channels
    at a time (``o`` chosen so that the ``[n, C, o J/G]`` block of each side stays within
    ``budget`` bytes), never the whole ``[n, C, P_layer]``. Unfolded columns that are zero
    for all examples of either side are dropped (exact). Cost ``n m C P_layer``
    multiply-adds (``n m C^2 P_layer`` for the full block) plus ``(n + m) C L P_layer``
    to form ``A``."""
    _, u1, gg1, n, c = ft1
    _, u2, gg2, mm, _ = ft2
    grp = rule_for(m).groups
    pos, jg = u1.shape[1:]
    og = gg1.shape[1] // c
    sw = std["weight"].reshape(grp, og, jg)
    idx = _nonzero_columns(u1, u2)
    if idx is not None:
        u1, sw = u1.index_select(2, idx), sw.index_select(2, idx)
        u2 = u1 if ft2 is ft1 else u2.index_select(2, idx)
    jk = u1.shape[2]
    u1, u2 = u1.view(n, grp, pos, jk), u2.view(mm, grp, pos, jk)
    g1, g2 = gg1.view(n, grp, c, og, pos), gg2.view(mm, grp, c, og, pos)
    rows = (n if ft2 is ft1 else n + mm) * c
    oc = max(1, min(og, budget // max(1, 3 * rows * jk * u1.element_size())))

    # preallocated column blocks, reused: fresh multi-GB tensors per block cost page faults
    bufs = [torch.empty(k * c * oc * jk, dtype=u1.dtype, device=u1.device)
            for k in ((n,) if ft2 is ft1 else (n, mm))]  # fmt: skip

    def cols(buf: Tensor, u: Tensor, g: Tensor, gi: int, o0: int, o1: int) -> Tensor:
        """Whitened Jacobian columns of output channels ``o0:o1`` of group ``gi``:
        ``[C, k, o J]`` (per-output) or ``[k C, o J]``."""
        k, w = len(u), o1 - o0
        if acc.diag:
            a = buf[: c * k * w * jk].view(c, k, w, jk)
            for ci in range(c):
                torch.bmm(g[:, gi, ci, o0:o1], u[:, gi], out=a[ci])
        else:
            a = buf[: k * c * w * jk].view(k, c, w, jk)
            gs = g[:, gi, :, o0:o1].reshape(k, c * w, pos)
            torch.bmm(gs, u[:, gi], out=a.view(k, c * w, jk))
        a.mul_(sw[gi, o0:o1])
        return a.view(c, k, w * jk) if acc.diag else a.view(k * c, w * jk)

    for gi in range(grp):
        for o0 in range(0, og, oc):
            o1 = min(og, o0 + oc)
            a1 = cols(bufs[0], u1, g1, gi, o0, o1)
            acc.add(a1, a1 if ft2 is ft1 else cols(bufs[1], u2, g2, gi, o0, o1))
    del bufs
    if "bias" in std:
        b1 = g1.sum(-1).permute(0, 2, 1, 3).reshape(n, c, -1) * std["bias"]
        b2 = b1 if ft2 is ft1 else g2.sum(-1).permute(0, 2, 1, 3).reshape(mm, c, -1) * std["bias"]
        acc.add_rows(b1, b2)


def _layer_features(m: nn.Module, a: Tensor, g: Tensor, var: dict[str, Tensor]) -> tuple:
    """Compact per-example features of one captured layer call with output gradients ``g
    [C, n, ...]`` (see :class:`_CaptureStructure`; ``var``: the layer's trainable parameters'
    variances): an outer-product layer with a trainable weight gives ``("outer", u [n, G,
    J/G], g [C, n, O])`` at one position, ``("positions", u [n G, L, J/G], g [n G, C O/G,
    L], n, C)`` at ``L > 1`` (:meth:`~fromp.curvature.layer_rules.LayerRule.input_rows` and
    ``output_rows``); any other layer, or one whose weight is frozen, ``("dense", a, g)``."""
    rule = rule_for(m)
    if not (rule.outer and "weight" in var):
        return ("dense", a, g)
    c, n = g.shape[:2]
    u = rule.input_rows(a)  # n, L, J
    grp, pos = rule.groups, u.shape[1]
    if pos == 1:
        return ("outer", u.reshape(n, grp, -1), g.reshape(c, n, -1))
    u = u.transpose(1, 2).reshape(n * grp, -1, pos).transpose(1, 2)  # n G, L, J/G
    rows = rule.output_rows(g.reshape(c * n, *g.shape[2:]))  # C n, L, O
    gg = rows.view(c, n, pos, grp, -1).permute(1, 3, 0, 4, 2).reshape(n * grp, -1, pos)
    return ("positions", u, gg, n, c)


def _dense_jacobian(m: nn.Module, ft: tuple, std: dict[str, Tensor]) -> Tensor:
    """Whitened per-example Jacobians ``[n, C, P_layer]`` of one dense layer (its trainable
    parameters in ``named_parameters`` order of the layer) from its rule's per-example
    gradients."""
    _, a, g = ft
    c, n = g.shape[:2]
    parts = per_example_layer_grads(m, a, g, tuple(std))  # [C, n, *shape]
    order = [pn for pn, p in m.named_parameters(recurse=False) if pn in std]
    return torch.cat(
        [parts[pn].transpose(0, 1).reshape(n, c, -1) * std[pn].reshape(-1) for pn in order],
        dim=-1,
    )
