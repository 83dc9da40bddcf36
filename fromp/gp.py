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

The Laplace evidence lives beside the Laplace code (:mod:`fromp.laplace`,
:mod:`fromp.baselaplace`).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vmap

from fromp._checks import check_batch, require_eval
from fromp.capture import (
    DEFAULT_MEMORY_BUDGET,
    LayerCall,
    _conv_geometry,
    _norm_per_example,
    capture_calls,
    supported_layer,
)
from fromp.jacobian import _flatten_leading, _single_output_fn, num_params, unflatten
from fromp.likelihood import (
    BernoulliLikelihood,
    CategoricalLikelihood,
    GaussianLikelihood,
    Likelihood,
    get_likelihood,
    randn_like_on,
)
from fromp.posterior import DiagonalGaussian, GaussianPosterior

__all__ = ["GP", "dnn2gp"]

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
                their products. ``"structured"`` (diagonal posteriors only): the layers of
                :mod:`fromp.capture` (``Linear``, ``Conv1d/2d``, norm layers' affine
                parameters) from their inputs ``a`` and output gradients ``g_c = df_c/dz``
                (one forward and one batched backward of the ``C`` outputs per example
                chunk, see :class:`_CaptureStructure`): a layer whose weight Jacobian is one
                outer product ``g_c u^T`` (``Linear`` on ``[N, in]``, a convolution with one
                output position) contributes
                ``sum_o g_co(x) g_do(x') [sum_j s_oj u_j(x) u_j(x') + s_o^b]`` (``s`` the
                posterior variances), one ``[N1 N2, J] @ [J, O]`` product independent of
                ``C`` (on a CPU taken a few ``x1`` rows at a time, each step keeping only the
                input columns nonzero in its rows and in ``x2``: sparse inputs such as MNIST
                images or ReLU units cost their nonzeros, exactly); a convolution with
                ``L > 1`` output positions forms its whitened Jacobian columns for a block of
                output channels at a time (one batched ``[C o, L] @ [L, J]`` product) and
                adds their Gram product; unfolded input
                columns that are zero for all examples (kernel taps that only see zero
                padding) are dropped, exactly. Parameters of other layers use the
                ``"jacobian"`` way. ``"auto"``: structured when the posterior is diagonal,
                the model has such layers, each called once per forward, and a one-example
                check against ``"jacobian"`` (float64 product) agrees; else ``"jacobian"``.
                Without ``chunk_size`` the structured way's example chunk comes from
                ``memory_budget``: a third of it for a chunk's features (ResNet-18 on
                32x32 inputs: 5.5 MB per example, so 2 GiB gives chunks of up to 131).

        Returns:
            ``[N1, C, N2, C]`` (entry ``[n, c, m, d] = k(x1_n, x2_m)_{cd}``), or ``[C, N1, N2]``
            with ``diagonal_outputs=True``.

        Memory: the output plus two chunks' features plus the cache; ``Sigma`` and the full
        ``J`` are never formed. ``"jacobian"``: features ``chunk_size * C * P`` numbers, cost
        ``N1 * N2 * C^2 * P`` multiply-adds (``N1 * N2 * C * P`` with ``diagonal_outputs``),
        halved when ``x2`` is None. ``"structured"``: features ``O(C * activations)`` per
        example; an outer-product layer costs ``N1 N2 P_layer`` (plus ``N1 N2 C O`` or
        ``N1 N2 C^2 O``), a convolution with ``L > 1`` positions ``N1 N2 C P_layer``
        (``N1 N2 C^2 P_layer`` for the full kernel) plus ``(N1 + N2) C L P_layer`` to form
        its columns; each layer's temporaries are bounded by half of ``memory_budget``.
        A symmetric block computes only its upper example-range pairs (5/8 of the
        products with four ranges).
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
                step = self._structured_step(structure, chunk_size, n1, step)
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
                # the reference product in float64: a float32 dot product over P ~ 1e7
                # terms is itself off by ~1e-4 relative
                ref = self._jacobian_block(a0.double(), a0.double(), False)
                got = st.block(f0, f0, False).double()
                tol = 1e-4 if self._dtype == torch.float32 else 1e-9
                if not torch.allclose(got, ref, rtol=tol, atol=tol * float(ref.abs().max())):
                    raise _NotStructured("one-example check against the Jacobian way failed")
                st.bytes_per_example = _nbytes(f0)
                self._structured = st
            except _NotStructured as err:
                self._structured = False
                self._structured_reason = str(err)
        if self._structured is False:
            if required:
                raise ValueError(f"method='structured' does not apply: {self._structured_reason}")
            return None
        return self._structured

    def _structured_step(
        self, structure: _CaptureStructure, chunk_size: int | None, n: int, step: int
    ) -> int:
        """Examples per structured feature chunk: ``step`` when a chunk size was given (here
        or to the GP), else equal chunks of at most what the memory budget allows."""
        if chunk_size is not None or self._chunk_size is not None:
            return step
        most = structure.example_chunk(structure.bytes_per_example)
        return -(-n // -(-n // most))

    def variance(self, x: Tensor, *, chunk_size: int | None = None, method: str = "auto") -> Tensor:
        """Marginal covariance of ``f(x_n)``: ``J(x_n) Sigma J(x_n)^T`` ``[N, C, C]``,
        computed per chunk of examples (never ``N x N``). ``method`` as :meth:`kernel`: the
        structured way adds each layer's per-example ``[C, C]`` block from the captured
        inputs and output gradients (:meth:`_CaptureStructure.marginal`: an outer-product
        layer costs ``n (P_layer + C^2 O)``, a convolution with ``L > 1`` positions
        ``n C L P_layer`` to form its whitened columns plus ``n C^2 P_layer``), without
        ``[n, C, P]`` Jacobians or ``n x n`` blocks."""
        if method not in ("auto", "jacobian", "structured"):
            raise ValueError(f"method must be 'auto', 'jacobian' or 'structured', got {method!r}")
        x = self._prep(x)
        step = self._step(chunk_size, x)
        structure = None
        if method != "jacobian":
            structure = self._structure(x[:1], required=method == "structured")
        if structure is not None:
            step = self._structured_step(structure, chunk_size, len(x), step)
        outs = []
        for rows in self._chunks(len(x), step):
            if structure is None:
                a = self._whitened(x, rows)
                v = torch.bmm(a, a.transpose(1, 2))
            else:
                v = structure.marginal(structure.features(x, rows))
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
            eps = randn_like_on((n_samples, *m.shape), generator, m.dtype, m.device)
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
    * convolutions with ``L > 1`` output positions: whitened Jacobian columns of a block of
      output channels at a time, ``[C o, L] @ [L, J]`` per example, then one Gram GEMM per
      block (:func:`_conv_into`); unfolded columns that are zero for every example dropped;
    * *dense* layers (norm layers, sequence ``Linear``): the layer's per-example Jacobians
      ``[n, C, P_layer]`` (small) and their Gram product;
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
        self.std: dict[str, dict[str, Tensor]] = {}
        captured: set[str] = set()
        for mname, mod in model.named_modules():
            own = {pn: p for pn, p in mod._parameters.items() if p is not None and p.requires_grad}
            if not own or not supported_layer(mod) or any(owners[id(p)] != 1 for p in own.values()):
                continue
            self.layers[mname] = mod
            self.var[mname] = {pn: var[names[id(p)]] for pn, p in own.items()}
            self.std[mname] = {pn: v.sqrt() for pn, v in self.var[mname].items()}
            captured.update(names[id(p)] for p in own.values())
        if not self.layers:
            raise _NotStructured("the model has no layer with a capture rule")
        self.other = [n for n in gp._params if n not in captured]
        std = unflatten(model, gp.posterior.std.detach().to(gp._dtype))
        self.other_std = torch.cat([std[n].reshape(-1) for n in self.other]) if self.other else None
        self._name_of = {id(m): k for k, m in self.layers.items()}

    def features(self, x: Tensor, rows: slice) -> tuple[dict[str, tuple], Any, int, int]:
        """``({layer: (kind, u or a, g [C, n, ...])}, A_other [n, C, P_other] or None, n,
        C)``:
        one forward pass and one batched backward pass of the ``C`` outputs per chunk."""
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
        return feats, a_other, n, c

    def block(
        self, f1: tuple, f2: tuple, diagonal_outputs: bool, budget: int | None = None
    ) -> Tensor:
        """Kernel block ``[C, n, m]`` (per-output) or ``[n, C, m, C]`` between two feature
        sets, accumulated layer by layer into one output (:class:`_Gram`); ``budget`` bytes
        (default half the GP's ``memory_budget``) bound each layer's temporaries."""
        (lay1, o1, n1, c), (lay2, o2, n2, _) = f1, f2
        same = f1 is f2
        budget = self.gp.memory_budget // 2 if budget is None else budget
        acc = _Gram(c, n1, n2, diagonal_outputs, same, self.gp._dtype, self.gp._device)
        contributed = o1 is not None
        if o1 is not None:
            acc.add_rows(o1, o1 if same else o2)
        for name, ft1 in lay1.items():
            ft2 = lay2.get(name)
            if ft2 is None:
                continue
            contributed = True
            m = self.layers[name]
            if ft1[0] == "outer":
                _outer_into(acc, ft1, ft1 if same else ft2, self.var[name], budget)
            elif ft1[0] == "conv":
                _conv_into(acc, m, ft1, ft1 if same else ft2, self.std[name], budget)
            else:
                j1 = _dense_jacobian(m, ft1, self.std[name])
                acc.add_rows(j1, j1 if same else _dense_jacobian(m, ft2, self.std[name]))
        if not contributed:
            raise _NotStructured("no layer contributes")
        return acc.result()

    def marginal(self, f: tuple, budget: int | None = None) -> Tensor:
        """Per-example blocks ``J(x_i) Sigma J(x_i)^T`` ``[n, C, C]`` of one feature set
        (the diagonal of :meth:`block` without the ``n x n`` products): outer-product layers
        by ``sum_o g_co g_do [sum_j s_oj u_j^2 + s^b_o]``, convolutions by the Gram products
        of their whitened columns per example, dense layers and other parameters by their
        per-example Jacobians."""
        lay, o, n, c = f
        budget = self.gp.memory_budget // 2 if budget is None else budget
        acc = _Marginal(n, c, self.gp._dtype, self.gp._device)
        contributed = o is not None
        if o is not None:
            acc.add_rows(o, o)
        for name, ft in lay.items():
            contributed = True
            m = self.layers[name]
            if ft[0] == "outer":
                _, u, g = ft
                grp, jg = u.shape[1:]
                sw = self.var[name]["weight"].reshape(grp, -1, jg)
                t = torch.einsum("ngj,goj->ngo", u * u, sw).reshape(n, -1)  # n, O
                if "bias" in self.var[name]:
                    t = t + self.var[name]["bias"]
                acc.out += torch.einsum("cno,no,dno->ncd", g, t, g)
            elif ft[0] == "conv":
                _conv_into(acc, m, ft, ft, self.std[name], budget)
            else:
                j = _dense_jacobian(m, ft, self.std[name])
                acc.add_rows(j, j)
        if not contributed:
            raise _NotStructured("no layer contributes")
        return acc.out

    def example_chunk(self, bytes_per_example: int) -> int:
        """Examples per feature chunk: a third of the memory budget for the chunk's features
        (the backward pass that produces them needs about as much again)."""
        return max(1, self.gp.memory_budget // (3 * max(1, bytes_per_example)))


_GRAM_MIN_ROWS = 128
"""Rows per example range of a symmetric :class:`_Gram` block, at least."""


class _Gram:
    """Accumulator of a kernel block ``sum_layers A1 A2^T``.

    The block is stored as ``[C, n, m]`` (``diagonal_outputs``) or ``[n C, m C]`` (rows
    ordered example-major, viewed as ``[n, C, m, C]``). For a symmetric block (both feature
    sets the same) the examples are split into up to four ranges and only the upper
    range pairs are computed (5/8 of the products for four ranges); :meth:`result` mirrors
    the rest."""

    def __init__(
        self, c: int, n: int, m: int, diag: bool, same: bool, dtype: torch.dtype, device
    ) -> None:
        self.c, self.n, self.m, self.diag, self.same = c, n, m, diag, same
        shape = (c, n, m) if diag else (n * c, m * c)
        self.out = torch.zeros(shape, dtype=dtype, device=device)
        nb = max(1, min(4, (n if diag else n * c) // _GRAM_MIN_ROWS)) if same else 1
        cuts = [round(i * n / nb) for i in range(nb + 1)]
        self.ranges = [slice(a, b) for a, b in itertools.pairwise(cuts) if b > a]

    def pairs(self) -> list[tuple[slice, slice]]:
        """Example ranges ``(rows, cols)`` to compute."""
        if not self.same:
            return [(slice(0, self.n), slice(0, self.m))]
        return [(r, q) for i, r in enumerate(self.ranges) for q in self.ranges[i:]]

    def view4(self) -> Tensor:
        """The block as ``[C, n, m]`` or ``[n, C, m, C]`` (a view)."""
        return self.out if self.diag else self.out.view(self.n, self.c, self.m, self.c)

    def add_rows(self, j1: Tensor, j2: Tensor) -> None:
        """Add ``A1 A2^T`` for per-example rows ``j1 [n, C, k]``, ``j2 [m, C, k]`` (``j2 is
        j1`` for a symmetric block)."""
        if self.diag:
            a1 = j1.transpose(0, 1).contiguous()  # C, n, k
            a2 = a1 if j2 is j1 else j2.transpose(0, 1).contiguous()
        else:
            a1 = j1.reshape(-1, j1.shape[-1])
            a2 = a1 if j2 is j1 else j2.reshape(-1, j2.shape[-1])
        self.add(a1, a2)

    def add(self, a1: Tensor, a2: Tensor) -> None:
        """Add ``A1 A2^T`` for ``a [C, n, k]`` (per-output) or ``[n C, k]`` (rows
        example-major), one GEMM per range pair into the output in place."""
        c = self.c
        if self.diag:
            for r, q in self.pairs():
                self.out[:, r, q].baddbmm_(a1[:, r], a2[:, q].transpose(1, 2))
        else:
            for r, q in self.pairs():
                rr, qq = slice(r.start * c, r.stop * c), slice(q.start * c, q.stop * c)
                self.out[rr, qq].addmm_(a1[rr], a2[qq].T)

    def result(self) -> Tensor:
        """The block (lower range pairs mirrored from the upper ones when symmetric)."""
        out = self.view4()
        if self.same:
            for i, r in enumerate(self.ranges):
                for q in self.ranges[i + 1 :]:
                    if self.diag:
                        out[:, q, r] = out[:, r, q].transpose(1, 2)
                    else:
                        out[q, :, r, :] = out[r, :, q, :].permute(2, 3, 0, 1)
        return out


class _Marginal:
    """Accumulator of per-example blocks ``sum_layers A_i A_i^T`` ``[n, C, C]``, with the
    interface of :class:`_Gram` that :func:`_conv_into` uses (rows example-major)."""

    diag = False
    same = True

    def __init__(self, n: int, c: int, dtype: torch.dtype, device) -> None:
        self.n, self.c = n, c
        self.out = torch.zeros(n, c, c, dtype=dtype, device=device)

    def add_rows(self, j1: Tensor, j2: Tensor) -> None:
        """Add ``A_i A_i^T`` for per-example rows ``j [n, C, k]`` (``j2`` is ``j1``)."""
        self.out.baddbmm_(j1, j1.transpose(1, 2))

    def add(self, a1: Tensor, a2: Tensor) -> None:
        """Add ``A_i A_i^T`` for rows ``a [n C, k]`` (example-major)."""
        a = a1.view(self.n, self.c, -1)
        self.out.baddbmm_(a, a.transpose(1, 2))


def _nonzero_columns(u1: Tensor, u2: Tensor) -> Tensor | None:
    """Indices of the last-dimension columns that are nonzero somewhere in both ``u1`` and
    ``u2`` (None when all are): a column that is zero for every example and position of
    either side (a kernel tap that only ever sees zero padding, a dead channel) contributes
    exactly zero to the kernel and is dropped."""
    k = u1.shape[-1]
    nz = u1.reshape(-1, k).ne(0).any(0)
    if u2 is not u1:
        nz = nz & u2.reshape(-1, k).ne(0).any(0)
    if bool(nz.all()):
        return None
    return nz.nonzero().squeeze(1)


_OUTER_STEP_BYTES = 1 << 25
"""Temporaries of one row step of :func:`_outer_into`, at most (32 MiB: larger steps are
no fewer flops but slower, memory-bound on fresh allocations)."""

_OUTER_ROWS = 256
"""Product rows (``x1`` rows times ``x2`` rows) of one row step of :func:`_outer_into` on a
CPU, at least: steps of one or a few ``x1`` rows leave few columns nonzero in the step's rows
(see :data:`_SPARSE_KEEP`)."""

_SPARSE_KEEP = 0.75
"""A row step of :func:`_outer_into` drops the input columns that are zero in all of its
``x1`` rows or in all of ``x2`` when fewer than this share of the columns is left."""


def _outer_into(acc: _Gram, ft1: tuple, ft2: tuple, var: dict[str, Tensor], budget: int) -> None:
    """Add ``sum_o g1_co g2_do [sum_j s_oj u1_j u2_j + s^b_o]`` of an outer-product layer
    (``u [n, G, J/G]``, ``g [C, n, O]``, ``s`` the weight variances ``[O, J/G]``).

    The inner sums ``t [n, m, O]`` are ``[n m, J] @ [J, O]`` products (independent of ``C``;
    ``N1 N2 P_layer`` multiply-adds), then contracted with ``g``. Rows of ``x1`` are taken a
    few at a time (about :data:`_OUTER_ROWS` product rows per step on a CPU; temporaries
    within ``budget`` bytes and 32 MiB, :data:`_OUTER_STEP_BYTES`), and a step keeps only
    the columns ``j`` that are nonzero in one of its ``x1`` rows and one ``x2`` row: the
    others add exactly zero. For sparse inputs this cuts the products by the sparsity (an
    MNIST image has about 150 nonzero pixels of 784, a ReLU layer about half its units);
    the selection costs one host synchronisation per step, so on a GPU steps are as large
    as the memory allows and only columns zero for whole chunks are dropped."""
    _, u1, g1 = ft1
    _, u2, g2 = ft2
    same = ft2 is ft1
    grp, jg = u1.shape[1:]
    c, _, o = g1.shape
    sw = var["weight"].reshape(grp, o // grp, jg)
    idx = _nonzero_columns(u1, u2)
    if idx is not None:
        u1, sw = u1.index_select(2, idx), sw.index_select(2, idx)
        u2 = u1 if same else u2.index_select(2, idx)
    jk = u1.shape[2]
    sb = var.get("bias")
    out = acc.view4()
    elt = u1.element_size()
    g2t = None if acc.diag else g2.permute(1, 0, 2).contiguous()  # m, C, O
    sparse = u1.device.type == "cpu" and jk > 1
    if sparse:
        nz1 = u1.ne(0).any(1)  # n, J: column j of example n is nonzero in some group
        nz2 = nz1 if same else u2.ne(0).any(1)
    if grp == 1:  # columns as rows: selecting them gathers whole rows
        swt = sw[0].T.contiguous()  # J, O
    for r, q in acc.pairs():
        mc = q.stop - q.start
        per_row = mc * (grp * jk + o + c * o) * elt * 2  # product, t, z
        step = max(1, min(budget, _OUTER_STEP_BYTES) // max(1, per_row))
        if sparse:
            step = min(step, -(-_OUTER_ROWS // mc))
            any2 = nz2[q].any(0)
        if grp == 1:
            u2qt = u2[q, 0].T.contiguous()  # J, mc
        for s in range(r.start, r.stop, step):
            rr = slice(s, min(s + step, r.stop))
            ri = rr.stop - rr.start
            cols = None
            if sparse:
                keep = nz1[rr].any(0) & any2
                if int(keep.sum()) < _SPARSE_KEEP * jk:
                    cols = keep.nonzero().squeeze(1)
            if grp == 1:
                # t[r, m, o] = sum_j u2[m, j] (u1[r, j] s[o, j]): one [mc, k] @ [k, ri O]
                a, bt, wt = u1[rr, 0], u2qt, swt
                if cols is not None:
                    a = a.index_select(1, cols)
                    bt, wt = bt.index_select(0, cols), wt.index_select(0, cols)
                w = (a.T[:, :, None] * wt[:, None, :]).reshape(-1, ri * o)  # k, ri O
                t = (bt.T @ w).view(mc, ri, o).transpose(0, 1)  # ri, mc, O
                del w
            else:
                a, b, sws = u1[rr], u2[q], sw
                if cols is not None:
                    a, b = a.index_select(2, cols), b.index_select(2, cols)
                    sws = sws.index_select(2, cols)
                prod = (a[:, None] * b[None]).reshape(ri * mc, grp, a.shape[2])
                t = torch.einsum("xgj,goj->xgo", prod, sws).reshape(ri, mc, o)
                del prod
            if sb is not None:
                t = t + sb
            if acc.diag:
                z = t.unsqueeze(0) * g2[:, None, q, :]  # C, ri, mc, O
                out[:, rr, q] += torch.matmul(z, g1[:, rr, :, None]).squeeze(-1)
            else:
                z = t.unsqueeze(2) * g2t[None, q]  # ri, mc, C, O
                res = torch.bmm(g1[:, rr].transpose(0, 1), z.reshape(ri, mc * c, o).transpose(1, 2))
                out[rr, :, q, :] += res.view(ri, c, mc, c)


def _conv_into(
    acc: _Gram | _Marginal,
    m: nn.Module,
    ft1: tuple,
    ft2: tuple,
    std: dict[str, Tensor],
    budget: int,
) -> None:
    """Add ``A1 A2^T`` of a convolution with ``L > 1`` output positions, ``A`` its whitened
    per-example Jacobians, formed from ``u [n G, L, J/G]`` and ``g [n G, C O/G, L]`` by one
    batched ``[C o, L] @ [L, J/G]`` product per example for a block of ``o`` output channels
    at a time (``o`` chosen so that the ``[n, C, o J/G]`` block of each side stays within
    ``budget`` bytes), never the whole ``[n, C, P_layer]``. Unfolded columns that are zero
    for all examples of either side are dropped (exact). Cost ``n m C P_layer``
    multiply-adds (``n m C^2 P_layer`` for the full block) plus ``(n + m) C L P_layer``
    to form ``A``."""
    _, u1, gg1, n, c = ft1
    _, u2, gg2, mm, _ = ft2
    grp = m.groups
    pos, jg = u1.shape[1:]
    og = gg1.shape[1] // c
    sw = std["weight"].reshape(grp, og, jg)
    idx = _nonzero_columns(u1, u2)
    if idx is not None:
        u1, sw = u1.index_select(2, idx), sw.index_select(2, idx)
        u2 = u1 if ft2 is ft1 else u2.index_select(2, idx)
    jk = u1.shape[2]
    u1, u2 = u1.view(n, grp, pos, jk), u2.view(mm, grp, pos, jk)
    g1, g2 = gg1.view(n, grp, c, og, pos), gg2.view(mm, grp, c, og, pos)
    rows = (n if ft2 is ft1 else n + mm) * c
    oc = max(1, min(og, budget // max(1, 3 * rows * jk * u1.element_size())))

    # preallocated column blocks, reused: fresh multi-GB tensors per block cost page faults
    bufs = [torch.empty(k * c * oc * jk, dtype=u1.dtype, device=u1.device)
            for k in ((n,) if ft2 is ft1 else (n, mm))]  # fmt: skip

    def cols(buf: Tensor, u: Tensor, g: Tensor, gi: int, o0: int, o1: int) -> Tensor:
        """Whitened Jacobian columns of output channels ``o0:o1`` of group ``gi``:
        ``[C, k, o J]`` (per-output) or ``[k C, o J]``."""
        k, w = len(u), o1 - o0
        if acc.diag:
            a = buf[: c * k * w * jk].view(c, k, w, jk)
            for ci in range(c):
                torch.bmm(g[:, gi, ci, o0:o1], u[:, gi], out=a[ci])
        else:
            a = buf[: k * c * w * jk].view(k, c, w, jk)
            gs = g[:, gi, :, o0:o1].reshape(k, c * w, pos)
            torch.bmm(gs, u[:, gi], out=a.view(k, c * w, jk))
        a.mul_(sw[gi, o0:o1])
        return a.view(c, k, w * jk) if acc.diag else a.view(k * c, w * jk)

    for gi in range(grp):
        for o0 in range(0, og, oc):
            o1 = min(og, o0 + oc)
            a1 = cols(bufs[0], u1, g1, gi, o0, o1)
            acc.add(a1, a1 if ft2 is ft1 else cols(bufs[1], u2, g2, gi, o0, o1))
    del bufs
    if "bias" in std:
        b1 = g1.sum(-1).permute(0, 2, 1, 3).reshape(n, c, -1) * std["bias"]
        b2 = b1 if ft2 is ft1 else g2.sum(-1).permute(0, 2, 1, 3).reshape(mm, c, -1) * std["bias"]
        acc.add_rows(b1, b2)


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
