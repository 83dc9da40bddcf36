"""The dense references of :mod:`fromp.testing` (and the test-only ones of ``cases``) checked
against closed forms, so that the reference every other test trusts is itself checked by an
independent route: linear regression (``J = x``, ``GGN = X^T X / sigma^2``, the Bayesian
linear-regression posterior and predictive), logistic regression (``Lambda = p (1 - p)``),
softmax regression (``Lambda = diag(p) - p p^T``), FROMP's regulariser on a linear model,
EWC's penalty by hand; and the shared networks (seeds, one set of factories)."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import fromp.testing as ft
from tests import cases

F64 = torch.float64


class _GaussNLL:
    """``0.5 ||y - f||^2 / sigma^2`` (constants dropped): written here, not fromp's."""

    def __init__(self, sigma: float) -> None:
        self.sigma = sigma

    def nll(self, f, y):
        return 0.5 * ((f - y) ** 2).sum(-1) / self.sigma**2


class _BernoulliNLL:
    def nll(self, f, y):
        return nn.functional.binary_cross_entropy_with_logits(f, y, reduction="none").sum(-1)


class _SoftmaxNLL:
    def nll(self, f, y):
        return nn.functional.cross_entropy(f, y, reduction="none")


def _linear(d: int, c: int, bias: bool, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(d, c, bias=bias).double()


def test_jacobian_of_a_linear_model_is_the_input():
    x = torch.randn(6, 3, dtype=F64)
    net = _linear(3, 2, bias=True)
    j = ft.dense_jacobian(net, x)  # weights [2, 3] row-major, then bias [2]
    assert j.shape == (6, 2, 8)
    want = torch.zeros(6, 2, 8, dtype=F64)
    for c in range(2):
        want[:, c, 3 * c : 3 * c + 3] = x
        want[:, c, 6 + c] = 1.0
    torch.testing.assert_close(j, want, rtol=0, atol=1e-14)


@pytest.mark.parametrize("sigma", [1.0, 0.3])
def test_linear_regression_ggn_posterior_and_predictive(sigma):
    x, y, _ = cases.toy_regression(15, 3, seed=2)
    net = _linear(3, 1, bias=False)
    ggn = ft.dense_ggn(net, x, _GaussNLL(sigma), y=y)
    torch.testing.assert_close(ggn, x.T @ x / sigma**2, rtol=1e-12, atol=1e-12)
    delta = 0.7
    cov = ft.dense_posterior_covariance(ggn, delta)
    # Bayesian linear regression through a QR of the stacked system [X / sigma; sqrt(delta) I]
    _, r = torch.linalg.qr(torch.cat([x / sigma, math.sqrt(delta) * torch.eye(3, dtype=F64)]))
    r_inv = torch.linalg.solve_triangular(r, torch.eye(3, dtype=F64), upper=True)
    torch.testing.assert_close(cov, r_inv @ r_inv.T, rtol=1e-10, atol=1e-12)
    # per-parameter prior precision
    vec = torch.tensor([0.5, 1.0, 2.0], dtype=F64)
    torch.testing.assert_close(
        ft.dense_posterior_covariance(ggn, vec).inverse(), x.T @ x / sigma**2 + torch.diag(vec)
    )
    xs = torch.randn(4, 3, dtype=F64)
    mean, var = ft.dense_predictive(net, xs, cov)
    torch.testing.assert_close(mean, xs @ net.weight.detach().T)
    want = torch.stack([xs[n] @ cov @ xs[n] for n in range(4)])
    torch.testing.assert_close(var[:, 0, 0], want, rtol=1e-12, atol=1e-14)


def test_logistic_regression_lambda_is_p_one_minus_p():
    x, _ = cases.toy_classification(12, 3, 2, seed=3)
    net = _linear(3, 1, bias=True)
    with torch.no_grad():
        f = net(x)
    y = (torch.rand(12, 1, dtype=F64) > 0.5).double()
    p = torch.sigmoid(f)
    lam = ft.dense_nll_hessians(_BernoulliNLL(), f, y)
    torch.testing.assert_close(lam[:, 0, 0], (p * (1 - p))[:, 0], rtol=1e-12, atol=1e-14)
    ggn = ft.dense_ggn(net, x, _BernoulliNLL(), y=y)
    xb = torch.cat([x, torch.ones(12, 1, dtype=F64)], 1)
    want = xb.T @ (p * (1 - p) * xb)
    torch.testing.assert_close(ggn, want, rtol=1e-12, atol=1e-12)


def test_softmax_lambda_is_diag_p_minus_p_p_transpose():
    f = torch.randn(5, 4, dtype=F64)
    y = torch.randint(0, 4, (5,))
    lam = ft.dense_nll_hessians(_SoftmaxNLL(), f, y)
    p = torch.softmax(f, -1)
    want = torch.diag_embed(p) - p.unsqueeze(2) * p.unsqueeze(1)
    torch.testing.assert_close(lam, want, rtol=1e-12, atol=1e-14)


def test_kernel_with_identity_covariance_is_the_input_inner_product():
    x1, x2 = torch.randn(3, 4, dtype=F64), torch.randn(2, 4, dtype=F64)
    net = _linear(4, 1, bias=False)
    k = ft.dense_kernel(
        ft.dense_jacobian(net, x1), torch.eye(4, dtype=F64), ft.dense_jacobian(net, x2)
    )
    torch.testing.assert_close(k[:, 0, :, 0], x1 @ x2.T, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kernel", ["per_class", "joint"])
def test_fromp_penalty_of_a_linear_regression_is_its_closed_form(kernel):
    """Identity link, one output: ``K = X diag(v) X^T + j I``, ``r = X (w_new - w_old)``."""
    x = torch.randn(5, 3, dtype=F64)
    net = _linear(3, 1, bias=False)
    w_old = ft.flat(net)
    w_new = w_old + torch.tensor([0.3, -0.2, 0.5], dtype=F64)
    v = torch.tensor([0.5, 2.0, 1.0], dtype=F64)
    got = cases.dense_fromp_penalty(
        net, x, w_old, v, w_new, kernel=kernel, jitter=0.1, link="identity"
    )
    k = x @ torch.diag(v) @ x.T + 0.1 * torch.eye(5, dtype=F64)
    r = x @ (w_new - w_old)
    want = 0.5 * r @ torch.linalg.solve(k, r)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)
    ident = cases.dense_fromp_penalty(net, x, w_old, v, w_new, kernel="identity", link="identity")
    torch.testing.assert_close(ident, 0.5 * (r * r).sum())


def test_fromp_penalty_softmax_per_class_uses_lambda_j():
    """Softmax link on a linear model: ``dp_c/dw = (Lambda J)_c`` with ``Lambda = diag(p) -
    p p^T`` and ``J`` the input, written out by hand."""
    x = torch.randn(4, 2, dtype=F64)
    net = _linear(2, 3, bias=False)
    w_old = ft.flat(net)
    w_new = w_old + 0.1 * torch.randn(6, dtype=F64)
    v = torch.rand(6, dtype=F64) + 0.5
    got = cases.dense_fromp_penalty(net, x, w_old, v, w_new, jitter=1e-3)
    p_old = torch.softmax(x @ w_old.view(3, 2).T, -1)
    p_new = torch.softmax(x @ w_new.view(3, 2).T, -1)
    want = torch.zeros((), dtype=F64)
    for c in range(3):
        # d p_c / d W[k, :] = (delta_ck p_c - p_c p_k) x
        g = torch.stack(
            [
                torch.cat(
                    [((c == k) * p_old[m, c] - p_old[m, c] * p_old[m, k]) * x[m] for k in range(3)]
                )
                for m in range(4)
            ]
        )
        kk = g @ torch.diag(v) @ g.T + 1e-3 * torch.eye(4, dtype=F64)
        r = p_new[:, c] - p_old[:, c]
        want = want + 0.5 * r @ torch.linalg.solve(kk, r)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-14)


def test_ewc_penalty_by_hand():
    w = torch.tensor([1.0, 2.0], dtype=F64)
    anchors = [torch.zeros(2, dtype=F64), torch.tensor([1.0, 1.0], dtype=F64)]
    fishers = [torch.tensor([1.0, 3.0], dtype=F64), torch.tensor([2.0, 0.5], dtype=F64)]
    # task 0: 1*1 + 3*4 = 13; task 1: 2*0 + 0.5*1 = 0.5; times lambda / B
    assert float(cases.dense_ewc_penalty(w, anchors, fishers, 2.0)) == pytest.approx(27.0)
    assert float(cases.dense_ewc_penalty(w, anchors, fishers, 2.0, 4)) == pytest.approx(6.75)


def test_factories_are_seeded_and_leave_the_global_generator_alone():
    torch.manual_seed(5)
    before = torch.get_rng_state()
    a = cases.tiny_mlp(seed=3)
    assert torch.equal(torch.get_rng_state(), before)
    torch.testing.assert_close(ft.flat(a), ft.flat(cases.tiny_mlp(seed=3)), rtol=0, atol=0)
    assert not torch.equal(ft.flat(a), ft.flat(cases.tiny_mlp(seed=4)))
    for make in (cases.tiny_cnn, cases.multihead_mlp, cases.conv_zoo):
        torch.testing.assert_close(ft.flat(make(seed=1)), ft.flat(make(seed=1)), rtol=0, atol=0)
    # with and without batch norm the convolutions and the linear layer are drawn alike
    bn, plain = cases.tiny_cnn(seed=2), cases.tiny_cnn(batch_norm=False, seed=2)
    assert plain.bn is None and not bn.training
    for name in ("conv1", "conv2", "fc"):
        torch.testing.assert_close(getattr(bn, name).weight, getattr(plain, name).weight)
    assert ft.dense_jacobian(bn, torch.randn(2, 1, 6, 6, dtype=F64)).shape[:2] == (2, 3)


def test_net_cases_cover_every_kind_with_matching_inputs():
    for kind in cases.NETS:
        case = cases.NetCase(kind)
        out = case.head(0)(case.inputs(3))
        assert out.shape == (3, 3) and out.dtype == F64, kind
        torch.testing.assert_close(ft.flat(cases.NetCase(kind).net), ft.flat(case.net))
    assert cases.NetCase("multihead").n_heads == 3
    with pytest.raises(ValueError, match="kind must be one of"):
        cases.NetCase("rnn")


def test_the_reference_uses_no_fromp_engine():
    """fromp.testing imports nothing from fromp: its references share no engine with what
    they check."""
    tree = ast.parse(Path(ft.__file__).read_text())
    mods = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module)
        elif isinstance(node, ast.Import):
            mods |= {a.name for a in node.names}
    assert {m for m in mods if m.split(".")[0] == "fromp"} == set()
