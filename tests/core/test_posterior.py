"""Gaussian posteriors (fromp.posterior): immutability, ``replace`` rebuilding the Cholesky
factor (dense float64 check), the GaussianPosterior protocol that GP is typed against."""

from __future__ import annotations

import dataclasses
import importlib
import math

import pytest
import torch

from fromp import GP, DiagonalGaussian, FullGaussian
from fromp.posterior import GaussianPosterior
from fromp.testing import dense_jacobian, dense_kernel, flat
from tests.cases import tiny_mlp

F64 = torch.float64


def _spd(p: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(p, p, generator=g, dtype=F64) / math.sqrt(p)
    return a @ a.T + 0.5 * torch.eye(p, dtype=F64)


def _both(p: int = 5):
    mean = torch.randn(p, dtype=F64)
    return [DiagonalGaussian(mean, torch.rand(p, dtype=F64) + 0.5), FullGaussian(mean, _spd(p, 0))]


@pytest.mark.parametrize("q", _both(), ids=["diagonal", "full"])
def test_setting_or_deleting_a_field_raises(q):
    before = q.precision.clone()
    for name in ("precision", "mean", "_chol", "anything"):
        with pytest.raises(dataclasses.FrozenInstanceError, match=r"immutable.*\.replace\("):
            setattr(q, name, torch.zeros(1))
    with pytest.raises(dataclasses.FrozenInstanceError, match="immutable"):
        del q.precision
    assert torch.equal(q.precision, before)


def test_full_replace_rebuilds_cholesky_and_covariance():
    p = 6
    q = FullGaussian(torch.randn(p, dtype=F64), _spd(p, 1))
    old_cov = q.covariance.clone()
    new_prec = _spd(p, 2)
    q2 = q.replace(precision=new_prec)
    cov = torch.linalg.inv(new_prec)
    torch.testing.assert_close(q2.covariance, cov)
    torch.testing.assert_close(q2.variance, torch.diagonal(cov))
    chol = q2.precision_cholesky
    torch.testing.assert_close(chol @ chol.T, new_prec)
    torch.testing.assert_close(q2.log_det_precision(), torch.logdet(new_prec))
    assert torch.equal(q2.mean, q.mean)
    torch.testing.assert_close(q.covariance, old_cov)  # the original is untouched
    q3 = q.with_precision(4 * torch.eye(p, dtype=F64))
    torch.testing.assert_close(q3.covariance, 0.25 * torch.eye(p, dtype=F64))
    with pytest.raises(ValueError, match="symmetric positive definite"):
        q.replace(precision=-new_prec)


def test_full_new_mean_or_detach_shares_the_factor_and_stays_exact():
    """``replace(mean=)`` and ``detach()`` keep the precision's Cholesky factor (no
    factorisation: a predictive at other weights) and give what a Gaussian built from
    nothing gives: covariance, whitening and samples against dense float64 ones; a wrong
    mean is refused as the constructor refuses it."""
    p = 6
    prec = _spd(p, 3).requires_grad_()
    q = FullGaussian(torch.randn(p, dtype=F64), prec)
    new_mean = torch.randn(p, dtype=F64)
    calls = []
    real = torch.linalg.cholesky_ex
    torch.linalg.cholesky_ex = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        moved, detached = q.replace(mean=new_mean), q.detach()
    finally:
        torch.linalg.cholesky_ex = real
    assert calls == []
    assert moved.precision_cholesky is q.precision_cholesky and not detached.precision.requires_grad
    fresh = FullGaussian(new_mean, prec.detach())
    cov = torch.linalg.inv(prec.detach())
    jac = torch.randn(4, p, dtype=F64)
    for r in (moved, detached):
        torch.testing.assert_close(r.covariance, cov)
        torch.testing.assert_close(r.whiten(jac) @ r.whiten(jac).T, jac @ cov @ jac.T)
    assert torch.equal(moved.mean, new_mean) and torch.equal(detached.mean, q.mean)
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    torch.testing.assert_close(moved.sample(3, generator=g1), fresh.sample(3, generator=g2))
    with pytest.raises(ValueError, match=r"mean must have shape \[P\]"):
        q.replace(mean=torch.zeros(p + 1, dtype=F64))
    with pytest.raises(ValueError, match="mean"):
        q.replace(mean=torch.full((p,), float("nan"), dtype=F64))


def test_diagonal_replace_and_whiten():
    p = 5
    q = DiagonalGaussian(torch.zeros(p, dtype=F64), torch.ones(p, dtype=F64))
    prec = torch.rand(p, dtype=F64) + 0.5
    q2 = q.with_precision(prec)
    torch.testing.assert_close(q2.variance, 1 / prec)
    torch.testing.assert_close(q.variance, torch.ones(p, dtype=F64))
    j = torch.randn(3, 2, p, dtype=F64)
    a = q2.whiten(j)
    torch.testing.assert_close(
        torch.einsum("ncp,mdp->ncmd", a, a), torch.einsum("ncp,p,mdp->ncmd", j, 1 / prec, j)
    )
    torch.testing.assert_close(q2.log_det_precision(), prec.log().sum())
    with pytest.raises(ValueError, match="strictly positive"):
        q.replace(precision=-prec)


def test_both_satisfy_the_protocol_and_laplace_reexports_full():
    for q in _both():
        assert isinstance(q, GaussianPosterior)
        assert isinstance(q.replace(mean=q.mean + 1), type(q))
    assert not isinstance(torch.zeros(3), GaussianPosterior)
    assert importlib.import_module("fromp.posterior").FullGaussian is FullGaussian


class _DenseCovariance:
    """A third implementation of the protocol (dense covariance, eigen square root): GP must
    use only the protocol, not the concrete classes."""

    def __init__(self, mean: torch.Tensor, cov: torch.Tensor) -> None:
        self.mean, self.cov = mean, cov
        evals, evecs = torch.linalg.eigh(cov)
        self._root = evecs * evals.sqrt()  # root @ root.T = cov

    num_params = property(lambda self: self.mean.numel())
    variance = property(lambda self: torch.diagonal(self.cov))

    def whiten(self, jac):
        return jac @ self._root.to(jac)

    def log_det_precision(self):
        return -torch.logdet(self.cov)

    def sample(self, n=None, *, generator=None):
        raise NotImplementedError

    def replace(self, **changes):
        return _DenseCovariance(changes.get("mean", self.mean), changes.get("cov", self.cov))

    def to(self, *args, **kwargs):
        return _DenseCovariance(self.mean.to(*args, **kwargs), self.cov.to(*args, **kwargs))

    def detach(self):
        return _DenseCovariance(self.mean.detach(), self.cov.detach())

    def state_dict(self):
        return {"mean": self.mean, "cov": self.cov}


@pytest.mark.parametrize("kind", ["full", "dense_protocol"])
def test_gp_kernel_after_replace_matches_dense(kind):
    """A GP over ``q.replace(precision=P2)`` uses P2's covariance, not the old factor."""
    model = tiny_mlp().double().eval()
    p = sum(t.numel() for t in model.parameters())
    x = torch.randn(4, 4, dtype=F64)
    new_prec = _spd(p, 4)
    cov = torch.linalg.inv(new_prec)
    if kind == "full":
        q = FullGaussian(flat(model), _spd(p, 3)).replace(precision=new_prec)
    else:
        q = _DenseCovariance(flat(model), cov)
    assert isinstance(q, GaussianPosterior)
    j = dense_jacobian(model, x)
    ref = dense_kernel(j, cov, j)
    torch.testing.assert_close(GP(model, q, "categorical").kernel(x), ref, rtol=1e-9, atol=1e-12)
