"""FROMP's functional regulariser on the memorable past.

After task ``t`` the network's predictions on a small memorable set ``X_t`` (``M`` inputs,
see :mod:`fromp.continual.memorable`) are stored as targets ``m_t = p(X_t; w_t) [M, C]`` (softmax
probabilities, or the likelihood's inverse link in general), together with the GP kernel
of the linearised network on those points,

    ``K_t = (dp/dw) Sigma (dp/dw)^T``,  ``dp/dw = Lambda(f) J``

(softmax: ``Lambda = diag(p) - p p^T``),

where ``Sigma = diag(posterior_variance)`` is the (diagonal) posterior covariance of the
weights, e.g. ``1 / (accumulated GGN diagonal + delta)``. While later tasks are learnt the
regulariser

    ``R(w) = 1/2 sum_s r_s^T K_s^{-1} r_s``,  ``r_s = p(X_s; w) - m_s``

keeps the function on the memorable past close to its old values; its gradient is
``sum_s (dp/dw)^T K_s^{-1} r_s``, the update of Pan et al. (2020). FROMP adds ``tau * R(w)``
to the loss.

Kernels (``kernel=``):

* ``"per_class"`` (the paper's choice): one ``[M, M]`` kernel per output ``c``, built from
  the ``c``-th column of ``dp/dw``, i.e. the block diagonal of the joint kernel.
* ``"joint"``: the full ``[C M, C M]`` kernel (ordering class-major: ``(c, m)``); for
  softmax it is singular (``sum_c p_c = 1``), so it relies on the jitter.
* ``"per_point"``: one ``[C, C]`` kernel per memorable point, ``K_m = (dp(x_m)/dw) Sigma
  (dp(x_m)/dw)^T``, the GP's marginal covariance of the point's outputs: the blocks of the
  joint kernel between each point and itself (the kernel between two points dropped),
  ``R = 1/2 sum_m r_m^T K_m^{-1} r_m``. Its cost is linear in the points (``P + C^2 O``
  multiply-adds per point for a layer of ``O`` outputs, structured; the per-class kernel's
  Gram products cost ``M^2 P`` per set), so the penalty can cover every stored point of a
  large memory. Meant for the logits: for softmax probabilities each block is singular
  (``sum_c p_c = 1``) and relies on the jitter, as the joint kernel does.
* ``"identity"``: ``K = I`` (FROMP-L2), ``R = 1/2 ||p(X; w) - m||^2``.

``K`` is the DNN2GP kernel (:class:`fromp.gp.GP`) of ``p = inverse_link(f)`` linearised
at the current weights under ``N(w, Sigma)``. With ``function="logits"`` the function kept
is ``f`` itself (``r_s = f(X_s; w) - m_s``, ``K_c = (df_c/dw) Sigma (df_c/dw)^T``, the
DNN2GP kernel of the outputs, S-FSVI's function space). The softmax's Jacobian ``diag(p) -
p p^T`` vanishes on confidently classified points, so their probabilities' kernels are
near the jitter and ``K^{-1}`` multiplies their small changes by up to ``1 / jitter``:
on one many-class head (class-incremental streams) that penalty grows by orders of
magnitude within an experience; the logits' kernel keeps its scale there.

The kernels are factorised once per
:meth:`FROMPRegularizer.add_task` / :meth:`update` call (float64 Cholesky,
``K + jitter I``, all kernels of a size in one batched call; larger jitter, with a warning,
for a kernel whose factorisation fails).

Cost. A training step runs the same operations whatever the number of tasks stored: one
forward and backward of the network on all ``N`` memorable points, then the quadratic forms
of all tasks as one: the inverse factors ``L_b^{-1}`` of every kernel block are stacked once
per stored task into ``[B, L, L]``, the residuals gathered into ``[B, L]`` with one stored
index, ``R = 1/2 ||L^{-1} r||^2`` one batched product (``B L^2`` multiply-adds; no host
synchronisation). What grows with the tasks is the arithmetic on more points, chiefly the
network's forward and backward on ``N = sum_s M_s``. After a task, :meth:`update` takes
every earlier set's targets and kernel again under the new posterior (FROMP regularises
towards the latest solution): one forward per head, one GP per head, each set's kernel
block, one batched factorisation; its cost grows with the sets stored, by design.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fromp._checks import (
    check_batch,
    check_chunk_size,
    check_count,
    check_tensor,
    check_vector,
    device_dtype,
)
from fromp.curvature.jacobian import flat_params, num_params
from fromp.gp.process import GP
from fromp.likelihood import Likelihood, get_likelihood
from fromp.models import takes_task_labels, with_task
from fromp.posterior import DiagonalGaussian

__all__ = ["FROMPRegularizer", "FunctionKernel", "MemorableSet", "task_fn"]

ModelFn = Callable[[Tensor, int], Tensor]
FunctionKernel = Callable[[nn.Module, Tensor, "int | None"], Tensor]
"""``(model, x [M, ...], task) -> J(x) Sigma J(x)^T`` ``[M, C, M, C]``: the DNN2GP kernel of
the outputs ``f`` through head ``task`` under a posterior of any structure (e.g. a fitted
Kronecker :func:`fromp.Laplace`); FROMP maps it to the probabilities' kernel."""
_KERNELS = ("per_class", "joint", "per_point", "identity")
#: the functions FROMP can keep: the probabilities ``p = inverse_link(f)`` (the paper) or the
#: outputs ``f`` themselves (the logits, the function space of DNN2GP and S-FSVI)
_FUNCTIONS = ("probs", "logits")


_LABELLED: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


def _takes_labels(model: nn.Module) -> bool:
    """:func:`fromp.models.takes_task_labels` of ``model``, read once per class (a signature
    read costs a training step tens of microseconds); a ``forward`` assigned to the instance
    is read each time."""
    if "forward" in vars(model):
        return takes_task_labels(model)
    cls = type(model)
    if cls not in _LABELLED:
        _LABELLED[cls] = takes_task_labels(model)
    return _LABELLED[cls]


def task_fn(model: nn.Module) -> ModelFn:
    """``(x, task) -> logits`` for a :mod:`fromp` multi-head model (the head is fixed with
    :func:`fromp.models.with_task`); plain ``x -> logits`` modules ignore ``task``."""

    def fn(x: Tensor, task: int) -> Tensor:
        return with_task(model, task)(x)

    return fn


class _InverseLink(nn.Module):
    """``x -> likelihood.inverse_link(module(x))``: the probabilities ``p`` whose kernel FROMP
    uses (softmax for ``"categorical"``)."""

    def __init__(self, module: nn.Module, likelihood: Likelihood) -> None:
        super().__init__()
        self.module = module
        self.likelihood = likelihood

    def forward(self, x: Tensor) -> Tensor:
        return self.likelihood.inverse_link(self.module(x))


def _prob_gp(
    module: nn.Module,
    likelihood: Likelihood,
    variance: Tensor | None,
    chunk_size: int,
    function: str = "probs",
) -> GP:
    """The DNN2GP :class:`~fromp.gp.GP` of ``p = inverse_link(module(x))`` (``function=
    "probs"``) or of the outputs ``f = module(x)`` (``"logits"``) linearised at the module's
    current weights, under ``Sigma = diag(variance)`` (``variance`` ``[P]``; None: the
    identity). A zero variance is taken as the smallest positive float64 (its whitened
    Jacobian column is then zero to working precision)."""
    mean = flat_params(module)
    if variance is None:
        precision = torch.ones_like(mean)
    else:
        precision = variance.double().clamp_min(torch.finfo(torch.float64).tiny).reciprocal()
    posterior = DiagonalGaussian(mean, precision.to(mean.device))
    fn = module if function == "logits" else _InverseLink(module, likelihood)
    return GP(fn, posterior, likelihood, chunk_size=chunk_size)


def _gp_kernel(gp: GP, x: Tensor, kernel: str) -> Tensor:
    """The blocks of ``gp``'s kernel on ``x`` that ``kernel`` uses: ``[C, M, M]`` per class
    (``gp.kernel(x, diagonal_outputs=True)``), ``[M, C, C]`` per point (``gp.variance(x)``)
    or ``[M, C, M, C]`` (joint); the per-example Jacobian way when the structured
    evaluator's one-example layer capture fails on the model (a model that squeezes the
    batch dimension of a single example, Avalanche's ``MTSimpleCNN``, feeds its last layer
    a ``[D]`` input instead of ``[1, D]``)."""

    def blocks(method: str) -> Tensor:
        if kernel == "per_point":
            return gp.variance(x, method=method)
        return gp.kernel(x, diagonal_outputs=kernel == "per_class", method=method)

    try:
        return blocks("auto")
    except RuntimeError as err:
        if isinstance(err, torch.OutOfMemoryError):
            raise
        return blocks("jacobian")


def _select_units(k: Tensor, units: Tensor, kernel: str, m: int) -> Tensor:
    """The kernel ``k`` of :meth:`FROMPRegularizer.kernel_matrix` on ``m`` points restricted
    to the output units ``units``: ``[C, M, M] -> [C_s, M, M]`` (per class), ``[M, C, C] ->
    [M, C_s, C_s]`` (per point),
    ``[1, C M, C M] -> [1, C_s M, C_s M]`` (joint, class-major)."""
    units = units.to(k.device)
    if kernel == "per_point":
        return k if len(units) == k.shape[1] else k[:, units][:, :, units]
    if kernel == "per_class":
        return k if len(units) == k.shape[0] else k[units]
    c = k.shape[-1] // m
    if len(units) == c:
        return k
    k4 = k.reshape(c, m, c, m)[units][:, :, units]
    return k4.reshape(1, len(units) * m, len(units) * m)


@dataclass
class MemorableSet:
    """One finished task's memorable past.

    Attributes:
        inputs: ``[M, ...]`` memorable inputs.
        task: the head (task id) whose outputs are regularised.
        targets: ``[M, C]`` float64 old predictions ``m``.
        chol: float64 lower Cholesky factors of ``K + jitter I``: ``[C, M, M]`` per class,
            ``[1, C M, C M]`` joint, ``[M, C, C]`` per point, None for the identity kernel.
        jitter: the jitter that was added to the kernel diagonal.
        units: ``[C_s]`` long indices of the output units the set is regularised on: the
            head's units whose probability is not exactly 0 on every memorable point (units
            an incremental classifier masks, at ``-1000``, for classes not seen yet are left
            out, as their kernel would be the jitter alone) and, when the regulariser knows
            the classes trained so far for the head (``classes_seen``, kept by
            :class:`fromp.continual.methods.FROMPMethod`), among those (a fixed 10-way head in a
            class-incremental stream: the units of classes not trained yet have
            probabilities near 0 and kernels near the jitter, and would stop the new classes
            from being learnt); ``targets`` and ``chol`` cover these units only. None
            (states of older versions): the first ``targets.shape[1]`` units.
        labels: ``[M]`` the memorable points' labels (indices of the head's units), kept
            for replay (:meth:`FROMPRegularizer.replay_loss`); None when not given.
        penalised: the penalty covers the first ``penalised`` inputs (``targets`` ``[k,
            C_s]`` and ``chol`` are theirs; the replay loss covers all ``M``); None: all.
    """

    inputs: Tensor
    task: int
    targets: Tensor
    chol: Tensor | None
    jitter: float = 0.0
    units: Tensor | None = None
    labels: Tensor | None = None
    penalised: int | None = None

    @property
    def n_penalised(self) -> int:
        """``k``: the inputs the penalty covers (the first ``k``)."""
        return len(self.inputs) if self.penalised is None else self.penalised


def _units_of(m: MemorableSet) -> Tensor:
    """The set's units (``[C_s]`` long); the first ``targets.shape[1]`` for older states."""
    if m.units is not None:
        return m.units
    return torch.arange(m.targets.shape[1], device=m.targets.device)


def _mean_weights(m: MemorableSet) -> Tensor:
    """``[M]`` float64 ``1 / M``: the weights of the set's mean over its points."""
    n = len(m.inputs)
    return torch.full((n,), 1.0 / n, dtype=torch.float64, device=m.targets.device)


@dataclass
class _Stack:
    """Every stored set's quadratic form as blocks of one batched one, and what the replay
    loss reads.

    Block ``b`` (per set and class for ``"per_class"``, per set and point for
    ``"per_point"``, per set for ``"joint"`` and ``"identity"``) holds ``L_b`` residual
    entries ``p[rows[b, i], cols[b, i]] - targets[b, i]`` (``p`` ``[N_k, C]`` the kept
    function on the ``N_k = sum_s k_s`` penalised points, the first ``k_s`` of each set;
    class-major ``(c, m)`` within a joint block), zero-padded to ``L = max_b L_b``, and
    ``whiten_t[b] = chol_b^{-T}`` (``chol_b chol_b^T = K_b + jitter I``; zero rows and
    columns on the padding), so that ``r_b^T (K_b + jitter I)^{-1} r_b = ||r_b^T
    whiten_t[b]||^2`` (the row-vector product is the faster layout of the batched matmul).
    ``rows_all`` are the same entries' rows among all ``N = sum_s M_s`` stored points (the
    layout of a step that evaluates every point).
    """

    rows: Tensor  # [B, L] long: the point among the N_k penalised points
    rows_all: Tensor  # [B, L] long: the point among all N stored points
    cols: Tensor  # [B, L] long: its output unit
    targets: Tensor  # [B, L] float64
    mask: Tensor  # [B, L] float64: 1 on entries, 0 on the padding
    whiten_t: Tensor | None  # [B, L, L] float64; None for the identity kernel
    sizes: list[int]  # M_s per set
    penalised: list[int]  # k_s per set
    needs: list[int]  # per set, the head width it needs (largest unit + 1)
    labels: Tensor | None  # [N] when every set has labels
    weights: Tensor  # [N] float64, 1 / M_s: each set's mean NLL (replay)
    point_set: Tensor  # [N] long: the set of each stored point
    offsets: Tensor  # [S] long: each set's first point among the N
    counts: Tensor  # [S] float64: M_s
    x: dict[str, Tensor] = field(default_factory=dict)  # "all" [N, ...], "penalised" [N_k, ...]
    task: dict[str, Tensor] = field(default_factory=dict)  # their heads, [N] / [N_k] long
    flat: dict[tuple[bool, int], Tensor] = field(default_factory=dict)  # rows * C + cols

    @property
    def count(self) -> int:
        return len(self.sizes)

    @property
    def need(self) -> int:
        return max(self.needs)

    @property
    def all_penalised(self) -> bool:
        """Every set's penalty covers all its points (the two layouts are one)."""
        return self.penalised == self.sizes

    @classmethod
    def of(cls, memories: list[MemorableSet], kernel: str) -> _Stack:
        """Stack ``memories`` (all on one device; each set's factor inverted once)."""
        rows, rows_all, cols, targets, whiten, point_set = [], [], [], [], [], []
        off = off_all = 0
        for j, m in enumerate(memories):
            n, k, dev = len(m.inputs), m.n_penalised, m.targets.device
            units = _units_of(m).to(dev)
            points = torch.arange(k, device=dev)
            if kernel == "per_point":  # a block per point: its units
                local = points[:, None].expand(k, len(units))
                cols.append(units[None].expand(k, len(units)))
                targets.append(m.targets)
            elif kernel == "per_class":
                local = points.expand(len(units), k)
                cols.append(units[:, None].expand(len(units), k))
                targets.append(m.targets.T)
            else:  # one block, class-major (c, m)
                local = points.repeat(len(units))[None]
                cols.append(units.repeat_interleave(k)[None])
                targets.append(m.targets.T.reshape(1, -1))
            rows.append(local + off)
            rows_all.append(local + off_all)
            if kernel != "identity":
                if m.chol is None:
                    raise ValueError(f"the memorable set of task {m.task} has no kernel factor")
                eye = torch.eye(m.chol.shape[-1], dtype=m.chol.dtype, device=dev)
                whiten.append(torch.linalg.solve_triangular(m.chol, eye, upper=False))
            point_set.append(torch.full((n,), j, dtype=torch.long, device=dev))
            off += k
            off_all += n
        width = max(t.shape[1] for t in targets)

        def pad(t: Tensor, square: bool = False) -> Tensor:
            extra = width - t.shape[-1]
            return F.pad(t, (0, extra, 0, extra) if square else (0, extra))

        dev = memories[0].targets.device
        sizes = [len(m.inputs) for m in memories]
        labelled = all(m.labels is not None for m in memories)
        return cls(
            rows=torch.cat([pad(r) for r in rows]),
            rows_all=torch.cat([pad(r) for r in rows_all]),
            cols=torch.cat([pad(c) for c in cols]),
            targets=torch.cat([pad(t) for t in targets]),
            mask=torch.cat([pad(torch.ones_like(t)) for t in targets]),
            whiten_t=torch.cat([pad(w, True) for w in whiten]).mT.contiguous() if whiten else None,
            sizes=sizes,
            penalised=[m.n_penalised for m in memories],
            needs=[int(_units_of(m).max()) + 1 for m in memories],
            labels=torch.cat([m.labels for m in memories]) if labelled else None,  # type: ignore[misc]
            weights=torch.cat([_mean_weights(m) for m in memories]),
            point_set=torch.cat(point_set),
            offsets=torch.tensor([0, *sizes[:-1]], device=dev).cumsum(0),
            counts=torch.tensor(sizes, dtype=torch.float64, device=dev),
        )

    def inputs(self, memories: list[MemorableSet], layout: str) -> tuple[Tensor, Tensor]:
        """``(x, heads)`` of the ``"all"`` or ``"penalised"`` layout (made on first use)."""
        if layout not in self.x:
            if layout == "all" or self.all_penalised:
                xs = [m.inputs for m in memories]
            else:
                xs = [m.inputs[: m.n_penalised] for m in memories]
            tasks = [0 if m.task is None else int(m.task) for m in memories]
            self.x[layout] = torch.cat(xs)
            self.task[layout] = torch.cat(
                [
                    torch.full((len(x),), t, dtype=torch.long, device=x.device)
                    for x, t in zip(xs, tasks)
                ]
            )
        return self.x[layout], self.task[layout]

    def draw(self, per_set: int) -> Tensor:
        """``[S per_set]`` indices among the ``N`` stored points: ``per_set`` drawn uniformly
        with replacement from each set (torch's generator of the points' device)."""
        u = torch.rand(self.count, per_set, dtype=torch.float64, device=self.offsets.device)
        local = (u * self.counts[:, None]).long().clamp_max_(self.counts.long()[:, None] - 1)
        return (self.offsets[:, None] + local).reshape(-1)


class FROMPRegularizer:
    """Functional regulariser ``1/2 sum_s r_s^T K_s^{-1} r_s`` over finished tasks.

    Args:
        kernel: ``"per_class"``, ``"joint"``, ``"per_point"`` or ``"identity"`` (FROMP-L2);
            see the module docstring.
        likelihood: defines ``p = inverse_link(f)`` (``"categorical"``: softmax).
        jitter: added to every kernel's diagonal (FROMP uses 1e-6 on split MNIST, 1e-5 on
            permuted MNIST).
        max_tries: when the Cholesky factorisation fails, the jitter is multiplied by 10
            (from at least ``1e-10 * mean(diag K)``) up to this many times, with a warning;
            a ``RuntimeError`` is raised if it still fails.
        chunk_size: examples per Jacobian chunk when computing kernels (``GP.kernel``).
        function: the function kept on the memorable points: ``"probs"`` (``p =
            inverse_link(f)``, FROMP) or ``"logits"`` (the outputs ``f``); see the module
            docstring.

    Example:
        >>> import torch
        >>> from fromp.curvature.jacobian import num_params
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        >>> reg = FROMPRegularizer()
        >>> x_mem = torch.randn(5, 4)  # task 0's memorable inputs
        >>> reg.add_task(net, x_mem, 0, torch.full((num_params(net),), 0.1))  # after task 0
        >>> float(reg.penalty(net).detach())  # zero at the weights the targets were taken at
        0.0
        >>> with torch.no_grad():
        ...     _ = net[2].bias[0].add_(1.0)  # the weights move: class 0 gains
        >>> bool(reg.penalty(net) > 0)  # while training: loss = loss + tau * penalty
        True
    """

    def __init__(
        self,
        kernel: str = "per_class",
        likelihood: str | Likelihood = "categorical",
        *,
        jitter: float = 1e-6,
        max_tries: int = 8,
        chunk_size: int = 64,
        function: str = "probs",
    ) -> None:
        if kernel not in _KERNELS:
            raise ValueError(f"kernel must be one of {_KERNELS}, got {kernel!r}")
        if function not in _FUNCTIONS:
            raise ValueError(f"function must be one of {_FUNCTIONS}, got {function!r}")
        if not jitter >= 0:
            raise ValueError(f"jitter must be >= 0, got {jitter!r}")
        if max_tries < 0:
            raise ValueError(f"max_tries must be >= 0, got {max_tries!r}")
        chunk_size = check_chunk_size(chunk_size, allow_none=False)  # type: ignore[assignment]
        self.kernel = kernel
        self.function = function
        self.likelihood = get_likelihood(likelihood)
        self.jitter = float(jitter)
        self.max_tries = int(max_tries)
        self.chunk_size = int(chunk_size)
        self._cache: dict = {}
        self._memories: list[MemorableSet] = []
        #: per head (task id), the classes (output units) trained so far; when a head has
        #: an entry, its sets are regularised on those units only (see MemorableSet.units)
        self.classes_seen: dict[int | None, list[int]] = {}

    def __len__(self) -> int:
        return len(self.memories)

    @property
    def memories(self) -> list[MemorableSet]:
        """The stored sets, one per finished task, in the order stored. The penalty reads
        them through tensors stacked once after they change (by this class's methods or by
        assigning a new list); a set's fields changed in place from outside are not seen."""
        return self._memories

    @memories.setter
    def memories(self, sets: list[MemorableSet]) -> None:
        self._memories = sets
        self._cache = {}

    @property
    def num_points(self) -> int:
        """Total number of memorable inputs over all tasks."""
        return sum(len(m.inputs) for m in self.memories)

    def link(self, f: Tensor) -> Tensor:
        """The function the penalty keeps, from the outputs ``f`` ``[M, C]``: ``p =
        inverse_link(f)`` (``function="probs"``) or ``f`` itself (``"logits"``)."""
        return f if self.function == "logits" else self.likelihood.inverse_link(f)

    # ----------------------------------------------------------------------------- kernels
    def kernel_matrix(
        self,
        model: nn.Module,
        x: Tensor,
        task: int | None,
        posterior_variance: Tensor | FunctionKernel,
    ) -> Tensor:
        """The kernel of ``x`` through head ``task`` (float64, before jitter):
        ``[C, M, M]`` for ``"per_class"`` (``K_c = G_c Sigma G_c^T``, ``G_c = dp_c/dw``),
        ``[1, C M, C M]`` for ``"joint"``, ``[M, C, C]`` for ``"per_point"`` (``K_m = G(x_m)
        Sigma G(x_m)^T``, ``G(x_m) = dp(x_m)/dw`` ``[C, P]``: :meth:`fromp.gp.GP.variance`,
        linear in ``M``), an identity ``[1, C M, C M]`` for ``"identity"``.

        ``K`` is the DNN2GP kernel of ``p = inverse_link(f)``. With a diagonal ``Sigma``
        (``posterior_variance`` ``[P]``): ``GP(p, N(w, Sigma)).kernel(x,
        diagonal_outputs=True)`` (per class) or its full ``[M, C, M, C]`` kernel reordered
        class-major (joint), computed in the model's dtype and returned in float64; see
        :meth:`fromp.gp.GP.kernel` for cost and memory (chunks of ``chunk_size`` examples,
        never a ``P x P`` matrix). With a :data:`FunctionKernel` ``k_f`` (any posterior
        structure): ``K = A k_f(x) A^T``, ``A_m = dp(x_m)/df(x_m)`` ``[C, C]`` the
        inverse link's Jacobian (softmax: ``diag(p) - p p^T``), since ``dp/dw = A df/dw``.
        Batch-norm and dropout layers must be in eval mode.
        """
        x = check_batch(x, "x")
        if self.kernel == "identity":
            with torch.no_grad():
                c_out = with_task(model, task)(x[:1]).shape[1]
            return torch.eye(c_out * len(x), dtype=torch.float64, device=x.device).unsqueeze(0)
        return self._kernels(model, [x], [task], self._check_variance(model, posterior_variance))[0]

    def _kernels(
        self,
        model: nn.Module,
        xs: list[Tensor],
        tasks: list[int | None],
        variance: Tensor | FunctionKernel,
    ) -> list[Tensor]:
        """:meth:`kernel_matrix` of every set ``xs[s]`` ``[M_s, ...]`` through head
        ``tasks[s]`` (``variance`` already checked), each its own block ``K_s`` (the kernel
        between two sets is never formed: its cost, ``C M_s M_r P`` per pair, would make
        the after-task step quadratic in the tasks for nothing the penalty uses).

        With a diagonal ``Sigma`` one :class:`~fromp.gp.GP` per head serves all the head's
        sets: its structured evaluator (and the one-example check that it applies) is set
        up once, and ``Sigma = 0`` is tested once. What is left per set is the kernel's own
        arithmetic, the Gram products of the set's whitened Jacobians (``C M_s^2 P``
        multiply-adds per class-diagonal block, ``P_layer`` per pair and layer with the
        structured way) and its ``[M_s, C, P]``-sized features; per point (``"per_point"``)
        only the ``[C, C]`` block of each point with itself, ``P + C^2 O`` per point and
        layer. A :data:`FunctionKernel` (``posterior="kron"``) gives the whole ``[M, C, M,
        C]`` kernel, whose blocks are kept."""
        if callable(variance):
            return [
                self._arranged(self._prob_kernel(with_task(model, t), x, variance(model, x, t)))
                for x, t in zip(xs, tasks)
            ]
        zero = not bool((variance > 0).any())  # Sigma = 0: K = 0
        gps: dict[int | None, GP] = {}
        out = []
        for x, t in zip(xs, tasks):
            if t not in gps:
                gps[t] = _prob_gp(
                    with_task(model, t), self.likelihood, variance, self.chunk_size, self.function
                )
            k = _gp_kernel(gps[t], x, self.kernel).double()
            if zero:
                k = torch.zeros_like(k)
            out.append(self._arranged(k) if self.kernel == "joint" else k)
        return out

    def _arranged(self, k: Tensor) -> Tensor:
        """``[M, C, M, C]`` -> the class blocks ``[C, M, M]`` (per class), the point blocks
        ``[M, C, C]`` (per point) or the class-major ``[1, C M, C M]`` (joint)."""
        if self.kernel == "per_class":
            return torch.diagonal(k, dim1=1, dim2=3).permute(2, 0, 1).contiguous()
        if self.kernel == "per_point":
            return torch.diagonal(k, dim1=0, dim2=2).permute(2, 0, 1).contiguous()
        m, c = k.shape[:2]
        return k.permute(1, 0, 3, 2).reshape(1, c * m, c * m)

    def _prob_kernel(self, module: nn.Module, x: Tensor, kf: Tensor) -> Tensor:
        """``A k_f A^T`` ``[M, C, M, C]`` (float64) from the outputs' kernel ``k_f``."""
        with torch.no_grad():
            f = module(x).double()
        m, c = f.shape
        if kf.shape != (m, c, m, c):
            raise ValueError(
                f"the function-space kernel must have shape [M, C, M, C]={(m, c, m, c)}, got "
                f"{tuple(kf.shape)}"
            )
        if self.function == "logits":  # A = I
            return kf.double()
        a = torch.func.vmap(torch.func.jacrev(self.likelihood.inverse_link))(f)  # [M, C, C]
        return torch.einsum("mca,manb,ndb->mcnd", a, kf.double(), a)

    def _check_variance(
        self, model: nn.Module, v: Tensor | FunctionKernel
    ) -> Tensor | FunctionKernel:
        if callable(v):
            return v
        v = check_vector(v, num_params(model), "posterior_variance", nonnegative=True)
        return v.detach().double()

    def _cholesky_retry(self, k: Tensor, what: str) -> tuple[Tensor, float]:
        """The factor of ``k + jitter' I`` ``[., L, L]`` once ``k + jitter I`` failed:
        ``jitter'`` from ``max(jitter, 1e-10 * mean(diag k))``, times 10 per try, with a
        warning; ``RuntimeError`` after ``max_tries``."""
        eye = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
        scale = float(torch.diagonal(k, dim1=-2, dim2=-1).abs().mean())
        jitter = max(self.jitter, 1e-10 * scale, 1e-12)
        for _ in range(self.max_tries):
            chol, info = torch.linalg.cholesky_ex(k + jitter * eye)
            if not bool((info != 0).any()):
                warnings.warn(
                    f"kernel of {what} is not positive definite with jitter {self.jitter:g}; "
                    f"added jitter {jitter:g} to its diagonal",
                    RuntimeWarning,
                    stacklevel=5,
                )
                return chol, jitter
            jitter *= 10
        raise RuntimeError(
            f"Cholesky factorisation of the kernel of {what} failed even with jitter "
            f"{jitter / 10:g} (max_tries={self.max_tries}); the kernel may contain NaN/inf"
        )

    def _cholesky_all(
        self, ks: list[Tensor], tasks: list[int | None]
    ) -> list[tuple[Tensor, float]]:
        """The lower Cholesky factors of ``K_s + jitter I`` for every set's kernel ``K_s``
        and the jitter used: the kernels of one block size in one batched factorisation
        (one host sync for all); only a set whose factorisation fails goes through the
        retries (:meth:`_cholesky_retry`) with its own larger jitter."""
        out: list[tuple[Tensor, float] | None] = [None] * len(ks)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, k in enumerate(ks):
            groups.setdefault(tuple(k.shape[1:]), []).append(i)
        for shape, idx in groups.items():
            k = ks[idx[0]] if len(idx) == 1 else torch.cat([ks[i] for i in idx])
            eye = torch.eye(shape[-1], dtype=k.dtype, device=k.device)
            chol, info = torch.linalg.cholesky_ex(k + self.jitter * eye)
            counts = [len(ks[i]) for i in idx]
            failed = [bool(f.any()) for f in (info != 0).cpu().split(counts)]
            for i, c, bad in zip(idx, chol.split(counts), failed):
                what = f"task {tasks[i]}"
                out[i] = self._cholesky_retry(ks[i], what) if bad else (c, self.jitter)
        return out  # type: ignore[return-value]

    def _units(self, p: Tensor, task: int | None) -> Tensor:
        """The output units a set is stored on (see :attr:`MemorableSet.units`) from the
        probabilities ``p`` ``[M, C]`` of its points."""
        # units whose probability is exactly 0 on every point (masked: logit -1000) have a
        # zero Jacobian, so a kernel of jitter alone: they are left out until they exist
        live = p.amax(0) > 0
        if task in self.classes_seen:  # classes never trained on have no function to keep
            seen = torch.zeros_like(live)
            seen[[c for c in self.classes_seen[task] if c < len(seen)]] = True
            live = live & seen
        units = torch.nonzero(live).squeeze(1)
        if len(units) == 0:
            raise ValueError(f"the head of task {task} gives probability 0 to every output")
        return units

    def _build(
        self,
        model: nn.Module,
        items: list[tuple[Tensor, int | None, Tensor | None]],
        variance: Tensor | FunctionKernel,
        penalty_points: int | None = None,
    ) -> list[MemorableSet]:
        """The memorable sets of ``items`` (``(inputs, task, labels)`` each) at the model's
        present weights and ``Sigma``, the penalty on the first ``min(M_s,
        penalty_points)`` inputs of each (None: all): targets from one forward per head
        over all its penalised points, kernels through one GP per head (:meth:`_kernels`),
        the factorisations batched (:meth:`_cholesky_all`). Nothing is stored here: a
        failure leaves the regulariser as it was."""
        ks = [
            None if penalty_points is None or penalty_points >= len(x) else int(penalty_points)
            for x, _, _ in items
        ]
        xs = [x if k is None else x[:k] for (x, _, _), k in zip(items, ks)]
        tasks = [t for _, t, _ in items]
        outs = self._outputs_by_head(model, xs, tasks)
        units = [self._units(self.likelihood.inverse_link(f), t) for f, t in zip(outs, tasks)]
        targets = [self.link(f).double()[:, u] for f, u in zip(outs, units)]
        if self.kernel == "identity":
            factors: list[tuple[Tensor | None, float]] = [(None, 0.0)] * len(items)
        else:
            kern = self._kernels(model, xs, tasks, variance)
            kern = [_select_units(k, u, self.kernel, len(x)) for k, u, x in zip(kern, units, xs)]
            factors = self._cholesky_all(kern, tasks)  # type: ignore[assignment]
        return [
            MemorableSet(x, t, target, chol, jitter, u, labels, k)
            for (x, t, labels), target, (chol, jitter), u, k in zip(
                items, targets, factors, units, ks
            )
        ]

    def _outputs_by_head(
        self, model: nn.Module, xs: list[Tensor], tasks: list[int | None]
    ) -> list[Tensor]:
        """The outputs ``f`` ``[M_s, C]`` of every set through its head, one forward per
        head over all the head's points (no gradient)."""
        heads: dict[int | None, list[int]] = {}
        for i, t in enumerate(tasks):
            heads.setdefault(t, []).append(i)
        out: list[Tensor | None] = [None] * len(xs)
        with torch.no_grad():
            for t, idx in heads.items():
                x = xs[idx[0]] if len(idx) == 1 else torch.cat([xs[i] for i in idx])
                f = with_task(model, t)(x)
                for i, pi in zip(idx, f.split([len(xs[i]) for i in idx])):
                    out[i] = pi
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------------------------ API
    def add_task(
        self,
        model: nn.Module,
        x_mem: Tensor,
        task: int | None,
        posterior_variance: Tensor | FunctionKernel,
        *,
        update_previous: bool = True,
        labels: Tensor | None = None,
        penalty_points: int | None = None,
    ) -> None:
        """Store task ``task``'s memorable set ``x_mem [M, ...]`` with targets and kernel
        at the current parameters of ``model``.

        Args:
            model: the network, a :mod:`fromp` multi-head model (head ``task`` is used) or a
                plain ``x -> [N, C]`` module. Put it in eval mode if it has dropout.
            x_mem: memorable inputs (``M >= 1``).
            task: head / task id (None or any int for single-head models).
            posterior_variance: ``[P]`` diagonal of ``Sigma``, or the outputs' kernel under
                a posterior of any structure (:data:`FunctionKernel`).
            update_previous: also recompute targets and kernels of the tasks stored before
                at the current parameters and ``Sigma`` (what FROMP does at the start of
                every task: it regularises towards the latest solution ``w_t``).
            labels: ``[M]`` the points' labels (head units), kept for
                :meth:`replay_loss`.
            penalty_points: the penalty covers the first ``penalty_points`` inputs of each
                set built here (all of a smaller set; None: all): targets and kernels are
                taken on those (``C k^2 P`` multiply-adds per set instead of ``C M^2 P``),
                the replay loss keeps every input.
        """
        check_batch(x_mem, "x_mem")
        penalty_points = check_count(penalty_points, "penalty_points")
        device, _ = device_dtype(model)
        if labels is not None:
            labels = check_tensor(labels, "labels", f"[M]=[{len(x_mem)}]")
            if labels.shape != (len(x_mem),) or labels.is_floating_point():
                raise ValueError(
                    f"labels must be [M]=[{len(x_mem)}] integer labels, got "
                    f"{tuple(labels.shape)} {labels.dtype}"
                )
            labels = labels.detach().long().to(device)
        var = self._check_variance(model, posterior_variance)
        new = (x_mem.detach().to(device), task, labels)
        if update_previous:  # the earlier sets and the new one in one pass
            self.memories = self._build(model, [*self._items(), new], var, penalty_points)
        else:
            self.memories = [*self.memories, *self._build(model, [new], var, penalty_points)]

    def update(
        self,
        model: nn.Module,
        posterior_variance: Tensor | FunctionKernel,
        *,
        penalty_points: int | None = None,
    ) -> None:
        """Recompute every stored task's targets and kernel at the current parameters and
        ``posterior_variance`` (inputs and heads are kept).

        This is the after-task cost that grows with the tasks learnt, by design: FROMP
        regularises towards the latest solution, so every earlier set's targets and kernel
        ``K_s`` are taken again under the new posterior (nothing of the old ``K_s`` can be
        reused: ``Sigma`` and the Jacobians both changed). The work is one forward per head
        over all its points, one GP per head (:meth:`_kernels`: its set-up and checks
        done once), each set's kernel block (``C M_s^2 P`` multiply-adds per set, linear in
        the tasks) and one batched Cholesky factorisation of all blocks of a size."""
        penalty_points = check_count(penalty_points, "penalty_points")
        var = self._check_variance(model, posterior_variance)
        self.memories = self._build(model, self._items(), var, penalty_points)

    def _items(self) -> list[tuple[Tensor, int | None, Tensor | None]]:
        return [(m.inputs, m.task, m.labels) for m in self.memories]

    def retarget(self, model_fn: ModelFn | nn.Module) -> None:
        """Set every stored set's targets to the model's present outputs through
        :meth:`outputs` (the evaluation the penalty uses: e.g. batch-norm layers on the
        statistics of the memorable batch), on the units each set is stored on."""
        for f, m in zip(self.outputs(model_fn), self.memories):
            p = self.link(f).detach().double()
            m.targets = p[:, m.units] if m.units is not None else p[:, : m.targets.shape[1]]
        self._cache = {}

    def residuals(self, model_fn: ModelFn | nn.Module) -> list[Tensor]:
        """``r_s = p(X_s; w) - m_s`` for every stored task, each ``[k_s, C_s]`` float64 (its
        penalised points, :attr:`MemorableSet.penalised`).

        ``C_s`` are the units the set was stored on (:attr:`MemorableSet.units`: the units
        not masked at the time). A head that has grown since (an incremental classifier
        adds or unmasks output units for new classes: ``p`` is ``[M, C']``) is compared on
        those units, the softmax taken over all ``C'`` units (masked units, at ``-1000``,
        have probability 0): keeping the old classes' probabilities keeps the new units'
        mass near zero on the memorable past."""
        outputs = self.outputs(model_fn)
        st = self._stack()
        for f in outputs:
            self._check_width(f.shape[1], st)
        return [
            self.link(f).double()[:, _units_of(m)] - m.targets
            for f, m in zip(outputs, self.memories)
        ]

    def _check_width(self, c: int, st: _Stack) -> None:
        """Refuse outputs ``[., c]`` narrower than a stored set's units (Python ints only)."""
        if c >= st.need:
            return
        for m, need in zip(self.memories, st.needs):
            if c < need:
                raise ValueError(
                    f"the head of task {m.task} has {c} outputs, fewer than the {need} it "
                    "had when its memorable set was stored"
                )

    def penalty(self, model_fn: ModelFn | nn.Module) -> Tensor:
        """``R(w) = 1/2 sum_s r_s^T K_s^{-1} r_s``, a differentiable scalar.

        Computed as ``1/2 ||W r||^2`` over all stored tasks at once: ``W`` ``[B, L, L]``
        stacks the inverse Cholesky factors ``L_b^{-1}`` of every kernel block ``b`` (one
        per task and class for ``"per_class"``, per task and point for ``"per_point"``, one
        per task for ``"joint"``; zero-padded
        to the largest block ``L``), built once per stored task (when the sets change),
        so ``r_b^T K_b^{-1} r_b = ||L_b^{-1} r_b||^2``; ``r`` ``[B, L]`` is gathered from
        the probabilities of all memorable points with one stored index. Since ``K`` is
        constant, one backward pass gives exactly ``sum_s (dp(X_s)/dw)^T K_s^{-1} r_s``.

        A :mod:`fromp` model (or a plain ``x -> logits`` module) is called once on all
        memorable inputs (a multi-head model gets a ``[N]`` tensor of heads); a module
        taking ``task_labels`` once per head; a function ``model_fn(x, task) -> logits``
        once per stored task. Whatever the number of tasks, a step runs the same
        operations (the forward and backward of the network on ``N`` points, then a fixed
        handful on ``[B, L]``, no host sync); its arithmetic grows with the points
        (``N``) and blocks (``B L^2``). Returns 0 when no task is stored.
        """
        return self.terms(model_fn)[0]

    def terms(
        self,
        model_fn: ModelFn | nn.Module,
        *,
        replay: bool = False,
        replay_points: int | None = None,
        replay_weights: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """``(R(w), replay loss or None)`` from one evaluation of the memorable points:
        :meth:`penalty` and, with ``replay``, the sets' mean negative log-likelihoods of
        their points under their stored labels (:meth:`replay_loss`).

        Args:
            model_fn: the model (see :meth:`penalty`).
            replay: also return the replay loss.
            replay_points: the replay loss's estimator: ``b`` points drawn uniformly with
                replacement from each set at every call (torch's generator of the points'
                device), each set's mean NLL estimated by the mean over its ``b`` draws,
                which is unbiased: ``E[(1/b) sum_j l(x_{s,I_j})] = (1/M_s) sum_m l(x_{s,m})``
                for ``I_j`` uniform on the set. The model then sees the penalised points and
                the ``S b`` draws in one forward pass instead of all ``N`` points. None: every
                point, exactly. Used for a model called once on all points (a plain module
                or a :mod:`fromp` multi-head model); others evaluate every point.
            replay_weights: ``[S]`` weights ``b_s`` of the sets' mean NLLs (None: 1 each).
        """
        replay_points = check_count(replay_points, "replay_points")
        if not self.memories:
            return torch.zeros(()), (torch.zeros(()) if replay else None)
        st = self._stack()
        if replay and st.labels is None:
            self._unlabelled()
        single = isinstance(model_fn, nn.Module) and not takes_task_labels(model_fn)
        sample = replay and replay_points is not None and single
        layout_all = replay and not sample and not st.all_penalised
        drawn = None
        if sample:  # the penalised points and the draws in one forward pass
            drawn = st.draw(int(replay_points))  # type: ignore[arg-type]
            x_k, t_k = st.inputs(self.memories, "penalised")
            x_a, t_a = st.inputs(self.memories, "all")
            x, heads = torch.cat([x_k, x_a[drawn]]), torch.cat([t_k, t_a[drawn]])
            out = model_fn(x, task=heads) if getattr(model_fn, "n_heads", 1) > 1 else model_fn(x)
            f: Tensor | list[Tensor] = out[: len(x_k)]
            f_rep = out[len(x_k) :]
        else:
            f = self._joined_outputs(model_fn, st, "all" if layout_all else "penalised")
        if isinstance(f, Tensor):
            p = self.link(f).double()
        else:  # heads of different widths: the kept function zero-padded to the widest
            width = max(fi.shape[1] for fi in f)
            p = torch.cat(
                [F.pad(self.link(fi).double(), (0, width - fi.shape[1]))
                 for fi in f]
            )  # fmt: skip
        self._check_width(p.shape[1], st)
        key = (layout_all, p.shape[1])
        flat = st.flat.get(key)
        if flat is None:  # the index into p's flat storage, per layout and head width
            rows = st.rows_all if layout_all else st.rows
            flat = st.flat[key] = rows * p.shape[1] + st.cols
        r = torch.take(p, flat) - st.targets  # [B, L]
        if st.whiten_t is None:  # identity kernel
            r = r * st.mask
            pen = 0.5 * (r * r).sum()
        else:
            z = torch.matmul(r.unsqueeze(1), st.whiten_t)  # [B, 1, L]: (L_b^{-1} r_b)^T
            pen = 0.5 * (z * z).sum()
        if not replay:
            return pen, None
        assert st.labels is not None
        if drawn is not None:
            w = 1.0 / float(replay_points)  # type: ignore[arg-type]
            nll = self.likelihood.nll(f_rep, st.labels[drawn])
            if replay_weights is not None:
                nll = nll * replay_weights.to(nll)[st.point_set[drawn]]
            return pen, w * nll.sum()
        if isinstance(f, Tensor):
            w_all = st.weights.to(f.dtype)
            if replay_weights is not None:
                w_all = w_all * replay_weights.to(w_all)[st.point_set]
            return pen, (self.likelihood.nll(f, st.labels) * w_all).sum()
        return pen, self._replay(f, replay_weights)

    def replay_loss(self, model_fn: ModelFn | nn.Module) -> Tensor:
        """The memorable sets as labelled coresets: ``-sum_s (1 / M_s) sum_{m in s} log
        p(y_m | f(x_m; w))``, each earlier task's mean negative log-likelihood on its
        stored points, through its head (softmax cross-entropy for ``"categorical"``),
        summed over the tasks (weights per set and an estimator: :meth:`terms`). Needs the
        labels (``add_task(..., labels=)``)."""
        return self.terms(model_fn, replay=True)[1]

    def _unlabelled(self) -> None:
        for m in self.memories:
            if m.labels is None:
                raise ValueError(
                    f"the memorable set of task {m.task} has no labels: replay needs "
                    "add_task(..., labels=)"
                )

    def _replay(self, outputs: list[Tensor], weights: Tensor | None) -> Tensor:
        """:meth:`replay_loss` from per-set outputs of different widths."""
        total = None
        for j, (f, m) in enumerate(zip(outputs, self.memories)):
            assert m.labels is not None
            nll = self.likelihood.nll(f, m.labels.to(f.device)).sum() / len(m.labels)
            if weights is not None:
                nll = nll * weights.to(nll)[j]
            total = nll if total is None else total + nll
        assert total is not None
        return total

    def outputs(self, model_fn: ModelFn | nn.Module) -> list[Tensor]:
        """The model's outputs ``[k_s, C]`` on every stored set's penalised points, through
        its head.

        A plain module or a :mod:`fromp` model: all memorable inputs in one forward pass
        (a multi-head model gets a ``[N]`` tensor of heads). A module taking
        ``task_labels`` (Avalanche's ``MultiTaskModule``, heads of different widths): one
        call per distinct head, with all that head's points. A function
        ``(x, task) -> logits``: one call per set."""
        return self._outputs(model_fn, self._stack(), "penalised")

    def _outputs(self, model_fn: ModelFn | nn.Module, st: _Stack, layout: str) -> list[Tensor]:
        """:meth:`outputs` on the points of ``layout`` (``"all"`` or ``"penalised"``)."""
        full = layout == "all" or st.all_penalised
        xs = [m.inputs if full else m.inputs[: m.n_penalised] for m in self.memories]
        if isinstance(model_fn, nn.Module) and _takes_labels(model_fn):
            fn = task_fn(model_fn)
            by_task: dict[int | None, list[int]] = {}
            for i, m in enumerate(self.memories):
                by_task.setdefault(m.task, []).append(i)
            out: list[Tensor | None] = [None] * len(self.memories)
            for t, idx in by_task.items():
                x = torch.cat([xs[i] for i in idx])
                f = fn(x, t)
                for i, fi in zip(idx, f.split([len(xs[i]) for i in idx])):
                    out[i] = fi
            return out  # type: ignore[return-value]
        if isinstance(model_fn, nn.Module):
            return list(self._forward_all(model_fn, st, layout).split([len(x) for x in xs]))
        return [model_fn(x, m.task) for x, m in zip(xs, self.memories)]

    def _joined_outputs(
        self, model_fn: ModelFn | nn.Module, st: _Stack, layout: str
    ) -> Tensor | list[Tensor]:
        """The outputs on the points of ``layout`` as one ``[N, C]`` tensor (in the sets'
        order), or per set when the heads' widths differ."""
        if isinstance(model_fn, nn.Module) and not _takes_labels(model_fn):
            return self._forward_all(model_fn, st, layout)
        outputs = self._outputs(model_fn, st, layout)
        if len({f.shape[1] for f in outputs}) > 1:
            return outputs
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)

    def _forward_all(self, model: nn.Module, st: _Stack, layout: str) -> Tensor:
        """One forward pass of the points of ``layout`` (a multi-head :mod:`fromp` model
        gets their heads)."""
        x, heads = st.inputs(self.memories, layout)
        if getattr(model, "n_heads", 1) > 1:
            return model(x, task=heads)
        return model(x)

    def _stack(self) -> _Stack:
        """The stored sets as the batched quadratic form :meth:`terms` evaluates, built
        once after the sets change (:meth:`add_task`, :meth:`update`, :meth:`retarget`,
        :meth:`load_state_dict`, a new :attr:`memories` list)."""
        st = self._cache.get("stack")
        if st is None or st.count != len(self.memories):
            st = self._cache["stack"] = _Stack.of(self.memories, self.kernel)
        return st

    # ------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """All state: settings and, per task, inputs, head, targets, Cholesky factors."""
        return {
            "kernel": self.kernel,
            "function": self.function,
            "likelihood": self.likelihood.name,
            "jitter": self.jitter,
            "max_tries": self.max_tries,
            "chunk_size": self.chunk_size,
            "classes_seen": {k: list(v) for k, v in self.classes_seen.items()},
            "memories": [
                {
                    "inputs": m.inputs,
                    "task": m.task,
                    "targets": m.targets,
                    "chol": m.chol,
                    "jitter": m.jitter,
                    "units": m.units,
                    "labels": m.labels,
                    "penalised": m.penalised,
                }
                for m in self.memories
            ],
        }

    def load_state_dict(self, state: dict, *, device: torch.device | str | None = None) -> None:
        """Restore :meth:`state_dict` (tensors moved to ``device`` when given)."""
        missing = {"kernel", "memories"} - set(state)
        if missing:
            raise ValueError(f"state is missing keys {sorted(missing)}")
        if state["kernel"] not in _KERNELS:
            raise ValueError(f"state['kernel'] must be one of {_KERNELS}, got {state['kernel']!r}")
        function = state.get("function", "probs")  # states before 0.4: the probabilities
        if function not in _FUNCTIONS:
            raise ValueError(f"state['function'] must be one of {_FUNCTIONS}, got {function!r}")
        self.kernel = state["kernel"]
        self.function = function
        if "likelihood" in state and state["likelihood"] != self.likelihood.name:
            self.likelihood = get_likelihood(state["likelihood"])
        self.jitter = float(state.get("jitter", self.jitter))
        self.max_tries = int(state.get("max_tries", self.max_tries))
        self.chunk_size = int(state.get("chunk_size", self.chunk_size))
        self.classes_seen = {k: list(v) for k, v in state.get("classes_seen", {}).items()}

        def mv(t: Tensor | None) -> Tensor | None:
            return t if t is None or device is None else t.to(device)

        self.memories = [
            MemorableSet(
                mv(d["inputs"]),
                d["task"],
                mv(d["targets"]),
                mv(d["chol"]),
                d.get("jitter", 0.0),
                mv(d.get("units")),
                mv(d.get("labels")),
                d.get("penalised"),
            )
            for d in state["memories"]
        ]
        self._cache = {}

    def to(self, device: torch.device | str) -> FROMPRegularizer:
        """Move all stored tensors to ``device`` (in place); returns ``self``."""
        self.load_state_dict(self.state_dict(), device=device)
        return self
