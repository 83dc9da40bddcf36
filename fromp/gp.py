"""DNN2GP: the Gaussian process of a linearised network under a Gaussian weight posterior.

Linearising the network at the posterior mean ``m``, ``f_w(x) ~= f_m(x) + J(x) (w - m)``,
and taking ``w ~ q = N(m, Sigma)`` (a Laplace or VOGN posterior) gives the GP

    ``f(x) ~ GP( f_m(x),  k(x, x') = J(x) Sigma J(x')^T )``,   ``k(x, x') [C, C]``

(Khan et al., 2019, "Approximate inference turns deep networks into Gaussian processes";
the kernel FROMP regularises with). :class:`GP` evaluates its mean, kernel blocks and
marginal (co)variances without ever forming ``Sigma`` densely for a diagonal posterior: with
``A(x) = J(x) Sigma^{1/2}`` (the posterior's :meth:`~fromp.posterior.GaussianPosterior.whiten`:
``J * std`` for :class:`~fromp.posterior.DiagonalGaussian`, ``J L^{-T}`` for a
:class:`~fromp.posterior.FullGaussian` with precision ``L L^T``)
``k(x, x') = A(x) A(x')^T``, and ``A`` is computed in chunks of examples.

The Laplace evidence lives beside the Laplace code (:mod:`fromp.laplace`);
:func:`log_marginal_likelihood` and :func:`optimize_prior_precision` are re-exported here for
existing callers.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vmap

from fromp._checks import check_batch
from fromp.capture import (
    DEFAULT_MEMORY_BUDGET,
    LayerCall,
    _conv_geometry,
    _norm_per_example,
    capture_calls,
    supported_layer,
)
from fromp.jacobian import _flatten_leading, _single_output_fn, num_params, unflatten
from fromp.laplace import (
    log_marginal_likelihood,
    optimize_prior_precision,
    require_eval,
)
from fromp.likelihood import (
    BernoulliLikelihood,
    CategoricalLikelihood,
    GaussianLikelihood,
    Likelihood,
    get_likelihood,
)
from fromp.posterior import DiagonalGaussian, GaussianPosterior

__all__ = [
    "GP",
    "dnn2gp",
    "log_marginal_likelihood",
    "optimize_prior_precision",
]

Posterior = GaussianPosterior

_PROBIT_SCALE = math.pi / 8


def _check_chunk(chunk_size: int) -> int:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    return chunk_size


class GP:
    """The DNN2GP Gaussian process of ``model`` linearised at ``posterior.mean``.

    Args:
        model: ``[N, ...] -> [N, C]`` (for a multi-head model,
            :func:`fromp.models.with_task` ``(net, t)``); batch norm / dropout must be in eval
            mode. Its own weights are not used: everything is evaluated at
            ``posterior.mean`` through :func:`torch.func.functional_call` (buffers such as
            batch-norm statistics are the module's).
        posterior: a :class:`~fromp.posterior.GaussianPosterior` over the ``P`` trainable
            parameters: :class:`~fromp.posterior.DiagonalGaussian`
            (``Sigma = diag(1/precision)``) or :class:`~fromp.posterior.FullGaussian`.
        likelihood: a :class:`~fromp.likelihood.Likelihood` or its name (for
            :meth:`predictive`).
        chunk_size: examples per Jacobian chunk (default for every method); None derives it
            from ``memory_budget``: ``min(64, budget / (3 C P * bytes))`` examples, so that a
            chunk's whitened Jacobians ``[chunk, C, P]`` and their temporaries fit (one
            example of ResNet-18 with ``C = 10`` is 0.45 GB in float32).
        memory_budget: bytes (default 2 GiB) for the default chunk size.
    """

    def __init__(
        self,
        model: nn.Module,
        posterior: GaussianPosterior,
        likelihood: str | Likelihood,
        *,
        chunk_size: int | None = None,
        memory_budget: int = DEFAULT_MEMORY_BUDGET,
    ) -> None:
        if not isinstance(posterior, GaussianPosterior):
            raise ValueError(
                "posterior must be a GaussianPosterior (DiagonalGaussian or FullGaussian), got "
                f"{type(posterior).__name__}"
            )
        require_eval(model)
        p_total = num_params(model)
        if posterior.num_params != p_total:
            raise ValueError(
                f"posterior has {posterior.num_params} parameters, model has P={p_total}"
            )
        self.model = model
        self.posterior = posterior
        self.likelihood = get_likelihood(likelihood)
        if chunk_size is not None:
            _check_chunk(chunk_size)
        if (
            isinstance(memory_budget, bool)
            or not isinstance(memory_budget, int)
            or (memory_budget < 1)
        ):
            raise ValueError(f"memory_budget must be a positive int (bytes), got {memory_budget!r}")
        self._chunk_size, self.memory_budget = chunk_size, memory_budget
        ref = next(p for p in model.parameters() if p.requires_grad)
        self._dtype, self._device = ref.dtype, ref.device
        self._params = unflatten(model, posterior.mean.detach().to(ref))
        self._buffers = dict(model.named_buffers())
        self._jac = vmap(jacrev(_single_output_fn(model)), in_dims=(None, 0))
        self._structured: _CaptureStructure | bool | None = None
        self._structured_reason = ""
        self._q = posterior.detach()

    @property
    def chunk_size(self) -> int:
        """Examples per Jacobian chunk (given, or derived from ``memory_budget``)."""
        if self._chunk_size is None:
            ref = next(p for p in self.model.parameters() if p.requires_grad)
            c = getattr(self, "_n_out", None) or 10
            per_example = 3 * c * self.num_params * ref.element_size()
            return max(1, min(64, self.memory_budget // per_example))
        return self._chunk_size

    @chunk_size.setter
    def chunk_size(self, value: int | None) -> None:
        self._chunk_size = None if value is None else _check_chunk(value)

    def _step(self, chunk_size: int | None, x: Tensor) -> int:
        if chunk_size is not None:
            return _check_chunk(chunk_size)
        if self._chunk_size is None and getattr(self, "_n_out", None) is None and len(x):
            self.mean(x[:1])  # the output width C sets the derived chunk size
        return self.chunk_size

    @property
    def num_params(self) -> int:
        """``P``, the number of parameters of the network and its posterior."""
        return self.posterior.num_params

    def _prep(self, x: Tensor, name: str = "x") -> Tensor:
        check_batch(x, name)
        x = x.to(self._device)
        return x.to(self._dtype) if x.is_floating_point() else x

    def mean(self, x: Tensor) -> Tensor:
        """``f(x)`` at the posterior mean, ``[N, C]``."""
        x = self._prep(x)
        with torch.no_grad():
            out = functional_call(self.model, (self._params, self._buffers), (x,))
        if out.ndim != 2:
            raise ValueError(f"model output must have shape [N, C], got {tuple(out.shape)}")
        self._n_out = out.shape[1]
        return out

    def jacobians(self, x: Tensor, *, chunk_size: int | None = None) -> Tensor:
        """``J(x) [N, C, P]`` at the posterior mean (dense: ``N * C * P`` numbers)."""
        x = self._prep(x)
        step = self._step(chunk_size, x)
        return torch.cat([self._jac_rows(x, slice(s, s + step)) for s in range(0, len(x), step)])

    def _jac_rows(self, x: Tensor, rows: slice) -> Tensor:
        return _flatten_leading(self._jac(self._params, x[rows]), 2).detach()

    def _whitened(self, x: Tensor, rows: slice) -> Tensor:
        """``A(x[rows]) = J Sigma^{1/2}`` ``[n, C, P]``."""
        return self._q.whiten(self._jac_rows(x, rows))

    def _chunks(self, n: int, step: int) -> list[slice]:
        return [slice(s, min(s + step, n)) for s in range(0, n, step)]

    def kernel(
        self,
        x1: Tensor,
        x2: Tensor | None = None,
        *,
        diagonal_outputs: bool = False,
        chunk_size: int | None = None,
        max_cache_bytes: int = 1 << 30,
        method: str = "auto",
    ) -> Tensor:
        """The kernel ``k(x1, x2) = J(x1) Sigma J(x2)^T``.

        Args:
            x1: ``[N1, ...]``.
            x2: ``[N2, ...]``; None for ``x2 = x1`` (only the upper block triangle is
                computed, the result is exactly symmetric).
            diagonal_outputs: return only the per-output blocks ``K_c = J_c Sigma J_c^T``
                (output ``c`` against output ``c``), as FROMP uses per class.
            chunk_size: examples per Jacobian chunk (default ``self.chunk_size``).
            max_cache_bytes: per-chunk features of ``x2`` (whitened Jacobians ``A(x2)``) of up
                to this many bytes are kept for reuse; beyond it chunks are recomputed for
                every ``x1`` chunk.
            method: ``"jacobian"``: per-example Jacobians of all parameters, whitened, and
                their products. ``"structured"`` (diagonal posteriors only): for every
                ``nn.Linear`` layer ``z = W a + b`` the Jacobian of output ``c`` is
                ``g_c a^T`` with ``g_c = df_c/dz``, so its kernel term is
                ``sum_i g_ci(x) g_di(x') [sum_j s_ij a_j(x) a_j(x') + s_i^b]`` with ``s`` the
                posterior variances: per-example ``g`` (one batched backward per output) and
                ``a`` replace the per-example Jacobian of the layer, saving a factor ``C``
                (``C^2`` for the full kernel) of the products; other parameters (convolutions,
                normalisation) use the ``"jacobian"`` way. ``"auto"``: structured when the
                posterior is diagonal, the model has such layers, each called once per forward
                on ``[N, in]`` inputs, and a one-example check against ``"jacobian"`` agrees;
                else ``"jacobian"``.

        Returns:
            ``[N1, C, N2, C]`` (entry ``[n, c, m, d] = k(x1_n, x2_m)_{cd}``), or ``[C, N1, N2]``
            with ``diagonal_outputs=True``.

        Memory: the output plus two chunks' features plus the cache; ``Sigma`` and the full
        ``J`` are never formed. ``"jacobian"``: features ``chunk_size * C * P`` numbers, cost
        ``N1 * N2 * C^2 * P`` multiply-adds (``N1 * N2 * C * P`` with ``diagonal_outputs``),
        halved when ``x2`` is None. ``"structured"``: a Linear layer's features are
        ``chunk_size * (in + C * out)`` numbers and its cost ``N1 * N2 * (in * out + C^2 * out)``
        (``C * out`` with ``diagonal_outputs``). ``O(N1 + N2)`` feature evaluations when the
        cache holds those of ``x2``.
        """
        x1 = self._prep(x1, "x1")
        step = self._step(chunk_size, x1)
        sym = x2 is None
        x2 = x1 if sym else self._prep(x2, "x2")
        if not sym and x1.shape[1:] != x2.shape[1:]:
            raise ValueError(
                f"x1 and x2 must have the same per-example shape, got {tuple(x1.shape[1:])} and "
                f"{tuple(x2.shape[1:])}"
            )
        if method not in ("auto", "jacobian", "structured"):
            raise ValueError(f"method must be 'auto', 'jacobian' or 'structured', got {method!r}")
        n1, n2 = len(x1), len(x2)
        c = self.mean(x1[:1]).shape[1]
        if method == "jacobian":
            feats, block_fn = self._whitened, self._jacobian_block
        else:
            structure = self._structure(x1[:1], required=method == "structured")
            if structure is None:
                feats, block_fn = self._whitened, self._jacobian_block
            else:
                feats, block_fn = structure.features, structure.block
        opts = {"dtype": self._dtype, "device": self._device}
        out = torch.empty((c, n1, n2) if diagonal_outputs else (n1, c, n2, c), **opts)
        rows2 = self._chunks(n2, step)
        cache: dict[int, Any] = {}
        used = 0

        def get2(j: int) -> Any:
            nonlocal used
            if j in cache:
                return cache[j]
            f = feats(x2, rows2[j])
            size = _nbytes(f)
            if used + size <= max_cache_bytes:
                cache[j], used = f, used + size
            return f

        for i, r1 in enumerate(self._chunks(n1, step)):
            f1 = get2(i) if sym else feats(x1, r1)
            for j in range(i if sym else 0, len(rows2)):
                r2 = rows2[j]
                f2 = f1 if (sym and j == i) else get2(j)
                block = block_fn(f1, f2, diagonal_outputs)
                if diagonal_outputs:  # C, n, m
                    if sym and j == i:  # BLAS rounding: make diagonal blocks exactly symmetric
                        block = 0.5 * (block + block.transpose(1, 2))
                    out[:, r1, r2] = block
                    if sym and j != i:
                        out[:, r2, r1] = block.transpose(1, 2)
                else:  # n, C, m, C
                    if sym and j == i:
                        block = 0.5 * (block + block.permute(2, 3, 0, 1))
                    out[r1, :, r2, :] = block
                    if sym and j != i:
                        out[r2, :, r1, :] = block.permute(2, 3, 0, 1)
        return out

    @staticmethod
    def _jacobian_block(a1: Tensor, a2: Tensor, diagonal_outputs: bool) -> Tensor:
        """``A1 A2^T`` for whitened Jacobians ``[n, C, P]``, ``[m, C, P]``: ``[C, n, m]``
        (per-output blocks) or ``[n, C, m, C]``."""
        if diagonal_outputs:
            return torch.bmm(a1.transpose(0, 1), a2.permute(1, 2, 0))
        n, c, p = a1.shape
        return (a1.reshape(-1, p) @ a2.reshape(-1, p).T).view(n, c, a2.shape[0], c)

    def _structure(self, x0: Tensor, required: bool) -> _CaptureStructure | None:
        """The structured kernel evaluator, or None (``required=False``) when it does not
        apply; checked on one example against the Jacobian way."""
        if not isinstance(self.posterior, DiagonalGaussian):
            if required:
                raise ValueError("method='structured' needs a DiagonalGaussian posterior")
            return None
        if self._structured is None:
            try:
                st = _CaptureStructure(self)
                f0 = st.features(x0, slice(0, 1))
                a0 = self._whitened(x0, slice(0, 1))
                ref = self._jacobian_block(a0, a0, False)
                got = st.block(f0, f0, False)
                tol = 1e-4 if self._dtype == torch.float32 else 1e-9
                if not torch.allclose(got, ref, rtol=tol, atol=tol * float(ref.abs().max())):
                    raise _NotStructured("one-example check against the Jacobian way failed")
                self._structured = st
            except _NotStructured as err:
                self._structured = False
                self._structured_reason = str(err)
        if self._structured is False:
            if required:
                raise ValueError(f"method='structured' does not apply: {self._structured_reason}")
            return None
        return self._structured

    def variance(self, x: Tensor, *, chunk_size: int | None = None, method: str = "auto") -> Tensor:
        """Marginal covariance of ``f(x_n)``: ``J(x_n) Sigma J(x_n)^T`` ``[N, C, C]``,
        computed per chunk of examples (never ``N x N``). ``method`` as :meth:`kernel`: the
        structured way evaluates the chunk's ``[n, C, n, C]`` block and keeps its diagonal
        (no ``[n, C, P]`` Jacobians)."""
        if method not in ("auto", "jacobian", "structured"):
            raise ValueError(f"method must be 'auto', 'jacobian' or 'structured', got {method!r}")
        x = self._prep(x)
        step = self._step(chunk_size, x)
        structure = None
        if method != "jacobian":
            structure = self._structure(x[:1], required=method == "structured")
        outs = []
        for rows in self._chunks(len(x), step):
            if structure is None:
                a = self._whitened(x, rows)
                v = torch.bmm(a, a.transpose(1, 2))
            else:
                f = structure.features(x, rows)
                blk = structure.block(f, f, False)  # n, C, n, C
                idx = torch.arange(blk.shape[0], device=blk.device)
                v = blk[idx, :, idx, :]
            outs.append(0.5 * (v + v.transpose(1, 2)))
        return torch.cat(outs)

    def predictive(
        self,
        x: Tensor,
        method: str = "probit",
        n_samples: int = 100,
        *,
        generator: torch.Generator | None = None,
        chunk_size: int | None = None,
        return_variance: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """The predictive distribution of ``y`` at ``x`` under the GP.

        Classification (categorical / Bernoulli), returns probabilities ``[N, C]``, or
        ``(probabilities [N, C], var f [N, C, C])`` with ``return_variance=True`` (the
        marginal covariance of the latent ``f(x)``, :meth:`variance`):

        * ``"probit"``: per-output probit approximation, ``softmax(m_c / sqrt(1 + pi/8
          v_cc))`` (``sigmoid`` for Bernoulli), ``m = mean(x)``, ``v = variance(x)``;
        * ``"mc"``: ``E[softmax(f)]`` with ``n_samples`` draws ``f ~ N(m, v)`` (full
          ``C x C`` marginal covariance);
        * ``"linear"``: the linearised network at the posterior mean, ``softmax(m)``
          (variance ignored).

        Gaussian likelihood: ``(m [N, C], v + sigma^2 I [N, C, C])``, exact for every method.
        """
        if method not in ("probit", "mc", "linear"):
            raise ValueError(f"method must be 'probit', 'mc' or 'linear', got {method!r}")
        if method == "mc" and (not isinstance(n_samples, int) or n_samples < 1):
            raise ValueError(f"n_samples must be a positive int, got {n_samples!r}")
        lik = self.likelihood
        m = self.mean(x)
        if isinstance(lik, GaussianLikelihood):
            v = self.variance(x, chunk_size=chunk_size)
            eye = torch.eye(m.shape[1], dtype=m.dtype, device=m.device)
            return m, v + lik.sigma**2 * eye
        if not isinstance(lik, CategoricalLikelihood | BernoulliLikelihood):
            raise ValueError(f"predictive does not support likelihood {lik!r}")
        need_v = return_variance or method != "linear"
        v = self.variance(x, chunk_size=chunk_size) if need_v else None
        if method == "linear":
            probs = lik.inverse_link(m)
        elif method == "probit":
            kappa = torch.rsqrt(1 + _PROBIT_SCALE * torch.diagonal(v, dim1=-2, dim2=-1))
            probs = lik.inverse_link(m * kappa)
        else:
            evals, evecs = torch.linalg.eigh(v)
            root = evecs * evals.clamp_min(0).sqrt().unsqueeze(-2)  # N, C, C: v = root root^T
            eps = torch.randn(
                (n_samples, *m.shape), generator=generator, dtype=m.dtype, device=m.device
            )
            f = m + torch.einsum("ncd,snd->snc", root, eps)
            probs = lik.inverse_link(f.reshape(-1, m.shape[1])).reshape(f.shape).mean(0)
        return (probs, v) if return_variance else probs


class _NotStructured(Exception):
    """The model does not have the layer structure the structured kernel needs."""


def _nbytes(obj: Any) -> int:
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict | tuple | list):
        items = obj.values() if isinstance(obj, dict) else obj
        return sum(_nbytes(o) for o in items)
    return 0


class _CaptureStructure:
    """Kernel blocks ``J(x) Sigma J(x')^T`` (diagonal ``Sigma``) from the layer structure of
    the Jacobian, after Novak et al. (2022), "Fast finite width neural tangent kernel": for a
    layer captured by :mod:`fromp.capture` with input ``a`` and output gradients
    ``g_c = df_c / dz`` (one forward pass and ``C`` backward passes per chunk),

    * *outer* layers (``Linear`` on ``[N, in]`` inputs, convolutions with one output position,
      ``u = unfold(a)``): ``J_c = g_c u^T``, so their kernel term is
      ``sum_o g_co(x) g_do(x') [sum_j s_oj u_j(x) u_j(x') + s^b_o]``: one ``[n m, J] @ [J, O]``
      product per block, independent of ``C``;
    * *dense* layers (convolutions with ``L > 1`` output positions, norm layers, sequence
      ``Linear``): the layer's per-example Jacobians ``[n, C, P_layer]`` formed per block from
      the stored ``(u, g)`` by one batched GEMM (``[C O, L] @ [L, J]`` per example), whitened,
      and multiplied as in the Jacobian way;
    * parameters of other layers: per-example Jacobians (``vmap(jacrev)``) of those alone.

    Features per example are ``O(C * activations)`` numbers instead of ``C * P``."""

    def __init__(self, gp: GP) -> None:
        self.gp = gp
        model = gp.model
        var = unflatten(model, gp.posterior.variance.detach().to(gp._dtype))
        owners: dict[int, int] = {}
        for mod in model.modules():
            for prm in mod._parameters.values():
                if prm is not None:
                    owners[id(prm)] = owners.get(id(prm), 0) + 1
        names = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
        self.layers: dict[str, nn.Module] = {}
        self.var: dict[str, dict[str, Tensor]] = {}
        captured: set[str] = set()
        for mname, mod in model.named_modules():
            own = {pn: p for pn, p in mod._parameters.items() if p is not None and p.requires_grad}
            if not own or not supported_layer(mod) or any(owners[id(p)] != 1 for p in own.values()):
                continue
            self.layers[mname] = mod
            self.var[mname] = {pn: var[names[id(p)]] for pn, p in own.items()}
            captured.update(names[id(p)] for p in own.values())
        if not self.layers:
            raise _NotStructured("the model has no layer with a capture rule")
        self.other = [n for n in gp._params if n not in captured]
        std = unflatten(model, gp.posterior.std.detach().to(gp._dtype))
        self.other_std = torch.cat([std[n].reshape(-1) for n in self.other]) if self.other else None
        self._name_of = {id(m): k for k, m in self.layers.items()}

    def features(self, x: Tensor, rows: slice) -> tuple[dict[str, tuple], Any]:
        """``({layer: (kind, u or a, g [C, n, ...])}, A_other [n, C, P_other] or None)``."""
        gp = self.gp
        xr = x[rows]
        n = len(xr)
        params = {k: v.detach().requires_grad_(True) for k, v in gp._params.items()}
        with torch.enable_grad(), capture_calls(list(self.layers.values())) as calls:
            out = functional_call(gp.model, (params, gp._buffers), (xr,))
        seen: dict[str, LayerCall] = {}
        for call in calls:
            name = self._name_of[id(call.module)]
            if name in seen:
                raise _NotStructured(f"layer {name!r} is called more than once per forward")
            seen[name] = call
        # layers never called (other task heads) contribute nothing; the one-example check
        # against the Jacobian way catches parameters used outside their layer's forward
        c = out.shape[1]
        basis = torch.eye(c, dtype=gp._dtype, device=gp._device)[:, None, :].expand(c, n, c)
        zs = [call.z for call in seen.values()]
        grads = torch.autograd.grad(
            out, zs, grad_outputs=basis, is_grads_batched=True, allow_unused=True
        )  # each [C, n, ...]
        feats = {}
        for (name, call), g in zip(seen.items(), grads):
            if g is None:  # a layer that does not reach the outputs
                g = torch.zeros(c, *call.z.shape, dtype=gp._dtype, device=gp._device)
            feats[name] = _layer_features(call.module, call.a, g.detach())
        a_other = None
        if self.other:
            other = {k: gp._params[k] for k in self.other}

            def single(p: dict[str, Tensor], xi: Tensor) -> Tensor:
                full = {**gp._params, **p}
                return functional_call(gp.model, (full, gp._buffers), (xi.unsqueeze(0),))[0]

            jac = vmap(jacrev(single), in_dims=(None, 0))(other, xr)
            a_other = _flatten_leading(jac, 2).detach() * self.other_std
        return feats, a_other

    def block(self, f1: tuple, f2: tuple, diagonal_outputs: bool) -> Tensor:
        """Kernel block ``[C, n, m]`` (per-output) or ``[n, C, m, C]``."""
        (lay1, o1), (lay2, o2) = f1, f2
        out = None if o1 is None else GP._jacobian_block(o1, o2, diagonal_outputs)
        for name, ft1 in lay1.items():
            ft2 = lay2.get(name)
            if ft2 is None:
                continue
            m = self.layers[name]
            if ft1[0] == "outer":
                term = _outer_block(ft1, ft2, self.var[name], m, diagonal_outputs)
            else:
                std = {k: v.sqrt() for k, v in self.var[name].items()}
                j1 = _dense_jacobian(m, ft1, std)
                j2 = j1 if ft2 is ft1 else _dense_jacobian(m, ft2, std)
                term = GP._jacobian_block(j1, j2, diagonal_outputs)
            out = term if out is None else out + term
        if out is None:
            raise _NotStructured("no layer contributes")
        return out


def _layer_features(m: nn.Module, a: Tensor, g: Tensor) -> tuple:
    """Compact per-example features of one captured layer call: ``("outer", u [n, G, J],
    g [C, n, O])`` or ``("dense", ...)`` (see :class:`_CaptureStructure`)."""
    c, n = g.shape[:2]
    if isinstance(m, nn.Linear):
        if a.ndim == 2:
            return ("outer", a.unsqueeze(1), g)
        return ("dense", a, g)
    if isinstance(m, nn.Conv1d | nn.Conv2d):
        ap, g2d, geo = _conv_geometry(m, a, g.reshape(c * n, *g.shape[2:]))
        u = F.unfold(ap, geo["kernel"], dilation=geo["dil"], stride=geo["stride"])  # n, J, L
        grp, pos = m.groups, u.shape[-1]
        if pos == 1:
            return ("outer", u.reshape(n, grp, -1), g.reshape(c, n, -1))
        u = u.reshape(n * grp, -1, pos).transpose(1, 2)  # n G, L, J/G
        gg = g2d.reshape(c, n, grp, -1, pos).permute(1, 2, 0, 3, 4).reshape(n * grp, -1, pos)
        return ("conv", u, gg, n, c)
    return ("dense", a, g)


def _outer_block(
    ft1: tuple, ft2: tuple, var: dict[str, Tensor], m: nn.Module, diagonal_outputs: bool
) -> Tensor:
    """``sum_o g1_co g2_do [sum_j s_oj u1_j u2_j + s^b_o]`` for an outer-product layer."""
    _, u1, g1 = ft1
    _, u2, g2 = ft2
    n, grp, jj = u1.shape
    mm = len(u2)
    sw = var["weight"].reshape(grp, -1, jj)  # G, O/G, J/G
    prod = (u1[:, None] * u2[None]).reshape(n * mm, grp, jj)
    t = torch.einsum("xgj,goj->xgo", prod, sw).reshape(n, mm, -1)  # n, m, O
    if "bias" in var:
        t = t + var["bias"]
    if diagonal_outputs:
        return torch.einsum("cni,nmi,cmi->cnm", g1, t, g2)
    return torch.einsum("cni,nmi,dmi->ncmd", g1, t, g2)


def _dense_jacobian(m: nn.Module, ft: tuple, std: dict[str, Tensor]) -> Tensor:
    """Whitened per-example Jacobians ``[n, C, P_layer]`` of one dense layer (parameters in
    ``named_parameters`` order of the layer)."""
    kind = ft[0]
    parts: dict[str, Tensor] = {}
    if kind == "conv":
        _, u, gg, n, c = ft
        grp = m.groups
        jw = torch.bmm(gg, u).view(n, grp, c, -1, u.shape[-1])  # n, G, C, O/G, J/G
        parts["weight"] = jw.permute(0, 2, 1, 3, 4).reshape(n, c, -1)
        if "bias" in std:
            parts["bias"] = gg.view(n, grp, c, -1, gg.shape[-1]).sum(-1).permute(0, 2, 1, 3)
            parts["bias"] = parts["bias"].reshape(n, c, -1)
    else:
        _, a, g = ft
        c, n = g.shape[:2]
        if isinstance(m, nn.Linear):
            a3, g4 = a.reshape(n, -1, a.shape[-1]), g.reshape(c, n, -1, g.shape[-1])
            parts["weight"] = torch.einsum("cnto,nti->ncoi", g4, a3).reshape(n, c, -1)
            if "bias" in std:
                parts["bias"] = g4.sum(2).transpose(0, 1)
        else:
            w_per, b_per = _norm_per_example(m, a, g)  # [C, n, ...]
            if "weight" in std:
                parts["weight"] = w_per.transpose(0, 1).reshape(n, c, -1)
            if "bias" in std:
                parts["bias"] = b_per.transpose(0, 1).reshape(n, c, -1)
    order = [pn for pn, p in m.named_parameters(recurse=False) if pn in std]
    return torch.cat([parts[pn] * std[pn].reshape(-1) for pn in order], dim=-1)


def dnn2gp(
    model: nn.Module,
    posterior: Posterior,
    likelihood: str | Likelihood,
    *,
    chunk_size: int | None = None,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> GP:
    """The DNN2GP :class:`GP` of ``model`` under ``posterior`` (see :class:`GP`)."""
    return GP(model, posterior, likelihood, chunk_size=chunk_size, memory_budget=memory_budget)
