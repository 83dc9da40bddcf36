"""``fromp.Laplace(..., subset_of_weights="subnetwork", subnetwork_indices=idx)`` against
dense float64 autograd on a small MLP and a small CNN: the precision is the dense GGN's
``[idx][:, idx]`` block plus ``delta`` in the order of ``idx`` (unsorted, across several
parameter tensors), the evidence, the GLM probit predictive, the functional variance and
kernel from the Jacobian's columns ``idx``, per-tensor priors, sample moments (full vectors,
the rest at the MAP), ``override=False``, the state round trip, the prior search, the score
masks and the refusals of bad ``subnetwork_indices``."""

from __future__ import annotations

import math

import pytest
import torch
from test_laplace_api import cnn, data, dense_ggn_blocks, mlp
from torch import nn
from torch.nn.utils import parameters_to_vector

from fromp import Laplace
from fromp.laplace.subnet import (
    LargestMagnitudeSubnetMask,
    LargestVarianceDiagLaplaceSubnetMask,
)
from fromp.likelihood import CategoricalLikelihood

F64 = torch.float64
MODELS = {"mlp": (mlp, (4,)), "cnn": (cnn, (1, 5, 5))}


def indices(p_total: int, s: int = 7, seed: int = 3) -> torch.Tensor:
    """``s`` distinct indices in a random (unsorted) order."""
    return torch.randperm(p_total, generator=torch.Generator().manual_seed(seed))[:s]


def dense(model, x):
    names = [n for n, _ in model.named_parameters()]
    return dense_ggn_blocks(model, x, names)  # g [P, P], jac [N, C, P], flat [P], f


def tensor_of(model, idx):
    """For each index, the number of its parameter tensor among those hit (model order)."""
    ends = torch.tensor([p.numel() for p in model.parameters()]).cumsum(0)
    t = torch.searchsorted(ends, idx, right=True)
    return torch.unique(t, return_inverse=True)[1]


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("structure", ["full", "diag"])
@pytest.mark.parametrize("method", ["forward", "reverse", "capture"])
def test_subnetwork_against_dense(model_name, structure, method):
    make, shape = MODELS[model_name]
    model = make()
    x, y = data(shape)
    g, jac, flat, f = dense(model, x)
    idx = indices(len(flat))
    assert not bool((idx[1:] > idx[:-1]).all())  # unsorted: the order must be kept
    la = Laplace(model, "classification", "subnetwork", structure, subnetwork_indices=idx,
                 prior_precision=0.7, method=method)  # fmt: skip
    la.fit([(x[:4], y[:4]), (x[4:], y[4:])])
    g_ss = g[idx][:, idx]
    if structure == "diag":
        g_ss = torch.diag(torch.diagonal(g_ss))
    prec = g_ss + 0.7 * torch.eye(len(idx), dtype=F64)
    torch.testing.assert_close(la.mean_subnet, flat[idx])
    torch.testing.assert_close(la.mean, flat)
    torch.testing.assert_close(la.full_mean, flat)
    got = la.posterior_precision
    torch.testing.assert_close(got if structure == "full" else torch.diag(got), prec)
    cov = torch.linalg.inv(prec)
    torch.testing.assert_close(la.posterior_covariance, cov)
    torch.testing.assert_close(la.posterior_variance, torch.diagonal(cov))
    with torch.no_grad():
        nll = CategoricalLikelihood().nll(model(x), y).sum()
    want = -nll - 0.5 * 0.7 * (flat[idx] ** 2).sum()
    want = want - 0.5 * (torch.logdet(prec) - len(idx) * math.log(0.7))
    torch.testing.assert_close(la.log_marginal_likelihood(), want, rtol=1e-10, atol=1e-9)
    js = jac[:, :, idx]
    fvar = torch.einsum("ncp,pq,ndq->ncd", js, cov, js)
    torch.testing.assert_close(la.functional_variance_at(x), fvar, rtol=1e-8, atol=1e-12)
    probit = torch.softmax(f / torch.sqrt(1 + math.pi / 8 * torch.diagonal(fvar, 0, 1, 2)), 1)
    torch.testing.assert_close(la(x, link_approx="probit"), probit, rtol=1e-8, atol=1e-12)
    k = la.gp().kernel(x[:3], x[3:7])
    want_k = torch.einsum("ncp,pq,mdq->ncmd", js[:3], cov, js[3:7])
    torch.testing.assert_close(k, want_k, rtol=1e-8, atol=1e-12)


def test_every_index_equals_the_all_weights_laplace():
    """``subnetwork_indices = arange(P)`` is the all-weights full Laplace, classification
    and regression (with the noise and the temperature)."""
    model = mlp()
    x, y = data((4,), n=12)
    idx = torch.arange(sum(p.numel() for p in model.parameters()))
    sub = Laplace(model, "classification", "subnetwork", "full", subnetwork_indices=idx)
    full = Laplace(model, "classification", "all", "full")
    for la in (sub.fit((x, y)), full.fit((x, y))):
        la.prior_precision = 0.3
    torch.testing.assert_close(sub.log_marginal_likelihood(), full.log_marginal_likelihood())
    torch.testing.assert_close(sub(x), full(x))
    yr = torch.randn(12, 3, generator=torch.Generator().manual_seed(0), dtype=F64)
    kw = {"sigma_noise": 0.4, "temperature": 1.5, "prior_precision": 2.0}
    sub = Laplace(model, "regression", "subnetwork", "full", subnetwork_indices=idx, **kw)
    full = Laplace(model, "regression", "all", "full", **kw)
    sub.fit((x, yr)), full.fit((x, yr))
    torch.testing.assert_close(sub.log_marginal_likelihood(), full.log_marginal_likelihood())
    torch.testing.assert_close(
        sub.log_marginal_likelihood(0.5, 0.8), full.log_marginal_likelihood(0.5, 0.8)
    )
    torch.testing.assert_close(sub(x)[1], full(x)[1])


def test_layerwise_prior_and_prior_mean():
    """A per-tensor ``delta`` goes to the entries of its tensor (tensors hit, model order);
    the prior mean is over the subnetwork."""
    model = cnn()
    x, y = data((1, 5, 5))
    g, _, flat, _ = dense(model, x)
    idx = indices(len(flat), s=9, seed=5)
    layer = tensor_of(model, idx)
    n_layers = int(layer.max()) + 1
    assert n_layers >= 3
    deltas = torch.linspace(0.5, 3.0, n_layers, dtype=F64)
    m0 = torch.linspace(-0.2, 0.2, len(idx), dtype=F64)
    la = Laplace(model, "classification", "subnetwork", "full", subnetwork_indices=idx,
                 prior_precision=deltas, prior_mean=m0).fit((x, y))  # fmt: skip
    assert la.n_layers == n_layers
    d = deltas[layer]
    prec = g[idx][:, idx] + torch.diag(d)
    torch.testing.assert_close(la.posterior_precision, prec)
    with torch.no_grad():
        nll = CategoricalLikelihood().nll(model(x), y).sum()
    want = -nll - 0.5 * (d * (flat[idx] - m0) ** 2).sum()
    want = want - 0.5 * (torch.logdet(prec) - d.log().sum())
    torch.testing.assert_close(la.log_marginal_likelihood(), want, rtol=1e-10, atol=1e-9)


@pytest.mark.parametrize("structure", ["full", "diag"])
def test_samples_are_full_vectors_with_the_right_moments(structure):
    model = mlp()
    x, y = data((4,), n=20)
    flat = parameters_to_vector(model.parameters()).detach()
    idx = indices(len(flat), s=6)
    la = Laplace(model, "classification", "subnetwork", structure, subnetwork_indices=idx,
                 prior_precision=3.0).fit((x, y))  # fmt: skip
    s = la.sample(40_000, generator=torch.Generator().manual_seed(0))
    assert s.shape == (40_000, len(flat))
    rest = torch.ones(len(flat), dtype=torch.bool)
    rest[idx] = False
    assert torch.equal(s[:, rest], flat[rest].expand(40_000, -1))
    cov = la.posterior_covariance
    sub = s[:, idx]
    torch.testing.assert_close(sub.mean(0), flat[idx], atol=4 * cov.diagonal().sqrt().max() / 200,
                               rtol=0)  # fmt: skip
    torch.testing.assert_close(torch.cov(sub.T), cov, atol=0.03 * cov.diagonal().max(), rtol=0)
    # weight-sample predictive at a tiny variance is the MAP's
    la.prior_precision = 1e8
    with torch.no_grad():
        p0 = torch.softmax(model(x), 1)
    torch.testing.assert_close(la(x, pred_type="nn", n_samples=5), p0, atol=1e-4, rtol=0)


@pytest.mark.parametrize("structure", ["full", "diag"])
def test_override_false_and_state_round_trip(structure):
    model = mlp()
    x, y = data((4,), n=12)
    idx = indices(38)
    kw = {"subnetwork_indices": idx}
    one = Laplace(model, "classification", "subnetwork", structure, **kw).fit((x, y))
    two = Laplace(model, "classification", "subnetwork", structure, **kw).fit((x[:5], y[:5]))
    half = two.log_marginal_likelihood(0.3)
    two.fit((x[5:], y[5:]), override=False)
    assert two.n_data == 12
    assert not torch.allclose(half, two.log_marginal_likelihood(0.3))
    torch.testing.assert_close(two.log_marginal_likelihood(0.3), one.log_marginal_likelihood(0.3))
    torch.testing.assert_close(two(x), one(x))
    one.prior_precision = 2.5
    fresh = Laplace(mlp(), "classification", "subnetwork", structure, **kw)
    fresh.load_state_dict(one.state_dict())
    torch.testing.assert_close(fresh.log_marginal_likelihood(), one.log_marginal_likelihood())
    torch.testing.assert_close(fresh(x), one(x))
    torch.testing.assert_close(fresh.full_mean, one.full_mean)
    other = Laplace(mlp(), "classification", "subnetwork", structure,
                    subnetwork_indices=idx.flip(0))  # fmt: skip
    with pytest.raises(ValueError, match="subnetwork_indices"):
        other.load_state_dict(one.state_dict())


@pytest.mark.parametrize("structure", ["full", "diag"])
def test_marglik_never_lowers_the_evidence(structure):
    model = mlp()
    x, y = data((4,), n=30)
    idx = indices(38, s=12)
    for prior_structure in ("scalar", "layerwise", "diag"):
        la = Laplace(model, "classification", "subnetwork", structure, subnetwork_indices=idx,
                     prior_precision=50.0).fit((x, y))  # fmt: skip
        before = la.log_marginal_likelihood()
        d = la.optimize_prior_precision(method="marglik", prior_structure=prior_structure)
        after = la.log_marginal_likelihood()
        assert after >= before - 1e-12
        assert after > before + 1e-3  # 50 is far from the optimum
        for f in (0.9, 1.1):
            assert la.log_marginal_likelihood(d * f) <= after + 1e-8


def test_score_masks():
    model = mlp()
    x, y = data((4,), n=20)
    flat = parameters_to_vector(model.parameters()).detach()
    idx = LargestMagnitudeSubnetMask(model, n_params_subnet=5).select()
    assert idx.dtype == torch.long
    assert torch.equal(idx, flat.abs().topk(5).indices.sort().values)
    diag = Laplace(model, "classification", "all", "diag", prior_precision=0.5)
    mask = LargestVarianceDiagLaplaceSubnetMask(model, 6, diag)
    idx = mask.select((x, y))
    torch.testing.assert_close(torch.sort(diag.posterior_variance[idx]).values,
                               torch.sort(diag.posterior_variance).values[-6:])  # fmt: skip
    la = Laplace(model, "classification", "subnetwork", "full", subnetwork_indices=idx)
    la.fit((x, y))
    assert la.num_params == 6
    with pytest.raises(ValueError, match="n_params_subnet"):
        LargestMagnitudeSubnetMask(model, n_params_subnet=len(flat) + 1)
    with pytest.raises(ValueError, match="train_loader"):
        LargestVarianceDiagLaplaceSubnetMask(model, 6, diag).select()


def test_bad_subnetwork_indices_are_refused_before_any_work():
    class Boom(nn.Module):
        """A model that fails if anything runs it."""

        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            raise AssertionError("the model was run")

    model = Boom()
    cases = [
        (None, ValueError, "needs subnetwork_indices"),
        ([0, 1], TypeError, "subnetwork_indices must be a 1-D torch.long"),
        (torch.tensor([0, 1], dtype=torch.int32), TypeError, "subnetwork_indices.*torch.long"),
        (torch.tensor([0.0, 1.0]), TypeError, "subnetwork_indices.*torch.long"),
        (torch.tensor([[0, 1]]), ValueError, "subnetwork_indices must be a non-empty 1-D"),
        (torch.tensor([], dtype=torch.long), ValueError, "subnetwork_indices must be a non-"),
        (torch.tensor([0, 15]), ValueError, r"subnetwork_indices must lie in \[0, 15\)"),
        (torch.tensor([-1, 2]), ValueError, r"subnetwork_indices must lie in \[0, 15\)"),
        (torch.tensor([3, 1, 3]), ValueError, "subnetwork_indices must not contain duplicate"),
    ]
    for idx, err, msg in cases:
        with pytest.raises(err, match=msg):
            Laplace(model, "classification", "subnetwork", "full", subnetwork_indices=idx)
    ok = torch.tensor([0, 1])
    for structure in ("kron", "lowrank"):
        with pytest.raises(ValueError, match=r"not available; supported"):
            Laplace(model, "classification", "subnetwork", structure, subnetwork_indices=ok)
    with pytest.raises(TypeError, match="subnetwork_indices"):
        Laplace(model, "classification", "all", "full", subnetwork_indices=ok)
    with pytest.raises(ValueError, match="method must be"):
        Laplace(model, "classification", "subnetwork", "full", subnetwork_indices=ok,
                method="jacobian")  # fmt: skip


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_capture_columns_on_every_layer_kind_equal_autograds(chunk_size):
    """``method="capture"`` (the default for ``S > C``) on a network with strided, dilated,
    grouped and 1-d convolutions, batch norm (eval), group and layer norm, a sequence
    Linear and a layer with no capture rule (``Scale``: its entries through per-example
    Jacobians): the subnetwork's Jacobian columns equal autograd's dense Jacobian's, in the
    order of the indices, with chunks of 3 of the 7 examples too (a chunk boundary inside
    the batch), and the precision is the dense GGN's block."""
    from fromp.testing import conv_zoo, dense_jacobian

    torch.manual_seed(0)
    model = conv_zoo(3, seed=0).eval()
    x = torch.randn(7, 2, 8, 8, dtype=F64)
    y = torch.arange(7) % 3
    flat = parameters_to_vector(model.parameters()).detach()
    ends = torch.tensor([p.numel() for p in model.parameters()]).cumsum(0)
    names = [n for n, _ in model.named_parameters()]
    scale_start = int(ends[names.index("scale.s") - 1])
    idx = torch.cat([indices(len(flat), 40, seed=5), torch.tensor([scale_start + 1])])
    idx = torch.unique(idx)[torch.randperm(len(torch.unique(idx)))]  # unsorted, distinct
    la = Laplace(model, "classification", "subnetwork", "full", subnetwork_indices=idx,
                 prior_precision=1.0, chunk_size=chunk_size)  # fmt: skip
    _, got = la._jacobian(x)
    want = dense_jacobian(model, x)[:, :, idx]  # [N, C, S]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert got[:, :, (idx == scale_start + 1).nonzero()[0, 0]].abs().sum() > 0
    la.fit([(x, y)])
    g, _, _, _ = dense(model, x)
    torch.testing.assert_close(
        la.posterior_precision,
        g[idx][:, idx] + torch.eye(len(idx), dtype=F64),
        rtol=1e-10,
        atol=1e-10,
    )
