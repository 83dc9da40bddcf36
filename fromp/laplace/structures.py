r"""The Hessian structures of :mod:`fromp.laplace.base` (the :func:`~fromp.Laplace` factory
is in :mod:`fromp.laplace.factory`).

One class per (subset of weights, structure), as in laplace-torch:

=========================  ===================  ===================  ===================
subset \\ structure        ``"diag"``           ``"kron"``           ``"full"``
=========================  ===================  ===================  ===================
``"all"``                  :class:`DiagLaplace`  :class:`KronLaplace`  :class:`FullLaplace`
``"last_layer"``           :class:`DiagLLLaplace` :class:`KronLLLaplace` :class:`FullLLLaplace`
=========================  ===================  ===================  ===================

The last-layer classes are in :mod:`fromp.laplace.lastlayer`, subnetworks (``"diag"``,
``"full"``) in :mod:`fromp.laplace.subnet`, the all-weights ``"lowrank"`` structure in
:mod:`fromp.laplace.lowrank`.

All weights: the diagonal comes from layer capture (any module), the Kronecker factors from
:mod:`fromp.curvature.kron` (``Linear`` / ``Conv2d``), the full GGN from
:func:`fromp.curvature.ggn.ggn` (small models). Last layer ``f = W phi + b``: ``J_n = I_C (x)
[phi_n; 1]^T`` in closed form, the features ``phi`` captured once per batch, so the structures cost
``O(N C D)`` (diagonal, Kronecker) or ``O(N C^2 D^2)`` (full) and need no per-example Jacobian of
the network.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

import fromp.laplace.checks as checks
from fromp.curvature.capture import LayerMap, capture_calls
from fromp.curvature.diagonal import diag_ggn
from fromp.curvature.ggn import ggn
from fromp.curvature.kron import KronCurvature, KronEigen, kron_curvature
from fromp.curvature.layer_rules import per_example_layer_grads, rule_for
from fromp.laplace.base import ParametricLaplace
from fromp.posterior import DiagonalGaussian, FullGaussian

__all__ = ["DiagLaplace", "FullLaplace", "KronH", "KronLaplace", "KronPrecision"]


class _AllWeightsGP:
    """All weights, diagonal or full ``Sigma``: the predictive and kernel of
    :class:`fromp.gp.GP` (structured layer capture for the diagonal), linearised at the
    model's current weights (as every structure: :mod:`fromp.laplace.predictive`)."""

    def _gp(self, memory_budget: int | None = None) -> Any:
        from fromp.gp.process import GP

        now = torch.cat([p.detach().reshape(-1) for _, p in self._named]).to(self._mu)
        post = self.posterior.replace(mean=now)
        budget = self._budget(memory_budget)
        return GP(self.model, post, self._lik,
                  chunk_size=self.chunk_size, memory_budget=budget)  # fmt: skip

    def _mean_and_variance(self, x: Tensor) -> tuple[Tensor, Tensor]:
        gp = self._gp()
        return gp.mean(x), gp.variance(x)

    def _mean_and_variance_chunked(
        self, x: Tensor, memory_budget: int | None = None
    ) -> tuple[Tensor, Tensor]:
        # the GP takes the inputs in chunks under the same budget itself (its mean by
        # forward passes, its variance by Jacobian or structured-feature chunks): one GP
        # (one factorisation of the posterior) for all chunks
        gp = self._gp(memory_budget)
        return gp.mean(x), gp.variance(x)

    def _glm(
        self, x: Tensor, joint: bool = False, memory_budget: int | None = None
    ) -> tuple[Tensor, Tensor]:
        if joint or self.enable_backprop:
            return super()._glm(x, joint, memory_budget)  # type: ignore[misc]
        mu, var = self._mean_and_variance_chunked(x, memory_budget)
        checks.finite_outputs(mu)
        return mu, var

    def _kernel(self, x1: Tensor, x2: Tensor) -> Tensor:
        return self._gp().kernel(x1, x2)


class _DiagMaths:
    """The posterior maths of a diagonal curvature ``h`` ``[P]`` (the fitted ``H``):
    precision ``h / (s^2 T) + delta``; every diagonal structure (all weights, last layer,
    subnetwork) takes it from here."""

    def _log_det_posterior(self, delta, factor):
        return (self._require_fit() * factor + self._delta_vector(delta)).log().sum()

    def _log_det_ratio(self, delta, factor):
        return torch.log1p(self._require_fit() * factor / self._delta_vector(delta)).sum()

    @property
    def posterior_precision(self) -> Tensor:
        return self._require_fit() * self._factor() + self._delta_vector(self._delta)

    @property
    def posterior_variance(self) -> Tensor:
        return self.posterior_precision.reciprocal()

    @property
    def posterior_covariance(self) -> Tensor:
        return torch.diag(self.posterior_variance)

    def _sqrt_cov_times(self, z):
        return z * self.posterior_variance.sqrt()

    def _sigma_times(self, v: Tensor) -> Tensor:
        """``Sigma v`` for rows ``v`` ``[K, P]``."""
        return v * self.posterior_variance

    def _prec_times(self, v: Tensor) -> Tensor:
        """``Prec v`` for rows ``v`` ``[K, P]``."""
        return v * self.posterior_precision


class DiagLaplace(_AllWeightsGP, _DiagMaths, ParametricLaplace):
    """``subset_of_weights="all"``, ``hessian_structure="diag"``: ``diag(G)`` ``[P]`` by
    layer capture (any ``nn.Module``; Linear, convolution and norm layers from their inputs
    and output gradients, per-example Jacobians for other parameters)::

        la = DiagLaplace(model, "classification").fit(train_loader)
        la.optimize_prior_precision()              # method="marglik"
        probs = la(x_test)                         # probit GLM predictive
        q = la.posterior                           # DiagonalGaussian for FROMP / VOGN
    """

    _key = ("all", "diag")

    def _curvature(self, batches):
        return diag_ggn(self.model, [(x,) for x, _ in batches], self._lik,
                        chunk_size=self.chunk_size, memory_budget=self._budget(),
                        method=self.method)  # fmt: skip

    @property
    def posterior(self) -> DiagonalGaussian:
        """:class:`~fromp.posterior.DiagonalGaussian` ``N(theta*, diag(precision)^{-1})``."""
        return DiagonalGaussian(self._mu.clone(), self.posterior_precision.detach().clone())


class _FullMaths:
    """The posterior maths of a dense curvature ``G`` ``[P, P]`` (the fitted ``H``):
    precision ``G / (s^2 T) + diag(delta)``, its factorisations cached; every full structure (all
    weights, last layer, subnetwork) takes it from here."""

    def _fitted(self):
        self._eig, self._logdet_calls = None, 0

    def _log_det_posterior(self, delta, factor):
        g = self._require_fit()
        self._logdet_calls = getattr(self, "_logdet_calls", 0) + 1
        if delta.ndim == 0 and (self._eig is not None or self._logdet_calls > 1):
            # repeated evaluations (the evidence in delta): one eigendecomposition, then O(P)
            if self._eig is None:
                self._eig = torch.linalg.eigvalsh(g).clamp_min(0)
            return (self._eig * factor + delta).log().sum()
        # one evaluation: a Cholesky factorisation (several times cheaper than eigvalsh),
        # in float64: a float32 G with a small delta is often not numerically PD
        prec = g.double() * factor + torch.diag(self._delta_vector(delta).double())
        chol, info = torch.linalg.cholesky_ex(prec)
        if int(info) != 0 and delta.ndim == 0:  # not PD in float64 either: clamped eigenvalues
            self._eig = torch.linalg.eigvalsh(g).clamp_min(0)
            return (self._eig * factor + delta).log().sum()
        if int(info) != 0:
            chol = torch.linalg.cholesky(prec)  # raises, naming the failure
        return (2 * torch.log(torch.diagonal(chol)).sum()).to(g.dtype)

    @property
    def posterior_precision(self) -> Tensor:
        return self._require_fit() * self._factor() + torch.diag(self._delta_vector(self._delta))

    def _cached(self, name: str, build: Callable[[], Any]) -> Any:
        """``build()``, kept under ``name`` until the fit, ``delta`` (also changed in place:
        the tensors' ``_version``) or ``1 / (s^2 T)`` change: each ``P x P`` factorisation
        is done once for every predictive call, chunk, kernel and sample."""
        h, delta, factor = self._require_fit(), self._delta, float(self._factor())
        stamp = (h._version, delta._version, factor)
        held = getattr(self, "_full_cache", None)
        if held is None or held[0] is not h or held[1] is not delta or held[2] != stamp:
            held = self._full_cache = (h, delta, stamp, {})
        if name not in held[3]:
            held[3][name] = build()
        return held[3][name]

    def _cholesky64(self) -> Tensor:
        """``L`` ``[P, P]`` (float64) with ``precision = L L^T``, cached (:meth:`_cached`)."""
        return self._cached(
            "cholesky64", lambda: torch.linalg.cholesky(self.posterior_precision.double())
        )

    def _covariance(self) -> Tensor:
        """``Sigma`` ``[P, P]`` in the precision's dtype, cached (:meth:`_cached`)."""

        def build() -> Tensor:
            dtype = self.posterior_precision.dtype
            return torch.cholesky_inverse(self._cholesky64()).to(dtype)

        return self._cached("covariance", build)

    posterior_covariance = property(lambda self: self._covariance().clone())
    posterior_variance = property(lambda self: torch.diagonal(self._covariance()).clone())

    def _sigma_times(self, v: Tensor) -> Tensor:
        return v @ self._covariance()

    def _prec_times(self, v: Tensor) -> Tensor:
        return v @ self.posterior_precision

    def _sqrt_cov_times(self, z):
        # Sigma = (L L^T)^{-1} = L^{-T} L^{-1}: theta = L^{-T} z
        chol = self._cholesky64()
        return torch.linalg.solve_triangular(chol.T, z.double().T, upper=True).T.to(z.dtype)


class FullLaplace(_AllWeightsGP, _FullMaths, ParametricLaplace):
    """``subset_of_weights="all"``, ``hessian_structure="full"``: ``G`` ``[P, P]`` (small
    models: ``P <= max_params``)."""

    _key = ("all", "full")

    def _curvature(self, batches):
        g = ggn(self.model, [(x,) for x, _ in batches], self._lik,
                chunk_size=self.chunk_size or 32, max_params=self.max_params)  # fmt: skip
        return 0.5 * (g + g.T)

    @property
    def posterior(self) -> FullGaussian:
        """:class:`~fromp.posterior.FullGaussian` ``N(theta*, precision^{-1})``; its
        Cholesky factorisation is cached until the fit, ``delta`` or ``1 / (s^2 T)`` change
        (each predictive call builds its GP from it: no ``P x P`` factorisation per call)."""
        q = self._cached(
            "posterior", lambda: FullGaussian(self._mu, self.posterior_precision.detach())
        )
        return q._around(self._mu.clone(), q.precision.clone(), q.precision_cholesky)


@dataclass
class KronH(KronCurvature):
    """A fitted Kronecker curvature (``la.H``) with laplace-torch's :meth:`to_matrix`."""

    order: list[str] = field(default_factory=list)

    def to_matrix(self) -> Tensor:
        """The dense block-diagonal ``[P, P]`` of ``B (x) A`` per weight, ``B_bias`` per bias
        and ``diag(h)`` per other parameter tensor, in the subset's parameter order (small
        models only)."""
        blocks: dict[str, Tensor] = {}
        for blk, names in zip(self.blocks, self.names):
            blocks[names[0]] = torch.kron(blk.B, blk.A)
            if len(names) > 1:
                blocks[names[1]] = blk.B_bias
        blocks |= {k: torch.diag(v.reshape(-1)) for k, v in self.diag.items()}
        return torch.block_diag(*[blocks[n] for n in self.order])


class KronPrecision(list):
    """The Kronecker posterior precision: its dense blocks per parameter tensor (a list),
    with laplace-torch's :meth:`to_matrix`."""

    def to_matrix(self) -> Tensor:
        """The dense ``[P, P]`` precision (small models only)."""
        return torch.block_diag(*self)


class _KronMixin:
    """Posterior maths of a KFAC curvature (:class:`fromp.curvature.kron.KronCurvature`)."""

    def _fitted(self):
        if self.H is not None and not isinstance(self.H, KronH):
            h = self.H
            self.H = KronH(h.blocks, h.names, h.n, h.diag, order=self.parameter_names)
        self._eig = KronEigen(self.H) if self.H is not None else None

    def _check_delta(self, value):
        """The prior of :meth:`~fromp.laplace.base.BaseLaplace._check_delta`, and a ``[P]``
        one constant on each parameter tensor (one precision per tensor keeps the
        Kronecker eigenbasis)."""
        d = super()._check_delta(value)
        if d.ndim == 1 and len(d) == self.num_params and len(d) != self.n_layers:
            self._deltas(d)  # refuses one that varies inside a tensor
        return d

    damping = False  # laplace-torch's damped Kronecker sum is not offered (exact eigenvalues)

    @property
    def H_facs(self) -> Any:
        """laplace-torch's name for the undecomposed Kronecker factors: the fitted
        :class:`fromp.curvature.kron.KronCurvature` (``H``; its eigendecomposition is internal)."""
        return self.H

    def _power_times(self, v: Tensor, power: int) -> Tensor:
        """``Prec^power v`` for rows ``v`` ``[K, P]`` (``power`` -1: ``Sigma v``), block by
        block in the factors' eigenbases."""
        self._require_fit()
        eig, deltas, factor = self._eig, self._deltas(self._delta), self._factor()
        parts = []
        for j, (i, kind, m) in enumerate(self._block_views(v)):
            if kind == "w":
                e = eig.weight_eigs(i, factor, deltas[j]) ** power
                parts.append(eig.unrotate_weight(i, eig.rotate_weight(i, m) * e).flatten(-2))
            elif kind == "b":
                e = eig.bias_eigs(i, factor, deltas[j]) ** power
                parts.append(((m @ eig.qbb[i]) * e) @ eig.qbb[i].T)
            else:
                parts.append(m * self._diag_eigs(i, factor, deltas[j]).reshape(-1) ** power)
        return torch.cat(parts, -1)

    def _sigma_times(self, v: Tensor) -> Tensor:
        return self._power_times(v, -1)

    def _prec_times(self, v: Tensor) -> Tensor:
        return self._power_times(v, 1)

    def _h_state(self, h):
        return h.state_dict()

    def _h_load(self, state):
        curv = KronCurvature.from_state_dict(state)
        for b in curv.blocks:
            b.A, b.B = b.A.to(self._mu), b.B.to(self._mu)
            b.B_bias = None if b.B_bias is None else b.B_bias.to(self._mu)
        curv.diag = {k: v.to(self._mu) for k, v in curv.diag.items()}
        return curv

    def _entries(self) -> list[tuple[str, Any]]:
        """Per parameter tensor of the subset, in its order: ``("w", i)`` / ``("b", i)`` for
        KFAC block ``i``'s weight / bias, ``("d", name)`` for a GGN-diagonal block."""
        where: dict[str, tuple[str, Any]] = {}
        for i, names in enumerate(self.H.names):
            where[names[0]] = ("w", i)
            if len(names) > 1:
                where[names[1]] = ("b", i)
        where |= {name: ("d", name) for name in self.H.diag}
        missing = [n for n in self.parameter_names if n not in where]
        if missing:
            raise ValueError(f"the Kronecker curvature does not cover parameters {missing}")
        return [where[n] for n in self.parameter_names]

    def _split_deltas(self, deltas: list[Tensor]) -> tuple[list[Tensor], dict[str, Tensor]]:
        """Per-tensor ``delta`` (subset order) as the KFAC blocks' (in the order of
        ``H.names`` flattened) and the diagonal blocks' (by name)."""
        kron, diag = [], {}
        for (kind, ref), d in zip(self._entries(), deltas):
            if kind == "d":
                diag[ref] = d
            else:
                kron.append(d)
        return kron, diag

    def _check_prior_structure(self, prior_structure):
        if prior_structure == "diag":
            raise ValueError(
                "hessian_structure='kron' takes prior_structure 'scalar' or 'layerwise' (one "
                "precision per parameter tensor keeps the Kronecker eigenbasis)"
            )

    def _deltas(self, delta: Tensor) -> list[Tensor]:
        """One scalar per parameter tensor; a ``[P]`` ``delta`` must be constant on each."""
        if delta.ndim == 0:
            return [delta] * self.n_layers
        if len(delta) == self.n_layers:
            return list(delta.unbind())
        out, k = [], 0
        for size in self.sizes:
            block = delta[k : k + size]
            if not bool((block == block[0]).all()):
                raise ValueError(
                    "hessian_structure='kron' needs prior_precision constant on each parameter "
                    "tensor (a scalar or [n_layers])"
                )
            out.append(block[0])
            k += size
        return out

    def _log_det_posterior(self, delta, factor):
        self._require_fit()
        kron, diag = self._split_deltas(self._deltas(delta))
        total = self._eig.logdet(factor, kron)
        for name, d in diag.items():
            total = total + (self.H.diag[name] * factor + d).log().sum()
        return total

    def _log_det_ratio(self, delta, factor):
        # sum log1p(b_i a_j factor / delta) per weight block, log1p(b factor / delta) per
        # bias block, log1p(h factor / delta) per diagonal block
        self._require_fit()
        eig, total = self._eig, 0.0
        kron, diag = self._split_deltas(self._deltas(delta))
        k = 0
        for i in range(len(eig.la)):
            total = total + torch.log1p(torch.outer(eig.lb[i], eig.la[i]) * factor / kron[k]).sum()
            k += 1
            if eig.lbb[i] is not None:
                total = total + torch.log1p(eig.lbb[i] * factor / kron[k]).sum()
                k += 1
        for name, d in diag.items():
            total = total + torch.log1p(self.H.diag[name] * factor / d).sum()
        return total

    @property
    def posterior_precision(self) -> KronPrecision:
        """Dense precision blocks, one per parameter tensor (``B (x) A / (s^2 T) + delta``
        for a weight, ``diag(h / (s^2 T) + delta)`` for a diagonal block; ``to_matrix()``:
        the ``[P, P]`` matrix): for inspection and tests; the posterior itself is never
        formed."""
        self._require_fit()
        kron, diag = self._split_deltas(self._deltas(self._delta))
        dense = iter(self._eig.to_dense(self._factor(), kron))
        return KronPrecision([
            torch.diag((self.H.diag[ref] * self._factor() + diag[ref]).reshape(-1))
            if kind == "d" else next(dense)
            for kind, ref in self._entries()
        ])  # fmt: skip

    @property
    def posterior_covariance(self) -> Tensor:
        return torch.block_diag(*[torch.linalg.inv(b) for b in self.posterior_precision])

    def _block_views(self, v: Tensor) -> list[tuple[Any, str, Tensor]]:
        """Split ``v [..., P]`` (subset order) into ``(layer, "w"|"b", [..., out, in'] or
        [..., out])`` for KFAC blocks and ``(name, "d", [..., numel])`` for diagonal ones."""
        out, k = [], 0
        for (kind, ref), size in zip(self._entries(), self.sizes):
            m = v[..., k : k + size]
            if kind == "w":
                blk = self.H.blocks[ref]
                m = m.reshape(*v.shape[:-1], blk.B.shape[0], blk.A.shape[0])
            out.append((ref, kind, m))
            k += size
        return out

    def _diag_eigs(self, name: str, factor: Tensor | float, delta: Tensor) -> Tensor:
        return self.H.diag[name].reshape(-1) * factor + delta

    def _sqrt_cov_times(self, z):
        eig, deltas, factor = self._eig, self._deltas(self._delta), self._factor()
        parts = []
        for j, (i, kind, m) in enumerate(self._block_views(z)):
            if kind == "w":
                r = m / eig.weight_eigs(i, factor, deltas[j]).sqrt()
                parts.append(eig.unrotate_weight(i, r).flatten(-2))
            elif kind == "b":
                r = m / eig.bias_eigs(i, factor, deltas[j]).sqrt()
                parts.append(r @ eig.qbb[i].T)
            else:
                parts.append(m / self._diag_eigs(i, factor, deltas[j]).sqrt())
        return torch.cat(parts, -1)

    @property
    def posterior_variance(self) -> Tensor:
        eig, deltas, factor = self._eig, self._deltas(self._delta), self._factor()
        parts = []
        for j, (i, kind, _) in enumerate(self._block_views(self._mu)):
            if kind == "w":
                inv = eig.weight_eigs(i, factor, deltas[j]).reciprocal()
                parts.append((eig.qb[i] ** 2 @ inv @ (eig.qa[i] ** 2).T).flatten())
            elif kind == "b":
                inv = eig.bias_eigs(i, factor, deltas[j]).reciprocal()
                parts.append(eig.qbb[i] ** 2 @ inv)
            else:
                parts.append(self._diag_eigs(i, factor, deltas[j]).reciprocal())
        return torch.cat(parts)


class KronLaplace(_KronMixin, ParametricLaplace):
    """``subset_of_weights="all"``, ``hessian_structure="kron"``: KFAC of every
    ``Linear`` / ``Conv2d`` layer (:mod:`fromp.curvature.kron`) and exact GGN-diagonal blocks for
    the parameters of batch-norm, layer-norm and group-norm layers (a ResNet's); models with
    parameters in other layers are refused (use ``"diag"``). The functional variance and the
    kernel come from each layer's per-example Jacobian rows ``sum_l g_ncl u_nl^T`` rotated
    into the factors' eigenbases: ``sum_ij R_nc,ij R_mc',ij / (b_i a_j / (s^2 T) +
    delta)``, and the diagonal blocks' per-example gradients.

    ``damping`` (laplace-torch's) is taken as False only: fromp uses the exact eigenvalues
    of ``G / (s^2 T) + delta`` in the factors' eigenbases."""

    _key = ("all", "kron")

    def __init__(self, model: nn.Module, likelihood: Any, *, damping: bool = False,
                 **kwargs: Any) -> None:  # fmt: skip
        if damping:
            raise ValueError("damping=True is not supported: fromp's Kronecker posterior uses "
                             "the exact eigenvalues of G / (s^2 T) + delta I")  # fmt: skip
        super().__init__(model, likelihood, **kwargs)

    def _curvature(self, batches):
        # the curvature pass's outputs serve the evidence's data term (no second forward pass)
        self._outputs = []
        return kron_curvature(self.model, batches, self._lik, outputs=self._outputs)

    def _rows(self, x: Tensor, factored: bool = False) -> tuple[Tensor, Any]:
        """``f(x)`` and an iterator of ``(ref, kind, rows)`` per parameter tensor of the
        subset: its Jacobian rows ``[N, C, ...]``, rotated into the factors' eigenbases for
        KFAC blocks, as they are for diagonal blocks (per-example gradients of the layer,
        :mod:`fromp.curvature.layer_rules`). The rows are formed one layer at a time as the
        iterator is consumed: a consumer that reduces each layer's rows before the next
        (the variance) holds one layer's ``[N, C, out, in']``, never all layers' ``[N, C,
        P]``.

        A weight's rotated rows ``R_nc = Q_B^T (sum_l g_ncl u_nl^T) Q_A`` ``[out, in']`` are
        formed from the rotated factors ``(Q_B^T g_ncl)`` and ``(Q_A^T u_nl)`` when that is
        cheaper (``C L out^2 + L in'^2 < C (out^2 in' + out in'^2)``: few positions ``L``),
        else by rotating the product. ``factored``: a layer with one position (``Linear``)
        gives the pair ``(Q_B^T g_nc [N, C, out], Q_A^T u_n [N, in'])`` instead of ``R``
        (``R_nc`` is their outer product: the variance needs no ``[N, C, out, in']``)."""
        layer_map = LayerMap.of(self.model)
        layers = [layer_map.owners[n[0]][0][0] for n in self.H.names]
        d_owner = {name: layer_map.owners[name][0] for name in self.H.diag}
        d_layers = list(dict.fromkeys(m for m, _ in d_owner.values()))
        with torch.enable_grad(), capture_calls(layers + d_layers) as calls:
            f = self.model(x)
        calls = {id(c.module): c for c in calls}
        mods = [m for m in layers + d_layers if id(m) in calls]
        zs = [calls[id(m)].z for m in mods]
        c_out = f.shape[1]
        grads: dict[int, list[Tensor]] = {id(m): [] for m in mods}
        for c in range(c_out):
            v = torch.zeros_like(f)
            v[:, c] = 1
            gs = torch.autograd.grad(f, zs, grad_outputs=v, retain_graph=c < c_out - 1,
                                     allow_unused=True)  # fmt: skip
            for m, g in zip(mods, gs):
                grads[id(m)].append(torch.zeros_like(calls[id(m)].z) if g is None else g.detach())
        del zs
        return f.detach(), self._iter_rows(x, f, layers, d_owner, calls, grads, factored)

    def _iter_rows(self, x, f, layers, d_owner, calls, grads, factored):
        """The iterator of :meth:`_rows` (``grads``: per layer, the output gradients of each
        output ``c``; a layer's are dropped once its rows are formed)."""
        c_out = f.shape[1]
        for i, m in enumerate(layers):
            blk = self.H.blocks[i]
            has_bias = len(self.H.names[i]) > 1
            if not grads.get(id(m)):  # not called (another task's head): zero Jacobian rows
                o, a = blk.B.shape[0], blk.A.shape[0]
                yield i, "w", f.new_zeros(len(x), c_out, o, a)
                if has_bias:
                    yield i, "b", f.new_zeros(len(x), c_out, o)
                continue
            rule = rule_for(m)
            u = rule.input_rows(calls[id(m)].a)  # [N, L, in']
            g = rule.output_rows(torch.stack(grads.pop(id(m)), 1).flatten(0, 1))  # [N C, L, out]
            g = g.view(len(x), c_out, *g.shape[1:]).transpose(2, 3)  # [N, C, out, L]
            qa, qb = self._eig.qa[i], self._eig.qb[i]
            n_pos, o, d_in = u.shape[1], g.shape[2], u.shape[2]
            if factored and n_pos == 1:
                rows = (torch.einsum("nco,op->ncp", g[..., 0], qb), u[:, 0] @ qa)
            elif c_out * n_pos * o * o + n_pos * d_in * d_in < c_out * o * d_in * (o + d_in):
                gb = torch.einsum("ncol,op->ncpl", g, qb)
                rows = torch.einsum("ncol,nli->ncoi", gb, u @ qa)
                del gb
            else:
                rows = self._eig.rotate_weight(i, torch.einsum("ncol,nli->ncoi", g, u))
            del u
            bias = g.sum(-1) @ self._eig.qbb[i] if has_bias else None
            del g
            yield i, "w", rows
            del rows
            if bias is not None:
                yield i, "b", bias
        for name, (m, pn) in d_owner.items():
            numel = self.H.diag[name].numel()
            if not grads.get(id(m)):
                yield name, "d", f.new_zeros(len(x), c_out, numel)
                continue
            per = [per_example_layer_grads(m, calls[id(m)].a, g)[pn] for g in grads[id(m)]]
            yield name, "d", torch.stack(per, 1).reshape(len(x), c_out, numel)

    def _bytes_per_input(self, x: Tensor) -> int:
        """One test input's working bytes for the layer-by-layer variance: the forward
        pass and the ``C`` output gradients of every captured layer (``(C + 2) A``), one
        unfolded input ``U``, and one layer's rows with their temporaries (``3 C`` times
        the largest parameter tensor), plus the diagonal blocks' rows (``C`` times their
        sizes)."""
        c, a, u = self._probe(x)
        diag = sum(h.numel() for h in self.H.diag.values())
        return ((c + 2) * a + u + 3 * c * max(self.sizes) + c * diag) * self._element_size()

    def _weights(self) -> list[Tensor]:
        eig, deltas, factor = self._eig, self._deltas(self._delta), self._factor()
        out = []
        for j, (i, kind, _) in enumerate(self._block_views(self._mu)):
            if kind == "w":
                e = eig.weight_eigs(i, factor, deltas[j])
            elif kind == "b":
                e = eig.bias_eigs(i, factor, deltas[j])
            else:
                e = self._diag_eigs(i, factor, deltas[j])
            out.append(e.reciprocal())
        return out

    def _weight_map(self) -> dict[tuple[str, Any], Tensor]:
        """The inverse eigenvalues :meth:`_weights` keyed by ``(kind, ref)``."""
        return {(kind, ref): w for (kind, ref), w in zip(self._entries(), self._weights())}

    def _mean_and_variance(self, x):
        """``f(x)`` and ``sum_layers sum_ij R_nc,ij R_nd,ij w_ij``, accumulated one layer at
        a time (:meth:`_rows`): the rows of one layer live at once."""
        f, rows = self._rows(x, factored=True)
        weights = self._weight_map()
        var = f.new_zeros(*f.shape, f.shape[1])
        for ref, kind, r in rows:
            w = weights[kind, ref]
            if isinstance(r, tuple):  # R_nc = gb_nc ua_n^T: sum_ij gb_ci gb_di ua_j^2 w_ij
                gb, ua = r
                var += torch.einsum("nci,ni,ndi->ncd", gb, (ua**2) @ w.T, gb)
            else:
                r = r.flatten(2)
                var += torch.einsum("ncp,p,ndp->ncd", r, w.flatten(), r)
            del r
        return f, var

    def _kernel(self, x1, x2):
        _, r1 = self._rows(x1)
        r1 = list(r1)
        r2 = r1 if x2 is x1 else list(self._rows(x2)[1])  # the Gram of one set: rows once
        weights = self._weight_map()
        k = 0.0
        for (ref, kind, a), (_, _, b) in zip(r1, r2):
            a = a.flatten(2)
            aw = a * weights[kind, ref].flatten()
            k = k + torch.einsum("ncp,mdp->ncmd", aw, a if x2 is x1 else b.flatten(2))
        return k
