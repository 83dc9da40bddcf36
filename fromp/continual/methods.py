"""Continual-learning methods as plain objects for any PyTorch training loop.

Each object holds one method's state and maths and knows nothing of Avalanche; all
implement one protocol (:class:`fromp.continual.protocol.ContinualMethod`), which the
Avalanche plugins of :mod:`fromp_avalanche` call from their hooks and nothing else:

* :class:`FROMPMethod` (here): FROMP (Pan et al., NeurIPS 2020), its whole training step,
  per-experience memorable sets, kernels and the running GGN sum.
* :class:`fromp.continual.ewc.EWCMethod`: EWC (Kirkpatrick et al., 2017) with a per-example Fisher
  diagonal keyed by parameter name.
* :class:`fromp.continual.vcl.VCLMethod`: VCL (Nguyen et al., 2018), mean-field Gaussian.

Models: a plain ``x -> logits`` module (one head), a :mod:`fromp` multi-head model
(``model(x, task=t)``), or a module whose ``forward(x, task_labels)`` takes the task label
(Avalanche's ``MultiTaskModule`` convention, e.g. ``MTSimpleMLP`` with a
``MultiHeadClassifier``); see :func:`fromp.models.with_task`. Everything computed for task
``t`` (memorable points, targets, kernels, GGN, Fisher) goes through head ``t``. State is
keyed by parameter name; a parameter that grows (an incremental classifier adding output
units) keeps its old entries in the leading slice and new entries start from the prior.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fromp import distributed
from fromp._checks import (
    check_batch,
    check_count,
    check_prior_precision,
    device_dtype,
    not_on_meta,
)
from fromp.continual.experiences import forget_experience
from fromp.continual.graphed import Same, check_mode, param_key, static_term, trainable
from fromp.continual.memorable import _ORDERS as _SELECT
from fromp.continual.memorable import global_classes, select_memorable
from fromp.continual.named_state import (
    Named,
    _check_labels,
    _clock,
    _norm_buffers,
    _swapped_buffers,
    by_name,
    fit_shape,
    to_flat,
)
from fromp.continual.protocol import ContinualMethod, Optim, TaskLabels, TaskStart
from fromp.continual.regularizer import _FUNCTIONS, _KERNELS, FROMPRegularizer, FunctionKernel
from fromp.curvature.diagonal import diag_ggn, diag_ggn_linear
from fromp.curvature.jacobian import default_memory_budget, flat_params
from fromp.curvature.kron import KronCurvature, kron_curvature
from fromp.laplace.structures import DiagLaplace, KronLaplace
from fromp.likelihood import get_likelihood
from fromp.models import TaskView, is_multitask, uncompiled, with_task
from fromp.optim import IVON, VOGN
from fromp.posterior import DiagonalGaussian

__all__ = ["FROMPMethod", "Named", "by_name", "fit_shape", "to_flat"]

#: what ``tau="auto"`` resolves to on a class-incremental stream (see FROMPMethod's
#: docstring, "Class-incremental streams"; measured in docs/results-details.md)
CI_TAU = 1.0
_POSTERIORS = ("ggn", "kron", "vogn", "ivon")
_OWN_CURVATURE = ("ggn", "kron")  # curvature computed by the method, not by an optimizer
_IVON_PENALTY = ("mean", "sample")
_BN_STATISTICS = ("stored", "live", "batch")
_CURVATURE_COMBINE = ("sum", "mean")
#: the keys of FROMPMethod.state_dict(), all required by load_state_dict
_STATE_KEYS = (
    "tau",
    "n_points",
    "select",
    "prior_precision",
    "grad_clip_norm",
    "posterior",
    "ivon_penalty",
    "curvature_examples",
    "chunk_size",
    "likelihood",
    "kernel",
    "function",
    "jitter",
    "replay",
    "replay_weight",
    "bn_statistics",
    "context_tau",
    "curvature_combine",
    "memory_batch",
    "class_incremental",
    "examples",
    "previous",
    "bn_buffers",
    "ggn_sum",
    "optimizer_variance",
    "ggn_terms",
    "kron_terms",
    "experiences",
    "regularizer",
    "task_count",
    "generator",
    "timings",
)
#: the settings a state must have been saved with to be loaded (see load_state_dict)
_SETTINGS = (
    "n_points",
    "replay",  # before select: replay=True changes select's default, name the cause
    "replay_weight",
    "select",
    "prior_precision",
    "posterior",
    "ivon_penalty",
    "curvature_examples",
    "likelihood",
    "kernel",
    "jitter",
    "bn_statistics",
    "context_tau",
    "curvature_combine",
    "memory_batch",
)


class FROMPMethod(ContinualMethod):
    """FROMP's state and maths for any training loop (no Avalanche needed): the whole
    training step and the work after each experience, a
    :class:`fromp.continual.protocol.ContinualMethod`.

    After each experience ``e`` (task label ``t``) :meth:`learn_task` selects ``n_points``
    memorable inputs (class-balanced, largest ``tr Lambda``), adds the experience's
    diagonal GGN ``G_e`` ``[P]`` (through head ``t``) to ``G = sum_e G_e``, and rebuilds the
    kernels ``K_s = (dp/dw) Sigma (dp/dw)^T`` ``[C, M, M]`` with
    ``Sigma = 1 / (G + prior_precision)`` (the diagonal Laplace posterior,
    :class:`fromp.laplace.structures.DiagLaplace`); :meth:`penalty` is
    ``R(w) = 1/2 sum_s r_s^T K_s^{-1} r_s``, ``r_s = p(X_s; w) - m_s``. State is kept by
    parameter name, so a head added later (a new task) starts from the prior and never
    shifts the others.

    A training step (:meth:`loss_terms`, then :meth:`before_update` between the backward
    pass and the optimizer's step) is FROMP's whole step, the one the Avalanche strategy and
    the benchmark runner take: the loss gets ``tau R`` (at IVON's mean instead, through
    :meth:`before_update`, for ``posterior="ivon"`` with ``ivon_penalty="mean"``), the
    coreset's loss (``replay=True``) and the context term (``context_tau > 0``, per task
    label in the batch); the gradient is clipped at ``tau * grad_clip_norm``; in the first
    steps of an experience a warning (once) says when ``tau R`` dominates the loss.

    Learning the same experience again (same ``experience`` key) *replaces* its GGN term
    and its memorable set: :meth:`learn_task` is idempotent per experience.

    Class-incremental streams. When an experience brings classes to a head that earlier
    experiences trained (:meth:`begin_task`'s ``classes`` beyond those the head was trained
    on, a head that grows with the classes: ``growing_head``, Avalanche's
    ``IncrementalClassifier``; or, in a loop that tells neither, labels beyond the trained
    ones, or a first experience whose labels leave output units of the one head unused) the
    stream is class-incremental (:attr:`class_incremental`) and the ``"auto"`` settings
    resolve for one head that must tell every class seen apart:

    * ``replay`` -> True: the memorable sets are replayed as labelled coresets (a penalty on
      the function alone does not teach the head to tell old classes from new ones), drawn
      at random per class (``select``);
    * ``function`` -> ``"logits"`` (whose kernels keep their scale on a many-class head; the
      probabilities when the user turned the coreset off);
    * ``kernel`` -> ``"per_point"`` with the logits: each memorable point's ``[C, C]``
      covariance ``J(x_m) Sigma J(x_m)^T`` of its outputs (the DNN2GP kernel without the
      terms between points), whose cost is linear in the points, so the penalty covers
      every stored point (``"per_class"`` with the probabilities, whose covariance per
      point is singular);
    * ``replay_weight`` -> each replayed point weighted as the ``N_s / M_s`` examples of its
      experience it stands for: ``b_s = N_s / (S M_s)`` (:meth:`set_weights`);
    * ``tau`` -> :data:`CI_TAU` (the context term stays off: on one head it holds the old
      classes' outputs on the new classes' inputs, which must fall for the new classes to
      win, and cost the newest experience 4-8 points);
    * ``memory_batch`` -> every stored point at every step, the penalty and the coreset's
      loss exactly, in one forward pass. Not drawn: an estimate of the coreset's loss from
      ``ceil(B / S)`` draws per set, weighted ``b_s``, is unbiased but so noisy that Adam's
      steps shrink and the newest classes are learnt less (split MNIST at a fifth of the
      data: 89.6 % on the newest experience against 93.3 % exact). With a kernel whose cost
      grows with the square of the points (``"per_class"``, ``"joint"``: ``C M^2 P``
      multiply-adds per set after each experience) the penalty covers the first ``ceil(B /
      S)`` points of each of the ``S`` sets instead, ``B`` the training batch's size.

    Elsewhere (a head per task, one head that every experience fills) they keep the paper's
    values: ``tau = 10``, no coreset, no context term, every point every step. A setting
    given explicitly is kept; a coreset turned off (``replay=False``) on a class-incremental
    stream gets a warning at the start of each experience that brings new classes.

    Example (a plain PyTorch loop: two experiences of a one-head classifier whose classes
    arrive one experience at a time, a class-incremental stream):

        >>> import torch
        >>> import torch.nn.functional as F
        >>> _ = torch.manual_seed(0)
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(),
        ...                           torch.nn.Linear(16, 4))
        >>> opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        >>> method = FROMPMethod(tau=1.0, n_points=8, grad_clip_norm=10.0)
        >>> labels = torch.arange(64) % 2
        >>> stream = [(torch.randn(64, 4), labels), (torch.randn(64, 4), 2 + labels)]
        >>> for e, (x, y) in enumerate(stream):
        ...     method.begin_task(net, experience=e, classes=y.unique().tolist())
        ...     for xb, yb in zip(x.split(16), y.split(16)):
        ...         out = net(xb)
        ...         loss = F.cross_entropy(out, yb)
        ...         loss = loss + method.loss_terms(net, xb, out, loss=loss)
        ...         opt.zero_grad()
        ...         loss.backward()
        ...         method.before_update(net, opt)  # clipping at tau * grad_clip_norm
        ...         opt.step()
        ...     times = method.learn_task(net, x, y, None, optimizer=opt, experience=e)
        >>> method.task_count, method.class_incremental, sorted(method.last_terms)
        (2, True, ['penalty', 'replay'])

    Args:
        tau: weight of the functional regulariser in the loss; ``"auto"`` (the default): 10
            (the paper's), :data:`CI_TAU` on a class-incremental stream.
        n_points: memorable points per task (the paper's setting: 40 on split MNIST, 200 on
            permuted MNIST and split CIFAR), split evenly over the task's classes.
        kernel: ``"per_class"`` (FROMP), ``"joint"``, ``"per_point"`` or ``"identity"``
            (FROMP-L2), see :mod:`fromp.continual.regularizer`; ``"auto"`` (the default):
            ``"per_class"``, ``"per_point"`` on a class-incremental stream whose penalty
            keeps the logits (:meth:`resolve_kernel`, at the first :meth:`learn_task`).
        function: the function the penalty keeps on the memorable points: ``"probs"``
            (``p = softmax(f)``, FROMP's choice) or ``"logits"`` (the outputs ``f``, whose
            kernel does not vanish on confidently classified points; on one head shared by
            every experience's classes it keeps the penalty's scale where the
            probabilities' kernels sit at the jitter, see :class:`fromp.continual.
            regularizer.FROMPRegularizer`), or ``"auto"`` (the default): chosen at the first
            :meth:`learn_task` from the head's layout (:meth:`auto_function`): ``"logits"``
            when one head serves every experience and the first experience's labels fill
            all its output units (the later experiences then share its classes: permuted
            MNIST and other domain-incremental streams), ``"probs"`` otherwise (a head per
            task, or one head whose classes arrive over the experiences). Measured with the
            other defaults (``benchmarks/results/one_head_defaults.json``, ``defaults-
            runner/``): permuted MNIST on one head 95.33 % with the logits against 83.58 %
            with the probabilities (Naive 56.05 %); class-incremental split MNIST without a
            coreset 37.87 % with the probabilities against 19.49 %; task-incremental split
            MNIST 99.63 % with the probabilities.
        select: the memorable points' order: ``"descending"`` (largest ``tr Lambda``,
            FROMP), ``"random"`` (a uniform draw per class: the points with the largest ``tr
            Lambda`` are the ambiguous ones, a poor labelled coreset: class-incremental split
            MNIST, 50 % of the data, 2 epochs, replay alone: 70.5 % with them against 90.9 %
            with random points), ``"ascending"`` or ``"sensitivity"`` (largest
            memory-perturbation sensitivity ``sum_k |e_k lambda_k v_k|`` under the task's
            posterior ``N(w, Sigma)``, see :mod:`fromp.memory.sensitivity`; ``Sigma`` is
            computed first, then the points); None (the default): ``"random"`` when the sets
            are replayed, else ``"descending"``.
        prior_precision: ``delta`` in ``Sigma = 1 / (G + delta)``.
        jitter: added to the kernels' diagonals before the Cholesky factorisation.
        grad_clip_norm: :meth:`before_update` clips the total gradient norm at ``tau *
            grad_clip_norm`` (None: no clipping; ``grad_clip_norm`` when ``tau = 0``): the
            reference code's update ``grad CE / tau + grad R`` clipped at ``grad_clip_norm``,
            up to the factor ``tau``, to which Adam is invariant.
        posterior: ``"ggn"``: ``Sigma = 1 / (G + prior_precision)`` with ``G`` the running
            sum of the exact diagonal GGN over tasks; ``"vogn"``: the optimizer is a
            :class:`fromp.optim.VOGN` (given to :meth:`learn_task` as ``optimizer``; driven
            by :class:`fromp_avalanche.vogn.VOGNPlugin` in Avalanche) and ``Sigma`` is the
            variance of its posterior at the end of the task (no GGN pass;
            the regulariser's gradient enters VOGN's mean gradient only, its curvature
            uses the data loss only); ``"ivon"``: the same with a
            :class:`fromp.optim.IVON` driven by :class:`fromp_avalanche.ivon.IVONPlugin`
            (``Sigma = 1 / (N (h + delta))``; see ``ivon_penalty``); ``"kron"``: ``Sigma =
            (G_kfac + prior_precision)^{-1}`` with ``G_kfac`` the running sum of the tasks'
            Kronecker-factored GGNs (KFAC of every ``Linear`` / ``Conv2d`` layer, through
            the task's head; :mod:`fromp.curvature.kron`), so the kernels keep the correlations
            within each layer (``K = A J Sigma J^T A^T``, ``A = dp/df``; :func:`fromp.Laplace` with
            ``hessian_structure="kron"``). Models with other trainable parameters (batch
            norm) are refused; memorable points by ``"sensitivity"`` use its diagonal.
        curvature_examples: use at most this many (random) training examples of a task for
            its GGN, rescaled to the task size (default 1,000: the after-experience cost is
            bounded whatever the experience's size, a few passes over 1,000 examples; None:
            all, as in the paper and the runner's settings).
        replay: also use the memorable set as a labelled coreset: :meth:`terms` returns,
            summed over the earlier tasks, the weighted mean negative log-likelihood of each
            task's memorable points under their labels (through their heads; weighted as
            :meth:`set_weights` says), which
            :meth:`loss_terms` adds to the loss (as S-FSVI and VCL use their coresets).
            Needed when one head sees classes one experience at a time (class-incremental
            streams), where a penalty on the function alone does not teach the head to tell
            old classes from new ones. ``"auto"`` (the default): on class-incremental
            streams only (class docstring).
        replay_weight: ``c`` in the replay loss ``sum_s b_s mean_{m in s} -log p(y_m |
            x_m)``: a number gives every set ``b_s = c`` (the data term of tasks of equal
            size for ``c = 1``; ``c > 1`` weighs the few stored points of the old classes
            above the new classes' data, against the bias of a small memory towards the
            newest classes on one head); ``"auto"`` (the default): on a class-incremental
            stream ``b_s = N_s / (S M_s)``, each replayed point weighing as the examples it
            stands for (:meth:`set_weights`), elsewhere ``c = 1``. Refused with
            ``replay=False``.
        bn_statistics: the batch-norm statistics the memorable points are evaluated with
            (targets, kernels and penalty): ``"stored"`` (default) those of the running
            buffers at the last :meth:`learn_task` (what the network computed at test after
            the task), swapped in for the penalty's forward, so that ``R`` is a function of
            the weights alone, 0 at the old weights; ``"batch"``: the memorable batch's own
            statistics (train-mode normalisation on the memorable points of all tasks in one
            batch, running buffers untouched; targets taken the same way); ``"live"``: the
            running statistics of the moment (they drift with the new task's batches). The
            running buffers are never written by the penalty.
        curvature_combine: how the experiences' curvatures form ``G`` (``posterior="ggn"``
            or ``"kron"``): ``G = E^(-a) sum_e G_e`` over the ``E`` experiences learnt (a
            parameter absent from an experience counting 0 there), with ``a = 0`` for
            ``"sum"`` (default; the sequential Laplace posterior), ``a = 1`` for ``"mean"``,
            or ``a`` given as a number in ``[0, 1]``. With the sum, ``Sigma`` shrinks as
            experiences accumulate, so every memorable set's kernel ``K_s`` shrinks with
            it and each set's penalty grows with the number of experiences learnt (on top
            of the growing number of sets); with the mean, ``Sigma`` keeps the scale of one
            experience's posterior, and a set's penalty keeps its scale; values between
            move between the two. Identical after the first experience.
        context_tau: weight of a second function-space term, on the training mini-batch
            (the new experience's inputs as context points, as S-FSVI draws context points
            from the current task): :meth:`context_penalty` ``= 1/2 mean_b ||g(x_b; w)_S -
            g(x_b; w_prev)_S||^2``, ``g`` the kept function (``function``), ``S`` the output
            units of the batch's head trained before the experience, ``w_prev`` the weights
            at the last :meth:`learn_task` (a frozen copy of the network is kept: one more
            network in memory and one no-grad forward per step). An identity kernel: the
            batch changes at every step, so no kernel is factorised for it. On one
            many-class head it keeps the old classes' outputs on the new inputs, which the
            memorable points alone do not (class-incremental split MNIST: see
            ``docs/results-details.md``, with the runner's recipe; by the same token it
            holds back the newest classes). 0 (the default): off, no copy kept.
        memory_batch: about how many stored points a training step evaluates, to bound its
            cost: an int ``n``: the penalty on the first ``ceil(n / S)`` points of each of
            the ``S`` memorable sets (chosen at each :meth:`learn_task`, its kernels taken
            on those; the sets keep all ``n_points`` points, stored class by class so that
            the first ones cover the classes evenly) and the coreset's loss on ``ceil(n /
            S)`` points drawn uniformly with replacement from each set at every step
            (torch's generator of the sets' device), an unbiased but noisy estimate of the
            sum over the sets (:meth:`FROMPRegularizer.terms`, ``replay_points``), both in
            one forward pass. None: every point every step (exact). ``"auto"`` (the
            default): None, except on a class-incremental stream with the ``"per_class"``
            or ``"joint"`` kernel, where the penalty is as for ``n = B``, the training
            batch's size (the largest of the experience, for the kernels), and the
            coreset's loss exact on every stored point (:meth:`replay_draws`).
        chunk_size: examples per Jacobian chunk for the kernels and the memorable points
            (memory ``chunk_size * C * P`` numbers). The diagonal GGN takes its chunks from
            the device's memory budget instead
            (:func:`fromp.curvature.jacobian.default_memory_budget`, set with
            ``set_default_memory_budget``): its layer capture holds activations, not
            ``[chunk, C, P]`` Jacobians, so larger chunks fit and each of its ``C`` backward
            passes runs on a full batch.
        likelihood: the likelihood's name (``"categorical"``: softmax heads), for the
            memorability scores, the GGN and the kernels' ``p = inverse_link(f)``.
        seed: seeds the generator for ``select="random"`` and ``curvature_examples``.
        ivon_penalty: where IVON evaluates the regulariser (``posterior="ivon"``):
            ``"mean"`` (default): at the mean ``m`` of IVON's posterior, as FROMP defines it
            (a penalty on the mean function ``f(x; m)``), its gradient added to IVON's
            gradient estimate only (:meth:`fromp.optim.IVON.add_gradient`); the data loss
            alone is evaluated at the sampled weights and feeds IVON's Hessian estimate.
            ``"sample"``: in the loss at IVON's sampled weights, so that it enters both
            IVON's gradient and its Hessian estimate (and its value carries the sampling
            noise of the functions on the memorable points, about ``M C / 2``).
        cuda_graph: how a training step evaluates ``tau R`` and the coreset's loss
            (:mod:`fromp.continual.graphed`): ``"auto"`` (default) replays one CUDA graph of
            their forward and backward pass when the network is on a CUDA device (captured
            again when the memorable sets, the network's parameters or the loss dtype
            change; the memorable inputs, kernels and targets are fixed within an
            experience), plain autograd elsewhere; ``"on"``: always the value and gradient
            in one call (on the CPU computed eagerly); ``"off"``: plain autograd. The same
            terms to float rounding (the context term is never captured: it depends on the
            mini-batch).
    """

    def __init__(
        self,
        tau: float | str = "auto",
        n_points: int = 40,
        *,
        kernel: str = "auto",
        function: str = "auto",
        select: str | None = None,
        prior_precision: float = 1e-3,
        jitter: float = 1e-6,
        grad_clip_norm: float | None = None,
        posterior: str = "ggn",
        curvature_examples: int | None = 1000,
        chunk_size: int = 64,
        likelihood: str = "categorical",
        seed: int = 0,
        ivon_penalty: str = "mean",
        replay: bool | str = "auto",
        replay_weight: float | str = "auto",
        bn_statistics: str = "stored",
        context_tau: float = 0.0,
        curvature_combine: str | float = "sum",
        cuda_graph: str = "auto",
        memory_batch: int | str | None = "auto",
    ) -> None:
        super().__init__()
        if isinstance(jitter, bool) or not isinstance(jitter, (int, float)):
            raise TypeError(f"jitter must be a number, got {type(jitter).__name__}")
        if not (jitter >= 0 and math.isfinite(jitter)):
            raise ValueError(f"jitter must be a finite number >= 0, got {jitter!r}")
        tau = _auto_or_number(tau, "tau", positive=False)
        context_tau = _auto_or_number(context_tau, "context_tau", positive=False, auto=False)
        replay_weight = _auto_or_number(replay_weight, "replay_weight", positive=True)
        if not (isinstance(replay, bool) or (isinstance(replay, str) and replay == "auto")):
            raise TypeError(f"replay must be True, False or 'auto', got {replay!r}")
        if replay is False and replay_weight != "auto":
            raise ValueError(
                f"replay_weight={replay_weight!r} weighs the coreset's loss: it needs replay=True "
                "or 'auto'"
            )
        if memory_batch != "auto":
            memory_batch = check_count(memory_batch, "memory_batch")
        if not isinstance(n_points, int) or n_points < 1:
            raise ValueError(f"n_points must be a positive int, got {n_points!r}")
        if select is not None and select not in _SELECT:
            raise ValueError(f"select must be None or one of {_SELECT}, got {select!r}")
        prior_precision = check_prior_precision(prior_precision)  # type: ignore[assignment]
        if grad_clip_norm is not None and not (
            grad_clip_norm > 0 and math.isfinite(grad_clip_norm)
        ):
            raise ValueError(
                f"grad_clip_norm must be a finite number > 0 or None, got {grad_clip_norm!r}"
            )
        if bn_statistics not in _BN_STATISTICS:
            raise ValueError(
                f"bn_statistics must be one of {_BN_STATISTICS}, got {bn_statistics!r}"
            )
        if posterior not in _POSTERIORS:
            raise ValueError(f"posterior must be one of {_POSTERIORS}, got {posterior!r}")
        if _combine_exponent(curvature_combine) != 0 and posterior not in _OWN_CURVATURE:
            raise ValueError(
                f"curvature_combine={curvature_combine!r} combines the method's own "
                f"curvature (posterior 'ggn' or 'kron'); posterior={posterior!r} takes Sigma "
                "from the optimizer"
            )
        if ivon_penalty not in _IVON_PENALTY:
            raise ValueError(f"ivon_penalty must be one of {_IVON_PENALTY}, got {ivon_penalty!r}")
        if curvature_examples is not None and (
            isinstance(curvature_examples, bool)
            or not isinstance(curvature_examples, int)
            or curvature_examples < 1
        ):
            raise ValueError(
                f"curvature_examples must be an int >= 1 or None, got {curvature_examples!r}"
            )
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {seed!r}")
        #: the settings as given ("auto" / None where the stream decides: see the class
        #: docstring, "Class-incremental streams"); the attributes of the same names without
        #: the underscore are the values in force
        self._tau, self._replay, self._replay_weight = tau, replay, replay_weight
        self._context_tau, self._memory_batch, self._select = context_tau, memory_batch, select
        #: whether the stream is class-incremental (an experience brings classes to a head
        #: trained before, or the head grows with the classes): resolves the "auto" settings
        self.class_incremental = False
        self.n_points = n_points
        self.prior_precision = float(prior_precision)
        self.grad_clip_norm = grad_clip_norm
        self.posterior = posterior
        self.ivon_penalty = ivon_penalty
        self.curvature_examples = curvature_examples
        self.chunk_size = chunk_size
        self.likelihood = likelihood
        if function not in ("auto", *_FUNCTIONS):
            raise ValueError(f"function must be 'auto' or one of {_FUNCTIONS}, got {function!r}")
        #: function="auto" and no task learnt yet: the choice waits for the first learn_task
        self._function_pending = function == "auto"
        if kernel != "auto" and kernel not in _KERNELS:
            raise ValueError(f"kernel must be 'auto' or one of {_KERNELS}, got {kernel!r}")
        #: kernel="auto" and no task learnt yet: resolved with the stream (resolve_kernel)
        self._kernel_pending = kernel == "auto"
        self.regularizer = FROMPRegularizer(
            "per_class" if kernel == "auto" else kernel,
            likelihood,
            jitter=jitter,
            chunk_size=chunk_size,
            function="probs" if function == "auto" else function,
        )
        self.seed = int(seed)
        self.curvature_combine = curvature_combine
        #: context_tau > 0: a frozen copy of the network at the last learn_task (the
        #: previous function on the new experience's inputs); a loaded state keeps its
        #: weights until the first context_penalty call gives it a network to copy
        self.previous: nn.Module | None = None
        self._previous_state: dict[str, Tensor] | None = None
        self.bn_statistics = bn_statistics
        # bn_statistics="stored": the normalisation layers' running statistics at the last
        # learn_task (those the targets and kernels were computed with), by buffer name
        self.bn_buffers: Named = {}
        self.generator = torch.Generator().manual_seed(seed)  # draws on the CPU (indices)
        # by parameter name: running sum of the tasks' diagonal GGNs (posterior="ggn"), or
        # the optimizer's posterior variance after the last task ("vogn", "ivon")
        self.ggn_sum: Named | None = None
        self.optimizer_variance: Named | None = None
        self.timings: list[dict[str, float]] = []
        # per experience key: its GGN (by name) and its place in the regulariser's list
        self.ggn_terms: dict[int, Named] = {}
        # posterior="kron": per experience key, its KFAC GGN (through its head)
        self.kron_terms: dict[int, KronCurvature] = {}
        # the training step (begin_task, loss_terms, before_update); last_terms holds the
        # detached weighted terms of the last step by name ("penalty": tau R, "replay",
        # "context"), for metrics; R itself is last_penalty
        self.last_penalty: Tensor | None = None
        self._checks_left = 0  # steps of this experience whose penalty is still compared
        self._warned = False
        self._norm_warned = False  # the warning on normalisation layers' running statistics
        self.cuda_graph = check_mode(cuda_graph)
        #: the step's trainable parameters, read by begin_task (after any growth)
        self._step_params: tuple[nn.Module, tuple[Tensor, ...]] | None = None
        #: and its modules, when they all keep nn.Module.train (the penalty's eval mode)
        self._step_modules: tuple[nn.Module | None, list[nn.Module] | None] = (None, None)
        self._captured: dict = {}  # the captured memorable terms (graphed.static_term)
        #: per experience key, the number of training examples its memorable set stands for
        self.examples: dict[int, int] = {}
        self._ess: int | None = None  # begin_task's ess: N_t of the experience being trained
        self._batch = 0  # the largest training batch of the experience (memory_batch="auto")
        self._weights: tuple[Any, Tensor] | None = None  # (key, b_s): set_weights' cache

    # ---------------------------------------------------------------------- helpers

    # ------------------------------------------------------- settings in force
    @property
    def tau(self) -> float:
        """``tau`` in force: as given, else (``"auto"``) :data:`CI_TAU` on a
        class-incremental stream and 10 (the paper's) otherwise."""
        if self._tau != "auto":
            return self._tau  # type: ignore[return-value]
        return CI_TAU if self.class_incremental else 10.0

    @property
    def replay(self) -> bool:
        """Whether the memorable sets are replayed as labelled coresets: as given, else
        (``"auto"``) on a class-incremental stream."""
        if self._replay != "auto":
            return bool(self._replay)
        return self.class_incremental

    @property
    def replay_weight(self) -> float | None:
        """The coreset's weight ``c`` in force, one for every set: as given, else
        (``"auto"``) 1, or None on a class-incremental stream, where each set has its own
        weight ``b_s`` (:meth:`set_weights`)."""
        if self._replay_weight != "auto":
            return self._replay_weight  # type: ignore[return-value]
        return None if self.class_incremental else 1.0

    @property
    def context_tau(self) -> float:
        """``context_tau`` as given (0: off)."""
        return float(self._context_tau)

    @property
    def select(self) -> str:
        """The memorable points' order in force: as given, else ``"random"`` when the sets
        are replayed (a labelled coreset must represent its classes) and ``"descending"``
        (FROMP's) otherwise."""
        if self._select is not None:
            return self._select
        return "random" if self.replay else "descending"

    def memory_points(self, batch: int | None = None) -> int | None:
        """The stored points the penalty covers at a training step, about (``memory_batch``
        in force; the first ``ceil(n / S)`` of each of the ``S`` sets): None (every point)
        unless ``memory_batch`` is an int, or ``"auto"`` on a class-incremental stream with
        a kernel whose cost grows with the square of the points (``"per_class"``,
        ``"joint"``: ``C M^2 P`` per set after each experience), where it is the training
        batch's size (``batch``; the largest batch of the experience when None,
        ``n_points`` before any step)."""
        if self._memory_batch != "auto":
            return self._memory_batch  # type: ignore[return-value]
        if not self.class_incremental or self.kernel in ("per_point", "identity"):
            return None
        return batch or self._batch or self.n_points

    def replay_draws(self) -> int | None:
        """The points drawn from each stored set for the coreset's loss at a training step:
        ``ceil(memory_batch / S)`` for an int ``memory_batch``; None (every stored point,
        the exact weighted sum) for None and for ``"auto"``."""
        if not isinstance(self._memory_batch, int) or not len(self.regularizer):
            return None
        return -(-self._memory_batch // len(self.regularizer))

    @property
    def kernel(self) -> str:
        """The kernel of the penalty (:class:`FROMPRegularizer`'s ``kernel``); ``"auto"``
        until the first :meth:`learn_task` or a class-incremental stream chooses (see
        ``kernel``)."""
        return "auto" if self._kernel_pending else self.regularizer.kernel

    def resolve_kernel(self) -> None:
        """Fix ``kernel="auto"`` (a no-op once chosen): ``"per_point"`` on a
        class-incremental stream whose penalty keeps the logits, else ``"per_class"`` (the
        paper's; the probabilities' ``[C, C]`` covariance of one point is singular, ``sum_c
        p_c = 1``). Chosen with the function, before the first memorable set is stored, so
        every set has the same kernel."""
        if self._kernel_pending and not self._function_pending:
            per_point = self.class_incremental and self.regularizer.function == "logits"
            self.regularizer.kernel = "per_point" if per_point else "per_class"
            self._kernel_pending = False

    @property
    def function(self) -> str:
        """The function kept on the memorable points: ``"probs"`` or ``"logits"``;
        ``"auto"`` until the first :meth:`learn_task` chooses (see ``function``)."""
        return "auto" if self._function_pending else self.regularizer.function

    @staticmethod
    def auto_function(net: nn.Module, x: Tensor, y: Tensor) -> str:
        """The function ``function="auto"`` keeps, from the first experience's inputs ``x``
        ``[N, ...]`` and labels ``y`` ``[N]`` (every rank's, under ``torch.distributed``):
        ``"logits"`` when ``net`` has one head (no task label) and ``y`` holds every one of
        its ``C`` output units (so later experiences share the head's classes); else
        ``"probs"``: a multi-task network (a head per task), or one head with classes still
        to come. A head that grows with the classes seen (Avalanche's
        ``IncrementalClassifier``) is filled by its first experience too:
        :meth:`begin_task` with ``growing_head=True`` keeps ``"probs"`` for it."""
        if is_multitask(net):
            return "probs"
        width = _width(net, x)
        return "logits" if width > 1 and len(global_classes(y)) == width else "probs"

    def _class_incremental_data(
        self, net: nn.Module, task: int | None, x: Tensor, classes: Sequence[int]
    ) -> bool:
        """Whether an experience's data ``x`` with labels of ``classes`` (every rank's) makes
        the stream class-incremental for a loop that did not tell :meth:`begin_task`: it
        brings classes to head ``task`` beyond those it was trained on, or it is the first
        experience of a network with one head whose output units its labels do not fill
        (classes still to come)."""
        seen = self.regularizer.classes_seen.get(task)
        if seen:
            return bool(set(classes) - set(seen))
        if is_multitask(net):
            return False
        return 1 < len(classes) < _width(net, x)

    def resolve_function(self, function: str) -> None:
        """Fix the function of ``function="auto"`` before the first :meth:`learn_task` (a
        no-op when it is already ``function``); refuses another function once one is
        kept."""
        if function not in _FUNCTIONS:
            raise ValueError(f"function must be one of {_FUNCTIONS}, got {function!r}")
        if self._function_pending:
            self.regularizer.function = function
            self._function_pending = False
        elif function != self.regularizer.function:
            raise ValueError(
                f"function: this method keeps {self.regularizer.function!r} already, cannot "
                f"change to {function!r}"
            )

    def posterior_variance(self, net: nn.Module) -> Tensor:
        """``Sigma`` ``[P]`` in ``net``'s trainable-parameter order: for ``posterior="ggn"``
        the diagonal Laplace posterior ``1 / (G / E^a + prior_precision)`` of the running
        GGN sum (:class:`fromp.laplace.structures.DiagLaplace`), for ``"kron"`` the marginal
        variances of the Kronecker one (:class:`fromp.laplace.structures.KronLaplace`); for
        ``"vogn"`` / ``"ivon"`` the variance of the optimizer's posterior stored after the
        last task. A parameter added since (e.g. a new head) gets the prior variance
        ``1 / prior_precision``."""
        if self.posterior == "kron":
            return self._kron_laplace(net)[0].posterior_variance.detach()
        state = self.ggn_sum if self.posterior == "ggn" else self.optimizer_variance
        if state is None:
            raise RuntimeError("no task has been learnt yet")
        if self.posterior != "ggn":
            return to_flat(state, net, 1.0 / self.prior_precision)
        return self._diag_laplace(net).posterior_variance.detach()

    def _diag_laplace(self, net: nn.Module) -> DiagLaplace:
        """The diagonal Laplace posterior ``Sigma = 1 / (G / E^a + prior_precision)`` of the
        summed GGN at ``net``'s current weights (a parameter added since the last task: no
        curvature, the prior), in ``net``'s trainable-parameter order."""
        assert self.ggn_sum is not None
        g = to_flat(self.ggn_sum, net, 0.0)
        if (k := self._curvature_divisor()) != 1:
            g = g / k
        la = DiagLaplace(net, self.likelihood, prior_precision=self.prior_precision)
        return la.use_curvature(g, 0)

    def _curvature_divisor(self) -> float:
        """``E^a``, what the summed curvature is divided by: ``E`` the experiences learnt,
        ``a`` the exponent of ``curvature_combine`` (the divisor is 1 for the sum)."""
        exponent = _combine_exponent(self.curvature_combine)
        if exponent == 0:
            return 1.0
        terms = self.kron_terms if self.posterior == "kron" else self.ggn_terms
        return float(max(1, len(terms))) ** exponent

    def penalty(self, net: nn.Module) -> Tensor:
        """``R(w)`` on the memorable past (see :meth:`terms`)."""
        return self.terms(net)[0]

    def terms(self, net: nn.Module) -> tuple[Tensor, Tensor | None]:
        """``(R(w), replay loss)`` from one forward pass of the memorable points (one call
        per head at most); the replay loss ``sum_s b_s mean_{m in s} -log p(y_m | x_m)``
        over the earlier experiences' sets (:meth:`set_weights`) is None unless the sets are
        replayed (``replay``). With :meth:`replay_draws` ``= b`` (an int ``memory_batch``)
        the replay loss is estimated from ``b`` points drawn per set (unbiased,
        :meth:`FROMPRegularizer.terms`'s ``replay_points``), else computed on every stored
        point, in the penalty's forward pass either way.

        The forward runs in eval mode (no dropout) and, with ``bn_statistics="stored"``,
        with the normalisation layers' running statistics of the last :meth:`learn_task`
        (swapped in for the pass and swapped back, never written): the targets and kernels
        were computed with those statistics, so ``R`` is a function of the weights alone,
        0 at the weights of the last task, whatever training on the new task does to the
        running statistics; the running buffers are neither read nor changed.
        ``"live"``: the running statistics of the moment (which drift with the new task's
        batches, so ``R`` is not 0 at the old weights)."""
        replay = self.replay
        points, weights = None, None
        if replay:
            points = self.replay_draws()
            weights = self.set_weights()
        with self._memorable_mode(net):
            pen, rep = self.regularizer.terms(
                net, replay=replay, replay_points=points, replay_weights=weights
            )
        if rep is not None and weights is None and self.replay_weight != 1:
            rep = self.replay_weight * rep
        return pen, rep

    def set_weights(self) -> Tensor | None:
        """``[S]`` float64 the replay loss's weight ``b_s`` of each stored set's mean
        negative log-likelihood, on the sets' device; None for one weight, ``c =
        replay_weight``, on every set (its value given, or ``"auto"`` outside a
        class-incremental stream).

        With ``replay_weight="auto"`` on a class-incremental stream each replayed point
        weighs as the examples of its experience it stands for. Set ``s`` keeps ``M_s`` of
        the ``N_s`` examples of its experience, so each of its points stands for ``N_s /
        M_s`` of them. The rule counts the stored memory, beside a step's ``B`` new
        examples (each weighing ``1 / B`` in their mean loss), as one more batch of ``B``
        stored points shared equally by the ``S`` sets (``B / S`` each, as Replay's buffer
        is balanced over the experiences), each point weighing as the ``N_s / M_s`` new
        examples it stands for:

            ``b_s S / B = (N_s / M_s) / B``,  so  ``b_s = N_s / (S M_s)``,

        on the set's mean negative log-likelihood, which the step computes on all the set's
        points (``memory_batch="auto"`` or None) or estimates from draws (an int
        ``memory_batch``). In the units of the new experience's mean loss the stored memory
        as a whole weighs ``N / M`` times the new data when the experiences have ``N``
        examples and keep ``M`` points each (on split MNIST's fifth experience, with 200
        points per experience, ``b_s = 3`` for 2,400 examples per experience, 15 for
        12,000). A rule checked at two data sizes and on two data sets
        (``docs/results-details.md``), not the joint objective's ``b_s = N_s / N_t``.
        ``N_s`` is counted at :meth:`learn_task` and ``M_s`` is the set's size; a set of
        unknown ``N_s`` (a state saved without the counts) is taken as of the current
        experience's size, the ``ess`` given to :meth:`begin_task`, or, without it, as
        standing for its own points only."""
        if self._replay_weight != "auto" or not self.class_incremental:
            return None
        mem = self.regularizer.memories
        device = mem[0].targets.device
        key = (tuple(self.experiences), self._ess, device)
        if self._weights is None or self._weights[0] != key:
            points = torch.tensor([float(len(m.inputs)) for m in mem], dtype=torch.float64)
            sizes = torch.tensor(
                [float(self.examples.get(k, 0)) for k in self.experiences], dtype=torch.float64
            )
            unknown = float(self._ess) if self._ess else None
            sizes = torch.where(
                sizes > 0, sizes, points if unknown is None else torch.full_like(sizes, unknown)
            )
            b = (sizes / (len(mem) * points)).to(device)
            self._weights = (key, b)
        return self._weights[1]

    def context_penalty(self, output: Tensor, x: Tensor, task: int | None = None) -> Tensor:
        """``1/2 mean_b ||g(x_b; w)_S - g(x_b; w_prev)_S||^2`` (see ``context_tau``): the
        change of the kept function ``g`` (``function``) on the mini-batch ``x`` ``[B,
        ...]``, over the units ``S`` of head ``task`` trained before the experience, from
        the network at the last :meth:`learn_task` to ``output`` ``[B, C]``, the model's
        outputs on ``x`` from the training step's own forward pass (so no second forward
        of the model). The copy is evaluated without dropout and with the batch's own
        normalisation statistics (train-mode batch norm, its running buffers untouched),
        as the training forward normalises. Differentiable in ``output``; 0 before the
        first :meth:`learn_task`, for a head with no trained units, or with
        ``context_tau=0``. Not multiplied by ``context_tau``."""
        zero = output.new_zeros(())
        if self.previous is not None:  # one head: its units whatever the label
            task = _head(self.previous, task)
        units = self.regularizer.classes_seen.get(task)
        if self.context_tau == 0 or not units:
            return zero
        if output.ndim != 2 or len(output) != len(x):
            raise ValueError(
                f"output must be [B, C] for the B={len(x)} inputs, got {tuple(output.shape)}"
            )
        previous = self._previous_for(output)
        if previous is None:
            return zero
        with torch.no_grad(), _batch_statistics(previous):
            old = self.regularizer.link(with_task(previous, task)(x.to(output.device)))
        units = [u for u in units if u < min(old.shape[1], output.shape[1])]
        r = self.regularizer.link(output)[:, units] - old[:, units].to(output.dtype)
        return 0.5 * (r * r).sum(1).mean()

    def _previous_for(self, output: Tensor) -> nn.Module | None:
        """The frozen copy; built from a loaded state's weights at first use."""
        if self.previous is None and self._previous_state is not None:
            raise RuntimeError(
                "the state holds the previous network's weights: call "
                "attach_previous(net) after load_state_dict, or learn_task"
            )
        return self.previous

    def attach_previous(self, net: nn.Module) -> None:
        """After :meth:`load_state_dict`: rebuild the frozen copy of the network at the last
        :meth:`learn_task` from the saved weights, with ``net``'s architecture (a head that
        grew since keeps the saved values in its leading units). No-op without saved
        weights."""
        if self._previous_state is None:
            return
        copy_ = _frozen_copy(net)
        own = copy_.state_dict()
        unknown = set(self._previous_state) - set(own)
        if unknown:
            raise ValueError(
                f"the saved previous network has entries the model lacks: {sorted(unknown)[:3]}"
            )
        with torch.no_grad():
            for name, saved in self._previous_state.items():
                dst = own[name]
                if saved.ndim != dst.ndim or any(a > b for a, b in zip(saved.shape, dst.shape)):
                    raise ValueError(
                        f"the saved previous network's {name} has shape {tuple(saved.shape)}, "
                        f"not a leading block of the model's {tuple(dst.shape)}"
                    )
                dst[tuple(slice(0, n) for n in saved.shape)] = saved.to(dst)
        self.previous, self._previous_state = copy_, None

    @contextlib.contextmanager
    def _memorable_mode(self, net: nn.Module) -> Iterator[None]:
        """The mode the memorable points are evaluated in (see :meth:`terms`): eval mode,
        each module's own mode restored after (a network whose modules all keep
        ``nn.Module.train``, listed once per experience by :meth:`begin_task`, switches by
        setting their flags: no traversal of the network per step)."""
        mods = self._step_modules[1] if self._step_modules[0] is net else None
        if mods is None:
            was_training = net.training
            net.eval()
        else:
            modes = [m.training for m in mods]
            for m in mods:
                m.__dict__["training"] = False
        try:
            if self.bn_statistics == "batch":
                with _batch_statistics(net):
                    yield
            else:
                stored = self.bn_buffers if self.bn_statistics == "stored" else {}
                with _swapped_buffers(net, stored):
                    yield
        finally:
            if mods is None:
                net.train(was_training)
            else:
                for m, mode in zip(mods, modes):
                    m.__dict__["training"] = mode

    # -------------------------------------------------------------- the training step
    #: ``tau R`` above this multiple of the loss without it gets a warning (once)
    dominance_ratio: float = 100.0
    #: the first steps of each experience whose penalty is compared (a host read each)
    dominance_steps: int = 20

    def _begin(self, net: nn.Module, start: TaskStart) -> None:
        """:meth:`begin_task` for FROMP: the dominance check restarts for its first steps;
        ``classes`` (the labels the experience brings to head ``task``) beyond those the head
        was trained on, or one head that grows with the classes (``growing_head``; not a
        network with a head per task, whose heads grow per task: Avalanche's
        ``MultiHeadClassifier``), mark the stream class-incremental
        (:attr:`class_incremental`), which resolves the ``"auto"`` settings (class
        docstring); when the user turned the coreset off there (``replay=False``), a warning
        at the start of each experience that brings new classes says so, naming it. A state
        loaded with :meth:`load_state_dict` gets its copy of the previous network from
        ``net`` (:meth:`attach_previous`). ``ess`` (``N_t``) weighs the coreset
        (:meth:`set_weights`)."""
        task = _head(net, start.task)
        seen = set(self.regularizer.classes_seen.get(task, ()))
        new = sorted(set(int(c) for c in start.classes or ()) - seen) if seen else []
        if (start.growing_head and not is_multitask(net)) or new:  # a head per task grows per task
            self._mark_class_incremental()
        if new and self._replay is False:
            warnings.warn(
                f"FROMP: this experience brings classes {new} to a head trained on "
                f"{sorted(seen)} (a class-incremental stream) and replay=False: the "
                "memorable points' labels are not replayed, and on one head FROMP then "
                "stays far below Replay (docs/avalanche.md); replay='auto' (the default) "
                "replays them",
                RuntimeWarning,
                stacklevel=2,
            )
        self._ess, self._batch = start.ess, 0
        self._checks_left = self.dominance_steps
        self.last_penalty = None
        self._step_params = (net, trainable(net))
        mods = list(net.modules())
        if self.class_incremental and self.replay and not self._norm_warned:
            running = [m for m in mods if _has_running_statistics(m)]
            if running:
                self._norm_warned = True
                warnings.warn(
                    f"FROMP: the network has {len(running)} normalisation layers with running "
                    f"statistics ({type(running[0]).__name__}) on a class-incremental stream: "
                    "the stored points are replayed in their own forward pass, apart from "
                    "the training batch, so the statistics the network is tested with follow "
                    "the newest classes and FROMP stays well below Replay (split MNIST, 20 %, "
                    "an MLP with BatchNorm1d: 70 % against 92 %); a normalisation without batch "
                    "statistics (LayerNorm, GroupNorm) keeps it above Replay (92.7 % against "
                    "90.2 % with LayerNorm; docs/avalanche.md)",
                    RuntimeWarning,
                    stacklevel=2,
                )
        plain = all(type(m).train is nn.Module.train for m in mods)
        self._step_modules = (net, mods if plain else None)
        self.attach_previous(uncompiled(net))

    def _mark_class_incremental(self) -> None:
        """The stream is class-incremental: the ``"auto"`` settings resolve for it, and
        ``function="auto"`` keeps the logits when the sets are replayed (the probabilities
        otherwise), if it has not chosen yet."""
        self.class_incremental = True
        if self._function_pending:
            self.resolve_function("logits" if self.replay else "probs")
        if not len(self.regularizer):  # the kernel is chosen before the first set
            self.resolve_kernel()

    def _loss_terms(
        self, net: nn.Module, x: Tensor, output: Tensor, task: TaskLabels, loss: Tensor | None
    ) -> Tensor:
        """:meth:`loss_terms` for FROMP, already weighted: ``tau R(w)`` (not for
        IVON's penalty at the mean, which :meth:`before_update` adds to IVON's gradient),
        the coreset's loss with ``replay=True`` (:meth:`terms`) and ``context_tau`` times
        the context term on the mini-batch (:meth:`context_penalty`; per task label when
        ``task`` is a ``[B]`` tensor of labels, each group weighted by its share of the
        batch), in ``loss``'s dtype when given. 0 before the first :meth:`learn_task`.
        ``output`` is the context term's (no second forward of ``net``); ``loss`` is the
        scale ``tau R`` is compared with in the first steps of the experience (a warning,
        once, above ``dominance_ratio`` times it; the only host reads of a step).

        The weighted parts, detached, are in :attr:`last_terms` (``"penalty"``,
        ``"replay"``, ``"context"``); ``R`` itself is :attr:`last_penalty`. A loop that logs
        the loss without the penalty subtracts ``"penalty"`` and ``"context"`` (the
        coreset's loss is part of the data term)."""
        dtype = output.dtype if loss is None else loss.dtype
        self._batch = max(self._batch, len(x))
        if len(self.regularizer) == 0:
            return output.new_zeros((), dtype=dtype)
        total: Tensor | None = None
        context = self._context_term(net, output, x, task, dtype)
        penalised = self.tau != 0 and not self._penalty_at_mean
        if penalised or self.replay:
            # captured (cuda_graph) only when every step evaluates the same stored points
            sampled = self.replay and self.replay_draws() is not None
            fixed = None if sampled else self._fixed_terms(net, dtype, penalised)
            if fixed is None:  # plain autograd
                pen, rep = self.terms(net)
                rep = None if rep is None else rep.to(dtype)
                weighted = self.tau * pen.to(dtype) if penalised else None
                summed = None
            else:  # captured: rep + tau R as one term, value and gradient in one call
                summed, pen, weighted, rep = fixed
            if rep is not None:  # the coreset's loss: part of the data term
                total = rep if summed is None else summed
                self.last_terms["replay"] = rep.detach()
            if penalised:
                assert pen is not None and weighted is not None
                self.last_penalty = pen.detach()
                self.last_terms["penalty"] = weighted.detach()
                if loss is not None:
                    self._check_dominance(weighted, loss if rep is None else loss + rep)
                if summed is None:
                    context = weighted if context is None else weighted + context
                elif rep is None:
                    total = summed
        if context is not None:
            total = context if total is None else total + context
        return output.new_zeros((), dtype=dtype) if total is None else total

    def _params(self, net: nn.Module) -> tuple[Tensor, ...]:
        """``net``'s trainable parameters, read once per experience (:meth:`begin_task`)."""
        if self._step_params is None or self._step_params[0] is not net:
            self._step_params = (net, trainable(net))
        return self._step_params[1]

    def _fixed_terms(
        self, net: nn.Module, dtype: torch.dtype, penalised: bool
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None] | None:
        """``(rep + tau R, R, tau R, rep)`` of the captured step (``cuda_graph``; the first
        differentiable, the others detached, None where not computed), or None for plain
        autograd. Captured again when its key changes: the stacked memorable sets, the
        parameters, the loss dtype, the settings the terms read."""
        params = self._params(net)
        stack = self.regularizer._stack()
        weights = self.set_weights() if self.replay else None  # b_s per set: a cached tensor
        key = (Same(stack), Same(self.bn_buffers), param_key(params), dtype, penalised,
               self.tau, self.replay, self.replay_weight, Same(weights), self.bn_statistics,
               self.regularizer.function)  # fmt: skip

        def fn() -> tuple[Tensor | None, ...]:
            pen, rep = self.terms(net)
            rep = None if rep is None else rep.to(dtype)
            weighted = self.tau * pen.to(dtype) if penalised else None
            if weighted is None:
                return rep, pen, None, rep
            return (weighted if rep is None else rep + weighted), pen, weighted, rep

        term = static_term(self._captured, self.cuda_graph, net, params, key, fn, "FROMP")
        return None if term is None else term()  # type: ignore[return-value]

    def _context_term(
        self,
        net: nn.Module,
        output: Tensor,
        x: Tensor,
        task: int | Tensor | None,
        dtype: torch.dtype | None = None,
    ) -> Tensor | None:
        """``context_tau`` times :meth:`context_penalty` on the mini-batch (None when
        ``context_tau = 0``). A network with one head: the batch is one group whatever its
        task labels (no host read). Several heads and ``[B]`` labels: one group per label
        in the batch (read on the host, as the network's own multi-task forward does),
        each weighted by its share of the batch."""
        if self.context_tau == 0:
            return None
        if isinstance(task, Tensor) and task.ndim > 0 and is_multitask(net):
            labels = task.unique()
            if len(labels) == 1:
                ctx = self.context_penalty(output, x, int(labels[0]))
            else:
                ctx = sum(
                    self.context_penalty(output[task == t], x[task == t], int(t))
                    * float((task == t).float().mean())
                    for t in labels
                )
        else:
            ctx = self.context_penalty(output, x, _head(net, task))
        weighted = self.context_tau * ctx.to(output.dtype if dtype is None else dtype)
        self.last_terms["context"] = weighted.detach()
        return weighted

    def _check_dominance(self, weighted: Tensor, loss: Tensor) -> None:
        """Warn (once) when ``tau R`` exceeds ``dominance_ratio`` times the loss without
        it; compared in the first ``dominance_steps`` steps of each experience only (a host
        read each)."""
        if self._warned or self._checks_left <= 0:
            return
        self._checks_left -= 1
        pair = [weighted.detach().reshape(1), loss.detach().reshape(1).to(weighted.dtype)]
        w, data = torch.cat(pair).tolist()  # one read back
        if w > self.dominance_ratio * max(abs(data), 1e-8):
            self._warned = True
            warnings.warn(
                f"FROMP: tau * R = {w:.3g} is {w / max(abs(data), 1e-8):.0f}x the loss "
                f"without it ({data:.3g}); the penalty dominates training: lower tau "
                f"(now {self.tau:g}) or raise prior_precision / jitter",
                RuntimeWarning,
                stacklevel=3,
            )

    @property
    def _penalty_at_mean(self) -> bool:
        return self.posterior == "ivon" and self.ivon_penalty == "mean"

    def _before_update(self, net: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """:meth:`before_update` for FROMP: clip the gradient's total
        norm at ``tau * grad_clip_norm`` (``grad_clip_norm`` when ``tau = 0``; nothing when
        None); for IVON's penalty at the mean (``posterior="ivon"``, ``ivon_penalty="mean"``)
        restore IVON's mean (its gradient estimate reads the data gradient at the draw,
        after the clipping) and add ``tau grad R(m)`` to IVON's gradient estimate
        (:meth:`fromp.optim.IVON.add_gradient`)."""
        if self.grad_clip_norm is not None:
            max_norm = self.grad_clip_norm * (self.tau if self.tau > 0 else 1.0)
            torch.nn.utils.clip_grad_norm_(self._params(net), max_norm)
        if self._penalty_at_mean and len(self.regularizer) and self.tau > 0:
            opt = _require_optimizer(optimizer, "ivon")
            if opt.sampled:
                opt.restore(accumulate=True)
            with torch.enable_grad():
                pen = self.penalty(net)
                grads = torch.autograd.grad(self.tau * pen, opt.params, allow_unused=True)
            self.last_penalty = pen.detach()
            self.last_terms["penalty"] = (self.tau * pen).detach()
            opt.add_gradient(grads)

    def _posterior_variance_of(self, net: nn.Module, optimizer: Any) -> Tensor | None:
        """``posterior="vogn"`` / ``"ivon"``: the optimizer's posterior variance ``[P]`` at
        the end of the experience, the network left at the posterior mean; None for the
        method's own curvature."""
        if self.posterior in _OWN_CURVATURE:
            return None
        opt = _require_optimizer(optimizer, self.posterior)
        if self.posterior == "vogn":
            opt.load_mean()  # the model holds the posterior mean
            return opt.posterior().variance
        if opt.sampled:
            opt.restore(accumulate=False)  # the model holds the posterior mean
        return opt.posterior(net).variance

    def _learn(
        self, net: nn.Module, x: Tensor, y: Tensor, task: int | None, optimizer: Optim, key: int
    ) -> dict[str, float]:
        """:meth:`learn_task` for FROMP, everything done after an experience: select its
        memorable points, add its GGN (or, for ``posterior="vogn"`` or ``"ivon"``, take the
        posterior variance of ``optimizer``), rebuild the kernels.

        Cost: the selection and the curvature are bounded per experience (one pass over
        ``x``, at most ``curvature_examples`` examples); the kernels grow with the
        experiences learnt, by design: FROMP regularises towards the latest solution, so
        every earlier memorable set's targets and kernel are taken again under the new
        posterior (:meth:`FROMPRegularizer.update`: one forward per head, one GP per head,
        each set's ``[C, M, M]`` kernel block, ``C M^2 P`` multiply-adds at most, and one
        batched Cholesky factorisation). On the task-time study's MLP (784-100-100-10, 40
        points per task) that is about 30 ms per earlier set on one CPU thread
        (``benchmarks/results/task_time.json``, ``fromp_kernel_s``).

        Args:
            net: the model (see the module docstring), in the state reached on the task (a
                ``torch.compile``d model: its curvature, points and kernels are taken through
                the module inside, :func:`fromp.models.uncompiled`).
            x: the experience's training inputs ``[N, ...]``.
            y: their labels ``[N]``, indices of the head's output units.
            task: the task label (head) of the experience; None for single-head models.
            optimizer: for ``posterior="vogn"`` / ``"ivon"`` the :class:`fromp.optim.VOGN` /
                :class:`fromp.optim.IVON` that trained the experience: its posterior's
                variance is ``Sigma`` (the network is left at the posterior mean); not used
                otherwise.
            key: the experience's key (:meth:`learn_task`'s ``experience``). Learning a key
                again replaces its GGN term and its memorable set instead of adding them
                twice.

        Returns the wall times of the three steps (seconds)."""
        net = uncompiled(net)
        not_on_meta(net)
        task = _head(net, task)
        check_batch(x, "x")
        if self.posterior not in _OWN_CURVATURE:
            _require_optimizer(optimizer, self.posterior)
        posterior_variance = self._posterior_variance_of(net, optimizer)
        was_training = net.training
        net.eval()
        device, _ = device_dtype(net)
        head = with_task(net, task)
        times = {"select_s": 0.0, "curvature_s": 0.0, "kernel_s": 0.0}
        try:
            _check_labels(head, x, y, self.likelihood)  # before any state changes
            classes = global_classes(y)  # every rank's (torch.distributed)
            per_class = self.n_points // len(classes)
            if per_class < 1:
                raise ValueError(
                    f"n_points={self.n_points} is fewer than the task's {len(classes)} classes"
                )
            if not self.class_incremental and self._class_incremental_data(net, task, x, classes):
                self._mark_class_incremental()
            if self._function_pending:  # function="auto": chosen from the first experience
                self.resolve_function(self.auto_function(net, x, y))
            self.resolve_kernel()
            sensitivity = self.select == "sensitivity"
            q = None
            if sensitivity:  # the points need this task's posterior: curvature first
                t0 = _clock(device)
                self._add_curvature(net, head, x, device, posterior_variance, key)
                times["curvature_s"] = _clock(device) - t0
                q = DiagonalGaussian(flat_params(net), self.posterior_variance(net).reciprocal())
            t0 = _clock(device)
            x_mem, y_mem = select_memorable(
                head,
                x.to(device) if sensitivity else x,
                y,
                self.likelihood,
                per_class,
                order=self.select,
                classes=classes,
                generator=self.generator,
                posterior=q,
                chunk_size=self.chunk_size,
                points=True,
            )
            times["select_s"] = _clock(device) - t0
            if not sensitivity:
                t0 = _clock(device)
                self._add_curvature(net, head, x, device, posterior_variance, key)
                times["curvature_s"] = _clock(device) - t0
            t0 = _clock(device)
            variance = self._kernel_source(net)
            i = forget_experience(self.experiences, key)
            if i is not None:  # learnt again: drop its old memorable set
                del self.regularizer.memories[i]
            seen = self.regularizer.classes_seen
            seen[task] = sorted(set(seen.get(task, [])) | set(classes))
            n = self.memory_points()
            points = None if n is None else -(-n // (len(self.experiences) + 1))
            if points is not None:  # the first k points of the set cover its classes evenly
                x_mem, y_mem = _interleaved(x_mem, len(classes)), _interleaved(y_mem, len(classes))
            self.regularizer.add_task(
                net, x_mem.to(device), task, variance, labels=y_mem.to(device),
                penalty_points=points,
            )  # fmt: skip
            self.examples[key] = len(x)
            self.bn_buffers = _norm_buffers(net)
            if self.bn_statistics == "batch" and any(
                isinstance(m, nn.modules.batchnorm._NormBase) for m in net.modules()
            ):
                with torch.no_grad(), self._memorable_mode(net):
                    self.regularizer.retarget(net)
            times["kernel_s"] = _clock(device) - t0
        finally:
            net.train(was_training)
        if self.context_tau > 0:
            self.previous, self._previous_state = _frozen_copy(net), None
        self._step_params, self._step_modules = None, (None, None)
        self.timings.append(times)
        return times

    def _add_curvature(
        self,
        net: nn.Module,
        head: nn.Module,
        x: Tensor,
        device: torch.device,
        posterior_variance: Tensor | None,
        experience: int,
    ) -> None:
        """Store ``posterior_variance`` (optimizer posteriors) or set the experience's
        diagonal GGN (on at most ``curvature_examples`` examples, rescaled) and recompute the
        sum over experiences, both by parameter name (a parameter new since the last task
        starts from zero; a grown one from zero in its new entries)."""
        if posterior_variance is not None:
            self.optimizer_variance = by_name(net, posterior_variance.to(device))
            return
        xc, scale = x, 1.0
        cap = self.curvature_examples
        if cap is not None and distributed.is_distributed():  # each rank its share
            cap = max(1, cap // distributed.world_size())
        if cap is not None and cap < len(x):
            sub = torch.randperm(len(x), generator=self.generator)
            xc = x[sub[:cap]]
        if len(xc) < len(x) or distributed.is_distributed():  # N / examples used, all ranks
            counts = torch.tensor([float(len(x)), float(len(xc))], dtype=torch.float64)
            distributed.all_reduce_sum([counts])
            scale = float(counts[0] / counts[1])
        if self.posterior == "kron":
            self._add_kron(net, head, xc, device, scale, experience)
            return
        self.ggn_terms[experience] = by_name(net, scale * self._diag_ggn(head, xc, device))
        total: Named = {}
        for term in self.ggn_terms.values():
            for n, g in by_name(net, term).items():
                g = g.to(device)
                if n in total:
                    shape = torch.Size(max(a, b) for a, b in zip(total[n].shape, g.shape))
                    total[n] = fit_shape(total[n], shape, 0.0) + fit_shape(g, shape, 0.0)
                else:
                    total[n] = g.clone()
        self.ggn_sum = total

    @staticmethod
    def _view(net: nn.Module, head: nn.Module) -> nn.Module:
        """The module the KFAC terms are taken through: one :class:`TaskView` type for every
        task of a multi-head model (the parameter names agree across tasks), else ``net``."""
        return TaskView(net, head.task) if isinstance(head, TaskView) else net

    def _add_kron(
        self,
        net: nn.Module,
        head: nn.Module,
        x: Tensor,
        device: torch.device,
        scale: float,
        experience: int,
    ) -> None:
        """Set the experience's KFAC GGN term (``scale`` for a subsample: the ``B`` sums and
        the example counts are scaled to the task's size)."""
        view = self._view(net, head)
        batches = [(x[s : s + 1024].to(device), None) for s in range(0, len(x), 1024)]
        term = kron_curvature(view, batches, get_likelihood(self.likelihood))
        term = distributed.fold(term, lambda a, b: a + b)  # every rank's shard (in rank order)
        if scale != 1.0:
            term = term.scaled(scale)
        for key, old in self.kron_terms.items():
            if key == experience:
                continue
            shapes = [(b.A.shape, b.B.shape) for b in old.blocks]
            if old.names != term.names or shapes != [(b.A.shape, b.B.shape) for b in term.blocks]:
                raise ValueError(
                    "posterior='kron' needs the same Linear/Conv2d layers in every experience; "
                    f"the layers changed since experience {key} (a grown head?): use "
                    "posterior='ggn'"
                )
        self.kron_terms[experience] = term

    def _kron_laplace(self, net: nn.Module) -> tuple[KronLaplace, nn.Module]:
        """The Kronecker Laplace of the summed KFAC terms at ``net``'s current weights and
        the module it is taken through."""
        if not self.kron_terms:
            raise RuntimeError("no task has been learnt yet")
        view = TaskView(net, 0) if is_multitask(net) else net
        total = None
        for key in sorted(self.kron_terms):
            term = self.kron_terms[key]
            total = term if total is None else total + term
        assert total is not None
        if (k := self._curvature_divisor()) != 1:
            total = total.scaled(1.0 / k)
        la = KronLaplace(view, self.likelihood, prior_precision=self.prior_precision)
        return la.use_curvature(total, total.n), view

    def _kernel_source(self, net: nn.Module) -> Tensor | FunctionKernel:
        """What the regulariser builds its kernels from: ``Sigma``'s diagonal ``[P]``, or
        for ``posterior="kron"`` the outputs' kernel under the Kronecker posterior."""
        if self.posterior != "kron":
            return self.posterior_variance(net)
        la, view = self._kron_laplace(net)

        def kernel(model: nn.Module, x: Tensor, task: int | None) -> Tensor:
            if isinstance(view, TaskView):
                view.task = int(task)  # type: ignore[arg-type]
            return la.gp().kernel(x).detach()

        return kernel

    def _diag_ggn(self, head: nn.Module, x: Tensor, device: torch.device) -> Tensor:
        """Exact diagonal GGN of ``x``: the batched linear-layer formula for MLPs, layer
        capture (:func:`fromp.curvature.diag_ggn`) otherwise, in chunks set by the device's
        memory budget (not ``chunk_size``, the kernels' Jacobian chunk)."""
        batches = ((x[s : s + 1024].to(device),) for s in range(0, len(x), 1024))
        try:
            g = diag_ggn_linear(head, batches, self.likelihood)
        except ValueError:
            budget = default_memory_budget(device)
            g = diag_ggn(head, x.to(device), self.likelihood, memory_budget=budget)
        distributed.all_reduce_sum([g])  # the sum over every rank's shard
        return g

    # ------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """All method state: settings, curvature sum, memorable sets with targets and
        Cholesky factors, task counter, RNG state, timings."""
        return {
            "tau": self._tau,
            "n_points": self.n_points,
            "select": self._select,
            "prior_precision": self.prior_precision,
            "grad_clip_norm": self.grad_clip_norm,
            "posterior": self.posterior,
            "ivon_penalty": self.ivon_penalty,
            "curvature_examples": self.curvature_examples,
            "chunk_size": self.chunk_size,
            "likelihood": self.likelihood,
            "kernel": self.kernel,
            "function": self.function,
            "jitter": self.regularizer.jitter,
            "replay": self._replay,
            "replay_weight": self._replay_weight,
            "bn_statistics": self.bn_statistics,
            "context_tau": self._context_tau,
            "curvature_combine": self.curvature_combine,
            "memory_batch": self._memory_batch,
            "class_incremental": self.class_incremental,
            "examples": dict(self.examples),
            "previous": (
                {k: v.detach().clone() for k, v in self.previous.state_dict().items()}
                if self.previous is not None
                else self._previous_state
            ),
            "bn_buffers": dict(self.bn_buffers),
            "ggn_sum": self.ggn_sum,
            "optimizer_variance": self.optimizer_variance,
            "ggn_terms": {k: dict(v) for k, v in self.ggn_terms.items()},
            "kron_terms": {k: v.state_dict() for k, v in self.kron_terms.items()},
            "experiences": list(self.experiences),
            "regularizer": self.regularizer.state_dict(),
            "task_count": self.task_count,
            "generator": self.generator.get_state(),
            "timings": list(self.timings),
        }

    def load_state_dict(
        self, state: dict[str, Any], *, device: torch.device | str | None = None
    ) -> None:
        """Restore :meth:`state_dict` (e.g. in a fresh process after a checkpoint), tensors
        moved to ``device`` when given (load the checkpoint with ``map_location="cpu"``,
        then pass the model's device).

        Refuses (``ValueError``, before anything is changed) a state that is not a dict,
        lacks keys of :meth:`state_dict` (all named in one line) or was saved with other
        settings (``tau``, ``n_points``, ``kernel``, ``prior_precision``, ...): resume with
        the settings of the run."""
        if not isinstance(state, dict):
            raise ValueError(f"state must be a dict, got {type(state).__name__}")
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(
                f"state is missing keys {missing}: not a FROMPMethod.state_dict() of this version"
            )
        given = {"tau", "select", "replay", "replay_weight", "context_tau", "memory_batch"}
        mine = {"tau": self._tau, "grad_clip_norm": self.grad_clip_norm}
        mine.update(
            {
                k: getattr(self, f"_{k}" if k in given else k)
                for k in _SETTINGS
                if k not in ("kernel", "jitter")
            }
        )
        mine["kernel"], mine["jitter"] = self.kernel, self.regularizer.jitter
        mine["function"] = self.function
        for key, value in mine.items():
            saved = state[key]
            if key == "curvature_combine":
                same = _combine_exponent(saved) == _combine_exponent(value)
            else:  # a function or kernel "auto" not chosen yet matches either
                pending = key in ("function", "kernel") and "auto" in (saved, value)
                same = saved == value or pending
            if not same:
                raise ValueError(
                    f"state was saved with {key}={saved!r}, method has {value!r}: resume "
                    "with the settings of the run"
                )

        def mv(d: Named | None) -> Named | None:
            if d is None or device is None:
                return d
            return {n: v.to(device) for n, v in d.items()}

        for key in ("chunk_size",):
            setattr(self, key, state[key])
        self.class_incremental = bool(state["class_incremental"])
        self.examples = {int(k): int(v) for k, v in state["examples"].items()}
        self._weights = None
        self.ggn_sum, self.optimizer_variance = (
            mv(state["ggn_sum"]),
            mv(state["optimizer_variance"]),
        )
        kept, kept_kernel = self.regularizer.function, self.regularizer.kernel
        self.regularizer.load_state_dict(state["regularizer"], device=device)
        if state["function"] == "auto":  # saved before its first task: nothing chosen
            self.regularizer.function = kept
        else:
            self._function_pending = False
        if state["kernel"] == "auto":
            self.regularizer.kernel = kept_kernel
        else:
            self._kernel_pending = False
        self.previous = None
        self._previous_state = mv(state["previous"])
        self.experiences = [int(k) for k in state["experiences"]]
        self.ggn_terms = {int(k): mv(v) for k, v in state["ggn_terms"].items()}  # type: ignore[misc]
        self.kron_terms = {}
        for k, v in state["kron_terms"].items():
            curv = KronCurvature.from_state_dict(v)
            if device is not None:
                for b in curv.blocks:
                    b.A, b.B = b.A.to(device), b.B.to(device)
                    b.B_bias = None if b.B_bias is None else b.B_bias.to(device)
            self.kron_terms[int(k)] = curv
        self.generator.set_state(state["generator"])
        self.timings = list(state["timings"])
        self.bn_buffers = dict(mv(state["bn_buffers"]) or {})


def _head(net: nn.Module, task: int | Tensor | None) -> int | None:
    """The head ``task`` labels in ``net``: None for a network with one head (whatever the
    label: every experience's state is then the one head's), else the int label."""
    if not is_multitask(net):
        return None
    return None if task is None else int(task)


def _require_optimizer(optimizer: Any, posterior: str) -> Any:
    """``optimizer`` when it is the :mod:`fromp.optim` optimizer that ``posterior``
    (``"vogn"`` or ``"ivon"``) takes its posterior from, else ``TypeError`` naming it."""
    cls = {"vogn": VOGN, "ivon": IVON}[posterior]
    if not isinstance(optimizer, cls):
        raise TypeError(
            f"posterior={posterior!r} needs optimizer= a fromp.optim.{cls.__name__} (its "
            f"posterior is FROMP's), got {type(optimizer).__name__}"
        )
    return optimizer


def _width(net: nn.Module, x: Tensor) -> int:
    """The output width of ``net`` (one head), from a forward of two examples of ``x``."""
    p = next(iter(net.parameters()), None)
    with torch.no_grad():
        return int(net(x[:2].to(p.device if p is not None else x.device)).shape[-1])


def _interleaved(t: Tensor, n_classes: int) -> Tensor:
    """The rows of ``t`` ``[n_classes * k, ...]`` (grouped by class, ``k`` each) reordered
    class by class: the first ``j n_classes`` rows hold the first ``j`` of every class."""
    k = len(t) // n_classes
    return t.reshape(n_classes, k, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _auto_or_number(value: Any, name: str, *, positive: bool, auto: bool = True) -> float | str:
    """``"auto"`` (where ``auto``), or ``value`` as a finite float ``> 0`` (``positive``) or
    ``>= 0``: ``TypeError`` for what is neither a number nor ``"auto"`` (bools included),
    ``ValueError`` for a number out of range, both naming ``name``."""
    if auto and isinstance(value, str) and value == "auto":
        return "auto"
    alt = " or 'auto'" if auto else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        hint = " (a strategy's criterion goes in criterion=)" if name == "tau" else ""
        raise TypeError(f"{name} must be a number{alt}, got {type(value).__name__}{hint}")
    bound = "> 0" if positive else ">= 0"
    if not ((value > 0 if positive else value >= 0) and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number {bound}{alt}, got {value!r}")
    return float(value)


def _combine_exponent(value: Any) -> float:
    """The exponent ``a`` of ``curvature_combine`` (``G = E^(-a) sum_e G_e``): 0 for
    ``"sum"``, 1 for ``"mean"``, a number in ``[0, 1]`` as given."""
    if isinstance(value, str) and value in _CURVATURE_COMBINE:
        return float(_CURVATURE_COMBINE.index(value))  # "sum": 0, "mean": 1
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (number and 0 <= value <= 1):
        raise ValueError(
            f"curvature_combine must be one of {_CURVATURE_COMBINE} or a number in [0, 1], "
            f"got {value!r}"
        )
    return float(value)


def _frozen_copy(net: nn.Module) -> nn.Module:
    """A copy of ``net`` in eval mode with no trainable parameters."""
    import copy

    twin = copy.deepcopy(net).eval()
    for p in twin.parameters():
        p.requires_grad_(False)
    return twin


def _has_running_statistics(m: nn.Module) -> bool:
    """A normalisation layer that normalises by running statistics at test time
    (``BatchNorm*``, ``InstanceNorm*`` with ``track_running_stats=True``)."""
    return isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats


@contextlib.contextmanager
def _batch_statistics(net: nn.Module) -> Iterator[None]:
    """``net`` in eval mode except its normalisation layers, which normalise with the
    batch's statistics; their running buffers are restored on exit (never changed)."""
    was_training = net.training
    net.eval()
    norms = [m for m in net.modules() if isinstance(m, nn.modules.batchnorm._NormBase)]
    clones = {
        n: b.detach().clone()
        for n, b in net.named_buffers()
        if n.rsplit(".", 1)[-1] in ("running_mean", "running_var", "num_batches_tracked")
    }
    for m in norms:
        m.train()
    try:
        with _swapped_buffers(net, clones):
            yield
    finally:
        net.train(was_training)
