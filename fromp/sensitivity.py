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
from fromp.jacobian import num_params, unflatten
from fromp.likelihood import CategoricalLikelihood, Likelihood, get_likelihood
from fromp.posterior import FullGaussian

__all__ = [
    "LOOTracker",
    "LastLayerLOO",
    "MemoryPerturbation",
    "last_layer_features",
    "last_layer_loo",
    "last_layer_remove",
    "memory_perturbation",
    "newton_step_loo",
    "prediction_variance",
]

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


def _check_examples(x: Tensor, y: Tensor) -> None:
    """``x`` a batch ``[N, ...]`` and ``y`` a tensor of ``N`` targets, else a ``ValueError`` /
    ``TypeError`` naming the argument."""
    check_batch(x, "x")
    check_tensor(y, "y", f"[N]=[{len(x)}]")
    if len(y) != len(x):
        raise ValueError(f"y must have N={len(x)} targets, got {tuple(y.shape)}")


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
    _check_examples(x, y)
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


_CURVATURES = ("hessian", "ggn")


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
    curvature: str = "hessian",
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

    ``curvature="hessian"`` removes the example's exact Hessian ``H_i = J_i^T Lambda_i J_i +
    sum_c e_ic d^2 f_ic / dw^2`` (use with ``H`` the exact Hessian of ``L``, e.g.
    ``FullGaussian(w*, torch.func.hessian(L)(w*))``); ``curvature="ggn"`` removes
    ``J_i^T Lambda_i J_i`` (use with a GGN posterior such as :func:`fromp.laplace_full`; with
    ``linearize=True`` this is ``memory_perturbation(..., covariance="full",
    correction=True)``).

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
        curvature: ``"hessian"`` or ``"ggn"``, the example's curvature removed.
        linearize: evaluate the linearised network instead of the network.
        tol: relative residual at which GMRES stops; default ``max(1e-10, 100 eps)`` with
            ``eps`` the machine epsilon of the posterior's dtype (``1e-10`` in float64,
            about ``1.2e-5`` in float32, which a float32 solve reaches).
        max_iter: GMRES steps at most (a ``RuntimeError`` if ``tol`` is not reached).
        return_steps: also return the weight steps ``w^{\i} - w*`` ``[N, P]``.

    Returns:
        the estimated leave-one-out outputs ``[N, C]`` (and the steps ``[N, P]``).
    """
    if curvature not in _CURVATURES:
        raise ValueError(f"curvature must be one of {_CURVATURES}, got {curvature!r}")
    if not isinstance(posterior, FullGaussian):
        raise ValueError("newton_step_loo needs a FullGaussian posterior")
    _check_examples(x, y)
    n_params = num_params(model)
    if posterior.num_params != n_params:
        raise ValueError(
            f"posterior must be over the model's P={n_params} parameters, got "
            f"{posterior.num_params}"
        )
    if max_iter < 1:
        raise ValueError(f"max_iter must be >= 1, got {max_iter}")
    if tol is None:
        tol = max(1e-10, 100 * torch.finfo(posterior.mean.dtype).eps)
    elif not tol > 0:
        raise ValueError(f"tol must be > 0, got {tol}")
    lik = get_likelihood(likelihood)
    w0 = posterior.mean.detach()
    cov = posterior.covariance  # Sigma = H^{-1} [P, P], once: matrix-vector products after
    buffers = dict(model.named_buffers())

    def out(w: Tensor, xi: Tensor) -> Tensor:
        return torch.func.functional_call(model, (unflatten(model, w), buffers), (xi,))[0]

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
                if curvature == "ggn" or linearize
                else None
            )
        with torch.no_grad():
            f_i = out(w0, xi)
        if curvature == "hessian":  # H_i v

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


# ----------------------------------------------------------------------------- last layer


def last_layer_features(model: nn.Module, x: Tensor) -> tuple[Tensor, nn.Linear]:
    """The inputs ``phi(x)`` ``[N, D]`` of the model's output layer and that layer.

    The output layer is the last :class:`torch.nn.Linear` called in the forward pass, and its
    output must be the model's output ``[N, C]`` (true for an MLP, a CNN with a linear
    classifier, a multi-head model seen through :func:`fromp.models.with_task`); otherwise a
    ``ValueError``. ``model`` in eval mode; no gradients are kept."""
    check_batch(x, "x")
    calls: list[tuple[nn.Linear, Tensor, Tensor]] = []

    def hook(mod: nn.Module, inp: tuple[Tensor, ...], out: Tensor) -> None:
        calls.append((mod, inp[0], out))  # type: ignore[arg-type]

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Linear)]
    try:
        with torch.no_grad():
            f = model(x)
    finally:
        for h in handles:
            h.remove()
    if not calls:
        raise ValueError(f"model must end in an nn.Linear layer; {type(model).__name__} has none")
    head, phi, out = calls[-1]
    if out.shape != f.shape or not torch.equal(out, f):
        raise ValueError(
            "model's output must be the output of its last nn.Linear layer (a last-layer "
            f"posterior needs a linear head); {type(model).__name__} transforms it further"
        )
    return phi.reshape(len(x), -1), head


def _augment(phi: Tensor, bias: bool) -> Tensor:
    """``[phi, 1]`` ``[N, D+1]`` with a bias, else ``phi``."""
    return torch.cat([phi, phi.new_ones(len(phi), 1)], 1) if bias else phi


def last_layer_ggn(phi: Tensor, logits: Tensor, likelihood: str | Likelihood) -> Tensor:
    r"""GGN of a linear head ``f = Theta phi~`` over ``theta = vec(Theta)`` (row-major,
    ``Theta = [W | b]`` ``[C, D1]``, ``phi~`` the features with a trailing 1 for a bias):

        ``G = sum_n Lambda_n (x) phi~_n phi~_n^T``  ``[C D1, C D1]``,

    since ``J_n = I_C (x) phi~_n^T``. For a canonical link (softmax, sigmoid, Gaussian) and a
    head linear in ``theta`` it is the exact Hessian of the summed NLL over the head.

    Args:
        phi: ``[N, D1]`` the (augmented) features. logits: ``[N, C]`` the head's outputs.
        likelihood: its name or a :class:`~fromp.likelihood.Likelihood`.
    """
    lik = get_likelihood(likelihood)
    big_lam = lik.hessian(logits)  # [N, C, C]
    c, d1 = logits.shape[1], phi.shape[1]
    g = phi.new_zeros(c, d1, c, d1)
    for i in range(c):  # C (C + 1) / 2 matrix products [D1, N] x [N, D1]
        for k in range(i, c):
            block = (phi * big_lam[:, i, k, None]).T @ phi
            g[i, :, k] = block
            if k != i:
                g[k, :, i] = block.T
    return g.reshape(c * d1, c * d1)


@dataclass
class LastLayerLOO:
    """A full-covariance last-layer Laplace posterior and its leave-one-out estimates.

    Attributes:
        perturbation: the :class:`MemoryPerturbation` of the examples (``loo_logits`` the
            one-step leave-one-out outputs with the example's own curvature removed,
            ``f + V (I - Lambda V)^{-1} e``: the exact Newton step of the head).
        precision: ``G + delta I`` ``[C D1, C D1]`` over ``vec([W | b])`` (float64).
        prior_precision: ``delta``.
        n_fit: examples in the GGN.
    """

    perturbation: MemoryPerturbation
    precision: Tensor
    prior_precision: float
    n_fit: int

    def summary(self) -> dict[str, Any]:
        """:meth:`MemoryPerturbation.loo_summary` plus ``posterior``, ``prior_precision``
        and ``n_fit``."""
        out: dict[str, Any] = {"posterior": "last-layer full Laplace-GGN"}
        out |= {"prior_precision": self.prior_precision, "n_fit": self.n_fit}
        return out | self.perturbation.loo_summary()


def last_layer_loo(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    prior_precision: float,
    likelihood: str | Likelihood = "categorical",
    *,
    chunk_size: int = 256,
) -> LastLayerLOO:
    r"""Leave-one-out estimates of every example of ``(x, y)`` under a full-covariance
    Laplace-GGN posterior over the output layer, fitted on exactly ``(x, y)``.

    With features ``phi~_n`` ``[D1]`` (:func:`last_layer_features`, a trailing 1 for a
    bias), ``J_n = I_C (x) phi~_n^T``, precision ``H = sum_n Lambda_n (x) phi~_n phi~_n^T +
    delta I`` (:func:`last_layer_ggn`) and ``Sigma = H^{-1}``, the prediction covariance is
    ``V_n[c, k] = phi~_n^T Sigma[c, :, k, :] phi~_n`` and the leave-one-out outputs are

        ``f_n^{\n} = f_n + V_n (I - Lambda_n V_n)^{-1} e_n``,

    one exact Newton step of the head's training objective without example ``n`` (exact for a
    Gaussian likelihood: the classical ``e_n / (1 - h_nn)``). The features are held fixed, so
    this is the leave-one-out of retraining the head alone. ``delta`` should be the prior
    precision (weight decay times ``N`` for a mean-reduced loss) the network was trained
    with; too small a ``delta`` with few examples per feature makes ``H`` ill-conditioned.

    Cost: one forward pass, ``O(N C^2 D1^2)`` for ``G`` and ``V``, one Cholesky of
    ``C D1 x C D1`` (full by definition: the last layer is small).

    Args:
        model: ``[N, ...] -> [N, C]`` in eval mode, ending in an ``nn.Linear``.
        x: ``[N, ...]`` the training examples. y: ``[N]`` targets.
        prior_precision: ``delta > 0``.
        likelihood: its name or a :class:`~fromp.likelihood.Likelihood`.
        chunk_size: examples per chunk of the ``V_n`` computation.
    """
    _check_examples(x, y)
    if not (isinstance(prior_precision, int | float) and prior_precision > 0):
        raise ValueError(f"prior_precision must be a number > 0, got {prior_precision!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    lik = get_likelihood(likelihood)
    phi, head = last_layer_features(model, x)
    with torch.no_grad():
        f = head(phi)
    dtype = f.dtype
    # float64 inside: softmax's Lambda is singular along the sum of the logits, so with a
    # small delta the precision is too ill-conditioned for a float32 Cholesky
    phi, f = _augment(phi, head.bias is not None).double(), f.double()
    y = y.to(f.device)
    c, d1 = f.shape[1], phi.shape[1]
    eye = torch.eye(c * d1, dtype=phi.dtype, device=phi.device)
    precision = last_layer_ggn(phi, f, lik) + prior_precision * eye
    chol = torch.linalg.cholesky(precision)
    sigma = torch.cholesky_inverse(chol).reshape(c, d1, c * d1).permute(1, 0, 2)
    sigma = sigma.reshape(d1, c * c * d1)  # [D1, C C D1]: V_n[c, k] = phi~_n^T Sigma_ck phi~_n
    cov = torch.cat(
        [
            ((p @ sigma).view(len(p), c, c, d1) * p[:, None, None, :]).sum(-1)
            for p in phi.split(chunk_size)
        ]
    )
    mp = _corrected_loo(f, y, cov, lik, dtype)
    return LastLayerLOO(mp, precision, float(prior_precision), len(x))


def _corrected_loo(f: Tensor, y: Tensor, cov: Tensor, lik: Likelihood, dtype: torch.dtype):
    """:class:`MemoryPerturbation` with ``loo_logits = f + V (I - Lambda V)^{-1} e`` from the
    outputs ``f`` ``[N, C]`` and prediction covariances ``V`` ``[N, C, C]``; tensors returned
    in ``dtype``."""
    with torch.enable_grad():
        fr = f.detach().requires_grad_(True)
        error = torch.autograd.grad(lik.nll(fr, y).sum(), fr)[0]
    big_lam = lik.hessian(f)
    lam = torch.diagonal(big_lam, dim1=-2, dim2=-1)
    eye_c = torch.eye(f.shape[1], dtype=f.dtype, device=f.device)
    rhs = torch.linalg.solve(eye_c - big_lam @ cov, error.unsqueeze(-1)).squeeze(-1)
    var = torch.diagonal(cov, dim1=-2, dim2=-1).clone()
    loo = f + torch.einsum("ncd,nd->nc", cov, rhs)
    return MemoryPerturbation(
        logits=f.to(dtype),
        targets=y.to(dtype) if y.is_floating_point() else y,
        error=error.to(dtype),
        lam=lam.to(dtype),
        variance=var.to(dtype),
        covariance=cov.to(dtype),
        sensitivity=(error * lam * var).abs().sum(-1).to(dtype),
        loo_logits=loo.to(dtype),
        likelihood=lik,
    )


def _head_slices(model: nn.Module, head: nn.Linear) -> tuple[slice, slice | None]:
    """Positions of ``head.weight`` and ``head.bias`` in the flat trainable parameters."""
    where: dict[int, slice] = {}
    i = 0
    for p in model.parameters():
        if p.requires_grad:
            where[id(p)] = slice(i, i + p.numel())
            i += p.numel()
    if id(head.weight) not in where:
        raise ValueError("model's output layer must be trainable for a last-layer posterior")
    return where[id(head.weight)], where.get(id(head.bias)) if head.bias is not None else None


def _diagonal_last_layer_loo(
    model: nn.Module, posterior: Any, x: Tensor, y: Tensor, lik: Likelihood
) -> MemoryPerturbation:
    """Leave-one-out from a diagonal posterior (IVON, VOGN) restricted to the output layer:
    ``V_n = diag_c(sum_d phi~_nd^2 s_cd)`` with ``s`` the head's posterior variances (exact:
    ``J_n = I_C (x) phi~_n^T`` and a diagonal ``Sigma`` give a diagonal ``V_n``)."""
    phi, head = last_layer_features(model, x)
    sw, sb = _head_slices(model, head)
    mean, var = posterior.mean.detach(), posterior.variance.detach()
    if mean.numel() != sum(p.numel() for p in model.parameters() if p.requires_grad) or (
        not torch.equal(mean[sw].view_as(head.weight).to(head.weight), head.weight.detach())
    ):
        raise ValueError(
            "optimizer's posterior must be over the model's trainable parameters in "
            "model.parameters() order, with its mean in the model (not a sampled draw)"
        )
    with torch.no_grad():
        f = head(phi)
    dtype = f.dtype
    phi, f = phi.double(), f.double()
    s_w = var[sw].view_as(head.weight).double()  # [C, D]
    v = phi.pow(2) @ s_w.T  # [N, C]
    if sb is not None:
        v = v + var[sb].double()
    return _corrected_loo(f, y.to(f.device), torch.diag_embed(v), lik, dtype)


class LOOTracker:
    r"""Leave-one-out estimates of the training set after each epoch of training, a
    generalisation estimate computed without a validation set.

    Call it after an epoch with the model, the training examples and optionally the
    optimizer::

        tracker = LOOTracker(prior_precision=1e-4 * len(x))   # or weight decay from Adam
        for epoch in range(epochs):
            train_one_epoch(model, opt)
            tracker(model, x, y, opt)          # -> {"loo_nll": ..., "loo_accuracy": ...}
        tracker.history                        # one record per call

    Posterior, by optimizer:

    * an optimizer with its own posterior (:class:`fromp.optim.IVON`,
      :class:`fromp.optim.VOGN`): its diagonal Gaussian, restricted to the output layer
      (``scope="last-layer"``, cost one forward pass) or over all weights
      (``scope="all"``, :func:`memory_perturbation`, ``C`` backward passes per example);
    * any other (Adam, SGD) or none: a full-covariance last-layer Laplace-GGN refitted at each
      call (:func:`last_layer_loo`) with ``prior_precision``, by default the optimizer's
      ``weight_decay`` times ``N`` (the prior precision of the summed objective that a
      mean-reduced loss with weight decay optimises).

    The leave-one-out outputs are ``f + V (I - Lambda V)^{-1} e`` (the example's own curvature
    removed). Cost: one forward pass over ``x`` plus ``O(N C^2 D1^2 + (C D1)^3)`` for the
    last-layer Laplace; ``max_examples`` caps ``N`` by a fixed random subset (the posterior is
    then fitted on the subset, which makes it wider: the estimate is pessimistic).

    Args:
        likelihood: its name or a :class:`~fromp.likelihood.Likelihood`.
        prior_precision: ``delta`` of the last-layer Laplace (None: the optimizer's weight
            decay times ``N``; an error if there is none).
        scope: ``"last-layer"`` or ``"all"``, for an optimizer's own posterior.
        max_examples: use at most this many training examples (None: all).
        seed: of the subset.
    """

    def __init__(
        self,
        likelihood: str | Likelihood = "categorical",
        *,
        prior_precision: float | None = None,
        scope: str = "last-layer",
        max_examples: int | None = None,
        seed: int = 0,
    ) -> None:
        if scope not in ("last-layer", "all"):
            raise ValueError(f"scope must be 'last-layer' or 'all', got {scope!r}")
        if prior_precision is not None and not (
            isinstance(prior_precision, int | float) and prior_precision > 0
        ):
            raise ValueError(
                f"prior_precision must be a number > 0 or None, got {prior_precision!r}"
            )
        if max_examples is not None and max_examples < 1:
            raise ValueError(f"max_examples must be >= 1 or None, got {max_examples}")
        self.likelihood = get_likelihood(likelihood)
        self.prior_precision = prior_precision
        self.scope = scope
        self.max_examples = max_examples
        self.seed = seed
        self.history: list[dict[str, Any]] = []

    def _delta(self, optimizer: Any, n: int) -> tuple[float, str]:
        if self.prior_precision is not None:
            return float(self.prior_precision), "given"
        groups = getattr(optimizer, "param_groups", None) or []
        wd = {float(g.get("weight_decay", 0.0)) for g in groups}
        if len(wd) == 1 and (w := wd.pop()) > 0:
            return w * n, "optimizer weight_decay x N"
        raise ValueError(
            "prior_precision is needed: the optimizer has no (single, positive) weight_decay "
            "to derive it from; pass LOOTracker(prior_precision=...)"
        )

    def __call__(
        self,
        model: nn.Module,
        x: Tensor,
        y: Tensor,
        optimizer: Any = None,
        *,
        epoch: int | None = None,
    ) -> dict[str, Any]:
        """Estimate, append to :attr:`history` and return ``{"epoch", "posterior",
        "prior_precision", "n", "loo_nll", "train_nll", "loo_accuracy", "train_accuracy",
        "seconds"}`` (accuracies for classification). ``model`` is put in eval mode for the
        estimate and restored after."""
        import time

        _check_examples(x, y)
        start = time.perf_counter()
        if self.max_examples is not None and len(x) > self.max_examples:
            gen = torch.Generator().manual_seed(self.seed)
            keep = torch.randperm(len(x), generator=gen)[: self.max_examples].to(x.device)
            x, y = x[keep], y[keep.to(y.device)]
        was_training = model.training
        model.eval()
        try:
            own = getattr(optimizer, "posterior", None)
            if callable(own):
                import inspect

                q = own(model) if "model" in inspect.signature(own).parameters else own()
                name = f"{type(optimizer).__name__} posterior ({self.scope})"
                delta: float | None = None
                if self.scope == "all":
                    mp = memory_perturbation(
                        model, q, x, y, self.likelihood, covariance="full", correction=True
                    )
                else:
                    mp = _diagonal_last_layer_loo(model, q, x, y, self.likelihood)
            else:
                delta, how = self._delta(optimizer, len(x))
                name = f"last-layer full Laplace-GGN (delta: {how})"
                mp = last_layer_loo(model, x, y, delta, self.likelihood).perturbation
        finally:
            model.train(was_training)
        record: dict[str, Any] = {
            "epoch": len(self.history) if epoch is None else epoch,
            "posterior": name,
            "prior_precision": delta,
            "n": len(x),
            **mp.loo_summary(),
            "seconds": time.perf_counter() - start,
        }
        self.history.append(record)
        return record


def last_layer_remove(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    remove: Tensor,
    prior_precision: float,
    x_eval: Tensor,
    likelihood: str | Likelihood = "categorical",
) -> tuple[Tensor, Tensor]:
    r"""Outputs at ``x_eval`` before and after removing the examples ``remove`` from the
    training set, by one Newton step of the output layer (features held fixed).

    With the head's Laplace-GGN precision ``H = sum_n J_n^T Lambda_n J_n + delta I`` over all
    of ``(x, y)`` (:func:`last_layer_ggn`), ``S`` the removed set, ``H_S`` its part of the sum
    and ``g_S = sum_{i in S} J_i^T e_i`` its gradient, the head moves by

        ``d theta = (H - H_S)^{-1} g_S``

    (exact for a Gaussian likelihood; for one example it is :func:`last_layer_loo`'s step),
    and the outputs at ``x_eval`` become ``f + J d theta``.

    Args:
        model: ``[N, ...] -> [N, C]`` in eval mode, ending in an ``nn.Linear``.
        x: ``[N, ...]`` the training examples. y: ``[N]`` targets.
        remove: ``[N]`` bool, the examples removed (e.g. ``y == c``: a whole class).
        prior_precision: ``delta > 0``.
        x_eval: ``[M, ...]`` where to evaluate.

    Returns:
        ``(f_eval [M, C], f_eval_after [M, C])``.
    """
    _check_examples(x, y)
    check_tensor(remove, "remove", f"[N]=[{len(x)}] bool")
    if remove.dtype != torch.bool or remove.shape != (len(x),):
        raise ValueError(
            f"remove must be a bool tensor of shape [{len(x)}], got {remove.dtype} "
            f"{tuple(remove.shape)}"
        )
    if not (isinstance(prior_precision, int | float) and prior_precision > 0):
        raise ValueError(f"prior_precision must be a number > 0, got {prior_precision!r}")
    check_batch(x_eval, "x_eval")
    lik = get_likelihood(likelihood)
    phi, head = last_layer_features(model, x)
    phi_e, _ = last_layer_features(model, x_eval)
    with torch.no_grad():
        f, f_e = head(phi).double(), head(phi_e).double()
    bias = head.bias is not None
    phi, phi_e = _augment(phi, bias).double(), _augment(phi_e, bias).double()
    remove = remove.to(phi.device)
    y = y.to(f.device)
    c, d1 = f.shape[1], phi.shape[1]
    eye = torch.eye(c * d1, dtype=phi.dtype, device=phi.device)
    keep = ~remove
    h_keep = last_layer_ggn(phi[keep], f[keep], lik) + prior_precision * eye
    with torch.enable_grad():
        fr = f[remove].detach().requires_grad_(True)
        e_s = torch.autograd.grad(lik.nll(fr, y[remove]).sum(), fr)[0]  # [S, C]
    g_s = (e_s[:, :, None] * phi[remove][:, None, :]).sum(0).reshape(-1)  # sum J^T e
    step = torch.linalg.solve(h_keep, g_s).reshape(c, d1)
    dtype = x_eval.dtype if x_eval.is_floating_point() else f_e.dtype
    return f_e.to(dtype), (f_e + phi_e @ step.T).to(dtype)
