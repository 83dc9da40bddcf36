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
:mod:`fromp.laplace.base`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev

from fromp._checks import (
    check_batch,
    check_chunk_size,
    check_model_output,
    not_on_meta,
    require_eval,
)
from fromp.curvature.jacobian import (
    flatten_leading,
    forward_numel,
    num_params,
    over_examples,
    resolve_memory_budget,
    row_chunks,
    rows_per_chunk,
    single_output_fn,
    unflatten,
)
from fromp.gp.kernel import _CaptureStructure, _nbytes, _NotStructured
from fromp.likelihood import (
    BernoulliLikelihood,
    CategoricalLikelihood,
    GaussianLikelihood,
    Likelihood,
    get_likelihood,
    randn_like_on,
)
from fromp.link import probit_scale
from fromp.models import uncompiled
from fromp.posterior import DiagonalGaussian, GaussianPosterior

__all__ = ["GP", "dnn2gp", "predictive_from"]

Posterior = GaussianPosterior


def _check_chunk(chunk_size: int) -> int:
    return check_chunk_size(chunk_size, allow_none=False)


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
        memory_budget: bytes of working memory for the default chunk sizes (Jacobian rows,
            structured features, forward passes of :meth:`mean`); None: half the free memory
            of a CUDA device, 2 GiB on the CPU
            (:func:`fromp.curvature.jacobian.default_memory_budget`). Refused unless a
            positive int.
    """

    def __init__(
        self,
        model: nn.Module,
        posterior: GaussianPosterior,
        likelihood: str | Likelihood,
        *,
        chunk_size: int | None = None,
        memory_budget: int | None = None,
    ) -> None:
        if not isinstance(posterior, GaussianPosterior):
            raise ValueError(
                "posterior must be a GaussianPosterior (DiagonalGaussian or FullGaussian), got "
                f"{type(posterior).__name__}"
            )
        model = uncompiled(model)  # the module inside torch.compile's wrapper
        require_eval(model)
        not_on_meta(model)
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
        ref = next(p for p in model.parameters() if p.requires_grad)
        memory_budget = resolve_memory_budget(memory_budget, device=ref.device)
        self._chunk_size, self.memory_budget = chunk_size, memory_budget
        self._dtype, self._device = ref.dtype, ref.device
        self._elt = ref.element_size()
        self._params = unflatten(model, posterior.mean.detach().to(ref))
        self._buffers = dict(model.named_buffers())
        self._jac = over_examples(jacrev(single_output_fn(model)), (None, 0))
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
        """``f(x)`` at the posterior mean, ``[N, C]``, by forward passes of as many inputs
        as ``memory_budget`` holds (twice one input's activations each)."""
        x = self._prep(x)
        step = len(x)
        if len(x) > 1:
            a, _, _ = forward_numel(self.model, x[:1])
            step = rows_per_chunk(2 * a * self._elt, self.memory_budget)
        out = None  # allocated once (a small result between chunks pins their freed memory)
        with torch.no_grad():
            for r in row_chunks(len(x), step):
                f = functional_call(self.model, (self._params, self._buffers), (x[r],))
                f = check_model_output(f)
                if out is None:
                    out = f.new_empty(len(x), *f.shape[1:])
                out[r] = f
                del f
        self._n_out = out.shape[1]
        return out

    def jacobians(self, x: Tensor, *, chunk_size: int | None = None) -> Tensor:
        """``J(x) [N, C, P]`` at the posterior mean (dense: ``N * C * P`` numbers)."""
        x = self._prep(x)
        step = self._step(chunk_size, x)
        return torch.cat([self._jac_rows(x, slice(s, s + step)) for s in range(0, len(x), step)])

    def _jac_rows(self, x: Tensor, rows: slice) -> Tensor:
        return flatten_leading(self._jac(self._params, x[rows]), 2).detach()

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
                :mod:`fromp.curvature.capture` (``Linear``, ``Conv1d/2d``, norm layers' affine
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
                # the features, and the pass that captures them: its activations A and the
                # C output gradients of every captured layer (the budget's largest part on a
                # convolution's early layers)
                n_act, _, c = forward_numel(self.model, x0[:1])
                st.bytes_per_example = _nbytes(f0) + (c + 2) * n_act * self._elt
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
        out = None  # allocated once: no small result between the chunks' large buffers,
        # which pins the freed memory of every chunk (the peak then grows with N)
        for rows in self._chunks(len(x), step):
            if structure is None:
                a = self._whitened(x, rows)
                v = torch.bmm(a, a.transpose(1, 2))
            else:
                v = structure.marginal(structure.features(x, rows))
            if out is None:
                out = v.new_empty(len(x), *v.shape[1:])
            out[rows] = 0.5 * (v + v.transpose(1, 2))
            del v
        return out

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
        sigma = self.likelihood.sigma if isinstance(self.likelihood, GaussianLikelihood) else 1.0
        return predictive_from(
            self.likelihood, sigma, self.mean, lambda z: self.variance(z, chunk_size=chunk_size),
            x, method, n_samples, generator, return_variance,
        )  # fmt: skip


def predictive_from(
    lik: Likelihood,
    sigma: float,
    mean: Any,
    variance: Any,
    x: Tensor,
    method: str,
    n_samples: int,
    generator: torch.Generator | None,
    return_variance: bool,
) -> Tensor | tuple[Tensor, Tensor]:
    """:meth:`GP.predictive` from a GP's ``mean(x)`` and ``variance(x)`` (shared by
    :class:`GP` and :class:`LaplaceGP`); ``sigma``: the Gaussian noise."""
    if method not in ("probit", "mc", "linear"):
        raise ValueError(f"method must be 'probit', 'mc' or 'linear', got {method!r}")
    if method == "mc" and (not isinstance(n_samples, int) or n_samples < 1):
        raise ValueError(f"n_samples must be a positive int, got {n_samples!r}")
    m = mean(x)
    if isinstance(lik, GaussianLikelihood):
        v = variance(x)
        eye = torch.eye(m.shape[1], dtype=m.dtype, device=m.device)
        return m, v + sigma**2 * eye
    if not isinstance(lik, CategoricalLikelihood | BernoulliLikelihood):
        raise ValueError(f"predictive does not support likelihood {lik!r}")
    need_v = return_variance or method != "linear"
    v = variance(x) if need_v else None
    if method == "linear":
        probs = lik.inverse_link(m)
    elif method == "probit":
        probs = lik.inverse_link(m * probit_scale(v))
    else:
        evals, evecs = torch.linalg.eigh(v)
        root = evecs * evals.clamp_min(0).sqrt().unsqueeze(-2)  # N, C, C: v = root root^T
        eps = randn_like_on((n_samples, *m.shape), generator, m.dtype, m.device)
        f = m + torch.einsum("ncd,snd->snc", root, eps)
        probs = lik.inverse_link(f.reshape(-1, m.shape[1])).reshape(f.shape).mean(0)
    return (probs, v) if return_variance else probs


def dnn2gp(
    model: nn.Module,
    posterior: Posterior,
    likelihood: str | Likelihood,
    *,
    chunk_size: int | None = None,
    memory_budget: int | None = None,
) -> GP:
    """The DNN2GP :class:`GP` of ``model`` under ``posterior`` (see :class:`GP`)."""
    return GP(model, posterior, likelihood, chunk_size=chunk_size, memory_budget=memory_budget)
