"""GGN (full, diagonal, matrix-vector products) and Fisher diagonals against dense float64
J^T Lambda J built from autograd Jacobians and autograd Hessians of the nll."""

from __future__ import annotations

import pytest
import torch

from fromp import ggn, ggn_vp
from fromp.curvature.diagonal import diag_ef, diag_fisher, diag_ggn
from fromp.likelihood import (
    BernoulliLikelihood,
    CategoricalLikelihood,
    GaussianLikelihood,
)
from fromp.models import MultiHeadMLP, with_task
from fromp.testing import dense_ggn, dense_jacobian
from tests.cases import tiny_cnn, tiny_mlp

CASES = {
    "mlp-categorical": (lambda: tiny_mlp(c=3), (4,), CategoricalLikelihood()),
    "mlp-bernoulli": (lambda: tiny_mlp(c=1), (4,), BernoulliLikelihood()),
    "mlp-gaussian": (lambda: tiny_mlp(c=2), (4,), GaussianLikelihood(0.3)),
    "cnn_bn-categorical": (lambda: tiny_cnn(c=3), (1, 6, 6), CategoricalLikelihood()),
    "multihead-categorical": (
        lambda: with_task(MultiHeadMLP(4, (5,), n_heads=2, head_size=3).double(), 1),
        (4,),
        CategoricalLikelihood(),
    ),
}


@pytest.fixture(params=sorted(CASES))
def case(request):
    make, shape, lik = CASES[request.param]
    model = make()
    x = torch.randn(7, *shape, dtype=torch.float64)
    return model, x, lik, dense_ggn(model, x, lik)


def test_full_ggn_matches_dense(case):
    model, x, lik, ref = case
    for data in (x, (x,), [(x[:3],), (x[3:],)]):
        got = ggn(model, data, lik, chunk_size=3)
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-12)
    assert torch.linalg.eigvalsh(ref).min() > -1e-10  # PSD


def test_diag_ggn_matches_dense(case):
    model, x, lik, ref = case
    got = diag_ggn(model, [x[:4], x[4:]], lik, chunk_size=2)
    torch.testing.assert_close(got, torch.diagonal(ref), rtol=1e-9, atol=1e-12)


def test_data_forms_tuple_is_one_batch_list_is_batches():
    """A list of two equal-length input batches is two batches, never (x, y); a tuple is
    one batch; a DataLoader is batches."""
    model, shape, lik = CASES["mlp-categorical"]
    model = model()
    x = torch.randn(6, *shape, dtype=torch.float64)
    ref = torch.diagonal(dense_ggn(model, x, lik))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)
    for data in ([x[:3], x[3:]], (x,), loader):
        torch.testing.assert_close(diag_ggn(model, data, lik), ref, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="same number of examples"):
        diag_ggn(model, (x, torch.zeros(5, dtype=torch.long)), lik)


def test_ggn_vp_matches_dense(case):
    model, x, lik, ref = case
    v = torch.randn(ref.shape[0], dtype=torch.float64)
    torch.testing.assert_close(ggn_vp(model, x, lik, v), ref @ v, rtol=1e-9, atol=1e-12)
    # batches are summed
    split = ggn_vp(model, [(x[:2],), (x[2:],)], lik, v)
    torch.testing.assert_close(split, ref @ v, rtol=1e-9, atol=1e-12)


def test_diag_ef_matches_dense_per_example_gradients():
    model, lik = tiny_mlp(c=3), CategoricalLikelihood()
    x = torch.randn(6, 4, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 2, 1, 0])
    jac = dense_jacobian(model, x)
    with torch.no_grad():
        p = torch.softmax(model(x), -1)
    resid = p - torch.nn.functional.one_hot(y, 3).double()  # d nll / d f
    g = torch.einsum("ncp,nc->np", jac, resid)
    torch.testing.assert_close(diag_ef(model, (x, y), lik), g.pow(2).sum(0))


def test_diag_fisher_is_unbiased_for_diag_ggn():
    model, lik = tiny_mlp(c=1), BernoulliLikelihood()
    x = torch.randn(5, 4, dtype=torch.float64)
    ref = diag_ggn(model, x, lik)
    est = diag_fisher(model, x, lik, n_samples=400, generator=torch.Generator().manual_seed(0))
    rel = (est - ref).abs().sum() / ref.abs().sum()
    assert rel < 0.15


def test_errors_named():
    model = tiny_mlp()
    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="max_params"):
        ggn(model, x, "categorical", max_params=10)
    with pytest.raises(ValueError, match="non-finite"):
        ggn(model, torch.full((3, 4), float("nan"), dtype=torch.float64), "categorical")
    with pytest.raises(ValueError, match=r"v must have shape \[P\]=\[43\]"):
        ggn_vp(model, x, "categorical", torch.zeros(3))
    with pytest.raises(ValueError, match="non-finite"):
        ggn_vp(model, x, "categorical", torch.full((43,), float("nan"), dtype=torch.float64))
    with pytest.raises(ValueError, match="likelihood must be"):
        ggn(model, x, "nope")
