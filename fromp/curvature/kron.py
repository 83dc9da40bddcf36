r"""Kronecker-factored (KFAC) curvature of ``Linear`` and ``Conv2d`` layers, eigendecomposed.

For a layer ``z_l = W u_l + b`` (``Linear``: one position ``l``; ``Conv2d``: ``u_l`` the
unfolded input patch at output position ``l``, ``W`` the kernel as ``[out, in k k]``), the
GGN of its weight is ``sum_n sum_k vec(sum_l g_nkl u_nl^T) vec(...)^T`` with ``g_nkl`` the
output gradient of column ``k`` of the square root of the output Hessian
(``Lambda_n = L_n L_n^T``; one backward pass per column). KFAC (Martens & Grosse 2015; its
convolutional form "expand" of Grosse & Martens 2016, as in laplace-torch and curvlinops)
approximates it by

    ``G_W ~= B (x) A``,  ``A = (1/(N L)) sum_{n,l} u_nl u_nl^T`` ``[in', in']``,
    ``B = sum_{n,k,l} g_nkl g_nkl^T`` ``[out, out]``,

with ``L`` the number of positions (1 for a ``Linear`` layer on ``[N, in]``): the positions
are treated as extra examples, ``sum_{n,l} (g g^T) (x) (u u^T) ~= (N L) E[g g^T] (x) E[u u^T]``
(Grosse & Martens' ``Omega (x) Gamma`` with ``Gamma = (1/L) E[sum_l g g^T]``; curvlinops'
``KFACLinearOperator(kfac_approx="expand")``, laplace-torch's default). It is exact for one
example of a ``Linear`` layer, and for one example of a convolution whose input patches are
all equal and whose output reaches the loss through one position.

With the row-major ``vec`` of ``W`` (fromp's flattening: index ``o * in' + i``),
``(B (x) A)[(o,i),(o',i')] = B[o,o'] A[i,i']``. The bias is its own block,
``G_b = sum_{n,k} (sum_l g_nkl)(sum_l g_nkl)^T`` ``[out, out]``, which is exact
(laplace-torch keeps the bias as a separate factor too, but takes the weight's ``B`` for it:
the same for a ``Linear`` layer, the positions' cross terms dropped for a convolution).

The empirical-Fisher variant uses the gradient of the loss (one column, ``k = 1``:
``g_nl = d nll_n / d z_nl``) in place of the columns of ``L``.

A posterior precision ``G / T + delta`` of a weight block is handled through the
eigendecompositions ``A = Q_A diag(a) Q_A^T``, ``B = Q_B diag(b) Q_B^T``:
``log det = sum_{ij} log(b_i a_j / T + delta)``, and products with its inverse or inverse
square root are ``Q_B [(Q_B^T M Q_A) / (b a^T / T + delta)^{p}] Q_A^T`` on ``M [out, in']``;
nothing of size ``P x P`` is formed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from fromp._checks import check_model_output
from fromp.curvature.capture import LayerMap, capture_calls
from fromp.curvature.layer_rules import rule_for, squared_grad_sums, supported_layer
from fromp.likelihood import Likelihood
from fromp.models import uncompiled

__all__ = [
    "KronBlock",
    "KronCurvature",
    "kron_curvature",
    "kron_curvature_tasks",
    "kron_layers",
    "kron_split",
]


def kron_layers(model: nn.Module) -> list[nn.Module]:
    """The ``Linear`` / ``Conv2d`` layers holding ``model``'s trainable parameters, in
    ``named_parameters()`` order; refuses (``ValueError``) a model with trainable
    parameters elsewhere (:func:`kron_split` gives those diagonal blocks instead), a shared
    parameter, or a layer whose weight is frozen while its bias is not."""
    kron, diag = kron_split(model)
    if diag:
        m = diag[0]
        names = [n for n, p in m.named_parameters(recurse=False) if p.requires_grad]
        raise ValueError(
            f"KFAC covers nn.Linear and nn.Conv2d with groups=1 only; {type(m).__name__} has "
            f"trainable parameters {names} (kron_split gives them diagonal blocks)"
        )
    return kron


def kron_split(model: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """``(kron, diag)``: the ``Linear`` / ``Conv2d`` (``groups=1``) layers that get KFAC
    blocks, and the other layers with trainable parameters that :mod:`fromp.curvature.layer_rules`
    handles (batch norm in eval mode, ``LayerNorm``, ``GroupNorm``, grouped or 1-d
    convolutions), whose parameters get exact GGN-diagonal blocks; both in
    ``named_parameters()`` order. A shared parameter or a layer of another type is refused
    by name."""
    layer_map = LayerMap.of(model)
    for name in layer_map.named:
        if layer_map.shared(name):
            raise ValueError(
                f"hessian_structure='kron': parameter {name!r} is shared between layers "
                "(use hessian_structure='diag')"
            )
    kron, diag = [], []
    for m, plist in layer_map.layers().items():
        if supported_layer(m) and rule_for(m).kfac:
            if not m.weight.requires_grad:
                raise ValueError(
                    f"hessian_structure='kron': parameter {plist[0][0]!r} trains while its "
                    f"layer's weight is frozen (a frozen weight and a trainable bias); KFAC "
                    "needs the weight: freeze the bias too, or use hessian_structure='diag'"
                )
            kron.append(m)
        elif supported_layer(m):
            diag.append(m)
        else:
            raise ValueError(
                f"hessian_structure='kron' covers nn.Linear and nn.Conv2d (KFAC) and batch "
                f"norm, layer norm, group norm (diagonal); {type(m).__name__} has trainable "
                f"parameters {[pn for _, pn in plist]} (freeze them, or use "
                "hessian_structure='diag')"
            )
    if not kron:
        raise ValueError("model has no trainable nn.Linear or nn.Conv2d parameters")
    return kron, diag


@dataclass
class KronBlock:
    """One layer's factors: ``A [in', in']`` (the mean over the ``n`` examples that reached
    the layer and over the ``L`` positions of each), ``B [out, out]`` (the sum) for the
    weight, and ``B_bias [out, out]`` (None without a trainable bias). ``n`` None: every
    example of the curvature (older state)."""

    A: Tensor
    B: Tensor
    B_bias: Tensor | None
    n: int | None = None


@dataclass
class KronCurvature:
    """KFAC curvature of the layers of a model: one :class:`KronBlock` per layer, with the
    parameter tensors they cover (``names``, in ``named_parameters()`` order: weight, then
    bias) and the number of examples ``n`` seen."""

    blocks: list[KronBlock]
    names: list[list[str]]
    n: int = 0
    diag: dict[str, Tensor] = field(default_factory=dict)
    """GGN diagonals (shaped like the parameter) of the parameters outside the KFAC layers
    (batch norm, layer norm, ...), by parameter name."""

    def __add__(self, other: KronCurvature) -> KronCurvature:
        """The curvature of both data sets: the ``B`` sums add, the ``A`` averages are
        weighted by the examples that reached each layer (a layer one data set never calls,
        e.g. another task's head, keeps the other's average instead of being diluted)."""
        if self.names != other.names:
            raise ValueError("cannot add KFAC curvatures of different layers")
        blocks = []
        for s, o in zip(self.blocks, other.blocks):
            ns = self.n if s.n is None else s.n
            no = other.n if o.n is None else o.n
            a = (s.A * ns + o.A * no) / (ns + no) if ns + no > 0 else s.A
            bb = None if s.B_bias is None else s.B_bias + o.B_bias
            blocks.append(KronBlock(a, s.B + o.B, bb, ns + no))
        if set(self.diag) != set(other.diag):
            raise ValueError("cannot add curvatures with different diagonal parameters")
        diag = {k: v + other.diag[k] for k, v in self.diag.items()}
        return KronCurvature(blocks, self.names, self.n + other.n, diag)

    def scaled(self, factor: float) -> KronCurvature:
        """``factor`` times this curvature (e.g. a subsample rescaled to its data set's
        size): each block's ``B`` sums (``A kron B`` scales with ``B``; ``A`` is an average),
        the diagonals of the other parameters and the example counts ``n``."""
        blocks = [
            KronBlock(
                b.A,
                b.B * factor,
                None if b.B_bias is None else b.B_bias * factor,
                None if b.n is None else round(b.n * factor),
            )
            for b in self.blocks
        ]
        diag = {k: v * factor for k, v in self.diag.items()}
        return KronCurvature(blocks, self.names, round(self.n * factor), diag)

    def state_dict(self) -> dict:
        return {
            "A": [b.A for b in self.blocks],
            "B": [b.B for b in self.blocks],
            "B_bias": [b.B_bias for b in self.blocks],
            "names": self.names,
            "n": self.n,
            "n_blocks": [b.n for b in self.blocks],
            "diag": dict(self.diag),
        }

    @classmethod
    def from_state_dict(cls, state: dict) -> KronCurvature:
        counts = state.get("n_blocks", [None] * len(state["A"]))
        blocks = [
            KronBlock(a, b, c, None if k is None else int(k))
            for a, b, c, k in zip(state["A"], state["B"], state["B_bias"], counts)
        ]
        names = [list(n) for n in state["names"]]
        return cls(blocks, names, int(state["n"]), dict(state.get("diag", {})))


def kron_curvature(
    model: nn.Module,
    batches: Iterable[tuple[Tensor, Tensor | None]],
    likelihood: Likelihood,
    *,
    layers: list[nn.Module] | None = None,
    diag_layers: list[nn.Module] | None = None,
    fisher: str = "ggn",
    outputs: list[Tensor] | None = None,
) -> KronCurvature:
    """KFAC factors of ``model``'s ``Linear``/``Conv2d`` layers over ``batches`` of
    ``(x [B, ...], y [B] or None)``; the model maps ``x`` to ``[B, C]`` and is in eval mode.

    Args:
        layers: the KFAC layers; ``diag_layers``: layers whose parameters get exact
            GGN-diagonal blocks (:attr:`KronCurvature.diag`). Default (``layers`` None): both
            from :func:`kron_split` ``(model)``. Each layer must be called exactly once per
            forward pass.
        fisher: ``"ggn"`` (columns of the output-Hessian square root, targets not needed)
            or ``"ef"`` (the empirical Fisher: the per-example loss gradient; needs ``y``).
        outputs: a list that receives each batch's outputs ``f(x)`` ``[B, C]`` (detached),
            so that a caller needing them (the evidence's data term) makes no second
            forward pass.
    """
    if fisher not in ("ggn", "ef"):
        raise ValueError(f"fisher must be 'ggn' or 'ef', got {fisher!r}")
    run = uncompiled(model)  # forward passes eagerly; names as ``model`` gives them
    if layers is None:
        layers, diag_layers = kron_split(model)
    diag_layers = list(diag_layers or [])
    layer_map = LayerMap.of(model)
    own, name_of = layer_map.layers(), layer_map.name_of()
    names = [[name for name, _ in own.get(m, [])] for m in layers]
    diag = {name: torch.zeros_like(layer_map.named[name]) for m in diag_layers
            for name, _ in own.get(m, [])}  # fmt: skip
    a_sum: list[Tensor | None] = [None] * len(layers)
    b_sum: list[Tensor | None] = [None] * len(layers)
    bb_sum: list[Tensor | None] = [None] * len(layers)
    n, n_used = 0, [0] * len(layers)
    for x, y in batches:
        with torch.enable_grad(), capture_calls(layers + diag_layers) as all_calls:
            f = check_model_output(run(x))
        if outputs is not None:
            outputs.append(f.detach())
        kron_ids = {id(m) for m in layers}
        calls = [c for c in all_calls if id(c.module) in kron_ids]
        d_calls = [c for c in all_calls if id(c.module) not in kron_ids]
        if len({id(c.module) for c in d_calls}) != len(d_calls):
            raise ValueError("a normalisation layer is called more than once per forward pass")
        by_layer = {}
        for c in calls:
            if id(c.module) in by_layer:
                raise ValueError(f"{c.module} is called more than once per forward pass")
            by_layer[id(c.module)] = c
        # a layer the forward pass does not call (another task's head), or calls on none of
        # the batch's examples (a head chosen per example), has no curvature from it
        used = [i for i, m in enumerate(layers) if id(m) in by_layer and len(by_layer[id(m)].a)]
        calls = [by_layer[id(layers[i])] for i in used]
        if fisher == "ggn":
            root = likelihood.sqrt_hessian(f.detach())  # [B, C, K]
            columns = [root[:, :, k] for k in range(root.shape[2])]
        else:
            if y is None:
                raise ValueError("fisher='ef' needs targets: batches of (x, y)")
            fd = f.detach().requires_grad_(True)
            (e,) = torch.autograd.grad(likelihood.nll(fd, y.to(f.device)).sum(), fd)
            columns = [e]
        zs = [c.z for c in calls] + [c.z for c in d_calls]
        d_grads: list[list[Tensor]] = [[] for _ in d_calls]
        for k, v in enumerate(columns):
            gs = torch.autograd.grad(f, zs, grad_outputs=v, retain_graph=k < len(columns) - 1,
                                     allow_unused=True)  # fmt: skip
            for j, g in enumerate(gs[len(calls) :]):
                if g is not None:
                    d_grads[j].append(g.detach())
            for i, g in zip(used, gs[: len(calls)]):
                m = layers[i]
                g = rule_for(m).output_rows(g.detach())  # [B, L, out]
                g2 = g.reshape(-1, g.shape[-1])  # (n, l) rows
                if b_sum[i] is None:
                    b_sum[i] = g2.new_zeros(g2.shape[1], g2.shape[1])
                b_sum[i].addmm_(g2.T, g2)  # accumulated in the GEMM: no extra pass over B
                if m.bias is not None and m.bias.requires_grad:
                    gb = g.sum(1)
                    bb = gb.T @ gb
                    bb_sum[i] = bb if bb_sum[i] is None else bb_sum[i] + bb
        for c, g in zip(d_calls, d_grads):  # exact: sum over examples and columns
            if g:
                for pn, t in squared_grad_sums(c.module, c.a, torch.stack(g)).items():
                    name = name_of.get((id(c.module), pn))
                    if name is not None:
                        diag[name] += t.detach()
        for i, c in zip(used, calls):
            u = rule_for(layers[i]).input_rows(c.a).detach()  # [B, L, in']
            u2 = u.reshape(-1, u.shape[-1])
            if a_sum[i] is None:
                a_sum[i] = u2.new_zeros(u2.shape[1], u2.shape[1])
            # the positions averaged (alpha = 1/L) and the batches summed inside the GEMM:
            # a separate division and addition would each be a full pass over [in', in']
            a_sum[i].addmm_(u2.T, u2, alpha=1.0 / u.shape[1])
            n_used[i] += len(u)  # the examples that reached the layer (a routed head: some)
        n += len(x)
    if n == 0:
        raise ValueError("data is empty: expected at least one batch")
    blocks = []
    for m, a, b, bb, k in zip(layers, a_sum, b_sum, bb_sum, n_used):
        w = m.weight
        if a is None:  # never called: zero factors (the posterior is the prior there)
            d_in = w[0].numel()
            a = w.new_zeros(d_in, d_in)
            b = w.new_zeros(w.shape[0], w.shape[0])
            has_bias = m.bias is not None and m.bias.requires_grad
            bb = w.new_zeros(w.shape[0], w.shape[0]) if has_bias else None
        a = a.detach().div_(max(k, 1))  # the mean over the examples that reached the layer
        blocks.append(KronBlock(a, b.detach(), None if bb is None else bb.detach(), k))
    return KronCurvature(blocks, names, n, diag)


def kron_curvature_tasks(
    model: nn.Module,
    tasks: Iterable[tuple[Tensor, int | None]],
    likelihood: Likelihood,
    *,
    batch_size: int = 1000,
) -> KronCurvature:
    r"""KFAC GGN of several tasks' data, each task's examples through its own head: the
    curvature of an objective that sums the tasks' losses (a continual method that keeps
    its earlier tasks; :class:`fromp.continual.methods.FROMPMethod` with ``posterior="kron"`` sums
    its experiences' terms the same way).

    ``tasks``: ``(x_t [N_t, ...], t)``, with ``t`` the task label (head) of a multi-task
    model (:func:`fromp.models.is_multitask`), ignored (may be None) otherwise. Every term
    is :func:`kron_curvature` of ``model`` with its head fixed to ``t``, all through one
    :class:`fromp.models.TaskView` (so the parameter names are those of ``with_task(model,
    t)`` for any ``t``), added by :meth:`KronCurvature.__add__`: for each layer ``B =
    sum_t sum_{n in t} sum_k g_nk g_nk^T`` and ``A`` the mean of ``u u^T`` over the
    examples of the tasks that call it. A shared (trunk) layer thus gets every task's
    curvature, task ``t``'s head only task ``t``'s, a head no task calls none (the prior
    alone in a posterior). ``model`` is in eval mode; returns one :class:`KronCurvature`
    with ``n = sum_t N_t``."""
    from fromp.models import TaskView, is_multitask

    multi = is_multitask(model)
    view = TaskView(model, 0) if multi else model
    total: KronCurvature | None = None
    for x, t in tasks:
        if multi:
            if t is None:
                raise ValueError("a multi-task model needs each task's label (head), got None")
            view.task = int(t)
        batches = [(x[s : s + batch_size], None) for s in range(0, len(x), batch_size)]
        term = kron_curvature(view, batches, likelihood)
        total = term if total is None else total + term
    if total is None:
        raise ValueError("tasks is empty: expected at least one (x, task)")
    return total


def _eigh_mrrr(sym: Tensor) -> tuple[Tensor, Tensor] | None:
    """LAPACK's MRRR solver (``?syevr`` through SciPy) in the factor's own dtype, on CPU; None
    where it is not available or does not give finite results."""
    if sym.device.type != "cpu" or sym.dtype not in (torch.float32, torch.float64):
        return None
    try:
        import scipy.linalg

        w, q = scipy.linalg.eigh(sym.detach().numpy(), driver="evr", check_finite=False)
    except (ImportError, ValueError, ArithmeticError):  # LinAlgError is a ValueError
        return None
    vals, vecs = torch.from_numpy(w).to(sym.dtype), torch.from_numpy(q).to(sym.dtype)
    if not bool(torch.isfinite(vals).all() & torch.isfinite(vecs).all()):
        return None
    return vals, vecs


def _eigh(m: Tensor) -> tuple[Tensor, Tensor]:
    """Eigendecomposition of the symmetric part of a factor. A factor of fewer examples than
    its size has many equal (zero) eigenvalues, where LAPACK's divide-and-conquer solver
    (torch's) can fail to converge or return NaN: then LAPACK's MRRR solver is tried in the
    same dtype (:func:`_eigh_mrrr`; a 4608 x 4608 ResNet-18 factor of 16 inputs: 12 s against
    31 s for the next step), and if that fails too, torch's in float64 with the degeneracy
    broken by a diagonal ramp of at most ``1e-10`` times the largest diagonal entry (which
    moves each eigenvalue by no more)."""
    sym = 0.5 * (m + m.T)
    try:
        vals, vecs = torch.linalg.eigh(sym)
        if bool(torch.isfinite(vals).all() & torch.isfinite(vecs).all()):
            return vals, vecs
    except torch.linalg.LinAlgError:
        pass  # (it may also return NaN without an error: both are retried)
    mrrr = _eigh_mrrr(sym)
    if mrrr is not None:
        return mrrr
    d = sym.double()
    scale = float(d.diagonal().abs().max()) or 1.0
    ramp = torch.linspace(0.0, 1e-10 * scale, len(d), dtype=d.dtype, device=d.device)
    vals, vecs = torch.linalg.eigh(d + torch.diag(ramp))
    if not bool(torch.isfinite(vals).all() & torch.isfinite(vecs).all()):
        raise FloatingPointError(
            f"the eigendecomposition of a {len(d)} x {len(d)} Kronecker factor is not finite "
            "even in float64 (a factor with NaN or inf?)"
        )
    return vals.to(m.dtype), vecs.to(m.dtype)


class KronEigen:
    """Eigendecompositions of a :class:`KronCurvature`'s factors, for the posterior
    precision ``G / T + delta`` block by block (``delta`` one positive scalar per parameter
    tensor: weight block, bias block).

    Attributes (per layer ``i``): ``qa[i] [in', in']``, ``la[i] [in']``, ``qb[i]``,
    ``lb[i] [out]``; ``qbb[i]``, ``lbb[i]`` for the bias (None without one). Eigenvalues are
    clamped at 0 (the factors are positive semi-definite up to rounding)."""

    def __init__(self, curv: KronCurvature) -> None:
        self.curv = curv
        self.qa, self.la, self.qb, self.lb, self.qbb, self.lbb = [], [], [], [], [], []
        for blk in curv.blocks:
            la, qa = _eigh(blk.A)
            lb, qb = _eigh(blk.B)
            self.la.append(la.clamp_min(0))
            self.qa.append(qa)
            self.lb.append(lb.clamp_min(0))
            self.qb.append(qb)
            if blk.B_bias is None:
                self.lbb.append(None)
                self.qbb.append(None)
            else:
                lbb, qbb = _eigh(blk.B_bias)
                self.lbb.append(lbb.clamp_min(0))
                self.qbb.append(qbb)

    def weight_eigs(self, i: int, scale: Tensor | float, prior_precision: Tensor) -> Tensor:
        """``[out, in']``: eigenvalues ``b_i a_j scale + delta`` of layer ``i``'s weight
        block of the posterior precision (``delta`` the weight's ``prior_precision``)."""
        return torch.outer(self.lb[i], self.la[i]) * scale + prior_precision

    def bias_eigs(self, i: int, scale: Tensor | float, prior_precision: Tensor) -> Tensor:
        """``[out]``: eigenvalues ``b_k scale + delta`` of layer ``i``'s bias block."""
        return self.lbb[i] * scale + prior_precision

    def logdet(self, scale: Tensor | float, prior_precisions: list[Tensor]) -> Tensor:
        """``log det(G scale + D)``; ``prior_precisions``: ``delta``, one scalar per parameter
        tensor, in the order of ``curv.names`` flattened."""
        total, k = 0.0, 0
        for i in range(len(self.la)):
            total = total + self.weight_eigs(i, scale, prior_precisions[k]).log().sum()
            k += 1
            if self.lbb[i] is not None:
                total = total + self.bias_eigs(i, scale, prior_precisions[k]).log().sum()
                k += 1
        return total

    def rotate_weight(self, i: int, m: Tensor) -> Tensor:
        """``Q_B^T M Q_A`` for ``M [..., out, in']``."""
        return self.qb[i].T @ m @ self.qa[i]

    def unrotate_weight(self, i: int, r: Tensor) -> Tensor:
        return self.qb[i] @ r @ self.qa[i].T

    def to_dense(self, scale: Tensor | float, prior_precisions: list[Tensor]) -> list[Tensor]:
        """The dense precision of each parameter tensor (tests and small models only):
        ``B (x) A scale + delta I`` for a weight, ``B_bias scale + delta I`` for a bias
        (``delta`` the tensor's entry of ``prior_precisions``)."""
        out, k = [], 0
        for blk in self.curv.blocks:
            w = torch.kron(blk.B, blk.A) * scale
            out.append(w + prior_precisions[k] * torch.eye(len(w), dtype=w.dtype, device=w.device))
            k += 1
            if blk.B_bias is not None:
                b = blk.B_bias * scale
                out.append(
                    b + prior_precisions[k] * torch.eye(len(b), dtype=b.dtype, device=b.device)
                )
                k += 1
        return out
