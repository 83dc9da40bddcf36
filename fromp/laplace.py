"""Laplace approximations of a trained network's posterior over its flattened weights.

Around a (local) MAP estimate ``w*`` of ``-sum_n log p(y_n | f_w(x_n)) - log N(w | m0, D^-1)``
with prior precision ``D = diag(delta)``, the Laplace-GGN posterior is

    ``q(w) = N(w*, (G + D)^-1)``,  ``G = sum_n J_n^T Lambda(f_n) J_n``

(:mod:`fromp.ggn`). :func:`laplace` keeps only ``diag(G)`` (a :class:`DiagonalGaussian`,
any model size); :func:`laplace_full` keeps all of ``G`` (a :class:`FullGaussian`, small
models only). In continual learning the posterior after task ``t`` is the prior of task
``t + 1``; passing ``posterior=`` adds the new task's GGN to its precision, so that after
``T`` tasks the precision is ``sum_t G_t + D`` (one prior, every task's curvature).
The prior mean ``m0`` does not enter ``q``: it only moves ``w*``, which is taken as given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fromp.curvature import DataArg, diag_ggn, iter_batches
from fromp.ggn import ggn
from fromp.jacobian import flat_params
from fromp.likelihood import Likelihood
from fromp.posterior import DiagonalGaussian

__all__ = [
    "FullGaussian",
    "accumulate_ggn",
    "laplace",
    "laplace_full",
    "prior_precision_vector",
    "require_eval",
]


@dataclass
class FullGaussian:
    """``q(w) = N(mean, precision^{-1})`` with a dense ``[P, P]`` precision (small models).

    Attributes:
        mean: ``[P]``.
        precision: ``[P, P]``, symmetric positive definite.
    """

    mean: Tensor
    precision: Tensor

    def __post_init__(self) -> None:
        p = self.mean.shape[0] if self.mean.ndim == 1 else -1
        if self.mean.ndim != 1 or self.precision.shape != (p, p):
            raise ValueError(
                "mean must have shape [P] and precision [P, P], got "
                f"{tuple(self.mean.shape)} and {tuple(self.precision.shape)}"
            )
        if not torch.isfinite(self.mean).all():
            raise ValueError("mean has non-finite entries")
        if not torch.isfinite(self.precision).all():
            raise ValueError("precision has non-finite entries")
        chol, info = torch.linalg.cholesky_ex(0.5 * (self.precision + self.precision.T))
        if int(info) != 0:
            raise ValueError("precision must be symmetric positive definite")
        self._chol = chol

    @property
    def num_params(self) -> int:
        """``P``, the number of parameters."""
        return self.mean.numel()

    @property
    def precision_cholesky(self) -> Tensor:
        """Lower-triangular ``L [P, P]`` with ``precision = L L^T``."""
        return self._chol

    @property
    def covariance(self) -> Tensor:
        """``precision^{-1}`` ``[P, P]``."""
        return torch.cholesky_inverse(self._chol)

    @property
    def variance(self) -> Tensor:
        """Marginal variances ``diag(precision^{-1})`` ``[P]``."""
        return torch.diagonal(self.covariance)

    def whiten(self, jac: Tensor) -> Tensor:
        """``A = J L^{-T}`` ``[..., P]`` for ``J [..., P]``, so that ``A A^T = J Sigma J^T``."""
        flat = jac.reshape(-1, self.num_params)
        a_t = torch.linalg.solve_triangular(self._chol, flat.T, upper=False)
        return a_t.T.reshape(jac.shape)

    def log_det_precision(self) -> Tensor:
        """``log det(precision)`` (scalar tensor)."""
        return 2 * torch.log(torch.diagonal(self._chol)).sum()

    def sample(self, n: int | None = None, *, generator: torch.Generator | None = None) -> Tensor:
        """``w = mean + L^{-T} eps``: ``[P]`` when ``n`` is None, else ``[n, P]``."""
        shape = (1 if n is None else n, self.num_params)
        eps = torch.randn(
            shape, generator=generator, dtype=self.mean.dtype, device=self.mean.device
        )
        w = self.mean + torch.linalg.solve_triangular(self._chol.T, eps.T, upper=True).T
        return w[0] if n is None else w

    def to(self, *args: Any, **kwargs: Any) -> FullGaussian:
        """Move or cast mean and precision (``torch.Tensor.to`` arguments)."""
        return FullGaussian(self.mean.to(*args, **kwargs), self.precision.to(*args, **kwargs))

    def detach(self) -> FullGaussian:
        """The same Gaussian detached from the autograd graph."""
        return FullGaussian(self.mean.detach(), self.precision.detach())

    def state_dict(self) -> dict[str, Tensor]:
        """``{"mean": [P], "precision": [P, P]}`` for ``torch.save``."""
        return {"mean": self.mean, "precision": self.precision}

    @classmethod
    def from_state_dict(cls, state: dict[str, Tensor]) -> FullGaussian:
        """Rebuild from :meth:`state_dict`."""
        return cls(state["mean"], state["precision"])


def prior_precision_vector(prior_precision: float | Tensor, reference: Tensor) -> Tensor:
    """``delta`` as a ``[P]`` vector like ``reference``; ``prior_precision`` a positive scalar
    or a ``[P]`` tensor of positive entries."""
    p = reference.shape[0]
    if isinstance(prior_precision, bool) or not isinstance(prior_precision, int | float | Tensor):
        raise ValueError(
            "prior_precision must be a positive number or a [P] tensor, got "
            f"{type(prior_precision).__name__}"
        )
    delta = torch.as_tensor(prior_precision, dtype=reference.dtype, device=reference.device)
    if delta.ndim == 0:
        delta = delta.expand(p)
    if delta.shape != (p,):
        raise ValueError(
            f"prior_precision must be a scalar or have shape [P]=[{p}], got {tuple(delta.shape)}"
        )
    if not (torch.isfinite(delta).all() and (delta > 0).all()):
        raise ValueError("prior_precision must be finite and strictly positive")
    return delta.clone()


def require_eval(model: nn.Module) -> None:
    """Raise ValueError when batch norm or dropout layers of ``model`` are in training mode:
    per-example Jacobians (and the GGN, kernel, evidence built from them) need ``eval()``."""
    stochastic = (nn.modules.batchnorm._BatchNorm, nn.modules.dropout._DropoutNd)
    bad = [
        n or type(m).__name__
        for n, m in model.named_modules()
        if m.training and isinstance(m, stochastic)
    ]
    if bad:
        raise ValueError(
            f"model has batch-norm/dropout layers in training mode ({', '.join(bad[:3])}); "
            "call model.eval() first"
        )


def _checked_batches(data: DataArg):
    """``data``'s batches, refusing non-finite inputs (the GGN of NaN inputs is NaN)."""
    for x, y in iter_batches(data):
        if not isinstance(x, Tensor):
            raise ValueError(f"data inputs must be tensors, got {type(x).__name__}")
        if x.is_floating_point() and not torch.isfinite(x).all():
            raise ValueError("data inputs have non-finite entries (NaN or inf)")
        yield (x,) if y is None else (x, y)


def _check_prior_mean(prior_mean: Tensor | None, mean: Tensor) -> None:
    if prior_mean is not None and (
        not isinstance(prior_mean, Tensor) or prior_mean.shape != mean.shape
    ):
        shape = tuple(prior_mean.shape) if isinstance(prior_mean, Tensor) else prior_mean
        raise ValueError(
            f"prior_mean must be None or a [P]={tuple(mean.shape)} tensor, got {shape}"
        )


def accumulate_ggn(
    model: nn.Module,
    data: DataArg,
    likelihood: str | Likelihood,
    previous: Tensor | None = None,
    *,
    chunk_size: int = 32,
) -> Tensor:
    """``previous + diag(G)`` ``[P]``: a running sum of GGN diagonals over tasks
    (``previous`` None starts from zero)."""
    require_eval(model)
    g = diag_ggn(model, _checked_batches(data), likelihood, chunk_size=chunk_size)
    if previous is None:
        return g
    if previous.shape != g.shape:
        raise ValueError(f"previous must have shape [P]={tuple(g.shape)}, got {previous.shape}")
    return previous.to(g) + g


def laplace(
    model: nn.Module,
    data: DataArg,
    likelihood: str | Likelihood,
    prior_precision: float | Tensor | None,
    prior_mean: Tensor | None = None,
    *,
    posterior: DiagonalGaussian | None = None,
    chunk_size: int = 32,
) -> DiagonalGaussian:
    """Diagonal Laplace-GGN posterior ``N(w*, diag(diag(G) + delta)^{-1})``.

    Args:
        model: the trained network at ``w*`` (``[N, ...] -> [N, C]``; for a multi-head
            model pass :func:`fromp.models.with_task` ``(net, t)``); eval mode.
        data: the task's inputs (``x``, ``(x, y)`` or an iterable of batches); targets are
            not needed (the GGN uses the model's predictive ``Lambda(f)``).
        likelihood: a :class:`~fromp.likelihood.Likelihood` or its name.
        prior_precision: ``delta``, a positive scalar or ``[P]`` tensor. Ignored (may be
            None) when ``posterior`` is given: the prior is already in its precision.
        prior_mean: the prior mean ``m0`` ``[P]`` (default 0); it does not change the
            Laplace posterior (only ``w*`` depends on it) and is only checked for shape.
        posterior: a previous task's posterior; the result then has precision
            ``posterior.precision + diag(G)`` (continual-learning accumulation).
        chunk_size: examples per Jacobian chunk (memory ``chunk_size * C * P``).

    Returns:
        :class:`DiagonalGaussian` with ``mean = flat_params(model)`` ``[P]`` and
        ``precision [P]``.
    """
    require_eval(model)
    mean = flat_params(model).clone()
    _check_prior_mean(prior_mean, mean)
    g = diag_ggn(model, _checked_batches(data), likelihood, chunk_size=chunk_size)
    if posterior is not None:
        if not isinstance(posterior, DiagonalGaussian) or posterior.mean.shape != mean.shape:
            raise ValueError(
                f"posterior must be a DiagonalGaussian over P={mean.numel()} parameters"
            )
        return DiagonalGaussian(mean, posterior.precision.to(g) + g)
    if prior_precision is None:
        raise ValueError("prior_precision is required when no posterior is given")
    return DiagonalGaussian(mean, g + prior_precision_vector(prior_precision, mean))


def laplace_full(
    model: nn.Module,
    data: DataArg,
    likelihood: str | Likelihood,
    prior_precision: float | Tensor | None,
    prior_mean: Tensor | None = None,
    *,
    posterior: FullGaussian | None = None,
    chunk_size: int = 32,
    max_params: int = 20_000,
) -> FullGaussian:
    """Full-covariance Laplace-GGN posterior ``N(w*, (G + diag(delta))^{-1})`` of a SMALL
    model (``P <= max_params``; memory ``P^2``). Arguments as :func:`laplace`; with
    ``posterior`` (a :class:`FullGaussian`) the precision is ``posterior.precision + G``."""
    require_eval(model)
    mean = flat_params(model).clone()
    _check_prior_mean(prior_mean, mean)
    g = ggn(model, _checked_batches(data), likelihood, chunk_size=chunk_size, max_params=max_params)
    if posterior is not None:
        if not isinstance(posterior, FullGaussian) or posterior.mean.shape != mean.shape:
            raise ValueError(f"posterior must be a FullGaussian over P={mean.numel()} parameters")
        return FullGaussian(mean, posterior.precision.to(g) + g)
    if prior_precision is None:
        raise ValueError("prior_precision is required when no posterior is given")
    return FullGaussian(mean, g + torch.diag(prior_precision_vector(prior_precision, mean)))
