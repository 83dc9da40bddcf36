"""DNN2GP (fromp.gp): kernel and variances against dense J Sigma J^T, the linearised-Laplace
predictive, exact Bayesian linear regression, the evidence and prior-precision search."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fromp import DiagonalGaussian, FullGaussian, dnn2gp, fit_laplace
from fromp.gp.process import GP
from fromp.laplace.one_call import (
    log_evidence_grid,
    log_marginal_likelihood,
    optimize_prior_precision,
)
from fromp.likelihood import BernoulliLikelihood, CategoricalLikelihood, GaussianLikelihood
from fromp.models import MultiHeadMLP, with_task
from fromp.testing import dense_jacobian, dense_kernel, flat, forward_at
from tests.cases import conv_zoo, tiny_cnn, tiny_mlp

F64 = torch.float64


def _random_posterior(p: int, full: bool):
    mean = torch.randn(p, dtype=F64) * 0.5
    if full:
        a = torch.randn(p, p, dtype=F64) / math.sqrt(p)
        return FullGaussian(mean, a @ a.T + 0.5 * torch.eye(p, dtype=F64))
    return DiagonalGaussian(mean, torch.rand(p, dtype=F64) + 0.5)


def _cov(post) -> torch.Tensor:
    return post.covariance if isinstance(post, FullGaussian) else torch.diag(post.variance)


MODELS = {
    "mlp": (lambda: tiny_mlp(c=3), (4,)),
    "cnn_bn": (lambda: tiny_cnn(c=3), (1, 6, 6)),
    "multihead": (lambda: with_task(MultiHeadMLP(4, (5,), 3, 2).double(), 1), (4,)),
}


@pytest.fixture(params=[(m, full) for m in sorted(MODELS) for full in (False, True)],
                ids=lambda v: f"{v[0]}-{'full' if v[1] else 'diag'}")  # fmt: skip
def setup(request):
    name, full = request.param
    make, shape = MODELS[name]
    model = make()
    p = sum(q.numel() for q in model.parameters())
    post = _random_posterior(p, full)
    x1 = torch.randn(5, *shape, dtype=F64)
    x2 = torch.randn(3, *shape, dtype=F64)
    return model, post, x1, x2


@pytest.mark.parametrize("method", ["jacobian", "structured"])
def test_kernel_matches_dense_at_posterior_mean(setup, method):
    model, post, x1, x2 = setup
    gp = dnn2gp(model, post, "categorical", chunk_size=2)
    if method == "structured" and isinstance(post, FullGaussian):
        with pytest.raises(ValueError, match="needs a DiagonalGaussian"):
            gp.kernel(x1, method=method)
        method = "auto"  # falls back to the Jacobian way
    # the module's own weights are NOT the posterior mean: everything must use the mean
    j1 = dense_jacobian(model, x1, post.mean)
    j2 = dense_jacobian(model, x2, post.mean)
    cov = _cov(post)
    ref12, ref11 = dense_kernel(j1, cov, j2), dense_kernel(j1, cov, j1)
    torch.testing.assert_close(gp.mean(x1), forward_at(model, post.mean, x1))
    assert not torch.allclose(gp.mean(x1), model(x1))
    torch.testing.assert_close(gp.kernel(x1, x2, method=method), ref12, rtol=1e-9, atol=1e-12)
    for cache in (0, 1 << 30):  # recomputed chunks and cached chunks
        k11 = gp.kernel(x1, chunk_size=2, max_cache_bytes=cache, method=method)
        torch.testing.assert_close(k11, ref11, rtol=1e-9, atol=1e-12)
    kd = gp.kernel(x1, x2, diagonal_outputs=True, chunk_size=4, method=method)
    c = ref12.shape[1]
    torch.testing.assert_close(
        kd, torch.stack([ref12[:, i, :, i] for i in range(c)]), rtol=1e-9, atol=1e-12
    )
    kd11 = gp.kernel(x1, diagonal_outputs=True, chunk_size=2, max_cache_bytes=0, method=method)
    torch.testing.assert_close(
        kd11, torch.stack([ref11[:, i, :, i] for i in range(c)]), rtol=1e-9, atol=1e-12
    )
    flat11 = k11.reshape(len(x1) * c, len(x1) * c)
    assert torch.equal(flat11, flat11.T)  # exactly symmetric
    assert torch.linalg.eigvalsh(flat11).min() > -1e-10  # PSD
    var = gp.variance(x1, chunk_size=3)
    torch.testing.assert_close(
        var, torch.stack([ref11[n, :, n, :] for n in range(len(x1))]), rtol=1e-9, atol=1e-12
    )


def test_variance_equals_linearised_laplace_monte_carlo():
    model = tiny_mlp(c=3)
    post = fit_laplace(model, torch.randn(30, 4, dtype=F64), "categorical", 2.0)
    gp = dnn2gp(model, post, "categorical")
    xs = torch.randn(4, 4, dtype=F64)
    jac = dense_jacobian(model, xs)
    w = post.sample(20000, generator=torch.Generator().manual_seed(1))
    f_lin = model(xs).detach() + torch.einsum("ncp,sp->snc", jac, w - post.mean)
    emp = torch.einsum("snc,snd->ncd", f_lin - f_lin.mean(0), f_lin - f_lin.mean(0)) / len(w)
    torch.testing.assert_close(gp.variance(xs), emp, rtol=0.06, atol=0.02 * emp.abs().max())
    torch.testing.assert_close(gp.mean(xs), f_lin.mean(0), rtol=0, atol=0.05)


def test_predictive_classification():
    model = tiny_mlp(c=3)
    post = fit_laplace(model, torch.randn(10, 4, dtype=F64), "categorical", 1.0)
    gp = dnn2gp(model, post, CategoricalLikelihood())
    xs = torch.randn(6, 4, dtype=F64)
    m, v = gp.mean(xs), gp.variance(xs)
    probit = gp.predictive(xs, "probit")
    expect = torch.softmax(m / torch.sqrt(1 + math.pi / 8 * torch.diagonal(v, 0, 1, 2)), -1)
    torch.testing.assert_close(probit, expect)
    torch.testing.assert_close(gp.predictive(xs, "linear"), torch.softmax(m, -1))
    # with return_variance: the same probabilities and var f = J Sigma J^T (dense)
    jac_d = dense_jacobian(model, xs)
    var_dense = torch.einsum("ncp,p,ndp->ncd", jac_d, 1 / post.precision, jac_d)
    for method in ("probit", "linear"):
        probs, var_f = gp.predictive(xs, method, return_variance=True)
        torch.testing.assert_close(probs, gp.predictive(xs, method))
        torch.testing.assert_close(var_f, var_dense, rtol=1e-9, atol=1e-12)
    mc = gp.predictive(xs, "mc", n_samples=20000, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(mc.sum(-1), torch.ones(6, dtype=F64))
    # MC over f ~ N(m, v) equals MC over linearised weights w ~ q
    jac = dense_jacobian(model, xs)
    w = post.sample(20000, generator=torch.Generator().manual_seed(2))
    f_lin = m + torch.einsum("ncp,sp->snc", jac, w - post.mean)
    torch.testing.assert_close(mc, torch.softmax(f_lin, -1).mean(0), rtol=0, atol=0.01)
    # Bernoulli: probit approximation close to the exact 1-d integral
    mb = tiny_mlp(c=1)
    gpb = dnn2gp(mb, fit_laplace(mb, torch.randn(8, 4, dtype=F64), "bernoulli", 0.3), "bernoulli")
    pb = gpb.predictive(xs, "probit")
    mcb = gpb.predictive(xs, "mc", n_samples=40000, generator=torch.Generator().manual_seed(0))
    assert pb.shape == (6, 1)
    torch.testing.assert_close(pb, mcb, rtol=0, atol=0.02)
    assert isinstance(gpb.likelihood, BernoulliLikelihood)


# ------------------------------------------------------- exact Bayesian linear regression


def _blr(bias: bool, c: int = 1, n: int = 12, d: int = 3, sigma: float = 0.4, delta: float = 1.7):
    x = torch.randn(n, d, dtype=F64)
    y = torch.randn(n, c, dtype=F64) if c > 1 else torch.randn(n, dtype=F64)
    xt = torch.cat([x, torch.ones(n, 1, dtype=F64)], 1) if bias else x
    precision = xt.T @ xt / sigma**2 + delta * torch.eye(xt.shape[1], dtype=F64)
    w_map = torch.linalg.solve(precision, xt.T @ y.reshape(n, c) / sigma**2)  # [D', C]
    model = nn.Linear(d, c, bias=bias).double()
    with torch.no_grad():
        model.weight.copy_(w_map[:d].T)
        if bias:
            model.bias.copy_(w_map[d])
    return model, x, y, xt, precision, GaussianLikelihood(sigma), sigma, delta


@pytest.mark.parametrize("bias", [False, True])
def test_full_posterior_equals_bayesian_linear_regression(bias):
    model, x, y, xt, precision, lik, sigma, delta = _blr(bias)
    post = fit_laplace(model, (x, y), lik, delta, hessian_structure="full")
    torch.testing.assert_close(post.precision, precision, rtol=1e-12, atol=1e-12)
    gp = dnn2gp(model, post, lik)
    xs = torch.randn(5, 3, dtype=F64)
    xst = torch.cat([xs, torch.ones(5, 1, dtype=F64)], 1) if bias else xs
    mean, var = gp.predictive(xs)
    # weight space
    cov = torch.linalg.inv(precision)
    w_map = cov @ xt.T @ y / sigma**2
    torch.testing.assert_close(mean[:, 0], xst @ w_map, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(
        var[:, 0, 0], (xst @ cov * xst).sum(1) + sigma**2, rtol=1e-10, atol=1e-10
    )
    # function space: GP with kernel x x'^T / delta
    kxx = xt @ xt.T / delta + sigma**2 * torch.eye(len(x), dtype=F64)
    ksx = xst @ xt.T / delta
    gp_mean = ksx @ torch.linalg.solve(kxx, y)
    gp_var = (xst * xst).sum(1) / delta - (ksx * torch.linalg.solve(kxx, ksx.T).T).sum(1)
    torch.testing.assert_close(mean[:, 0], gp_mean, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(var[:, 0, 0], gp_var + sigma**2, rtol=1e-9, atol=1e-9)
    # kernel on the training inputs: the posterior kernel J Sigma J^T
    torch.testing.assert_close(gp.kernel(x)[:, 0, :, 0], xt @ cov @ xt.T, rtol=1e-10, atol=1e-12)
    # evidence: exact log N(y | 0, sigma^2 I + X X^T / delta)
    exact = torch.distributions.MultivariateNormal(torch.zeros(len(x), dtype=F64), kxx).log_prob(y)
    lml = log_marginal_likelihood(model, (x, y), lik, delta, hessian_structure="full")
    assert abs(float(lml - exact)) < 1e-8


def test_evidence_multi_output_and_vector_prior():
    model, x, y, xt, _, lik, sigma, delta = _blr(True, c=2)
    kxx = xt @ xt.T / delta + sigma**2 * torch.eye(len(x), dtype=F64)
    mvn = torch.distributions.MultivariateNormal(torch.zeros(len(x), dtype=F64), kxx)
    exact = mvn.log_prob(y.T).sum()
    lml = log_marginal_likelihood(model, [(x[:5], y[:5]), (x[5:], y[5:])], lik, delta,
                                  hessian_structure="full")  # fmt: skip
    assert abs(float(lml - exact)) < 1e-8
    vec = torch.full((8,), delta, dtype=F64)
    lml_vec = log_marginal_likelihood(model, (x, y), lik, vec, hessian_structure="full")
    assert abs(float(lml_vec - exact)) < 1e-8


def test_diagonal_posterior_linear_regression_is_mean_field_on_the_diagonal():
    """With the diagonal GGN the posterior keeps diag(X^T X)/sigma^2 + delta, so the GP variance
    is sum_j x_j^2 / (sum_n x_nj^2 / sigma^2 + delta) and the evidence replaces log det H by
    sum_j log H_jj, which by Hadamard's inequality never exceeds the exact evidence."""
    model, x, y, _, precision, lik, _, delta = _blr(True)
    post = fit_laplace(model, (x, y), lik, delta)
    h_diag = torch.diagonal(precision)
    torch.testing.assert_close(post.precision, h_diag, rtol=1e-12, atol=1e-12)
    gp = dnn2gp(model, post, lik)
    xs = torch.randn(4, 3, dtype=F64)
    xst = torch.cat([xs, torch.ones(4, 1, dtype=F64)], 1)
    torch.testing.assert_close(gp.variance(xs)[:, 0, 0], (xst**2 / h_diag).sum(1), rtol=1e-10,
                               atol=1e-12)  # fmt: skip
    full = log_marginal_likelihood(model, (x, y), lik, delta, hessian_structure="full")
    diag = log_marginal_likelihood(model, (x, y), lik, delta, hessian_structure="diag")
    gap = 0.5 * (torch.log(h_diag).sum() - torch.logdet(precision))
    torch.testing.assert_close(full - diag, gap, rtol=1e-10, atol=1e-10)
    assert float(diag) <= float(full)


@pytest.mark.parametrize("curvature", ["diag", "full"])
def test_optimize_prior_precision_grid_and_gradient_agree(curvature):
    model = tiny_mlp(c=3)
    x = torch.randn(20, 4, dtype=F64)
    y = torch.randint(0, 3, (20,))
    data, lik = (x, y), CategoricalLikelihood()
    grid = torch.logspace(-3, 3, 121, dtype=F64)
    deltas, values = log_evidence_grid(model, data, lik, grid, hessian_structure=curvature)
    best_g = float(deltas[int(values.argmax())])
    best_d = optimize_prior_precision(
        model, data, lik, "marglik", optimizer="lbfgs", hessian_structure=curvature
    )
    assert values.shape == (121,)
    step = math.log(float(grid[1] / grid[0]))
    assert abs(math.log(best_g) - math.log(best_d)) <= step
    f = [float(log_marginal_likelihood(model, data, lik, best_d * s, hessian_structure=curvature))
         for s in (0.99, 1.0, 1.01)]  # fmt: skip
    assert f[1] >= f[0] and f[1] >= f[2]  # a maximum
    assert f[1] >= float(values.max()) - 1e-9


class _TiedMLP(nn.Module):
    """Two calls of one Linear layer (weight sharing across depth)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 5)
        self.shared = nn.Linear(5, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        h = torch.tanh(self.shared(torch.tanh(self.inp(x))))
        return self.out(torch.tanh(self.shared(h)))


class _WeightReused(nn.Module):
    """A Linear whose weight is also used outside its forward (the layer structure misses
    that term: the one-example check must reject the structured way)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x) + torch.tanh(x) @ self.lin.weight.T


@pytest.mark.parametrize("make,shape", [(_TiedMLP, (4,)), (_WeightReused, (4,))])
def test_structured_kernel_falls_back_where_it_does_not_apply(make, shape):
    model = make().double()
    p = sum(q.numel() for q in model.parameters())
    post = _random_posterior(p, full=False)
    x = torch.randn(4, *shape, dtype=F64)
    gp = dnn2gp(model, post, "categorical")
    with pytest.raises(ValueError, match="method='structured' does not apply"):
        gp.kernel(x, method="structured")
    j = dense_jacobian(model, x, post.mean)
    ref = dense_kernel(j, torch.diag(post.variance), j)
    torch.testing.assert_close(gp.kernel(x), ref, rtol=1e-9, atol=1e-12)  # auto falls back


def test_errors_named():
    model = tiny_mlp()
    p = 43
    post = DiagonalGaussian(torch.zeros(p, dtype=F64), torch.ones(p, dtype=F64))
    with pytest.raises(ValueError, match="posterior has 3 parameters"):
        GP(model, DiagonalGaussian(torch.zeros(3), torch.ones(3)), "categorical")
    with pytest.raises(ValueError, match="posterior must be a GaussianPosterior"):
        GP(model, torch.zeros(p), "categorical")
    with pytest.raises(ValueError, match="training mode"):
        dnn2gp(tiny_cnn().train(), post, "categorical")
    gp = dnn2gp(model, post, "categorical")
    with pytest.raises(ValueError, match="x1 has non-finite"):
        gp.kernel(torch.full((2, 4), float("nan"), dtype=F64))
    with pytest.raises(ValueError, match="x1 and x2 must have the same per-example shape"):
        gp.kernel(torch.zeros(2, 4, dtype=F64), torch.zeros(2, 5, dtype=F64))
    with pytest.raises(ValueError, match=r"x must be a non-empty \[N, \.\.\.\] tensor"):
        gp.variance(torch.zeros(0, 4, dtype=F64))
    with pytest.raises(ValueError, match="method must be 'auto'"):
        gp.kernel(torch.zeros(2, 4, dtype=F64), method="dense")
    with pytest.raises(ValueError, match="method must be"):
        gp.predictive(torch.zeros(2, 4, dtype=F64), "laplace")
    with pytest.raises(ValueError, match="chunk_size"):
        gp.variance(torch.zeros(2, 4, dtype=F64), chunk_size=-1)
    with pytest.raises(ValueError, match="needs targets"):
        log_marginal_likelihood(model, torch.zeros(2, 4, dtype=F64), "categorical", 1.0)
    with pytest.raises(ValueError, match="hessian_structure must be"):
        log_marginal_likelihood(model, (torch.zeros(2, 4), torch.zeros(2)), "categorical", 1.0,
                                hessian_structure="kfac")  # fmt: skip
    with pytest.raises(ValueError, match="method must be 'marglik' or 'gridsearch'"):
        optimize_prior_precision(
            model, (torch.zeros(2, 4, dtype=F64), torch.zeros(2)), "categorical", "em"
        )
    with pytest.raises(ValueError, match="grid must be"):
        log_evidence_grid(model, (torch.zeros(2, 4), torch.zeros(2)), "categorical", [1.0, -1.0])
    assert flat(model).numel() == p


def test_gp_at_a_vogn_iterate_matches_dense():
    """A GP exists at any VOGN iterate: its kernel is J(x) diag(1 / (N s + delta)) J(x')^T
    at the current mean, computed densely."""
    from fromp.optim import VOGN

    model = tiny_mlp(c=3)
    x, y = torch.randn(12, 4, dtype=F64), torch.randint(0, 3, (12,))
    opt = VOGN(model, lr=0.05, ess=12, prior_precision=2.0, mc_samples=1)

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    for _ in range(5):
        opt.step(closure)
    opt.load_mean()
    q = opt.posterior()
    gp = dnn2gp(model, q, "categorical")
    xs = torch.randn(5, 4, dtype=F64)
    jac = dense_jacobian(model, xs)
    ref = torch.einsum("ncp,p,mdp->ncmd", jac, 1 / q.precision, jac)
    torch.testing.assert_close(gp.kernel(xs), ref, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(q.mean, opt.posterior().mean)
    assert not torch.allclose(q.precision, torch.full_like(q.precision, 2.0))  # data counted


def test_default_chunk_size_follows_memory_budget():
    """Without chunk_size the chunk comes from the memory budget (at most 64 examples) and
    the kernel does not depend on it."""
    model = tiny_mlp(c=3)
    post = DiagonalGaussian.isotropic(model, 2.0)
    x = torch.randn(5, 4, dtype=F64)
    big, small = GP(model, post, "categorical"), GP(model, post, "categorical", memory_budget=1)
    ref = big.kernel(x, method="jacobian")
    assert big.chunk_size == 64 and small.chunk_size == 1
    torch.testing.assert_close(small.kernel(x, method="jacobian"), ref, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="memory_budget"):
        GP(model, post, "categorical", memory_budget=0)


@pytest.mark.parametrize("diagonal_outputs", [False, True])
def test_structured_kernel_of_conv_norm_layers_matches_dense(diagonal_outputs):
    """Convolutions (stride, dilation, groups, padding modes, a 1x1-output conv), batch norm
    in eval mode, GroupNorm, LayerNorm, a sequence Linear and a layer without a capture rule:
    the structured kernel equals the dense float64 kernel, chunked or not."""
    model = conv_zoo()
    p = sum(q.numel() for q in model.parameters())
    post = _random_posterior(p, full=False)
    x1, x2 = torch.randn(5, 2, 8, 8, dtype=F64), torch.randn(3, 2, 8, 8, dtype=F64)
    gp = dnn2gp(model, post, "categorical", chunk_size=2)
    j1 = dense_jacobian(model, x1, post.mean)
    j2 = dense_jacobian(model, x2, post.mean)
    cov = torch.diag(post.variance)
    for xa, ja, xb, jb in ((x1, j1, None, j1), (x1, j1, x2, j2)):
        ref = dense_kernel(ja, cov, jb)
        if diagonal_outputs:
            ref = torch.stack([ref[:, c, :, c] for c in range(ref.shape[1])])
        got = gp.kernel(xa, xb, diagonal_outputs=diagonal_outputs, method="structured")
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12)
    assert gp._structured is not False and gp._structured.other == ["scale.s"]
    full = dense_kernel(j1, cov, j1)
    want = torch.stack([full[n, :, n, :] for n in range(len(x1))])
    for method in ("structured", "jacobian"):
        got = gp.variance(x1, method=method)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


class _PaddedTaps(nn.Module):
    """Convolutions with kernel taps that only ever see zero padding (their unfolded columns
    are dropped as exact zeros): a dilated conv on a 2x2 input (2x2 output, only the centre
    tap ever sees the input), a strided conv to a 1x1 output (4 of 9 taps see the input) and
    a 3x3 conv on a 1x1 input (the centre tap only), then a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(2, 3, 3, padding=2, dilation=2)
        self.b = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.c = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        return self.fc(torch.tanh(self.c(h)).flatten(1))


@pytest.mark.parametrize("budget", [None, 1], ids=["one-chunk", "tiny-budget"])
@pytest.mark.parametrize("diagonal_outputs", [False, True])
@pytest.mark.parametrize("make,shape", [(conv_zoo, (2, 8, 8)), (_PaddedTaps, (2, 2, 2))],
                         ids=["zoo", "padded-taps"])  # fmt: skip
def test_structured_kernel_range_pairs_and_chunks_match_dense(
    monkeypatch, make, shape, diagonal_outputs, budget
):
    """Symmetric blocks split into example ranges (upper range pairs computed, the rest
    mirrored), example chunks and output-channel / row chunks from a tiny memory budget, and
    dropped zero columns: the structured kernel still equals the dense float64 kernel."""
    import fromp.gp.kernel as gp_mod

    monkeypatch.setattr(gp_mod, "_GRAM_MIN_ROWS", 2)  # 7 examples: 3 ranges (4 for C rows)
    model = make().double().eval()
    x1, x2 = torch.randn(7, *shape, dtype=F64), torch.randn(4, *shape, dtype=F64)
    opts = {} if budget is None else {"memory_budget": budget}
    gp = _check_structured_against_dense(model, x1, x2, diagonal_outputs, **opts)
    if make is _PaddedTaps:  # the zero-column path is exercised for every conv
        lay = gp._structured.features(x1, slice(0, 7))[0]
        assert [lay[k][0] for k in "abc"] == ["positions", "outer", "outer"]
        for k, kept in (("a", 2 * 1), ("b", 3 * 4), ("c", 4 * 1)):
            idx = gp_mod._nonzero_columns(lay[k][1], lay[k][1])
            assert idx is not None and len(idx) == kept


def test_gram_ranges_cover_the_block_once():
    """The upper range pairs of a symmetric block plus their mirrors cover every entry
    exactly once (no range dropped or counted twice at the chunk edges)."""
    from fromp.gp.kernel import _Gram

    for n, c, diag in ((1000, 1, True), (300, 3, False), (7, 10, True), (129, 1, True)):
        acc = _Gram(c, n, n, diag, True, F64, "cpu")
        hits = torch.zeros(n, n)
        for r, q in acc.pairs():
            hits[r, q] += 1
            if r != q:
                hits[q, r] += 1
        assert (hits == 1).all() and len(acc.ranges) == max(
            1, min(4, n * (1 if diag else c) // 128)
        )


def _check_structured_against_dense(
    model: nn.Module, x1, x2, diagonal_outputs: bool, **gp_opts
) -> GP:
    """Structured kernel (``x1`` with itself and with ``x2``) and variance of ``x1`` under a
    random diagonal posterior equal the dense float64 ``J Sigma J^T``; returns the GP."""
    p = sum(q.numel() for q in model.parameters())
    post = _random_posterior(p, full=False)
    gp = dnn2gp(model, post, "categorical", **gp_opts)
    j1, j2 = dense_jacobian(model, x1, post.mean), dense_jacobian(model, x2, post.mean)
    cov = torch.diag(post.variance)
    for xb, jb in ((None, j1), (x2, j2)):
        ref = dense_kernel(j1, cov, jb)
        if diagonal_outputs:
            ref = torch.stack([ref[:, c, :, c] for c in range(ref.shape[1])])
        got = gp.kernel(x1, xb, diagonal_outputs=diagonal_outputs, method="structured")
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12)
    full = dense_kernel(j1, cov, j1)
    want = torch.stack([full[i, :, i, :] for i in range(len(x1))])
    torch.testing.assert_close(gp.variance(x1, method="structured"), want, rtol=1e-9, atol=1e-12)
    return gp


@pytest.mark.parametrize("keep", [0.0, 0.75, 1.01], ids=["never", "default", "always"])
@pytest.mark.parametrize("rows", [1, 3, 256])
@pytest.mark.parametrize("diagonal_outputs", [False, True])
def test_structured_kernel_sparse_row_steps_match_dense(monkeypatch, diagonal_outputs, rows, keep):
    """Outer-product layers on sparse inputs (each example has 3 of 16 inputs nonzero, at
    different places; ReLU hidden units): row steps of 1, 3 or all rows of ``x1``, each
    keeping only the columns nonzero in one of its rows and one row of ``x2`` (never, by
    default, or whenever any column is zero). Selecting the columns of the wrong rows, or
    dropping a column nonzero on one side only, changes the kernel."""
    import fromp.gp.kernel as gp_mod

    monkeypatch.setattr(gp_mod, "_OUTER_ROWS", rows)
    monkeypatch.setattr(gp_mod, "_SPARSE_KEEP", keep)
    monkeypatch.setattr(gp_mod, "_GRAM_MIN_ROWS", 2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 8), nn.ReLU(),
                          nn.Linear(8, 3)).double().eval()  # fmt: skip

    def sparse(n: int) -> torch.Tensor:
        x = torch.zeros(n, 16, dtype=F64)
        for i in range(n):
            x[i, torch.randperm(16)[:3]] = torch.randn(3, dtype=F64)
        return x

    x1, x2 = sparse(9), sparse(5)
    assert (x1.ne(0).sum(1) < 0.75 * 16).all()  # the default share drops columns per row
    _check_structured_against_dense(model, x1, x2, diagonal_outputs)


@pytest.mark.parametrize("keep", [0.0, 1.01], ids=["never", "always"])
@pytest.mark.parametrize("diagonal_outputs", [False, True])
def test_structured_kernel_grouped_one_position_conv_matches_dense(
    monkeypatch, diagonal_outputs, keep
):
    """A grouped convolution with one output position (an outer-product layer with ``G =
    2`` groups) on inputs with zeros, row steps of one row: kernel and variance equal the
    dense float64 ones (a group mixed up with another changes them)."""
    import fromp.gp.kernel as gp_mod

    monkeypatch.setattr(gp_mod, "_OUTER_ROWS", 1)
    monkeypatch.setattr(gp_mod, "_SPARSE_KEEP", keep)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(4, 6, 3, groups=2), nn.Flatten(), nn.ReLU(),
                          nn.Linear(6, 3)).double().eval()  # fmt: skip
    x1 = torch.randn(6, 4, 3, 3, dtype=F64) * (torch.rand(6, 4, 3, 3) < 0.3)
    x2 = torch.randn(4, 4, 3, 3, dtype=F64) * (torch.rand(4, 4, 3, 3) < 0.3)
    gp = _check_structured_against_dense(model, x1, x2, diagonal_outputs)
    lay = gp._structured.features(x1, slice(0, 6))[0]
    assert lay["0"][0] == "outer" and lay["0"][1].shape[1] == 2  # grouped outer layer


def test_structured_chunks_follow_the_memory_budget(monkeypatch):
    """Without a chunk size the structured kernel and variance take feature chunks of at most
    what the budget allows (``example_chunk``), as few as possible; a given chunk size wins."""
    from fromp.gp.kernel import _CaptureStructure

    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double().eval()
    post = _random_posterior(sum(q.numel() for q in model.parameters()), full=False)
    x = torch.randn(7, 4, dtype=F64)
    seen: list[int] = []
    features = _CaptureStructure.features

    def spy(self, xx, rows):
        if len(xx) == len(x):  # not the one-example check
            seen.append(rows.stop - rows.start)
        return features(self, xx, rows)

    monkeypatch.setattr(_CaptureStructure, "features", spy)
    monkeypatch.setattr(_CaptureStructure, "example_chunk", lambda self, nbytes: 3)
    gp = dnn2gp(model, post, "categorical")
    for run in (lambda **k: gp.kernel(x, method="structured", **k),
                lambda **k: gp.variance(x, method="structured", **k)):  # fmt: skip
        seen.clear()
        run()
        assert max(seen) <= 3 and len(seen) == 3 and sum(seen) == 7, seen
        seen.clear()
        run(chunk_size=2)
        assert seen == [2, 2, 2, 1], seen
