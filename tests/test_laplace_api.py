"""``fromp.Laplace`` in laplace-torch's words, every (subset x structure) pair against dense
float64 computations on a small MLP and a small CNN: the posterior precision, the evidence,
the GLM predictive (probit), the kernel, sample moments, ``override=False``, the prior
search, the state round trip; the closed form of Bayesian linear regression (evidence in
``prior_precision`` and ``sigma_noise``); and the refusals."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.func import functional_call

from fromp import Laplace
from fromp.likelihood import CategoricalLikelihood
from fromp.testing import Scale, dense_nll_hessians

F64 = torch.float64
PAIRS = [(s, h) for s in ("all", "last_layer") for h in ("diag", "kron", "full")]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(F64).eval()


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1), nn.Tanh(), nn.Conv2d(2, 2, 3, stride=2), nn.Tanh(),
        nn.Flatten(), nn.Linear(8, 3),
    ).to(F64).eval()  # fmt: skip


MODELS = {"mlp": (mlp, (4,)), "cnn": (cnn, (1, 5, 5))}


def data(shape, n=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g, dtype=F64), torch.randint(0, 3, (n,), generator=g)


def subset_names(model, subset):
    names = [n for n, _ in model.named_parameters()]
    return names if subset == "all" else names[-2:]


def dense_jac(model, x, names):
    """``J [N, C, P_subset]`` by autograd, the subset's parameters in order."""
    params = dict(model.named_parameters())
    flat = torch.cat([params[n].detach().reshape(-1) for n in names])

    def f(w):
        d, k = {}, 0
        for n in names:
            d[n] = w[k : k + params[n].numel()].view_as(params[n])
            k += params[n].numel()
        return functional_call(model, d, (x,))

    return torch.autograd.functional.jacobian(f, flat), flat


def dense_ggn_blocks(model, x, names):
    jac, flat = dense_jac(model, x, names)
    with torch.no_grad():
        f = model(x)
    lam = dense_nll_hessians(CategoricalLikelihood(), f, torch.zeros(len(x), dtype=torch.long))
    g = torch.einsum("ncp,ncd,ndq->pq", jac, lam, jac)
    return g, jac, flat, f


def kfac_reference(model, x, names):
    """KFAC by definition: ``A = (1/(N L)) sum u u^T`` from the layers' inputs (unfolded, L
    positions),
    ``B = sum_n Jz_n^T Lambda_n Jz_n`` with ``Jz = df/dz`` by autograd; bias blocks exact."""
    layers = {n.rsplit(".", 1)[0] for n in names}
    blocks = []
    for i, m in enumerate(model):
        if str(i) not in layers:
            continue
        head, tail = model[:i], model[i + 1 :]
        with torch.no_grad():
            a = head(x)
            z = m(a)
            f = tail(z)
        lam = dense_nll_hessians(CategoricalLikelihood(), f, torch.zeros(len(x), dtype=torch.long))
        jz = torch.stack([
            torch.autograd.functional.jacobian(lambda zz, t=tail: t(zz.unsqueeze(0))[0], z[n])
            for n in range(len(x))
        ])  # [N, C, *z]  # fmt: skip
        if isinstance(m, nn.Conv2d):
            u = nn.functional.unfold(a, m.kernel_size, padding=m.padding, stride=m.stride)
            u = u.transpose(1, 2)  # [N, L, in k k]
            jz = jz.flatten(3)  # [N, C, out, L]
        else:
            u = a.unsqueeze(1)
            jz = jz.unsqueeze(-1)
        amat = torch.einsum("nli,nlj->ij", u, u) / (len(x) * u.shape[1])  # KFAC-expand
        # B = sum_n sum_l,l' over positions of the output-gradient covariance
        bmat = torch.einsum("ncol,ncd,ndpl->op", jz, lam, jz)
        bbias = torch.einsum("ncol,ncd,ndpk->op", jz, lam, jz)
        w_prec = torch.kron(bmat, amat)
        blocks.append(w_prec)
        if f"{i}.bias" in names:
            blocks.append(bbias)
    return blocks


def dense_precision(la, model, x, names, structure, delta):
    g, jac, flat, f = dense_ggn_blocks(model, x, names)
    if structure == "diag":
        g = torch.diag(torch.diagonal(g))
    elif structure == "kron":
        g = torch.block_diag(*kfac_reference(model, x, names))
    return g + delta * torch.eye(len(g), dtype=F64), jac, flat, f


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("subset,structure", PAIRS)
def test_every_pair_against_dense(model_name, subset, structure):
    make, shape = MODELS[model_name]
    model = make()
    x, y = data(shape)
    names = subset_names(model, subset)
    la = Laplace(model, "classification", subset, structure, prior_precision=0.7)
    la.fit([(x[:4], y[:4]), (x[4:], y[4:])])
    assert la.parameter_names == names
    prec, jac, flat, f = dense_precision(la, model, x, names, structure, 0.7)
    torch.testing.assert_close(la.mean, flat)
    if structure == "diag":
        torch.testing.assert_close(la.posterior_precision, torch.diagonal(prec))
    elif structure == "full":
        torch.testing.assert_close(la.posterior_precision, prec)
    else:
        torch.testing.assert_close(torch.block_diag(*la.posterior_precision), prec)
    cov = torch.linalg.inv(prec)
    torch.testing.assert_close(la.posterior_variance, torch.diagonal(cov))
    # evidence
    with torch.no_grad():
        nll = CategoricalLikelihood().nll(model(x), y).sum()
    want = (
        -nll - 0.5 * 0.7 * (flat**2).sum() - 0.5 * (torch.logdet(prec) - len(flat) * math.log(0.7))
    )
    torch.testing.assert_close(la.log_marginal_likelihood(), want, rtol=1e-10, atol=1e-9)
    # GLM predictive (laplace-torch's probit) and kernel
    fvar = torch.einsum("ncp,pq,ndq->ncd", jac, cov, jac)
    torch.testing.assert_close(la.functional_variance_at(x), fvar, rtol=1e-8, atol=1e-10)
    probit = torch.softmax(
        f / torch.sqrt(1 + math.pi / 8 * torch.diagonal(fvar, dim1=1, dim2=2)), 1
    )
    torch.testing.assert_close(la(x, link_approx="probit"), probit, rtol=1e-8, atol=1e-10)
    k = la.gp().kernel(x[:3], x[3:7])
    torch.testing.assert_close(k, torch.einsum("ncp,pq,mdq->ncmd", jac[:3], cov, jac[3:7]),
                               rtol=1e-8, atol=1e-10)  # fmt: skip


@pytest.mark.parametrize("subset,structure", PAIRS)
def test_override_false_equals_one_fit_and_state_round_trip(subset, structure):
    model = mlp()
    x, y = data((4,), n=12)
    one = Laplace(model, "classification", subset, structure).fit((x, y))
    two = Laplace(model, "classification", subset, structure).fit((x[:5], y[:5]))
    two.fit((x[5:], y[5:]), override=False)
    torch.testing.assert_close(two.log_marginal_likelihood(0.3), one.log_marginal_likelihood(0.3))
    torch.testing.assert_close(two(x), one(x))
    assert two.n_data == 12
    # state: a fresh object from the state gives the same evidence and predictive
    one.prior_precision = 2.5
    fresh = Laplace(mlp(), "classification", subset, structure)
    fresh.load_state_dict(one.state_dict())
    torch.testing.assert_close(fresh.log_marginal_likelihood(), one.log_marginal_likelihood())
    torch.testing.assert_close(fresh(x), one(x))
    other = "diag" if structure != "diag" else "full"
    with pytest.raises(ValueError, match="structure"):
        Laplace(mlp(), "classification", subset, other).load_state_dict(one.state_dict())


def test_kfac_is_exact_for_one_example_and_the_bias_blocks_always():
    model = mlp()
    x, y = data((4,), n=1)
    la = Laplace(model, "classification", "all", "kron").fit((x, y))
    g, *_ = dense_ggn_blocks(model, x, subset_names(model, "all"))
    sizes = [p.numel() for p in model.parameters()]
    k = 0
    for block in la.posterior_precision:  # delta = 1
        n = len(block)
        torch.testing.assert_close(block, g[k : k + n, k : k + n] + torch.eye(n, dtype=F64))
        k += n
    # many examples: the bias blocks stay exact
    x, y = data((4,), n=9)
    la = Laplace(model, "classification", "all", "kron").fit((x, y))
    g, *_ = dense_ggn_blocks(model, x, subset_names(model, "all"))
    offsets = torch.cumsum(torch.tensor([0, *sizes]), 0).tolist()
    for i in (1, 3):  # the bias tensors
        a, b = offsets[i], offsets[i + 1]
        want = g[a:b, a:b] + torch.eye(b - a, dtype=F64)
        torch.testing.assert_close(la.posterior_precision[i], want)


def test_bayesian_linear_regression_closed_form():
    """For ``y = X w + e`` the full (and, without a bias, Kronecker) Laplace at the exact
    MAP is exact: its evidence is ``log N(y; 0, X X^T / delta + s^2 I)`` at every
    ``delta`` and ``s``, differentiably; the GLM predictive is the exact posterior one."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(15, 3, generator=g, dtype=F64)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=F64) + 0.3 * torch.randn(
        15, generator=g, dtype=F64
    )
    for structure in ("full", "kron"):
        for delta, s in ((0.5, 0.3), (2.0, 1.1)):
            model = nn.Linear(3, 1, bias=False).to(F64)
            w = torch.linalg.solve(x.T @ x / s**2 + delta * torch.eye(3, dtype=F64), x.T @ y / s**2)
            with torch.no_grad():
                model.weight.copy_(w.reshape(1, 3))
            la = Laplace(model, "regression", "all", structure, prior_precision=delta,
                         sigma_noise=s).fit((x, y))  # fmt: skip
            cov = x @ x.T / delta + s**2 * torch.eye(15, dtype=F64)
            want = torch.distributions.MultivariateNormal(torch.zeros(15, dtype=F64), cov)
            torch.testing.assert_close(la.log_marginal_likelihood(), want.log_prob(y))
            _, var = la(x[:4])
            post = torch.linalg.inv(x.T @ x / s**2 + delta * torch.eye(3, dtype=F64))
            torch.testing.assert_close(
                var[:, 0, 0], torch.einsum("ni,ij,nj->n", x[:4], post, x[:4])
            )
        # differentiable in sigma_noise and prior_precision
        s_t = torch.tensor(0.4, dtype=F64, requires_grad=True)
        d_t = torch.tensor(0.8, dtype=F64, requires_grad=True)
        lml = la.log_marginal_likelihood(d_t, s_t)
        gs, gd = torch.autograd.grad(lml, [s_t, d_t])
        eps = 1e-6
        fd_s = (
            la.log_marginal_likelihood(0.8, 0.4 + eps) - la.log_marginal_likelihood(0.8, 0.4 - eps)
        ) / (2 * eps)
        fd_d = (
            la.log_marginal_likelihood(0.8 + eps, 0.4) - la.log_marginal_likelihood(0.8 - eps, 0.4)
        ) / (2 * eps)
        torch.testing.assert_close(gs, fd_s, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(gd, fd_d, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("subset,structure", PAIRS)
def test_marglik_never_lowers_the_evidence(subset, structure):
    model = mlp()
    x, y = data((4,), n=30)
    for prior_structure in ("scalar", "layerwise"):
        la = Laplace(model, "classification", subset, structure, prior_precision=50.0).fit((x, y))
        before = la.log_marginal_likelihood()
        d = la.optimize_prior_precision(method="marglik", prior_structure=prior_structure)
        after = la.log_marginal_likelihood()
        assert after >= before - 1e-12
        assert d.shape == (() if prior_structure == "scalar" else (la.n_layers,))
        # a stationary point: no small move of the scalar/per-layer delta improves it
        for f in (0.9, 1.1):
            assert la.log_marginal_likelihood(d * f) <= after + 1e-8


@pytest.mark.parametrize("subset,structure", PAIRS)
def test_sample_moments(subset, structure):
    model = mlp()
    x, y = data((4,), n=20)
    la = Laplace(model, "classification", subset, structure, prior_precision=3.0).fit((x, y))
    gen = torch.Generator().manual_seed(0)
    s = la.sample(40_000, generator=gen)
    cov = torch.linalg.inv(
        torch.diag(la.posterior_precision) if structure == "diag" else
        la.posterior_precision if structure == "full" else
        torch.block_diag(*la.posterior_precision)
    )  # fmt: skip
    torch.testing.assert_close(
        s.mean(0), la.mean, atol=4 * cov.diagonal().sqrt().max() / 200, rtol=0
    )
    torch.testing.assert_close(torch.cov(s.T), cov, atol=0.03 * cov.diagonal().max(), rtol=0)


def test_predictives_are_probabilities_and_nn_agrees_at_small_variance():
    model = mlp()
    x, y = data((4,), n=20)
    la = Laplace(model, "classification", "last_layer", "kron", prior_precision=1e6).fit((x, y))
    with torch.no_grad():
        p0 = torch.softmax(model(x), 1)
    gen = torch.Generator().manual_seed(0)
    for kw in ({"link_approx": "probit"}, {"link_approx": "mc", "generator": gen},
               {"link_approx": "bridge"}, {"pred_type": "nn", "generator": gen}):  # fmt: skip
        p = la(x, **kw)
        torch.testing.assert_close(p.sum(1), torch.ones(20, dtype=F64))
        if kw.get("link_approx") != "bridge":
            torch.testing.assert_close(p, p0, atol=1e-3, rtol=0)
    draws = la.predictive_samples(x, n_samples=7, generator=gen)
    assert draws.shape == (7, 20, 3)


def test_refusals_name_the_argument():
    model = mlp()
    with pytest.raises(ValueError, match=r"lowrank.*supported"):
        Laplace(model, "classification", "last_layer", "lowrank")
    with pytest.raises(ValueError, match="subnetwork_indices"):
        Laplace(model, "classification", "subnetwork", "full")
    with pytest.raises(ValueError, match="hessian_structure"):
        Laplace(model, "classification", "all", "block")
    odd = nn.Sequential(nn.Linear(4, 5), Scale(5), nn.Linear(5, 3)).to(F64).eval()
    x, y = data((4,))
    with pytest.raises(ValueError, match=r"Scale has trainable parameters \['s'\].*diag"):
        Laplace(odd, "classification", "all", "kron").fit((x, y))
    la = Laplace(model, "classification", "all", "kron").fit((x, y))
    with pytest.raises(ValueError, match="prior_structure"):
        la.optimize_prior_precision(prior_structure="diag")
    with pytest.raises(ValueError, match="val_loader"):
        la.optimize_prior_precision(method="gridsearch")
    with pytest.raises(ValueError, match="sigma_noise"):
        Laplace(model, "classification", sigma_noise=0.5)
    soft = nn.Sequential(nn.Linear(4, 3), nn.Softmax(-1)).to(F64)
    with pytest.raises(ValueError, match=r"last nn\.Linear"):
        Laplace(soft, "classification", "last_layer", "kron").fit((x, y))
    with pytest.raises(ValueError, match="call fit"):
        Laplace(model, "classification", "all", "diag").log_marginal_likelihood()


def test_gridsearch_picks_the_best_validation_nll():
    model = mlp()
    x, y = data((4,), n=40)
    la = Laplace(model, "classification", "last_layer", "full").fit((x[:30], y[:30]))
    d = la.optimize_prior_precision(method="gridsearch", val_loader=(x[30:], y[30:]), grid_size=9)
    nll = {}
    for g in torch.logspace(-4, 4, 9, dtype=F64):
        la.prior_precision = g
        nll[float(g)] = float(-la(x[30:]).gather(1, y[30:, None]).log().sum())
    assert float(d) == min(nll, key=nll.get)


@pytest.mark.parametrize("subset,structure", PAIRS)
def test_temperature_divides_the_curvature_and_the_data_term(subset, structure):
    """``T`` enters as ``G / T`` in the precision and ``nll / T`` in the evidence: at
    ``T = 2`` the evidence equals that of half the data term and half the curvature."""
    model = mlp()
    x, y = data((4,), n=12)
    cold = Laplace(model, "classification", subset, structure, prior_precision=0.4).fit((x, y))
    hot = Laplace(model, "classification", subset, structure, prior_precision=0.4,
                  temperature=2.0).fit((x, y))  # fmt: skip
    prec = cold.posterior_precision
    hot_prec = hot.posterior_precision
    if structure == "kron":
        prec, hot_prec = torch.block_diag(*prec), torch.block_diag(*hot_prec)
    eye = torch.eye(len(prec), dtype=F64) if prec.ndim == 2 else torch.ones_like(prec)
    torch.testing.assert_close(hot_prec, (prec - 0.4 * eye) / 2 + 0.4 * eye)
    torch.testing.assert_close(hot.log_likelihood, cold.log_likelihood / 2)


@pytest.mark.parametrize("structure", ["diag", "kron", "full"])
def test_layerwise_evidence_keeps_the_prior_of_tensors_no_example_reached(structure):
    """A multi-head network fitted through head 1: heads 0 and 2 have no curvature, so the
    evidence in their ``delta`` grows without bound as it goes to 0 (a bug drove it to 0 and
    refused the result as not strictly positive); they keep their prior, the tensors the data
    reached get their own evidence-chosen values, and the evidence does not fall."""
    from fromp.models import MultiHeadMLP, with_task

    torch.manual_seed(0)
    net = MultiHeadMLP(4, (5,), n_heads=3, head_size=2).to(F64).eval()
    model = with_task(net, 1)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(12, 4, generator=g, dtype=F64), torch.randint(0, 2, (12,), generator=g)
    la = Laplace(model, "classification", "all", structure, prior_precision=1.0)
    la.fit((x, y))
    before = float(la.log_marginal_likelihood())
    delta = la.optimize_prior_precision(
        method="marglik", prior_structure="layerwise", optimizer="lbfgs"
    )
    names = la.parameter_names
    assert torch.isfinite(delta).all() and (delta > 0).all()
    unreached = [i for i, n in enumerate(names) if ".heads.0." in n or ".heads.2." in n]
    reached = [i for i in range(len(names)) if i not in unreached]
    assert len(unreached) == 4 and len(reached) == 4
    assert torch.equal(delta[unreached], torch.ones(4, dtype=F64))
    assert not torch.allclose(delta[reached], torch.ones(4, dtype=F64), atol=1e-3)
    assert float(la.log_marginal_likelihood()) >= before


@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_kron_fit_runs_the_model_once_per_batch_and_keeps_the_evidence(subset):
    """The evidence's data term comes from the curvature pass's outputs: one forward pass
    per batch (a second pass doubled the fit's forward cost); the evidence is unchanged."""
    model = mlp()
    x, y = data((4,), n=12)
    calls = []

    def count(module, inputs, output):  # batch-sized calls: last_layer probes one example
        if len(inputs[0]) > 1:
            calls.append(1)

    handle = model.register_forward_hook(count)
    la = Laplace(model, "classification", subset, "kron", prior_precision=0.7)
    la.fit([(x[:5], y[:5]), (x[5:], y[5:])])
    handle.remove()
    assert len(calls) == 2
    nll = torch.nn.functional.cross_entropy(model(x), y, reduction="sum")
    torch.testing.assert_close(la.log_likelihood, -nll)


@pytest.mark.parametrize(("subset", "structure"), PAIRS)
def test_fit_refuses_a_diverged_network(subset, structure):
    """NaN weights (a diverged run) are refused by name before any curvature is computed,
    also where the NaN sits outside the subset (it makes the features NaN)."""
    model = mlp()
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    match = "0.weight are not finite" if subset == "all" else "outputs are not finite"
    with pytest.raises(ValueError, match=match):  # all weights: already at construction
        Laplace(model, "classification", subset, structure).fit(data((4,)))
