"""EWC (Kirkpatrick et al., 2017) as a plain object for any PyTorch training loop: a
per-example Fisher diagonal per task, keyed by parameter name, and the quadratic penalty
(models and heads as in :mod:`fromp.continual.methods`).

The per-task penalties are consolidated into one quadratic (issue: per-step cost that grows
with the tasks learnt). With ``S = sum_t F_t`` and the Fisher-weighted mean anchor
``a~ = sum_t F_t w*_t / S`` (0 where ``S = 0``), for every parameter entry

    ``sum_t F_t (w - w*_t)^2 = S (w - a~)^2 + sum_t F_t (w*_t - a~)^2``,

the last term a constant. :class:`EWCMethod` keeps the per-task terms (to replace a task
learnt again exactly, and for checkpoints) and the consolidated ``S``, ``a~`` and constant,
rebuilt once per learnt task in float64, so that a training step costs one pass over the
parameters whatever the number of tasks (the form ``S w^2 - 2 w sum_t F_t w*_t + c`` would
lose the penalty to cancellation in float32 when ``w`` is near the anchors).

``ewc_lambda`` is on Avalanche's scale (``avalanche.training.EWC(ewc_lambda=...)``, 0.6):
Avalanche's penalty is ``lambda sum_t sum_p I_{t,p} (w_p - w*_{t,p})^2`` (no 1/2) with the
importance ``I_t = (1 / M) sum_b (grad_w L_b)^2``, ``L_b`` the mean loss of mini-batch ``b``
(``M`` mini-batches of ``B`` = the strategy's ``train_mb_size``, observed labels, eval mode).
Near a minimum ``I ~ F / B`` with ``F`` the per-example Fisher, so the per-example importances
here enter as ``F / B`` (``batch_size=B``): ``fisher="minibatch"`` is Avalanche's importance
itself, and ``ewc_lambda=x`` is then Avalanche's penalty to float rounding (tested against
Avalanche's ``EWCPlugin``). The former per-example scale, ``(lambda' / 2) sum F (w - w*)^2``,
is ``per_example_lambda=lambda'`` (``= 2 ewc_lambda / B``).

Under ``torch.distributed`` (:mod:`fromp.distributed`) :meth:`EWCMethod.learn_task` takes this
rank's shard of the experience and the Fisher is the sum over every rank's shard divided by
the total count: every rank ends with the Fisher of the union, as one process on all the
data."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import Tensor, nn

from fromp import distributed
from fromp._checks import (
    check_batch,
    check_chunk_size,
    check_class_targets,
    device_dtype,
    not_on_meta,
    probe_outputs,
)
from fromp.continual.experiences import forget_experience
from fromp.continual.graphed import Same, check_mode, param_key, static_term
from fromp.continual.methods import Named, by_name, fit_shape
from fromp.continual.protocol import ContinualMethod, Optim, TaskLabels, TaskStart
from fromp.curvature.diagonal import diag_ef, diag_fisher, diag_ggn
from fromp.likelihood import Likelihood, get_likelihood
from fromp.models import is_multitask, uncompiled, with_task

__all__ = ["EWCMethod", "ewc_penalty"]

_FISHERS = ("sampled", "empirical", "exact", "minibatch")

#: Prefixes that wrappers put before a model's parameter names: ``nn.DataParallel`` and
#: ``DistributedDataParallel`` (``module.``), ``torch.compile`` (``_orig_mod.``).
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def ewc_penalty(
    w: Tensor | Named,
    anchors: list[Tensor] | list[Named],
    importances: list[Tensor] | list[Named],
    ewc_lambda: float,
) -> Tensor:
    """``lambda sum_t sum_p F_{t,p} (w_p - w*_{t,p})^2`` (a scalar): Avalanche's EWC penalty
    for importances ``F_t`` on its scale (module docstring; the 1/2 of 0.3 is gone:
    halve ``ewc_lambda`` for the former value).

    ``w``, each anchor ``w*_t`` and each importance ``F_t`` are either flat ``[P]`` vectors
    or dicts ``{parameter name: tensor}``; with dicts, a parameter that a task's importance
    does not name (e.g. a head added after that task) gets no penalty from that task, and
    a parameter that grew since (new output units) is penalised on its old entries only."""
    if len(anchors) != len(importances):
        raise ValueError(
            f"anchors and importances must have equal lengths, got {len(anchors)} "
            f"and {len(importances)}"
        )
    terms = []
    for a, f in zip(anchors, importances):
        if isinstance(w, dict):
            for n, p in w.items():
                if n not in f:
                    continue
                old = tuple(slice(0, k) for k in f[n].shape)
                pn = p if p.shape == f[n].shape else p[old]
                terms.append((f[n] * (pn - a[n]) ** 2).reshape(-1))
        else:
            terms.append(f * (w - a) ** 2)
    total = (next(iter(w.values())) if isinstance(w, dict) else w).new_zeros(())
    for t in terms:
        total = total + t.sum()
    return ewc_lambda * total


def strip_wrappers(name: str) -> str:
    """``name`` without the leading wrapper prefixes (:data:`WRAPPER_PREFIXES`)."""
    while name.startswith(WRAPPER_PREFIXES):
        name = name.split(".", 1)[1]
    return name


def _unwrapped_names(names: list[str]) -> dict[str, str]:
    """``{name: name without wrapper prefixes}``, or the names as they are when stripping
    would merge two of them (a model whose own submodule is called ``module``)."""
    out = {n: strip_wrappers(n) for n in names}
    return out if len(set(out.values())) == len(out) else {n: n for n in names}


def _live(model: nn.Module) -> Named:
    """The trainable parameters by name without wrapper prefixes (differentiable): the
    anchors of a model trained plain apply to it wrapped by ``DataParallel`` or
    ``torch.compile``, and back."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    key = _unwrapped_names([n for n, _ in named])
    return {key[n]: p for n, p in named}


def _named(net: nn.Module, value: Tensor | Named) -> Named:
    """Detached per-parameter state keyed like :func:`_live` (a flat ``[P]`` vector split
    in ``net``'s parameter order; a dict's names stripped of wrapper prefixes)."""
    value = by_name(net, value)
    key = _unwrapped_names(list(value))
    return {key[n]: v for n, v in value.items()}


class _Consolidated:
    """``S = sum_t F_t``, ``a~ = sum_t F_t w*_t / S`` by parameter name and the constant
    ``c = sum_t sum_p F_t (w*_t - a~)^2`` (float64 sums, ``S`` and ``a~`` stored in the
    anchors' dtype): ``sum_t F_t (w - w*_t)^2 = S (w - a~)^2 + c`` entry by entry. A
    parameter that grew between tasks is summed in its largest shape, the entries a task
    did not have getting ``F_t = 0`` from it. A parameter whose ``S`` is 0 everywhere (a
    head no learnt task used) is left out: its terms are 0 in value and gradient, and a
    step then neither evaluates them nor gives the optimizer a zero gradient to apply
    (its gradient is the data term's alone, as without the penalty)."""

    def __init__(self, anchors: list[Named], importances: list[Named]) -> None:
        shapes: dict[str, tuple[int, ...]] = {}
        for f in importances:
            for n, v in f.items():
                old = shapes.get(n)
                if old is not None and len(old) != v.ndim:
                    raise ValueError(f"EWC importances of {n!r} change rank between tasks")
                shapes[n] = tuple(v.shape) if old is None else tuple(map(max, old, v.shape))
        self.curvature: Named = {}
        self.center: Named = {}
        const = 0.0
        for n, shape in shapes.items():
            s_f = s_fa = None
            parts = []
            for a, f in zip(anchors, importances):
                if n not in f:
                    continue
                fd, ad = f[n].double(), a[n].double()
                parts.append((fd, ad))
                ff, fa = fit_shape(fd, shape, 0.0), fit_shape(fd * ad, shape, 0.0)
                s_f = ff if s_f is None else s_f + ff
                s_fa = fa if s_fa is None else s_fa + fa
            assert s_f is not None and s_fa is not None
            if not bool(s_f.any()):  # read once per consolidation, not per step
                continue
            center = torch.where(s_f > 0, s_fa / torch.where(s_f > 0, s_f, 1.0), 0.0)
            for fd, ad in parts:
                old = tuple(slice(0, k) for k in fd.shape)
                const += float((fd * (ad - center[old]) ** 2).sum())
            dtype = next(a[n].dtype for a, f in zip(anchors, importances) if n in f)
            self.curvature[n] = s_f.to(dtype)
            self.center[n] = center.to(dtype)
        self.const = const

    def value(self, w: Named) -> Tensor:
        """``sum_p S_p (w_p - a~_p)^2 + c`` (a scalar, differentiable in ``w``): one pass
        over the parameters. The constant enters as a Python number (a kernel argument),
        never as a tensor made from it: on a GPU that would be a blocking host-to-device copy
        on every step."""
        ref = next(iter(w.values()))
        # differentiable even with no term (every importance 0): a 0 with a gradient path
        total = (ref.reshape(-1)[:1] * 0.0).sum() if not self.curvature else ref.new_zeros(())
        for n, s_f in self.curvature.items():
            p = w.get(n)
            if p is None:
                continue
            if p.shape != s_f.shape:
                if p.ndim != s_f.ndim or any(a < b for a, b in zip(p.shape, s_f.shape)):
                    raise ValueError(
                        f"parameter {n!r} has shape {tuple(p.shape)}, the EWC anchors "
                        f"{tuple(s_f.shape)}: parameters may only grow"
                    )
                p = p[tuple(slice(0, k) for k in s_f.shape)]
            total = total + (s_f * (p - self.center[n]) ** 2).sum()
        return total + self.const


class EWCMethod(ContinualMethod):
    """EWC with a per-example Fisher diagonal, for any training loop (no Avalanche needed).

    The importance of task ``t`` is ``F_t = (1 / N_t) sum_n diag(g_n g_n^T)`` ``[P]``,
    ``g_n = grad_w -log p(y_n | f_w(x_n))`` through head ``t``, with ``y_n`` sampled from
    the model (``fisher="sampled"``), the observed labels (``"empirical"``) or its exact
    expectation (``"exact"``: the GGN diagonal); ``"minibatch"`` is Avalanche's importance,
    ``F_t = B (1 / M) sum_b (grad_w L_b)^2`` over the task's ``M`` consecutive mini-batches of
    ``B = batch_size`` (``L_b`` their mean negative log-likelihood, observed labels). The
    penalty, on Avalanche's scale (module docstring), is

        ``(lambda / B) sum_{t < T} sum_p F_{t,p} (w_p - w*_{t,p})^2``          (separate)
        ``(lambda / B) sum_p F~_p (w_p - w*_{T-1,p})^2``, ``F~ <- gamma F~ + F_t``  (online)

    (``per_example_lambda=lambda'`` instead: ``lambda / B`` is ``lambda' / 2``, the scale of
    0.3). With ``fisher="minibatch"`` and ``B`` the training mini-batch size it
    is ``avalanche.training.EWC(ewc_lambda=lambda)``'s penalty.

    with ``w*_t`` the weights after task ``t``. Anchors and importances are dicts keyed by
    parameter name (without the ``module.`` / ``_orig_mod.`` prefixes of ``DataParallel``
    and ``torch.compile``), so a head added later is not penalised by earlier tasks and never
    shifts their entries. The separate mode's sum is consolidated into one quadratic (module
    docstring): a step costs one pass over the parameters whatever the number of tasks.

    Learning the same experience again (same ``experience`` key in :meth:`learn_task`)
    *replaces* its anchor and Fisher instead of adding a second one, as
    :class:`fromp.continual.methods.FROMPMethod` does (online mode: exactly when it is the last
    experience learnt; an earlier one, whose decayed contribution cannot be taken out of the
    running sum, is added again with a warning).

    Args:
        ewc_lambda: ``lambda`` on Avalanche's scale (give this or ``per_example_lambda``).
        mode: ``"separate"`` or ``"online"``.
        decay_factor: ``gamma`` of the online mode, applied once per learnt task after the
            first.
        fisher: ``"sampled"`` (default) | ``"empirical"`` | ``"exact"``.
        fisher_samples: labels drawn per example for ``"sampled"``.
        max_examples: use at most this many (random) examples for the Fisher (None: all).
        chunk_size: examples per vectorised per-example-gradient call.
        likelihood: a :class:`fromp.likelihood.Likelihood` or its name.
        batch_size: ``B``, the mini-batch size Avalanche's importance would use (its
            ``train_mb_size``; the strategy passes its own).
        per_example_lambda: ``lambda'``, the per-example scale of 0.3: penalty
            ``(lambda' / 2) sum_p F_p (w_p - w*_p)^2`` whatever ``batch_size``.
        cuda_graph: how a training step evaluates the penalty (:mod:`fromp.continual.graphed`):
            ``"auto"`` (default) replays one CUDA graph of its forward and backward pass
            when the network is on a CUDA device (captured again when the stored terms, the
            parameters or the loss dtype change), plain autograd elsewhere; ``"on"``: always
            the value and gradient in one call (on the CPU computed eagerly); ``"off"``:
            plain autograd. The same penalty to float rounding.

    Under ``torch.distributed`` :meth:`learn_task` takes this rank's shard and the Fisher
    sums over every rank's (module docstring); ``max_examples`` then caps each rank at
    ``max_examples // world_size`` examples.

    Example (a plain PyTorch loop, the continual-method protocol of
    :class:`fromp.continual.protocol.ContinualMethod`)::

        method = EWCMethod(ewc_lambda=6400.0, batch_size=128)
        for task, (x, y) in enumerate(tasks):
            method.begin_task(net, task=task, experience=task)
            for xb, yb in batches(x, y):
                out = with_task(net, task)(xb)
                loss = F.cross_entropy(out, yb)
                loss = loss + method.loss_terms(net, xb, out, task=task)
                ...
            method.learn_task(net, x, y, task, experience=task)
    """

    def __init__(
        self,
        ewc_lambda: float | None = None,
        *,
        mode: str = "separate",
        decay_factor: float = 1.0,
        fisher: str = "sampled",
        fisher_samples: int = 1,
        max_examples: int | None = None,
        chunk_size: int = 128,
        likelihood: str | Likelihood = "categorical",
        batch_size: int = 1,
        per_example_lambda: float | None = None,
        cuda_graph: str = "auto",
    ) -> None:
        super().__init__()
        if ewc_lambda is not None and per_example_lambda is not None:
            raise ValueError(
                "give one of ewc_lambda (Avalanche's scale) and per_example_lambda "
                f"(the per-example scale), got ewc_lambda={ewc_lambda!r}, "
                f"per_example_lambda={per_example_lambda!r}"
            )
        if ewc_lambda is None and per_example_lambda is None:
            ewc_lambda = 100.0  # Avalanche's scale
        name, value = (
            ("ewc_lambda", ewc_lambda)
            if per_example_lambda is None
            else ("per_example_lambda", per_example_lambda)
        )
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not value >= 0
            or not math.isfinite(value)
        ):
            raise ValueError(f"{name} must be a finite float >= 0, got {value!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if mode not in ("separate", "online"):
            raise ValueError(f"mode must be 'separate' or 'online', got {mode!r}")
        if not 0.0 <= decay_factor <= 1.0:
            raise ValueError(f"decay_factor must be in [0, 1], got {decay_factor}")
        if fisher not in _FISHERS:
            raise ValueError(f"fisher must be one of {_FISHERS}, got {fisher!r}")
        if (
            isinstance(fisher_samples, bool)
            or not isinstance(fisher_samples, int)
            or (fisher_samples < 1)
        ):
            raise ValueError(f"fisher_samples must be an int >= 1, got {fisher_samples!r}")
        if max_examples is not None and (
            isinstance(max_examples, bool) or not isinstance(max_examples, int) or max_examples < 1
        ):
            raise ValueError(f"max_examples must be an int >= 1 or None, got {max_examples!r}")
        chunk_size = check_chunk_size(chunk_size, allow_none=False)
        self.batch_size = int(batch_size)
        if per_example_lambda is not None:
            self.ewc_lambda = 0.5 * float(per_example_lambda) * self.batch_size
            self._coefficient = 0.5 * float(per_example_lambda)
        else:
            assert ewc_lambda is not None
            self.ewc_lambda = float(ewc_lambda)
            self._coefficient = self.ewc_lambda / self.batch_size
        self.mode, self.decay_factor = mode, decay_factor
        self.fisher, self.fisher_samples = fisher, int(fisher_samples)
        self.max_examples, self.chunk_size = max_examples, int(chunk_size)
        self.likelihood = get_likelihood(likelihood)
        self.anchors: list[Named] = []  # w*_t by parameter name
        self.importances: list[Named] = []  # F_t by name (online: a single decayed sum)
        # online mode: the running Fisher before the last experience was added (to replace
        # that experience exactly when it is learnt again)
        self._online_base: Named | None = None
        self._consolidated: tuple[tuple, _Consolidated, tuple] | None = None
        self._live: tuple[nn.Module, Named] | None = None  # the step's parameters by name
        self.cuda_graph = check_mode(cuda_graph)
        self._captured: dict = {}  # the captured penalty (graphed.static_term)

    def _terms(self, net: nn.Module) -> _Consolidated:
        """The consolidated penalty of the stored terms, rebuilt when they change (a learnt
        task, a loaded state, anchors assigned by hand). The key, the stored terms'
        identities, is read with C-level maps: no Python work per task on a step (the
        terms themselves are kept with it, so that an identity is not reused)."""
        key = (*map(id, self.anchors), None, *map(id, self.importances))
        if self._consolidated is not None and self._consolidated[0] == key:
            return self._consolidated[1]
        if len(self.anchors) != len(self.importances):
            raise ValueError(
                f"anchors and importances must have equal lengths, got {len(self.anchors)} "
                f"and {len(self.importances)}"
            )
        device = device_dtype(net)[0]
        anchors = [{n: v.to(device) for n, v in _named(net, a).items()} for a in self.anchors]
        importances = [
            {n: v.to(device) for n, v in _named(net, f).items()} for f in self.importances
        ]
        terms = _Consolidated(anchors, importances)
        self._consolidated = (key, terms, (tuple(self.anchors), tuple(self.importances)))
        return terms

    def penalty(self, net: nn.Module) -> Tensor:
        """The current penalty (scalar, differentiable in ``net``'s parameters):
        ``(lambda / B) (sum_p S_p (w_p - a~_p)^2 + c)`` (module docstring), one pass over
        the parameters. Refuses a ``net`` that has none of the parameter names the anchors
        hold (a renamed model: the penalty would silently be 0)."""
        return self._penalty(net, _live(net))

    def _penalty(self, net: nn.Module, w: Named) -> Tensor:
        """:meth:`penalty` of the trainable parameters ``w`` of ``net`` by name."""
        if not self.anchors:
            return next(iter(w.values())).new_zeros(())
        terms = self._terms(net)
        if terms.curvature and not any(n in w for n in terms.curvature):
            names = sorted(terms.curvature)
            raise ValueError(
                f"EWC penalty: none of the {len(names)} parameter names of the anchors (e.g. "
                f"{names[0]!r}) is a trainable parameter of the net (e.g. {next(iter(w))!r}): "
                "pass the network the method learnt (wrappers' 'module.' and '_orig_mod.' "
                "prefixes are handled)"
            )
        return self.coefficient * terms.value(w)

    # -------------------------------------------------------------- the protocol
    def _begin(self, net: nn.Module, start: TaskStart) -> None:
        """:meth:`begin_task` for EWC: the step's parameters are read from ``net`` again at
        the next :meth:`loss_terms` (after any growth); ``task``, ``ess``, ``classes`` and
        ``growing_head`` are not used."""
        del net, start
        self._live = None

    def _loss_terms(
        self, net: nn.Module, x: Tensor, output: Tensor, task: TaskLabels, loss: Tensor | None
    ) -> Tensor:
        """:meth:`loss_terms` for EWC: the weighted penalty :meth:`penalty` (0 before the
        first :meth:`learn_task` or with ``lambda = 0``), in ``loss``'s dtype when given;
        ``net``'s parameters by name are read once per experience (:meth:`begin_task`), not
        at every step. ``x``,
        ``output`` and ``task`` are not used."""
        del x, task
        dtype = output.dtype if loss is None else loss.dtype
        if not self.anchors or self.coefficient == 0:
            return output.new_zeros((), dtype=dtype)
        if self._live is None or self._live[0] is not net:
            self._live = (net, _live(net))
        w = self._live[1]
        value = self._fixed_penalty(net, w, dtype)
        if value is None:  # plain autograd
            value = self._penalty(net, w).to(dtype)
        self.last_terms = {"penalty": value.detach()}
        return value

    def _fixed_penalty(self, net: nn.Module, w: Named, dtype: torch.dtype) -> Tensor | None:
        """The penalty of the captured step (``cuda_graph``: value and gradient in one call,
        a CUDA graph on CUDA), or None for plain autograd. Captured again when its key
        changes: the consolidated terms, the parameters, the loss dtype, the coefficient."""
        params = tuple(w.values())
        key = (Same(self._terms(net)), param_key(params), dtype, self.coefficient)

        def fn() -> tuple[Tensor | None, ...]:
            return (self._penalty(net, w).to(dtype),)

        term = static_term(self._captured, self.cuda_graph, net, params, key, fn, "EWC")
        return None if term is None else term()[0]

    @property
    def coefficient(self) -> float:
        """The factor of ``sum_p F_p (w_p - w*_p)^2`` in the penalty: ``lambda / B`` (or
        ``lambda' / 2`` for ``per_example_lambda``)."""
        return self._coefficient

    @torch.no_grad()
    def fisher_diagonal(self, net: nn.Module, x: Tensor, y: Tensor, task: int | None) -> Tensor:
        """Per-example-averaged Fisher diagonal ``[P]`` of ``(x, y)`` through head ``task``
        (eval mode); under ``torch.distributed`` ``(x, y)`` is this rank's shard and the
        average is over every rank's examples (``"minibatch"``: over every rank's
        mini-batches)."""
        model = with_task(net, task)
        lik = self.likelihood
        was_training = net.training
        net.eval()
        try:
            with torch.enable_grad():
                if self.fisher == "sampled":
                    f = diag_fisher(
                        model,
                        (x, y),
                        lik,
                        n_samples=self.fisher_samples,
                        chunk_size=self.chunk_size,
                    )
                elif self.fisher == "empirical":
                    f = diag_ef(model, (x, y), lik, chunk_size=self.chunk_size)
                elif self.fisher == "exact":
                    f = diag_ggn(model, x, lik, chunk_size=self.chunk_size)
                else:
                    return _minibatch_importance(model, x, y, lik, self.batch_size)
        finally:
            net.train(was_training)
        count = f.new_tensor([float(len(x))])
        distributed.all_reduce_sum([f, count])
        return f / count

    def _learn(
        self, net: nn.Module, x: Tensor, y: Tensor, task: int | None, optimizer: Optim, key: int
    ) -> None:
        """:meth:`learn_task` for EWC: after training on task ``task`` with data ``x [N, ...]``,
        ``y [N]``: store the anchor ``w*`` and the Fisher (separate), or decay the running
        Fisher once and add the new one (online). A ``torch.compile``d ``net``: the Fisher
        is taken through the module inside (:func:`fromp.models.uncompiled`). Learning a key
        again replaces its anchor and Fisher instead of adding a second one; ``optimizer``
        is not used."""
        del optimizer
        net = uncompiled(net)
        not_on_meta(net)
        check_batch(x, "x")
        if not isinstance(y, Tensor) or len(y) != len(x):
            got = tuple(y.shape) if isinstance(y, Tensor) else type(y).__name__
            raise ValueError(f"y must be a tensor of N={len(x)} targets, got {got}")
        cap = self.max_examples
        if cap is not None and distributed.is_distributed():
            cap = max(1, cap // distributed.world_size())
        if cap is not None and len(x) > cap:
            idx = torch.randperm(len(x))[:cap]
            x, y = x[idx], y[idx]
        device, _ = device_dtype(net)
        task = task if is_multitask(net) else None
        was_training = net.training
        net.eval()
        try:  # x against the model (dtype, shape, a tensor output) before any work
            n_out = probe_outputs(with_task(net, task), x, n=1).shape[-1]
        finally:
            net.train(was_training)
        if self.fisher in ("empirical", "minibatch") and self.likelihood.name != "gaussian":
            check_class_targets(y, n_out, self.likelihood, "y")
        f = _named(net, self.fisher_diagonal(net, x.to(device), y.to(device), task))
        w = _named(net, _live(net))
        self._to(device)  # a state loaded on another device
        self._sync_experiences()
        i = forget_experience(self.experiences, key)
        if self.mode == "separate":
            if i is not None:  # learnt again: replace its term
                del self.anchors[i], self.importances[i]
            self.anchors.append(w)
            self.importances.append(f)
        else:
            if i is not None and i == len(self.experiences):  # the last one, learnt again
                base = self._online_base or {}  # the sum before it
            else:
                if i is not None:
                    warnings.warn(
                        f"EWC online mode: experience {key} learnt again after "
                        "others; its decayed Fisher cannot be taken out of the running sum, "
                        "so it is added again",
                        stacklevel=2,
                    )
                base = self.importances[0] if self.importances else {}
            decayed = {n: v * self.decay_factor for n, v in base.items()}
            summed = {}
            for n, v in f.items():
                if n in decayed:
                    summed[n] = fit_shape(decayed[n], v.shape, 0.0) + v
                else:
                    summed[n] = v
            self._online_base = base
            self.anchors = [w]
            self.importances = [{**decayed, **summed}]
        self._live = None

    def _to(self, device: torch.device) -> None:
        """The stored anchors, importances and online base on ``device``."""

        def mv(d: Named) -> Named:
            if all(v.device == device for v in d.values()):
                return d  # kept as it is (the consolidated penalty's cache key)
            return {n: v.to(device) for n, v in d.items()}

        self.anchors = [mv(a) for a in self.anchors]
        self.importances = [mv(f) for f in self.importances]
        self._online_base = None if self._online_base is None else mv(self._online_base)

    def _sync_experiences(self) -> None:
        """Experience keys for terms assigned by hand (``method.anchors = [...]``)."""
        n = len(self.anchors) if self.mode == "separate" else self.task_count
        if len(self.experiences) != n:
            self.experiences = list(range(n))

    def _settings(self) -> dict:
        return {
            "mode": self.mode,
            "decay_factor": self.decay_factor,
            "fisher": self.fisher,
            "fisher_samples": self.fisher_samples,
            "likelihood": self.likelihood.name,
        }

    def state_dict(self) -> dict:
        """Anchors and importances (``{name: tensor}`` per task, on the CPU), the task
        counter and the settings."""
        self._sync_experiences()
        base = self._online_base
        return {
            "anchors": [{n: v.cpu().clone() for n, v in a.items()} for a in self.anchors],
            "importances": [{n: v.cpu().clone() for n, v in f.items()} for f in self.importances],
            "task_count": self.task_count,
            "experiences": list(self.experiences),
            "online_base": None if base is None else {n: v.cpu().clone() for n, v in base.items()},
            **self._settings(),
        }

    def load_state_dict(
        self, state: dict[str, Any], *, device: torch.device | str | None = None
    ) -> None:
        """Restore what :meth:`state_dict` returned, tensors moved to ``device`` when given
        (else they move to the network's device at the first step). Refuses a state that
        lacks keys (all named) or was saved with other settings, before changing
        anything."""
        if not isinstance(state, dict):
            raise ValueError(f"state must be a dict, got {type(state).__name__}")
        keys = ("anchors", "importances", "task_count", "experiences", "online_base")
        missing = [k for k in (*keys, *self._settings()) if k not in state]
        if missing:
            raise ValueError(
                f"state is missing keys {missing}: not an EWCMethod.state_dict() of this version"
            )
        for key, value in self._settings().items():
            if state[key] != value:
                raise ValueError(
                    f"state was saved with {key}={state[key]!r}, method has {value!r}: "
                    "resume with the settings of the run"
                )

        def load(items: list) -> list[Named]:
            return [
                {n: v.detach().clone().to(device or v.device) for n, v in d.items()} for d in items
            ]

        anchors = load(state["anchors"])
        importances = load(state["importances"])
        if len(anchors) != len(importances):
            raise ValueError(f"state has {len(anchors)} anchors and {len(importances)} importances")
        base = state["online_base"]
        self.anchors, self.importances = anchors, importances
        self.experiences = [int(k) for k in state["experiences"]]
        self._online_base = None if base is None else load([base])[0]
        self._consolidated, self._live = None, None
        self._sync_experiences()


def _minibatch_importance(
    model: nn.Module, x: Tensor, y: Tensor, likelihood: Likelihood, batch_size: int
) -> Tensor:
    """Avalanche's EWC importance times ``B``: ``B (1 / M) sum_b (grad_w L_b)^2`` ``[P]``,
    ``L_b`` the mean negative log-likelihood of the ``b``-th of the ``M`` consecutive
    mini-batches of ``B = batch_size`` examples (the last one may be smaller), in the order
    of the parameters of ``model``. Under ``torch.distributed`` the sum and ``M`` run over
    every rank's mini-batches."""
    params = list(model.parameters())
    live = [p for p in params if p.requires_grad]
    total = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=x.device)
    for s in range(0, len(x), batch_size):
        loss = likelihood.nll(model(x[s : s + batch_size]), y[s : s + batch_size]).mean()
        grads = dict(zip(map(id, live), torch.autograd.grad(loss, live, allow_unused=True)))
        total += torch.cat(
            [
                (torch.zeros_like(p) if grads.get(id(p)) is None else grads[id(p)]).reshape(-1) ** 2
                for p in params
            ]
        )
    count = total.new_tensor([float(-(-len(x) // batch_size))])
    distributed.all_reduce_sum([total, count])
    return total * batch_size / count
