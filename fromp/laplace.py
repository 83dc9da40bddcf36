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
from fromp.likelihood import Likelihood, get_likelihood
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


class _FittedLaplace:
    """Shared code of :class:`DiagLaplace` and :class:`FullLaplace`."""

    _kind = ""

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
        self.model = model
        self.likelihood = get_likelihood(likelihood)
        self.mean = flat_params(model).clone()
        _check_prior_mean(prior_mean, self.mean)
        self.prior_mean = (
            torch.zeros_like(self.mean) if prior_mean is None else prior_mean.detach().to(self.mean)
        )
        self.chunk_size, self.memory_budget, self.method = chunk_size, memory_budget, method
        self.max_params = max_params
        self.sizes = [p.numel() for p in model.parameters() if p.requires_grad]
        self.prior_precision = prior_precision
        self.curvature: Tensor | None = None
        self.nll: Tensor | None = None
        self.n_data = 0

    # ------------------------------------------------------------------ prior precision
    @property
    def num_params(self) -> int:
        """``P``."""
        return self.mean.numel()

    @property
    def n_layers(self) -> int:
        """Number of trainable parameter tensors: the length of a per-layer ``delta``."""
        return len(self.sizes)

    @property
    def prior_precision(self) -> Tensor:
        """``delta``: a 0-d tensor, ``[n_layers]`` (one per parameter tensor, in
        ``named_parameters()`` order) or ``[P]``."""
        return self._delta

    @prior_precision.setter
    def prior_precision(self, value: float | Tensor) -> None:
        self._delta = self._check_delta(value).detach().clone()

    def _check_delta(self, value: float | Tensor) -> Tensor:
        if isinstance(value, bool) or not isinstance(value, int | float | Tensor):
            raise ValueError(
                "prior_precision must be a positive number or a tensor of shape [], "
                f"[n_layers]=[{self.n_layers}] or [P]=[{self.num_params}], got "
                f"{type(value).__name__}"
            )
        d = value if isinstance(value, Tensor) else torch.tensor(float(value))
        d = d.to(dtype=self.mean.dtype, device=self.mean.device)
        if d.ndim > 1 or (d.ndim == 1 and len(d) not in (self.n_layers, self.num_params)):
            raise ValueError(
                f"prior_precision must have shape [], [n_layers]=[{self.n_layers}] or "
                f"[P]=[{self.num_params}], got {tuple(d.shape)}"
            )
        dd = d.detach()
        if not (torch.isfinite(dd).all() and (dd > 0).all()):
            raise ValueError("prior_precision must be finite and strictly positive")
        return d

    def _delta_vector(self, d: Tensor) -> Tensor:
        """``delta`` expanded to ``[P]`` (differentiable)."""
        if d.ndim == 0:
            return d.expand(self.num_params)
        if len(d) == self.num_params:
            return d
        sizes = torch.tensor(self.sizes, device=d.device)
        return torch.repeat_interleave(d, sizes)

    # ------------------------------------------------------------------ fit
    def fit(self, data: DataArg, *, override: bool = True) -> _FittedLaplace:
        """Compute the curvature of ``data`` at the model's weights (and, when ``data`` has
        targets, the negative log-likelihood the evidence needs). ``override=False`` adds
        to the curvature of earlier fits (several data sets, or tasks)."""
        require_eval(model := self.model)
        w = flat_params(model)
        if w.shape != self.mean.shape:
            raise ValueError(f"model has P={w.numel()} parameters, the fit had {self.num_params}")
        self.mean = w.clone()
        nll = torch.zeros((), dtype=w.dtype, device=w.device)
        state = {"targets": True, "n": 0}

        def batches():
            for batch in _checked_batches(data):
                x = batch[0].to(w.device)
                if len(batch) > 1:
                    with torch.no_grad():
                        nonlocal nll
                        nll = nll + self.likelihood.nll(model(x), batch[1].to(w.device)).sum()
                else:
                    state["targets"] = False
                state["n"] += len(x)
                yield (x,)

        curv = self._curvature(batches())
        if override or self.curvature is None:
            self.curvature, self.n_data = curv, 0
            self.nll = nll if state["targets"] else None
        else:
            self.curvature = self.curvature + curv
            self.nll = None if (self.nll is None or not state["targets"]) else self.nll + nll
        self.n_data += state["n"]
        return self

    def _curvature(self, batches: Any) -> Tensor:
        raise NotImplementedError

    def _require_fit(self) -> Tensor:
        if self.curvature is None:
            raise ValueError("call fit(data) first")
        return self.curvature

    # ------------------------------------------------------------------ evidence
    def _log_det_posterior(self, delta: Tensor) -> Tensor:
        raise NotImplementedError

    def log_det_ratio(self, prior_precision: float | Tensor | None = None) -> Tensor:
        """``log det(G + D) - log det(D)``, ``D = diag(delta)`` (differentiable in delta)."""
        self._require_fit()
        d = self._delta if prior_precision is None else self._check_delta(prior_precision)
        vec = self._delta_vector(d)
        return self._log_det_posterior(d) - vec.log().sum()

    def scatter(self, prior_precision: float | Tensor | None = None) -> Tensor:
        """``(w* - m0)^T D (w* - m0)`` (differentiable in delta)."""
        d = self._delta if prior_precision is None else self._check_delta(prior_precision)
        return (self._delta_vector(d) * (self.mean - self.prior_mean) ** 2).sum()

    @property
    def log_likelihood(self) -> Tensor:
        """``log p(D | w*) = -sum_n nll_n`` of the fitted data."""
        self._require_fit()
        if self.nll is None:
            raise ValueError("the evidence needs targets: fit with data=(x, y) batches")
        return -self.nll

    def log_marginal_likelihood(self, prior_precision: float | Tensor | None = None) -> Tensor:
        """Laplace evidence, differentiable in ``prior_precision`` (scalar, per layer, per
        parameter; default: the current one):

        ``log p(D | delta) ~= log p(D | w*) - 1/2 [(w* - m0)^T D (w* - m0)]
        - 1/2 [log det(G + D) - log det D]``

        i.e. :attr:`log_likelihood` ``- (`` :meth:`scatter` ``+`` :meth:`log_det_ratio`
        ``) / 2`` (the ``P/2 log 2 pi`` of the prior and of the Laplace integral cancel).
        ``w*`` is kept fixed (post-hoc); for a linear-Gaussian model with the full GGN and
        ``w*`` the exact MAP this is the exact evidence.
        """
        ll = self.log_likelihood
        return ll - 0.5 * (self.scatter(prior_precision) + self.log_det_ratio(prior_precision))

    def optimize_prior_precision(
        self,
        method: str = "gradient",
        *,
        structure: str = "scalar",
        grid: Sequence[float] | Tensor | None = None,
        init: float | Tensor | None = None,
        max_iter: int = 200,
    ) -> Tensor:
        """Maximise :meth:`log_marginal_likelihood` over ``delta``; sets and returns it.

        Args:
            method: ``"gradient"`` (L-BFGS with strong Wolfe line search on ``log delta``,
                exact autograd gradients; default) or ``"grid"`` (scalar only; best of
                ``grid``, default ``logspace(-4, 4, 81)``).
            structure: ``"scalar"``, ``"layerwise"`` (one per parameter tensor) or
                ``"diagonal"`` (one per parameter).
            init: starting ``delta`` (default: the current one, broadcast).
        """
        if method not in ("gradient", "grid"):
            raise ValueError(f"method must be 'gradient' or 'grid', got {method!r}")
        shapes = {"scalar": (), "layerwise": (self.n_layers,), "diagonal": (self.num_params,)}
        if structure not in shapes:
            raise ValueError(
                f"structure must be 'scalar', 'layerwise' or 'diagonal', got {structure!r}"
            )
        if method == "grid" and structure != "scalar":
            raise ValueError("method='grid' supports structure='scalar' only")
        self.log_likelihood  # noqa: B018  (fails early without a fit or targets)
        opts = {"dtype": self.mean.dtype, "device": self.mean.device}
        if method == "grid":
            deltas = torch.as_tensor(
                torch.logspace(-4, 4, 81) if grid is None else grid, **opts
            ).reshape(-1)
            if len(deltas) == 0 or not (torch.isfinite(deltas).all() and (deltas > 0).all()):
                raise ValueError("grid must be a non-empty sequence of positive finite numbers")
            with torch.no_grad():
                values = torch.stack([self.log_marginal_likelihood(d) for d in deltas])
            self.prior_precision = deltas[int(torch.argmax(values))]
            return self.prior_precision
        start = self._check_delta(self._delta if init is None else init).detach()
        start = self._delta_vector(start) if structure == "diagonal" else start
        if structure == "layerwise" and start.ndim == 0:
            start = start.expand(self.n_layers)
        if structure == "scalar" and start.ndim != 0:
            start = start.mean()
        if tuple(start.shape) != shapes[structure]:
            raise ValueError(f"init must broadcast to {shapes[structure]}, got {start.shape}")
        log_d = start.log().clone().requires_grad_(True)
        opt = torch.optim.LBFGS(
            [log_d], lr=1.0, max_iter=max_iter, line_search_fn="strong_wolfe",
            tolerance_grad=1e-10, tolerance_change=1e-14,
        )  # fmt: skip

        def closure() -> Tensor:
            opt.zero_grad()
            loss = -self.log_marginal_likelihood(log_d.exp())
            loss.backward()
            return loss

        opt.step(closure)
        self.prior_precision = log_d.detach().exp()
        return self.prior_precision

    # ------------------------------------------------------------------ posterior & GP
    @property
    def posterior_precision(self) -> Tensor:
        """``G + D``: ``[P]`` (diagonal) or ``[P, P]`` (full)."""
        raise NotImplementedError

    def gp(self, *, chunk_size: int = 64) -> Any:
        """The DNN2GP :class:`fromp.gp.GP` of the model under :attr:`posterior`."""
        return GP(self.model, self.posterior, self.likelihood, chunk_size=chunk_size)

    dnn2gp = gp

    def predictive(self, x: Tensor, method: str = "probit", **kwargs: Any) -> Any:
        """The GP predictive at ``x`` (:meth:`fromp.gp.GP.predictive`): class probabilities
        ``[N, C]`` for classification, ``(mean [N, C], covariance [N, C, C])`` for the
        Gaussian likelihood."""
        return self.gp().predictive(x, method, **kwargs)

    __call__ = predictive

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to rebuild the fit without the data (``torch.save``-able)."""
        return {
            "kind": self._kind,
            "mean": self.mean,
            "prior_mean": self.prior_mean,
            "prior_precision": self._delta,
            "curvature": self._require_fit(),
            "nll": self.nll,
            "n_data": self.n_data,
            "likelihood": repr(self.likelihood),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`; refuses a fit of another kind, size or likelihood."""
        if state.get("kind") != self._kind:
            raise ValueError(f"state is a {state.get('kind')!r} fit, this is {self._kind!r}")
        if state["mean"].shape != self.mean.shape:
            raise ValueError(f"state has P={state['mean'].numel()}, model has {self.num_params}")
        if state["likelihood"] != repr(self.likelihood):
            raise ValueError(
                f"state was fitted with {state['likelihood']}, this is {self.likelihood!r}"
            )
        self.mean = state["mean"].to(self.mean)
        self.prior_mean = state["prior_mean"].to(self.mean)
        self.prior_precision = state["prior_precision"]
        self.curvature = state["curvature"].to(self.mean)
        self.nll = None if state["nll"] is None else state["nll"].to(self.mean)
        self.n_data = int(state["n_data"])


class DiagLaplace(_FittedLaplace):
    """Diagonal Laplace-GGN fitted once: ``q = N(w*, diag(diag(G) + delta)^{-1})``.

    The GGN diagonal ``diag(G)`` ``[P]`` is computed by :meth:`fit` (layer capture,
    :func:`fromp.curvature.diag_ggn`, within ``memory_budget`` bytes); the evidence, its
    gradient in ``delta`` and the posterior for any ``delta`` are then closed forms in ``P``
    operations. The workflow of laplace-torch's ``DiagLaplace``::

        la = DiagLaplace(model, "categorical").fit(train_loader)
        la.optimize_prior_precision()              # gradient of the evidence (default)
        probs = la.predictive(x_test)              # probit GP predictive
        q = la.posterior                           # DiagonalGaussian for FROMP / VOGN

    Args:
        model: the trained network at ``w*`` (``[N, ...] -> [N, C]``), eval mode.
        likelihood: a :class:`~fromp.likelihood.Likelihood` or its name.
        prior_precision: initial ``delta``: a float, or a tensor ``[]``, ``[n_layers]`` (one
            per trainable parameter tensor) or ``[P]``.
        prior_mean: ``m0`` ``[P]`` (default 0), entering the evidence's scatter term.
        chunk_size, memory_budget, method: as :func:`fromp.curvature.diag_ggn`.
    """

    _kind = "diag"

    def _curvature(self, batches: Any) -> Tensor:
        return diag_ggn(
            self.model, batches, self.likelihood, chunk_size=self.chunk_size,
            memory_budget=self.memory_budget, method=self.method,
        )  # fmt: skip

    def _log_det_posterior(self, delta: Tensor) -> Tensor:
        return (self._require_fit() + self._delta_vector(delta)).log().sum()

    @property
    def posterior_precision(self) -> Tensor:
        return self._require_fit() + self._delta_vector(self._delta)

    @property
    def posterior_variance(self) -> Tensor:
        """``1 / (diag(G) + delta)`` ``[P]``."""
        return self.posterior_precision.reciprocal()

    @property
    def posterior(self) -> DiagonalGaussian:
        """:class:`~fromp.posterior.DiagonalGaussian` ``N(w*, diag(G + delta)^{-1})``."""
        return DiagonalGaussian(self.mean.clone(), self.posterior_precision.detach().clone())


class FullLaplace(_FittedLaplace):
    """Full-covariance Laplace-GGN of a SMALL model (``P <= max_params``), fitted once:
    ``q = N(w*, (G + D)^{-1})``. As :class:`DiagLaplace`; the evidence uses the eigenvalues
    of ``G`` for a scalar ``delta`` and a Cholesky factor of ``G + D`` otherwise."""

    _kind = "full"

    def _curvature(self, batches: Any) -> Tensor:
        g = ggn(
            self.model, batches, self.likelihood, chunk_size=self.chunk_size or 32,
            max_params=self.max_params,
        )  # fmt: skip
        return 0.5 * (g + g.T)

    def _log_det_posterior(self, delta: Tensor) -> Tensor:
        g = self._require_fit()
        if delta.ndim == 0:
            key = id(g)
            if getattr(self, "_eig_key", None) != key:
                self._eig, self._eig_key = torch.linalg.eigvalsh(g).clamp_min(0), key
            return (self._eig + delta).log().sum()
        chol = torch.linalg.cholesky(g + torch.diag(self._delta_vector(delta)))
        return 2 * torch.log(torch.diagonal(chol)).sum()

    @property
    def posterior_precision(self) -> Tensor:
        return self._require_fit() + torch.diag(self._delta_vector(self._delta))

    @property
    def posterior(self) -> FullGaussian:
        """:class:`FullGaussian` ``N(w*, (G + D)^{-1})``."""
        return FullGaussian(self.mean.clone(), self.posterior_precision.detach().clone())


# ----------------------------------------------------------------------------- evidence


def _fitted(
    model: nn.Module,
    data: DataArg,
    likelihood: str | Likelihood,
    prior_mean: Tensor | None,
    curvature: str,
    chunk_size: int | None,
    max_params: int,
) -> _FittedLaplace:
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
