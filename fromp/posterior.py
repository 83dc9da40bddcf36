"""Gaussian posteriors over a network's flattened parameters.

:class:`DiagonalGaussian` ``N(mean, diag(1 / precision))`` is what the Laplace
approximation (:func:`fromp.laplace`), VOGN and the FROMP regulariser exchange: all vectors
are ``[P]``, parameters flattened in ``named_parameters()`` order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["DiagonalGaussian"]


@dataclass
class DiagonalGaussian:
    """``q(w) = N(mean, diag(precision)^{-1})`` over ``P`` flattened parameters.

    Attributes:
        mean: ``[P]``.
        precision: ``[P]``, strictly positive.
    """

    mean: Tensor
    precision: Tensor

    def __post_init__(self) -> None:
        if self.mean.ndim != 1 or self.mean.shape != self.precision.shape:
            raise ValueError(
                "mean and precision must both have shape [P], got "
                f"{tuple(self.mean.shape)} and {tuple(self.precision.shape)}"
            )
        if not torch.isfinite(self.mean).all():
            raise ValueError("mean has non-finite entries")
        if not (torch.isfinite(self.precision).all() and (self.precision > 0).all()):
            raise ValueError("precision must be finite and strictly positive")

    @property
    def num_params(self) -> int:
        """``P``, the number of parameters."""
        return self.mean.numel()

    @property
    def variance(self) -> Tensor:
        """``1 / precision`` ``[P]``."""
        return self.precision.reciprocal()

    @property
    def std(self) -> Tensor:
        """``precision^{-1/2}`` ``[P]``."""
        return self.precision.rsqrt()

    def sample(self, n: int | None = None, *, generator: torch.Generator | None = None) -> Tensor:
        """Draw ``w = mean + std * eps``: ``[P]`` when ``n`` is None, else ``[n, P]``."""
        shape = (self.num_params,) if n is None else (n, self.num_params)
        eps = torch.randn(
            shape, generator=generator, dtype=self.mean.dtype, device=self.mean.device
        )
        return self.mean + self.std * eps

    def kl(self, other: DiagonalGaussian) -> Tensor:
        """``KL(self || other)`` for two diagonal Gaussians (a scalar tensor)."""
        if other.mean.shape != self.mean.shape:
            raise ValueError(f"other has {other.num_params} parameters, self has {self.num_params}")
        var_ratio = other.precision / self.precision
        diff = self.mean - other.mean
        return 0.5 * (var_ratio + other.precision * diff**2 - 1 - var_ratio.log()).sum()

    def to(self, *args: Any, **kwargs: Any) -> DiagonalGaussian:
        """Move or cast both vectors (``torch.Tensor.to`` arguments)."""
        return DiagonalGaussian(self.mean.to(*args, **kwargs), self.precision.to(*args, **kwargs))

    def detach(self) -> DiagonalGaussian:
        """The same Gaussian with both vectors detached from the autograd graph."""
        return DiagonalGaussian(self.mean.detach(), self.precision.detach())

    def state_dict(self) -> dict[str, Tensor]:
        """``{"mean": [P], "precision": [P]}`` for ``torch.save``."""
        return {"mean": self.mean, "precision": self.precision}

    @classmethod
    def from_state_dict(cls, state: dict[str, Tensor]) -> DiagonalGaussian:
        """Rebuild from :meth:`state_dict`."""
        return cls(state["mean"], state["precision"])

    @classmethod
    def isotropic(
        cls, model_or_mean: nn.Module | Tensor, precision: float | Tensor
    ) -> DiagonalGaussian:
        """``N(m, precision^{-1} I)`` with ``m`` the model's current parameters (or a given
        ``[P]`` mean); ``precision`` a positive scalar or a ``[P]`` tensor."""
        if isinstance(model_or_mean, nn.Module):
            from fromp.jacobian import flat_params

            mean = flat_params(model_or_mean)
        else:
            mean = model_or_mean.detach()
        prec = torch.as_tensor(precision, dtype=mean.dtype, device=mean.device)
        return cls(mean.clone(), prec.expand_as(mean).clone())
