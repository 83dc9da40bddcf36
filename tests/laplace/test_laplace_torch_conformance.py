"""laplace-torch 0.3's documentation examples, written here from their descriptions and run
against ``fromp`` with only the import changed, each checked against an independent dense
float64 computation (no laplace-torch needed). Where laplace-torch is importable, the same
setups run side by side and must agree to 1e-10 in float64 (skipped with the reason
otherwise). The examples: the README regression with its marginal-likelihood hyperparameter
loop, the README classification (last layer, Kronecker, marglik, probit), ``marglik_training``,
subnetwork masks, ``prior_mean`` for continual learning, the full covariance, ``log_prob``,
the joint predictive and the Bayesian-optimisation gradient. A last test introspects
laplace-torch 0.3's public names (copied from its source as literal lists)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

# the only lines a laplace-torch user changes
from fromp import Laplace, marglik_training
from fromp.testing import dense_jacobian, flat, forward_at
from fromp.utils import (
    LargestMagnitudeSubnetMask,
    LargestVarianceDiagLaplaceSubnetMask,
    LargestVarianceSWAGSubnetMask,
    LastLayerSubnetMask,
    ModuleNameSubnetMask,
    ParamNameSubnetMask,
    RandomSubnetMask,
    fit_diagonal_swag_var,
)

F64 = torch.float64


def regression_data(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.linspace(-2, 2, n, dtype=F64).unsqueeze(1)
    y = torch.sin(2 * x) + 0.3 * torch.randn(n, 1, dtype=F64, generator=g)
    return x, y


def classification_data(n=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, dtype=F64, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return x, y


def trained(model, x, y, loss, steps=400, lr=0.05):
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        loss(model(x), y).backward()
        opt.step()
    return model.eval()


def reg_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1, 10), nn.Tanh(), nn.Linear(10, 1)).double()


def cls_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def dense_regression_posterior(model, x, delta, sigma):
    """``(Sigma [P, P], J [N, 1, P])`` of the full GGN Laplace: ``(J^T J / s^2 + delta I)^-1``."""
    jac = dense_jacobian(model, x)
    j = jac.flatten(0, 1)
    prec = j.T @ j / sigma**2 + delta * torch.eye(j.shape[1], dtype=F64)
    return torch.linalg.inv(prec), jac


# ------------------------------------------------------------------------------ README


def test_readme_regression_with_the_marglik_hyperparameter_loop():
    x, y = regression_data()
    model = trained(reg_model(), x, y, nn.MSELoss(), steps=1500)
    train_loader = DataLoader(TensorDataset(x, y), batch_size=10)
    # --- the README, verbatim but for the import
    la = Laplace(model, "regression", subset_of_weights="all", hessian_structure="full")
    la.fit(train_loader)
    log_prior = torch.ones(1, dtype=F64, requires_grad=True)
    log_sigma = torch.ones(1, dtype=F64, requires_grad=True)
    hyper_optimizer = torch.optim.Adam([log_prior, log_sigma], lr=1e-1)
    for _ in range(200):
        hyper_optimizer.zero_grad()
        neg_marglik = -la.log_marginal_likelihood(log_prior.exp(), log_sigma.exp())
        neg_marglik.backward()
        hyper_optimizer.step()
    xs = torch.linspace(-3, 3, 7, dtype=F64).unsqueeze(1)
    f_mu, f_var = la(xs, pred_type="glm")
    f_sigma = f_var.squeeze().sqrt()
    pred_std = torch.sqrt(f_sigma**2 + la.sigma_noise.item() ** 2)
    # --- dense float64: the same hyperparameter loop on the dense evidence
    jac = dense_jacobian(model, x).flatten(0, 1)
    w, sse, p = flat(model), ((model(x) - y) ** 2).sum().detach(), jac.shape[1]

    def evidence(delta, s):
        prec = jac.T @ jac / s**2 + delta * torch.eye(p, dtype=F64)
        ll = -sse / (2 * s**2) - len(x) * torch.log(s * math.sqrt(2 * math.pi))
        return ll - 0.5 * (delta * w @ w + torch.logdet(prec) - p * torch.log(delta))

    lp = torch.ones(1, dtype=F64, requires_grad=True)
    ls = torch.ones(1, dtype=F64, requires_grad=True)
    opt = torch.optim.Adam([lp, ls], lr=1e-1)
    for _ in range(200):
        opt.zero_grad()
        used = lp.exp().detach().clone(), ls.exp().detach().clone()
        (-evidence(lp.exp(), ls.exp())).sum().backward()
        opt.step()
    # laplace-torch keeps the values of the last call (before the optimiser's last step)
    torch.testing.assert_close(la.prior_precision.reshape(()), used[0][0], rtol=1e-9, atol=0)
    torch.testing.assert_close(la.sigma_noise, used[1][0], rtol=1e-9, atol=0)
    cov, _ = dense_regression_posterior(model, x, float(la.prior_precision), la.sigma_noise.item())
    jx = dense_jacobian(model, xs)
    var_ref = torch.einsum("ncp,pq,ndq->ncd", jx, cov, jx)
    torch.testing.assert_close(f_mu, model(xs).detach())
    torch.testing.assert_close(f_var, var_ref, rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(pred_std, (var_ref.squeeze() + la.sigma_noise**2).sqrt())
    assert 0.15 < la.sigma_noise.item() < 0.6 and float(la.prior_precision) != 1.0


def _ll_kron_dense(model, x, delta):
    """Last-layer KFAC by definition: weight block ``B (x) A``, ``B = sum_n Lambda_n``, ``A =
    (1/N) sum_n phi_n phi_n^T``; bias block ``B``; plus ``delta I``."""
    with torch.no_grad():
        phi = torch.tanh(model[0](x))
        p = torch.softmax(model(x), -1)
    lam = torch.diag_embed(p) - torch.einsum("nc,nd->ncd", p, p)
    b, a = lam.sum(0), phi.T @ phi / len(x)
    g = torch.block_diag(torch.kron(b, a), b)
    return g + delta * torch.eye(len(g), dtype=F64), phi


def test_readme_classification_last_layer_kron_marglik_probit():
    x, y = classification_data()
    model = trained(cls_model(), x, y, nn.CrossEntropyLoss())
    train_loader = DataLoader(TensorDataset(x, y), batch_size=16)
    la = Laplace(model, "classification", subset_of_weights="last_layer", hessian_structure="kron")
    la.fit(train_loader)
    la.optimize_prior_precision(method="marglik", pred_type="glm", link_approx="probit",
                                optimizer="lbfgs")  # fmt: skip
    xs = torch.randn(5, 2, dtype=F64, generator=torch.Generator().manual_seed(3))
    pred = la(xs, pred_type="glm", link_approx="probit")
    # dense: the evidence is stationary at the chosen delta, and the probit predictive
    nll = nn.functional.cross_entropy(model(x), y, reduction="sum").detach()
    w = torch.cat([model[2].weight.detach().reshape(-1), model[2].bias.detach()])
    d = la.prior_precision.detach().clone().requires_grad_(True)
    prec, _ = _ll_kron_dense(model, x, d)
    ev = -nll - 0.5 * (d * w @ w + torch.logdet(prec) - len(w) * torch.log(d))
    (g,) = torch.autograd.grad(ev, d)
    assert abs(float(g * d)) < 1e-6
    cov = torch.linalg.inv(_ll_kron_dense(model, x, float(d))[0])
    with torch.no_grad():
        phi_s = torch.tanh(model[0](xs))
        f = model(xs)
    jac = torch.cat([torch.einsum("cd,nk->ncdk", torch.eye(3, dtype=F64), phi_s).flatten(2),
                     torch.eye(3, dtype=F64).expand(5, 3, 3)], -1)  # fmt: skip
    var = torch.einsum("ncp,pq,ndq->ncd", jac, cov, jac)
    ref = torch.softmax(f / torch.sqrt(1 + math.pi / 8 * torch.diagonal(var, 0, 1, 2)), -1)
    torch.testing.assert_close(pred, ref, rtol=1e-8, atol=1e-10)
    # laplace-torch's procedure (Adam, 100 steps of 0.1 from 1) reaches the same optimum
    # to the accuracy of its steps
    la2 = Laplace(model, "classification", "last_layer", "kron").fit(train_loader)
    la2.optimize_prior_precision(method="marglik", optimizer="adam", n_steps=300)
    torch.testing.assert_close(la2.prior_precision, la.prior_precision, rtol=1e-3, atol=0)


# ------------------------------------------------------------------------------ marglik_training


def test_marglik_training_one_epoch_against_hand_steps():
    """One epoch of one batch with SGD: the weights move by the gradient of ``CE + w^T
    delta w / (2 N T)`` (delta = T * prior_prec_init), the hyperparameter steps follow the
    dense evidence, and the returned Laplace is fitted at the returned weights with the
    best step's delta."""
    x, y = classification_data(n=30)
    model = cls_model()
    w0 = flat(model)
    loader = DataLoader(TensorDataset(x, y), batch_size=30)
    la, net, margliks, losses = marglik_training(
        model, loader, likelihood="classification", hessian_structure="full",
        optimizer_cls=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, n_epochs=1,
        n_hypersteps=4, prior_prec_init=2.0, temperature=1.0, prior_structure="scalar",
    )  # fmt: skip
    assert net is model and len(losses) == 1 and len(margliks) == 4
    wr = w0.clone().requires_grad_(True)
    obj = nn.functional.cross_entropy(forward_at(model, wr, x), y) + 0.5 * 2.0 * wr @ wr / 30
    (g,) = torch.autograd.grad(obj, wr)
    torch.testing.assert_close(flat(model), w0 - 0.1 * g, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.tensor(losses[0], dtype=F64), obj.detach())
    # dense evidence and Adam on log delta, by hand
    jac = dense_jacobian(model, x)
    with torch.no_grad():
        f = model(x)
        p = torch.softmax(f, -1)
    lam = torch.diag_embed(p) - torch.einsum("nc,nd->ncd", p, p)
    ggn = torch.einsum("ncp,ncd,ndq->pq", jac, lam, jac)
    w, nll, n_p = flat(model), nn.functional.cross_entropy(f, y, reduction="sum"), len(flat(model))

    def neg_ev(d):
        prec = ggn + d * torch.eye(n_p, dtype=F64)
        return nll + 0.5 * (d * w @ w + torch.logdet(prec) - n_p * torch.log(d))

    log_d = torch.full((1,), math.log(2.0), dtype=F64, requires_grad=True)
    opt = torch.optim.Adam([log_d], lr=0.1)
    want, last_d = [], None
    for _ in range(4):
        opt.zero_grad()
        last_d = log_d.exp()
        v = neg_ev(last_d).sum()
        v.backward()
        opt.step()
        want.append(float(v))
    torch.testing.assert_close(torch.tensor(margliks), torch.tensor(want), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(la.prior_precision.reshape(()), last_d.detach()[0])
    torch.testing.assert_close(la.mean, flat(model))


def test_marglik_training_regression_learns_the_noise():
    x, y = regression_data(n=60)
    loader = DataLoader(TensorDataset(x, y), batch_size=20)
    la, _, margliks, losses = marglik_training(
        reg_model(), loader, likelihood="regression", hessian_structure="kron",
        optimizer_kwargs={"lr": 0.02}, n_epochs=80, marglik_frequency=10,
    )  # fmt: skip
    assert len(losses) == 80 and len(margliks) == 8 * 10
    assert la.likelihood == "regression" and 0.15 < la.sigma_noise.item() < 0.8
    assert margliks[-1] < margliks[0]
    assert la.prior_precision.shape == (4,)  # layerwise, laplace-torch's default


# ------------------------------------------------------------------------------ subnetworks


def test_subnetwork_masks_select_what_they_say():
    x, y = classification_data()
    model = trained(cls_model(), x, y, nn.CrossEntropyLoss())
    w = flat(model)
    loader = DataLoader(TensorDataset(x, y), batch_size=20)
    idx = LargestMagnitudeSubnetMask(model, n_params_subnet=6).select()
    assert torch.equal(idx, torch.topk(w.abs(), 6).indices.sort().values)
    assert idx.dtype == torch.long
    torch.manual_seed(7)
    rnd = RandomSubnetMask(model, n_params_subnet=5).select()
    torch.manual_seed(7)
    assert torch.equal(rnd, torch.topk(torch.rand_like(w), 5).indices.sort().values)
    n0, n1 = model[0].weight.numel(), model[0].bias.numel()
    n2 = model[2].weight.numel()
    assert torch.equal(ParamNameSubnetMask(model, ["0.bias"]).select(), torch.arange(n0, n0 + n1))
    assert torch.equal(ModuleNameSubnetMask(model, ["2"]).select(), torch.arange(n0 + n1, len(w)))
    assert torch.equal(LastLayerSubnetMask(model).select(loader), torch.arange(n0 + n1, len(w)))
    assert len(torch.arange(n0 + n1, len(w))) == n2 + 3
    # largest variance under a diagonal Laplace: dense diag GGN
    diag_la = Laplace(model, "classification", "all", "diag")
    sel = LargestVarianceDiagLaplaceSubnetMask(model, 7, diag_la).select(loader)
    jac = dense_jacobian(model, x)
    with torch.no_grad():
        p = torch.softmax(model(x), -1)
    lam = torch.diag_embed(p) - torch.einsum("nc,nd->ncd", p, p)
    var = 1 / (torch.einsum("ncp,ncd,ndp->p", jac, lam, jac) + 1.0)
    assert torch.equal(sel, torch.topk(var, 7).indices.sort().values)
    m = LargestMagnitudeSubnetMask(model, 3)
    m.select()
    with pytest.raises(ValueError, match="already selected"):
        m.select()
    # the subnetwork Laplace over the mask, against the dense GGN restricted to it
    la = Laplace(model, "classification", subset_of_weights="subnetwork",
                 hessian_structure="full", subnetwork_indices=idx).fit(loader)  # fmt: skip
    ggn = torch.einsum("ncp,ncd,ndq->pq", jac, lam, jac)[idx][:, idx]
    torch.testing.assert_close(la.posterior_precision, ggn + torch.eye(6, dtype=F64),
                               rtol=1e-10, atol=1e-12)  # fmt: skip
    assert la.mean.shape == w.shape and la.n_params_subnet == 6


def test_diagonal_swag_variance_against_hand_sgd():
    x, y = classification_data(n=20)
    model = cls_model()
    before = flat(model)
    loader = [(x, y)]
    var = fit_diagonal_swag_var(model, loader, nn.CrossEntropyLoss(), n_snapshots_total=3,
                                lr=0.05, momentum=0.0, weight_decay=0.0)  # fmt: skip
    assert torch.equal(flat(model), before)  # the model is not changed
    w, snaps = before.clone(), []
    for _ in range(3):
        wr = w.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(nn.functional.cross_entropy(forward_at(model, wr, x), y), wr)
        w = w - 0.05 * g
        snaps.append(w)
    s = torch.stack(snaps)
    torch.testing.assert_close(var, (s**2).mean(0) - s.mean(0) ** 2, rtol=1e-6, atol=1e-14)
    sel = LargestVarianceSWAGSubnetMask(model, 4, swag_n_snapshots=3).select(loader)
    assert len(sel) == 4


# ------------------------------------------------------------------------------ other examples


def test_prior_mean_continual_learning_full_covariance_log_prob_joint():
    """Task 2's Laplace takes task 1's posterior as its prior (mean and diagonal precision);
    the evidence's scatter uses that mean, the posterior covariance is the dense inverse,
    log_prob is the Gaussian's, and the joint predictive is the dense J Sigma J^T."""
    x1, y1 = classification_data(seed=1)
    x2, y2 = classification_data(seed=2)
    model = trained(cls_model(), x1, y1, nn.CrossEntropyLoss())
    la1 = Laplace(model, "classification", "all", "diag").fit([(x1, y1)])
    m1, d1 = la1.mean.clone(), la1.posterior_precision.clone()
    trained(model.train(), x2, y2, nn.CrossEntropyLoss(), steps=100, lr=0.01)
    la2 = Laplace(model, "classification", "all", "full", prior_mean=m1, prior_precision=d1)
    la2.fit([(x2, y2)])
    w = flat(model)
    torch.testing.assert_close(la2.scatter, ((w - m1) * d1) @ (w - m1))
    jac = dense_jacobian(model, x2)
    with torch.no_grad():
        p = torch.softmax(model(x2), -1)
    lam = torch.diag_embed(p) - torch.einsum("nc,nd->ncd", p, p)
    cov = torch.linalg.inv(torch.einsum("ncp,ncd,ndq->pq", jac, lam, jac) + torch.diag(d1))
    torch.testing.assert_close(la2.posterior_covariance, cov, rtol=1e-8, atol=1e-10)
    dist = torch.distributions.MultivariateNormal(w, covariance_matrix=cov)
    v = la2.sample(3, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(la2.log_prob(v), dist.log_prob(v), rtol=1e-8, atol=1e-8)
    xr, yr = regression_data(n=20)
    net = trained(reg_model(), xr, yr, nn.MSELoss())
    lar = Laplace(net, "regression", "all", "full", sigma_noise=0.3).fit([(xr, yr)])
    xs = torch.tensor([[0.1], [0.7], [1.5]], dtype=F64)
    mu, jcov = lar(xs, pred_type="glm", joint=True)
    cov_r, _ = dense_regression_posterior(net, xr, 1.0, 0.3)
    js = dense_jacobian(net, xs).flatten(0, 1)
    torch.testing.assert_close(jcov, js @ cov_r @ js.T, rtol=1e-8, atol=1e-12)
    assert mu.shape == (3,)


def test_bayesopt_gradient_last_layer():
    """laplace-torch's BayesOpt use: enable_backprop=True, d UCB / dx by autograd equals
    the closed form through the features (dense float64 Jacobian of phi(x))."""
    xr, yr = regression_data(n=30)
    net = trained(reg_model(), xr, yr, nn.MSELoss())
    la = Laplace(net, "regression", "last_layer", "full", enable_backprop=True,
                 sigma_noise=0.3).fit([(xr, yr)])  # fmt: skip
    x = torch.tensor([[0.3]], dtype=F64, requires_grad=True)
    mu, var = la(x)
    ucb = mu[0, 0] + 2 * var[0, 0, 0].sqrt()
    (g,) = torch.autograd.grad(ucb, x)
    cov = la.posterior_covariance.detach()

    def ucb_dense(xx):
        phi = torch.tanh(net[0](xx))
        t = torch.cat([phi, torch.ones(1, 1, dtype=F64)], 1)[0]
        return net(xx)[0, 0] + 2 * (t @ cov @ t).sqrt()

    (g_ref,) = torch.autograd.grad(ucb_dense(x), x)
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------ introspection

#: laplace-torch 0.3's public instance names of BaseLaplace, ParametricLaplace and the
#: Full / Kron / Diag / LowRank, last-layer and subnetwork classes (from its source).
LT_NAMES = [
    "H", "backend", "dict_key_x", "dict_key_y", "enable_backprop", "fit",
    "functional_covariance", "functional_samples", "functional_variance", "is_subset_params",
    "likelihood", "load_state_dict", "log_det_posterior_precision", "log_det_prior_precision",
    "log_det_ratio", "log_likelihood", "log_marginal_likelihood", "log_prob", "loss", "mean",
    "model", "n_data", "n_layers", "n_outputs", "n_params", "optimize_prior_precision",
    "params", "posterior_covariance", "posterior_precision", "posterior_variance",
    "predictive", "predictive_samples", "prior_mean", "prior_precision",
    "prior_precision_diag", "sample", "scatter", "sigma_noise", "square_norm", "state_dict",
    "temperature",
]  # fmt: skip
LT_EXTRA = {  # name: (subset, structure) where laplace-torch has it
    "posterior_scale": [("all", "diag"), ("all", "full")],
    "H_facs": [("all", "kron"), ("last_layer", "kron")],
    "damping": [("all", "kron"), ("last_layer", "kron")],
    "V": [("all", "lowrank")],
    "Kinv": [("all", "lowrank")],
    "functional_variance_fast": [("last_layer", "diag")],
    "data": [("last_layer", "diag")],
    "assemble_full_samples": [("subnetwork", "diag")],
    "n_params_subnet": [("subnetwork", "full")],
    "mean_subnet": [("subnetwork", "full")],
}
LT_INIT = ["model", "likelihood", "sigma_noise", "prior_precision", "prior_mean", "temperature",
           "enable_backprop", "dict_key_x", "dict_key_y", "backend", "backend_kwargs",
           "asdl_fisher_kwargs"]  # fmt: skip
LT_INIT_EXTRA = {("all", "kron"): ["damping"], ("subnetwork", "full"): ["subnetwork_indices"],
                 ("last_layer", "kron"): ["last_layer_name", "feature_reduction"]}  # fmt: skip
LT_CALL = ["x", "pred_type", "joint", "link_approx", "n_samples", "diagonal_output",
           "generator", "fitting"]  # fmt: skip
LT_OPP = ["pred_type", "method", "n_steps", "lr", "init_prior_prec", "prior_structure",
          "val_loader", "loss", "log_prior_prec_min", "log_prior_prec_max", "grid_size",
          "link_approx", "n_samples", "verbose", "progress_bar", "log_prior_prec_base"]  # fmt: skip
LT_FIT = ["train_loader", "override", "progress_bar"]
LT_MARGLIK = ["model", "train_loader", "likelihood", "hessian_structure", "backend",
              "optimizer_cls", "optimizer_kwargs", "scheduler_cls", "scheduler_kwargs",
              "n_epochs", "lr_hyp", "prior_structure", "n_epochs_burnin", "n_hypersteps",
              "marglik_frequency", "prior_prec_init", "sigma_noise_init", "temperature",
              "fix_sigma_noise", "progress_bar", "enable_backprop", "dict_key_x",
              "dict_key_y"]  # fmt: skip


def _fitted(subset, structure, **kw):
    x, y = classification_data(n=20)
    model = cls_model().eval()
    if subset == "subnetwork":
        kw.setdefault("subnetwork_indices", torch.tensor([0, 3, 5, 40]))
    return Laplace(model, "classification", subset, structure, **kw).fit([(x, y)])


@pytest.mark.parametrize(("subset", "structure"), [
    ("all", "diag"), ("all", "kron"), ("all", "full"), ("all", "lowrank"),
    ("last_layer", "diag"), ("last_layer", "kron"), ("last_layer", "full"),
    ("subnetwork", "diag"), ("subnetwork", "full"),
])  # fmt: skip
def test_every_laplace_torch_name_and_argument_exists(subset, structure):
    la = _fitted(subset, structure)
    for name in LT_NAMES:
        getattr(la, name)  # raises AttributeError when missing
    for name, where in LT_EXTRA.items():
        if (subset, structure) in where:
            getattr(la, name)
    params = set(inspect.signature(la.__call__).parameters) | {"x"}
    assert set(LT_CALL) <= params
    assert set(LT_OPP) <= set(inspect.signature(la.optimize_prior_precision).parameters)
    assert set(LT_FIT) <= set(inspect.signature(la.fit).parameters)
    # every constructor argument is taken with laplace-torch's meaning (defaults here)
    extra = LT_INIT_EXTRA.get((subset, structure), [])
    kw = {"sigma_noise": 1.0, "prior_precision": 1.0, "prior_mean": 0.0, "temperature": 1.0,
          "enable_backprop": False, "dict_key_x": "input_ids", "dict_key_y": "labels",
          "backend": "CurvlinopsGGN", "backend_kwargs": None,
          "asdl_fisher_kwargs": None}  # fmt: skip
    assert set(LT_INIT) - {"model", "likelihood"} == set(kw)
    kw |= {"damping": False, "last_layer_name": "2", "feature_reduction": None}
    kw = {k: v for k, v in kw.items() if k in LT_INIT or k in extra}
    _fitted(subset, structure, **kw)
    assert set(LT_MARGLIK) == set(inspect.signature(marglik_training).parameters)


def test_refusals_name_the_fromp_equivalent():
    cases = [
        ({"backend": "CurvlinopsEF"}, "diag_ef"),
        ({"backend": "AsdlHessian"}, "exact GGN"),
        ({"backend_kwargs": {"num_samples": 3}}, "exact"),
        ({"asdl_fisher_kwargs": {"n_mc_samples": 3}}, "exact GGN"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            _fitted("all", "diag", **kw)
    with pytest.raises(ValueError, match="damping=True"):
        _fitted("all", "kron", damping=True)
    with pytest.raises(ValueError, match="feature_reduction"):
        _fitted("last_layer", "diag", feature_reduction="pick_last")
    with pytest.raises(ValueError, match="last_layer_name='0': that layer's output is not"):
        _fitted("last_layer", "diag", last_layer_name="0")
    with pytest.raises(ValueError, match="sod"):
        _fitted("all", "gp", functional_approximation="nystrom")


# ------------------------------------------------------------------------------ side by side


LT_SETUPS = [("all", "diag"), ("all", "kron"), ("all", "full"), ("last_layer", "diag"),
             ("last_layer", "kron"), ("last_layer", "full"), ("subnetwork", "full")]  # fmt: skip


@pytest.mark.parametrize(("subset", "structure"), LT_SETUPS)
def test_side_by_side_with_laplace_torch(subset, structure):
    """Where laplace-torch 0.3 is installed: the same float64 setup in both libraries (its
    default CurvlinopsGGN backend) gives the same evidence, its terms, the predictive and
    the hyperparameters of the README loop, to 1e-10."""
    lt = pytest.importorskip("laplace", reason="laplace-torch is not installed (.[laplace])")
    # laplace-torch's dense GGN goes through torch.eye in the default dtype
    old = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    try:
        _side_by_side(lt, subset, structure)
    finally:
        torch.set_default_dtype(old)


def _side_by_side(lt, subset, structure):
    x, y = classification_data(n=24)
    model = trained(cls_model(), x, y, nn.CrossEntropyLoss(), steps=100)
    loader = DataLoader(TensorDataset(x, y), batch_size=8)
    kw = {"subnetwork_indices": torch.tensor([0, 5, 9, 30, 40])} if subset == "subnetwork" else {}
    mine = Laplace(model, "classification", subset, structure, prior_precision=0.7, **kw)
    theirs = lt.Laplace(model, "classification", subset_of_weights=subset,
                        hessian_structure=structure, prior_precision=0.7, **kw)  # fmt: skip
    mine.fit(loader)
    theirs.fit(loader)
    for name in ("log_likelihood", "scatter", "log_det_ratio", "log_det_posterior_precision"):
        torch.testing.assert_close(
            getattr(mine, name).reshape(()),
            getattr(theirs, name).reshape(()),
            rtol=1e-10,
            atol=1e-10,
        )
    for d in (0.3, 2.0):
        torch.testing.assert_close(mine.log_marginal_likelihood(torch.tensor(d, dtype=F64)),
                                   theirs.log_marginal_likelihood(torch.tensor(d, dtype=F64))
                                   .reshape(()), rtol=1e-10, atol=1e-10)  # fmt: skip
    xs = torch.randn(6, 2, dtype=F64, generator=torch.Generator().manual_seed(4))
    for link in ("probit", "bridge", "bridge_norm"):
        torch.testing.assert_close(mine(xs, link_approx=link), theirs(xs, link_approx=link),
                                   rtol=1e-10, atol=1e-10)  # fmt: skip
    mine.optimize_prior_precision(method="marglik", optimizer="adam")
    theirs.optimize_prior_precision(method="marglik")
    torch.testing.assert_close(
        mine.prior_precision.reshape(()), theirs.prior_precision.reshape(()), rtol=1e-10, atol=0
    )
    assert mine.n_outputs == theirs.n_outputs and mine.likelihood == theirs.likelihood


REG_SETUPS = [("all", "full"), ("all", "diag"), ("all", "kron"), ("last_layer", "kron")]


@pytest.mark.parametrize(("subset", "structure"), REG_SETUPS)
def test_side_by_side_regression_readme_loop_joint_log_prob_and_gradient(subset, structure):
    """Where laplace-torch 0.3 is installed: its README regression loop, the joint
    predictive, log_prob and the enable_backprop gradient, in both libraries, to 1e-10. With
    ``"kron"`` laplace-torch's evidence is not differentiated in ``sigma_noise`` through its
    log-determinant (its ``KronDecomposed * scalar`` turns the factor into a Python number),
    so there the loop is not compared: the values agree, and fromp's gradient is the
    finite difference of laplace-torch's values."""
    lt = pytest.importorskip("laplace", reason="laplace-torch is not installed (.[laplace])")
    old = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    try:
        _regression_side_by_side(lt, subset, structure)
    finally:
        torch.set_default_dtype(old)


def _regression_side_by_side(lt, subset, structure):
    x, y = regression_data(n=30)
    model = trained(reg_model(), x, y, nn.MSELoss(), steps=300)
    loader = DataLoader(TensorDataset(x, y), batch_size=10)
    close = {"rtol": 1e-10, "atol": 1e-10}
    las = []
    for lib in (Laplace, lt.Laplace):
        la = lib(model, "regression", subset_of_weights=subset, hessian_structure=structure,
                 enable_backprop=True)  # fmt: skip
        la.fit(loader)
        las.append(la)
    mine, theirs = las
    if structure == "kron":
        for d, s in ((2.0, 0.3), (0.5, 1.2)):
            dd, ss = torch.tensor([d]), torch.tensor([s], requires_grad=True)
            value = mine.log_marginal_likelihood(dd, ss)
            torch.testing.assert_close(value.reshape(()), theirs.log_marginal_likelihood(
                dd, torch.tensor([s])).reshape(()), **close)  # fmt: skip
            (g,) = torch.autograd.grad(value.sum(), ss)
            h = 1e-6
            up = theirs.log_marginal_likelihood(dd, torch.tensor([s + h]))
            down = theirs.log_marginal_likelihood(dd, torch.tensor([s - h]))
            torch.testing.assert_close(g, ((up - down) / (2 * h)).reshape(1).detach(),
                                       rtol=1e-6, atol=1e-6)  # fmt: skip
        for la in las:  # the same stored values for the predictives below
            la.prior_precision, la.sigma_noise = torch.tensor([1.5]), torch.tensor([0.7])
    else:
        for la in las:
            log_prior = torch.ones(1, dtype=F64, requires_grad=True)
            log_sigma = torch.ones(1, dtype=F64, requires_grad=True)
            opt = torch.optim.Adam([log_prior, log_sigma], lr=1e-1)
            for _ in range(50):
                opt.zero_grad()
                (-la.log_marginal_likelihood(log_prior.exp(), log_sigma.exp())).sum().backward()
                opt.step()
        torch.testing.assert_close(mine.prior_precision.reshape(()),
                                   theirs.prior_precision.reshape(()), **close)  # fmt: skip
        torch.testing.assert_close(mine.sigma_noise, theirs.sigma_noise.reshape(()), **close)
    xs = torch.tensor([[0.2], [1.1], [2.5]], dtype=F64)
    for a, b in zip(mine(xs, joint=True), theirs(xs, joint=True)):
        torch.testing.assert_close(a.detach(), b.detach(), **close)
    for a, b in zip(mine(xs, diagonal_output=True), theirs(xs, diagonal_output=True)):
        torch.testing.assert_close(a.detach(), b.detach(), **close)
    if structure != "kron" or subset == "all":
        v = theirs.mean.detach() + 0.01
        torch.testing.assert_close(mine.log_prob(v), theirs.log_prob(v).reshape(()), **close)
    grads = []
    for la in (mine, theirs):
        xg = xs.clone().requires_grad_(True)
        mu, var = la(xg)
        (g,) = torch.autograd.grad((mu + var.squeeze(-1).sqrt()).sum(), xg)
        grads.append(g)
    torch.testing.assert_close(grads[0], grads[1], **close)


def test_side_by_side_marglik_training_and_masks():
    """Where laplace-torch 0.3 is installed: ``marglik_training`` (full GGN through its
    CurvlinopsGGN backend, classification) gives the same losses, negative log evidences and
    prior precision, and the subnetwork masks select the same indices."""
    lt = pytest.importorskip("laplace", reason="laplace-torch is not installed (.[laplace])")
    from laplace.curvature import CurvlinopsGGN
    from laplace.utils import subnetmask as ltm

    old = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    try:
        x, y = classification_data(n=24)
        loader = DataLoader(TensorDataset(x, y), batch_size=8)
        outs = []
        for fn in (marglik_training, lt.marglik_training):
            out = fn(cls_model(), loader, likelihood="classification", hessian_structure="full",
                     backend=CurvlinopsGGN, n_epochs=4, n_hypersteps=3, marglik_frequency=2,
                     optimizer_kwargs={"lr": 0.01})  # fmt: skip
            outs.append(out)
        (la1, m1, ml1, l1), (la2, m2, ml2, l2) = outs
        close = {"rtol": 1e-9, "atol": 1e-9}
        torch.testing.assert_close(torch.tensor(l1), torch.tensor(l2), **close)
        torch.testing.assert_close(torch.tensor(ml1), torch.tensor(ml2), **close)
        torch.testing.assert_close(la1.prior_precision, la2.prior_precision.reshape(-1), **close)
        torch.testing.assert_close(flat(m1), flat(m2), **close)
        model = trained(cls_model(), x, y, nn.CrossEntropyLoss(), steps=50)
        names = ["2.weight"]
        pairs = [
            (LargestMagnitudeSubnetMask(model, 7), ltm.LargestMagnitudeSubnetMask(model, 7)),
            (ParamNameSubnetMask(model, names), ltm.ParamNameSubnetMask(model, names)),
            (ModuleNameSubnetMask(model, ["0"]), ltm.ModuleNameSubnetMask(model, ["0"])),
            (LastLayerSubnetMask(model), ltm.LastLayerSubnetMask(model)),
        ]  # fmt: skip
        for a, b in pairs:
            assert torch.equal(a.select(loader), b.select(loader).cpu())
    finally:
        torch.set_default_dtype(old)


def test_option_enums_stand_where_laplace_torch_has_them():
    """laplace-torch 0.3 exports its eight option enums from ``laplace`` and from
    ``laplace.utils``: ``fromp.laplace`` and ``fromp.utils`` have them all, the same objects."""
    import fromp.laplace
    import fromp.laplace.options
    import fromp.utils

    names = ("SubsetOfWeights", "FunctionalApproximation", "HessianStructure", "Likelihood",
             "PredType", "LinkApprox", "TuningMethod", "PriorStructure")  # fmt: skip
    for module in (fromp.laplace, fromp.utils):
        for name in names:
            assert name in module.__all__, (module.__name__, name)
            assert getattr(module, name) is getattr(fromp.laplace.options, name)
