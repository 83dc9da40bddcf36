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

from fromp._checks import check_chunk_size, check_prior_precision, require_eval
from fromp.curvature.diagonal import DataArg, iter_batches
from fromp.curvature.jacobian import check_memory_budget, free_memory
from fromp.laplace.base import _likelihood
from fromp.laplace.options import check_backend, option
from fromp.laplace.predictive import LaplaceTorchAPI
from fromp.likelihood import GaussianLikelihood

__all__ = ["FunctionalLaplace"]


class FunctionalLaplace(LaplaceTorchAPI):
    """The subset-of-data GP Laplace of all weights (module docstring).

    Args (laplace-torch's): ``model``, ``likelihood``, ``n_subset`` (``M``),
    ``sigma_noise``, ``prior_precision`` (a scalar: the GP view needs an isotropic prior),
    ``prior_mean``, ``temperature``, ``enable_backprop``, ``dict_key_x``, ``dict_key_y``,
    ``backend`` / ``backend_kwargs`` (GGN only), ``independent_outputs``, ``seed``;
    fromp's ``full_output_hessian`` (default False: laplace-torch's diagonal) and
    ``chunk_size`` (examples per Jacobian chunk) and ``memory_budget`` (bytes for the
    predictive's chunks of test inputs; None: the device's default, see
    :mod:`fromp.laplace.predictive`).
    """

    structure = "gp"
    subset_of_weights = "all"

    def __init__(
        self,
        model: nn.Module,
        likelihood: Any,
        n_subset: int,
        sigma_noise: float | Tensor = 1.0,
        prior_precision: float | Tensor = 1.0,
        prior_mean: float | Tensor = 0.0,
        temperature: float = 1.0,
        enable_backprop: bool = False,
        dict_key_x: str = "input_ids",
        dict_key_y: str = "labels",
        backend: Any = None,
        backend_kwargs: dict[str, Any] | None = None,
        independent_outputs: bool = False,
        seed: int = 0,
        full_output_hessian: bool = False,
        chunk_size: int | None = None,
        memory_budget: int | None = None,
    ) -> None:
        if memory_budget is not None:
            check_memory_budget(memory_budget)
        self.memory_budget = memory_budget
        check_backend(backend, backend_kwargs)
        if isinstance(n_subset, bool) or not isinstance(n_subset, int) or n_subset < 1:
            raise ValueError(f"n_subset must be a positive int, got {n_subset!r}")
        if not (isinstance(temperature, int | float) and temperature > 0):
            raise ValueError(f"temperature must be a positive number, got {temperature!r}")
        self.model = model
        self._lik, self._sigma = _likelihood(option(likelihood), sigma_noise)
        self.regression = isinstance(self._lik, GaussianLikelihood)
        self.temperature = float(temperature)
        self.enable_backprop, self.dict_key_x, self.dict_key_y = (
            bool(enable_backprop), dict_key_x, dict_key_y,
        )  # fmt: skip
        self.n_subset, self.independent_outputs, self.seed = n_subset, independent_outputs, seed
        self.full_output_hessian = full_output_hessian
        self.chunk_size = check_chunk_size(chunk_size)
        self._named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.sizes = [p.numel() for _, p in self._named]
        self._mu = torch.cat([p.detach().reshape(-1) for _, p in self._named]).clone()
        self.prior_precision = prior_precision
        m0 = torch.as_tensor(prior_mean, dtype=self._mu.dtype, device=self._mu.device)
        m0 = m0.expand(self.num_params) if m0.ndim == 0 else m0
        if m0.shape != self._mu.shape:
            raise ValueError(f"prior_mean must be a float or have shape [P]=[{self.num_params}]")
        self.prior_mean = m0.clone()
        self.H: Any = None
        self.n_data, self.n_outputs, self.loss = 0, 0, None

    # ------------------------------------------------------------------ hyperparameters
    num_params = property(lambda self: self._mu.numel())
    n_layers = property(lambda self: len(self._named))

    def _device(self) -> torch.device:
        return self._mu.device

    def _require_fit(self) -> Any:
        if self.H is None:
            raise ValueError("call fit(train_loader) first")
        return self.H

    @property
    def prior_precision(self) -> Tensor:
        return self._delta

    @prior_precision.setter
    def prior_precision(self, value: float | Tensor) -> None:
        self._delta = self._check_delta(value).detach()

    def _check_delta(self, value: float | Tensor) -> Tensor:
        """``value`` as a 0-dim ``delta`` on the mean's dtype and device (differentiable)."""
        if isinstance(value, Tensor) and value.numel() != 1:
            raise ValueError(
                "FunctionalLaplace needs a positive scalar prior_precision (the GP view of "
                f"the linearised network needs an isotropic prior), got shape {tuple(value.shape)}"
            )
        value = value.reshape(()) if isinstance(value, Tensor) else value
        return check_prior_precision(value, sizes={}, like=self._mu)  # type: ignore[return-value]

    def _delta_vector(self, d: Tensor) -> Tensor:
        return d.reshape(()).expand(self.num_params)

    @property
    def sigma_noise(self) -> Tensor:
        return torch.tensor(self._sigma, dtype=self._mu.dtype, device=self._mu.device)

    @sigma_noise.setter
    def sigma_noise(self, value: float | Tensor) -> None:
        v = float(value.detach()) if isinstance(value, Tensor) else float(value)
        if not (v > 0 and math.isfinite(v)) or (not self.regression and v != 1.0):
            raise ValueError(f"sigma_noise must be positive (1 for classification), got {v}")
        self._sigma = v

    def _factor(self, sigma: Any = None) -> Any:
        s = self._sigma if sigma is None else sigma
        return 1.0 / (s**2 * self.temperature) if self.regression else 1.0 / self.temperature

    @property
    def gp_kernel_prior_variance(self) -> Tensor:
        """``s = M / (N delta)``."""
        return self.n_subset / self.n_data / self._delta

    # ------------------------------------------------------------------ fit
    def fit(self, train_loader: DataArg, override: bool = True, progress_bar: bool = False):
        """Draw the ``M`` subset points of ``train_loader`` and keep their Jacobians,
        outputs and loss Hessians at the model's current weights."""
        if not override:
            raise ValueError("FunctionalLaplace.fit takes override=True only (laplace-torch's)")
        require_eval(self.model)
        batches = list(iter_batches(self._undict(train_loader), need_targets=True))
        x = torch.cat([b[0] for b in batches]).to(self._device())
        y = torch.cat([b[1] for b in batches]).to(self._device())
        n = len(x)
        if self.n_subset > n:
            raise ValueError(f"n_subset={self.n_subset} exceeds the N={n} training points")
        self._check_jacobian_fits(x)
        idx = torch.as_tensor(np.random.default_rng(self.seed).choice(n, self.n_subset,
                                                                      replace=False))  # fmt: skip
        self._mu = torch.cat([p.detach().reshape(-1) for _, p in self._named]).clone()
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
        return self

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

    def optimize_prior_precision(
        self,
        pred_type: str = "gp",
        method: str = "marglik",
        n_steps: int = 100,
        lr: float = 0.1,
        init_prior_prec: float = 1.0,
        **kwargs: Any,
    ) -> Tensor:
        """laplace-torch's: ``n_steps`` Adam steps of rate ``lr`` on ``log delta`` from
        ``init_prior_prec`` maximising the evidence (``method="marglik"``, scalar prior)."""
        if option(method) != "marglik":
            raise ValueError("FunctionalLaplace.optimize_prior_precision takes method='marglik'")
        init = check_prior_precision(init_prior_prec, sizes={}, name="init_prior_prec")
        log_d = torch.tensor(math.log(float(init)), dtype=self._mu.dtype, requires_grad=True)
        opt = torch.optim.Adam([log_d], lr=lr)
        for _ in range(n_steps):
            opt.zero_grad()
            (-self._evidence(log_d.exp(), None)).backward()
            opt.step()
        self.prior_precision = log_d.detach().exp()
        return self.prior_precision

    # ------------------------------------------------------------------ predictive
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
