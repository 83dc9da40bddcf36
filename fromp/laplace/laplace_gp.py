"""The GP of a fitted Laplace: :class:`LaplaceGP` (``la.gp()`` for every structure), with
:class:`fromp.gp.GP`'s methods and predictive on the Laplace's own fast routes."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import fromp.laplace.checks as checks
from fromp.gp.process import GPPredictive
from fromp.likelihood import Likelihood

__all__ = ["LaplaceGP"]


class LaplaceGP(GPPredictive):
    """The GP of a fitted :class:`fromp.Laplace` (``la.gp()``, every structure; the one type
    ``gp()`` returns): :meth:`mean` ``f_w*(x)`` ``[N, C]``, :meth:`kernel` ``J(x1) Sigma
    J(x2)^T`` ``[N, C, M, C]``, :meth:`variance` ``[N, C, C]`` and :meth:`predictive`, with
    :class:`GP`'s signatures (the chunking arguments are the Laplace's own and are ignored
    here). :meth:`predictive` is :class:`fromp.gp.GPPredictive`'s, with the Laplace's
    ``sigma_noise`` (regression: ``(m, v + sigma_noise^2 I)``, the predictive of ``y``) and
    ``method="bridge"``, the Laplace bridge. Every call runs the Laplace's predict checks
    (:func:`fromp.laplace.checks.at_predict`)."""

    def __init__(self, la: Any) -> None:
        self.la = la

    @property
    def likelihood(self) -> Likelihood:
        return self.la.likelihood_fn

    @property
    def num_params(self) -> int:
        return self.la.num_params

    def mean(self, x: Tensor) -> Tensor:
        checks.at_predict(self.la, x)
        x = x.to(self.la._device())
        step = self.la._forward_step(x)  # forward passes within the Laplace's memory budget
        with torch.no_grad():
            return torch.cat([self.la.model(x[s : s + step]) for s in range(0, len(x), step)])

    def variance(self, x: Tensor, *, chunk_size: int | None = None, method: str = "auto") -> Tensor:
        return self.la.functional_variance_at(x.to(self.la._device()))

    def kernel(self, x1: Tensor, x2: Tensor | None = None, **unused: Any) -> Tensor:
        checks.at_predict(self.la, x1)
        if x2 is not None:
            checks.at_predict(self.la, x2)
        dev = self.la._device()
        x1 = x1.to(dev)
        return self.la._kernel_chunked(x1, x1 if x2 is None else x2.to(dev))

    def _sigma_noise(self) -> float:
        return float(self.la.sigma_noise)

    def _own_predictive(self, x: Tensor, method: str) -> Tensor | None:
        """``method="bridge"``: the Laplace bridge (``la(x, link_approx="bridge")``)."""
        return self.la(x, link_approx="bridge") if method == "bridge" else None
