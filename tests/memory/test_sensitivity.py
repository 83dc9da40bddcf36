"""The memory-perturbation equation: every per-example quantity against dense float64
brute force for Laplace (diagonal, full) and IVON posteriors, and the leave-one-out
estimates against exact retraining of logistic regressions (exact to first order)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fromp
from fromp.likelihood import get_likelihood
from fromp.memory.sensitivity import memory_perturbation, newton_step_loo, prediction_variance
from fromp.optim import IVON
from fromp.testing import dense_jacobian, dense_nll_hessians, flat, forward_at, split
from tests.cases import tiny_cnn, tiny_mlp

D = torch.float64


def _posterior(kind: str, net: nn.Module, x: torch.Tensor, y: torch.Tensor):
    if kind == "laplace-diag":
        return fromp.fit_laplace(net, x, "categorical", prior_precision=0.5)
    if kind == "laplace-full":
        return fromp.fit_laplace(
            net, x, "categorical", prior_precision=0.5, hessian_structure="full"
        )
    opt = IVON(net.parameters(), lr=0.05, ess=len(x), hess_init=0.3, betas=(0.9, 0.9))
    for _ in range(3):
        with opt.sampled_params(train=True):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return opt.posterior(net)


def _dense_cov(q) -> torch.Tensor:
    if isinstance(q, fromp.DiagonalGaussian):
        return torch.diag(q.variance)
    return torch.linalg.inv(q.precision)


@pytest.mark.parametrize("kind", ["laplace-diag", "laplace-full", "ivon"])
@pytest.mark.parametrize("make", [tiny_mlp, tiny_cnn], ids=["mlp", "cnn"])
def test_every_quantity_against_dense(kind, make):
    torch.manual_seed(0)
    net = make().eval()
    x = torch.randn(7, 4, dtype=D) if make is tiny_mlp else torch.randn(7, 1, 6, 6, dtype=D)
    y = torch.randint(0, 3, (7,))
    q = _posterior(kind, net, x, y)
    with torch.no_grad():  # perturb the model: everything must use the posterior mean
        for p in net.parameters():
            p.add_(0.3)
    mp = memory_perturbation(net, q, x, y, chunk_size=3)  # 7 = 3 + 3 + 1: uneven chunks
    mp_full = memory_perturbation(net, q, x, y, covariance="full", chunk_size=64)

    jac = dense_jacobian(net, x, q.mean)  # N, C, P
    big_v = torch.einsum("ncp,pq,ndq->ncd", jac, _dense_cov(q), jac)
    v = torch.diagonal(big_v, dim1=-2, dim2=-1)
    f = forward_at(net, q.mean, x).detach()
    p = torch.softmax(f, -1)
    e = p - nn.functional.one_hot(y, 3).to(D)
    lam = torch.diagonal(dense_nll_hessians(get_likelihood("categorical"), f, y), dim1=1, dim2=2)
    torch.testing.assert_close(lam, p * (1 - p))
    s = torch.stack([sum(abs(e[i, k] * lam[i, k] * v[i, k]) for k in range(3)) for i in range(7)])
    tol = dict(rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(mp.logits, f, **tol)
    torch.testing.assert_close(mp.error, e, **tol)
    torch.testing.assert_close(mp.lam, lam, **tol)
    torch.testing.assert_close(mp.variance, v, **tol)
    torch.testing.assert_close(mp.covariance, big_v, **tol)
    torch.testing.assert_close(mp.sensitivity, s, **tol)
    torch.testing.assert_close(mp.loo_logits, f + e * v, **tol)
    torch.testing.assert_close(mp_full.loo_logits, f + torch.einsum("ncd,nd->nc", big_v, e), **tol)
    # the corrected forms: f + e v / (1 - lambda v) and f + V (I - Lambda V)^{-1} e
    # 1 - lambda v <= 0 can happen with an approximate posterior: refused, naming how many
    bad = int(((1 - lam * v) <= 0).any(-1).sum())
    if bad:
        with pytest.raises(ValueError, match=f"for {bad} of 7 examples"):
            memory_perturbation(net, q, x, y, correction=True)
    else:
        mp_c = memory_perturbation(net, q, x, y, correction=True)
        torch.testing.assert_close(mp_c.loo_logits, f + e * v / (1 - lam * v), **tol)
    mp_fc = memory_perturbation(net, q, x, y, covariance="full", correction=True)
    big_lam = dense_nll_hessians(get_likelihood("categorical"), f, y)
    want_fc = torch.stack(
        [f[i] + big_v[i] @ torch.linalg.inv(torch.eye(3, dtype=D) - big_lam[i] @ big_v[i]) @ e[i]
         for i in range(7)]
    )  # fmt: skip
    torch.testing.assert_close(mp_fc.loo_logits, want_fc, **tol)
    torch.testing.assert_close(prediction_variance(net, q, x, chunk_size=2), v, **tol)
    loo_nll = nn.functional.cross_entropy(f + e * v, y, reduction="none")
    torch.testing.assert_close(mp.loo_nll(), loo_nll, **tol)
    summary = mp.loo_summary()
    assert summary["loo_nll"] == pytest.approx(loo_nll.mean().item())
    assert summary["loo_accuracy"] == pytest.approx(((f + e * v).argmax(-1) == y).double().mean())
    assert summary["loo_nll"] >= summary["train_nll"]  # leaving an example out hurts it
    assert len(mp.to_dict()["sensitivity"]) == 7


def _fit(x: torch.Tensor, y: torch.Tensor, lik, c: int, delta: float, w0=None, iters: int = 30):
    """Minimise ``sum_i nll_i + delta/2 |w|^2`` of a linear model ``f = x W^T + b`` by Newton's
    method to machine precision; returns the flat ``[P]`` optimum."""
    d = x.shape[1]
    net = nn.Linear(d, c).to(D)
    w = flat(net).zero_() if w0 is None else w0.clone()

    def obj(v):
        return lik.nll(forward_at(net, v, x), y).sum() + 0.5 * delta * (v * v).sum()

    for _ in range(iters):
        g = torch.autograd.functional.jacobian(obj, w)
        h = torch.autograd.functional.hessian(obj, w)
        w = w - torch.linalg.lstsq(h, g.unsqueeze(1)).solution.squeeze(1)
        if g.abs().max() < 1e-12:
            break
    return w, net


@pytest.mark.parametrize("lik_name", ["bernoulli", "categorical"])
def test_leave_one_out_matches_exact_retraining_to_first_order(lik_name):
    """Removing one example of a (multinomial) logistic regression, retrained exactly: the
    change of its outputs is ``V_i e_i`` up to second-order terms (here < 10 % of the change,
    relatively smaller where the change is smaller), and the sensitivity ranks the examples
    as the true change does."""
    g = torch.Generator().manual_seed(0)
    n, d = 300, 3
    c = 1 if lik_name == "bernoulli" else 3
    lik = get_likelihood(lik_name)
    x = torch.randn(n, d, generator=g, dtype=D)
    w_true = torch.randn(max(c, 1), d, generator=g, dtype=D)
    f_true = x @ w_true.T
    if lik_name == "bernoulli":
        y = torch.bernoulli(torch.sigmoid(f_true[:, 0]), generator=g)
    else:
        y = torch.multinomial(torch.softmax(f_true, -1), 1, generator=g).squeeze(1)
    delta = 1.0
    w_star, net = _fit(x, y, lik, c, delta)
    with torch.no_grad():
        net.weight.copy_(w_star[: c * d].view(c, d))
        net.bias.copy_(w_star[c * d :])
    net.eval()
    q = fromp.fit_laplace(net, x, lik_name, prior_precision=delta, hessian_structure="full")
    mp = memory_perturbation(net, q, x, y, lik_name, covariance="full")
    idx = torch.argsort(mp.sensitivity, descending=True)[[0, 1, 2, 50, 150, 299]]
    true_shift, est_shift = [], []
    for i in idx.tolist():
        keep = torch.arange(n) != i
        w_i, _ = _fit(x[keep], y[keep], lik, c, delta, w0=w_star)
        f_loo = forward_at(net, w_i, x[i : i + 1]).detach()[0]
        true_shift.append(f_loo - mp.logits[i])
        est_shift.append(mp.loo_logits[i] - mp.logits[i])
    true_shift, est_shift = torch.stack(true_shift), torch.stack(est_shift)
    err = (est_shift - true_shift).norm(dim=1)
    true_size = true_shift.norm(dim=1)
    rel = err / true_size
    # removing the example's own curvature first is closer still (exact for linear-Gaussian)
    mp_c = memory_perturbation(net, q, x, y, lik_name, covariance="full", correction=True)
    err_c = (mp_c.loo_logits[idx] - mp_c.logits[idx] - true_shift).norm(dim=1)
    assert (err_c[:3] < err[:3]).all(), (err_c, err)
    assert (rel < 0.1).all(), (est_shift, true_shift)
    # the error is of second order: relatively smaller for the examples that move less
    assert rel[3:].max() < rel[:3].min(), rel
    assert true_size[:3].min() > true_size[3:].max()  # most sensitive moved most
    if lik_name == "bernoulli":  # C = 1: the diagonal form is the full one
        mp_diag = memory_perturbation(net, q, x, y, lik_name)
        torch.testing.assert_close(mp_diag.loo_logits, mp.loo_logits)


def test_bad_arguments():
    net = tiny_mlp().eval()
    x, y = torch.randn(4, 4, dtype=D), torch.randint(0, 3, (4,))
    q = fromp.DiagonalGaussian.isotropic(net, 1.0)
    with pytest.raises(ValueError, match="covariance"):
        memory_perturbation(net, q, x, y, covariance="dense")
    with pytest.raises(ValueError, match="y must"):
        memory_perturbation(net, q, x, y[:3])
    with pytest.raises(ValueError, match="chunk_size"):
        memory_perturbation(net, q, x, y, chunk_size=0)
    with pytest.raises(ValueError, match="posterior"):
        memory_perturbation(net, fromp.DiagonalGaussian.isotropic(torch.zeros(3), 1.0), x, y)


def _trained_tiny_mlp(delta: float):
    torch.manual_seed(1)
    net = tiny_mlp().eval()
    x, y = torch.randn(9, 4, dtype=D), torch.randint(0, 3, (9,))
    w = flat(net).requires_grad_(True)

    def obj(v):
        return nn.functional.cross_entropy(forward_at(net, v, x), y, reduction="sum") + (
            0.5 * delta * (v * v).sum()
        )

    opt = torch.optim.LBFGS([w], max_iter=500, tolerance_grad=1e-12, tolerance_change=0.0,
                            history_size=50, line_search_fn="strong_wolfe")  # fmt: skip

    def closure():
        opt.zero_grad()
        loss = obj(w)
        loss.backward()
        return loss

    opt.step(closure)
    w = w.detach()
    with torch.no_grad():
        for p, v in zip(net.parameters(), split(net, w).values()):
            p.copy_(v)
    return net, x, y, w, obj


@pytest.mark.parametrize("curvature", ["hessian", "ggn"])
@pytest.mark.parametrize("linearize", [False, True])
def test_newton_step_loo_against_dense(curvature, linearize):
    """``f(x_i; w* + (H - H_i)^{-1} g_i)`` with dense float64 autograd Hessians (the whole
    objective's for ``H``, the example's exact one or its GGN for ``H_i``)."""
    delta = 1.0
    net, x, y, w, obj = _trained_tiny_mlp(delta)
    big_h = torch.autograd.functional.hessian(obj, w)
    q = fromp.FullGaussian(w, big_h)
    got, steps = newton_step_loo(
        net, q, x, y, hess_approx=curvature, linearize=linearize, return_steps=True
    )
    jac = dense_jacobian(net, x, w)
    f = forward_at(net, w, x).detach()
    big_lam = dense_nll_hessians(get_likelihood("categorical"), f, y)
    want, want_steps = [], []
    for i in range(len(x)):

        def nll_i(v, i=i):
            return nn.functional.cross_entropy(forward_at(net, v, x[i : i + 1]), y[i : i + 1])

        g_i = torch.autograd.functional.jacobian(nll_i, w)
        if curvature == "hessian":
            h_i = torch.autograd.functional.hessian(nll_i, w)
        else:
            h_i = jac[i].T @ big_lam[i] @ jac[i]
        step = torch.linalg.solve(big_h - h_i, g_i)
        want_steps.append(step)
        if linearize:
            want.append(f[i] + jac[i] @ step)
        else:
            want.append(forward_at(net, w + step, x[i : i + 1]).detach()[0])
    want = torch.stack(want)
    assert (want - f).abs().max() > 0.1  # the examples do move
    torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(steps, torch.stack(want_steps), rtol=1e-7, atol=1e-9)
    if curvature == "ggn" and linearize:  # the corrected memory-perturbation form
        q_ggn = fromp.fit_laplace(
            net, x, "categorical", prior_precision=delta, hessian_structure="full"
        )
        mp = memory_perturbation(net, q_ggn, x, y, covariance="full", correction=True)
        got_ggn = newton_step_loo(net, q_ggn, x, y, hess_approx="ggn", linearize=True)
        torch.testing.assert_close(got_ggn, mp.loo_logits, rtol=1e-7, atol=1e-9)


def test_newton_step_loo_exact_for_ridge_regression():
    """Linear model, Gaussian likelihood, L2 prior: the leave-one-out objective is quadratic,
    so one Newton step is exact retraining (both curvatures coincide)."""
    g = torch.Generator().manual_seed(0)
    n, d, c, delta = 40, 3, 2, 0.5
    lik = get_likelihood("gaussian")
    x = torch.randn(n, d, generator=g, dtype=D)
    y = x @ torch.randn(d, c, generator=g, dtype=D) + torch.randn(n, c, generator=g, dtype=D)
    y[0] += 5.0  # an outlier: a large leave-one-out change
    w_star, net = _fit(x, y, lik, c, delta)
    with torch.no_grad():
        net.weight.copy_(w_star[: c * d].view(c, d))
        net.bias.copy_(w_star[c * d :])
    net.eval()
    q = fromp.fit_laplace(
        net, x, "gaussian", prior_precision=delta, hessian_structure="full"
    )  # GGN = Hessian here
    idx = [0, 1, 2]
    got = newton_step_loo(net, q, x[idx], y[idx], "gaussian")
    for k, i in enumerate(idx):
        keep = torch.arange(n) != i
        w_i, _ = _fit(x[keep], y[keep], lik, c, delta, w0=w_star)
        torch.testing.assert_close(got[k], forward_at(net, w_i, x[i : i + 1]).detach()[0])
    assert (got[0] - net(x[:1])[0]).abs().max() > 0.5


def test_newton_step_loo_bad_arguments():
    net = tiny_mlp().eval()
    x, y = torch.randn(4, 4, dtype=D), torch.randint(0, 3, (4,))
    with pytest.raises(ValueError, match="FullGaussian"):
        newton_step_loo(net, fromp.DiagonalGaussian.isotropic(net, 1.0), x, y)
    q = fromp.fit_laplace(net, x, "categorical", prior_precision=1.0, hessian_structure="full")
    with pytest.raises(ValueError, match="hess_approx"):
        newton_step_loo(net, q, x, y, hess_approx="fisher")
    small = fromp.FullGaussian(torch.zeros(3, dtype=D), torch.eye(3, dtype=D))
    with pytest.raises(ValueError, match="posterior must be over the model's P="):
        newton_step_loo(net, small, x, y)


def test_newton_step_loo_default_tolerance_is_reached_in_float32(monkeypatch):
    """In float32 the default tolerance follows the dtype: GMRES stops after at most
    ``C + 1`` steps per example (the rank of the GGN term plus one), as in float64, instead
    of running to ``max_iter``; the result agrees with float64."""
    import fromp.memory.sensitivity as sens

    net, x, y, _, _ = _trained_tiny_mlp(1.0)
    q64 = fromp.fit_laplace(net, x, "categorical", prior_precision=1.0, hessian_structure="full")
    want = newton_step_loo(net, q64, x, y, hess_approx="ggn")
    net32 = net.float()
    q32 = fromp.FullGaussian(q64.mean.float(), q64.precision.float())
    steps = []
    real = sens._gmres

    def counting(apply, b, tol, max_iter):
        n = [0]

        def counted(v):
            n[0] += 1
            return apply(v)

        out = real(counted, b, tol, max_iter)
        steps.append(n[0])
        return out

    monkeypatch.setattr(sens, "_gmres", counting)
    got = newton_step_loo(net32, q32, x.float(), y, hess_approx="ggn")
    c = want.shape[1]
    assert max(steps) <= c + 1, steps
    torch.testing.assert_close(got.double(), want, rtol=1e-3, atol=1e-4)
