"""Laplace approximations of a trained network's posterior over its flattened weights.

Around a (local) MAP estimate ``w*`` of ``-sum_n log p(y_n | f_w(x_n)) - log N(w | m0, D^-1)``
with prior precision ``D = diag(delta)``, the Laplace-GGN posterior is

    ``q(w) = N(w*, (G + D)^-1)``,  ``G = sum_n J_n^T Lambda(f_n) J_n``

(:mod:`fromp.ggn`). :func:`laplace` keeps only ``diag(G)`` (a :class:`DiagonalGaussian`,
any model size); :func:`laplace_full` keeps all of ``G`` (a :class:`FullGaussian`, small
models only). In continual learning the posterior after task ``t`` is the prior of task
``t + 1``; passing ``posterior=`` adds the new task's GGN to its precision, so that after
``T`` tasks the precision is ``sum_t G_t + D`` (one prior, every task's curvature).
The prior mean ``m0`` does not enter ``q``: it only moves ``w*``, which is taken as given.
Both Gaussians live in :mod:`fromp.posterior`; ``FullGaussian`` is re-exported here.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fromp._checks import check_vector, require_eval
from fromp.capture import DEFAULT_MEMORY_BUDGET
from fromp.curvature import DataArg, diag_ggn, iter_batches
from fromp.ggn import ggn
from fromp.gp import GP
from fromp.jacobian import flat_params
from fromp.laplace_structures import LaplaceDiag, LaplaceFull
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
    or a ``[P]`` tensor of positive entries."""
    p = reference.shape[0]
    if isinstance(prior_precision, bool) or not isinstance(prior_precision, int | float | Tensor):
        raise ValueError(
            "prior_precision must be a positive number or a [P] tensor, got "
            f"{type(prior_precision).__name__}"
        )
    delta = torch.as_tensor(prior_precision, dtype=reference.dtype, device=reference.device)
    if delta.ndim == 0:
        delta = delta.expand(p)
    if delta.shape != (p,):
        raise ValueError(
            f"prior_precision must be a scalar or have shape [P]=[{p}], got {tuple(delta.shape)}"
        )
    if not (torch.isfinite(delta).all() and (delta > 0).all()):
        raise ValueError("prior_precision must be finite and strictly positive")
    return delta.clone()


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
    """Diagonal Laplace-GGN posterior ``N(w*, diag(diag(G) + delta)^{-1})``.

    Args:
        model: the trained network at ``w*`` (``[N, ...] -> [N, C]``; for a multi-head
            model pass :func:`fromp.models.with_task` ``(net, t)``); eval mode.
        data: the task's inputs (``x``, ``(x, y)`` or an iterable of batches); targets are
            not needed (the GGN uses the model's predictive ``Lambda(f)``).
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
    require_eval(model)
    mean = flat_params(model).clone()
    _check_prior_mean(prior_mean, mean)
    g = diag_ggn(
        model, _checked_batches(data), likelihood, chunk_size=chunk_size,
        memory_budget=memory_budget,
    )  # fmt: skip
    if posterior is not None:
        if not isinstance(posterior, DiagonalGaussian) or posterior.mean.shape != mean.shape:
            raise ValueError(
                f"posterior must be a DiagonalGaussian over P={mean.numel()} parameters"
            )
        return DiagonalGaussian(mean, posterior.precision.to(g) + g)
    if prior_precision is None:
        raise ValueError("prior_precision is required when no posterior is given")
    return DiagonalGaussian(mean, g + prior_precision_vector(prior_precision, mean))


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
    model (``P <= max_params``; memory ``P^2``). Arguments as :func:`laplace`; with
    ``posterior`` (a :class:`FullGaussian`) the precision is ``posterior.precision + G``."""
    require_eval(model)
    mean = flat_params(model).clone()
    _check_prior_mean(prior_mean, mean)
    g = ggn(model, _checked_batches(data), likelihood, chunk_size=chunk_size, max_params=max_params)
    if posterior is not None:
        if not isinstance(posterior, FullGaussian) or posterior.mean.shape != mean.shape:
            raise ValueError(f"posterior must be a FullGaussian over P={mean.numel()} parameters")
        return FullGaussian(mean, posterior.precision.to(g) + g)
    if prior_precision is None:
        raise ValueError("prior_precision is required when no posterior is given")
    return FullGaussian(mean, g + torch.diag(prior_precision_vector(prior_precision, mean)))


# ----------------------------------------------------------------------------- fitted


class _Compat:
    """The earlier fitted-Laplace API on top of :mod:`fromp.baselaplace` (one
    implementation): a tensor or None ``prior_mean``, ``optimize_prior_precision(method=
    "gradient" | "grid", structure=...)``, ``predictive(x, method)`` and ``gp()`` returning
    :class:`fromp.gp.GP`, ``curvature`` and ``nll``."""

    def __init__(
        self,
        model: nn.Module,
        likelihood: str | Likelihood,
        *,
        prior_precision: float | Tensor = 1.0,
        prior_mean: Tensor | None = None,
        chunk_size: int | None = None,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
        method: str = "auto",
        max_params: int = 20_000,
    ) -> None:
        if prior_mean is not None:
            _check_prior_mean(prior_mean, flat_params(model))
        super().__init__(  # type: ignore[call-arg]
            model, likelihood, prior_precision=prior_precision,
            prior_mean=0.0 if prior_mean is None else prior_mean.detach(),
            subset_of_weights="all", chunk_size=chunk_size, memory_budget=memory_budget,
            method=method, max_params=max_params,
        )  # fmt: skip

    @property
    def curvature(self) -> Tensor | None:
        """``diag(G)`` ``[P]`` or ``G`` ``[P, P]`` of the fitted data (None before a fit)."""
        return self.H

    @property
    def nll(self) -> Tensor | None:
        return None if self.loss is None or self.regression else self.loss

    def optimize_prior_precision(  # type: ignore[override]
        self,
        method: str = "gradient",
        *,
        structure: str = "scalar",
        grid: Sequence[float] | Tensor | None = None,
        init: float | Tensor | None = None,
        max_iter: int = 200,
    ) -> Tensor:
        """Maximise the evidence over ``delta``: ``"gradient"`` (L-BFGS on ``log delta``;
        ``structure`` ``"scalar"``, ``"layerwise"`` or ``"diagonal"``) or ``"grid"`` (the
        best scalar of ``grid``, default ``logspace(-4, 4, 81)``); sets and returns it."""
        if method not in ("gradient", "grid"):
            raise ValueError(f"method must be 'gradient' or 'grid', got {method!r}")
        names = {"scalar": "scalar", "layerwise": "layerwise", "diagonal": "diag"}
        if structure not in names:
            raise ValueError(
                f"structure must be 'scalar', 'layerwise' or 'diagonal', got {structure!r}"
            )
        if method == "grid":
            if structure != "scalar":
                raise ValueError("method='grid' supports structure='scalar' only")
            self.log_likelihood  # noqa: B018  (fails early without a fit or targets)
            opts = {"dtype": self.mean.dtype, "device": self.mean.device}
            deltas = torch.as_tensor(
                torch.logspace(-4, 4, 81) if grid is None else grid, **opts
            ).reshape(-1)
            if len(deltas) == 0 or not (torch.isfinite(deltas).all() and (deltas > 0).all()):
                raise ValueError("grid must be a non-empty sequence of positive finite numbers")
            with torch.no_grad():
                values = torch.stack([self.log_marginal_likelihood(d) for d in deltas])
            self.prior_precision = deltas[int(torch.argmax(values))]
            return self.prior_precision
        return super().optimize_prior_precision(  # type: ignore[misc]
            "marglik", prior_structure=names[structure], n_steps=max_iter, init_prior_prec=init
        )

    def gp(self, *, chunk_size: int = 64) -> GP:  # type: ignore[override]
        """The DNN2GP :class:`fromp.gp.GP` of the model under :attr:`posterior`."""
        return GP(self.model, self.posterior, self.likelihood, chunk_size=chunk_size)

    dnn2gp = gp

    def predictive(self, x: Tensor, method: str = "probit", **kwargs: Any) -> Any:
        """The GP predictive at ``x`` (:meth:`fromp.gp.GP.predictive`)."""
        return self.gp().predictive(x, method, **kwargs)

    __call__ = predictive


class DiagLaplace(_Compat, LaplaceDiag):
    """Diagonal Laplace-GGN of all weights, fitted once (``fromp.Laplace(model, lik, "all",
    "diag")`` with the earlier method names): ``q = N(w*, diag(diag(G) + delta)^{-1})``::

        la = DiagLaplace(model, "categorical").fit(train_loader)
        la.optimize_prior_precision()              # gradient of the evidence (default)
        probs = la.predictive(x_test)              # probit GP predictive
        q = la.posterior                           # DiagonalGaussian for FROMP / VOGN
    """


class FullLaplace(_Compat, LaplaceFull):
    """Full-covariance Laplace-GGN of a SMALL model (``P <= max_params``), fitted once
    (``fromp.Laplace(model, lik, "all", "full")`` with the earlier method names)."""


# ----------------------------------------------------------------------------- evidence


def _fitted(
    model: nn.Module,
    data: DataArg,
    likelihood: str | Likelihood,
    prior_mean: Tensor | None,
    curvature: str,
    chunk_size: int | None,
    max_params: int,
) -> DiagLaplace | FullLaplace:
    if curvature not in ("diag", "full"):
        raise ValueError(f"curvature must be 'diag' or 'full', got {curvature!r}")
    cls = DiagLaplace if curvature == "diag" else FullLaplace
    la = cls(model, likelihood, prior_mean=prior_mean, chunk_size=chunk_size, max_params=max_params)
    batches = list(iter_batches(data, need_targets=True))
    return la.fit(batches)


def log_marginal_likelihood(
    model: nn.Module,
    data: DataArg,
    likelihood: str | Likelihood,
    prior_precision: float | Tensor,
    *,
    prior_mean: Tensor | None = None,
    curvature: str = "diag",
    chunk_size: int | None = None,
    max_params: int = 20_000,
) -> Tensor:
    """Laplace evidence ``log p(D | delta)`` at the model's weights ``w*`` (one call: fits
    the curvature, then :meth:`DiagLaplace.log_marginal_likelihood`; to evaluate many
    ``delta`` fit a :class:`DiagLaplace` / :class:`FullLaplace` once).

    ``= -sum_n nll_n - 1/2 (w* - m0)^T D (w* - m0) - 1/2 [log det(G + D) - log det D]`` with
    ``G`` the GGN: its diagonal (``curvature="diag"``) or, for small models, the full matrix
    (``curvature="full"``, ``P <= max_params``). By Hadamard's inequality the diagonal version
    is never larger than the full one. ``prior_precision``: a positive scalar or ``[P]``.
    Returns a scalar tensor (detached). ``data`` needs targets.
    """
    la = _fitted(model, data, likelihood, prior_mean, curvature, chunk_size, max_params)
    delta = prior_precision_vector(prior_precision, la.mean)  # validates: scalar or [P]
    if not isinstance(prior_precision, Tensor) or prior_precision.ndim == 0:
        delta = delta[0]
    return la.log_marginal_likelihood(delta).detach()


def optimize_prior_precision(
    model: nn.Module,
    data: DataArg,
    likelihood: str | Likelihood,
    method: str = "gradient",
    grid: Sequence[float] | Tensor | None = None,
    *,
    prior_mean: Tensor | None = None,
    curvature: str = "diag",
    init: float = 1.0,
    max_iter: int = 200,
    chunk_size: int | None = None,
    max_params: int = 20_000,
) -> float:
    """The scalar prior precision ``delta`` maximising :func:`log_marginal_likelihood`
    (one call; :meth:`DiagLaplace.optimize_prior_precision` is the fitted form, with
    per-layer / per-parameter ``delta``; :func:`log_evidence_grid` gives the evidence on a
    grid, e.g. for plots).

    Args:
        method: ``"gradient"`` (default; L-BFGS on ``log delta`` from ``init``, exact
            autograd gradients) or ``"grid"`` (best of ``grid``, default
            ``logspace(-4, 4, 81)``).

    Returns:
        ``delta`` as a float.
    """
    if method not in ("grid", "gradient"):
        raise ValueError(f"method must be 'grid' or 'gradient', got {method!r}")
    if method == "grid":
        deltas = _checked_grid(grid)
    elif grid is not None:
        raise ValueError("grid is used by method='grid' only; pass method='grid' with it")
    elif not (isinstance(init, int | float) and init > 0 and math.isfinite(init)):
        raise ValueError(f"init must be a positive finite number, got {init!r}")
    la = _fitted(model, data, likelihood, prior_mean, curvature, chunk_size, max_params)
    if method == "grid":
        la.optimize_prior_precision("grid", grid=deltas)
    else:
        la.optimize_prior_precision("gradient", init=float(init), max_iter=max_iter)
    return float(la.prior_precision)


def log_evidence_grid(
    model: nn.Module,
    data: DataArg,
    likelihood: str | Likelihood,
    grid: Sequence[float] | Tensor | None = None,
    *,
    prior_mean: Tensor | None = None,
    curvature: str = "diag",
    chunk_size: int | None = None,
    max_params: int = 20_000,
) -> tuple[Tensor, Tensor]:
    """The Laplace evidence ``log p(D | delta)`` (:func:`log_marginal_likelihood`) at every
    scalar ``delta`` of ``grid`` (default ``logspace(-4, 4, 81)``), fitting the curvature
    once. Returns ``(deltas [G], log evidence [G])``, float64, detached."""
    deltas = _checked_grid(grid)
    la = _fitted(model, data, likelihood, prior_mean, curvature, chunk_size, max_params)
    with torch.no_grad():
        values = torch.stack([la.log_marginal_likelihood(float(d)) for d in deltas])
    return deltas, values.to(torch.float64)


def _checked_grid(grid: Sequence[float] | Tensor | None) -> Tensor:
    deltas = torch.as_tensor(
        torch.logspace(-4, 4, 81, dtype=torch.float64) if grid is None else grid,
        dtype=torch.float64,
    ).reshape(-1)
    if len(deltas) == 0 or not (torch.isfinite(deltas).all() and (deltas > 0).all()):
        raise ValueError("grid must be a non-empty sequence of positive finite numbers")
    return deltas
