r"""Functional Laplace (laplace-torch's ``FunctionalLaplace``, ``hessian_structure="gp"``):
the DNN2GP Gaussian process of the linearised network, ``f(x) ~ GP(m(x), k(x, x'))`` with
``m(x) = f_w(x) + J(x) (m0 - w)`` and ``k(x, x') = J(x) J(x')^T / delta``, conditioned by a
Laplace approximation on a subset of ``M = n_subset`` training points (subset of data,
drawn with ``numpy.random.default_rng(seed).choice(N, M, replace=False)``, laplace-torch's
sampler). The prior variance is scaled by ``M / N`` (laplace-torch's ``SoD`` factor), so
``s = M / (N delta)`` and ``K = s J_M J_M^T`` ``[M C, M C]``.

With ``W = (Lambda_M / (s^2 T))^{1/2}`` (the outputs' loss Hessians on the subset: the
softmax Hessian's diagonal, laplace-torch's choice, or its full ``C x C`` blocks with
``full_output_hessian=True``; ``I / (sigma^2 T)`` for regression) the predictive is

    ``var f(x) = s J(x) J(x)^T - s^2 (J(x) J_M^T W) (I + W K W)^{-1} (W J_M J(x)^T)``,

which for ``M = N`` and the full blocks is the all-weights full Laplace's ``J Sigma J^T``
(Woodbury) exactly. ``independent_outputs`` keeps one GP per output (the kernel's diagonal
blocks). The evidence: classification ``log p(y_M | f) - 1/2 [mu^T (K + eps I)^{-1} mu +
log det(I + W K W)]`` with ``mu = J_M (w - m0)`` and ``eps = 1e-5`` (laplace-torch's);
regression the exact GP evidence ``log N(y_M | m(x_M), K + sigma^2 T I)`` (laplace-torch 0.3
adds the data fit ``log p(y | f)`` to it as well: see docs/laplace.md).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

import fromp.laplace.checks as checks
from fromp.curvature.diagonal import DataArg
from fromp.curvature.jacobian import free_memory
from fromp.laplace.base import BaseLaplace
from fromp.laplace.options import option
from fromp.laplace.predictive import takes_mappings

__all__ = ["FunctionalLaplace"]


class FunctionalLaplace(BaseLaplace):
    """The subset-of-data GP Laplace of all weights (module docstring), a
    :class:`~fromp.laplace.base.BaseLaplace` (its prior, noise, checks, evidence
    optimisation and predictive), with a scalar prior precision (the GP view needs an
    isotropic prior).

    Args: ``n_subset`` (``M``), ``independent_outputs``, ``seed`` (laplace-torch's);
    ``full_output_hessian`` (default False: laplace-torch's diagonal); the rest as
    :class:`~fromp.laplace.base.BaseLaplace`.
    """

    _key = ("all", "gp")
    structure = "gp"

    def __init__(
        self,
        model: nn.Module,
        likelihood: Any,
        n_subset: int,
        *,
        independent_outputs: bool = False,
        seed: int = 0,
        full_output_hessian: bool = False,
        **kwargs: Any,
    ) -> None:
        if isinstance(n_subset, bool) or not isinstance(n_subset, int) or n_subset < 1:
            raise ValueError(f"n_subset must be a positive int, got {n_subset!r}")
        super().__init__(model, likelihood, **kwargs)
        self.n_subset, self.independent_outputs, self.seed = n_subset, independent_outputs, seed
        self.full_output_hessian = full_output_hessian

    def _prior_sizes(self) -> dict[str, int]:
        return {}  # a scalar

    def _check_prior_structure(self, prior_structure: str) -> None:
        if prior_structure != "scalar":
            raise ValueError("FunctionalLaplace takes prior_structure='scalar' (the GP view of the "
                             "linearised network needs an isotropic prior)")  # fmt: skip

    @property
    def gp_kernel_prior_variance(self) -> Tensor:
        """``s = M / (N delta)``."""
        return self.n_subset / self.n_data / self._delta

    # ------------------------------------------------------------------ fit
    def fit(self, train_loader: DataArg, override: bool = True, progress_bar: bool = False):
        """Draw the ``M`` subset points of ``train_loader`` and keep their Jacobians,
        outputs and loss Hessians at the model's current weights (mapping batches are
        joined into one mapping)."""
        if not override:
            raise ValueError("FunctionalLaplace.fit takes override=True only (laplace-torch's)")
        groups = checks.at_fit(self, train_loader)
        if any(y is None for _, bs in groups for _, y in bs):
            raise ValueError("FunctionalLaplace.fit needs targets: (x, y) batches")
        mapping = None
        if groups[0][0] is not None:
            if any(m is None for m, _ in groups):
                raise ValueError("train_loader mixes mapping and tensor batches")
            mapping = {k: torch.cat([m[k] for m, _ in groups]) if isinstance(v, Tensor) else v
                       for k, v in groups[0][0].items()}  # fmt: skip
        with checks.on_mapping(self.model, mapping, self.dict_key_x) as idx:
            y = torch.cat([y for _, bs in groups for _, y in bs]).to(self._device())
            x = idx if idx is not None else torch.cat([x for _, bs in groups for x, _ in bs])
            self._fit_subset(x.to(self._device()), y)
        return self

    def _fit_subset(self, x: Tensor, y: Tensor) -> None:
        n = len(x)
        if self.n_subset > n:
            raise ValueError(f"n_subset={self.n_subset} exceeds the N={n} training points")
        self._check_jacobian_fits(x)
        idx = torch.as_tensor(np.random.default_rng(self.seed).choice(n, self.n_subset,
                                                                      replace=False))  # fmt: skip
        self._set_mean()
        self.H = True  # the Jacobians below need a "fitted" object
        js, f = self._jacobians(x[idx])
        self._jm, self._fm, self._ym, self.n_data, self.n_outputs = js, f, y[idx], n, f.shape[1]
        if self.regression:
            lam = torch.eye(f.shape[1], dtype=f.dtype, device=f.device).expand(len(f), -1, -1)
            yy = self._ym.to(f).reshape(f.shape)
            self.loss = ((f - yy) ** 2).sum()
        else:
            lam = self._lik.hessian(f)
            self.loss = self._lik.nll(f, self._ym).sum()
        if not self.full_output_hessian:
            lam = torch.diag_embed(torch.diagonal(lam, dim1=-2, dim2=-1))
        evals, evecs = torch.linalg.eigh(lam)
        self._lam_root = evecs * evals.clamp_min(0).sqrt().unsqueeze(-2)  # L L^T = Lambda
        self.H = (js, lam)

    def _check_jacobian_fits(self, x: Tensor) -> None:
        """Refuse, before any Jacobian is taken, a subset whose Jacobian ``[M, C, P]`` (kept
        by the fit and needed whole by the GP's Gram matrix) is larger than the memory free
        on the model's device: ResNet-18 with ``M = 500`` and ``C = 10`` would need 224 GB."""
        p = self._named[0][1] if self._named else None
        dtype = p.dtype if p is not None else torch.get_default_dtype()
        with torch.no_grad():
            c = int(self.model(x[:2]).reshape(min(2, len(x)), -1).shape[1])
        need = self.n_subset * c * self.num_params * torch.finfo(dtype).bits // 8
        free = free_memory(self._device())
        if free is not None and need > free:
            fits = free // max(1, c * self.num_params * torch.finfo(dtype).bits // 8)
            raise ValueError(
                f"n_subset={self.n_subset}: the 'gp' structure keeps the subset's Jacobian "
                f"[M, C, P] = [{self.n_subset}, {c}, {self.num_params}] ({need / 1e9:.3g} GB), "
                f"more than the {free / 1e9:.3g} GB free on {self._device()}: use n_subset <= "
                f"{fits}, or another structure (diag, kron, lowrank) for this network"
            )

    # ------------------------------------------------------------------ GP maths
    def _w(self, factor: Any) -> Tensor:
        """``W`` ``[M C, M C]`` (block diagonal): ``W W^T = Lambda factor``."""
        m, c = self._fm.shape
        blocks = self._lam_root * math.sqrt(float(factor)) if not isinstance(factor, Tensor) \
            else self._lam_root * factor.sqrt()  # fmt: skip
        return torch.block_diag(*blocks) if m * c else blocks.new_zeros(0, 0)

    def _gram(self) -> Tensor:
        j = self._jm.flatten(0, 1)
        k = j @ j.T
        if self.independent_outputs:
            c = self._fm.shape[1]
            same = torch.arange(len(k), device=k.device) % c
            k = k * (same[:, None] == same[None, :])
        return k

    def _cross(self, js: Tensor) -> Tensor:
        """``J(x) J_M^T`` as ``[N C, M C]`` (independent outputs: same output only)."""
        k = js.flatten(0, 1) @ self._jm.flatten(0, 1).T
        if self.independent_outputs:
            c = self._fm.shape[1]
            rows = torch.arange(k.shape[0], device=k.device) % c
            cols = torch.arange(k.shape[1], device=k.device) % c
            k = k * (rows[:, None] == cols[None, :])
        return k

    def _posterior_cov(self, js: Tensor) -> Tensor:
        """``[N C, N C]``: ``s J J^T - s^2 (J J_M^T W) (I + s W^T K W)^{-1} (W^T J_M J^T)``."""
        self._require_fit()
        s = self.gp_kernel_prior_variance
        w = self._w(self._factor())
        kw = self._cross(js).to(w) @ w
        b = torch.eye(len(w), dtype=w.dtype, device=w.device) + s * w.T @ self._gram() @ w
        prior = js.flatten(0, 1) @ js.flatten(0, 1).T
        if self.independent_outputs:
            c = js.shape[1]
            r = torch.arange(len(prior), device=prior.device) % c
            prior = prior * (r[:, None] == r[None, :])
        return s * prior - s**2 * kw @ torch.linalg.solve(b, kw.T)

    def functional_covariance(self, Js: Tensor) -> Tensor:
        return self._posterior_cov(self._check_js(Js))

    def functional_variance(self, Js: Tensor) -> Tensor:
        """``var f(x_n)`` ``[N, C, C]`` for Jacobians ``Js`` ``[N, C, P]``, a chunk of
        inputs at a time (each input's block needs only its own rows)."""
        js = self._check_js(Js)
        return self._over_inputs(js, self._js_variance, None, 3 * js[0].numel() * js.element_size())

    def _js_variance(self, js: Tensor) -> Tensor:
        n, c = js.shape[:2]
        cov = self._posterior_cov(js).reshape(n, c, n, c)
        return cov[torch.arange(n), :, torch.arange(n), :]

    def _glm_joint(self, x: Tensor, memory_budget: int | None = None) -> tuple[Tensor, Tensor]:
        js, f = self._jacobians(x, enable_backprop=self.enable_backprop)
        return f.flatten(), self.functional_covariance(js)

    def _glm_marginal(self, x: Tensor) -> tuple[Tensor, Tensor]:
        js, f = self._jacobians(x, enable_backprop=self.enable_backprop)
        return f, self._js_variance(js)

    def _mean_and_variance(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self._glm_marginal(x)

    def _kernel(self, x1: Tensor, x2: Tensor) -> Tensor:
        raise NotImplementedError(
            "FunctionalLaplace has no weight-space kernel; use la(x, joint=True)"
        )

    # ------------------------------------------------------------------ evidence
    def _mu_scatter(self) -> Tensor:
        """Regression: ``y - m(x_M)``; classification: ``J_M (w - m0)``, flat ``[M C]``."""
        shift = torch.einsum("mcp,p->mc", self._jm, self._mu - self.prior_mean)
        if self.regression:
            yy = self._ym.to(self._fm).reshape(self._fm.shape)
            return (yy - self._fm + shift).flatten()
        return shift.flatten()

    def _terms(self, delta: Tensor, sigma: Any) -> tuple[Tensor, Tensor, Tensor]:
        """``(data term, scatter, log-determinant)`` of the evidence: classification
        ``(log p(y_M | f), mu^T (K + eps I)^{-1} mu, log det(I + W K W))``; regression
        ``(-(M C / 2) log 2 pi, mu^T A^{-1} mu, log det A)`` with ``A = K + sigma^2 T I``."""
        self._require_fit()
        s = self.n_subset / self.n_data / delta.reshape(())
        k = s * self._gram()
        eye = torch.eye(len(k), dtype=k.dtype, device=k.device)
        mu = self._mu_scatter()
        if self.regression:
            sig = torch.as_tensor(self._sigma if sigma is None else sigma, dtype=k.dtype)
            sig = sig.to(k.device).reshape(())
            chol = torch.linalg.cholesky(k + sig**2 * self.temperature * eye)
            z = torch.linalg.solve_triangular(chol, mu[:, None], upper=False)
            data = torch.tensor(-0.5 * len(mu) * math.log(2 * math.pi), dtype=k.dtype)
            return data, (z**2).sum(), 2 * torch.diagonal(chol).log().sum()
        w = self._w(self._factor())
        chol = torch.linalg.cholesky(eye + w.T @ k @ w)
        scatter = mu @ torch.linalg.solve(k + 1e-5 * eye, mu)
        return -self.loss / self.temperature, scatter, 2 * torch.diagonal(chol).log().sum()

    def _evidence(self, delta: Tensor, sigma: Any) -> Tensor:
        data, scatter, logdet = self._terms(delta, sigma)
        return data - 0.5 * (scatter + logdet)

    @property
    def scatter(self) -> Tensor:
        """The evidence's quadratic term (module docstring)."""
        return self._terms(self._delta, None)[1]

    @property
    def log_det_ratio(self) -> Tensor:
        """The evidence's log-determinant term (module docstring)."""
        return self._terms(self._delta, None)[2]

    def log_marginal_likelihood_at(
        self, prior_precision: Any = None, sigma_noise: Any = None
    ) -> Tensor:
        """The GP evidence (module docstring) at the given values, differentiable in both,
        without storing them (:meth:`log_marginal_likelihood` stores them)."""
        if sigma_noise is not None and not self.regression:
            raise ValueError("sigma_noise is for regression only")
        d = self._delta if prior_precision is None else self._check_delta(prior_precision)
        return self._evidence(d, sigma_noise)

    # ------------------------------------------------------------------ predictive
    @takes_mappings
    def __call__(self, x: Any, pred_type: str = "gp", joint: bool = False,
                 link_approx: str = "probit", n_samples: int = 100,
                 diagonal_output: bool = False, generator: torch.Generator | None = None,
                 fitting: bool = False, memory_budget: int | None = None,
                 **model_kwargs: Any):  # fmt: skip
        """The GP predictive (``pred_type`` ``"gp"`` or ``"glm"``; see
        :meth:`fromp.laplace.predictive.LaplaceTorchAPI.__call__` for the rest)."""
        if option(pred_type) not in ("gp", "glm"):
            raise ValueError("FunctionalLaplace predicts with pred_type='gp' (or 'glm')")
        link_approx = option(link_approx)
        self._require_fit()
        self._budget(memory_budget)
        mu, var = self._glm(self._input(x, memory_budget), joint=joint and self.regression,
                            memory_budget=memory_budget)  # fmt: skip
        return self._linked(mu, var, joint, link_approx, n_samples, diagonal_output, generator)

    def sample(self, n_samples: int = 100, generator: torch.Generator | None = None) -> Tensor:
        raise ValueError("FunctionalLaplace has no weight-space posterior to sample; use "
                         "functional_samples(x)")  # fmt: skip
