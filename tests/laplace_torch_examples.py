"""19 calls from laplace-torch 0.3's documentation (its README / index page, the regression,
calibration, calibration-GP, Hugging Face and Bayesian-optimisation examples, the
subnetwork, serialisation and ``marglik_training`` sections), written once against a library
module ``lib`` (``laplace`` or ``fromp``: only the import differs) on small float64 problems
with fixed weights. ``run_all(lib)`` returns each example's numbers; the reference numbers in
``laplace_torch_reference.json`` were computed with laplace-torch 0.3 by

    python tests/laplace_torch_examples.py > tests/laplace_torch_reference.json

in an environment where ``import laplace`` is laplace-torch 0.3 (torch 2.14.1)."""

from __future__ import annotations

import io
import json
import sys
import warnings
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

F64 = torch.float64


def _cls_data(n: int = 48, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, dtype=F64, generator=g)
    y = ((x[:, 0] > 0).long() + (x[:, 1] > 0.4).long()).clamp_max(2)
    return x, y


def _reg_data(n: int = 40, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.linspace(-2, 2, n, dtype=F64).unsqueeze(1)
    return x, torch.sin(2 * x) + 0.2 * torch.randn(n, 1, dtype=F64, generator=g)


def _trained(model: nn.Module, x, y, loss, steps: int = 300) -> nn.Module:
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(steps):
        opt.zero_grad()
        loss(model(x), y).backward()
        opt.step()
    return model.eval()


def _cls_model():
    torch.manual_seed(0)
    x, y = _cls_data()
    net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 3)).to(F64)
    return _trained(net, x, y, nn.CrossEntropyLoss())


def _reg_model():
    torch.manual_seed(0)
    x, y = _reg_data()
    net = nn.Sequential(nn.Linear(1, 10), nn.Tanh(), nn.Linear(10, 1)).to(F64)
    return _trained(net, x, y, nn.MSELoss(), steps=800)


def _cls_loader(batch_size: int = 16):
    x, y = _cls_data()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def _x_test(n: int = 6, d: int = 3):
    return torch.randn(n, d, dtype=F64, generator=torch.Generator().manual_seed(7))


def _vals(t: Any) -> list[float]:
    return [float(v) for v in torch.as_tensor(t).detach().reshape(-1)]


# ------------------------------------------------------------------------------ examples


def simple_usage(lib):
    """index.md "Simple usage": all weights, diagonal, grid search on validation data."""
    la = lib.Laplace(
        _cls_model(), "classification", subset_of_weights="all", hessian_structure="diag"
    )
    la.fit(_cls_loader())
    x, y = _cls_data(24, seed=1)
    la.optimize_prior_precision(
        method="gridsearch",
        pred_type="glm",
        link_approx="probit",
        val_loader=DataLoader(TensorDataset(x, y), batch_size=8),
    )
    return {
        "prior_precision": _vals(la.prior_precision),
        "pred": _vals(la(_x_test(), pred_type="glm", link_approx="probit")),
    }


def marginal_likelihood(lib):
    """index.md "Marginal likelihood": the default last-layer KFAC, regression, the
    evidence and its gradient in the prior precision and the noise."""
    x, y = _reg_data()
    la = lib.Laplace(_reg_model(), likelihood="regression")
    la.fit(DataLoader(TensorDataset(x, y), batch_size=10))
    prior_prec = torch.tensor(2.0, dtype=F64, requires_grad=True)
    obs_noise = torch.tensor(0.3, dtype=F64, requires_grad=True)
    ml = la.log_marginal_likelihood(prior_prec, obs_noise)
    ml.backward()
    return {"ml": _vals(ml), "grad": _vals(torch.stack([prior_prec.grad, obs_noise.grad]))}


def regression_example(lib):
    """regression_example.md: all weights, full, the Adam loop on the evidence in
    ``log prior precision`` and ``log sigma``, the GLM predictive."""
    x, y = _reg_data()
    la = lib.Laplace(_reg_model(), "regression", subset_of_weights="all", hessian_structure="full")
    la.fit(DataLoader(TensorDataset(x, y), batch_size=10))
    log_prior, log_sigma = torch.ones(1, requires_grad=True), torch.ones(1, requires_grad=True)
    hyper_optimizer = torch.optim.Adam([log_prior, log_sigma], lr=1e-1)
    for _ in range(100):
        hyper_optimizer.zero_grad()
        neg_marglik = -la.log_marginal_likelihood(log_prior.exp(), log_sigma.exp())
        neg_marglik.backward()
        hyper_optimizer.step()
    xs = torch.linspace(-3, 3, 7, dtype=F64).unsqueeze(1)
    f_mu, f_var = la(xs)
    return {
        "prior_precision": _vals(la.prior_precision),
        "sigma": _vals(la.sigma_noise),
        "f_mu": _vals(f_mu),
        "f_var": _vals(f_var),
    }


def _marglik(lib, subset, structure, **kw):
    la = lib.Laplace(
        _cls_model(), "classification", subset_of_weights=subset, hessian_structure=structure, **kw
    )
    la.fit(_cls_loader())
    la.optimize_prior_precision(method="marglik", pred_type="glm", link_approx="probit")
    return {
        "prior_precision": _vals(la.prior_precision),
        "evidence": _vals(la.log_marginal_likelihood()),
        "pred": _vals(la(_x_test(), pred_type="glm", link_approx="probit")),
    }


def calibration_example(lib):
    """calibration_example.md: last layer, KFAC, marglik prior, probit predictive."""
    return _marglik(lib, "last_layer", "kron")


def marglik_all_diag(lib):
    return _marglik(lib, "all", "diag")


def marglik_all_kron(lib):
    return _marglik(lib, "all", "kron")


def marglik_all_full(lib):
    return _marglik(lib, "all", "full")


def marglik_last_layer_diag(lib):
    return _marglik(lib, "last_layer", "diag")


def marglik_last_layer_full(lib):
    return _marglik(lib, "last_layer", "full")


def calibration_bridge(lib):
    """calibration_example.md's other predictive: the Laplace bridge."""
    la = lib.Laplace(
        _cls_model(),
        "classification",
        subset_of_weights="all",
        hessian_structure="kron",
        prior_precision=2.0,
    )
    la.fit(_cls_loader())
    return {"pred": _vals(la(_x_test(), pred_type="glm", link_approx="bridge"))}


def subnetwork(lib, mask_module):
    """index.md "Subnetwork Laplace": the 12 largest weights, full covariance."""
    model = _cls_model()
    indices = mask_module.LargestMagnitudeSubnetMask(model, n_params_subnet=12).select()
    la = lib.Laplace(
        model,
        "classification",
        subset_of_weights="subnetwork",
        hessian_structure="full",
        subnetwork_indices=indices,
        prior_precision=0.5,
    )
    la.fit(_cls_loader())
    return {
        "indices": _vals(indices),
        "evidence": _vals(la.log_marginal_likelihood()),
        "pred": _vals(la(_x_test())),
    }


class MyHFModel(nn.Module):
    """huggingface_example.md's wrapper: ``forward`` takes the whole mapping batch."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, data):
        return self.net(data["input_ids"] * data["attention_mask"])


class _DictDataset(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.x, self.y = _cls_data()

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {
            "input_ids": self.x[i],
            "attention_mask": torch.ones(1, dtype=F64),
            "labels": self.y[i],
        }


def _dict_loader():
    return DataLoader(_DictDataset(), batch_size=16)


def huggingface_example(lib):
    """huggingface_example.md / index.md "Laplace on LLMs": a model taking dict batches,
    gradients only in the last layer, subset "all", diagonal, default prior search."""
    model = MyHFModel(_cls_model())
    for p in model.net[0].parameters():
        p.requires_grad = False
    la = lib.Laplace(
        model, likelihood="classification", subset_of_weights="all", hessian_structure="diag"
    )
    la.fit(_dict_loader())
    la.optimize_prior_precision()
    test_data = next(iter(_dict_loader()))
    return {"prior_precision": _vals(la.prior_precision), "pred": _vals(la(test_data))}


def huggingface_kron(lib):
    """The same model and dict batches with the default last-layer KFAC."""
    la = lib.Laplace(MyHFModel(_cls_model()), "classification", prior_precision=1.5)
    la.fit(_dict_loader())
    return {
        "evidence": _vals(la.log_marginal_likelihood()),
        "pred": _vals(la(next(iter(_dict_loader())))),
    }


def calibration_gp_example(lib):
    """calibration_gp_example.md: FunctionalLaplace (hessian_structure="gp")."""
    la = lib.Laplace(
        _cls_model(),
        "classification",
        subset_of_weights="all",
        hessian_structure="gp",
        n_subset=20,
        prior_precision=2.0,
    )
    la.fit(_cls_loader())
    return {
        "evidence": _vals(la.log_marginal_likelihood()),
        "pred": _vals(la(_x_test(), pred_type="gp", link_approx="probit")),
    }


def bayesopt_example(lib):
    """bayesopt_example.py: last-layer KFAC with ``enable_backprop``: the gradient of the
    predictive mean plus deviation in the inputs."""
    x, y = _reg_data()
    la = lib.Laplace(
        _reg_model(),
        "regression",
        subset_of_weights="last_layer",
        hessian_structure="kron",
        enable_backprop=True,
        prior_precision=1.0,
    )
    la.fit(DataLoader(TensorDataset(x, y), batch_size=10))
    xs = torch.linspace(-1, 1, 5, dtype=F64).unsqueeze(1).requires_grad_(True)
    f_mu, f_var = la(xs, pred_type="glm")
    (f_mu.squeeze() + f_var.squeeze().sqrt()).sum().backward()
    return {"f_mu": _vals(f_mu), "f_var": _vals(f_var), "grad": _vals(xs.grad)}


def prior_mean_continual(lib):
    """laplace-redux's continual learning: the previous task's weights as a prior mean
    (a scalar given here: laplace-torch keeps it a scalar)."""
    la = lib.Laplace(
        _cls_model(),
        "classification",
        subset_of_weights="all",
        hessian_structure="diag",
        prior_precision=2.0,
        prior_mean=0.1,
    )
    la.fit(_cls_loader())
    return {
        "prior_mean_shape": list(la.prior_mean.shape),
        "evidence": _vals(la.log_marginal_likelihood()),
    }


def serialization(lib):
    """index.md "Serialization": ``state_dict`` into a new Laplace of the same model."""
    model = _cls_model()
    la = lib.Laplace(
        model,
        "classification",
        subset_of_weights="all",
        hessian_structure="diag",
        prior_precision=0.7,
    )
    la.fit(_cls_loader())
    buf = io.BytesIO()
    torch.save(la.state_dict(), buf)
    la2 = lib.Laplace(model, "classification", subset_of_weights="all", hessian_structure="diag")
    buf.seek(0)
    la2.load_state_dict(torch.load(buf))
    return {"evidence": _vals(la2.log_marginal_likelihood()), "pred": _vals(la2(_x_test()))}


def marglik_training_example(lib):
    """index.md / ``marglik_training``: two epochs, diagonal, the evidence after each
    hyperparameter step and the final prior precision."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 3)).to(F64)
    la, model, margliks, losses = lib.marglik_training(
        model,
        _cls_loader(),
        likelihood="classification",
        hessian_structure="diag",
        n_epochs=2,
        n_hypersteps=3,
        optimizer_kwargs={"lr": 1e-2},
        prior_structure="scalar",
    )
    return {"margliks": margliks, "losses": losses, "prior_precision": _vals(la.prior_precision)}


def kron_matrices(lib):
    """The Kronecker ``H`` and posterior precision as dense matrices (``to_matrix()``)."""
    la = lib.Laplace(
        _cls_model(),
        "classification",
        subset_of_weights="last_layer",
        hessian_structure="kron",
        prior_precision=0.5,
    )
    la.fit(_cls_loader())
    return {"H": _vals(la.H.to_matrix()), "precision": _vals(la.posterior_precision.to_matrix())}


EXAMPLES = [
    simple_usage,
    marginal_likelihood,
    regression_example,
    calibration_example,
    marglik_all_diag,
    marglik_all_kron,
    marglik_all_full,
    marglik_last_layer_diag,
    marglik_last_layer_full,
    calibration_bridge,
    subnetwork,
    huggingface_example,
    huggingface_kron,
    calibration_gp_example,
    bayesopt_example,
    prior_mean_continual,
    serialization,
    marglik_training_example,
    kron_matrices,
]


def run(example, lib, mask_module) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if example is subnetwork:
            return example(lib, mask_module)
        return example(lib)


if __name__ == "__main__":  # the reference numbers, with laplace-torch installed
    import laplace
    import laplace.utils

    out = {}
    for ex in EXAMPLES:
        try:
            out[ex.__name__] = run(ex, laplace, laplace.utils)
        except Exception as err:  # recorded: laplace-torch cannot run it
            out[ex.__name__] = {"error": f"{type(err).__name__}: {err}"[:300]}
    json.dump(
        {"laplace-torch": "0.3", "torch": torch.__version__, "examples": out}, sys.stdout, indent=1
    )
