r"""Low-rank Laplace (laplace-torch's ``hessian_structure="lowrank"``, all weights).

The GGN ``G = sum_n J_n^T Lambda_n J_n`` ``[P, P]`` is kept as its top ``k`` eigenpairs
``G ~= U diag(lam) U^T`` (``U`` ``[P, k]`` orthonormal, ``lam`` ``[k]`` descending, summed
over the data, not averaged), and the posterior precision is

    ``Prec = U diag(lam / (s^2 T)) U^T + D``,  ``D = diag(d)`` ``[P]``

(``d`` from a scalar, per-tensor or per-parameter ``delta``). With ``W = D^{-1/2} U
diag(lam / (s^2 T))^{1/2}`` ``[P, k]`` and ``M = W^T W`` ``[k, k]``, everything costs
``O(P k^2)``, never a ``[P, P]`` matrix:

* ``log det Prec = sum log d + log det(I_k + M)``;
* ``Sigma = D^{-1/2} (I - W (I + M)^{-1} W^T) D^{-1/2}`` (Woodbury), so
  ``J Sigma J'^T = A A'^T - (A W) (I + M)^{-1} (A' W)^T`` with ``A = J D^{-1/2}``, and
  ``diag Sigma = 1/d - rowsum((D^{-1/2} W L^{-T})^2)`` (``L L^T = I + M``);
* ``Sigma^{1/2} z = D^{-1/2} (I + W Q diag(c) Q^T W^T) z`` with ``M = Q diag(m) Q^T`` and
  ``c = ((1 + m)^{-1/2} - 1) / m = -1 / (sqrt(1 + m) (1 + sqrt(1 + m)))``, a symmetric
  square root of ``Sigma``.

The eigenpairs (``eig_method``):

* ``"gram"``: ``G = R^T R`` with ``R = [L_n^T J_n]_n`` ``[N K, P]`` (``Lambda_n = L_n
  L_n^T``); the nonzero spectrum of ``G`` is that of ``R R^T`` ``[N K, N K]``, whose
  eigenvectors ``v`` give ``u = R^T v / sqrt(lam)``. Exact; needs ``R`` and the Gram in
  memory (``N K P + min(N K, P)^2`` numbers, at most ``memory_budget`` bytes); when
  ``P < N K`` the ``[P, P]`` matrix ``R^T R`` is decomposed instead (small models).
* ``"subspace"``: block subspace iteration on GGN-matrix products ``G V`` (forward-mode
  ``J V``, then ``J^T Lambda (J V)`` by reverse mode, vectorised over the ``k +
  oversampling`` columns), with a Rayleigh-Ritz step each pass, until the top ``k`` Ritz
  values change by less than ``tol`` (relative) or ``max_iter`` passes over the data.
* ``"auto"``: ``"gram"`` when ``R`` fits the memory budget, else ``"subspace"``.

Eigenvalues below ``max(lam) * max(P, N K) * eps`` (numerical zeros) are dropped, so
``k`` may come out smaller than asked (as laplace-torch drops eigenvalues under its EPS).
``fit(..., override=False)`` adds ``U_1 diag(lam_1) U_1^T + U_2 diag(lam_2) U_2^T`` (rank
``<= k_1 + k_2``, decomposed through a thin QR) and keeps its top ``k``: exact when the sum
has rank ``<= k``, otherwise the best rank-``k`` approximation of the sum of the two
truncations, not of the full sum (laplace-torch refuses ``override=False`` here).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from fromp.curvature.ggn import ggn_matmat
from fromp.curvature.jacobian import iter_jacobians, trainable_params
from fromp.laplace.base import ParametricLaplace
from fromp.likelihood import Likelihood

__all__ = ["LowRankLaplace", "top_eigenpairs"]


def _truncate(lam: Tensor, vecs: Tensor, k: int, size: int) -> tuple[Tensor, Tensor]:
    """The top ``k`` of descending ``lam`` above the numerical-zero threshold."""
    lam, vecs = lam[:k], vecs[:, :k]
    if len(lam) == 0:
        return vecs, lam
    keep = lam > lam[0].clamp_min(0) * size * torch.finfo(lam.dtype).eps
    return vecs[:, keep], lam[keep]


def top_eigenpairs(
    model: nn.Module,
    batches: list[Tensor],
    likelihood: Likelihood,
    k: int,
    *,
    method: str = "auto",
    chunk_size: int | None = None,
    memory_budget: int = 2 * 1024**3,
    oversampling: int = 10,
    max_iter: int = 100,
    tol: float = 1e-10,
    seed: int = 0,
) -> tuple[Tensor, Tensor]:
    """``(U [P, k'], lam [k'])``: the top ``k' <= k`` eigenpairs of the GGN of ``model`` on
    the input batches (module docstring), ``lam`` descending and positive."""
    params = trainable_params(model)
    p_total = sum(p.numel() for p in params.values())
    ref = next(iter(params.values()))
    with torch.no_grad():
        k_out = likelihood.sqrt_hessian(model(batches[0][:1])).shape[-1]
    rows = sum(len(x) for x in batches) * k_out
    if method == "auto":
        need = (rows * p_total + min(rows, p_total) ** 2) * ref.element_size()  # R, Gram
        fits = need <= memory_budget
        method = "gram" if fits else "subspace"
    if method == "gram":
        parts = []
        for x in batches:
            with torch.no_grad():
                sqrt_lam = likelihood.sqrt_hessian(model(x))  # [N, C, K]
            for r, jac in iter_jacobians(model, x, chunk_size=chunk_size):
                parts.append(torch.einsum("nck,ncp->nkp", sqrt_lam[r], jac).flatten(0, 1))
        big = torch.cat(parts)  # R [N K, P]
        if p_total <= len(big):
            lam, vecs = torch.linalg.eigh(big.T @ big)
            return _truncate(lam.flip(0), vecs.flip(1), k, max(p_total, rows))
        lam, v = torch.linalg.eigh(big @ big.T)
        lam, v = lam.flip(0)[:k], v.flip(1)[:, :k]
        v, lam = _truncate(lam, v, k, max(p_total, rows))
        return (big.T @ v) / lam.sqrt(), lam
    if method != "subspace":
        raise ValueError(f"eig_method must be 'auto', 'gram' or 'subspace', got {method!r}")
    m = min(p_total, k + oversampling)
    gen = torch.Generator(device=ref.device).manual_seed(seed)
    q, _ = torch.linalg.qr(
        torch.randn(p_total, m, generator=gen, dtype=ref.dtype, device=ref.device)
    )
    prev = None
    for _ in range(max_iter):
        y = ggn_matmat(model, batches, likelihood, q)
        t = q.T @ y
        theta, s = torch.linalg.eigh(0.5 * (t + t.T))
        theta, s = theta.flip(0), s.flip(1)
        top = theta[:k]
        if prev is not None and bool((top - prev).abs().max() <= tol * top.abs().max()):
            break
        prev = top
        q, _ = torch.linalg.qr(y)
    return _truncate(theta, q @ s, k, max(p_total, rows))


class LowRankLaplace(ParametricLaplace):
    """``subset_of_weights="all"``, ``hessian_structure="lowrank"`` (module docstring).

    Args (besides :class:`~fromp.laplace.base.BaseLaplace`'s):
        low_rank: ``k``, the number of eigenpairs kept (laplace-torch: 10, given there as
            ``backend_kwargs={"low_rank": k}``, which is accepted too).
        eig_method: ``"auto"``, ``"gram"`` or ``"subspace"``; oversampling, max_iter, tol,
            seed: the subspace iteration's controls.

    ``posterior_precision`` is laplace-torch's ``((U, lam / (s^2 T)), d)``.
    """

    _key = ("all", "lowrank")
    structure = "lowrank"

    def __init__(
        self,
        model: nn.Module,
        likelihood: str | Likelihood,
        *,
        low_rank: int = 10,
        backend_kwargs: dict[str, Any] | None = None,
        eig_method: str = "auto",
        oversampling: int = 10,
        max_iter: int = 100,
        tol: float = 1e-10,
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        if backend_kwargs:
            extra = set(backend_kwargs) - {"low_rank"}
            if extra:
                raise ValueError(f"backend_kwargs takes only 'low_rank' here, got {sorted(extra)}")
            low_rank = backend_kwargs.get("low_rank", low_rank)
        if isinstance(low_rank, bool) or not isinstance(low_rank, int) or low_rank < 1:
            raise ValueError(f"low_rank must be a positive int, got {low_rank!r}")
        if eig_method not in ("auto", "gram", "subspace"):
            raise ValueError(f"eig_method must be 'auto', 'gram' or 'subspace', got {eig_method!r}")
        super().__init__(model, likelihood, **kwargs)
        self.low_rank, self.eig_method = low_rank, eig_method
        self._eig_kw = {"oversampling": oversampling, "max_iter": max_iter, "tol": tol,
                        "seed": seed}  # fmt: skip

    # ------------------------------------------------------------------ curvature
    def _curvature(self, batches):
        return top_eigenpairs(
            self.model, [x for x, _ in batches], self._lik, self.low_rank,
            method=self.eig_method, chunk_size=self.chunk_size,
            memory_budget=self._budget(), **self._eig_kw,
        )  # fmt: skip

    def _add(self, old, new):
        w = torch.cat([old[0] * old[1].sqrt(), new[0] * new[1].sqrt()], 1)  # [P, k1 + k2]
        q, r = torch.linalg.qr(w)
        lam, v = torch.linalg.eigh(r @ r.T)
        v, lam = _truncate(lam.flip(0), v.flip(1), self.low_rank, max(w.shape))
        return q @ v, lam

    def _h_state(self, h):
        return {"U": h[0], "eigenvalues": h[1]}

    def _h_load(self, state):
        return state["U"].to(self._mu), state["eigenvalues"].to(self._mu)

    @property
    def rank(self) -> int:
        """``k'``: the eigenpairs kept."""
        return len(self._require_fit()[1])

    # ------------------------------------------------------------------ Woodbury pieces
    def _parts(self, delta: Tensor, factor: Tensor | float) -> tuple[Tensor, Tensor, Tensor]:
        """``(d [P], W [P, k], chol(I + W^T W) [k, k])``."""
        u, lam = self._require_fit()
        d = self._delta_vector(delta)
        w = u * (lam * factor).sqrt() / d.sqrt()[:, None]
        eye = torch.eye(w.shape[1], dtype=w.dtype, device=w.device)
        return d, w, torch.linalg.cholesky(eye + w.T @ w)

    def _log_det_posterior(self, delta, factor):
        d, _, chol = self._parts(delta, factor)
        return d.log().sum() + 2 * torch.diagonal(chol).log().sum()

    @property
    def posterior_precision(self) -> tuple[tuple[Tensor, Tensor], Tensor]:
        """``((U [P, k], lam / (s^2 T) [k]), d [P])``: ``Prec = U diag(.) U^T + diag(d)``."""
        u, lam = self._require_fit()
        return (u, lam * self._factor()), self._delta_vector(self._delta)

    @property
    def posterior_covariance(self) -> Tensor:
        """``Sigma`` ``[P, P]`` (dense: small models only)."""
        d, w, chol = self._parts(self._delta, self._factor())
        z = torch.linalg.solve_triangular(chol, w.T, upper=False)  # L^{-1} W^T [k, P]
        inner = torch.eye(len(d), dtype=d.dtype, device=d.device) - z.T @ z
        s = d.rsqrt()
        return s[:, None] * inner * s[None, :]

    @property
    def posterior_variance(self) -> Tensor:
        d, w, chol = self._parts(self._delta, self._factor())
        z = torch.linalg.solve_triangular(chol, w.T, upper=False)
        return (1 - (z**2).sum(0)) / d

    def _sqrt_cov_times(self, z):
        d, w, _ = self._parts(self._delta, self._factor())
        m, q = torch.linalg.eigh(w.T @ w)
        m = m.clamp_min(0)
        c = -1 / ((1 + m).sqrt() * (1 + (1 + m).sqrt()))
        wq = w @ q  # [P, k]
        r = z + ((z @ wq) * c) @ wq.T
        return r * d.rsqrt()

    @property
    def V(self) -> Tensor:
        """laplace-torch's ``V = D^{-1} U`` ``[P, k]``."""
        (u, _), d = self.posterior_precision
        return u / d.reshape(-1, 1)

    @property
    def Kinv(self) -> Tensor:
        """laplace-torch's ``(diag(1 / lam') + U^T V)^{-1}`` ``[k, k]`` (``lam' = lam / (s^2
        T)``): ``Sigma = D^{-1} - V Kinv V^T`` (Woodbury)."""
        (u, lam), _ = self.posterior_precision
        return torch.linalg.inv(torch.diag(1 / lam) + u.T @ self.V)

    def _sigma_times(self, v: Tensor) -> Tensor:
        """``Sigma v`` for rows ``v`` ``[K, P]`` (Woodbury)."""
        d, w, chol = self._parts(self._delta, self._factor())
        a = v * d.rsqrt()
        e = torch.cholesky_solve((a @ w).T, chol)  # (I + M)^{-1} W^T a^T  [k, K]
        return (a - (w @ e).T) * d.rsqrt()

    def _prec_times(self, v: Tensor) -> Tensor:
        """``Prec v = U diag(lam / (s^2 T)) U^T v + d v`` for rows ``v`` ``[K, P]``."""
        u, lam = self._require_fit()
        return ((v @ u) * (lam * self._factor())) @ u.T + v * self._delta_vector(self._delta)

    # ------------------------------------------------------------------ predictive
    def _rows(self, jac: Tensor, d: Tensor, w: Tensor, chol: Tensor) -> tuple[Tensor, Tensor]:
        """``(A [N, C, P], L^{-1} (A W)^T [k, N, C])``, ``A = J D^{-1/2}``, for Jacobians
        ``J`` ``[N, C, P]``."""
        a = jac * d.rsqrt()
        b = torch.einsum("ncp,pk->knc", a, w)
        e = torch.linalg.solve_triangular(chol, b.flatten(1), upper=False)
        return a, e.reshape(b.shape)

    def _mean_and_variance(self, x):
        with torch.no_grad():
            f = self.model(x)
        parts = self._parts(self._delta, self._factor())
        var = f.new_zeros(*f.shape, f.shape[1])
        for r, jac in iter_jacobians(self.model, x, chunk_size=self.chunk_size or 32):
            a, e = self._rows(jac, *parts)  # a chunk of examples at a time
            var[r] = torch.einsum("ncp,ndp->ncd", a, a) - torch.einsum("knc,knd->ncd", e, e)
        return f, var

    def _jac(self, x: Tensor) -> Tensor:
        return torch.cat([j for _, j in iter_jacobians(self.model, x, chunk_size=self.chunk_size)])

    def _kernel(self, x1, x2):
        parts = self._parts(self._delta, self._factor())
        a1, e1 = self._rows(self._jac(x1), *parts)
        a2, e2 = (a1, e1) if x2 is x1 else self._rows(self._jac(x2), *parts)
        return torch.einsum("ncp,mdp->ncmd", a1, a2) - torch.einsum("knc,kmd->ncmd", e1, e2)
