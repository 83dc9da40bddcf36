"""Choosing the prior precision ``delta`` of a fitted :class:`fromp.laplace.base.BaseLaplace`
(laplace-torch's ``optimize_prior_precision``): by the Laplace evidence (laplace-torch's Adam
steps by default, or L-BFGS to the optimum with ``optimizer="lbfgs"``) or by a validation
grid search."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

import fromp.laplace.checks as checks
from fromp.curvature.diagonal import DataArg
from fromp.laplace.options import option
from fromp.likelihood import BernoulliLikelihood

__all__ = ["PriorTuning"]


class PriorTuning:
    """``optimize_prior_precision`` and its helpers; needs the evidence
    (``log_marginal_likelihood_at``, ``log_det_ratio_at``) and the predictive of the
    class."""

    def optimize_prior_precision(
        self,
        pred_type: str = "glm",
        method: str = "marglik",
        n_steps: int | None = None,
        lr: float = 0.1,
        init_prior_prec: float | Tensor | None = None,
        prior_structure: str = "scalar",
        val_loader: DataArg | None = None,
        loss: Any = None,
        log_prior_prec_min: float = -4.0,
        log_prior_prec_max: float = 4.0,
        grid_size: int = 100,
        link_approx: str = "probit",
        n_samples: int = 100,
        verbose: bool = False,
        progress_bar: bool = False,
        log_prior_prec_base: float = 10.0,
        optimizer: str = "adam",
    ) -> Tensor:
        """Choose ``delta``; sets and returns it (laplace-torch's arguments, in its order).

        * ``method="marglik"``: maximise the evidence in ``log delta``.
          ``optimizer="adam"`` (default, laplace-torch's procedure and numbers): ``n_steps``
          (default 100) Adam steps of rate ``lr`` from ``init_prior_prec`` (default 1), which
          may stop short of the optimum (0.5-4 % in ``delta`` on laplace-torch's examples).
          ``optimizer="lbfgs"``: to the optimum: L-BFGS with strong Wolfe line search, exact
          autograd gradients, at most ``n_steps`` (default 200) iterations, from the current
          ``delta`` (or ``init_prior_prec``); the result is kept only if its evidence is at
          least the starting one;
        * ``method="gridsearch"``: ``grid_size`` scalars ``log_prior_prec_base^t``, ``t``
          evenly spaced in ``[log_prior_prec_min, log_prior_prec_max]``, the one with the
          smallest validation loss on ``val_loader``: ``loss(preds, y)`` (classification),
          ``loss(mean, var, y)`` (regression), or by default the negative log predictive
          likelihood (laplace-torch's default for regression is the mean squared error).

        ``prior_structure``: ``"scalar"``, ``"layerwise"`` (one per parameter tensor) or
        ``"diag"`` (one per parameter; not for ``"kron"``). ``pred_type``, ``link_approx``,
        ``n_samples``: the predictive of the grid search. ``verbose`` prints the result;
        ``progress_bar`` is accepted and shows nothing.
        """
        pred_type, method = option(pred_type), option(method)
        prior_structure, link_approx = option(prior_structure), option(link_approx)
        if optimizer not in ("lbfgs", "adam"):
            raise ValueError(f"optimizer must be 'lbfgs' or 'adam', got {optimizer!r}")
        val_groups = checks.at_prior_search(
            self,
            method,
            prior_structure,
            100 if n_steps is None else n_steps,
            grid_size,
            val_loader,
        )
        if method == "gridsearch":
            grid = torch.logspace(log_prior_prec_min, log_prior_prec_max, grid_size,
                                  base=log_prior_prec_base, dtype=self._mu.dtype)  # fmt: skip
            out = self._gridsearch(val_groups, grid, pred_type, link_approx, n_samples, loss)
        elif optimizer == "adam":
            out = self._marglik_adam(100 if n_steps is None else n_steps, lr,
                                     1.0 if init_prior_prec is None else init_prior_prec,
                                     prior_structure)  # fmt: skip
        else:
            out = self._marglik_lbfgs(200 if n_steps is None else n_steps, init_prior_prec,
                                      prior_structure)  # fmt: skip
        if verbose:
            print(f"Optimized prior precision is {self.prior_precision}.")
        return out

    def _start(self, init: float | Tensor | None, prior_structure: str) -> Tensor:
        """The starting ``delta`` in the shape of ``prior_structure``."""
        shapes = {"scalar": (), "layerwise": (self.n_layers,), "diag": (self.num_params,)}
        if prior_structure not in shapes:
            raise ValueError(
                f"prior_structure must be 'scalar', 'layerwise' or 'diag', got {prior_structure!r}"
            )
        self._check_prior_structure(prior_structure)
        self.log_likelihood  # noqa: B018  (fails early without a fit or targets)
        start = self._check_delta(self._delta if init is None else init).detach()
        if prior_structure == "diag":
            return self._delta_vector(start).clone()
        if prior_structure == "layerwise":
            start = start.expand(self.n_layers).clone() if start.ndim == 0 else start
            if len(start) != self.n_layers:  # a [P] start
                raise ValueError("init_prior_prec of shape [P] needs prior_structure='diag'")
            return start
        return start.mean() if start.ndim != 0 else start

    def _marglik_adam(self, n_steps: int, lr: float, init: Any, prior_structure: str) -> Tensor:
        """laplace-torch's marglik: Adam on ``log delta``."""
        log_d = self._start(init, prior_structure).log().clone().requires_grad_(True)
        opt = torch.optim.Adam([log_d], lr=lr)
        for _ in range(n_steps):
            opt.zero_grad()
            (-self.log_marginal_likelihood_at(log_d.exp())).backward()
            opt.step()
        self.prior_precision = log_d.detach().exp()
        return self.prior_precision

    def _marglik_lbfgs(self, n_steps: int, init: Any, prior_structure: str) -> Tensor:
        start = self._start(init, prior_structure)
        with torch.no_grad():
            before = self.log_marginal_likelihood_at(start)
        free = self._identifiable(start)
        log_d = start.log().clone().requires_grad_(True)
        opt = torch.optim.LBFGS(
            [log_d], lr=1.0, max_iter=n_steps, line_search_fn="strong_wolfe",
            tolerance_grad=1e-10, tolerance_change=1e-14,
        )  # fmt: skip

        def closure() -> Tensor:
            opt.zero_grad()
            loss = -self.log_marginal_likelihood_at(torch.where(free, log_d.exp(), start))
            loss.backward()
            return loss

        opt.step(closure)
        best = torch.where(free, log_d.detach().exp(), start)
        with torch.no_grad():
            after = self.log_marginal_likelihood_at(best)
        self.prior_precision = best if bool(after >= before) else start
        return self.prior_precision

    def _identifiable(self, delta: Tensor) -> Tensor:
        """Which entries of a layerwise / per-parameter ``delta`` the evidence determines
        (bool, ``delta``'s shape). A tensor no fitted example reached (another task's head) has
        no curvature: its part of the log-determinant ratio is zero, so the evidence,
        ``-delta_l |theta_l - m0_l|^2 / 2``, grows without bound as ``delta_l -> 0``. Found as
        a derivative of the ratio that is zero next to the prior's ``n_l / delta_l``."""
        probe = delta.detach().clone().requires_grad_(True)
        if delta.ndim == 0:
            return torch.ones_like(probe, dtype=torch.bool)
        with torch.enable_grad():
            (g,) = torch.autograd.grad(self.log_det_ratio_at(probe), probe)
            (n,) = torch.autograd.grad(self._delta_vector(probe).log().sum(), probe)
        return g.abs() > 1e-6 * n.abs()

    def _check_prior_structure(self, prior_structure: str) -> None:
        """Hook: a structure may refuse a prior structure."""

    def _gridsearch(self, groups, grid, pred_type, link_approx, n_samples, loss) -> Tensor:
        scores = []
        for d in grid:
            self.prior_precision = d
            outs, ys, nll = [], [], 0.0
            for mapping, x, y in ((m, x, y) for m, bs in groups for x, y in bs):
                with checks.on_mapping(self.model, mapping, self.dict_key_x):
                    out = self(x, pred_type=pred_type, link_approx=link_approx,
                               n_samples=n_samples)  # fmt: skip
                y = y.to(self._device())
                if loss is None:
                    nll += float(self._predictive_nll(out, y))
                outs.append(out)
                ys.append(y)
            if loss is not None:
                y = torch.cat(ys)
                if isinstance(outs[0], tuple):
                    mean, var = (torch.cat([o[i] for o in outs]) for i in range(2))
                    nll = float(loss(mean, var, y))
                else:
                    nll = float(loss(torch.cat(outs), y))
            scores.append(nll)
        self.prior_precision = grid[int(torch.tensor(scores).argmin())]
        return self.prior_precision

    def _predictive_nll(self, out: Any, y: Tensor) -> Tensor:
        if self.regression:
            mu, var = out
            yy = y.to(mu.dtype).reshape(mu.shape)
            v = torch.diagonal(var, dim1=-2, dim2=-1) + self._sigma**2
            return (0.5 * ((yy - mu) ** 2 / v + v.log() + math.log(2 * math.pi))).sum()
        probs = out.clamp_min(1e-12)
        if isinstance(self._lik, BernoulliLikelihood):
            yy = y.to(probs.dtype).reshape(probs.shape)
            return -(yy * probs.log() + (1 - yy) * (1 - probs).clamp_min(1e-12).log()).sum()
        return -probs.gather(1, y.long().reshape(-1, 1)).log().sum()
