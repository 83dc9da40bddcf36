r"""laplace-torch 0.3's instance API on fromp's Laplace classes: the predictive
(``la(x, ...)``, :meth:`~LaplaceTorchAPI.predictive`, samples), the posterior's density
(``log_prob``, ``square_norm``), its named quantities as properties (``scatter``,
``log_det_ratio``, ``posterior_scale``, ...) and the ``backend`` object with laplace-torch's
``jacobians`` / ``gradients``. :class:`fromp.laplace.base.BaseLaplace` inherits it.

The weights a prediction uses (one rule for every subset and structure, laplace-torch's):
the linearised (``"glm"``) predictive is taken at the model's *current* weights ``w``,
``f ~ N(f_w(x), J_w(x) Sigma J_w(x)^T)``; weight samples (``"nn"``, :meth:`sample`)
perturb the fitted mean ``la.mean``. After the weights move, ``la(x)`` follows the model.

With ``enable_backprop=True`` the ``"glm"`` predictive is differentiable in ``x`` (its
Jacobians ``J(x)`` by ``torch.func``, with autograd through ``x``): the gradient of the
predictive mean and variance, e.g. for Bayesian optimisation.

Bounded memory: every predictive, functional variance, kernel and sample path takes its
test inputs a chunk at a time under one budget, ``memory_budget`` bytes (per call, else the
Laplace's ``memory_budget``, else :func:`fromp.curvature.jacobian.default_memory_budget`:
half the free memory of a CUDA device, 2 GiB on the CPU). The chunk holds
``budget // b`` inputs, ``b`` the working bytes of one input, known before any work from
the shapes (``P``, ``C`` and one example's forward pass, :meth:`LaplaceTorchAPI.
_bytes_per_input`); results are the same to float rounding for any chunk, and the peak
memory does not grow with the number of inputs beyond the outputs themselves.

Last-layer posteriors draw ``"nn"`` samples from the features ``phi(x)`` of one forward pass
(only the head is resampled), not one full forward pass per draw.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vmap

import fromp.laplace.checks as checks
from fromp.curvature.jacobian import (
    forward_numel,
    resolve_memory_budget,
    row_chunks,
    rows_per_chunk,
)
from fromp.laplace.laplace_gp import LaplaceGP
from fromp.laplace.options import Likelihood as LikelihoodName
from fromp.laplace.options import option
from fromp.likelihood import CategoricalLikelihood, GaussianLikelihood
from fromp.link import glm_draws, probit_scale

__all__ = ["LaplaceBackend", "LaplaceTorchAPI", "bridge", "takes_mappings"]


def takes_mappings(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A method of test inputs ``x`` that also takes a mapping batch (Hugging Face style:
    the model is called on the whole mapping, ``x[dict_key_x]`` gives the number of
    examples), through :func:`fromp.laplace.checks.on_mapping`."""

    @functools.wraps(fn)
    def method(self: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
        la = getattr(self, "la", self)  # LaplaceBackend: its Laplace's
        if not isinstance(x, Mapping):
            return fn(self, x, *args, **kwargs)
        if la.dict_key_x not in x:
            raise ValueError(f"x is a mapping without the key dict_key_x={la.dict_key_x!r} "
                             f"(keys: {list(x)})")  # fmt: skip
        with checks.on_mapping(la.model, x, la.dict_key_x) as idx:
            return fn(self, idx, *args, **kwargs)

    return method


_PRED = ("glm", "nn")
_LINKS = ("probit", "bridge", "bridge_norm", "mc")


def bridge(mu: Tensor, var: Tensor, normalized: bool = False) -> Tensor:
    r"""The Laplace bridge (Hobbhahn, Kristiadi & Hennig 2022) as laplace-torch computes it:
    the zero-mean correction ``mu <- mu - s (1^T mu) / (1^T V 1)``, ``V <- V - s s^T / (1^T V
    1)`` (``s = V 1``), then ``alpha_k = (1 - 2/C + e^{mu_k} sum_l e^{-mu_l} / C^2) / V_kk``,
    returning ``alpha / sum alpha`` ``[N, C]``. ``normalized`` (laplace-torch's
    ``"bridge_norm"``): first ``mu <- mu / sqrt(m)``, ``V_kk <- V_kk / m`` with ``m =
    mean_k(V_kk) / sqrt(C / 2)``."""
    s = var.sum(-1)
    tot = var.sum(dim=(1, 2)).reshape(-1, 1)
    mu = mu - s * mu.sum(-1, keepdim=True) / tot
    var = var - torch.einsum("ni,nj->nij", s, var.sum(-2)) / tot.unsqueeze(-1)
    c = mu.shape[-1]
    v = torch.diagonal(var, dim1=1, dim2=2)
    if normalized:
        m = v.mean(1) / math.sqrt(c / 2)
        mu = mu / m.sqrt().unsqueeze(-1)
        v = v / m.unsqueeze(-1)
    alpha = (1 - 2 / c + mu.exp() / c**2 * torch.exp(-mu).sum(1, keepdim=True)) / v
    return torch.nan_to_num(alpha / alpha.sum(1, keepdim=True), nan=1.0)


class LaplaceBackend:
    """``la.backend``: laplace-torch's curvature-backend calls that users make directly,
    evaluated at the model's current weights over the Laplace's subset of weights."""

    def __init__(self, la: LaplaceTorchAPI) -> None:
        self.la = la

    @property
    def model(self) -> nn.Module:
        return self.la.model

    @takes_mappings
    def jacobians(self, x: Any, enable_backprop: bool = False) -> tuple[Tensor, Tensor]:
        """``(Js [N, C, P], f [N, C])``: the Jacobians of the outputs in the subset's
        parameters (``P``: the subset, ``S`` for a subnetwork), and the outputs."""
        return self.la._jacobians(self.la._input(x), enable_backprop)

    def last_layer_jacobians(self, x: Any, enable_backprop: bool = False) -> tuple[Tensor, Tensor]:
        """laplace-torch's name for a last-layer Laplace's :meth:`jacobians`."""
        if self.la.subset_of_weights != "last_layer":
            raise ValueError("last_layer_jacobians is for subset_of_weights='last_layer'; "
                             "use jacobians")  # fmt: skip
        return self.jacobians(x, enable_backprop)

    @takes_mappings
    def gradients(self, x: Any, y: Tensor) -> tuple[Tensor, Tensor]:
        """``(Gs [N, P], loss)``: per-example gradients of the loss (cross-entropy summed;
        regression ``1/2 (f - y)^2`` summed over outputs, laplace-torch's ``MSELoss`` with
        its factor 1/2) in the subset's parameters, and the summed loss."""
        la = self.la
        x = la._input(x)
        js, f = la._jacobians(x)
        with torch.enable_grad():
            fr = f.detach().requires_grad_(True)
            if la.regression:
                yy = y.to(f).reshape(f.shape)
                per = 0.5 * ((fr - yy) ** 2).sum(-1)
            else:
                per = la._lik.nll(fr, y.to(f.device))
            (g,) = torch.autograd.grad(per.sum(), fr)
        return torch.einsum("nc,ncp->np", g, js), per.detach().sum()


class LaplaceTorchAPI:
    """laplace-torch 0.3's public instance names (module docstring). Needs from the class:
    ``_mu``, ``_named``, ``_delta``, ``_lik``, ``regression``, ``_mean_and_variance``,
    ``_kernel``, ``_sigma_times``, ``_prec_times``, ``_log_det_posterior``, ``_factor``,
    ``sample``, ``log_marginal_likelihood_at``."""

    # ------------------------------------------------------------------ evidence
    def log_marginal_likelihood(
        self,
        prior_precision: float | Tensor | None = None,
        sigma_noise: float | Tensor | None = None,
    ) -> Tensor:
        """The Laplace evidence (:mod:`fromp.laplace.base`; the GP evidence for
        :class:`~fromp.laplace.functional.FunctionalLaplace`), differentiable in ``prior_precision``
        and ``sigma_noise`` (defaults: the current values). As in laplace-torch, values
        passed are *stored* (``la.prior_precision``, ``la.sigma_noise``, detached), so a loop
        of hyperparameter steps leaves the Laplace at its last values; the evidence at
        other values without storing them: :meth:`log_marginal_likelihood_at`."""
        out = self.log_marginal_likelihood_at(prior_precision, sigma_noise)
        if prior_precision is not None:
            self.prior_precision = prior_precision
        if sigma_noise is not None:
            self.sigma_noise = sigma_noise
        return out

    # ------------------------------------------------------------------ names
    @property
    def mean(self) -> Tensor:
        """The fitted mean ``theta*`` of the subset ``[P]`` (a subnetwork: all ``P``
        weights, laplace-torch's convention; its ``S`` entries are ``mean_subnet``)."""
        return self._mu

    @mean.setter
    def mean(self, value: Tensor) -> None:
        self._mu = value

    @property
    def likelihood(self) -> Any:
        """laplace-torch's likelihood name: ``"classification"`` (categorical) or
        ``"regression"`` (Gaussian), as a :class:`fromp.laplace.options.Likelihood` (a
        ``str``: equal to the string); ``"bernoulli"`` for fromp's Bernoulli likelihood. The
        likelihood object is :attr:`likelihood_fn`."""
        if isinstance(self._lik, GaussianLikelihood):
            return LikelihoodName.REGRESSION
        if isinstance(self._lik, CategoricalLikelihood):
            return LikelihoodName.CLASSIFICATION
        return self._lik.name

    @likelihood.setter
    def likelihood(self, value: Any) -> None:
        if option(value) != self.likelihood:
            raise ValueError(f"likelihood is fixed at construction ({self.likelihood!r}); got "
                             f"{value!r}: build a new Laplace")  # fmt: skip

    @property
    def likelihood_fn(self) -> Any:
        """The :class:`fromp.likelihood.Likelihood` object (unit noise for regression)."""
        return self._lik

    @property
    def n_params(self) -> int:
        """laplace-torch's ``n_params``: parameters of the subset (a subnetwork: all
        trainable weights ``P``; its ``S`` are ``n_params_subnet``)."""
        return self.num_params

    @property
    def params(self) -> list[Tensor]:
        """The parameter tensors the posterior is over (laplace-torch: the trainable ones;
        last layer: that layer's)."""
        return [p for _, p in self._named]

    @property
    def is_subset_params(self) -> bool:
        """Whether some of the model's parameters are frozen (``requires_grad=False``)."""
        return any(not p.requires_grad for p in self.model.parameters())

    @property
    def backend(self) -> LaplaceBackend:
        """laplace-torch's backend calls (:class:`LaplaceBackend`)."""
        return LaplaceBackend(self)

    @property
    def prior_precision_diag(self) -> Tensor:
        """``delta`` as ``[P]`` (``[S]`` for a subnetwork)."""
        return self._delta_vector(self._delta)

    @property
    def log_det_prior_precision(self) -> Tensor:
        """``log det D``."""
        return self.prior_precision_diag.log().sum()

    @property
    def log_det_posterior_precision(self) -> Tensor:
        """``log det(G / (s^2 T) + D)``."""
        self._require_fit()
        return self._log_det_posterior(self._delta, self._factor())

    @property
    def log_det_ratio(self) -> Tensor:
        """``log det(G / (s^2 T) + D) - log det D`` (in a form without cancellation; at
        other values: :meth:`log_det_ratio_at`). A method in fromp 0.3."""
        return self.log_det_ratio_at()

    @property
    def scatter(self) -> Tensor:
        """``(theta* - m0)^T D (theta* - m0)`` (at another ``delta``: :meth:`scatter_at`).
        A method in fromp 0.3."""
        return self.scatter_at()

    @property
    def posterior_scale(self) -> Tensor:
        """A square root ``L`` of ``Sigma = L L^T``: ``1 / sqrt(precision)`` ``[P]``
        (diagonal structures) or the lower Cholesky factor of ``Sigma`` ``[P, P]`` (full),
        as laplace-torch's; the Kronecker and low-rank structures have none (laplace-torch
        neither): draw with :meth:`sample`."""
        if self.structure == "diag":
            return self.posterior_variance.sqrt()
        if self.structure == "full":
            return torch.linalg.cholesky(self.posterior_covariance.double()).to(self._mu.dtype)
        raise AttributeError(f"posterior_scale is for the diag and full structures (laplace-torch "
                             f"has none for {self.structure!r}); use sample()")  # fmt: skip

    # ------------------------------------------------------------------ density
    def _subset_value(self, value: Tensor) -> Tensor:
        """``value`` ``[..., P]`` over the subset (hook: a subnetwork takes ``[..., S]``)."""
        return value

    def square_norm(self, value: Tensor) -> Tensor:
        """``(value - theta*)^T Prec (value - theta*)`` for ``value`` ``[P]`` or ``[B,
        P]`` (returns ``[]`` / ``[B]``)."""
        self._require_fit()
        v = self._subset_value(torch.as_tensor(value).to(self._mu))
        if v.shape[-1] != self.num_params or v.ndim not in (1, 2):
            raise ValueError(f"value must have shape [P] or [B, P] with P={self.num_params}, got "
                             f"{tuple(v.shape)}")  # fmt: skip
        d = (v - self._mu).reshape(-1, self.num_params)
        out = (d * self._prec_times(d)).sum(-1)
        return out[0] if v.ndim == 1 else out

    def log_prob(self, value: Tensor, normalized: bool = True) -> Tensor:
        """``log N(value | theta*, Prec^{-1})`` (``normalized=False``: only
        ``-square_norm / 2``)."""
        if not normalized:
            return -self.square_norm(value) / 2
        norm = -self.num_params / 2 * math.log(2 * math.pi) + self.log_det_posterior_precision / 2
        return norm - self.square_norm(value) / 2

    # ------------------------------------------------------------------ Jacobians
    def _input(self, x: Any, memory_budget: int | None = None) -> Tensor:
        """``x`` on the model's device, checked (a mapping became its index input in
        :func:`takes_mappings`)."""
        if not isinstance(x, Tensor):
            raise ValueError(f"x must be a tensor or a mapping, got {type(x).__name__}")
        # a fit, eval mode, the fitted size, finite x and outputs f(x); the last-layer
        # structures check the outputs where their feature pass computes them
        # (checks.finite_outputs), so that their predictive runs the network once
        checks.at_predict(self, x, self.subset_of_weights != "last_layer", memory_budget)
        return x.to(self._device())

    def _jacobian_columns(self) -> Tensor | None:
        """Hook: the columns of the subset's concatenated parameter tensors that are the
        posterior's (a subnetwork's entries); None: all."""
        return None

    def _jacobians(self, x: Tensor, enable_backprop: bool = False) -> tuple[Tensor, Tensor]:
        """``(J [N, C, P], f [N, C])`` at the model's current weights, in the subset's
        parameter order, by ``vmap(jacrev)`` per example; with ``enable_backprop`` both are
        differentiable in ``x``."""
        self._require_fit()
        model, names = self.model, [n for n, _ in self._named]
        params = {n: p.detach() for n, p in self._named}

        def one(ps: dict[str, Tensor], xi: Tensor) -> tuple[Tensor, Tensor]:
            out = functional_call(model, ps, (xi.unsqueeze(0),))[0]
            return out, out

        jac_fn = vmap(jacrev(one, has_aux=True), in_dims=(None, 0))
        step = self.chunk_size or 32
        js, fs = [], []
        with torch.set_grad_enabled(enable_backprop or torch.is_grad_enabled()):
            for s in range(0, len(x), step):
                jac, f = jac_fn(params, x[s : s + step])
                js.append(torch.cat([jac[n].flatten(2) for n in names], -1))
                fs.append(f)
        j, f = torch.cat(js), torch.cat(fs)
        cols = self._jacobian_columns()
        if cols is not None:
            j = j[..., cols.to(j.device)]
        return (j, f) if enable_backprop else (j.detach(), f.detach())

    # ------------------------------------------------------------------ memory budget
    def _budget(self, memory_budget: int | None = None) -> int:
        """The working-memory budget in bytes: ``memory_budget`` (this call), else the
        Laplace's ``memory_budget``, else the device's default
        (:func:`fromp.curvature.jacobian.default_memory_budget`)."""
        return resolve_memory_budget(memory_budget, getattr(self, "memory_budget", None),
                                     device=self._device())  # fmt: skip

    def _probe(self, x: Tensor) -> tuple[int, int, int]:
        """``(C, A, U)`` from one example's forward pass (no gradients):
        :func:`fromp.curvature.jacobian.forward_numel`'s ``A`` and ``U``, and the output
        width ``C``."""
        a, u, c = forward_numel(self.model, x[:1].detach())
        return c, a, u

    def _element_size(self) -> int:
        return self._mu.element_size() if self._mu.numel() else 4

    def _forward_step(self, x: Tensor, memory_budget: int | None = None) -> int:
        """Inputs per chunk of a forward pass without gradients: ``budget // (2 A bytes)``."""
        _, a, _ = self._probe(x)
        return rows_per_chunk(2 * a * self._element_size(), self._budget(memory_budget))

    def _bytes_per_input(self, x: Tensor) -> int:
        """The working bytes of one test input of the linearised predictive (hook): its
        Jacobian rows ``[C, P]``, ``Sigma J^T`` and one temporary (``3 C P`` numbers) and its
        forward and backward pass (``2 A``). The Kronecker structure overrides it."""
        c, a, _ = self._probe(x)
        return (3 * c * self.num_params + 2 * a) * self._element_size()

    def _over_inputs(
        self,
        x: Tensor,
        fn: Any,
        memory_budget: int | None = None,
        bytes_per_input: int | None = None,
        dims: tuple[int, ...] = (0, 0),
        before_chunk: Any = None,
    ) -> Any:
        """``fn(x)`` for a function of the test inputs whose outputs are stacked along
        ``dims`` (one per output), evaluated a chunk of ``budget // bytes_per_input`` inputs
        at a time and concatenated (the same values as one call, to float rounding);
        ``before_chunk()`` runs before each chunk (to replay a random stream)."""
        per = self._bytes_per_input(x) if bytes_per_input is None else bytes_per_input
        step = rows_per_chunk(per, self._budget(memory_budget))
        if step >= len(x):
            if before_chunk is not None:
                before_chunk()
            return fn(x)
        # the results are written into tensors allocated at the first chunk: a small result
        # kept between the chunks' large buffers pins their freed memory (a peak growing with
        # the number of inputs); a result differentiable in x is concatenated instead
        outs: list[Any] = []
        single = True
        for rows in row_chunks(len(x), step):
            if before_chunk is not None:
                before_chunk()
            got = fn(x[rows])
            single = isinstance(got, Tensor)
            parts = (got,) if single else got
            for i, (part, d) in enumerate(zip(parts, dims)):
                if len(outs) <= i:
                    shape = list(part.shape)
                    shape[d] = len(x)
                    outs.append([] if part.requires_grad else part.new_empty(shape))
                if isinstance(outs[i], list):
                    outs[i].append(part)
                else:
                    outs[i].narrow(d, rows.start, rows.stop - rows.start).copy_(part)
            del got, parts
        outs = [torch.cat(o, d) if isinstance(o, list) else o for o, d in zip(outs, dims)]
        return outs[0] if single else tuple(outs)

    def _kernel_chunked(self, x1: Tensor, x2: Tensor, memory_budget: int | None = None) -> Tensor:
        """``J(x1) Sigma J(x2)^T`` ``[N1, C, N2, C]`` by blocks of inputs (each structure's
        ``_kernel`` on a pair of chunks, a block's working memory within the budget);
        ``x2 is x1``: the Gram of one set (the diagonal blocks by the structure's own fast
        route for one set)."""
        per = self._bytes_per_input(x1)
        step = rows_per_chunk(2 * per, self._budget(memory_budget))
        if step >= len(x1) and step >= len(x2):
            return self._kernel(x1, x2)
        same = x2 is x1
        c = self._probe(x1)[0]
        out = x1.new_zeros(len(x1), c, len(x2), c, dtype=self._mu.dtype)
        chunks1, chunks2 = row_chunks(len(x1), step), row_chunks(len(x2), step)
        for r1 in chunks1:
            a = x1[r1]
            for r2 in chunks2:
                b = a if same and r1 == r2 else x2[r2]
                out[r1, :, r2, :] = self._kernel(a, b)
        return out

    def _nn_over_inputs(
        self,
        x: Tensor,
        n_samples: int,
        generator: torch.Generator | None,
        memory_budget: int | None = None,
        **model_kwargs: Any,
    ) -> Tensor:
        """``[S, N, C]`` network outputs at ``S`` weight draws (:meth:`_nn_samples`), a chunk
        of inputs at a time: the random stream (``generator``, else torch's global one) is
        replayed for each chunk, so every chunk sees the same ``S`` draws and the result
        equals one call's; the stream ends where one call leaves it."""
        if generator is not None:
            state = generator.get_state()

            def replay() -> None:
                generator.set_state(state)

        else:
            dev = self._device()
            cpu = torch.get_rng_state()
            gpu = torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None

            def replay() -> None:
                torch.set_rng_state(cpu)
                if gpu is not None:
                    torch.cuda.set_rng_state(gpu, dev)

        c, a, _ = self._probe(x)
        per = (2 * a + 2 * n_samples * c) * self._element_size()
        return self._over_inputs(
            x, lambda z: self._nn_samples(z, n_samples, generator, **model_kwargs),
            memory_budget, per, dims=(1,), before_chunk=replay,
        )  # fmt: skip

    def _mean_and_variance_chunked(
        self, x: Tensor, memory_budget: int | None = None
    ) -> tuple[Tensor, Tensor]:
        return self._over_inputs(x, self._mean_and_variance, memory_budget)

    # ------------------------------------------------------------------ functional
    def _check_js(self, js: Tensor) -> Tensor:
        if not isinstance(js, Tensor) or js.ndim != 3 or js.shape[-1] != self.num_params:
            raise ValueError(f"Js must be Jacobians [N, C, P] with P={self.num_params}, got "
                             f"{getattr(js, 'shape', type(js).__name__)}")  # fmt: skip
        return js.to(self._mu.dtype)

    def functional_variance(self, Js: Tensor) -> Tensor:
        """``J_n Sigma J_n^T`` ``[N, C, C]`` for Jacobians ``Js`` ``[N, C, P]``
        (laplace-torch's; at inputs ``x``: :meth:`functional_variance_at`)."""
        js = self._check_js(Js)
        return self._over_inputs(js, self._js_variance, None, 3 * js[0].numel() * js.element_size())

    def _js_variance(self, js: Tensor) -> Tensor:
        """``J_n Sigma J_n^T`` ``[n, C, C]`` for Jacobians ``[n, C, P]``."""
        sj = self._sigma_times(js.flatten(0, 1)).reshape(js.shape)
        return torch.einsum("ncp,ndp->ncd", js, sj)

    def functional_covariance(self, Js: Tensor) -> Tensor:
        """``J Sigma J^T`` ``[N C, N C]`` for ``Js`` ``[N, C, P]`` (rows example-major)."""
        j = self._check_js(Js).flatten(0, 1)
        return j @ self._sigma_times(j).T

    @takes_mappings
    def functional_variance_at(self, x: Tensor, memory_budget: int | None = None) -> Tensor:
        """``J(x_n) Sigma J(x_n)^T`` ``[N, C, C]`` at inputs ``x`` (each structure's fast
        route, no ``[N, C, P]`` Jacobian where it has one), a chunk of inputs at a time
        within ``memory_budget`` bytes (module docstring)."""
        self._budget(memory_budget)  # refused before any work when not a positive int
        x = self._input(x, memory_budget)
        mu, var = self._mean_and_variance_chunked(x, memory_budget)
        checks.finite_outputs(mu)
        return var

    def _glm(
        self, x: Tensor, joint: bool = False, memory_budget: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """``(f [N, C], var [N, C, C])`` or, ``joint``, ``(f [N C], cov [N C, N C])``; the
        marginal one a chunk of inputs at a time (:meth:`_glm_marginal`)."""
        if joint:
            return self._glm_joint(x, memory_budget)
        return self._over_inputs(x, self._glm_marginal, memory_budget)

    def _glm_joint(self, x: Tensor, memory_budget: int | None = None) -> tuple[Tensor, Tensor]:
        """``(f [N C], J Sigma J^T [N C, N C])``."""
        if self.enable_backprop:
            js, f = self._jacobians(x, enable_backprop=True)
            checks.finite_outputs(f)
            j = js.flatten(0, 1)
            return f.flatten(), j @ self._sigma_times(j).T
        step = self._forward_step(x, memory_budget)
        with torch.no_grad():
            f = torch.cat([checks.finite_outputs(self.model(x[r]))
                           for r in row_chunks(len(x), step)])  # fmt: skip
        k = self._kernel_chunked(x, x, memory_budget)
        n, c = f.shape
        return f.flatten(), k.reshape(n * c, n * c).detach()

    def _glm_marginal(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(f [n, C], J_n Sigma J_n^T [n, C, C])`` for one chunk of inputs."""
        if self.enable_backprop:
            js, f = self._jacobians(x, enable_backprop=True)
            checks.finite_outputs(f)
            return f, self._js_variance(js)
        mu, var = self._mean_and_variance(x)
        checks.finite_outputs(mu)
        return mu.detach(), var.detach()

    # ------------------------------------------------------------------ predictive
    @takes_mappings
    def __call__(
        self,
        x: Any,
        pred_type: str = "glm",
        joint: bool = False,
        link_approx: str = "probit",
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
        fitting: bool = False,
        memory_budget: int | None = None,
        **model_kwargs: Any,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """The predictive at ``x`` (a tensor, or a mapping holding it at ``dict_key_x``):
        class probabilities ``[N, C]`` (classification) or ``(mean [N, C], functional
        variance [N, C, C])`` (regression: add ``sigma_noise^2`` for ``y``).

        * ``pred_type="glm"``: ``f ~ N(f_w(x), J Sigma J^T)`` at the model's current
          weights ``w``; ``link_approx`` ``"probit"`` (``softmax(m / sqrt(1 + pi/8 diag
          v))``), ``"bridge"`` / ``"bridge_norm"`` (:func:`bridge`) or ``"mc"``
          (``n_samples`` draws of ``f``); regression with ``joint=True``: ``(f [N C], cov
          [N C, N C])``; ``diagonal_output``: regression variances ``[N, C]``, and ``"mc"``
          draws from the diagonal;
        * ``pred_type="nn"``: ``n_samples`` weight draws around ``la.mean`` pushed through
          the network (``model_kwargs`` passed to its forward): probabilities averaged, or
          regression ``(mean, variance [N, C])`` of the draws (laplace-torch's).

        ``memory_budget``: working bytes for this call (module docstring: the inputs are
        taken a chunk at a time; default the Laplace's, else the device's).

        ``fitting`` (laplace-torch's reward modelling) has no effect here."""
        pred_type, link_approx = option(pred_type), option(link_approx)
        if pred_type not in _PRED:
            raise ValueError(f"pred_type must be 'glm' or 'nn', got {pred_type!r}")
        if link_approx not in _LINKS:
            raise ValueError(f"link_approx must be one of {_LINKS}, got {link_approx!r}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        if model_kwargs and pred_type != "nn":
            raise ValueError(f"model keyword arguments {sorted(model_kwargs)} are used by "
                             "pred_type='nn' only (the glm predictive calls model(x))")  # fmt: skip
        self._require_fit()
        self._budget(memory_budget)  # refused before any work when not a positive int
        x = self._input(x, memory_budget)
        if pred_type == "nn":
            f = self._nn_over_inputs(x, n_samples, generator, memory_budget, **model_kwargs)
            f = checks.finite_outputs(f)
            if self.regression:
                return f.mean(0), f.var(0)
            return self._lik.inverse_link(f.flatten(0, 1)).reshape(f.shape).mean(0)
        mu, var = self._glm(x, joint=joint and self.regression, memory_budget=memory_budget)
        return self._linked(mu, var, joint, link_approx, n_samples, diagonal_output, generator)

    def _linked(
        self,
        mu: Tensor,
        var: Tensor,
        joint: bool,
        link_approx: str,
        n_samples: int,
        diagonal_output: bool,
        generator: torch.Generator | None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """The GLM predictive from the outputs' Gaussian ``N(mu, var)``: regression ``(mu,
        var)`` (``diagonal_output``: the variances), else the probabilities by
        ``link_approx`` (:meth:`__call__`)."""
        if self.regression:
            if diagonal_output and not joint:
                var = torch.diagonal(var, dim1=-2, dim2=-1)
            return mu, var
        if link_approx == "probit":
            return self._lik.inverse_link(mu * probit_scale(var))
        if link_approx == "mc":
            if diagonal_output:
                var = torch.diag_embed(torch.diagonal(var, dim1=-2, dim2=-1))
            f = glm_draws(mu, var, n_samples, generator)
            return self._lik.inverse_link(f.flatten(0, 1)).reshape(f.shape).mean(0)
        if not isinstance(self._lik, CategoricalLikelihood):
            raise ValueError(f"link_approx={link_approx!r} is for the categorical likelihood")
        return bridge(mu, var, normalized=link_approx == "bridge_norm")

    def predictive(
        self,
        x: Any,
        pred_type: str = "glm",
        link_approx: str = "probit",
        n_samples: int = 100,
        memory_budget: int | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """laplace-torch's ``predictive``: ``la(x, pred_type=..., link_approx=...,
        n_samples=..., memory_budget=...)``."""
        return self(x, pred_type=pred_type, link_approx=link_approx, n_samples=n_samples,
                    memory_budget=memory_budget)  # fmt: skip

    @takes_mappings
    def functional_samples(
        self,
        x: Any,
        pred_type: str = "glm",
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
        memory_budget: int | None = None,
    ) -> Tensor:
        """``[n_samples, N, C]`` draws of the outputs ``f(x)``: of the linearised network's
        Gaussian (``"glm"``; ``diagonal_output``: its diagonal) or through weight draws
        (``"nn"``); the inputs a chunk at a time within ``memory_budget`` bytes."""
        pred_type = option(pred_type)
        self._require_fit()
        self._budget(memory_budget)
        x = self._input(x, memory_budget)
        if pred_type == "nn":
            return checks.finite_outputs(
                self._nn_over_inputs(x, n_samples, generator, memory_budget)
            )
        if pred_type != "glm":
            raise ValueError(f"pred_type must be 'glm' or 'nn', got {pred_type!r}")
        mu, var = self._glm(x, memory_budget=memory_budget)
        if diagonal_output:
            var = torch.diag_embed(torch.diagonal(var, dim1=-2, dim2=-1))
        return glm_draws(mu, var, n_samples, generator)

    def predictive_samples(
        self,
        x: Any,
        pred_type: str = "glm",
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
        memory_budget: int | None = None,
    ) -> Tensor:
        """``[n_samples, N, C]`` draws of the predictive: :meth:`functional_samples` with
        the inverse link applied (probabilities; regression: the outputs)."""
        f = self.functional_samples(x, pred_type, n_samples, diagonal_output, generator,
                                    memory_budget)  # fmt: skip
        if self.regression:
            return f
        return self._lik.inverse_link(f.flatten(0, 1)).reshape(f.shape)

    def _full_vector(self, theta: Tensor) -> list[tuple[str, Tensor]]:
        """A subset draw ``[P]`` as ``(name, tensor)`` pairs for ``functional_call``."""
        out, k = [], 0
        for (name, p), size in zip(self._named, self.sizes):
            out.append((name, theta[k : k + size].view_as(p).to(p.dtype)))
            k += size
        return out

    def _nn_samples(
        self, x: Tensor, n_samples: int, generator: torch.Generator | None, **model_kwargs: Any
    ) -> Tensor:
        """``[S, N, C]``: the network at ``S`` weight draws around ``la.mean``."""
        outs = []
        with torch.set_grad_enabled(self.enable_backprop and torch.is_grad_enabled()):
            for theta in self.sample(n_samples, generator):
                params = dict(self._full_vector(theta))
                outs.append(functional_call(self.model, params, (x,), model_kwargs))
        return torch.stack(outs)

    def gp(self) -> Any:
        """The DNN2GP Gaussian process of the linearised network under this posterior:
        mean ``f_w(x)``, kernel ``J(x) Sigma J(x')^T`` (:class:`fromp.gp.LaplaceGP`)."""
        self._require_fit()
        return LaplaceGP(self)
