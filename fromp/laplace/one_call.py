"""Laplace approximations of a trained network's posterior over its flattened weights.

Around a (local) MAP estimate ``w*`` of ``-sum_n log p(y_n | f_w(x_n)) - log N(w | m0, D^-1)``
with prior precision ``D = diag(delta)``, the Laplace-GGN posterior is

    ``q(w) = N(w*, (G + D)^-1)``,  ``G = sum_n J_n^T Lambda(f_n) J_n``

(:mod:`fromp.curvature.ggn`). :func:`fit_laplace` keeps only ``diag(G)`` (a
:class:`DiagonalGaussian`, any model size) or, ``hessian_structure="full"``, all of ``G`` (a
:class:`FullGaussian`, small models only). In continual learning the posterior after task
``t`` is the prior of task ``t + 1``; passing ``posterior=`` adds the new task's GGN to its
precision, so that after ``T`` tasks the precision is ``sum_t G_t + D`` (one prior, every
task's curvature). The prior mean ``m0`` does not enter ``q``: it only moves ``w*``, which is
taken as given. Both Gaussians live in :mod:`fromp.posterior`.

One engine: every function here fits a :func:`fromp.Laplace` all-weights class
(:class:`~fromp.laplace.structures.DiagLaplace` or
:class:`~fromp.laplace.structures.FullLaplace`) and returns its posterior, evidence or prior
precision, so the numbers and the refusals (:mod:`fromp.laplace.checks`, each argument
checked once, by the class) are the classes'.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from fromp.curvature.capture import DEFAULT_MEMORY_BUDGET
from fromp.curvature.diagonal import DataArg
from fromp.laplace.factory import Laplace
from fromp.likelihood import Likelihood
from fromp.posterior import DiagonalGaussian, FullGaussian

__all__ = [
    "fit_laplace",
    "log_evidence_grid",
    "log_marginal_likelihood",
    "optimize_prior_precision",
]


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
    la = Laplace(
        model, likelihood, "all", structure, prior_precision=prior_precision,
        prior_mean=0.0 if prior_mean is None else prior_mean, chunk_size=chunk_size,
        memory_budget=memory_budget, max_params=max_params,
    )  # fmt: skip
    return la.fit(data)


def fit_laplace(
    model: nn.Module,
    data: DataArg,
    likelihood: str | Likelihood,
    prior_precision: float | Tensor | None,
    prior_mean: Tensor | None = None,
    *,
    hessian_structure: str = "diag",
    posterior: DiagonalGaussian | FullGaussian | None = None,
    chunk_size: int | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
    max_params: int = 20_000,
) -> DiagonalGaussian | FullGaussian:
    """Laplace-GGN posterior ``N(w*, (G + diag(delta))^{-1})`` over all the weights: one call
    of ``fromp.Laplace(model, likelihood, "all", hessian_structure, ...).fit(data).posterior``
    (the same engine and checks).

    ``hessian_structure="diag"`` (default) keeps ``diag(G)``: a :class:`DiagonalGaussian`
    with precision ``diag(G) + delta``, any model size. ``"full"`` keeps all of ``G``: a
    :class:`FullGaussian` with precision ``G + diag(delta)`` ``[P, P]``, for SMALL models
    only (``P <= max_params``; memory ``P^2``).

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
        prior_mean: the prior mean ``m0`` (a number or ``[P]``, default 0); it does not
            change the Laplace posterior (only ``w*`` depends on it) and is only checked.
        hessian_structure: ``"diag"`` or ``"full"`` (anything else is refused before any
            work).
        posterior: a previous task's posterior of the same structure (a
            :class:`DiagonalGaussian` for ``"diag"``, a :class:`FullGaussian` for
            ``"full"``); the result then has precision ``posterior.precision + G`` (its
            diagonal for ``"diag"``: continual-learning accumulation).
        chunk_size: examples per Jacobian chunk; None: derived from ``memory_budget`` for
            ``"diag"``, 32 for ``"full"``.
        memory_budget: working memory in bytes of the ``"diag"`` curvature (default 2 GiB;
            checked, unused by ``"full"``): the GGN diagonal comes from layer capture
            (:func:`fromp.curvature.diag_ggn`: Linear, convolution and norm layers from their
            inputs and output gradients, per-example Jacobians for other parameters), so an
            MLP or a ResNet takes the fast route by default.
        max_params: the largest ``P`` that ``"full"`` accepts (unused by ``"diag"``).

    Returns:
        ``"diag"``: :class:`DiagonalGaussian` with ``mean = flat_params(model)`` ``[P]`` and
        ``precision [P]``; ``"full"``: :class:`FullGaussian` with ``precision [P, P]``.
    """
    kinds = {"diag": DiagonalGaussian, "full": FullGaussian}
    if hessian_structure not in kinds:
        raise ValueError(f"hessian_structure must be 'diag' or 'full', got {hessian_structure!r}")
    kind = kinds[hessian_structure]
    p = sum(q.numel() for q in model.parameters() if q.requires_grad)
    if posterior is not None:
        if not isinstance(posterior, kind) or posterior.mean.shape != (p,):
            raise ValueError(
                f"posterior must be a {kind.__name__} over P={p} parameters "
                f"(hessian_structure={hessian_structure!r})"
            )
    elif prior_precision is None:
        raise ValueError("prior_precision is required when no posterior is given")
    la = _fitted(
        model, data, likelihood, hessian_structure,
        prior_precision=1.0 if posterior is not None else prior_precision,
        prior_mean=prior_mean, chunk_size=chunk_size, memory_budget=memory_budget,
        max_params=max_params,
    )  # fmt: skip
    if posterior is None:
        return la.posterior
    g = la.H if la.sigma_noise == 1.0 else la.H / la.sigma_noise**2
    return kind(la.mean.clone(), posterior.precision.to(g) + g)


# ----------------------------------------------------------------------------- prior search


def optimize_prior_precision(
    model: nn.Module,
    data: DataArg,
    likelihood: str | Likelihood,
    method: str = "marglik",
    *,
    prior_structure: str = "scalar",
    n_steps: int | None = None,
    init_prior_prec: float | Tensor = 1.0,
    optimizer: str = "adam",
    prior_mean: Tensor | None = None,
    hessian_structure: str = "diag",
    chunk_size: int | None = None,
    max_params: int = 20_000,
    **kwargs: Any,
) -> float | Tensor:
    """The prior precision ``delta`` of the all-weights Laplace (``hessian_structure``
    ``"diag"`` or ``"full"``) fitted on ``data``, chosen by the fitted class's
    :meth:`~fromp.laplace.tuning.PriorTuning.optimize_prior_precision`:

    * ``method="marglik"`` (default): maximise the evidence, ``prior_structure``
      ``"scalar"``, ``"layerwise"`` or ``"diag"``: ``optimizer="adam"`` (laplace-torch's
      ``n_steps=100`` steps, ``lr=0.1``) or ``optimizer="lbfgs"`` (to the optimum, at most
      ``n_steps=200`` iterations);
    * ``method="gridsearch"``: the best scalar on ``val_loader=`` (validation data), with
      ``grid_size=``, ``log_prior_prec_min=``, ``log_prior_prec_max=``, ``pred_type=``,
      ``link_approx=``, ``n_samples=`` passed on.

    Returns:
        ``delta`` as a float for a scalar prior, else the ``[n_layers]`` / ``[P]`` tensor.
    """
    la = _fitted(
        model, data, likelihood, hessian_structure, prior_mean=prior_mean,
        chunk_size=chunk_size, max_params=max_params,
    )  # fmt: skip
    if method == "marglik":
        kwargs |= {"n_steps": n_steps, "init_prior_prec": init_prior_prec, "optimizer": optimizer}
    prior_precision = la.optimize_prior_precision(
        method=method, prior_structure=prior_structure, **kwargs
    )
    return float(prior_precision) if prior_precision.ndim == 0 else prior_precision


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
) -> Tensor:
    """Laplace evidence ``log p(D | delta)`` at the model's weights ``w*``: one call of
    ``fromp.Laplace(model, likelihood, "all", hessian_structure, prior_precision=delta)
    .fit(data).log_marginal_likelihood()`` (to evaluate many ``delta`` fit the Laplace once).

    ``= -sum_n nll_n - 1/2 (w* - m0)^T D (w* - m0) - 1/2 [log det(G + D) - log det D]`` with
    ``G`` the GGN: its diagonal (``hessian_structure="diag"``) or, for small models, the full
    matrix (``hessian_structure="full"``, ``P <= max_params``). By Hadamard's inequality the
    diagonal version is never larger than the full one. ``prior_precision``: a positive
    scalar or ``[P]``. Returns a scalar tensor (detached). ``data`` needs targets.
    """
    la = _fitted(
        model, data, likelihood, hessian_structure, prior_precision=prior_precision,
        prior_mean=prior_mean, chunk_size=chunk_size, max_params=max_params,
    )  # fmt: skip
    return la.log_marginal_likelihood().detach()


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
) -> tuple[Tensor, Tensor]:
    """The Laplace evidence ``log p(D | delta)`` (:func:`log_marginal_likelihood`) at every
    scalar ``delta`` of ``grid`` (default ``logspace(-4, 4, 81)``: a non-empty sequence of
    positive finite numbers), fitting the curvature once (``hessian_structure`` ``"diag"``
    or ``"full"``). Returns ``(prior precisions [G], log evidence [G])``, float64, detached."""
    deltas = torch.as_tensor(
        torch.logspace(-4, 4, 81, dtype=torch.float64) if grid is None else grid,
        dtype=torch.float64,
    ).reshape(-1)
    if len(deltas) == 0 or not (torch.isfinite(deltas).all() and (deltas > 0).all()):
        raise ValueError("grid must be a non-empty sequence of positive finite numbers")
    la = _fitted(
        model, data, likelihood, hessian_structure, prior_mean=prior_mean,
        chunk_size=chunk_size, max_params=max_params,
    )  # fmt: skip
    la.log_likelihood  # noqa: B018  (fails early without targets, naming them)
    with torch.no_grad():
        values = torch.stack([la.log_marginal_likelihood(float(d)) for d in deltas])
    return deltas, values.to(torch.float64)
