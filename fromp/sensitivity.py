r"""The memory-perturbation equation: how much each training example shapes the model.

Nickl, Xu, Tailor, Möllenhoff and Khan ("The memory-perturbation equation: understanding
model's sensitivity to data", NeurIPS 2023) show that, for a Gaussian posterior
``N(m, Sigma)`` (Laplace, VOGN, IVON), removing example ``i`` moves the mean by about
``Sigma J_i^T e_i`` (one Newton step), so its outputs move by about ``V_i e_i`` with

* ``f_i = f(x_i; m)`` ``[C]`` the outputs at the posterior mean,
* ``e_i = d nll(f_i, y_i) / d f_i`` ``[C]`` the prediction error (``p_i - onehot(y_i)``
  for a softmax, ``p_i - y_i`` for a sigmoid, ``(f_i - y_i) / sigma^2`` for a Gaussian),
* ``Lambda_i = d^2 nll / d f_i^2`` ``[C, C]`` and ``lambda_i = diag(Lambda_i)`` ``[C]``
  (``p (1 - p)`` for a softmax),
* ``V_i = J_i Sigma J_i^T`` ``[C, C]``, the DNN2GP prediction covariance, and
  ``v_i = diag(V_i)`` ``[C]``.

From these, without retraining:

* leave-one-out outputs ``f_i^{\i} ~= f_i + e_i * v_i`` (``covariance="diagonal"``, the
  form of the paper's per-output estimate) or ``f_i + V_i e_i`` (``covariance="full"``; exact
  to first order for any ``C``). With ``correction=True`` the example's own curvature is
  first taken out of the posterior (one Newton step from the posterior without it, exact for
  a linear-Gaussian model): ``f_i + V_i (I - Lambda_i V_i)^{-1} e_i``, diagonal form
  ``f_i + e_i v_i / (1 - lambda_i v_i)`` (denominator clamped at machine epsilon: an
  approximate posterior can give ``lambda_i v_i >= 1``); it matters for the most sensitive
  examples, where ``lambda_i v_i`` approaches 1;
* the sensitivity ``s_i = sum_k |e_ik lambda_ik v_ik|`` (large: the model depends on the
  example; the examples FROMP memorises have large ``lambda``);
* the estimated leave-one-out NLL ``(1/N) sum_i nll(f_i^{\i}, y_i)`` and accuracy, a
  generalisation estimate computed on the training set.

``v_i`` comes from :meth:`fromp.gp.GP.variance` (chunks of ``chunk_size`` examples: peak
memory ``chunk_size * C * P`` numbers, never ``P x P`` for a diagonal posterior).

Example::

    q = fromp.laplace(model, (x, y), "categorical", prior_precision=1.0)  # or opt.posterior()
    mp = memory_perturbation(model, q, x, y)
    mp.sensitivity          # [N]
    mp.loo_summary()        # {"loo_nll": ..., "loo_accuracy": ..., "train_nll": ...}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fromp._checks import check_batch, check_tensor
from fromp.gp import GP, Posterior
from fromp.likelihood import CategoricalLikelihood, Likelihood, get_likelihood

__all__ = ["MemoryPerturbation", "memory_perturbation", "prediction_variance"]

_COVARIANCES = ("diagonal", "full")


def prediction_variance(
    model: nn.Module,
    posterior: Posterior,
    x: Tensor,
    likelihood: str | Likelihood = "categorical",
    *,
    chunk_size: int = 64,
) -> Tensor:
    """``v_i = diag(J_i Sigma J_i^T)`` ``[N, C]`` (the DNN2GP marginal variances), computed
    in chunks of ``chunk_size`` examples. ``model`` in eval mode; evaluated at
    ``posterior.mean``."""
    gp = GP(model, posterior, likelihood, chunk_size=chunk_size)
    return torch.diagonal(gp.variance(x), dim1=-2, dim2=-1).clone()


@dataclass
class MemoryPerturbation:
    """Per-example quantities of the memory-perturbation equation (module docstring).

    Attributes:
        logits: ``f_i`` ``[N, C]`` at the posterior mean.
        targets: ``y`` ``[N]``.
        error: ``e_i`` ``[N, C]``.
        lam: ``lambda_i = diag(Lambda_i)`` ``[N, C]``.
        variance: ``v_i`` ``[N, C]``.
        covariance: ``V_i`` ``[N, C, C]``.
        sensitivity: ``s_i`` ``[N]``.
        loo_logits: estimated leave-one-out outputs ``[N, C]``.
        likelihood: the likelihood.
    """

    logits: Tensor
    targets: Tensor
    error: Tensor
    lam: Tensor
    variance: Tensor
    covariance: Tensor
    sensitivity: Tensor
    loo_logits: Tensor
    likelihood: Likelihood

    def nll(self) -> Tensor:
        """Training NLL of each example at the posterior mean ``[N]``."""
        return self.likelihood.nll(self.logits, self.targets)

    def loo_nll(self) -> Tensor:
        """Estimated leave-one-out NLL of each example ``nll(f_i^{\\i}, y_i)`` ``[N]``."""
        return self.likelihood.nll(self.loo_logits, self.targets)

    def loo_correct(self) -> Tensor:
        """Whether the estimated leave-one-out prediction is right ``[N]`` (bool);
        classification only."""
        if isinstance(self.likelihood, CategoricalLikelihood):
            return self.loo_logits.argmax(-1) == self.targets
        if self.loo_logits.shape[1] == 1 and self.likelihood.name == "bernoulli":
            return (self.loo_logits[:, 0] > 0).long() == self.targets.long()
        raise ValueError(f"loo_correct needs a classification likelihood, got {self.likelihood}")

    def loo_summary(self) -> dict[str, float]:
        """``{"loo_nll", "train_nll"}`` means over the examples, plus ``"loo_accuracy"``
        and ``"train_accuracy"`` for classification."""
        out = {"loo_nll": self.loo_nll().mean().item(), "train_nll": self.nll().mean().item()}
        if isinstance(self.likelihood, CategoricalLikelihood):
            out["loo_accuracy"] = self.loo_correct().double().mean().item()
            out["train_accuracy"] = (self.logits.argmax(-1) == self.targets).double().mean().item()
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable per-example numbers: ``sensitivity``, ``error_norm``
        (``|e_i|_1``), ``variance_sum`` (``sum_k v_ik``), ``lambda_trace`` (``sum_k
        lambda_ik``), ``nll``, ``loo_nll``, ``target``."""
        return {
            "sensitivity": self.sensitivity.tolist(),
            "error_norm": self.error.abs().sum(-1).tolist(),
            "variance_sum": self.variance.sum(-1).tolist(),
            "lambda_trace": self.lam.sum(-1).tolist(),
            "nll": self.nll().tolist(),
            "loo_nll": self.loo_nll().tolist(),
            "target": self.targets.tolist(),
        }


def memory_perturbation(
    model: nn.Module,
    posterior: Posterior,
    x: Tensor,
    y: Tensor,
    likelihood: str | Likelihood = "categorical",
    *,
    covariance: str = "diagonal",
    correction: bool = False,
    chunk_size: int = 64,
) -> MemoryPerturbation:
    """Prediction error, variance, sensitivity and leave-one-out estimates of ``(x, y)``.

    Args:
        model: ``[N, ...] -> [N, C]`` in eval mode (for a multi-head model,
            :func:`fromp.models.with_task`); evaluated at ``posterior.mean``.
        posterior: :class:`~fromp.posterior.DiagonalGaussian` (``fromp.laplace``,
            ``VOGN.posterior()``, ``IVON.posterior(model)``) or
            :class:`~fromp.posterior.FullGaussian` over the model's ``P`` parameters, fitted
            on a training set that contains ``(x, y)``.
        x: ``[N, ...]``. y: ``[N]`` targets (``[N, C]`` for a Gaussian likelihood).
        likelihood: its name or a :class:`~fromp.likelihood.Likelihood`.
        covariance: ``"diagonal"`` (``f + e * v``) or ``"full"`` (``f + V e``) for the
            leave-one-out outputs.
        correction: remove the example's own curvature first (module docstring):
            ``f + e v / (1 - lambda v)`` or ``f + V (I - Lambda V)^{-1} e``.
        chunk_size: examples per Jacobian chunk.
    """
    if covariance not in _COVARIANCES:
        raise ValueError(f"covariance must be one of {_COVARIANCES}, got {covariance!r}")
    check_batch(x, "x")
    check_tensor(y, "y", f"[N]=[{len(x)}]")
    if len(y) != len(x):
        raise ValueError(f"y must have N={len(x)} targets, got {tuple(y.shape)}")
    lik = get_likelihood(likelihood)
    gp = GP(model, posterior, lik, chunk_size=chunk_size)
    f = gp.mean(x)
    y = y.to(f.device)
    with torch.enable_grad():
        fr = f.detach().requires_grad_(True)
        error = torch.autograd.grad(lik.nll(fr, y).sum(), fr)[0]
    lam = torch.diagonal(lik.hessian(f), dim1=-2, dim2=-1)
    cov = gp.variance(x)
    var = torch.diagonal(cov, dim1=-2, dim2=-1)
    if covariance == "diagonal":
        shift = error * var
        if correction:
            shift = shift / (1 - lam * var).clamp_min(torch.finfo(var.dtype).eps)
    else:
        rhs = error
        if correction:  # (I - Lambda V)^{-1} e
            eye = torch.eye(cov.shape[-1], dtype=cov.dtype, device=cov.device)
            big_lam = lik.hessian(f)
            rhs = torch.linalg.solve(eye - big_lam @ cov, error.unsqueeze(-1)).squeeze(-1)
        shift = torch.einsum("ncd,nd->nc", cov, rhs)
    sens = (error * lam * var).abs().sum(-1)
    return MemoryPerturbation(
        logits=f,
        targets=y,
        error=error,
        lam=lam,
        variance=var.clone(),
        covariance=cov,
        sensitivity=sens,
        loo_logits=f + shift,
        likelihood=lik,
    )
