r"""Subnetwork Laplace (laplace-torch's ``subset_of_weights="subnetwork"``) and the score
rules that pick a subnetwork.

The subnetwork is ``S`` entries of the flat parameter vector ``w = parameters_to_vector(
model.parameters())`` ``[P]``, given as ``subnetwork_indices`` ``[S]`` (in the order the
user gives them; the posterior's rows and columns follow that order). The other ``P - S``
weights stay at the MAP ``w*``, and the posterior over ``theta = w[S]`` is

    ``q(theta) = N(w*[S], (G_SS / (s^2 T) + D)^{-1})``,
    ``G_SS = sum_n J_{n,S}^T Lambda_n J_{n,S}``  ``[S, S]``,

with ``J_{n,S} = d f(x_n) / d w[S]`` ``[C, S]``: the columns ``S`` of the network's
Jacobian. ``G_SS`` is never cut from a ``[P, P]`` GGN; ``J_{n,S}`` is computed either

* ``method="reverse"``: per-example Jacobians (``vmap(jacrev)``, chunks of examples) with
  respect to the parameter tensors that hold subnetwork entries only, then column-selected:
  ``chunk * C * P_touched`` numbers at a time (``P_touched`` the size of those tensors;
  ``chunk`` is ``chunk_size``, or as many examples as fit ``memory_budget``, at most 256);
* ``method="forward"``: one forward-mode pass (``jvp``) per subnetwork entry, vectorised over
  chunks of entries, over a whole batch: no Jacobian row of any parameter tensor is formed,
  ``S / chunk`` passes over the data (cheaper than ``"reverse"`` when ``S <= C``);
* ``method="capture"``: layer capture (:mod:`fromp.curvature.capture`): one batched
  backward pass per output over a chunk of examples gives every captured layer's output
  gradients ``g``; each layer's per-example gradients follow from its input ``a`` and ``g``
  (:func:`~fromp.curvature.layer_rules.per_example_layer_grads`), one layer at a time, and
  the subnetwork's entries are read from them. Parameters of layers without a capture rule
  go through ``"reverse"``'s per-example Jacobians. ``C`` batched backward passes per chunk
  instead of ``C`` per example: on ResNet-18, where ``"reverse"`` fits 3 examples in a
  4 GiB budget, the difference between seconds and minutes.

``method="auto"`` picks ``"forward"`` when ``S <= C`` (the number of outputs), else
``"capture"``. ``hessian_structure="full"`` keeps ``G_SS`` ``[S, S]``, ``"diag"`` its
diagonal; the posterior maths is that of :class:`~fromp.laplace.structures.FullLaplace` /
:class:`~fromp.laplace.structures.DiagLaplace` on ``S`` parameters.

Prior precision ``delta``: a scalar, one per parameter tensor holding subnetwork entries
(``"layerwise"``, in the model's order) or one per subnetwork entry ``[S]``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev, jvp, vmap
from torch.nn.utils import parameters_to_vector

from fromp.curvature.capture import (
    CapturePlan,
    capture_calls,
    fallback_jacobian,
)
from fromp.curvature.jacobian import over_examples
from fromp.curvature.layer_rules import per_example_entries
from fromp.laplace.base import ParametricLaplace
from fromp.laplace.structures import DiagLaplace, FullLaplace, _DiagMaths, _FullMaths
from fromp.laplace.subnet_masks import (
    LargestMagnitudeSubnetMask,
    LargestVarianceDiagLaplaceSubnetMask,
)
from fromp.likelihood import Likelihood

__all__ = [
    "DiagSubnetLaplace",
    "FullSubnetLaplace",
    "LargestMagnitudeSubnetMask",
    "LargestVarianceDiagLaplaceSubnetMask",
    "SubnetLaplace",
    "check_subnetwork_indices",
]


def check_subnetwork_indices(indices: Any, n_params: int) -> Tensor:
    """``indices`` as given when they are a valid subnetwork of a model with ``n_params``
    parameters: a non-empty 1-D ``torch.long`` tensor of distinct entries in ``[0,
    n_params)``. Raises ``TypeError`` (not a tensor, not ``torch.long``) or ``ValueError``
    naming ``subnetwork_indices``."""
    if indices is None:
        raise ValueError(
            "subset_of_weights='subnetwork' needs subnetwork_indices: a 1-D torch.long tensor "
            "of indices into parameters_to_vector(model.parameters())"
        )
    if not isinstance(indices, Tensor):
        raise TypeError(
            f"subnetwork_indices must be a 1-D torch.long tensor, got {type(indices).__name__}"
        )
    if indices.dtype != torch.long:
        raise TypeError(f"subnetwork_indices must have dtype torch.long, got {indices.dtype}")
    if indices.ndim != 1 or indices.numel() == 0:
        raise ValueError(
            f"subnetwork_indices must be a non-empty 1-D tensor, got shape {tuple(indices.shape)}"
        )
    lo, hi = int(indices.min()), int(indices.max())
    if lo < 0 or hi >= n_params:
        raise ValueError(
            f"subnetwork_indices must lie in [0, {n_params}) (the model's P={n_params} "
            f"parameters), got entries in [{lo}, {hi}]"
        )
    if len(torch.unique(indices)) != len(indices):
        raise ValueError("subnetwork_indices must not contain duplicate entries")
    return indices


class SubnetLaplace(ParametricLaplace):
    """Laplace over a subnetwork (module docstring); build one with
    ``fromp.Laplace(model, likelihood, subset_of_weights="subnetwork", hessian_structure=
    "full" | "diag", subnetwork_indices=idx)``.

    As in laplace-torch, ``la.mean`` is all the weights ``w*`` ``[P]`` (also
    ``la.full_mean``), ``la.mean_subnet`` is ``w*[S]`` ``[S]``, ``la.n_params`` is ``P`` and
    ``la.n_params_subnet`` is ``S``; ``posterior_precision``, ``posterior_covariance``,
    ``posterior_variance``, ``prior_mean``, ``prior_precision_diag`` and the Jacobians of
    ``la.backend.jacobians`` are over the ``S`` entries; ``sample(n)`` returns full
    parameter vectors ``[n, P]`` (the subnetwork drawn, the rest at ``w*``).
    """

    def __init__(
        self,
        model: nn.Module,
        likelihood: str | Likelihood,
        subnetwork_indices: Tensor | None = None,
        **kwargs: Any,
    ) -> None:
        n_total = sum(p.numel() for p in model.parameters())
        idx = check_subnetwork_indices(subnetwork_indices, n_total)
        if kwargs.get("method", "auto") not in ("auto", "forward", "reverse", "capture"):
            raise ValueError(
                f"method must be 'auto', 'forward', 'reverse' or 'capture' for "
                f"subset_of_weights='subnetwork', got {kwargs['method']!r}"
            )
        self.subnetwork_indices = idx.detach().cpu().clone()
        super().__init__(model, likelihood, **kwargs)

    subset_of_weights = "subnetwork"

    def _subset_named(self) -> list[tuple[str, nn.Parameter]]:
        self._locate()
        return self._named

    # ------------------------------------------------------------------ the subnetwork
    def _locate(self) -> None:
        """Where each subnetwork entry lives: the parameter tensors holding entries
        (``_named``, model order), per tensor the entries' flat offsets inside it and their
        positions in ``theta``, and per entry its tensor's number (``_layer_of``)."""
        named = list(self.model.named_parameters())
        self._all_named = named
        starts = torch.tensor([0] + [p.numel() for _, p in named]).cumsum(0)
        idx = self.subnetwork_indices
        tensor_of = torch.searchsorted(starts[1:], idx, right=True)  # [S]
        self._named, self._where, layer_of = [], [], torch.empty_like(idx)
        for t in torch.unique(tensor_of).tolist():
            pos = (tensor_of == t).nonzero(as_tuple=True)[0]  # positions in theta
            layer_of[pos] = len(self._named)
            self._named.append(named[t])
            self._where.append((named[t][0], idx[pos] - starts[t], pos))
        self._layer_of = layer_of

    def _set_mean(self) -> None:
        self.full_mean = parameters_to_vector(self.model.parameters()).detach().clone()
        idx = self.subnetwork_indices.to(self.full_mean.device)
        self._mu = self.full_mean[idx].clone()
        self.sizes = [len(pos) for _, _, pos in self._where]

    def _subset_size(self) -> int:
        n_total = sum(p.numel() for p in self.model.parameters())
        if n_total != self.full_mean.numel():
            raise ValueError(f"model has P={n_total} parameters, the subnetwork was chosen "
                             f"in a model of {self.full_mean.numel()}")  # fmt: skip
        return self.num_params

    @property
    def n_params_subnet(self) -> int:
        """``S``: laplace-torch's name."""
        return self.num_params

    @property
    def n_params(self) -> int:
        """``P``: all the model's parameters (laplace-torch's)."""
        return self.full_mean.numel()

    @property
    def mean(self) -> Tensor:
        """``w*`` ``[P]``: all weights (laplace-torch's); the subnetwork's ``mean_subnet``."""
        return self.full_mean

    @mean.setter
    def mean(self, value: Tensor) -> None:
        value = value.to(self.full_mean)
        if value.shape != self.full_mean.shape:
            raise ValueError(f"mean must have shape [P]=[{self.n_params}], got "
                             f"{tuple(value.shape)}")  # fmt: skip
        self.full_mean = value.clone()
        self._mu = self.full_mean[self.subnetwork_indices.to(value.device)].clone()

    @property
    def mean_subnet(self) -> Tensor:
        """``w*[S]`` ``[S]`` (laplace-torch's name)."""
        return self._mu

    def assemble_full_samples(self, subnet_samples: Tensor) -> Tensor:
        """Subnetwork draws ``[n, S]`` as full parameter vectors ``[n, P]`` (the other
        weights at ``w*``)."""
        full = self.full_mean.repeat(len(subnet_samples), 1)
        full[:, self.subnetwork_indices.to(full.device)] = subnet_samples.to(full)
        return full

    def _subset_value(self, value: Tensor) -> Tensor:
        """A full vector ``[..., P]`` reduced to the subnetwork's ``[..., S]``."""
        if value.shape[-1] == self.n_params and self.n_params != self.num_params:
            return value[..., self.subnetwork_indices.to(value.device)]
        return value

    def _jacobian_columns(self) -> Tensor:
        """The subnetwork entries among the touched tensors' concatenated entries."""
        offsets = torch.tensor([0, *self.sizes_touched]).cumsum(0)
        cols = torch.empty(self.num_params, dtype=torch.long)
        for t, (_, local, pos) in enumerate(self._where):
            cols[pos] = offsets[t] + local
        return cols

    @property
    def sizes_touched(self) -> list[int]:
        return [p.numel() for _, p in self._named]

    def _delta_vector(self, d: Tensor) -> Tensor:
        if d.ndim == 0:
            return d.expand(self.num_params)
        if len(d) == self.num_params:
            return d
        return d[self._layer_of.to(d.device)]  # one per parameter tensor holding entries

    # ------------------------------------------------------------------ Jacobian columns
    def _jacobian(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(f(x) [N, C], J_S(x) [N, C, S])``: the subnetwork's Jacobian columns, in the
        order of ``subnetwork_indices`` (module docstring for the two methods)."""
        model = self.model
        buffers = dict(model.named_buffers())
        fixed = {n: p.detach() for n, p in self._all_named}
        touched = {n: p.detach() for n, p in self._named}
        with torch.no_grad():
            f = model(x)
        n_out = f.shape[1]
        method = self.method
        if method == "auto":
            method = "forward" if self.num_params <= n_out else "capture"
        out = f.new_zeros(len(x), n_out, self.num_params)
        if method == "capture":
            self._capture_columns(x, out)
            return f, out
        if method == "reverse":

            def one(params: dict[str, Tensor], xi: Tensor) -> Tensor:
                return functional_call(model, ({**fixed, **params}, buffers), (xi[None],))[0]

            jac_fn = over_examples(jacrev(one), (None, 0))
            p_touched = sum(p.numel() for p in touched.values())
            per_example = 3 * n_out * p_touched * f.element_size()  # rows and their grads
            step = self.chunk_size or max(1, min(256, self._budget() // per_example))
            for s in range(0, len(x), step):
                jac = jac_fn(touched, x[s : s + step])
                for name, local, pos in self._where:
                    j = jac[name].reshape(*jac[name].shape[:2], -1)  # [n, C, numel]
                    out[s : s + step, :, pos.to(x.device)] = j[..., local.to(x.device)]
            return f, out

        def batch(params: dict[str, Tensor]) -> Tensor:
            return functional_call(model, ({**fixed, **params}, buffers), (x,))

        def column(tangent: dict[str, Tensor]) -> Tensor:
            return jvp(batch, (touched,), (tangent,))[1]

        step = self.chunk_size or 16
        for s in range(0, self.num_params, step):
            cols = torch.arange(s, min(s + step, self.num_params))
            tangents = {}
            for name, local, pos in self._where:
                p = touched[name]
                t = torch.zeros(len(cols), p.numel(), dtype=p.dtype, device=p.device)
                hit = (pos[:, None] == cols[None, :]).nonzero()  # [(entry, column)]
                t[hit[:, 1], local[hit[:, 0]]] = 1.0
                tangents[name] = t.reshape(len(cols), *p.shape)
            out[..., s : s + len(cols)] = vmap(column)(tangents).permute(1, 2, 0)
        return f, out

    def _capture_plan(self, x: Tensor) -> CapturePlan:
        """The capture plan of the model for inputs shaped like ``x`` (its probe forward
        and self-check run once, not once per batch), rebuilt when the trainable
        parameters or the input shape change."""
        key = (tuple(id(p) for p in self.model.parameters()), tuple(x.shape[1:]), x.dtype)
        cached = getattr(self, "_plan_cache", None)
        if cached is None or cached[0] != key:
            cached = (key, CapturePlan.build(self.model, x[: min(len(x), 4)], n_columns=1))
            self._plan_cache = cached
        return cached[1]

    def _capture_columns(self, x: Tensor, out: Tensor) -> None:
        """Fill ``out`` ``[N, C, S]`` with the subnetwork's Jacobian columns by layer capture
        (module docstring): per chunk one forward with the layers holding subnetwork entries
        recorded, then per output ``c`` one backward of ``sum_n f_c(x_n)``; the entries of
        parameters no capture rule covers come from per-example Jacobians of those alone."""
        model, n_out = self.model, out.shape[1]
        where = {name: (local.to(x.device), pos.to(x.device)) for name, local, pos in self._where}
        plan = self._capture_plan(x)
        layers = [m for m in plan.captured if any(
            plan.param_of.get((id(m), pn)) in where for pn, _ in m.named_parameters(recurse=False)
        )]  # fmt: skip
        fallback = [n for n in plan.fallback if n in where]
        per_example = plan.bytes_per_example
        if fallback:
            p_fb = sum(p.numel() for n, p in self._named if n in fallback)
            per_example += 3 * n_out * p_fb * x.element_size()
        step = self.chunk_size or max(1, min(256, self._budget() // max(1, per_example)))
        for s in range(0, len(x), step):
            xc = x[s : s + step]
            if layers:
                with torch.enable_grad(), capture_calls(layers) as calls:
                    fc = model(xc)
                zs = [c.z for c in calls]
                for c in range(n_out):
                    gs = torch.autograd.grad(
                        fc[:, c].sum(), zs, retain_graph=c < n_out - 1, allow_unused=True
                    )
                    for call, g in zip(calls, gs):
                        if g is None:  # no path to this output: its entries stay 0
                            continue
                        for attr, _ in call.module.named_parameters(recurse=False):
                            name = plan.param_of.get((id(call.module), attr))
                            if name in where:
                                local, pos = where[name]
                                out[s : s + step, c, pos] = per_example_entries(
                                    call.module, call.a, g, attr, local
                                )
                del calls, zs, fc
            if fallback:
                jac = fallback_jacobian(model, fallback, xc)  # [B, C, P_fb]
                start, sizes = 0, {n: p.numel() for n, p in self._named}
                for name in fallback:
                    size = sizes[name]
                    local, pos = where[name]
                    out[s : s + step, :, pos] = jac[..., start : start + size][..., local]
                    start += size

    def _sqrt_ggn_rows(self, batches: list[tuple[Tensor, Tensor | None]]):
        for x, _ in batches:
            f, jac = self._jacobian(x)
            yield torch.einsum("nck,ncs->nks", self._lik.sqrt_hessian(f), jac).flatten(0, 1)

    # ------------------------------------------------------------------ samples, predictive
    def sample(self, n_samples: int = 100, generator: torch.Generator | None = None) -> Tensor:
        """``[n_samples, P]`` full parameter vectors: ``w[S] ~ q``, the rest ``w*``."""
        return self.assemble_full_samples(super().sample(n_samples, generator))

    def _nn_samples(self, x, n_samples, generator, **model_kwargs):
        outs = []
        with torch.set_grad_enabled(self.enable_backprop and torch.is_grad_enabled()):
            for w in self.sample(n_samples, generator):
                params, k = {}, 0
                for name, p in self._all_named:
                    params[name] = w[k : k + p.numel()].view_as(p).to(p.dtype)
                    k += p.numel()
                outs.append(functional_call(self.model, params, (x,), model_kwargs))
        return torch.stack(outs)

    def _cov_times(self, jac: Tensor) -> Tensor:
        """``Sigma J^T`` as ``[S, N C]`` for ``J`` ``[N, C, S]``."""
        raise NotImplementedError

    def _mean_and_variance(self, x: Tensor) -> tuple[Tensor, Tensor]:
        f, jac = self._jacobian(x)
        sj = self._cov_times(jac).reshape(self.num_params, *jac.shape[:2])  # [S, N, C]
        return f, torch.einsum("ncs,snd->ncd", jac, sj)

    def _kernel(self, x1: Tensor, x2: Tensor) -> Tensor:
        _, j1 = self._jacobian(x1)
        j2 = j1 if x2 is x1 else self._jacobian(x2)[1]
        sj = self._cov_times(j2).reshape(self.num_params, *j2.shape[:2])
        return torch.einsum("ncs,smd->ncmd", j1, sj)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "subnetwork_indices": self.subnetwork_indices}

    def _weights_now(self) -> Tensor:
        """The subnetwork's current weights ``[S]`` (the model's at ``subnetwork_indices``)."""
        full = parameters_to_vector([p.detach() for p in self.model.parameters()])
        return full[self.subnetwork_indices.to(full.device)]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        idx = state.get("subnetwork_indices")
        if idx is None or not torch.equal(idx.cpu(), self.subnetwork_indices):
            raise ValueError("state has other subnetwork_indices than this Laplace")
        super().load_state_dict(state)
        self.full_mean = self.full_mean.to(self._mu).clone()
        self.full_mean[self.subnetwork_indices.to(self._mu.device)] = self._mu


class FullSubnetLaplace(_FullMaths, SubnetLaplace):
    """Subnetwork, ``hessian_structure="full"``: ``G_SS`` ``[S, S]``."""

    _key = ("subnetwork", "full")
    structure = "full"

    def _curvature(self, batches):
        g = 0.0
        for rows in self._sqrt_ggn_rows(batches):
            g = g + rows.T @ rows
        return 0.5 * (g + g.T)

    posterior = FullLaplace.posterior

    def _cov_times(self, jac):
        return self._covariance() @ jac.flatten(0, 1).T


class DiagSubnetLaplace(_DiagMaths, SubnetLaplace):
    """Subnetwork, ``hessian_structure="diag"``: ``diag(G_SS)`` ``[S]``."""

    _key = ("subnetwork", "diag")
    structure = "diag"

    def _curvature(self, batches):
        h = 0.0
        for rows in self._sqrt_ggn_rows(batches):
            h = h + (rows**2).sum(0)
        return h

    posterior = DiagLaplace.posterior

    def _cov_times(self, jac):
        return self.posterior_variance[:, None] * jac.flatten(0, 1).T
