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

* leave-one-out outputs ``f_i^{\i} ~= f_i + e_i * v_i`` (``covariance="diag"``, the
  form of the paper's per-output estimate) or ``f_i + V_i e_i`` (``covariance="full"``; exact
  to first order for any ``C``). With ``correction=True`` the example's own curvature is
  first taken out of the posterior (one Newton step from the posterior without it, exact for
  a linear-Gaussian model): ``f_i + V_i (I - Lambda_i V_i)^{-1} e_i``, diagonal form
  ``f_i + e_i v_i / (1 - lambda_i v_i)`` (refused when an approximate posterior gives
  ``lambda_i v_i >= 1`` for some example: the form has no meaning there); it matters for
  the most sensitive examples, where ``lambda_i v_i`` approaches 1;
* the sensitivity ``s_i = sum_k |e_ik lambda_ik v_ik|`` (large: the model depends on the
  example; the examples FROMP memorises have large ``lambda``);
* the estimated leave-one-out NLL ``(1/N) sum_i nll(f_i^{\i}, y_i)`` and accuracy, a
  generalisation estimate computed on the training set.

For large leave-one-out changes (the most sensitive examples) the one-step forms above can be
far off: they evaluate the linearised network and, for a GGN posterior, ignore the
second-derivative terms of the network. :func:`newton_step_loo` instead takes one exact
Newton step on the leave-one-out objective from the trained weights (the approximate
leave-one-out of Beirami et al., 2017, and Rad and Maleki, 2020) and evaluates the network
at the new weights; it needs a full-covariance posterior whose precision is the Hessian of
the training objective.

``v_i`` comes from :meth:`fromp.gp.GP.variance` (chunks of ``chunk_size`` examples: peak
memory ``chunk_size * C * P`` numbers, never ``P x P`` for a diagonal posterior).

Example::

    q = fromp.fit_laplace(model, (x, y), "categorical", prior_precision=1.0)  # or opt.posterior()
    mp = memory_perturbation(model, q, x, y)
    mp.sensitivity          # [N]
    mp.loo_summary()        # {"loo_nll": ..., "loo_accuracy": ..., "train_nll": ...}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from fromp._checks import check_batch, check_class_targets, check_tensor
from fromp.curvature.jacobian import num_params, unflatten
from fromp.gp.process import GP
from fromp.laplace.base import BaseLaplace
from fromp.likelihood import (
    CategoricalLikelihood,
    GaussianLikelihood,
    Likelihood,
    get_likelihood,
)
from fromp.posterior import FullGaussian, GaussianPosterior

__all__ = ["MemoryPerturbation", "memory_perturbation", "newton_step_loo", "prediction_variance"]

_COVARIANCES = ("diag", "full")


def prediction_variance(
    model: nn.Module,
    posterior: GaussianPosterior,
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


def _check_examples(x: Tensor, y: Tensor) -> None:
    """``x`` a batch ``[N, ...]`` and ``y`` a tensor of ``N`` targets, else a ``ValueError`` /
    ``TypeError`` naming the argument."""
    check_batch(x, "x")
    check_tensor(y, "y", f"[N]=[{len(x)}]")
    if len(y) != len(x):
        raise ValueError(f"y must have N={len(x)} targets, got {tuple(y.shape)}")


def _laplace_likelihood(posterior: BaseLaplace, likelihood: str | Likelihood | None) -> Likelihood:
    """The likelihood of a fitted :func:`fromp.Laplace` with its noise ``sigma`` (the
    Laplace keeps a unit-noise likelihood and ``sigma_noise`` apart); an explicit
    ``likelihood`` must agree with it."""
    own = posterior.likelihood_fn
    if isinstance(own, GaussianLikelihood):
        own = GaussianLikelihood(float(posterior.sigma_noise))
    if likelihood is None:
        return own
    lik = get_likelihood(likelihood)
    same = lik.name == own.name and (
        not isinstance(lik, GaussianLikelihood) or lik.sigma == own.sigma  # type: ignore[attr-defined]
    )
    if not same:
        raise ValueError(
            f"likelihood={lik!r} does not match the fitted Laplace's {own!r}: omit "
            "likelihood= to use the Laplace's own (with its sigma_noise)"
        )
    return own


def check_loo_targets(y: Tensor, n_outputs: int, likelihood: Likelihood) -> None:
    """Targets that fit the likelihood and a model of ``n_outputs`` outputs (class indices
    in range, ``{0, 1}`` for a Bernoulli, finite regression targets), and no softmax over a
    single output (whose probability is always 1: LOO NLL 0 and accuracy 100 %, meaningless);
    ``ValueError`` naming ``y`` or ``likelihood``."""
    if isinstance(likelihood, CategoricalLikelihood) and n_outputs < 2:
        raise ValueError(
            f"likelihood='categorical' needs a model with at least 2 outputs, got {n_outputs} "
            "(a softmax over one output is always 1): use 'bernoulli' or 'gaussian'"
        )
    check_class_targets(y, n_outputs, likelihood, "y")


def memory_perturbation(
    model: nn.Module,
    posterior: GaussianPosterior,
    x: Tensor,
    y: Tensor,
    likelihood: str | Likelihood | None = None,
    *,
    covariance: str = "diag",
    correction: bool = False,
    chunk_size: int = 64,
) -> MemoryPerturbation:
    """Prediction error, variance, sensitivity and leave-one-out estimates of ``(x, y)``.

    Args:
        model: ``[N, ...] -> [N, C]`` in eval mode (for a multi-head model,
            :func:`fromp.models.with_task`); evaluated at ``posterior.mean``.
        posterior: :class:`~fromp.posterior.DiagonalGaussian` (``fromp.laplace``,
            ``VOGN.posterior()``, ``IVON.posterior(model)``) or
            :class:`~fromp.posterior.FullGaussian` over the model's ``P`` parameters, or a
            fitted :func:`fromp.Laplace` of ``model`` (any subset and structure: ``V_i`` is
            its ``functional_variance``), fitted on a training set that contains ``(x, y)``.
        x: ``[N, ...]``. y: ``[N]`` targets (``[N, C]`` for a Gaussian likelihood).
        likelihood: its name or a :class:`~fromp.likelihood.Likelihood`; None (default):
            a fitted :func:`fromp.Laplace`'s own likelihood and ``sigma_noise``, else
            ``"categorical"``. With a Laplace, an explicit likelihood that disagrees with
            its own (another kind, another noise) is refused.
        covariance: ``"diag"`` (``f + e * v``) or ``"full"`` (``f + V e``) for the
            leave-one-out outputs.
        correction: remove the example's own curvature first (module docstring):
            ``f + e v / (1 - lambda v)`` or ``f + V (I - Lambda V)^{-1} e``. The diagonal
            form is refused when ``1 - lambda_ik v_ik <= 0`` for some example (an approximate
            posterior wider than the example's own curvature allows: the form has no
            meaning there), naming how many.
        chunk_size: examples per Jacobian chunk.
    """
    if covariance not in _COVARIANCES:
        raise ValueError(f"covariance must be one of {_COVARIANCES}, got {covariance!r}")
    _check_examples(x, y)
    if isinstance(posterior, BaseLaplace):  # any structure and subset of fromp.Laplace
        if posterior.model is not model:
            raise ValueError("posterior is a fitted Laplace of another model")
        lik = _laplace_likelihood(posterior, likelihood)
        lgp, step = posterior.gp(), max(chunk_size, 256)
        f = torch.cat([lgp.mean(x[s : s + step]) for s in range(0, len(x), step)])

        def variance(xx: Tensor) -> Tensor:
            return torch.cat([lgp.variance(xx[s : s + step]) for s in range(0, len(xx), step)])

    else:
        lik = get_likelihood("categorical" if likelihood is None else likelihood)
        gp = GP(model, posterior, lik, chunk_size=chunk_size)
        f = gp.mean(x)
        variance = gp.variance
    y = y.to(f.device)
    check_loo_targets(y, f.shape[1], lik)  # before the variances, the costly part
    with torch.enable_grad():
        fr = f.detach().requires_grad_(True)
        error = torch.autograd.grad(lik.nll(fr, y).sum(), fr)[0]
    lam = torch.diagonal(lik.hessian(f), dim1=-2, dim2=-1)
    cov = variance(x)
    var = torch.diagonal(cov, dim1=-2, dim2=-1)
    if covariance == "diag":
        shift = error * var
        if correction:
            denom = 1 - lam * var
            bad = (denom <= 0).any(-1)
            if bool(bad.any()):
                raise ValueError(
                    f"covariance='diag', correction=True: 1 - lambda v <= 0 for "
                    f"{int(bad.sum())} of {len(bad)} examples (the posterior variance exceeds "
                    "what the example's own curvature allows, so the corrected diagonal form "
                    "has no meaning there): use covariance='full' or correction=False"
                )
            shift = shift / denom
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


_HESS_APPROX = ("hessian", "ggn")


def _gmres(apply: Any, b: Tensor, tol: float, max_iter: int) -> Tensor:
    """Solve ``A u = b`` (``b`` ``[P]``) by GMRES without restarts (Arnoldi with twice
    applied Gram-Schmidt). For ``A = I + (rank r)`` the Krylov space is exhausted after at
    most ``r + 1`` steps, so the solution is exact then (up to rounding)."""
    beta = b.norm()
    if beta == 0:
        return torch.zeros_like(b)
    n = min(max_iter, b.numel())
    q = b.new_zeros(n + 1, b.numel())
    h = b.new_zeros(n + 1, n)
    q[0] = b / beta
    rhs = b.new_zeros(n + 1)
    rhs[0] = beta
    coef = rhs[:1]
    for k in range(n):
        w = apply(q[k])
        for _ in range(2):
            c = q[: k + 1] @ w
            w = w - c @ q[: k + 1]
            h[: k + 1, k] += c
        h[k + 1, k] = w.norm()
        coef = torch.linalg.lstsq(h[: k + 2, : k + 1], rhs[: k + 2, None]).solution[:, 0]
        resid = (rhs[: k + 2] - h[: k + 2, : k + 1] @ coef).norm()
        if resid <= tol * beta or h[k + 1, k] <= tol * beta:
            return coef @ q[: k + 1]
        q[k + 1] = w / h[k + 1, k]
    raise RuntimeError(f"GMRES did not reach tol={tol} in {n} iterations (residual {resid:.2e})")


def newton_step_loo(
    model: nn.Module,
    posterior: FullGaussian,
    x: Tensor,
    y: Tensor,
    likelihood: str | Likelihood = "categorical",
    *,
    hess_approx: str = "hessian",
    linearize: bool = False,
    tol: float | None = None,
    max_iter: int = 2000,
    return_steps: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    r"""Leave-one-out outputs from one Newton step on the leave-one-out objective.

    With the training objective ``L(w) = sum_j nll(f(x_j; w), y_j) + R(w)`` minimised at
    ``w* = posterior.mean`` and ``posterior.precision = H`` its Hessian there ``[P, P]``,
    the objective without example ``i``, ``L(w) - l_i(w)``, has gradient ``-g_i`` and Hessian
    ``H - H_i`` at ``w*``, with ``g_i = grad l_i(w*)`` ``[P]`` and ``H_i`` the example's
    Hessian ``[P, P]``. One Newton step gives the leave-one-out weights

        ``w^{\i} = w* + (H - H_i)^{-1} g_i``,

    and the leave-one-out outputs ``f(x_i; w^{\i})`` ``[C]`` (the network evaluated at the
    stepped weights; ``linearize=True``: ``f_i + J_i (w^{\i} - w*)``). This is the
    approximate leave-one-out (ALO) of Rad and Maleki (2020), exact when ``L - l_i`` is
    quadratic; the step is the example's gradient under the posterior covariance with the
    example's own curvature removed.

    ``hess_approx="hessian"`` removes the example's exact Hessian ``H_i = J_i^T Lambda_i J_i +
    sum_c e_ic d^2 f_ic / dw^2`` (use with ``H`` the exact Hessian of ``L``, e.g.
    ``FullGaussian(w*, torch.func.hessian(L)(w*))``); ``hess_approx="ggn"`` removes
    ``J_i^T Lambda_i J_i`` (use with a GGN posterior such as :func:`fromp.fit_laplace` with
    ``hessian_structure="full"``; with ``linearize=True`` this is
    ``memory_perturbation(..., covariance="full", correction=True)``).

    ``(H - H_i)^{-1} g_i = (I - Sigma H_i)^{-1} Sigma g_i`` (``Sigma = H^{-1}``) is solved by
    GMRES with example-Hessian-vector products; ``Sigma H_i`` has rank at most that of
    ``H_i``, so GMRES ends after ``rank(H_i) + 1`` steps (``C + 1`` for the GGN). Cost per
    example: that many products with ``Sigma`` (``O(P^2)`` each) and one forward pass; memory
    ``O(P^2)`` (``Sigma``, formed once from the Cholesky factor of ``H``).

    Args:
        model: ``[N, ...] -> [N, C]`` in eval mode; evaluated at ``posterior.mean``.
        posterior: a :class:`~fromp.posterior.FullGaussian` whose precision is the Hessian
            (or GGN) of the training objective at its minimum ``posterior.mean``.
        x: ``[N, ...]`` the examples to leave out, one at a time. y: ``[N]`` targets.
        likelihood: its name or a :class:`~fromp.likelihood.Likelihood`.
        hess_approx: ``"hessian"`` or ``"ggn"``, the example's curvature removed.
        linearize: evaluate the linearised network instead of the network.
        tol: relative residual at which GMRES stops; default ``max(1e-10, 100 eps)`` of the
            posterior's dtype (``1e-10`` in float64, ``1.2e-5`` in float32, which a float32
            residual can reach). max_iter: GMRES steps at most.
        return_steps: also return the weight steps ``w^{\i} - w*`` ``[N, P]``.

    Returns:
        the estimated leave-one-out outputs ``[N, C]`` (and the steps ``[N, P]``).
    """
    if hess_approx not in _HESS_APPROX:
        raise ValueError(f"hess_approx must be one of {_HESS_APPROX}, got {hess_approx!r}")
    if not isinstance(posterior, FullGaussian):
        raise ValueError("newton_step_loo needs a FullGaussian posterior")
    _check_examples(x, y)
    n_params = num_params(model)
    if posterior.num_params != n_params:
        raise ValueError(
            f"posterior must be over the model's P={n_params} parameters, got "
            f"{posterior.num_params}"
        )
    lik = get_likelihood(likelihood)
    w0 = posterior.mean.detach()
    if max_iter < 1:
        raise ValueError(f"max_iter must be >= 1, got {max_iter}")
    if tol is None:
        tol = max(1e-10, 100 * torch.finfo(w0.dtype).eps)
    elif not tol > 0:
        raise ValueError(f"tol must be > 0, got {tol}")
    buffers = dict(model.named_buffers())

    def out(w: Tensor, xi: Tensor) -> Tensor:
        return torch.func.functional_call(model, (unflatten(model, w), buffers), (xi,))[0]

    with torch.no_grad():
        n_out = out(w0, x[:1]).shape[-1]
    check_loo_targets(y, n_out, lik)
    cov = posterior.covariance  # Sigma = H^{-1} [P, P], once: matrix-vector products after

    def sigma(v: Tensor) -> Tensor:
        return cov @ v

    rows, steps = [], []
    for i in range(len(x)):
        xi, yi = x[i : i + 1], y[i : i + 1].to(w0.device)

        def nll_i(w: Tensor, xi: Tensor = xi, yi: Tensor = yi) -> Tensor:
            return lik.nll(out(w, xi).unsqueeze(0), yi).sum()

        with torch.enable_grad():
            g_i = torch.func.grad(nll_i)(w0)
            # J_i [C, P], once per example (the GGN products and the linearised outputs)
            jac = (
                torch.func.jacrev(lambda w, xi=xi: out(w, xi))(w0)
                if hess_approx == "ggn" or linearize
                else None
            )
        with torch.no_grad():
            f_i = out(w0, xi)
        if hess_approx == "hessian":  # H_i v

            def hvp(v: Tensor, nll_i: Any = nll_i) -> Tensor:
                with torch.enable_grad():
                    return torch.func.jvp(torch.func.grad(nll_i), (w0,), (v,))[1]
        else:  # J_i^T Lambda_i J_i v
            big_lam = lik.hessian(f_i.unsqueeze(0))[0]

            def hvp(v: Tensor, jac: Tensor = jac, big_lam: Tensor = big_lam) -> Tensor:
                return jac.T @ (big_lam @ (jac @ v))

        step = _gmres(lambda v, hvp=hvp: v - sigma(hvp(v)), sigma(g_i), tol, max_iter)
        steps.append(step)
        if linearize:
            rows.append(f_i + jac @ step)
        else:
            with torch.no_grad():
                rows.append(out(w0 + step, xi))
    if return_steps:
        return torch.stack(rows), torch.stack(steps)
    return torch.stack(rows)
