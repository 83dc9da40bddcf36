"""IVON's posterior and its continual prior (:class:`IVONPosterior`, a base of
:class:`fromp.optim.IVON`): ``q = N(m, diag(1 / (N (h + delta))))`` over the flat
parameters, the prior ``N(m0, diag(1 / p0))``, and :meth:`IVONPosterior.set_prior`, which
makes a posterior the next task's prior. See :mod:`fromp.optim.ivon` for the update."""

from __future__ import annotations

import torch
from torch import nn

from fromp._checks import check_prior_precision
from fromp.posterior import DiagonalGaussian

__all__ = ["IVONPosterior"]


class IVONPosterior:
    """The posterior and prior methods of :class:`fromp.optim.IVON` (they read its
    per-parameter state: ``momentum``, ``hess``, ``prior_mean``, ``prior_precision``)."""

    def _order(self, model: nn.Module | None) -> list[int]:
        """Positions of the parameters in flat order: group order, or ``model``'s
        ``named_parameters()`` order (its trainable parameters must be exactly these)."""
        params = self.params
        if model is None:
            return list(range(len(params)))
        where = {id(p): i for i, p in enumerate(params)}
        trainable = [p for p in model.parameters() if p.requires_grad]
        if {id(p) for p in trainable} != set(where) or len(trainable) != len(params):
            raise ValueError("model's trainable parameters must be exactly the optimizer's")
        return [where[id(p)] for p in trainable]

    @torch.no_grad()
    def posterior(self, model: nn.Module | None = None) -> DiagonalGaussian:
        """``q = N(m, diag(1 / (N (h + delta))))`` over the flat parameters ``[P]``.

        Args:
            model: flatten in ``model.named_parameters()`` order (what :func:`fromp.dnn2gp`
                and :func:`fromp.flat_params` use); None: parameter-group order.
        """
        if self._drawn:
            raise RuntimeError("IVON.posterior(): the parameters hold a draw; restore() first")
        states = self._states()
        pairs = list(self._pairs())
        means, precs = [], []
        for i in self._order(model):
            (group, p), st = pairs[i], states[i]
            means.append(p.detach().reshape(-1))
            prec = torch.add(st["hess"], self._delta(group, st)).mul_(group["ess"])
            precs.append(prec.reshape(-1))
        return DiagonalGaussian(torch.cat(means).clone(), torch.cat(precs))

    def prior(self, model: nn.Module | None = None) -> DiagonalGaussian:
        """The prior ``N(m0, diag(1 / p0))``: ``N(0, 1 / delta)`` before :meth:`set_prior`
        (``delta`` the group's ``prior_precision``, which must then be ``> 0``)."""
        states = self._states()
        pairs = list(self._pairs())
        means, precs = [], []
        for i in self._order(model):
            (group, p), st = pairs[i], states[i]
            m0 = st.get("prior_mean", torch.zeros_like(p))
            p0 = st.get("prior_precision")
            if p0 is None:  # 0 is allowed in training (no prior), not here
                name = "prior(): prior_precision (0: an improper prior)"
                p0 = torch.full_like(p, check_prior_precision(group["prior_precision"], name=name))
            means.append(m0.reshape(-1))
            precs.append(p0.reshape(-1))
        return DiagonalGaussian(torch.cat(means).clone(), torch.cat(precs).clone())

    @torch.no_grad()
    def set_prior(
        self,
        prior: DiagonalGaussian | None = None,
        *,
        model: nn.Module | None = None,
        reset: bool = True,
    ) -> DiagonalGaussian:
        """Make ``prior`` (default: the current posterior) the prior ``N(m0, diag(1/p0))``
        (continual IVON; ``delta = p0 / N`` from then on, the weight decay is no longer used).

        Args:
            prior: over the flat parameters ``[P]`` in ``model``'s order (group order when
                ``model`` is None).
            reset: restart the momentum, the step count and ``h`` (at ``hess_init``), as
                for a new task; the mean is kept.

        Returns the new prior.
        """
        if self._drawn:
            raise RuntimeError("IVON.set_prior(): the parameters hold a draw; restore() first")
        prior = self.posterior(model) if prior is None else prior
        if not isinstance(prior, DiagonalGaussian):
            raise ValueError(f"prior must be a DiagonalGaussian, got {type(prior).__name__}")
        params = self.params
        total = sum(p.numel() for p in params)
        if prior.num_params != total:
            raise ValueError(f"prior must have P={total} entries, got {prior.num_params}")
        states = self._states()
        offsets, i = {}, 0
        for k in self._order(model):
            offsets[k] = i
            i += params[k].numel()
        for k, ((group, p), st) in enumerate(zip(self._pairs(), states)):
            s = slice(offsets[k], offsets[k] + p.numel())
            st["prior_mean"] = prior.mean[s].detach().to(p).view_as(p).clone()
            st["prior_precision"] = prior.precision[s].detach().to(p).view_as(p).clone()
            if reset:
                st["momentum"].zero_()
                st["hess"].fill_(group["hess_init"])
        if reset:
            for st in states:
                st["step"] = 0
        self._version += 1
        return self.prior(model)
