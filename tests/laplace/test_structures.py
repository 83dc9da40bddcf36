"""The fast paths of the Laplace structures against their plain forms in float64: the full
Laplace's first evidence (a Cholesky factorisation) and later ones (an eigendecomposition),
against ``slogdet``; the Kronecker Laplace's functional variance from factored Jacobian rows
(``Linear``), from rotated factors (a convolution with few positions) and from rotated
products (many positions), against the dense ``J Sigma J^T``; the Kronecker factors
accumulated over several batches against one batch."""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call, jacrev

from fromp import Laplace
from fromp.curvature.kron import kron_curvature
from fromp.likelihood import CategoricalLikelihood

F64 = torch.float64


def _net() -> nn.Module:
    torch.manual_seed(0)
    # conv 1: 16 positions, in' = 9 (rotating the product is cheaper); conv 2: one position
    # (rotating the factors is cheaper); then Linear layers (factored rows)
    return nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Conv2d(2, 3, 4), nn.Tanh(), nn.Flatten(),
        nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3),
    ).to(F64).eval()  # fmt: skip


def _data(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 6, 6, generator=g, dtype=F64), torch.randint(0, 3, (n,), generator=g)


def _dense_jacobian(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    params = {k: v.detach() for k, v in net.named_parameters()}
    jac = jacrev(lambda p: functional_call(net, p, (x,)))(params)
    return torch.cat([jac[k].reshape(len(x), -1, params[k].numel()) for k in params], -1)


def test_kron_variance_paths_against_dense():
    net = _net()
    x, y = _data(7)
    la = Laplace(net, "classification", "all", "kron", prior_precision=0.3).fit([(x, y)])
    xt, _ = _data(5, seed=2)
    j = _dense_jacobian(net, xt)  # [N, C, P]
    want = torch.einsum("ncp,pq,ndq->ncd", j, la.posterior_covariance, j)
    got = la.functional_variance_at(xt)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # the kernel (unfactored rows: both convolution paths) agrees with the variance
    k = la.gp().kernel(xt)
    torch.testing.assert_close(torch.einsum("ncnd->ncd", k), want, rtol=1e-10, atol=1e-12)


def test_full_evidence_first_and_later_calls():
    net = _net()
    x, y = _data(9)
    la = Laplace(net, "classification", "all", "full", prior_precision=0.5).fit([(x, y)])
    first = la.log_marginal_likelihood()  # Cholesky
    second = la.log_marginal_likelihood()  # eigendecomposition, cached
    third = la.log_marginal_likelihood(torch.tensor(2.0))
    torch.testing.assert_close(first, second, rtol=1e-12, atol=0)
    prec = la.H + 2.0 * torch.eye(len(la.H), dtype=F64)
    delta = torch.full((len(la.H),), 2.0, dtype=F64)
    want = (la.log_likelihood - 0.5 * (2.0 * (la.mean**2).sum() + torch.slogdet(prec)[1]
            - delta.log().sum()))  # fmt: skip
    torch.testing.assert_close(third, want, rtol=1e-12, atol=0)
    # differentiable in delta through both paths
    d = torch.tensor(0.5, dtype=F64, requires_grad=True)
    la._fitted()
    (g1,) = torch.autograd.grad(la.log_marginal_likelihood(d), d)
    (g2,) = torch.autograd.grad(la.log_marginal_likelihood(d), d)
    torch.testing.assert_close(g1, g2, rtol=1e-10, atol=0)


def test_kron_factors_over_batches_equal_one_batch():
    net = _net()
    x, y = _data(12)
    lik = CategoricalLikelihood()
    one = kron_curvature(net, [(x, y)], lik)
    many = kron_curvature(net, [(x[:5], y[:5]), (x[5:], y[5:])], lik)
    for a, b in zip(one.blocks, many.blocks):
        torch.testing.assert_close(a.A, b.A, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(a.B, b.B, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(a.B_bias, b.B_bias, rtol=1e-12, atol=1e-14)


def test_full_covariance_cache_follows_the_prior_and_the_fit():
    net = _net()
    x, y = _data(9)
    for subset in ("all", "last_layer"):
        la = Laplace(net, "classification", subset, "full", prior_precision=0.5).fit([(x, y)])

        def dense(la=la) -> torch.Tensor:
            return torch.linalg.inv(la.posterior_precision)

        torch.testing.assert_close(la.posterior_covariance, dense())
        la.posterior_covariance.mul_(0)  # a returned copy: the cache is not touched
        torch.testing.assert_close(la.posterior_covariance, dense())
        la.prior_precision = 3.0
        torch.testing.assert_close(la.posterior_covariance, dense())
        la.prior_precision.mul_(2)  # in place: seen through the tensor's version
        torch.testing.assert_close(la.posterior_covariance, dense())
        la.temperature = 0.5
        torch.testing.assert_close(la.posterior_covariance, dense())
        la.fit([(x[:4], y[:4])], override=False)
        torch.testing.assert_close(la.posterior_covariance, dense())
        torch.testing.assert_close(la.posterior_variance, torch.diagonal(dense()))


def test_float32_evidence_has_no_cancellation():
    """``log det(G + D) - log det D`` over millions of parameters in float32: as a sum of
    ``log1p(lambda / delta)`` it keeps float32 accuracy (as two sums of ``P`` logarithms it
    lost about three digits: ~6e-4 relative on ResNet-18)."""
    from fromp.curvature.kron import KronBlock, KronCurvature

    torch.manual_seed(0)
    net = nn.Linear(2048, 1024).eval()  # 2.1M parameters
    g = torch.Generator().manual_seed(0)
    h = torch.rand(net.weight.numel() + 1024, generator=g) * 1e-3
    ref = torch.log1p(h.double() / 30.0).sum()
    la = Laplace(net, "classification", "all", "diag", prior_precision=30.0)
    la.use_curvature(h, 100)
    assert la.log_det_ratio_at().dtype == torch.float32
    assert abs(float(la.log_det_ratio_at()) - float(ref)) < 1e-4 * abs(float(ref))
    a = torch.rand(2048, generator=g)
    b = torch.rand(1024, generator=g) * 1e-3
    bb = torch.rand(1024, generator=g) * 1e-3
    names = [["weight", "bias"]]
    curv = KronCurvature([KronBlock(torch.diag(a), torch.diag(b), torch.diag(bb), 100)], names, 100)
    la = Laplace(net, "classification", "all", "kron", prior_precision=30.0)
    la.use_curvature(curv, 100)
    ref = torch.log1p(torch.outer(b, a).double() / 30).sum() + torch.log1p(bb.double() / 30).sum()
    assert abs(float(la.log_det_ratio_at()) - float(ref)) < 1e-4 * abs(float(ref))


def test_a_factor_torch_cannot_decompose_goes_to_the_mrrr_solver(monkeypatch):
    """torch's eigh failing (a large degenerate factor): LAPACK's MRRR solver in the same
    dtype gives the decomposition, without the float64 retry."""
    import pytest

    from fromp.curvature import kron

    pytest.importorskip("scipy")
    u = torch.randn(60, 4, dtype=torch.float32)
    m = u @ u.T  # rank 4: 56 equal (zero) eigenvalues
    calls: list = []

    def failing(a, *args, **kwargs):
        calls.append(a.dtype)
        raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")

    monkeypatch.setattr(torch.linalg, "eigh", failing)
    vals, vecs = kron._eigh(m)
    assert calls == [torch.float32] and vals.dtype == vecs.dtype == torch.float32
    torch.testing.assert_close(vecs @ torch.diag(vals) @ vecs.T, m, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(vecs.T @ vecs, torch.eye(60), rtol=0, atol=1e-5)


def test_full_posterior_factor_is_computed_once_and_follows_the_prior_and_the_fit(monkeypatch):
    """The all-weights full Laplace factorises its ``P x P`` precision once for every
    predictive call, kernel and posterior until the fit, the prior precision (also changed
    in place) or the temperature change: the functional variance against the dense ``J
    Sigma J^T`` after each change, and no Cholesky factorisation in a repeated call."""
    net = _net()
    x, y = _data(9)
    xt, _ = _data(4, seed=3)
    la = Laplace(net, "classification", "all", "full", prior_precision=0.5).fit([(x, y)])
    calls = []
    real = torch.linalg.cholesky_ex
    monkeypatch.setattr(
        torch.linalg, "cholesky_ex", lambda *a, **k: calls.append(1) or real(*a, **k)
    )

    def check() -> None:
        j = _dense_jacobian(net, xt)
        cov = torch.linalg.inv(la.posterior_precision)
        want = torch.einsum("ncp,pq,ndq->ncd", j, cov, j)
        torch.testing.assert_close(la.functional_variance_at(xt), want, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(la.posterior.covariance, cov)

    check()
    assert len(calls) == 1
    la(xt), la.gp().kernel(xt), la.posterior.mean.mul_(0)  # a returned copy: the cache stays
    check()
    assert len(calls) == 1
    for change in (lambda: setattr(la, "prior_precision", 3.0),
                   lambda: la.prior_precision.mul_(2),
                   lambda: setattr(la, "temperature", 0.5),
                   lambda: la.fit([(x[:4], y[:4])], override=False)):  # fmt: skip
        change()
        before = len(calls)
        check()
        check()
        assert len(calls) == before + 1
