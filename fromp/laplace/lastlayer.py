r"""Last-layer Laplace (laplace-torch's ``subset_of_weights="last_layer"``): the last
``nn.Linear`` layer ``f = W phi + b`` as the subset, ``J_n = I_C (x) [phi_n; 1]^T`` in closed
form, the features ``phi`` captured once per batch, so the structures cost ``O(N C D)``
(diagonal, Kronecker) or ``O(N C^2 D^2)`` (full) and need no per-example Jacobian of the
network. The posterior maths is that of :mod:`fromp.laplace.structures`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from fromp.curvature.kron import KronBlock, KronCurvature
from fromp.curvature.last_layer import (
    augment_features,
    last_layer_features,
    last_layer_forward,
    last_layer_ggn,
)
from fromp.laplace.base import ParametricLaplace
from fromp.laplace.structures import _DiagMaths, _FullMaths, _KronMixin

__all__ = ["DiagLLLaplace", "FullLLLaplace", "KronLLLaplace", "LLLaplace"]


class LLLaplace(ParametricLaplace):
    """The last ``nn.Linear`` layer ``f = W phi + b`` as the subset (laplace-torch's
    ``LLLaplace``): ``J_n = I_C (x) [phi_n; 1]^T`` in closed form, features captured once
    per batch. ``last_layer_name`` (laplace-torch's) names the layer (checked at the first
    fit to give the model's output); None finds it at the first fit."""

    subset_of_weights = "last_layer"

    def __init__(self, model, likelihood, *, last_layer_name=None, feature_reduction=None,
                 **kwargs):  # fmt: skip
        if feature_reduction is not None:
            raise ValueError(
                f"feature_reduction={feature_reduction!r} is not supported: fromp's last layer "
                "takes features [N, D] (reduce a sequence dimension inside the model)"
            )
        self.last_layer_name = last_layer_name
        super().__init__(model, likelihood, **kwargs)

    def _subset_named(self):
        if self.last_layer_name is None:
            return []
        layer = dict(self.model.named_modules()).get(self.last_layer_name)
        if not isinstance(layer, nn.Linear):
            raise ValueError(f"last_layer_name={self.last_layer_name!r} must name an nn.Linear "
                             f"of the model, got {type(layer).__name__}")  # fmt: skip
        self.layer_name, self.layer = self.last_layer_name, layer
        return self._layer_named()

    def _layer_named(self):
        prefix = f"{self.layer_name}." if self.layer_name else ""
        return [(prefix + n, p) for n, p in self.layer.named_parameters(recurse=False)
                if p.requires_grad]  # fmt: skip

    def _prepare(self, x: Tensor) -> None:
        self.data = x  # laplace-torch's: an input that found the last layer
        if self.layer is None:
            _, layer = last_layer_features(self.model, x)  # refuses a non-linear head
            self._use_layer(next(n for n, m in self.model.named_modules() if m is layer), layer)
        elif not getattr(self, "_layer_checked", False):
            try:
                last_layer_forward(self.model, x, self.layer)
            except ValueError as err:
                raise ValueError(f"last_layer_name={self.layer_name!r}: {err}") from None
            self._layer_checked = True

    def _prepare_names(self, names: list[str]) -> None:
        if self.layer is None:
            name = names[0].rsplit(".", 1)[0] if "." in names[0] else ""
            self._use_layer(name, self.model.get_submodule(name) if name else self.model)

    def _use_layer(self, name: str, layer: nn.Module) -> None:
        self.layer_name, self.layer = name, layer
        self._named = self._layer_named()
        if not self._named:
            raise ValueError(f"subset_of_weights='last_layer': the last layer ({name or 'model'}) "
                             "has no trainable parameters (requires_grad=False); unfreeze it or "
                             "use subset_of_weights='all'")  # fmt: skip
        self._set_mean()
        self._init_prior()

    def _phi(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(f(x) [N, C], phi(x) [N, D])``: the outputs and the last layer's input."""
        f, phi, _ = last_layer_forward(self.model, x, self.layer, check=False)
        return f, phi

    def _feature_batches(self, batches) -> Iterable[tuple[Tensor, Tensor]]:
        """``(f, phi)`` per batch; ``f`` is kept in ``_outputs`` for the fit's data term."""
        self._outputs = []
        for x, _ in batches:
            f, phi = self._phi(x)
            self._outputs.append(f)
            yield f, phi

    @property
    def _bias(self) -> bool:
        return len(self._named) == 2

    def _tilde(self, phi: Tensor) -> Tensor:
        """``[phi, 1]`` ``[N, D']`` (``D' = D + 1`` with a trainable bias)."""
        return augment_features(phi, self._bias)

    def _to_flat(self, m: Tensor) -> Tensor:
        """``[..., C, D']`` (internal ``[W | b]``) to the flat parameter order
        ``(W row-major, b)`` ``[..., P]``."""
        if not self._bias:
            return m.flatten(-2)
        return torch.cat([m[..., :-1].flatten(-2), m[..., -1]], -1)

    def _from_flat(self, v: Tensor) -> Tensor:
        c = self.layer.out_features
        if not self._bias:
            return v.reshape(*v.shape[:-1], c, -1)
        w, b = v[..., :-c], v[..., -c:]
        return torch.cat([w.reshape(*v.shape[:-1], c, -1), b.unsqueeze(-1)], -1)

    def _lambda(self, f: Tensor) -> Tensor:
        return self._lik.hessian(f)

    def functional_variance_fast(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """laplace-torch's: ``(f(x) [N, C], diag J Sigma J^T [N, C])``."""
        f, var = self._mean_and_variance_chunked(self._input(x))
        return f, torch.diagonal(var, dim1=-2, dim2=-1)

    def _nn_samples(self, x, n_samples, generator, **model_kwargs):
        """``[S, N, C]``: one forward pass for the features ``phi(x)``, then ``f_s = W_s
        phi + b_s`` for each head draw ``theta_s`` (no full forward pass per draw)."""
        if model_kwargs:
            return super()._nn_samples(x, n_samples, generator, **model_kwargs)
        _, phi = self._phi(x)
        heads = self._from_flat(self.sample(n_samples, generator))  # [S, C, D']
        return torch.einsum("nd,scd->snc", self._tilde(phi).to(heads), heads)


class DiagLLLaplace(_DiagMaths, LLLaplace):
    """Last layer, diagonal: ``diag(G)[c, d] = sum_n Lambda_n[c, c] phi~_nd^2``."""

    _key = ("last_layer", "diag")
    structure = "diag"

    def _curvature(self, batches):
        h = 0.0
        for f, phi in self._feature_batches(batches):
            lam = torch.diagonal(self._lambda(f), dim1=-2, dim2=-1)  # [N, C]
            h = h + lam.T @ self._tilde(phi) ** 2
        return self._to_flat(h)

    def _mean_and_variance(self, x):
        f, phi = self._phi(x)
        s = self._from_flat(self.posterior_variance)  # [C, D']
        return f, torch.diag_embed(self._tilde(phi) ** 2 @ s.T)

    def _kernel(self, x1, x2):
        _, p1 = self._phi(x1)
        p2 = p1 if x2 is x1 else self._phi(x2)[1]
        s = self._from_flat(self.posterior_variance)  # [C, D']
        k = torch.einsum("nd,cd,md->ncm", self._tilde(p1), s, self._tilde(p2))
        eye = torch.eye(s.shape[0], dtype=s.dtype, device=s.device)
        return torch.einsum("ncm,cd->ncmd", k, eye)


class FullLLLaplace(_FullMaths, LLLaplace):
    """Last layer, full: ``G = sum_n Lambda_n (x) phi~_n phi~_n^T`` ``[P, P]``."""

    _key = ("last_layer", "full")
    structure = "full"

    def _curvature(self, batches):
        h = 0.0
        for f, phi in self._feature_batches(batches):
            h = h + last_layer_ggn(self._tilde(phi), f, self._lik)  # [C D', C D'] internal
        c = self.layer.out_features
        perm = self._perm(c, h.shape[0] // c)
        return h[perm][:, perm]

    def _perm(self, c: int, d: int) -> Tensor:
        """Flat index -> internal ``[W | b]`` row-major index."""
        idx = torch.arange(c * d).reshape(c, d)
        return self._to_flat(idx)

    def _cov4(self) -> Tensor:
        """``Sigma`` as ``[C, D', C, D']`` (internal order)."""
        cov = self._covariance()
        c = self.layer.out_features
        d = self.num_params // c
        inv = torch.empty_like(self._perm(c, d))
        inv[self._perm(c, d)] = torch.arange(c * d)
        return cov[inv][:, inv].reshape(c, d, c, d)

    def _mean_and_variance(self, x):
        f, phi = self._phi(x)
        t = self._tilde(phi)
        return f, torch.einsum("nd,cdke,ne->nck", t, self._cov4(), t)

    def _kernel(self, x1, x2):
        _, p1 = self._phi(x1)
        p2 = p1 if x2 is x1 else self._phi(x2)[1]
        return torch.einsum("nd,cdke,me->ncmk", self._tilde(p1), self._cov4(), self._tilde(p2))


class KronLLLaplace(_KronMixin, LLLaplace):
    """Last layer, Kronecker: ``B = sum_n Lambda_n`` ``[C, C]``, ``A = (1/N) sum_n phi_n
    phi_n^T`` for the weight, the exact ``B`` for the bias (as :mod:`fromp.curvature.kron`)."""

    _key = ("last_layer", "kron")
    structure = "kron"

    def _curvature(self, batches):
        a, b, n = 0.0, 0.0, 0
        for f, phi in self._feature_batches(batches):
            a = a + phi.T @ phi
            b = b + self._lambda(f).sum(0)
            n += len(phi)
        return KronCurvature([KronBlock(a / n, b, b.clone() if self._bias else None)],
                             [self.parameter_names], n)  # fmt: skip

    def _mean_and_variance(self, x):
        f, phi = self._phi(x)
        eig, deltas, factor = self._eig, self._deltas(self._delta), self._factor()
        pa = phi @ eig.qa[0]  # [N, D]
        w = (pa**2) @ eig.weight_eigs(0, factor, deltas[0]).reciprocal().T  # [N, C(eig)]
        var = torch.einsum("ci,ni,di->ncd", eig.qb[0], w, eig.qb[0])
        if self._bias:
            inv = eig.bias_eigs(0, factor, deltas[1]).reciprocal()
            var = var + (eig.qbb[0] * inv) @ eig.qbb[0].T
        return f, var

    def _kernel(self, x1, x2):
        _, p1 = self._phi(x1)
        p2 = p1 if x2 is x1 else self._phi(x2)[1]
        eig, deltas, factor = self._eig, self._deltas(self._delta), self._factor()
        a1, a2 = p1 @ eig.qa[0], p2 @ eig.qa[0]
        w = eig.weight_eigs(0, factor, deltas[0]).reciprocal()  # [C, D]
        k = torch.einsum("nj,ij,mj,ci,di->ncmd", a1, w, a2, eig.qb[0], eig.qb[0])
        if self._bias:
            inv = eig.bias_eigs(0, factor, deltas[1]).reciprocal()
            kb = (eig.qbb[0] * inv) @ eig.qbb[0].T
            k = k + kb.reshape(1, *kb.shape[:1], 1, kb.shape[1]).expand_as(k)
        return k
