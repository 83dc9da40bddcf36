"""Likelihoods and their output Hessians ``Lambda(f) = d^2 loss / d f^2``.

The loss is the negative log-likelihood ``-log p(y | f)`` of outputs ``f [N, C]``. For the
generalised Gauss-Newton matrix ``sum_n J_n^T Lambda_n J_n`` only ``Lambda`` is needed, and
to avoid loops over classes every likelihood also gives a square root ``L`` with
``Lambda = L L^T`` so that ``J^T Lambda J = (L^T J)^T (L^T J)``.

=================  ====================  ==========================  =====================
name               ``p(y | f)``          ``Lambda(f)``               ``L`` (``[N, C, C]``)
=================  ====================  ==========================  =====================
``"categorical"``  softmax(f)_y          ``diag(p) - p p^T``         ``diag(sqrt p) - p sqrt(p)^T``
``"bernoulli"``    sigmoid(f) (C = 1)    ``p (1 - p)``               ``sqrt(p (1 - p))``
``"gaussian"``     N(y; f, sigma^2 I)    ``I / sigma^2``             ``I / sigma``
=================  ====================  ==========================  =====================
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import Tensor


def randn_like_on(
    shape: tuple[int, ...],
    generator: torch.Generator | None,
    dtype: torch.dtype,
    device: torch.device,
) -> Tensor:
    """Standard normal draws of ``shape`` on ``device``: drawn on the generator's device (so
    a CPU generator works with CUDA tensors and a CUDA generator with CUDA tensors, each
    drawing where it lives, with no silent fallback), then moved to ``device``."""
    where = device if generator is None else generator.device
    return torch.randn(shape, generator=generator, dtype=dtype, device=where).to(device)


def _on_generator(t: Tensor, generator: torch.Generator | None) -> Tensor:
    return t if generator is None else t.to(generator.device)


__all__ = [
    "BernoulliLikelihood",
    "CategoricalLikelihood",
    "GaussianLikelihood",
    "Likelihood",
    "get_likelihood",
]


def _check_f(f: Tensor) -> None:
    if f.ndim != 2:
        raise ValueError(f"f must have shape [N, C], got {tuple(f.shape)}")


class Likelihood(ABC):
    """An observation model ``p(y | f)`` for network outputs ``f [N, C]``."""

    name: str = ""

    @abstractmethod
    def nll(self, f: Tensor, y: Tensor) -> Tensor:
        """Per-example negative log-likelihood ``[N]``."""

    @abstractmethod
    def hessian(self, f: Tensor) -> Tensor:
        """``Lambda(f) [N, C, C]``, the Hessian of ``nll`` with respect to ``f``."""

    @abstractmethod
    def sqrt_hessian(self, f: Tensor) -> Tensor:
        """``L [N, C, K]`` with ``Lambda = L L^T``."""

    @abstractmethod
    def inverse_link(self, f: Tensor) -> Tensor:
        """The mean of ``y`` given ``f`` (probabilities for classification) ``[N, C]``."""

    @abstractmethod
    def sample(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Targets drawn from ``p(y | f)`` (for the sampled-label Fisher)."""

    def check_targets(self, y: Tensor, n_outputs: int, name: str = "y") -> Tensor:
        """``y`` unchanged when it is a valid target batch for outputs ``[N, n_outputs]``,
        else ``ValueError`` naming ``name`` and what was expected (run before any work).
        The base class accepts any tensor; the likelihoods below check theirs."""
        return y

    def hessian_trace(self, f: Tensor) -> Tensor:
        """``tr Lambda(f) [N]``: FROMP's memorability score."""
        return torch.diagonal(self.hessian(f), dim1=-2, dim2=-1).sum(-1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class CategoricalLikelihood(Likelihood):
    """Softmax cross-entropy; ``y`` holds class indices ``[N]``."""

    name = "categorical"

    def check_targets(self, y: Tensor, n_outputs: int, name: str = "y") -> Tensor:
        """Class indices ``[N]`` (integers, or integer-valued floats) in ``[0, C)``, and
        ``C >= 2`` (a softmax over one output is the constant 1)."""
        if n_outputs < 2:
            raise ValueError(
                f"a softmax (categorical / 'classification') likelihood needs C >= 2 outputs, "
                f"the model has C={n_outputs} (its softmax is always 1); for two classes with "
                "one output use likelihood='bernoulli'"
            )
        if y.ndim != 1:
            raise ValueError(
                f"{name} must be [N] class indices, got shape {tuple(y.shape)} (one-hot "
                "targets: pass y.argmax(-1))"
            )
        if y.is_floating_point() or y.is_complex():
            if not bool(torch.isfinite(y).all()) or not bool((y == y.round()).all()):
                raise ValueError(f"{name} must hold class indices; got fractional labels")
        if len(y) and (int(y.min()) < 0 or int(y.max()) >= n_outputs):
            raise ValueError(
                f"{name} must hold class indices in [0, C)=[0, {n_outputs}), got labels in "
                f"[{int(y.min())}, {int(y.max())}]"
            )
        return y

    def nll(self, f: Tensor, y: Tensor) -> Tensor:
        _check_f(f)
        if y.shape != f.shape[:1]:
            raise ValueError(f"y must be [N]=[{len(f)}] class indices, got {tuple(y.shape)}")
        if y.is_floating_point():
            if not bool((y == y.round()).all()):
                raise ValueError("y must hold class indices; got fractional labels")
        # indices out of range: cross_entropy raises (CPU) or asserts on the device (CUDA)
        return F.cross_entropy(f, y.long(), reduction="none")

    def hessian(self, f: Tensor) -> Tensor:
        _check_f(f)
        p = torch.softmax(f, dim=-1)
        return torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)

    def sqrt_hessian(self, f: Tensor) -> Tensor:
        # (diag(s) - p s^T)(diag(s) - s p^T) = diag(p) - 2 p p^T + p (s^T s) p^T, s^T s = 1.
        _check_f(f)
        p = torch.softmax(f, dim=-1)
        s = p.sqrt()
        return torch.diag_embed(s) - p.unsqueeze(-1) * s.unsqueeze(-2)

    def hessian_trace(self, f: Tensor) -> Tensor:
        _check_f(f)
        p = torch.softmax(f, dim=-1)
        return (p * (1 - p)).sum(-1)

    def inverse_link(self, f: Tensor) -> Tensor:
        return torch.softmax(f, dim=-1)

    def sample(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        p = _on_generator(torch.softmax(f, -1), generator)
        return torch.multinomial(p, 1, generator=generator).squeeze(-1).to(f.device)


class BernoulliLikelihood(Likelihood):
    """Sigmoid cross-entropy for one logit (``C = 1``); ``y`` in {0, 1}, shape ``[N]``."""

    name = "bernoulli"

    def _check(self, f: Tensor) -> None:
        _check_f(f)
        if f.shape[1] != 1:
            raise ValueError(f"bernoulli likelihood needs f of shape [N, 1], got {tuple(f.shape)}")

    def check_targets(self, y: Tensor, n_outputs: int, name: str = "y") -> Tensor:
        """Labels in ``{0, 1}``, ``[N]`` or ``[N, 1]``, for one output (``C = 1``)."""
        if n_outputs != 1:
            raise ValueError(
                f"the bernoulli likelihood needs one output (C = 1), the model has "
                f"C={n_outputs}; use likelihood='categorical' for C classes"
            )
        if not (y.ndim == 1 or (y.ndim == 2 and y.shape[1] == 1)):
            raise ValueError(f"{name} must be [N] labels in {{0, 1}}, got shape {tuple(y.shape)}")
        if not bool(((y == 0) | (y == 1)).all()):
            bad = y[(y != 0) & (y != 1)].flatten()[0]
            raise ValueError(f"{name} must hold labels 0 or 1, got {bad.item()!r}")
        return y

    def nll(self, f: Tensor, y: Tensor) -> Tensor:
        self._check(f)
        return F.binary_cross_entropy_with_logits(f[:, 0], y.to(f.dtype), reduction="none")

    def hessian(self, f: Tensor) -> Tensor:
        self._check(f)
        p = torch.sigmoid(f)
        return (p * (1 - p)).unsqueeze(-1)

    def sqrt_hessian(self, f: Tensor) -> Tensor:
        return self.hessian(f).sqrt()

    def inverse_link(self, f: Tensor) -> Tensor:
        return torch.sigmoid(f)

    def sample(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        p = _on_generator(torch.sigmoid(f[:, 0]), generator)
        return torch.bernoulli(p, generator=generator).to(f.device)


class GaussianLikelihood(Likelihood):
    """``N(y; f, sigma^2 I)``; ``y [N, C]`` (or ``[N]`` when ``C = 1``)."""

    name = "gaussian"

    def __init__(self, sigma: float = 1.0) -> None:
        if not (isinstance(sigma, int | float) and sigma > 0 and math.isfinite(sigma)):
            raise ValueError(f"sigma must be a positive finite number, got {sigma!r}")
        self.sigma = float(sigma)

    def _y(self, f: Tensor, y: Tensor) -> Tensor:
        y = y.to(f.dtype)
        y = y.unsqueeze(-1) if y.ndim == 1 and f.shape[1] == 1 else y
        if y.shape != f.shape:
            raise ValueError(
                f"y must have the outputs' shape {tuple(f.shape)} ([N] when C = 1), got "
                f"{tuple(y.shape)}"
            )
        return y

    def check_targets(self, y: Tensor, n_outputs: int, name: str = "y") -> Tensor:
        """Finite targets ``[N, C]`` (``[N]`` when ``C = 1``)."""
        if not (y.shape[1:] == (n_outputs,) or (y.ndim == 1 and n_outputs == 1)):
            raise ValueError(
                f"{name} must have shape [N, C]=[N, {n_outputs}] ([N] when C = 1), got "
                f"{tuple(y.shape)}"
            )
        if y.is_floating_point() and not bool(torch.isfinite(y).all()):
            raise ValueError(f"{name} has non-finite entries (NaN or inf)")
        return y

    def nll(self, f: Tensor, y: Tensor) -> Tensor:
        _check_f(f)
        r = f - self._y(f, y)
        c = f.shape[1]
        return 0.5 * (r**2).sum(-1) / self.sigma**2 + c * (
            math.log(self.sigma) + 0.5 * math.log(2 * math.pi)
        )

    def hessian(self, f: Tensor) -> Tensor:
        _check_f(f)
        eye = torch.eye(f.shape[1], dtype=f.dtype, device=f.device)
        return eye.expand(len(f), -1, -1) / self.sigma**2

    def sqrt_hessian(self, f: Tensor) -> Tensor:
        return self.hessian(f) * self.sigma

    def hessian_trace(self, f: Tensor) -> Tensor:
        _check_f(f)
        return torch.full((len(f),), f.shape[1] / self.sigma**2, dtype=f.dtype, device=f.device)

    def inverse_link(self, f: Tensor) -> Tensor:
        return f

    def sample(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return f + self.sigma * randn_like_on(tuple(f.shape), generator, f.dtype, f.device)

    def __repr__(self) -> str:
        return f"GaussianLikelihood(sigma={self.sigma})"


_NAMES = {
    "categorical": CategoricalLikelihood,
    "classification": CategoricalLikelihood,
    "softmax": CategoricalLikelihood,
    "bernoulli": BernoulliLikelihood,
    "binary": BernoulliLikelihood,
    "gaussian": GaussianLikelihood,
    "regression": GaussianLikelihood,
}


def get_likelihood(likelihood: str | Likelihood) -> Likelihood:
    """A :class:`Likelihood` from itself or a name: ``"categorical"`` (alias
    ``"classification"``), ``"bernoulli"`` (``"binary"``) or ``"gaussian"``
    (``"regression"``, sigma = 1)."""
    if isinstance(likelihood, Likelihood):
        return likelihood
    if isinstance(likelihood, str) and likelihood.lower() in _NAMES:
        return _NAMES[likelihood.lower()]()
    raise ValueError(
        f"likelihood must be a Likelihood or one of {sorted(_NAMES)}, got {likelihood!r}"
    )
