"""Laplace approximations of a trained network's posterior over its flattened weights.

Around a (local) MAP estimate ``w*`` of ``-sum_n log p(y_n | f_w(x_n)) - log N(w | m0, D^-1)``
with prior precision ``D = diag(delta)``, the Laplace-GGN posterior is

    ``q(w) = N(w*, (G + D)^-1)``,  ``G = sum_n J_n^T Lambda(f_n) J_n``

(:mod:`fromp.curvature.ggn`). :func:`laplace` keeps only ``diag(G)`` (a :class:`DiagonalGaussian`,
any model size); :func:`laplace_full` keeps all of ``G`` (a :class:`FullGaussian`, small
models only). In continual learning the posterior after task ``t`` is the prior of task
``t + 1``; passing ``posterior=`` adds the new task's GGN to its precision, so that after
``T`` tasks the precision is ``sum_t G_t + D`` (one prior, every task's curvature).
The prior mean ``m0`` does not enter ``q``: it only moves ``w*``, which is taken as given.
Both Gaussians live in :mod:`fromp.posterior`; ``FullGaussian`` is re-exported here.

One engine: every function here fits a :func:`fromp.Laplace` all-weights class
(``"diag"`` or ``"full"``) and returns its posterior, evidence or prior precision, so the
numbers and the refusals (:mod:`fromp.laplace.checks`) are the classes'. :class:`DiagLaplace`
and :class:`FullLaplace` are those classes under laplace-torch's names, also understanding
fromp's earlier spellings (with a DeprecationWarning).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fromp._checks import check_prior_precision, check_vector, require_eval
from fromp.curvature.capture import DEFAULT_MEMORY_BUDGET
from fromp.curvature.diagonal import DataArg, diag_ggn, iter_batches
from fromp.curvature.jacobian import flat_params
from fromp.laplace.base import BaseLaplace
from fromp.laplace.factory import Laplace
from fromp.laplace.structures import LaplaceDiag, LaplaceFull
from fromp.likelihood import Likelihood
from fromp.posterior import DiagonalGaussian, FullGaussian

__all__ = [
    "DiagLaplace",
    "FullGaussian",
    "FullLaplace",
    "accumulate_ggn",
    "laplace",
    "laplace_full",
    "log_evidence_grid",
    "log_marginal_likelihood",
    "optimize_prior_precision",
    "prior_precision_vector",
    "require_eval",
]


def prior_precision_vector(prior_precision: float | Tensor, reference: Tensor) -> Tensor:
    """``delta`` as a ``[P]`` vector like ``reference``; ``prior_precision`` a positive scalar
    or a ``[P]`` tensor of positive entries (:func:`fromp._checks.check_prior_precision`)."""
    p = reference.shape[0]
    delta = check_prior_precision(prior_precision, sizes={"P": p}, like=reference)
    return delta.expand(p).clone()  # type: ignore[union-attr]


def _checked_batches(data: DataArg):
    """``data``'s batches as tuples; :func:`~fromp.curvature.iter_batches` refuses
    non-finite inputs (the GGN of NaN inputs is NaN)."""
    for x, y in iter_batches(data):
        yield (x,) if y is None else (x, y)


def _check_prior_mean(prior_mean: Tensor | None, mean: Tensor) -> None:
    if prior_mean is not None:
        check_vector(prior_mean, mean.numel(), "prior_mean")


def accumulate_ggn(
    model: nn.Module,
    data: DataArg,
    likelihood: str | Likelihood,
    previous: Tensor | None = None,
    *,
    chunk_size: int | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> Tensor:
    """``previous + diag(G)`` ``[P]``: a running sum of GGN diagonals over tasks
    (``previous`` None starts from zero); ``chunk_size`` / ``memory_budget`` as
    :func:`fromp.curvature.diag_ggn`.

    Deprecated: one API does this, ``laplace(model, data, likelihood, None,
    posterior=previous_posterior)`` (the running sum is the posterior precision) or
    :func:`fromp.curvature.diag_ggn` added to the previous sum.
    """
    warnings.warn(
        "accumulate_ggn is deprecated: use laplace(..., posterior=previous) or "
        "diag_ggn(...) + previous",
        DeprecationWarning,
        stacklevel=2,
    )
    require_eval(model)
    g = diag_ggn(
        model, _checked_batches(data), likelihood, chunk_size=chunk_size,
        memory_budget=memory_budget,
    )  # fmt: skip
    if previous is None:
        return g
    if previous.shape != g.shape:
        raise ValueError(f"previous must have shape [P]={tuple(g.shape)}, got {previous.shape}")
    return previous.to(g) + g


def _hessian_structure(hessian_structure: str, curvature: str | None) -> str:
    """``hessian_structure`` (``"diag"`` or ``"full"``), or the deprecated ``curvature=``
    that named it before (a DeprecationWarning); ``"diagonal"`` is read as ``"diag"`` (a
    DeprecationWarning). Refused, naming the argument, when neither structure."""
    name = "hessian_structure"
    if curvature is not None:
        warnings.warn("curvature= naming the structure is deprecated: use hessian_structure= "
                      "(curvature= names the kind of curvature, 'ggn' | 'ef' | 'hessian')",
                      DeprecationWarning, stacklevel=3)  # fmt: skip
        hessian_structure, name = curvature, "curvature"
    if hessian_structure == "diagonal":
        warnings.warn("'diagonal' is deprecated: write 'diag'", DeprecationWarning, stacklevel=3)
        hessian_structure = "diag"
    if hessian_structure not in ("diag", "full"):
        raise ValueError(f"{name} must be 'diag' or 'full', got {hessian_structure!r}")
    return hessian_structure


def _fitted(
    model: nn.Module,
    data: DataArg,
    likelihood: str | Likelihood,
    structure: str,
    *,
    prior_precision: float | Tensor = 1.0,
    prior_mean: Tensor | None = None,
    chunk_size: int | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    max_params: int = 20_000,
) -> Any:
    """``fromp.Laplace(model, likelihood, "all", structure, ...)`` fitted on ``data``: the one
    engine behind the functions of this module (its checks included: eval mode, the model's
    dtype and device, the inputs and the targets for the likelihood, before any work)."""
    if structure not in ("diag", "full"):
        raise ValueError(f"hessian_structure must be 'diag' or 'full', got {structure!r}")
    mean = flat_params(model)
    _check_prior_mean(prior_mean, mean)
    la = Laplace(
        model, likelihood, "all", structure, prior_precision=prior_precision,
        prior_mean=None if prior_mean is None else prior_mean.detach(), chunk_size=chunk_size,
        memory_budget=memory_budget, max_params=max_params,
    )  # fmt: skip
    return la.fit(data)


def _posterior(
    model: nn.Module,
    data: DataArg,
    likelihood: str | Likelihood,
    structure: str,
    prior_precision: float | Tensor | None,
    prior_mean: Tensor | None,
    posterior: Any,
    **kwargs: Any,
) -> Any:
    """The fitted all-weights posterior of :func:`laplace` / :func:`laplace_full`: the
    Laplace's own, or ``posterior``'s precision plus the new data's ``G / s^2``."""
    kind = DiagonalGaussian if structure == "diag" else FullGaussian
    p = sum(q.numel() for q in model.parameters() if q.requires_grad)
    if posterior is not None:
        if not isinstance(posterior, kind) or posterior.mean.shape != (p,):
            raise ValueError(f"posterior must be a {kind.__name__} over P={p} parameters")
    elif prior_precision is None:
        raise ValueError("prior_precision is required when no posterior is given")
    else:
        prior_precision_vector(prior_precision, flat_params(model))  # scalar or [P], > 0
    la = _fitted(
        model, data, likelihood, structure,
        prior_precision=1.0 if posterior is not None else prior_precision,
        prior_mean=prior_mean, **kwargs,
    )  # fmt: skip
    if posterior is None:
        return la.posterior
    g = la.H if la.sigma_noise == 1.0 else la.H / la.sigma_noise**2
    return kind(la.mean.clone(), posterior.precision.to(g) + g)


def laplace(
    model: nn.Module,
    data: DataArg,
    likelihood: str | Likelihood,
    prior_precision: float | Tensor | None,
    prior_mean: Tensor | None = None,
    *,
    posterior: DiagonalGaussian | None = None,
    chunk_size: int | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> DiagonalGaussian:
    """Diagonal Laplace-GGN posterior ``N(w*, diag(diag(G) + delta)^{-1})``: one call of
    ``fromp.Laplace(model, likelihood, "all", "diag", ...).fit(data).posterior`` (the same
    engine and checks).

    Args:
        model: the trained network at ``w*`` (``[N, ...] -> [N, C]``; for a multi-head
            model pass :func:`fromp.models.with_task` ``(net, t)``); eval mode.
        data: the task's inputs (``x``, ``(x, y)`` or an iterable of batches); targets are
            not needed (the GGN uses the model's predictive ``Lambda(f)``); when given they
            are checked for the likelihood (class indices in ``[0, C)``, Bernoulli labels in
            ``{0, 1}``, regression targets of the outputs' shape, finite).
        likelihood: a :class:`~fromp.likelihood.Likelihood` or its name.
        prior_precision: ``delta``, a positive scalar or ``[P]`` tensor. Ignored (may be
            None) when ``posterior`` is given: the prior is already in its precision.
        prior_mean: the prior mean ``m0`` ``[P]`` (default 0); it does not change the
            Laplace posterior (only ``w*`` depends on it) and is only checked for shape.
        posterior: a previous task's posterior; the result then has precision
            ``posterior.precision + diag(G)`` (continual-learning accumulation).
        chunk_size: examples per chunk; None derives it from ``memory_budget``.
        memory_budget: working memory in bytes (default 2 GiB); the GGN diagonal comes from
            layer capture (:func:`fromp.curvature.diag_ggn`: Linear, convolution and norm
            layers from their inputs and output gradients, per-example Jacobians for other
            parameters), so an MLP or a ResNet takes the fast route by default.

    Returns:
        :class:`DiagonalGaussian` with ``mean = flat_params(model)`` ``[P]`` and
        ``precision [P]``.
    """
    return _posterior(
        model, data, likelihood, "diag", prior_precision, prior_mean, posterior,
        chunk_size=chunk_size, memory_budget=memory_budget,
    )  # fmt: skip


def laplace_full(
    model: nn.Module,
    data: DataArg,
    likelihood: str | Likelihood,
    prior_precision: float | Tensor | None,
    prior_mean: Tensor | None = None,
    *,
    posterior: FullGaussian | None = None,
    chunk_size: int = 32,
    max_params: int = 20_000,
) -> FullGaussian:
    """Full-covariance Laplace-GGN posterior ``N(w*, (G + diag(delta))^{-1})`` of a SMALL
    model (``P <= max_params``; memory ``P^2``): ``fromp.Laplace(model, likelihood, "all",
    "full", ...).fit(data).posterior``. Arguments as :func:`laplace`; with ``posterior`` (a
    :class:`FullGaussian`) the precision is ``posterior.precision + G``."""
    return _posterior(
        model, data, likelihood, "full", prior_precision, prior_mean, posterior,
        chunk_size=chunk_size, max_params=max_params,
    )  # fmt: skip


# ----------------------------------------------------------------------------- prior search

_OLD_STRUCTURES = {"scalar": "scalar", "layerwise": "layerwise", "diagonal": "diag", "diag": "diag"}


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated: use {new}", DeprecationWarning, stacklevel=4)


def _new_vocabulary(method: str, kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``optimize_prior_precision``'s earlier spellings in the one vocabulary (each with a
    DeprecationWarning): ``"gradient"`` -> ``"marglik"``, ``structure=`` ->
    ``prior_structure=`` (``"diagonal"`` -> ``"diag"``), ``max_iter=`` -> ``n_steps=``,
    ``init=`` -> ``init_prior_prec=``. ``"grid"`` (the best evidence on ``grid=``) stays a
    method of its own, deprecated for :func:`log_evidence_grid`."""
    kwargs = dict(kwargs)
    if method == "gradient":
        _deprecated("method='gradient'", "method='marglik'")
        method = "marglik"
    elif method == "grid":
        _deprecated("method='grid'", "log_evidence_grid(...) (or method='marglik')")
    if "structure" in kwargs:
        _deprecated("structure=", "prior_structure=")
        structure = kwargs.pop("structure")
        kwargs["prior_structure"] = _OLD_STRUCTURES.get(structure, structure)
    for old, new in (("max_iter", "n_steps"), ("init", "init_prior_prec")):
        if old in kwargs:
            _deprecated(f"{old}=", f"{new}=")
            kwargs[new] = kwargs.pop(old)
    return method, kwargs


def _evidence_grid(la: Any, grid: Any, prior_structure: str) -> Tensor:
    """The scalar of ``grid`` with the largest evidence (the deprecated ``method="grid"``)."""
    if prior_structure not in (None, "scalar"):
        raise ValueError("method='grid' supports structure='scalar' only")
    la.log_likelihood  # noqa: B018  (fails early without a fit or targets)
    deltas = _checked_grid(grid).to(la.mean)
    with torch.no_grad():
        values = torch.stack([la.log_marginal_likelihood(d) for d in deltas])
    la.prior_precision = deltas[int(torch.argmax(values))]
    return la.prior_precision


def optimize_prior_precision(
    model: nn.Module,
    data: DataArg,
    likelihood: str | Likelihood,
    method: str = "marglik",
    grid: Sequence[float] | Tensor | None = None,
    *,
    prior_structure: str = "scalar",
    n_steps: int = 200,
    init_prior_prec: float | Tensor = 1.0,
    prior_mean: Tensor | None = None,
    hessian_structure: str = "diag",
    chunk_size: int | None = None,
    max_params: int = 20_000,
    curvature: str | None = None,
    **kwargs: Any,
) -> float | Tensor:
    """The prior precision ``delta`` of the all-weights Laplace (``hessian_structure``
    ``"diag"`` or ``"full"``; ``curvature=`` deprecated) fitted on ``data``, chosen by the
    fitted class's
    :meth:`~fromp.laplace.base.BaseLaplace.optimize_prior_precision` (one vocabulary):

    * ``method="marglik"`` (default): maximise the evidence (L-BFGS on ``log delta`` from
      ``init_prior_prec``, at most ``n_steps`` iterations), ``prior_structure`` ``"scalar"``,
      ``"layerwise"`` or ``"diag"``;
    * ``method="gridsearch"``: the best scalar on ``val_loader=`` (validation data), with
      ``grid_size=``, ``log_prior_prec_min=``, ``log_prior_prec_max=``, ``pred_type=``,
      ``link_approx=``, ``n_samples=`` passed on.

    Earlier spellings work with a DeprecationWarning: ``"gradient"``, ``structure=``
    (``"diagonal"``), ``max_iter=``, ``init=``, and ``"grid"`` with ``grid=`` (the scalar of
    ``grid``, default ``logspace(-4, 4, 81)``, with the largest evidence: see
    :func:`log_evidence_grid`).

    Returns:
        ``delta`` as a float for a scalar prior, else the ``[n_layers]`` / ``[P]`` tensor.
    """
    structure = _hessian_structure(hessian_structure, curvature)
    method, kwargs = _new_vocabulary(method, kwargs)
    if method not in ("marglik", "gridsearch", "grid"):
        raise ValueError(
            f"method must be 'marglik' or 'gridsearch' (deprecated: 'gradient', 'grid'), got "
            f"{method!r}"
        )
    prior_structure = kwargs.pop("prior_structure", prior_structure)
    n_steps = kwargs.pop("n_steps", n_steps)
    init_prior_prec = kwargs.pop("init_prior_prec", init_prior_prec)
    if method == "grid":
        _checked_grid(grid)
    elif grid is not None:
        raise ValueError("grid is used by method='grid' only; pass method='grid' with it")
    elif isinstance(init_prior_prec, int | float) and not (
        init_prior_prec > 0 and math.isfinite(init_prior_prec)
    ):
        raise ValueError(
            f"init_prior_prec must be a positive finite number, got {init_prior_prec!r}"
        )
    la = _fitted(
        model, data, likelihood, structure, prior_mean=prior_mean, chunk_size=chunk_size,
        max_params=max_params,
    )  # fmt: skip
    if method == "grid":
        delta = _evidence_grid(la, grid, prior_structure)
    elif method == "marglik":
        delta = la.optimize_prior_precision(
            "marglik", prior_structure=prior_structure, n_steps=n_steps,
            init_prior_prec=init_prior_prec, **kwargs,
        )  # fmt: skip
    else:
        delta = la.optimize_prior_precision("gridsearch", prior_structure=prior_structure, **kwargs)
    return float(delta) if delta.ndim == 0 else delta


def log_marginal_likelihood(
    model: nn.Module,
    data: DataArg,
    likelihood: str | Likelihood,
    prior_precision: float | Tensor,
    *,
    prior_mean: Tensor | None = None,
    hessian_structure: str = "diag",
    chunk_size: int | None = None,
    max_params: int = 20_000,
    curvature: str | None = None,
) -> Tensor:
    """Laplace evidence ``log p(D | delta)`` at the model's weights ``w*``: one call of
    ``fromp.Laplace(model, likelihood, "all", hessian_structure).fit(data)
    .log_marginal_likelihood(delta)`` (to evaluate many ``delta`` fit the Laplace once);
    ``curvature=`` for ``hessian_structure=`` still works with a DeprecationWarning.

    ``= -sum_n nll_n - 1/2 (w* - m0)^T D (w* - m0) - 1/2 [log det(G + D) - log det D]`` with
    ``G`` the GGN: its diagonal (``hessian_structure="diag"``) or, for small models, the full
    matrix (``hessian_structure="full"``, ``P <= max_params``). By Hadamard's inequality the
    diagonal version is never larger than the full one. ``prior_precision``: a positive
    scalar or ``[P]``. Returns a scalar tensor (detached). ``data`` needs targets.
    """
    structure = _hessian_structure(hessian_structure, curvature)
    next(iter_batches(data, need_targets=True))  # refuses data without targets, naming it
    delta = prior_precision_vector(prior_precision, flat_params(model))  # scalar or [P]
    if not isinstance(prior_precision, Tensor) or prior_precision.ndim == 0:
        delta = delta[0]
    la = _fitted(
        model, data, likelihood, structure, prior_mean=prior_mean, chunk_size=chunk_size,
        max_params=max_params,
    )  # fmt: skip
    return la.log_marginal_likelihood(delta).detach()


def log_evidence_grid(
    model: nn.Module,
    data: DataArg,
    likelihood: str | Likelihood,
    grid: Sequence[float] | Tensor | None = None,
    *,
    prior_mean: Tensor | None = None,
    hessian_structure: str = "diag",
    chunk_size: int | None = None,
    max_params: int = 20_000,
    curvature: str | None = None,
) -> tuple[Tensor, Tensor]:
    """The Laplace evidence ``log p(D | delta)`` (:func:`log_marginal_likelihood`) at every
    scalar ``delta`` of ``grid`` (default ``logspace(-4, 4, 81)``), fitting the curvature
    once (``hessian_structure`` ``"diag"`` or ``"full"``; ``curvature=`` deprecated).
    Returns ``(deltas [G], log evidence [G])``, float64, detached."""
    structure = _hessian_structure(hessian_structure, curvature)
    deltas = _checked_grid(grid)
    la = _fitted(
        model, data, likelihood, structure, prior_mean=prior_mean, chunk_size=chunk_size,
        max_params=max_params,
    )  # fmt: skip
    la.log_likelihood  # noqa: B018  (fails early without targets, naming them)
    with torch.no_grad():
        values = torch.stack([la.log_marginal_likelihood(float(d)) for d in deltas])
    return deltas, values.to(torch.float64)


# ----------------------------------------------------------------------------- the classes


class _Compat:
    """The all-weights diagonal / full Laplace in laplace-torch's words (the classes of
    :func:`fromp.Laplace`), also understanding the earlier fitted-Laplace spellings, each
    with a DeprecationWarning: ``optimize_prior_precision("gradient" | "grid", structure=,
    max_iter=, init=, grid=)``, ``predictive(x, method)`` / ``la(x, method)`` with a link
    name (``"probit"``, ``"mc"``, ``"linear"``), ``curvature`` (``H``) and ``nll``."""

    def optimize_prior_precision(self, method: str = "marglik", **kwargs: Any) -> Tensor:
        """:meth:`fromp.laplace.base.BaseLaplace.optimize_prior_precision`; the earlier
        spellings are translated (``"grid"``: the scalar of ``grid=`` with the largest
        evidence)."""
        method, kwargs = _new_vocabulary(method, kwargs)
        if method == "grid":
            return _evidence_grid(
                self, kwargs.pop("grid", None), kwargs.pop("prior_structure", "scalar")
            )
        return super().optimize_prior_precision(method, **kwargs)  # type: ignore[misc]

    def _old_link(self, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        """``(x, "probit")`` / ``method="probit"`` (the earlier predictive) as
        ``link_approx="probit"``."""
        if args and args[0] in ("probit", "mc", "linear", "bridge"):
            kwargs = {**kwargs, "method": args[0]}
            args = args[1:]
        if "method" in kwargs:
            _deprecated("predictive(x, method)", "la(x, link_approx=...)")
            kwargs = dict(kwargs)
            kwargs["link_approx"] = kwargs.pop("method")
        return args, kwargs

    def __call__(self, x: Tensor, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = self._old_link(args, kwargs)
        if kwargs.get("link_approx") == "linear":  # the linearised mean, no variance
            kwargs.pop("link_approx")
            with torch.no_grad():
                return self.likelihood.inverse_link(self.gp().mean(x))  # type: ignore[attr-defined]
        return super().__call__(x, *args, **kwargs)  # type: ignore[misc]

    def predictive(self, x: Tensor, *args: Any, **kwargs: Any) -> Any:
        """laplace-torch's alias of ``la(x, ...)``."""
        return self(x, *args, **kwargs)

    dnn2gp = BaseLaplace.gp

    @property
    def curvature(self) -> Tensor | None:
        """Deprecated: ``H`` (``diag(G)`` ``[P]`` or ``G`` ``[P, P]``)."""
        _deprecated("curvature", "H")
        return self.H  # type: ignore[attr-defined]

    @property
    def nll(self) -> Tensor | None:
        """Deprecated: ``-log_likelihood`` (classification)."""
        _deprecated("nll", "-log_likelihood")
        if self.loss is None or self.regression:  # type: ignore[attr-defined]
            return None
        return self.loss  # type: ignore[attr-defined]


class DiagLaplace(_Compat, LaplaceDiag):
    """laplace-torch's ``DiagLaplace``: the diagonal Laplace-GGN of all weights, ``q = N(w*,
    diag(diag(G) + delta)^{-1})`` (``fromp.Laplace(model, lik, "all", "diag")``, whose class
    this is a subclass of), also accepting the earlier spellings with a warning::

        la = DiagLaplace(model, "classification").fit(train_loader)
        la.optimize_prior_precision()              # method="marglik"
        probs = la(x_test)                         # probit GLM predictive
        q = la.posterior                           # DiagonalGaussian for FROMP / VOGN
    """


class FullLaplace(_Compat, LaplaceFull):
    """laplace-torch's ``FullLaplace``: the full-covariance Laplace-GGN of a SMALL model
    (``P <= max_params``; ``fromp.Laplace(model, lik, "all", "full")``), also accepting the
    earlier spellings with a warning."""


def _checked_grid(grid: Sequence[float] | Tensor | None) -> Tensor:
    deltas = torch.as_tensor(
        torch.logspace(-4, 4, 81, dtype=torch.float64) if grid is None else grid,
        dtype=torch.float64,
    ).reshape(-1)
    if len(deltas) == 0 or not (torch.isfinite(deltas).all() and (deltas > 0).all()):
        raise ValueError("grid must be a non-empty sequence of positive finite numbers")
    return deltas
