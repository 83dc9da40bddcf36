r"""Fitted Laplace posteriors in laplace-torch's words: :func:`Laplace` and one class per
(subset of weights, Hessian structure).

Around the trained weights ``w*`` (the MAP of ``sum_n nll_n / T - log N(w | m0, D^{-1})``),
for the chosen parameters ``theta`` (all weights, the last ``nn.Linear`` layer, or a
subnetwork of chosen entries, the others fixed at ``w*``: :mod:`fromp.laplace.subnet`),

    ``q(theta) = N(theta*, (G / (s^2 T) + D)^{-1})``,  ``G = sum_n J_n^T Lambda_n J_n``,

with ``J_n = d f(x_n) / d theta`` ``[C, P]``, ``Lambda_n`` the Hessian of the loss in the
outputs (softmax: ``diag(p) - p p^T``; regression: ``I``, the noise ``s = sigma_noise``
entering as ``1 / s^2``; classification has ``s = 1``), ``T`` the temperature and
``D = diag(delta)`` the prior precision (a scalar, one per parameter tensor, or one per
parameter). ``G`` is kept in one of four structures:

* ``"diag"``: ``diag(G)`` ``[P]`` (layer capture, :func:`fromp.curvature.diag_ggn`);
* ``"kron"``: KFAC blocks ``B (x) A`` per ``Linear`` / ``Conv2d`` weight and exact ``[out,
  out]`` bias blocks (:mod:`fromp.curvature.kron`), eigendecomposed;
* ``"full"``: ``G`` ``[P, P]`` (small ``P`` only);
* ``"lowrank"``: the top ``k`` eigenpairs ``U diag(lam) U^T`` (all weights,
  :mod:`fromp.laplace.lowrank`).

The Laplace evidence (log marginal likelihood), differentiable in ``delta`` and ``s``, is

    ``log p(D) ~= log p(D | w*) - 1/2 (theta* - m0)^T D (theta* - m0)
    - 1/2 [log det(G / (s^2 T) + D) - log det D]``,

with ``log p(D | w*) = -(1/T) sum_n nll_n`` (regression:
``-(1/T) [SSE / (2 s^2) + N C log(s sqrt(2 pi))]``). Predictions (``la(x)``) use the
linearised network (``pred_type="glm"``: ``f ~ N(f_w*(x), J Sigma J^T)``, then the probit,
Laplace-bridge or Monte-Carlo link approximation) or weight samples (``"nn"``).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import Tensor, nn

import fromp.laplace.checks as checks
from fromp import distributed
from fromp._checks import check_chunk_size, check_positive, check_prior_precision
from fromp.curvature.diagonal import DataArg
from fromp.curvature.jacobian import check_memory_budget
from fromp.laplace.laplace_gp import LaplaceGP
from fromp.laplace.options import check_backend, option
from fromp.laplace.predictive import LaplaceTorchAPI
from fromp.laplace.tuning import PriorTuning
from fromp.likelihood import (
    GaussianLikelihood,
    Likelihood,
    get_likelihood,
    randn_like_on,
)
from fromp.models import uncompiled

__all__ = ["BaseLaplace", "LaplaceGP", "ParametricLaplace"]

_ALIASES = {"classification": "categorical", "regression": "gaussian"}


def _checked_sigma(value: Any, regression: bool) -> float:
    """``sigma_noise``: a positive finite number or one-element tensor (1 for
    classification); the one check of the noise, at construction and in the setter."""
    if isinstance(value, Tensor) and value.numel() == 1:
        value = float(value.detach())
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not value > 0
        or (not math.isfinite(value))
    ):
        raise ValueError(f"sigma_noise must be a positive finite number, got {value!r}")
    if not regression and value != 1:
        raise ValueError(
            f"sigma_noise is for regression only (1 for classification), got {value!r}"
        )
    return float(value)


def _likelihood(likelihood: str | Likelihood, sigma_noise: Any) -> tuple[Likelihood, float]:
    """The likelihood with unit noise (the curvature is kept free of ``s``) and ``s``."""
    likelihood = option(likelihood)
    lik = get_likelihood(_ALIASES.get(likelihood, likelihood) if isinstance(likelihood, str)
                         else likelihood)  # fmt: skip
    regression = isinstance(lik, GaussianLikelihood)
    s = _checked_sigma((lik.sigma if regression else 1.0) if sigma_noise is None else sigma_noise,
                       regression)  # fmt: skip
    return (GaussianLikelihood(1.0) if regression else lik), s


def _checked_prior_mean(value: Any, like: Tensor | None) -> Tensor:
    """``m0`` in laplace-torch's forms (a number: a 0-dim tensor; a tensor ``[]``: ``[1]``;
    ``[1]``; ``[P]``, ``P = len(like)``, unchecked without ``like``), finite."""
    if isinstance(value, bool) or not isinstance(value, int | float | Tensor):
        raise TypeError(f"prior_mean must be a number or a tensor, got {type(value).__name__}")
    m0 = torch.as_tensor(value)
    if like is not None:
        m0 = m0.to(dtype=like.dtype, device=like.device)
    m0 = m0.reshape(1) if isinstance(value, Tensor) and m0.ndim == 0 else m0
    n = (1, len(like)) if like is not None else (len(m0),) if m0.ndim == 1 else ()
    if m0.ndim > 1 or (m0.ndim == 1 and len(m0) not in n):
        raise ValueError(f"prior_mean must be a number or have shape [1] or [P]="
                         f"[{n[-1]}], got {tuple(m0.shape)}")  # fmt: skip
    if not bool(torch.isfinite(m0).all()):
        raise ValueError(f"prior_mean must be finite, got {value!r}" if m0.ndim == 0
                         else "prior_mean is not finite (it has NaN or inf entries)")  # fmt: skip
    return m0.detach().clone()


class BaseLaplace(PriorTuning, LaplaceTorchAPI):
    r"""What every Laplace shares (laplace-torch's ``BaseLaplace``): the model, the
    likelihood, the prior and its checks, the noise, the evidence and its optimisation, the
    predictive. The weight-space structures are :class:`ParametricLaplace`\ s, the GP view
    :class:`~fromp.laplace.functional.FunctionalLaplace`. Build one with :func:`Laplace`
    (it picks the class whose ``_key`` is ``(subset_of_weights, hessian_structure)``) or
    by its class.

    Args:
        model: the trained network at ``w*``, ``[N, ...] -> [N, C]``, in eval mode (a
            ``torch.compile``\ d model: its original module, :func:`fromp.models.uncompiled`).
        likelihood: ``"classification"`` / ``"regression"`` (laplace-torch's names) or a
            fromp likelihood (``"categorical"``, ``"bernoulli"``, ``"gaussian"``, an object).
        sigma_noise: the regression noise ``s`` (default 1, or the ``sigma`` of a
            :class:`~fromp.likelihood.GaussianLikelihood` given as ``likelihood``).
        prior_precision: ``delta``: a float or a tensor ``[]``, ``[n_layers]`` (one per
            parameter tensor of the subset) or ``[P]``.
        prior_mean: ``m0``: a float (kept as a 0-dim tensor), a tensor ``[]`` (kept as
            ``[1]``), ``[1]`` or ``[P]``: laplace-torch's forms.
        temperature: ``T > 0``.
        chunk_size, memory_budget: working-memory controls: ``chunk_size`` examples per
            Jacobian chunk of the curvature; ``memory_budget`` bytes for the curvature and for
            every predictive, kernel and sampling path (test inputs a chunk at a time, see
            :mod:`fromp.laplace.predictive`); None: half the free memory of a CUDA device,
            2 GiB on the CPU (:func:`fromp.curvature.jacobian.default_memory_budget`).
        enable_backprop: make the ``"glm"`` predictive differentiable in ``x``.
        dict_key_x, dict_key_y: mapping batches (Hugging Face style): the model is called
            on the whole mapping, as in laplace-torch; ``batch[dict_key_x]`` gives the
            number of examples and ``batch[dict_key_y]`` the targets.
        backend, backend_kwargs, asdl_fisher_kwargs: laplace-torch's curvature backend:
            ``None`` or a GGN backend (``CurvlinopsGGN``, ``AsdlGGN``, ``BackPackGGN``, as a
            class or its name) is fromp's exact GGN; others are refused naming fromp's
            equivalent (:func:`fromp.laplace.options.check_backend`).
        temper_normaliser: regression with ``T != 1``: divide the Gaussian normaliser by
            ``T`` as well (fromp's tempered likelihood ``p(y|f)^{1/T}``, default) or not
            (False: laplace-torch's evidence).
        method, max_params: the diagonal's / subnetwork's Jacobian route and the full
            structures' largest ``P``.
    """

    #: ``(subset_of_weights, hessian_structure)`` of the class :func:`Laplace` builds
    _key: tuple[str, str] | None = None
    structure = ""
    subset_of_weights = "all"

    def __init__(
        self,
        model: nn.Module,
        likelihood: str | Likelihood,
        *,
        sigma_noise: float | None = None,
        prior_precision: float | Tensor = 1.0,
        prior_mean: float | Tensor = 0.0,
        temperature: float = 1.0,
        chunk_size: int | None = None,
        memory_budget: int | None = None,
        method: str = "auto",
        max_params: int = 20_000,
        enable_backprop: bool = False,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        backend: Any = None,
        backend_kwargs: dict[str, Any] | None = None,
        asdl_fisher_kwargs: dict[str, Any] | None = None,
        temper_normaliser: bool = True,
    ) -> None:
        model = uncompiled(model)
        checks.check_model(model)
        self.backend_name = check_backend(backend, backend_kwargs)
        if asdl_fisher_kwargs:
            raise ValueError("asdl_fisher_kwargs are not supported: fromp computes the exact GGN "
                             "without ASDL (no Fisher sampling to configure)")  # fmt: skip
        self.temperature = check_positive(temperature, "temperature")
        if memory_budget is not None:
            check_memory_budget(memory_budget)
        self.chunk_size = check_chunk_size(chunk_size)
        self.memory_budget, self.method, self.max_params = memory_budget, method, max_params
        self.enable_backprop = bool(enable_backprop)
        self.dict_key_x, self.dict_key_y = dict_key_x, dict_key_y
        self.temper_normaliser = bool(temper_normaliser)
        self.model = model
        self._lik, self._sigma = _likelihood(likelihood, sigma_noise)
        self.regression = isinstance(self._lik, GaussianLikelihood)
        self.layer_name: str | None = None
        self.layer: nn.Linear | None = None
        self._prior_mean_arg, self._prior_arg = prior_mean, prior_precision
        self._named = self._subset_named()
        self._mu, self.sizes = torch.zeros(0), []
        if self._named:
            self._set_mean()
            self._init_prior()
        else:  # the subset is found at the first fit (the last layer): its shape is checked then
            _checked_prior_mean(prior_mean, None)
            one_dim = isinstance(prior_precision, Tensor) and prior_precision.ndim == 1
            check_prior_precision(prior_precision,
                                  sizes={"n": len(prior_precision)} if one_dim else {})  # fmt: skip
        self.H: Any = None
        self.loss: Tensor | None = None  # classification: sum nll; regression: SSE
        self.n_outputs = 0  # C (laplace-torch's)
        self._n_targets = 0  # sum over the fitted batches of N_b C: the Gaussian normaliser's
        self.n_data = 0

    def _subset_named(self) -> list[tuple[str, nn.Parameter]]:
        """The subset's ``(name, parameter)`` pairs (hook): all trainable parameters; ``[]``
        when found at the first fit."""
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    # ------------------------------------------------------------------ parameters
    def _set_mean(self) -> None:
        for name, p in self._named:  # a diverged network has no Laplace approximation
            if not bool(torch.isfinite(p.detach()).all()):
                raise ValueError(f"model weights {name} are not finite (NaN or inf)")
        self._mu = torch.cat([p.detach().reshape(-1) for _, p in self._named]).clone()
        self.sizes = [p.numel() for _, p in self._named]

    def _weights_now(self) -> Tensor:
        """The model's current weights in ``la.mean``'s coordinates ``[P]``."""
        return torch.cat([p.detach().reshape(-1) for _, p in self._named])

    def _warn_if_weights_differ(self) -> None:
        """A loaded posterior's mean ``la.mean`` against the model's weights: the GLM
        predictive linearises at the model's current weights, so a state fitted at other
        weights (another model's, or before more training) is used at weights it was not
        fitted at; warned once, with the largest difference."""
        now = self._weights_now().to(self._mu)
        if now.shape != self._mu.shape:
            return  # another size: refused by the caller's checks
        gap = float((now - self._mu).abs().max()) if now.numel() else 0.0
        scale = max(1.0, float(self._mu.abs().max())) if now.numel() else 1.0
        if gap > 1e-6 * scale:
            warnings.warn(
                f"load_state_dict: the state was fitted at weights that differ from the "
                f"model's (max |difference| {gap:.3g}); the predictive linearises at the "
                "model's current weights: load the fitted weights into the model too",
                UserWarning,
                stacklevel=3,
            )

    def _subset_size(self) -> int:
        """The model's current number of parameters in the subset (checked at each fit)."""
        return sum(p.numel() for _, p in self._named)

    def _prepare(self, x: Tensor) -> None:
        """Hook: find the subset's parameters from an input (the last layer)."""

    def _prepare_names(self, names: list[str]) -> None:
        """Hook: find the subset's parameters from their names (loading a state)."""

    def _init_prior(self) -> None:
        self.prior_mean = self._prior_mean_arg
        self.prior_precision = self._prior_arg

    @property
    def prior_mean(self) -> Tensor:
        """``m0``: laplace-torch's forms: a 0-dim tensor (from a float), ``[1]`` (from a
        tensor ``[]`` or ``[1]``) or ``[P]``."""
        return self._prior_mean

    @prior_mean.setter
    def prior_mean(self, value: float | Tensor) -> None:
        self._prior_mean = _checked_prior_mean(value, self._mu)

    @property
    def num_params(self) -> int:
        """``P``: parameters of the subset."""
        return self._mu.numel()

    @property
    def n_layers(self) -> int:
        """Parameter tensors of the subset: the length of a per-layer ``delta``."""
        return len(self._named)

    @property
    def parameter_names(self) -> list[str]:
        return [n for n, _ in self._named]

    @property
    def prior_precision(self) -> Tensor:
        """``delta``: ``[]``, ``[n_layers]`` or ``[P]``."""
        return self._delta

    @prior_precision.setter
    def prior_precision(self, value: float | Tensor) -> None:
        self._delta = self._check_delta(value).detach().clone()

    def _check_delta(self, value: float | Tensor) -> Tensor:
        """``value`` as ``delta`` on the mean's dtype and device: ``[]``, ``[n_layers]`` or
        ``[P]`` (:meth:`_prior_sizes`), finite and ``> 0``
        (:func:`fromp._checks.check_prior_precision`: the one check of the prior)."""
        return check_prior_precision(value, sizes=self._prior_sizes(), like=self._mu)  # type: ignore[return-value]

    def _prior_sizes(self) -> dict[str, int]:
        """The lengths a one-dimensional ``delta`` may have (hook)."""
        return {"n_layers": self.n_layers, "P": self.num_params}

    def _delta_vector(self, d: Tensor) -> Tensor:
        """``delta`` as ``[P]`` (differentiable)."""
        if d.ndim == 0:
            return d.expand(self.num_params)
        if len(d) == self.num_params:
            return d
        return torch.repeat_interleave(d, torch.tensor(self.sizes, device=d.device))

    @property
    def sigma_noise(self) -> Tensor:
        """The regression noise ``s`` as a 0-dim tensor (laplace-torch's; 1 for
        classification). Set it with a number or a tensor of one element."""
        return torch.tensor(self._sigma, dtype=self._mu.dtype, device=self._mu.device)

    @sigma_noise.setter
    def sigma_noise(self, value: float | Tensor) -> None:
        self._sigma = _checked_sigma(value, self.regression)

    def _factor(self, sigma: Tensor | float | None = None) -> Tensor | float:
        """``1 / (s^2 T)``: the curvature's weight in the posterior precision."""
        s = self._sigma if sigma is None else sigma
        return 1.0 / (s**2 * self.temperature) if self.regression else 1.0 / self.temperature

    def _device(self) -> torch.device:
        return next(p for p in self.model.parameters()).device

    def _require_fit(self) -> Any:
        if self.H is None:
            raise ValueError("call fit(train_loader) first")
        return self.H

    def _log_lik(self, sigma: Tensor | float | None = None) -> Tensor:
        self._require_fit()
        if self.loss is None:
            raise ValueError("the evidence needs targets: fit with (x, y) batches")
        if not self.regression:
            return -self.loss / self.temperature
        s = self._sigma if sigma is None else sigma
        s = torch.as_tensor(s, dtype=self._mu.dtype, device=self._mu.device)
        norm = self._n_targets * (torch.log(s) + 0.5 * math.log(2 * math.pi))
        if not self.temper_normaliser:  # laplace-torch's: only the data fit is tempered
            return -self.loss / (2 * s**2) / self.temperature - norm
        return -(self.loss / (2 * s**2) + norm) / self.temperature

    @property
    def log_likelihood(self) -> Tensor:
        """``log p(D | w*)`` of the fitted data (with the temperature)."""
        return self._log_lik()

    def log_marginal_likelihood_at(
        self,
        prior_precision: float | Tensor | None = None,
        sigma_noise: float | Tensor | None = None,
    ) -> Tensor:
        """The Laplace evidence at the given values, without storing them."""
        if sigma_noise is not None and not self.regression:
            raise ValueError("sigma_noise is for regression only")
        ll = self._log_lik(sigma_noise)
        return ll - 0.5 * (
            self.scatter_at(prior_precision) + self.log_det_ratio_at(prior_precision, sigma_noise)
        )


class ParametricLaplace(BaseLaplace):
    """A Gaussian posterior over weights (laplace-torch's ``ParametricLaplace``): the
    curvature ``G`` of the subset in a structure (diagonal, Kronecker, full, low rank), the
    evidence from it, weight samples and the state. One subclass per (subset, structure)."""

    # ------------------------------------------------------------------ fit
    def fit(
        self, train_loader: DataArg, override: bool = True, progress_bar: bool = False
    ) -> ParametricLaplace:
        """Fit the curvature (and the data term of the evidence when targets are given) at
        the model's current weights. ``train_loader``: a DataLoader of ``(x, y)`` or of
        mappings (the model is called on the mapping, ``dict_key_y`` holds the targets), a
        list of batches, or one batch. ``override=False`` adds the new data to the curvature
        of earlier fits (more data, or the next task in continual learning); the model's
        weights are then those of the last fit. ``progress_bar`` is accepted
        (laplace-torch's) and shows nothing. Over a ``DistributedSampler`` every process
        fits its shard and the shards are combined (:mod:`fromp.distributed`)."""
        groups = checks.at_fit(self, train_loader)
        device = self._device()
        curv, loss = None, torch.zeros((), dtype=self._mu.dtype, device=device)
        targets, n, n_out, width = True, 0, 0, 0
        for k, (mapping, batches) in enumerate(groups):
            with checks.on_mapping(self.model, mapping, self.dict_key_x):
                batches = [(x.to(device), None if y is None else y.to(device))
                           for x, y in batches]  # fmt: skip
                if k == 0:
                    self._prepare(batches[0][0][:1])
                    p_now = self._subset_size()
                    if p_now != self.num_params:
                        raise ValueError(f"model has P={p_now} parameters in the subset, the "
                                         f"fit had {self.num_params}")  # fmt: skip
                    self._set_mean()
                self._outputs = None
                c = self._curvature(batches)
                curv = c if curv is None else self._add(curv, c)
                # a structure whose curvature pass has the outputs f(x) (the last layer's,
                # Kronecker) leaves them in self._outputs: no second forward pass
                outs, self._outputs = self._outputs, None
                if outs is None or len(outs) != len(batches):
                    outs = [None] * len(batches)
                with torch.no_grad():
                    for (x, y), f in zip(batches, outs):
                        n += len(x)
                        if y is None:
                            targets = False
                            continue
                        f = self.model(x) if f is None else f
                        loss = loss + self._loss_sum(f, y)
                        n_out += f.numel()
                        width = f.shape[-1]
                    if width == 0:  # no targets: the width from one forward pass
                        width = self.model(batches[0][0][:1]).shape[-1]
        if distributed.is_distributed():
            # each process fitted its shard (a DistributedSampler): combine the shards in rank
            # order as a sequential fit(..., override=False) would, so that every rank holds
            # the posterior of one process on all the data
            curv, loss, n, n_out, targets, width = distributed.fold(
                (curv, loss, n, n_out, targets, width),
                lambda a, b: (self._add(a[0], b[0]), a[1] + b[1], a[2] + b[2], a[3] + b[3],
                              a[4] and b[4], a[5] or b[5]),
            )  # fmt: skip
        if override or self.H is None:
            self.H, self.n_data, self._n_targets = curv, 0, 0
            self.loss = loss if targets else None
        else:
            self.H = self._add(self.H, curv)
            self.loss = None if (self.loss is None or not targets) else self.loss + loss
        self.n_data += n
        self._n_targets += n_out
        self.n_outputs = width
        self._fitted()
        return self

    def use_curvature(
        self, curvature: Any, n_data: int, loss: Tensor | float | None = None
    ) -> ParametricLaplace:
        """Take a curvature computed elsewhere (this structure's type, e.g. the sum of a
        continual method's per-task KFAC terms) at the model's current weights, in place of
        :meth:`fit`. ``loss``: the evidence's data term for that curvature's data (the
        summed NLL at these weights; classification), when known; None leaves the evidence
        (and ``optimize_prior_precision``) unavailable."""
        if self.subset_of_weights != "all":
            raise ValueError("use_curvature needs subset_of_weights='all'")
        self._set_mean()
        if loss is not None:
            loss = torch.as_tensor(loss, dtype=self._mu.dtype, device=self._mu.device)
        self.H, self.loss, self.n_data, self._n_targets = curvature, loss, int(n_data), 0
        self._fitted()
        return self

    def _loss_sum(self, f: Tensor, y: Tensor) -> Tensor:
        if self.regression:
            yy = y.to(f.dtype)
            yy = yy.unsqueeze(-1) if yy.ndim == 1 else yy
            if yy.shape != f.shape:
                raise ValueError(f"targets must have the outputs' shape {tuple(f.shape)}, got "
                                 f"{tuple(y.shape)}")  # fmt: skip
            return ((f - yy) ** 2).sum()
        return self._lik.nll(f, y).sum()

    def _fitted(self) -> None:
        """Hook: refresh cached factorisations after a fit."""

    def _add(self, old: Any, new: Any) -> Any:
        return old + new

    def _curvature(self, batches: list[tuple[Tensor, Tensor | None]]) -> Any:
        raise NotImplementedError

    # ------------------------------------------------------------------ evidence
    def _log_det_posterior(self, delta: Tensor, factor: Tensor | float) -> Tensor:
        raise NotImplementedError

    def log_det_ratio_at(
        self,
        prior_precision: float | Tensor | None = None,
        sigma_noise: Tensor | float | None = None,
    ) -> Tensor:
        """``log det(G / (s^2 T) + D) - log det D`` at ``delta = prior_precision`` and
        ``s = sigma_noise`` (defaults: the current values; differentiable in both)."""
        self._require_fit()
        d = self._delta if prior_precision is None else self._check_delta(prior_precision)
        return self._log_det_ratio(d, self._factor(sigma_noise))

    def _log_det_ratio(self, delta: Tensor, factor: Tensor | float) -> Tensor:
        """``log det(G factor + D) - log det D``; structures with eigenvalues ``lambda_i`` of
        ``G`` in ``D``'s basis override it with ``sum_i log1p(lambda_i factor / delta_i)``,
        which has no cancellation between two sums of ``P`` terms (in float32 the
        difference of two sums of ~1e7 logarithms loses about three digits)."""
        return self._log_det_posterior(delta, factor) - self._delta_vector(delta).log().sum()

    def scatter_at(self, prior_precision: float | Tensor | None = None) -> Tensor:
        """``(theta* - m0)^T D (theta* - m0)`` (differentiable in ``delta``)."""
        d = self._delta if prior_precision is None else self._check_delta(prior_precision)
        return (self._delta_vector(d) * (self._mu - self.prior_mean) ** 2).sum()

    # ------------------------------------------------------------------ posterior
    @property
    def posterior_precision(self) -> Any:
        """``G / (s^2 T) + D`` in the structure's form."""
        raise NotImplementedError

    @property
    def posterior_variance(self) -> Tensor:
        """The marginal variances ``diag(Sigma)`` ``[P]``."""
        raise NotImplementedError

    @property
    def posterior_covariance(self) -> Tensor:
        """``Sigma`` ``[P, P]`` (dense: small subsets only)."""
        raise NotImplementedError

    def sample(self, n_samples: int = 100, generator: torch.Generator | None = None) -> Tensor:
        """``[n_samples, P]`` draws of ``theta ~ q`` (parameter order of the subset)."""
        if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1:
            raise ValueError(f"n_samples must be a positive int, got {n_samples!r}")
        self._require_fit()
        z = randn_like_on((n_samples, self.num_params), generator, self._mu.dtype, self._mu.device)
        return self._mu + self._sqrt_cov_times(z)

    def _sqrt_cov_times(self, z: Tensor) -> Tensor:
        """``Sigma^{1/2} z`` row by row (any square root ``R`` with ``R R^T = Sigma``)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ predictive
    def _mean_and_variance(self, x: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def _kernel(self, x1: Tensor, x2: Tensor) -> Tensor:
        raise NotImplementedError

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to rebuild the fit without the data (``torch.save``-able)."""
        checks.at_state_dict(self)
        return {
            "structure": self.structure,
            "subset_of_weights": self.subset_of_weights,
            "parameter_names": self.parameter_names,
            "mean": self._mu,
            "prior_mean": self.prior_mean,
            "prior_precision": self._delta,
            "sigma_noise": self._sigma,
            "temperature": self.temperature,
            "H": self._h_state(self._require_fit()),
            "loss": self.loss,
            "n_data": self.n_data,
            "n_outputs": self.n_outputs,
            "n_targets": self._n_targets,
            "likelihood": repr(self._lik),
        }

    def _h_state(self, h: Any) -> Any:
        return h

    def _h_load(self, state: Any) -> Any:
        return state.to(self._mu)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`; refuses a fit of another structure, subset,
        likelihood or parameter set."""
        checks.at_load(self, state)
        for key, mine in (("structure", self.structure),
                          ("subset_of_weights", self.subset_of_weights),
                          ("likelihood", repr(self._lik))):  # fmt: skip
            if state.get(key) != mine and key == "likelihood":
                raise ValueError(f"state was fitted with {state.get(key)}, this is {mine}")
            if state.get(key) != mine:
                raise ValueError(f"state has {key}={state.get(key)!r}, this is {mine!r}")
        self._prepare_names(list(state["parameter_names"]))
        if list(state["parameter_names"]) != self.parameter_names:
            raise ValueError(
                f"state is over parameters {state['parameter_names'][:3]}..., this model's "
                f"subset is {self.parameter_names[:3]}..."
            )
        self._mu = state["mean"].to(self._mu)
        self._warn_if_weights_differ()
        self.prior_mean = state["prior_mean"].to(self._mu)
        self.prior_precision = state["prior_precision"]
        self._sigma = float(state["sigma_noise"])
        self.temperature = float(state["temperature"])
        self.H = self._h_load(state["H"])
        self.loss = None if state["loss"] is None else state["loss"].to(self._mu)
        self.n_data, self.n_outputs = int(state["n_data"]), int(state["n_outputs"])
        # fromp 0.3 states stored the number of targets N C as n_outputs
        self._n_targets = int(state.get("n_targets", self.n_outputs))
        self._fitted()
