"""Gaussian posteriors over a network's flattened parameters.

:class:`DiagonalGaussian` ``N(mean, diag(1 / precision))`` is what the Laplace
approximation (:func:`fromp.laplace`), VOGN, IVON and the FROMP regulariser exchange;
:class:`FullGaussian` ``N(mean, precision^{-1})`` keeps a dense ``[P, P]`` precision
(:func:`fromp.fit_laplace` with ``hessian_structure="full"``, small models only). All vectors
are ``[P]``, parameters flattened in ``named_parameters()`` order.

Both are immutable: setting or deleting an attribute raises
:class:`dataclasses.FrozenInstanceError`; :meth:`~DiagonalGaussian.replace` builds a new
posterior (validated, and for :class:`FullGaussian` with a new Cholesky factor), so no cached
factor can go stale. The tensors are owned by the posterior: editing them in place is not
supported. Both satisfy :class:`GaussianPosterior`, the small protocol :class:`fromp.GP`, the
FROMP regulariser and the optimisers' ``posterior()`` are typed against.
"""

from __future__ import annotations

import dataclasses
from dataclasses import FrozenInstanceError, dataclass, field
from typing import Any, Protocol, Self, TypeVar, runtime_checkable

import torch
from torch import Tensor, nn

from fromp._checks import check_finite
from fromp.likelihood import randn_like_on

__all__ = ["DiagonalGaussian", "FullGaussian", "GaussianPosterior"]

_G = TypeVar("_G")


@runtime_checkable
class GaussianPosterior(Protocol):
    """A Gaussian ``q(w) = N(mean, Sigma)`` over ``P`` flattened parameters.

    What :class:`fromp.GP` (kernels ``J Sigma J^T = A A^T`` with ``A = whiten(J)``), the FROMP
    regulariser and the optimisers' predictive helpers need of a posterior.
    """

    @property
    def mean(self) -> Tensor:
        """``[P]``."""
        ...

    @property
    def num_params(self) -> int:
        """``P``."""
        ...

    @property
    def variance(self) -> Tensor:
        """Marginal variances ``diag(Sigma)`` ``[P]``."""
        ...

    def whiten(self, jac: Tensor) -> Tensor:
        """``A = J Sigma^{1/2}`` ``[..., P]`` for ``J [..., P]``: ``A A^T = J Sigma J^T``."""
        ...

    def log_det_precision(self) -> Tensor:
        """``log det(Sigma^{-1})`` (scalar tensor)."""
        ...

    def sample(self, n: int | None = None, *, generator: torch.Generator | None = None) -> Tensor:
        """``[P]`` when ``n`` is None, else ``[n, P]``."""
        ...

    def replace(self: _G, **changes: Tensor) -> _G:
        """A new posterior with some fields replaced (``mean=``, ``precision=``)."""
        ...

    def to(self: _G, *args: Any, **kwargs: Any) -> _G:
        """Moved or cast (``torch.Tensor.to`` arguments)."""
        ...

    def detach(self: _G) -> _G:
        """Detached from the autograd graph."""
        ...

    def state_dict(self) -> dict[str, Tensor]:
        """Tensors for ``torch.save``."""
        ...


def _immutable(cls: type[_G]) -> type[_G]:
    """Make a frozen dataclass say how to change it: ``.replace(name=...)``."""

    def __setattr__(self: Any, name: str, value: Any) -> None:
        raise FrozenInstanceError(
            f"{type(self).__name__} is immutable: cannot set .{name}; build a new one with "
            f".replace({name}=...)"
        )

    def __delattr__(self: Any, name: str) -> None:
        raise FrozenInstanceError(f"{type(self).__name__} is immutable: cannot delete .{name}")

    cls.__setattr__ = __setattr__  # type: ignore[method-assign,assignment]
    cls.__delattr__ = __delattr__  # type: ignore[method-assign,assignment]
    return cls


class _Gaussian:
    """What both Gaussians share: ``P``, :meth:`replace`, ``to``/``detach``, state dicts."""

    mean: Tensor
    precision: Tensor

    def __init__(self, mean: Tensor, precision: Tensor) -> None:  # replaced by the dataclass
        raise NotImplementedError

    @property
    def num_params(self) -> int:
        """``P``, the number of parameters."""
        return self.mean.numel()

    def replace(self, **changes: Tensor) -> Self:
        """A new, validated posterior with the given fields (``mean=``, ``precision=``)
        replaced; ``self`` is unchanged."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    def with_precision(self, precision: Tensor) -> Self:
        """``replace(precision=precision)``."""
        return self.replace(precision=precision)

    def to(self, *args: Any, **kwargs: Any) -> Self:
        """Move or cast mean and precision (``torch.Tensor.to`` arguments)."""
        return type(self)(self.mean.to(*args, **kwargs), self.precision.to(*args, **kwargs))

    def detach(self) -> Self:
        """The same Gaussian detached from the autograd graph."""
        return type(self)(self.mean.detach(), self.precision.detach())

    def state_dict(self) -> dict[str, Tensor]:
        """``{"mean": [P], "precision": [P] or [P, P]}`` for ``torch.save``."""
        return {"mean": self.mean, "precision": self.precision}

    @classmethod
    def from_state_dict(cls, state: dict[str, Tensor]) -> Self:
        """Rebuild from :meth:`state_dict`."""
        return cls(state["mean"], state["precision"])


@_immutable
@dataclass(frozen=True, eq=False)
class DiagonalGaussian(_Gaussian):
    """``q(w) = N(mean, diag(precision)^{-1})`` over ``P`` flattened parameters (immutable).

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
        check_finite(self.mean, "mean")
        check_finite(self.precision, "precision")
        if not bool((self.precision > 0).all()):
            raise ValueError("precision must be finite and strictly positive")

    @property
    def variance(self) -> Tensor:
        """``1 / precision`` ``[P]``."""
        return self.precision.reciprocal()

    @property
    def std(self) -> Tensor:
        """``precision^{-1/2}`` ``[P]``."""
        return self.precision.rsqrt()

    def whiten(self, jac: Tensor) -> Tensor:
        """``A = J * std`` ``[..., P]`` for ``J [..., P]`` (``std`` cast to ``jac``'s dtype and
        device), so that ``A A^T = J diag(1 / precision) J^T``."""
        return jac * self.std.to(jac)

    def log_det_precision(self) -> Tensor:
        """``sum log precision`` (scalar tensor)."""
        return self.precision.log().sum()

    def sample(self, n: int | None = None, *, generator: torch.Generator | None = None) -> Tensor:
        """Draw ``w = mean + std * eps``: ``[P]`` when ``n`` is None, else ``[n, P]``."""
        shape = (self.num_params,) if n is None else (n, self.num_params)
        eps = randn_like_on(shape, generator, self.mean.dtype, self.mean.device)
        return self.mean + self.std * eps

    def kl(self, other: DiagonalGaussian) -> Tensor:
        """``KL(self || other)`` for two diagonal Gaussians (a scalar tensor)."""
        if other.mean.shape != self.mean.shape:
            raise ValueError(f"other has {other.num_params} parameters, self has {self.num_params}")
        var_ratio = other.precision / self.precision
        diff = self.mean - other.mean
        return 0.5 * (var_ratio + other.precision * diff**2 - 1 - var_ratio.log()).sum()

    @classmethod
    def isotropic(
        cls, model_or_mean: nn.Module | Tensor, precision: float | Tensor
    ) -> DiagonalGaussian:
        """``N(m, precision^{-1} I)`` with ``m`` the model's current parameters (or a given
        ``[P]`` mean); ``precision`` a positive scalar or a ``[P]`` tensor."""
        if isinstance(model_or_mean, nn.Module):
            from fromp.curvature.jacobian import flat_params

            mean = flat_params(model_or_mean)
        else:
            mean = model_or_mean.detach()
        prec = torch.as_tensor(precision, dtype=mean.dtype, device=mean.device)
        return cls(mean.clone(), prec.expand_as(mean).clone())


@_immutable
@dataclass(frozen=True, eq=False)
class FullGaussian(_Gaussian):
    """``q(w) = N(mean, precision^{-1})`` with a dense ``[P, P]`` precision (small models;
    immutable, so its Cholesky factor, computed once, always matches ``precision``).

    Attributes:
        mean: ``[P]``.
        precision: ``[P, P]``, symmetric positive definite.
    """

    mean: Tensor
    precision: Tensor
    _chol: Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        p = self.mean.shape[0] if self.mean.ndim == 1 else -1
        if self.mean.ndim != 1 or self.precision.shape != (p, p):
            raise ValueError(
                "mean must have shape [P] and precision [P, P], got "
                f"{tuple(self.mean.shape)} and {tuple(self.precision.shape)}"
            )
        check_finite(self.mean, "mean")
        check_finite(self.precision, "precision")
        chol, info = torch.linalg.cholesky_ex(0.5 * (self.precision + self.precision.T))
        if int(info) != 0:
            raise ValueError("precision must be symmetric positive definite")
        object.__setattr__(self, "_chol", chol)

    @property
    def precision_cholesky(self) -> Tensor:
        """Lower-triangular ``L [P, P]`` with ``precision = L L^T``."""
        return self._chol

    def replace(self, **changes: Tensor) -> Self:
        """A new, validated posterior with the given fields replaced; with ``mean=`` alone
        the precision and its Cholesky factor are shared, not factorised again (``O(P)``
        instead of ``O(P^3)``: a predictive linearised at other weights)."""
        if set(changes) != {"mean"}:
            return super().replace(**changes)
        return self._around(changes["mean"], self.precision, self._chol)

    def detach(self) -> Self:
        """The same Gaussian detached from the autograd graph (its factor detached, not
        computed again)."""
        return self._around(self.mean.detach(), self.precision.detach(), self._chol.detach())

    def _around(self, mean: Tensor, precision: Tensor, chol: Tensor) -> Self:
        """``N(mean, precision^{-1})`` with ``chol`` (``precision``'s factor, already
        computed) as its factor; ``mean`` checked as :meth:`__post_init__` does."""
        if mean.shape != self.mean.shape:
            raise ValueError(
                f"mean must have shape [P] = {tuple(self.mean.shape)}, got {tuple(mean.shape)}"
            )
        check_finite(mean, "mean")
        new = object.__new__(type(self))
        for name, value in (("mean", mean), ("precision", precision), ("_chol", chol)):
            object.__setattr__(new, name, value)
        return new

    @property
    def covariance(self) -> Tensor:
        """``precision^{-1}`` ``[P, P]``."""
        return torch.cholesky_inverse(self._chol)

    @property
    def variance(self) -> Tensor:
        """Marginal variances ``diag(precision^{-1})`` ``[P]``."""
        return torch.diagonal(self.covariance)

    def whiten(self, jac: Tensor) -> Tensor:
        """``A = J L^{-T}`` ``[..., P]`` for ``J [..., P]``, so that ``A A^T = J Sigma J^T``
        (``L`` cast to ``jac``'s dtype and device)."""
        flat = jac.reshape(-1, self.num_params)
        a_t = torch.linalg.solve_triangular(self._chol.to(flat), flat.T, upper=False)
        return a_t.T.reshape(jac.shape)

    def log_det_precision(self) -> Tensor:
        """``log det(precision)`` (scalar tensor)."""
        return 2 * torch.log(torch.diagonal(self._chol)).sum()

    def sample(self, n: int | None = None, *, generator: torch.Generator | None = None) -> Tensor:
        """``w = mean + L^{-T} eps``: ``[P]`` when ``n`` is None, else ``[n, P]``."""
        shape = (1 if n is None else n, self.num_params)
        eps = randn_like_on(shape, generator, self.mean.dtype, self.mean.device)
        w = self.mean + torch.linalg.solve_triangular(self._chol.T, eps.T, upper=True).T
        return w[0] if n is None else w
