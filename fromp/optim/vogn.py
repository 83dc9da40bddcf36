r"""Variational Online Gauss-Newton (VOGN) and its deterministic variant OGN.

VOGN (Khan et al., 2018; Osawa et al., 2019) fits a mean-field Gaussian
``q(w) = N(mu, diag(sigma^2))`` to the (tempered) posterior of a network trained with
``N`` examples, a prior ``p(w) = N(mu_0, diag(1 / delta))`` and a KL weight (temperature)
``kl_weight`` (written ``tau`` in Osawa et al.; in this project ``tau`` is FROMP's
regulariser weight only). With the data term written as a mean over examples, every step

1. draws ``w ~ q`` (``mc_samples`` draws; ``mc_samples = 0`` is OGN: ``w = mu``),
2. computes on a mini-batch of ``M`` examples, at ``w``, the mean gradient
   ``g = (1/M) sum_i g_i`` and a per-example curvature ``h = (1/M) sum_i h_i`` with
   ``g_i = d nll(f(x_i; w), y_i) / dw`` and either ``h_i = g_i^2`` (``hess_approx="ef"``, the
   squared per-example gradients of VOGN) or the exact diagonal of the per-example GGN
   ``h_i = diag(J_i^T Lambda_i J_i)`` (``hess_approx="ggn"``), averaged over the draws,
3. updates (Adam's convention: ``beta`` is the decay)::

       delta~ = kl_weight * delta / N
       m  <- beta1 m + (1 - beta1) (g + delta~ (mu - mu_0))
       s  <- beta2 s + (1 - beta2) h
       mu <- mu - lr * m^ / (s^ + delta~)

   with ``m^ = m / (1 - beta1^t)`` and ``s^ = s / (1 - beta2^t)`` when ``bias_correction``
   (the correction of ``s`` only applies when ``s`` starts at zero, i.e.
   ``hess_init=None``; otherwise ``s^ = s``).

The posterior is ``q = N(mu, diag(1 / (N (s^ + delta~) / kl_weight)))``: precision
``N s^ / kl_weight + delta``. For ``kl_weight = 1`` this is ``N (s^ + delta~)``. As in
``torchsso`` (the reference implementation of Osawa et al.), ``hess_init`` is the
initial value of ``s`` (so ``q`` starts with precision ``N s_0 / kl_weight + delta``) and
``kl_weight`` scales both the prior term and the sampling variance.

The state is torch's ``self.state[p]``, per parameter and shaped like it (``"mean"``
``mu``, ``"momentum"`` ``m``, ``"hess"`` ``s``, ``"prior_mean"``, ``"prior_precision"``,
``"step"`` and, with ``hess_init``, ``"hess_init"``); ``N`` is the groups' ``"ess"``. Every
flat ``[P]`` vector of the API (``posterior()``, :meth:`VOGN.update`'s ``g`` and ``h``)
follows the parameters in group order, for a model its ``named_parameters()`` order
(trainable only), the order of :func:`fromp.curvature.jacobian.flat_params`; the update
works on private flat copies of the state, gathered before and written back after it.

Per-example statistics (``g``, ``h``; exact for any architecture) come from
:mod:`fromp.optim._stats`, predictives from :mod:`fromp.optim.predictive` (re-exported).

Typical use::

    opt = VOGN(model, lr=1e-3, ess=len(train_x), prior_precision=100.0, kl_weight=0.02)
    for x, y in loader:

        def closure():
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)  # the mean over the mini-batch
            loss.backward()
            return loss

        loss = opt.step(closure)  # w ~ q, the per-example curvature of model(x), update
    q = opt.posterior()                  # DiagonalGaussian over the flat parameters
    probs = predict_mc(model, q, x_test, n_samples=20)

Batch norm: its affine parameters get a posterior like any other parameter. The per-example
pass runs the batch-norm layers in ``eval()`` mode (:mod:`fromp.optim._stats`); when the
closure calls the model in training mode, that call updates the running statistics.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from fromp._checks import check_chunk_size, check_positive, check_prior_precision
from fromp.distributed import is_distributed, mean_over_ranks
from fromp.likelihood import Likelihood
from fromp.optim._contract import (
    GroupHyperparameters,
    _as_vector,
    check_betas,
    check_closure_result,
    check_ess,
    check_groups,
    check_param_state,
    check_vogn_groups,
    param_views,
)
from fromp.optim._stats import (
    GradStats,
    LayerCapture,
    LossFn,
    OutputCapture,
    _loss_fn,
    per_example_grad_stats,
)
from fromp.optim.predictive import predict_mc, predict_mean
from fromp.posterior import DiagonalGaussian

__all__ = [
    "OGN",
    "VOGN",
    "GradStats",
    "LayerCapture",
    "OutputCapture",
    "minibatch_curvature",
    "per_example_grad_stats",
    "predict_mc",
    "predict_mean",
    "recorded_curvature",
]


#: per-parameter state (``self.state[p]``) and the private flat copy it is gathered into
_VIEWS = (
    ("mean", "mu"),
    ("momentum", "m"),
    ("hess", "s"),
    ("prior_mean", "prior_mean"),
    ("prior_precision", "prior_precision"),
)
_REQUIRED = tuple(name for name, _ in _VIEWS)


class VOGN(GroupHyperparameters, torch.optim.Optimizer):
    r"""Variational Online Gauss-Newton with a diagonal Gaussian posterior.

    See the module docstring for the update. The state (``mu``, ``s``, ``m``, step count,
    prior) is torch's ``self.state[p]`` (``N``: ``param_groups[i]["ess"]``), so
    :meth:`state_dict` / :meth:`load_state_dict` are torch's; a parameter added later (a
    new head) gets its state at its first step, and a reset of ``self.state`` (Avalanche's
    ``make_optimizer(reset_optimizer_state=True)``) restarts VOGN as if built on the current
    weights (:class:`fromp_avalanche.vogn.VOGNPlugin` loads a resumed run's state again
    after it). After every step the parameters hold ``mu``.

    Two ways to step:

    * **With a closure** (torch's ``step(closure)``, the protocol IVON shares):

      .. code-block:: python

          def closure():
              opt.zero_grad()
              loss = F.cross_entropy(model(x), y)     # the mean over the mini-batch
              with opt.extra_term():                  # optional: enters g, never h
                  loss = loss + reg(model) / N         # on the mean per-example scale
              loss.backward()
              return loss

          opt.step(closure)

      For each draw ``w ~ q`` held in the parameters the optimizer runs the closure and
      finds the per-example curvature of the model calls it made itself (no
      ``set_curvature``): from the layer inputs and output gradients (``hess_approx="ef"``,
      layers of :mod:`fromp.curvature.capture`) or from per-example Jacobians at the
      recorded outputs (any model, ``"ef"`` or ``"ggn"``). The loss must be the mean of
      per-example losses over the rows of the model's outputs; multi-head calls
      (``with_task(net, t)(x_t)`` per task, Avalanche's ``model(x, task_labels)``) count
      all their rows.
    * **Two-phase** (training loops that call ``loss.backward(); optimizer.step()``, such as
      Avalanche's; see :class:`fromp_avalanche.vogn.VOGNPlugin`): ``opt.sample_params()`` before
      the forward pass, ``opt.set_curvature(h)`` after the backward pass with the per-example
      curvature of the data loss at the sampled weights, then ``opt.step()``: ``g`` is read
      from the parameters' ``.grad`` (everything that was back-propagated: data loss plus
      any regulariser). The lowest level is :meth:`update` ``(g, h)``.

    Args:
        params_or_model: the model (what the closure calls), an iterable of its
            parameters, or parameter groups (dicts with ``"params"`` and optionally ``"lr"``
            and ``"prior_precision"``, a float for the group's part of ``delta``); with
            tensors or groups, pass ``model=`` for the closure API (else only the two-phase
            and :meth:`update` APIs, or a closure that calls :meth:`set_curvature`). The
            flat ``[P]`` state follows the groups' order. ``lr`` is read from
            ``param_groups`` at every step, so learning-rate schedulers work; a group's
            ``prior_precision`` edited between steps becomes the prior precision of its
            parameters from the next step on; ``betas``, ``mc_samples``, ``kl_weight`` and
            ``bias_correction`` are one per optimizer.
        lr: step size ``alpha``.
        betas: ``(beta1, beta2)`` decays of ``m`` and ``s``.
        ess: ``N``, the effective sample size (usually the training-set size; IVON's name);
            may be None until the first step (the Avalanche plugin sets it for every
            experience).
        prior_precision: ``delta``, a float or ``[P]`` tensor (default 1.0): the precision
            of the prior on the weights (IVON's ``weight_decay`` is ``delta / N``).
        prior_mean: ``mu_0`` ``[P]`` (default zeros) or a :class:`DiagonalGaussian` prior,
            whose precision is then ``delta`` too (``prior_precision`` must then be None).
        hess_init: initial curvature ``s`` (float or ``[P]``; torchsso's convention; IVON's
            name for its initial Hessian estimate); None: 0.
        mc_samples: draws per step; 0 gives OGN (no sampling, ``w = mu``).
        kl_weight: the weight of the KL term (tempering; ``tau`` in Osawa et al.).
        likelihood: the per-example loss: a :class:`Likelihood`, its name, or a callable
            ``(f [B, C], y [B]) -> [B]`` (``hess_approx="ef"`` only).
        hess_approx: ``"ef"`` (squared per-example gradients, VOGN) or ``"ggn"`` (exact
            per-example GGN diagonal; costs a Jacobian per example).
        bias_correction: Adam-style bias correction (see the module docstring).
        chunk_size: examples per vectorised per-example call (bounds memory).
        method: how the separate per-example pass of
            :class:`fromp_avalanche.vogn.VOGNPlugin` computes the squared gradients, see
            :func:`per_example_grad_stats` (``"auto"``, ``"hooks"`` or ``"vmap"``).
        model: with parameter groups, the module the closure calls (its trainable
            parameters must be exactly the groups').

    Several processes (``torch.distributed``): see :meth:`update`; draw the same noise on
    every rank or not, the update is the same on all of them.
    """

    def __init__(
        self,
        params_or_model: nn.Module | Iterable[Tensor],
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        ess: float | None = None,
        prior_precision: float | Tensor | None = None,
        prior_mean: Tensor | DiagonalGaussian | None = None,
        hess_init: float | Tensor | None = None,
        mc_samples: int = 1,
        kl_weight: float = 1.0,
        likelihood: Likelihood | LossFn | str = "categorical",
        hess_approx: str = "ef",
        bias_correction: bool = True,
        chunk_size: int | None = None,
        method: str = "auto",
        model: nn.Module | None = None,
    ) -> None:
        if isinstance(params_or_model, nn.Module):
            if model is not None and model is not params_or_model:
                raise ValueError("model= is for parameter groups: VOGN(model) has its model")
            self.model: nn.Module | None = params_or_model
            named = [(n, p) for n, p in params_or_model.named_parameters() if p.requires_grad]
            params = [p for _, p in named]
        else:
            if model is not None and not isinstance(model, nn.Module):
                raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
            self.model = model
            params = list(params_or_model)
            if any(isinstance(p, dict) for p in params):
                params = check_vogn_groups(params)
        if not params:
            raise ValueError("params_or_model has no trainable parameters")
        check_positive(lr, "lr")
        betas = check_betas(betas)
        if not (isinstance(mc_samples, int) and mc_samples >= 0):
            raise ValueError(f"mc_samples must be an int >= 0, got {mc_samples!r}")
        check_positive(kl_weight, "kl_weight")
        if hess_approx not in ("ef", "ggn"):
            raise ValueError(f"hess_approx must be 'ef' or 'ggn', got {hess_approx!r}")
        chunk_size = check_chunk_size(chunk_size)
        if method not in ("auto", "vmap", "hooks"):
            raise ValueError(f"method must be 'auto', 'vmap' or 'hooks', got {method!r}")
        if ess is not None:
            ess = check_ess(ess)
        defaults = dict(
            lr=float(lr),
            betas=tuple(float(b) for b in betas),
            mc_samples=int(mc_samples),
            kl_weight=float(kl_weight),
            bias_correction=bool(bias_correction),
            prior_precision=None,
            ess=ess,
        )
        super().__init__(params, defaults)
        self.likelihood = likelihood
        self.loss_fn: LossFn = _loss_fn(likelihood)  # per-example loss (f, y) -> [B]
        self.hess_approx = hess_approx
        self.chunk_size = chunk_size
        self.method = method

        mu = torch.cat([p.detach().reshape(-1) for p in self.params]).clone()
        group_deltas = [g["prior_precision"] for g in self.param_groups]
        if isinstance(prior_mean, DiagonalGaussian):
            if prior_precision is not None or any(d is not None for d in group_deltas):
                raise ValueError(
                    "prior_precision (argument or group key) must be None when prior_mean is "
                    "a DiagonalGaussian (its precision is the prior precision)"
                )
            prior_precision = prior_mean.precision
            prior_mean = prior_mean.mean
        delta = check_prior_precision(
            1.0 if prior_precision is None else prior_precision, sizes={"P": len(mu)}, like=mu
        )
        delta = delta.detach().expand_as(mu).clone()  # type: ignore[union-attr]
        i = 0
        for group, d in zip(self.param_groups, group_deltas):
            k = sum(p.numel() for p in group["params"])
            if d is not None:
                delta[i : i + k] = check_prior_precision(
                    d, name="prior_precision of a parameter group"
                )
            i += k
        mu0 = (
            torch.zeros_like(mu) if prior_mean is None else _as_vector(prior_mean, mu, "prior_mean")
        )
        if hess_init is None:
            s0 = torch.zeros_like(mu)
        else:
            s0 = _as_vector(hess_init, mu, "hess_init")
            if not (torch.isfinite(s0).all() and (s0 >= 0).all()):
                raise ValueError("hess_init must be finite and >= 0")
        # the constructor's configuration (not state): what self.state[p] starts with, at
        # construction and again after a reset of self.state (torch's meaning)
        self._s_from_zero = hess_init is None  # s^ bias-corrected; no "hess_init" in the state
        params = self.params
        views = zip(*(param_views(t, params) for t in (mu0, delta, s0)))
        self._initial: dict[Tensor, dict[str, Tensor]] = {
            p: {"prior_mean": m0, "prior_precision": d, "hess": s}
            for p, (m0, d, s) in zip(params, views)
        }
        # what a parameter added later starts with (a float given to the constructor)
        self._s0_scalar = float(hess_init) if isinstance(hess_init, int | float) else 0.0
        self._delta_scalar = (
            float(prior_precision) if isinstance(prior_precision, int | float) else 1.0
        )
        self._pending_curv: Tensor | None = None
        # each group's prior_precision as last applied to its parameters' state
        self._group_priors = [g["prior_precision"] for g in self.param_groups]
        self._pending_n: int | None = None
        self._paused = 0  # inside extra_term(): model calls are not examples
        self._sampled = False
        self._version = 0  # bumped when the prior or the state is replaced
        self._std_cache: tuple[tuple, Tensor] | None = None
        self._dt_cache: tuple[tuple, Tensor] | None = None
        self._lr_cache: tuple[tuple, Tensor] | None = None
        self._work: dict[str, Tensor] = {}  # [P] work buffers (see _buffer)
        self._cache: dict[str, Any] | None = None  # flat copies of self.state (see _flat)
        self._states()  # self.state[p] for every parameter, as torch's optimizers keep it

    # ---------------------------------------------------------------- state
    def _fresh(self, p: Tensor, group: dict[str, Any]) -> dict[str, Tensor]:
        """The state a parameter starts with: mean its current value, no momentum, ``s`` and
        the prior from the constructor (a parameter added later: ``s`` at ``hess_init``, 0
        when it was None or a vector, the prior ``N(0, 1 / delta)`` with its group's
        ``prior_precision``, 1.0 when the constructor got a vector)."""
        init = self._initial.get(p)
        if init is not None and init["hess"].shape == p.shape:
            s0, m0, d = init["hess"], init["prior_mean"], init["prior_precision"]
        else:
            s0 = torch.full_like(p, self._s0_scalar)
            m0 = torch.zeros_like(p)
            d = torch.full_like(p, group["prior_precision"] or self._delta_scalar)
        st = {
            "mean": p.detach().clone(),
            "momentum": torch.zeros_like(p).detach(),
            "hess": s0.detach().to(p).clone(),
            "prior_mean": m0.detach().to(p).clone(),
            "prior_precision": d.detach().to(p).clone(),
        }
        if not self._s_from_zero:
            st["hess_init"] = s0.detach().to(p).clone()
        return st

    def _state_changed(self) -> None:
        self._cache = None  # gather the flat copies again

    def _flat(self) -> dict[str, Any]:
        """Private flat ``[P]`` copies of :attr:`state` (``"mu"``, ``"m"``, ``"s"``,
        ``"prior_mean"``, ``"prior_precision"``, ``"init_s"`` or None, and ``"step"``), in
        group order, gathered again whenever ``self.state`` was replaced or reset, or
        parameters were added (the update works on them in place; :meth:`_scatter` writes
        them back into ``self.state``)."""
        states = self._states()
        params = self.params
        src = (
            tuple(id(p) for p in params),
            tuple(id(v) for st in states for v in st.values() if isinstance(v, Tensor)),
        )
        c = self._cache
        if c is not None and c["src"] == src:
            return c
        c = {key: torch.cat([st[name].reshape(-1) for st in states]) for name, key in _VIEWS}
        c["init_s"] = (
            torch.cat([st["hess_init"].reshape(-1) for st in states])
            if all("hess_init" in st for st in states)
            else None
        )
        c["step"] = max(int(st["step"]) for st in states)
        c["src"] = src
        self._cache = c
        self._version += 1
        self._work = {}
        self._lr_cache = None
        return c

    def _scatter(self, keys: Iterable[str]) -> None:
        """Write the flat copies ``keys`` (and the step count) back into ``self.state``."""
        c = self._cache
        assert c is not None
        states = [self.state[p] for p in self.params]
        for name, key in _VIEWS:
            if key in keys:
                torch._foreach_copy_([st[name] for st in states], self._views(c[key]))
        for st in states:
            st["step"] = c["step"]

    def _views(self, flat: Tensor) -> list[Tensor]:
        return param_views(flat, self.params)

    # ---------------------------------------------------------------- hyper-parameters
    @property
    def kl_weight(self) -> float:
        return float(self.param_groups[0]["kl_weight"])

    @property
    def ess(self) -> float | None:
        """``N``, the effective sample size (None until set; ``param_groups[i]["ess"]``)."""
        return self.param_groups[0].get("ess")

    @ess.setter
    def ess(self, n: float) -> None:
        n = check_ess(n)
        for group in self.param_groups:
            group["ess"] = n

    def _n(self) -> float:
        n = self.ess
        if n is None:
            raise ValueError("ess is not set: pass VOGN(..., ess=N) or set opt.ess = N")
        return n

    # ---------------------------------------------------------------- posterior
    def _check_precision_scale(self, where: str) -> None:
        """``N c / kl_weight`` (the factor of ``s`` in the posterior precision) must be a
        number of the state's dtype: a tiny ``kl_weight`` overflows it (refused before any
        change)."""
        if self.ess is None:
            return
        dtype = self._flat()["s"].dtype
        alpha = self._n() * self._s_scale() / self.kl_weight
        limit = torch.finfo(dtype).max
        if not math.isfinite(alpha) or alpha > limit:
            raise ValueError(
                f"{where}: kl_weight={self.kl_weight:g} makes the posterior precision's factor "
                f"N / kl_weight = {alpha:.3g} overflow {dtype} (N={self._n():g}); use a "
                "larger kl_weight"
            )

    def _s_scale(self) -> float:
        """``c`` with ``s^ = c s`` (bias correction of ``s`` when it starts at zero)."""
        st = self._flat()
        beta2 = self.param_groups[0]["betas"][1]
        if self.param_groups[0]["bias_correction"] and st["init_s"] is None and st["step"] > 0:
            return 1.0 / (1.0 - beta2 ** st["step"])
        return 1.0

    def _s_hat(self) -> Tensor:
        return self._flat()["s"] * self._s_scale()

    def _delta_tilde(self) -> Tensor:
        """``kl_weight delta / N`` ``[P]`` (cached until the prior, N or kl_weight change)."""
        st = self._flat()
        key = (self._n(), self.kl_weight, self._version)
        if self._dt_cache is None or self._dt_cache[0] != key:
            self._dt_cache = (key, st["prior_precision"] * (key[1] / key[0]))
        return self._dt_cache[1]

    def posterior_precision(self, out: Tensor | None = None) -> Tensor:
        """``N s^ / kl_weight + delta`` ``[P]`` (written into ``out`` when given)."""
        st = self._flat()
        alpha = self._n() * self._s_scale() / self.kl_weight
        return torch.add(st["prior_precision"], st["s"], alpha=alpha, out=out)

    def posterior(self) -> DiagonalGaussian:
        """``q = N(mu, diag(1 / (N s^ / kl_weight + delta)))`` (copies of the state)."""
        return DiagonalGaussian(self._flat()["mu"].clone(), self.posterior_precision().clone())

    def prior(self) -> DiagonalGaussian:
        st = self._flat()
        return DiagonalGaussian(st["prior_mean"].clone(), st["prior_precision"].clone())

    def set_prior(
        self, prior: DiagonalGaussian | None = None, *, reset: bool = True
    ) -> DiagonalGaussian:
        """Make ``prior`` (default: the current posterior) the prior ``N(mu_0, 1/delta)``.

        With ``reset`` (a new task of naive continual VOGN), ``m``, the step count and ``s``
        restart (``s`` at its initial value, so with ``hess_init=None`` the next
        posterior starts equal to the prior); ``mu`` is kept. Returns the new prior.
        """
        prior = self.posterior() if prior is None else prior
        st = self._flat()
        if prior.mean.shape != st["mu"].shape:
            raise ValueError(
                f"prior must have P={st['mu'].numel()} entries, got {tuple(prior.mean.shape)}"
            )
        self._version += 1
        st["prior_mean"] = prior.mean.detach().to(st["mu"]).clone()
        st["prior_precision"] = prior.precision.detach().to(st["mu"]).clone()
        if reset:
            st["m"].zero_()
            st["step"] = 0
            st["s"] = torch.zeros_like(st["mu"]) if st["init_s"] is None else st["init_s"].clone()
        self._scatter([key for _, key in _VIEWS])
        return self.prior()

    # ---------------------------------------------------------------- parameters
    def _sync_device(self) -> None:
        """Follow the parameters when the model was moved after construction, parameters
        were added (their state starts at their first step), ``self.state`` was reset or a
        group's ``prior_precision`` was edited (:meth:`_apply_group_priors`)."""
        self._apply_group_priors()
        self._flat()

    def _apply_group_priors(self) -> None:
        """A group's ``prior_precision`` edited since the last step (by hand, a scheduler)
        becomes ``delta`` of its parameters' state (the prior mean stays); groups added
        since start with their own value (:meth:`_fresh`)."""
        applied = self._group_priors
        for i, group in enumerate(self.param_groups):
            d = group.get("prior_precision")
            if i < len(applied) and d is not None and d != applied[i]:
                for p in group["params"]:
                    if "prior_precision" in self.state[p]:
                        self.state[p]["prior_precision"].fill_(float(d))
                self._cache = None  # gather the flat copies again
        self._group_priors = [g.get("prior_precision") for g in self.param_groups]

    @torch.no_grad()
    def _write(self, vec: Tensor) -> None:
        params = self.params
        torch._foreach_copy_(params, param_views(vec, params))

    def _read_grad(self) -> Tensor:
        parts = []
        for p in self.params:
            parts.append(torch.zeros_like(p).reshape(-1) if p.grad is None else p.grad.reshape(-1))
        return torch.cat(parts).detach()

    def _buffer(self, name: str) -> Tensor:
        """A ``[P]`` work buffer like ``mu``, reused across steps. Fresh ``[P]`` temporaries
        cost page faults on every step on a CPU; the hot path writes into these instead."""
        mu = self._flat()["mu"]
        buf = self._work.get(name)
        if buf is None or buf.shape != mu.shape or buf.dtype != mu.dtype or buf.device != mu.device:
            buf = self._work[name] = torch.empty_like(mu)
        return buf

    @torch.no_grad()
    def sample_params(
        self, generator: torch.Generator | None = None, *, copy: bool = True
    ) -> Tensor:
        """Write ``w ~ q`` (``w = mu`` when ``mc_samples == 0``) into the parameters and return
        ``w`` ``[P]``. Sampling uses the scaled std ``sqrt(kl_weight / (N (s^ + delta~)))``.

        With ``copy=False`` the returned tensor is an internal buffer (``mu`` itself when
        ``mc_samples == 0``) that the next draw overwrites: no ``[P]`` allocation per step,
        what the training loops use."""
        check_groups(self.param_groups, "VOGN.sample_params()")
        self._check_precision_scale("VOGN.sample_params()")
        self._sync_device()
        mu = self._flat()["mu"]
        if self.mc_samples == 0:
            w = mu
        else:
            key = (self._flat()["step"], self._n(), self.kl_weight, self._version)
            if self._std_cache is None or self._std_cache[0] != key:
                std = self.posterior_precision(out=self._buffer("std")).rsqrt_()
                self._std_cache = (key, std)
            w = self._buffer("sample")
            w.normal_(generator=generator).mul_(self._std_cache[1]).add_(mu)
        self._write(w)
        self._sampled = True
        return w.clone() if copy else w

    @torch.no_grad()
    def load_mean(self) -> None:
        """Write ``mu`` into the parameters."""
        self._write(self._flat()["mu"])
        self._sampled = False

    @contextmanager
    def sampled_params(self, generator: torch.Generator | None = None) -> Iterator[Tensor]:
        """Hold a draw ``w ~ q`` (:meth:`sample_params`, ``copy=False``) in the parameters
        inside the ``with`` block and yield it; ``mu`` is written back on exit, also when the
        block raises, so the parameters never keep a sample."""
        w = self.sample_params(generator, copy=False)
        try:
            yield w
        finally:
            self.load_mean()

    @torch.no_grad()
    def sync_mean_from_params(self) -> None:
        """Set ``mu`` to the parameters' current values (after loading a model by hand)."""
        st = self._flat()
        st["mu"] = torch.cat([p.detach().reshape(-1) for p in self.params]).clone()
        self._scatter(("mu",))

    # ---------------------------------------------------------------- updates
    @torch.no_grad()
    def update(self, grad: Tensor, curv: Tensor, batch_size: int | None = None) -> None:
        """One VOGN update from ``g`` ``[P]`` (mean data gradient plus any extra terms, no
        prior term) and ``h`` ``[P]`` (mean per-example curvature); writes ``mu`` into the
        parameters.

        Under ``torch.distributed`` (more than one process), ``g`` and ``h`` are this rank's
        means over its ``batch_size`` examples ``M_r``, and are replaced by the means over
        all ranks' examples, ``sum_r M_r g_r / sum_r M_r`` (:func:`fromp.distributed.
        mean_over_ranks`; ``batch_size=None`` weighs the ranks equally, right when every
        rank has the same batch size; :meth:`step` with a closure counts ``M_r`` itself),
        before the update: every rank then makes the same
        update, the one of a single process on the global batch."""
        check_groups(self.param_groups, "VOGN.update()")
        self._check_precision_scale("VOGN.update()")
        self._sync_device()
        st = self._flat()
        mu = st["mu"]
        for name, v in (("grad", grad), ("curv", curv)):
            if v.shape != mu.shape:
                raise ValueError(f"{name} must have shape [P]=[{mu.numel()}], got {tuple(v.shape)}")
        if is_distributed():
            grad, curv = grad.clone(), curv.clone()
            mean_over_ranks([grad, curv], 1.0 if batch_size is None else batch_size)
        # one host sync per step; refuse before any state changes (a NaN loss would
        # otherwise be written into the mean, the momentum and the curvature estimate)
        if not bool(torch.isfinite(grad).all() & torch.isfinite(curv).all()):
            self.load_mean()
            raise FloatingPointError(
                "VOGN.step(): the gradient or the curvature at the sampled weights is not "
                "finite (a NaN or infinite loss?); the weights and the optimizer state are "
                "unchanged"
            )
        group = self.param_groups[0]
        beta1, beta2 = group["betas"]
        lr = self._lr()
        dt = self._delta_tilde()
        st["step"] += 1
        t = st["step"]
        m, s = st["m"], st["s"]
        m.mul_(beta1).add_(grad.to(mu), alpha=1 - beta1)
        diff = torch.sub(mu, st["prior_mean"], out=self._buffer("diff"))
        m.addcmul_(diff, dt, value=1 - beta1)
        s.mul_(beta2).add_(curv.to(mu), alpha=1 - beta2)
        bc1 = 1 - beta1**t if group["bias_correction"] else 1.0
        denom = torch.add(dt, s, alpha=self._s_scale(), out=self._buffer("denom"))  # s^ + δ~
        if isinstance(lr, float):
            mu.addcdiv_(m, denom, value=-lr / bc1)
        else:  # parameter groups with different step sizes
            mu.addcmul_(torch.div(m, denom, out=denom), lr, value=-1.0 / bc1)
        self._scatter(("mu", "m", "s"))  # into self.state
        self.load_mean()

    def _lr(self) -> float | Tensor:
        """The step size: a float when every group has the same ``lr``, else ``[P]`` (read
        at every step, so learning-rate schedulers that edit ``param_groups`` apply)."""
        lrs = tuple(float(g["lr"]) for g in self.param_groups)
        if len(set(lrs)) == 1:
            return lrs[0]
        mu = self._flat()["mu"]
        key = (lrs, mu.device, mu.dtype)
        if self._lr_cache is None or self._lr_cache[0] != key:
            sizes = [sum(p.numel() for p in g["params"]) for g in self.param_groups]
            vec = torch.cat([mu.new_full((k,), lr) for k, lr in zip(sizes, lrs)])
            self._lr_cache = (key, vec)
        return self._lr_cache[1]

    def set_curvature(self, curv: Tensor, batch_size: int | None = None) -> None:
        """Store ``h`` ``[P]`` (a mean over ``batch_size`` examples: the weight of this rank
        under ``torch.distributed``, see :meth:`update`) for the next argument-less
        :meth:`step` (the two-phase loop of :class:`fromp_avalanche.vogn.VOGNPlugin`). A closure
        passed to :meth:`step` need not call it: VOGN finds ``h`` itself."""
        self._pending_curv = curv.detach()
        self._pending_n = batch_size

    def step(  # type: ignore[override]
        self, closure: Callable[[], Tensor] | None = None
    ) -> Tensor | None:
        """One VOGN step, :meth:`torch.optim.Optimizer.step` ``(closure=None)``.

        * ``step(closure)`` (the closure protocol IVON shares): for each of
          ``max(mc_samples, 1)`` draws held in the parameters (:meth:`sampled_params`),
          ``closure()`` computes the **mean** loss over the mini-batch of the model's outputs
          (``VOGN(model)``, or ``model=`` with parameter groups), calls ``backward()`` and
          returns the loss. ``g`` is read from ``.grad``; ``h`` VOGN finds itself from the
          model calls the closure made (layer capture, or per-example Jacobians, see
          :meth:`_step_closure`), and with it the rows ``M`` of the mini-batch (the weight
          of this rank under ``torch.distributed``, :meth:`update`); calls of the model
          inside :meth:`extra_term` (a regulariser) enter ``g`` only. Returns the mean loss
          over the draws.
        * ``step()``: two-phase step (``g`` from ``.grad``, ``h`` and ``M`` from
          :meth:`set_curvature`).

        The parameters hold ``mu`` afterwards, also when a draw raises.
        """
        check_groups(self.param_groups, "VOGN.step()")
        self._check_precision_scale("VOGN.step()")
        if closure is None:
            if self._pending_curv is None:
                raise ValueError(
                    "VOGN.step() without a closure needs the curvature of the mini-batch: call "
                    "set_curvature(h) after the backward pass (VOGNPlugin does this), or pass "
                    "a closure"
                )
            curv, self._pending_curv = self._pending_curv, None
            self.update(self._read_grad(), curv, self._pending_n)
            return None
        if not callable(closure):
            raise TypeError(
                "VOGN.step takes a closure (zero the gradients, compute the mean loss of "
                "model(x), call backward(), return the loss) or nothing, got "
                f"{type(closure).__name__}"
            )
        return self._step_closure(closure)

    @contextmanager
    def extra_term(self) -> Iterator[None]:
        """Inside a closure: calls of the model in this block belong to a term of the
        objective besides the data's mean loss (e.g. FROMP's function-space regulariser on
        memorable points, on the scale of the mean per-example loss): its gradient enters
        ``g`` through ``.grad``, never the curvature ``h``, and its rows are not examples."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _named_to_flat(self, named: Tensor) -> Tensor:
        """A ``[P]`` vector in the model's ``named_parameters()`` order (trainable) in the
        optimizer's order (parameter groups)."""
        assert self.model is not None
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        params = self.params
        if [id(p) for p in trainable] == [id(p) for p in params]:
            return named
        if {id(p) for p in trainable} != {id(p) for p in params} or len(trainable) != len(params):
            raise ValueError("model's trainable parameters must be exactly the optimizer's")
        parts = dict(zip(map(id, trainable), named.split([p.numel() for p in trainable])))
        return torch.cat([parts[id(p)] for p in params])

    def _curvature_of(
        self, outputs: OutputCapture | None, layers: LayerCapture | None
    ) -> tuple[Tensor, int | None]:
        """``(h, M)`` of the closure just run, at the weights the parameters hold: the ``h``
        given to :meth:`set_curvature`, else from the layer capture (one call of the model,
        no extra term), else from the recorded calls' per-example Jacobians."""
        h, n_ex = self._pending_curv, self._pending_n
        self._pending_curv = None
        if h is not None:
            return h, n_ex
        if outputs is None:
            raise ValueError(
                "VOGN.step(closure) finds the per-example curvature from the model's calls: "
                "construct VOGN(model) or VOGN(param_groups, model=model) (or let the "
                "closure call set_curvature(h))"
            )
        n_ex = outputs.batch_size
        if layers is not None and len(outputs.calls) == 1 and not outputs.skipped:
            h = layers.squared_grads_of_mean_loss()
        if layers is not None:
            layers.calls, layers._outs = [], []
        if h is None:
            lik = self.likelihood if isinstance(self.likelihood, str | Likelihood) else None
            if self.hess_approx == "ggn" and lik is None:
                raise ValueError("VOGN: hess_approx='ggn' needs likelihood to be a Likelihood")
            named = outputs.curvature(lik, self.hess_approx, self.chunk_size)
            if named is None:
                raise ValueError(
                    "VOGN.step(closure): the loss reached no call of the model (the closure "
                    "must compute the mean loss of the model's outputs and call backward())"
                )
            h = self._named_to_flat(named)
        return h, n_ex

    def _step_closure(self, closure: Callable[[], Tensor]) -> Tensor:
        """``max(mc_samples, 1)`` draws; at each, the closure's gradient ``g`` and the
        per-example curvature ``h`` of the model calls it made (outside
        :meth:`extra_term`): from the layer inputs and output gradients when every layer is
        one :mod:`fromp.curvature.capture` handles, called once (``hess_approx="ef"``), else
        from the per-example Jacobians at the recorded calls (:class:`~fromp.optim._stats.
        OutputCapture`), or the ``h`` the closure gave to :meth:`set_curvature`."""
        draws = max(self.mc_samples, 1)
        g_acc = h_acc = loss_acc = None
        n_ex = None
        self._pending_curv = None
        model = self.model
        layers = None if model is None else LayerCapture(model, retain_grad=True)
        trainable = [] if model is None else [id(p) for p in model.parameters() if p.requires_grad]
        fast = (
            layers is not None
            and layers.supported
            and self.hess_approx == "ef"
            and trainable == [id(p) for p in self.params]  # same order: no reordering of h
        )
        for _ in range(draws):
            outputs = None if model is None else OutputCapture(model, lambda: self._paused > 0)
            with self.sampled_params(), torch.enable_grad():
                with outputs or nullcontext(), layers if fast else nullcontext():
                    for p in self.params:  # a closure that never calls backward(): None
                        p.grad = None
                    loss = closure()
                check_closure_result("VOGN", loss, self.params)
                h, n_ex = self._curvature_of(outputs, layers if fast else None)  # at w
            g = self._read_grad()
            self._pending_curv = None
            g_acc = g if g_acc is None else g_acc + g
            h_acc = h if h_acc is None else h_acc + h
            loss = torch.as_tensor(loss).detach()
            loss_acc = loss if loss_acc is None else loss_acc + loss
        assert g_acc is not None and h_acc is not None and loss_acc is not None
        if draws > 1:
            g_acc, h_acc = g_acc / draws, h_acc / draws
        self.update(g_acc, h_acc, n_ex)
        return loss_acc / draws

    # ---------------------------------------------------------------- (de)serialisation
    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict: ``"state"`` (per parameter index: ``"mean"``
        ``mu``, ``"momentum"`` ``m``, ``"hess"`` ``s``, ``"prior_mean"``,
        ``"prior_precision"``, ``"step"`` and, with ``hess_init``, ``"hess_init"``, all
        shaped like the parameter) and ``"param_groups"`` (with ``"ess"``). The tensors are
        the live ones, as torch's (copy them to keep them)."""
        self._states()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`, refused before any change when it does not fit;
        writes ``mu`` into the parameters."""
        # refuse before anything is replaced: torch's load overwrites the groups
        groups = state_dict.get("param_groups", [])
        check_groups(groups, "VOGN.load_state_dict")
        for g in groups:
            if g.get("ess") is not None:
                check_ess(g["ess"])
        state = state_dict.get("state", {})
        check_param_state(state, self.params, _REQUIRED, "VOGN")
        for i, st in state.items():
            d = st["prior_precision"].reshape(-1)  # its shape: check_param_state's
            name = f"VOGN state[{i}]['prior_precision']"
            check_prior_precision(d, sizes={"numel": len(d)}, name=name)
        super().load_state_dict(state_dict)
        self._own_state_copies()
        self._group_priors = [g.get("prior_precision") for g in self.param_groups]
        self._cache = None
        self._version += 1
        self.load_mean()


class OGN(VOGN):
    """Online Gauss-Newton: :class:`VOGN` without sampling (``mc_samples=0``)."""

    def __init__(self, params_or_model: nn.Module | Iterable[Tensor], **kwargs: Any) -> None:
        if kwargs.get("mc_samples", 0) != 0:
            raise ValueError("OGN does not sample: mc_samples must be 0 (use VOGN)")
        kwargs["mc_samples"] = 0
        super().__init__(params_or_model, **kwargs)


def minibatch_curvature(
    model: nn.Module, x: Tensor, y: Tensor, task_labels: Tensor | None, opt: VOGN
) -> Tensor:
    """``h = (1/M) sum_i h_i`` ``[P]`` of the data loss on a mini-batch at the model's
    current weights, examples grouped by task label (each group through its head,
    :func:`fromp.models.with_task`): what a loop that does not call :meth:`VOGN.step` hands
    to :meth:`VOGN.set_curvature`.

    Args:
        model: a fromp model or an Avalanche ``MultiTaskModule``; its parameters must be
            those of ``opt`` in the same order.
        x: ``[M, ...]``. y: ``[M]``. task_labels: ``[M]`` or None (single head).
        opt: supplies the likelihood, the curvature type and the chunk size.
    """
    from fromp.models import is_multitask, with_task

    multi = is_multitask(model)  # fromp multi-head models and Avalanche MultiTaskModules
    if not multi or task_labels is None:
        if multi:
            raise ValueError("task_labels are required for a multi-head model")
        groups = [(None, slice(None))]
    else:
        groups = [(int(t), task_labels == t) for t in torch.unique(task_labels)]
    total = None
    for t, rows in groups:
        stats = per_example_grad_stats(
            with_task(model, t),
            x[rows],
            y[rows],
            opt.likelihood,
            hess_approx=opt.hess_approx,
            chunk_size=opt.chunk_size,
            method=opt.method,
            need_grad=False,
        )
        part = stats.curv * stats.batch_size
        total = part if total is None else total + part
    assert total is not None
    return total / len(x)


def recorded_curvature(outputs: OutputCapture, f: Tensor, y: Tensor, opt: VOGN) -> Tensor:
    """``h`` of the data loss ``opt.loss_fn(f, y)`` at the output ``f`` of a forward call
    ``outputs`` recorded (whatever else was back-propagated): per-example output gradients
    of that loss, per-example Jacobians of the same call (its task labels, heads and
    padding; :class:`fromp.optim._stats.OutputCapture`). Other calls of the model inside the
    recording (e.g. on memorable points) are left out."""
    outputs.calls = [c for c in outputs.calls if c[2] is f][:1]
    if not outputs.calls:
        raise ValueError("f is not the output of a recorded call")
    fd = f.detach().requires_grad_(True)
    with torch.enable_grad():
        losses = opt.loss_fn(fd, y)
        (r,) = torch.autograd.grad(losses.sum(), fd)
    lik = opt.likelihood if opt.hess_approx == "ggn" else None
    named = outputs.curvature(lik, opt.hess_approx, opt.chunk_size, output_grads=[r])  # at w
    assert named is not None
    return opt._named_to_flat(named) if opt.model is not None else named
