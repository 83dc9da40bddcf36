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
* ``"identity"``: ``K = I`` (FROMP-L2), ``R = 1/2 ||p(X; w) - m||^2``.

``K`` is the DNN2GP kernel (:class:`fromp.gp.GP`) of ``p = inverse_link(f)`` linearised
at the current weights under ``N(w, Sigma)``. The kernels are factorised once per
:meth:`FROMPRegularizer.add_task` / :meth:`update` call (float64 Cholesky,
``K + jitter I``; larger jitter, with a warning, when the factorisation fails), so every
training step costs only forward/backward passes on the memorable inputs and ``[M, M]``
triangular solves.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fromp._checks import check_batch, check_chunk_size, check_tensor, check_vector, device_dtype
from fromp.curvature.jacobian import flat_params, num_params
from fromp.gp.process import GP
from fromp.likelihood import Likelihood, get_likelihood
from fromp.models import takes_task_labels, with_task
from fromp.posterior import DiagonalGaussian

__all__ = ["FROMPRegularizer", "FunctionKernel", "MemorableSet", "prob_jacobian", "task_fn"]

ModelFn = Callable[[Tensor, int], Tensor]
FunctionKernel = Callable[[nn.Module, Tensor, "int | None"], Tensor]
"""``(model, x [M, ...], task) -> J(x) Sigma J(x)^T`` ``[M, C, M, C]``: the DNN2GP kernel of
the outputs ``f`` through head ``task`` under a posterior of any structure (e.g. a fitted
Kronecker :func:`fromp.Laplace`); FROMP maps it to the probabilities' kernel."""
_KERNELS = ("per_class", "joint", "identity")


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
    module: nn.Module, likelihood: Likelihood, variance: Tensor | None, chunk_size: int
) -> GP:
    """The DNN2GP :class:`~fromp.gp.GP` of ``p = inverse_link(module(x))`` linearised at the
    module's current weights, under ``Sigma = diag(variance)`` (``variance`` ``[P]``; None: the
    identity). A zero variance is taken as the smallest positive float64 (its whitened
    Jacobian column is then zero to working precision)."""
    mean = flat_params(module)
    if variance is None:
        precision = torch.ones_like(mean)
    else:
        precision = variance.double().clamp_min(torch.finfo(torch.float64).tiny).reciprocal()
    posterior = DiagonalGaussian(mean, precision.to(mean.device))
    return GP(_InverseLink(module, likelihood), posterior, likelihood, chunk_size=chunk_size)


def _gp_kernel(gp: GP, x: Tensor, diagonal_outputs: bool) -> Tensor:
    """``gp.kernel(x)``; the per-example Jacobian way when the structured evaluator's
    one-example layer capture fails on the model (a model that squeezes the batch
    dimension of a single example, Avalanche's ``MTSimpleCNN``, feeds its last layer a
    ``[D]`` input instead of ``[1, D]``)."""
    try:
        return gp.kernel(x, diagonal_outputs=diagonal_outputs)
    except RuntimeError as err:
        if isinstance(err, torch.OutOfMemoryError):
            raise
        return gp.kernel(x, diagonal_outputs=diagonal_outputs, method="jacobian")


def _select_units(k: Tensor, units: Tensor, kernel: str, m: int) -> Tensor:
    """The kernel ``k`` of :meth:`FROMPRegularizer.kernel_matrix` on ``m`` points restricted
    to the output units ``units``: ``[C, M, M] -> [C_s, M, M]`` (per class),
    ``[1, C M, C M] -> [1, C_s M, C_s M]`` (joint, class-major)."""
    units = units.to(k.device)
    if kernel == "per_class":
        return k if len(units) == k.shape[0] else k[units]
    c = k.shape[-1] // m
    if len(units) == c:
        return k
    k4 = k.reshape(c, m, c, m)[units][:, :, units]
    return k4.reshape(1, len(units) * m, len(units) * m)


def prob_jacobian(
    module: nn.Module,
    x: Tensor,
    output: int,
    likelihood: str | Likelihood = "categorical",
    *,
    chunk_size: int = 64,
) -> Tensor:
    """``d p_c(x_m) / d w`` for one output ``c`` and every input: ``[M, P]``.

    ``p = likelihood.inverse_link(module(x))`` (softmax probabilities for
    ``"categorical"``), so the rows are those of ``Lambda(f) J`` for the canonical links.
    Per-example Jacobians of the :class:`~fromp.gp.GP` of ``p`` (:meth:`~fromp.gp.GP.jacobians`)
    over chunks of ``chunk_size`` examples; memory ``chunk_size * C * P`` numbers besides the
    ``M * P`` of the result. Batch-norm and dropout layers must be in eval mode.
    """
    gp = _prob_gp(module, get_likelihood(likelihood), None, chunk_size)
    x = check_batch(x, "x")
    return torch.cat(
        [gp.jacobians(x[s : s + chunk_size])[:, output] for s in range(0, len(x), chunk_size)]
    )


@dataclass
class MemorableSet:
    """One finished task's memorable past.

    Attributes:
        inputs: ``[M, ...]`` memorable inputs.
        task: the head (task id) whose outputs are regularised.
        targets: ``[M, C]`` float64 old predictions ``m``.
        chol: float64 lower Cholesky factors of ``K + jitter I``: ``[C, M, M]`` per class,
            ``[1, C M, C M]`` joint, None for the identity kernel.
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
    """

    inputs: Tensor
    task: int
    targets: Tensor
    chol: Tensor | None
    jitter: float = 0.0
    units: Tensor | None = None
    labels: Tensor | None = None


class FROMPRegularizer:
    """Functional regulariser ``1/2 sum_s r_s^T K_s^{-1} r_s`` over finished tasks.

    Args:
        kernel: ``"per_class"``, ``"joint"`` or ``"identity"`` (FROMP-L2).
        likelihood: defines ``p = inverse_link(f)`` (``"categorical"``: softmax).
        jitter: added to every kernel's diagonal (FROMP uses 1e-6 on split MNIST, 1e-5 on
            permuted MNIST).
        max_tries: when the Cholesky factorisation fails, the jitter is multiplied by 10
            (from at least ``1e-10 * mean(diag K)``) up to this many times, with a warning;
            a ``RuntimeError`` is raised if it still fails.
        chunk_size: examples per Jacobian chunk when computing kernels (``GP.kernel``).

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
    ) -> None:
        if kernel not in _KERNELS:
            raise ValueError(f"kernel must be one of {_KERNELS}, got {kernel!r}")
        if not jitter >= 0:
            raise ValueError(f"jitter must be >= 0, got {jitter!r}")
        if max_tries < 0:
            raise ValueError(f"max_tries must be >= 0, got {max_tries!r}")
        chunk_size = check_chunk_size(chunk_size, allow_none=False)  # type: ignore[assignment]
        self.kernel = kernel
        self.likelihood = get_likelihood(likelihood)
        self.jitter = float(jitter)
        self.max_tries = int(max_tries)
        self.chunk_size = int(chunk_size)
        self.memories: list[MemorableSet] = []
        #: per head (task id), the classes (output units) trained so far; when a head has
        #: an entry, its sets are regularised on those units only (see MemorableSet.units)
        self.classes_seen: dict[int | None, list[int]] = {}
        self._cache: dict = {}

    def __len__(self) -> int:
        return len(self.memories)

    @property
    def num_points(self) -> int:
        """Total number of memorable inputs over all tasks."""
        return sum(len(m.inputs) for m in self.memories)

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
        ``[1, C M, C M]`` for ``"joint"``, an identity ``[1, C M, C M]`` for ``"identity"``.

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
        module = with_task(model, task)
        x = check_batch(x, "x")
        if self.kernel == "identity":
            with torch.no_grad():
                c_out = module(x[:1]).shape[1]
            return torch.eye(c_out * len(x), dtype=torch.float64, device=x.device).unsqueeze(0)
        if callable(posterior_variance):
            k = self._prob_kernel(module, x, posterior_variance(model, x, task))
        else:
            var = self._check_variance(model, posterior_variance)
            gp = _prob_gp(module, self.likelihood, var, self.chunk_size)
            k = _gp_kernel(gp, x, self.kernel == "per_class").double()
            if not bool((var > 0).any()):  # Sigma = 0: K = 0
                k = torch.zeros_like(k)
            if self.kernel == "per_class":
                return k
        if self.kernel == "per_class":
            return torch.diagonal(k, dim1=1, dim2=3).permute(2, 0, 1).contiguous()
        m, c = k.shape[:2]  # [M, C, M, C] -> class-major [C M, C M]
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
        a = torch.func.vmap(torch.func.jacrev(self.likelihood.inverse_link))(f)  # [M, C, C]
        return torch.einsum("mca,manb,ndb->mcnd", a, kf.double(), a)

    def _check_variance(
        self, model: nn.Module, v: Tensor | FunctionKernel
    ) -> Tensor | FunctionKernel:
        if callable(v):
            return v
        v = check_vector(v, num_params(model), "posterior_variance", nonnegative=True)
        return v.detach().double()

    def _cholesky(self, k: Tensor, what: str) -> tuple[Tensor, float]:
        eye = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
        jitter = self.jitter
        chol, info = torch.linalg.cholesky_ex(k + jitter * eye)
        if not bool((info != 0).any()):
            return chol, jitter
        scale = float(torch.diagonal(k, dim1=-2, dim2=-1).abs().mean())
        jitter = max(jitter, 1e-10 * scale, 1e-12)
        for _ in range(self.max_tries):
            chol, info = torch.linalg.cholesky_ex(k + jitter * eye)
            if not bool((info != 0).any()):
                warnings.warn(
                    f"kernel of {what} is not positive definite with jitter {self.jitter:g}; "
                    f"added jitter {jitter:g} to its diagonal",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return chol, jitter
            jitter *= 10
        raise RuntimeError(
            f"Cholesky factorisation of the kernel of {what} failed even with jitter "
            f"{jitter / 10:g} (max_tries={self.max_tries}); the kernel may contain NaN/inf"
        )

    def _build(
        self,
        model: nn.Module,
        x: Tensor,
        task: int | None,
        variance: Tensor | FunctionKernel,
        labels: Tensor | None = None,
    ) -> MemorableSet:
        module = with_task(model, task)
        with torch.no_grad():
            p = self.likelihood.inverse_link(module(x))
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
        targets = p.double()[:, units]
        if self.kernel == "identity":
            return MemorableSet(x, task, targets, None, 0.0, units, labels)
        k = self.kernel_matrix(model, x, task, variance)
        k = _select_units(k, units, self.kernel, len(x))
        chol, jitter = self._cholesky(k, f"task {task}")
        return MemorableSet(x, task, targets, chol, jitter, units, labels)

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
        """
        check_batch(x_mem, "x_mem")
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
        if update_previous:
            self.update(model, var)
        self.memories.append(self._build(model, x_mem.detach().to(device), task, var, labels))
        self._cache = {}

    def update(self, model: nn.Module, posterior_variance: Tensor | FunctionKernel) -> None:
        """Recompute every stored task's targets and kernel at the current parameters and
        ``posterior_variance`` (inputs and heads are kept)."""
        var = self._check_variance(model, posterior_variance)
        self.memories = [self._build(model, m.inputs, m.task, var, m.labels) for m in self.memories]
        self._cache = {}

    def retarget(self, model_fn: ModelFn | nn.Module) -> None:
        """Set every stored set's targets to the model's present outputs through
        :meth:`outputs` (the evaluation the penalty uses: e.g. batch-norm layers on the
        statistics of the memorable batch), on the units each set is stored on."""
        for f, m in zip(self.outputs(model_fn), self.memories):
            p = self.likelihood.inverse_link(f).detach().double()
            m.targets = p[:, m.units] if m.units is not None else p[:, : m.targets.shape[1]]
        self._cache = {}

    def residuals(self, model_fn: ModelFn | nn.Module) -> list[Tensor]:
        """``r_s = p(X_s; w) - m_s`` for every stored task, each ``[M, C_s]`` float64.

        ``C_s`` are the units the set was stored on (:attr:`MemorableSet.units`: the units
        not masked at the time). A head that has grown since (an incremental classifier
        adds or unmasks output units for new classes: ``p`` is ``[M, C']``) is compared on
        those units, the softmax taken over all ``C'`` units (masked units, at ``-1000``,
        have probability 0): keeping the old classes' probabilities keeps the new units'
        mass near zero on the memorable past."""
        return [self._residual(f, m) for f, m in zip(self.outputs(model_fn), self.memories)]

    def _residual(self, f: Tensor, m: MemorableSet) -> Tensor:
        p = self.likelihood.inverse_link(f).double()
        need = m.targets.shape[1] if m.units is None else int(m.units.max()) + 1
        if p.shape[1] < need:
            raise ValueError(
                f"the head of task {m.task} has {p.shape[1]} outputs, fewer than the "
                f"{need} it had when its memorable set was stored"
            )
        if m.units is None:
            return p[:, :need] - m.targets
        return p[:, m.units] - m.targets

    def penalty(self, model_fn: ModelFn | nn.Module) -> Tensor:
        """``R(w) = 1/2 sum_s r_s^T K_s^{-1} r_s``, a differentiable scalar.

        ``K_s^{-1} r_s`` is a Cholesky solve that is differentiable in ``r_s``; since
        ``K_s`` is constant, one backward pass gives exactly
        ``sum_s (dp(X_s)/dw)^T K_s^{-1} r_s``. ``model_fn(x, task) -> logits`` is called once
        per stored task. A :mod:`fromp` model (or a plain ``x -> logits`` module) may be
        passed instead: then all memorable inputs go through one forward pass (a multi-head
        model gets a ``[N]`` tensor of heads) and the solves of equal-sized kernels are
        batched. Returns 0 when no task is stored.
        """
        return self.terms(model_fn)[0]

    def terms(
        self, model_fn: ModelFn | nn.Module, *, replay: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """``(R(w), replay loss or None)`` from one evaluation of the memorable points:
        :meth:`penalty`, and with ``replay`` the tasks' mean negative log-likelihoods of the
        memorable points under their stored labels (:meth:`replay_loss`)."""
        if not self.memories:
            return torch.zeros(()), (torch.zeros(()) if replay else None)
        outputs = self.outputs(model_fn)
        residuals = [self._residual(f, m) for f, m in zip(outputs, self.memories)]
        return self._penalty(residuals), (self._replay(outputs) if replay else None)

    def replay_loss(self, model_fn: ModelFn | nn.Module) -> Tensor:
        """The memorable sets as labelled coresets: ``-sum_s (1 / M_s) sum_{m in s} log
        p(y_m | f(x_m; w))``, each earlier task's mean negative log-likelihood on its
        stored points, through its head (softmax cross-entropy for ``"categorical"``),
        summed over the tasks. Each set stands in for its task's data term, which the
        current task's mean loss weighs 1: after ``t`` tasks the coreset weighs ``t``
        against the new task's 1, as the tasks' classes do in a class-incremental stream
        (one mean over all the points instead gave the ``2 t`` old classes together the
        weight of the 2 new ones: split MNIST after 5 experiences 90.2 % against Replay's
        90.0 %). Needs the labels (``add_task(..., labels=)``)."""
        return self.terms(model_fn, replay=True)[1]

    def _replay(self, outputs: list[Tensor]) -> Tensor:
        total = None
        for f, m in zip(outputs, self.memories):
            if m.labels is None:
                raise ValueError(
                    f"the memorable set of task {m.task} has no labels: replay needs "
                    "add_task(..., labels=)"
                )
            nll = self.likelihood.nll(f, m.labels.to(f.device)).sum() / len(m.labels)
            total = nll if total is None else total + nll
        assert total is not None
        return total

    def outputs(self, model_fn: ModelFn | nn.Module) -> list[Tensor]:
        """The model's outputs ``[M_s, C]`` on every stored memorable set, through its head.

        A plain module or a :mod:`fromp` model: all memorable inputs in one forward pass
        (a multi-head model gets a ``[N]`` tensor of heads). A module taking
        ``task_labels`` (Avalanche's ``MultiTaskModule``, heads of different widths): one
        call per distinct head, with all that head's points. A function
        ``(x, task) -> logits``: one call per set."""
        if isinstance(model_fn, nn.Module) and takes_task_labels(model_fn):
            fn = task_fn(model_fn)
            by_task: dict[int | None, list[int]] = {}
            for i, m in enumerate(self.memories):
                by_task.setdefault(m.task, []).append(i)
            out: list[Tensor | None] = [None] * len(self.memories)
            for t, idx in by_task.items():
                x = torch.cat([self.memories[i].inputs for i in idx])
                f = fn(x, t)
                for i, fi in zip(idx, f.split([len(self.memories[i].inputs) for i in idx])):
                    out[i] = fi
            return out  # type: ignore[return-value]
        if isinstance(model_fn, nn.Module):
            return self._outputs_batched(model_fn)
        return [model_fn(m.inputs, m.task) for m in self.memories]

    def _penalty(self, residuals: list[Tensor]) -> Tensor:
        if self.kernel == "identity":
            return 0.5 * sum((r * r).sum() for r in residuals)
        # group the right-hand sides by kernel size: one batched solve per group
        groups: dict[int, list[int]] = {}
        for i, m in enumerate(self.memories):
            groups.setdefault(m.chol.shape[-1], []).append(i)
        total = None
        for idx in groups.values():
            if self.kernel == "per_class":
                rr = torch.cat([residuals[i].T.unsqueeze(-1) for i in idx])  # [sum C, M, 1]
            else:
                rr = torch.cat([residuals[i].T.reshape(1, -1, 1) for i in idx])
            chol = self._stacked_chol(tuple(idx))
            term = 0.5 * (rr * torch.cholesky_solve(rr, chol)).sum()
            total = term if total is None else total + term
        return total

    def _stacked_chol(self, idx: tuple[int, ...]) -> Tensor:
        key = ("chol", idx)
        if key not in self._cache:
            self._cache[key] = torch.cat([self.memories[i].chol for i in idx])
        return self._cache[key]

    def _outputs_batched(self, model: nn.Module) -> list[Tensor]:
        if "x" not in self._cache:
            self._cache["x"] = torch.cat([m.inputs for m in self.memories])
            tasks = [0 if m.task is None else int(m.task) for m in self.memories]
            self._cache["task"] = torch.cat(
                [
                    torch.full((len(m.inputs),), t, dtype=torch.long, device=m.inputs.device)
                    for m, t in zip(self.memories, tasks)
                ]
            )
            self._cache["sizes"] = [len(m.inputs) for m in self.memories]
        x, task = self._cache["x"], self._cache["task"]
        if getattr(model, "n_heads", 1) > 1:
            f = model(x, task=task)
        else:
            f = model(x)
        return list(f.split(self._cache["sizes"]))

    # ------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """All state: settings and, per task, inputs, head, targets, Cholesky factors."""
        return {
            "kernel": self.kernel,
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
        self.kernel = state["kernel"]
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
            )
            for d in state["memories"]
        ]
        self._cache = {}

    def to(self, device: torch.device | str) -> FROMPRegularizer:
        """Move all stored tensors to ``device`` (in place); returns ``self``."""
        self.load_state_dict(self.state_dict(), device=device)
        return self


def _former_name(stacklevel: int = 2) -> type[FROMPRegularizer]:
    """``FunctionalRegularizer``, the former name of :class:`FROMPRegularizer` (deprecated)."""
    warnings.warn(
        "FunctionalRegularizer is deprecated: use FROMPRegularizer",
        DeprecationWarning,
        stacklevel=stacklevel + 1,
    )
    return FROMPRegularizer


def __getattr__(name: str) -> object:
    if name == "FunctionalRegularizer":
        return _former_name(stacklevel=2)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
