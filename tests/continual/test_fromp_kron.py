"""FROMP with a Kronecker (KFAC) posterior kernel (``FROMPMethod(posterior="kron")``):
kernels against dense float64 brute force, the per-task KFAC bookkeeping after tasks 2 and
3 (head routing, per-layer example counts, re-learning, subsamples), resume, refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fromp import FROMPMethod, Laplace
from fromp.curvature.jacobian import flat_params
from fromp.curvature.kron import kron_curvature
from fromp.likelihood import CategoricalLikelihood
from fromp.models import MultiHeadMLP, TaskView, with_task
from fromp.testing import dense_ggn, dense_jacobian

F64 = torch.float64


def _kernel_of(method: FROMPMethod, i: int) -> torch.Tensor:
    """The stored kernel ``L L^T - jitter I`` of memorable set ``i``."""
    mem = method.regularizer.memories[i]
    eye = torch.eye(mem.chol.shape[-1], dtype=mem.chol.dtype)
    return mem.chol @ mem.chol.transpose(-1, -2) - mem.jitter * eye


def _block_mask(net: nn.Module) -> torch.Tensor:
    """``[P, P]`` True within each parameter tensor's block (KFAC keeps no cross-tensor
    terms: neither between layers nor between a layer's weight and bias)."""
    ids = torch.cat([torch.full((p.numel(),), i) for i, p in enumerate(net.parameters())])
    return ids[:, None] == ids[None, :]


def _prob_kernel_per_class(net: nn.Module, x: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """Dense ``[C, M, M]``: ``K_c = (dp_c/dw) Sigma (dp_c/dw)^T`` by autograd."""
    jf = dense_jacobian(net, x)  # [M, C, P]
    with torch.no_grad():
        p = torch.softmax(net(x), -1)
    a = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]  # softmax Jacobian [M, C, C]
    jp = torch.einsum("mca,map->mcp", a, jf)
    return torch.einsum("mcp,pq,ncq->cmn", jp, cov, jp)


def test_single_example_kfac_kernel_equals_dense_block_diagonal_ggn():
    """With one training example KFAC is exact within each parameter tensor, so the stored
    per-class kernel is ``A J Sigma J^T A^T`` with ``Sigma = (blockdiag(GGN) + delta)^-1``
    (dense float64 autograd; a dropped softmax Jacobian, a wrong class or a wrong block
    fails this)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).to(F64).eval()
    x, y = torch.randn(1, 3, dtype=F64), torch.tensor([2])
    delta = 0.7
    method = FROMPMethod(tau=1.0, n_points=1, posterior="kron", prior_precision=delta)
    method.learn_task(net, x, y, None)
    g = dense_ggn(net, x, CategoricalLikelihood())
    cov = torch.linalg.inv(g * _block_mask(net) + delta * torch.eye(len(g), dtype=F64))
    # on the one class trained (label 2): the units of classes not trained are left out
    want = _prob_kernel_per_class(net, x, cov)[[2]]
    assert method.regularizer.memories[0].units.tolist() == [2]
    torch.testing.assert_close(_kernel_of(method, 0), want, rtol=1e-8, atol=1e-12)
    # the joint kernel from the same posterior: class-major [1, C M, C M]
    joint = FROMPMethod(tau=1.0, n_points=1, posterior="kron", prior_precision=delta,
                        kernel="joint")  # fmt: skip
    joint.learn_task(net, x, y, None)
    k = _kernel_of(joint, 0)[0]
    torch.testing.assert_close(torch.diagonal(k), torch.diagonal(want, dim1=1, dim2=2).reshape(-1))


def _three_tasks(seed: int = 0):
    torch.manual_seed(seed)
    net = MultiHeadMLP(5, (6,), n_heads=3, head_size=2).to(F64).eval()
    data = [(torch.randn(n, 5, dtype=F64), torch.randint(0, 2, (n,))) for n in (7, 4, 9)]
    return net, data


def _perturb(net: nn.Module) -> None:
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.2 * torch.randn_like(p))


def test_kernels_after_tasks_two_and_three_equal_a_sequential_kron_laplace():
    """After each of three tasks (weights moved in between, as training does), every stored
    kernel equals the one from ``fromp.Laplace(hessian_structure="kron")`` fitted task by
    task through each task's head with ``fit(override=False)``, evaluated at the current
    weights through the memorable set's own head."""
    net, data = _three_tasks()
    delta = 2.0
    method = FROMPMethod(tau=1.0, n_points=2, posterior="kron", prior_precision=delta)
    view = TaskView(net, 0)
    la = Laplace(view, "classification", subset_of_weights="all", hessian_structure="kron",
                 prior_precision=delta)  # fmt: skip
    for t, (x, y) in enumerate(data):
        view.task = t
        la.fit((x, y), override=t == 0)
        method.learn_task(net, x, y, t)
        ref = Laplace(view, "classification", subset_of_weights="all", hessian_structure="kron",
                      prior_precision=delta)  # fmt: skip
        ref.use_curvature(la.H, la.n_data)
        for i, mem in enumerate(method.regularizer.memories):
            view.task = mem.task
            kf = ref.gp().kernel(mem.inputs)
            with torch.no_grad():
                p = torch.softmax(with_task(net, mem.task)(mem.inputs), -1)
            a = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
            kp = torch.einsum("mca,manb,ndb->mcnd", a, kf, a)
            want = torch.diagonal(kp, dim1=1, dim2=3).permute(2, 0, 1)
            torch.testing.assert_close(_kernel_of(method, i), want, rtol=1e-8, atol=1e-12)
        assert len(method.regularizer.memories) == t + 1
        _perturb(net)


def test_a_head_keeps_its_own_factors_after_later_tasks():
    """Per-layer example counts: a head only task 1 calls keeps task 1's input average after
    tasks 2 and 3 are added (averaging over all examples would shrink it by 4/20); the
    shared body averages over all 20 examples."""
    net, data = _three_tasks()
    lik = CategoricalLikelihood()
    terms = [kron_curvature(TaskView(net, t), [(x, None)], lik) for t, (x, _) in enumerate(data)]
    total = terms[0] + terms[1] + terms[2]
    names = [n[0] for n in total.names]
    head1 = names.index("model.heads.1.weight")
    torch.testing.assert_close(total.blocks[head1].A, terms[1].blocks[head1].A)
    torch.testing.assert_close(total.blocks[head1].B, terms[1].blocks[head1].B)
    assert total.blocks[head1].n == 4
    body = names.index("model.body.1.weight") if "model.body.1.weight" in names else 0
    want = sum(t.blocks[body].A * len(x) for t, (x, _) in zip(terms, data)) / 20
    torch.testing.assert_close(total.blocks[body].A, want)


def test_relearning_an_experience_replaces_its_term_and_subsamples_are_rescaled():
    net, data = _three_tasks()
    once = FROMPMethod(n_points=2, posterior="kron")
    twice = FROMPMethod(n_points=2, posterior="kron")
    for t, (x, y) in enumerate(data[:2]):
        once.learn_task(net, x, y, t, experience=t)
        twice.learn_task(net, x, y, t, experience=t)
    twice.learn_task(net, *data[1], 1, experience=1)
    assert sorted(twice.kron_terms) == [0, 1]
    for a, b in zip(once.regularizer.memories, twice.regularizer.memories):
        torch.testing.assert_close(a.chol, b.chol)
    # a subsample of k of N examples: the B sums are scaled by N / k
    sub = FROMPMethod(n_points=2, posterior="kron", curvature_examples=3, seed=1)
    x, y = data[2]
    sub.learn_task(net, x, y, 2, experience=0)
    idx = torch.randperm(len(x), generator=torch.Generator().manual_seed(1))[:3]
    ref = kron_curvature(TaskView(net, 2), [(x[idx], None)], CategoricalLikelihood())
    for b, r in zip(sub.kron_terms[0].blocks, ref.blocks):
        torch.testing.assert_close(b.B, r.B * len(x) / 3)
        torch.testing.assert_close(b.A, r.A)


def test_resume_after_task_two_gives_the_same_task_three():
    net, data = _three_tasks()
    a = FROMPMethod(n_points=2, posterior="kron")
    for t, (x, y) in enumerate(data[:2]):
        a.learn_task(net, x, y, t)
    state = a.state_dict()
    b = FROMPMethod(n_points=2, posterior="kron")
    b.load_state_dict(state)
    assert sorted(b.kron_terms) == [0, 1]
    _perturb(net)
    a.learn_task(net, *data[2], 2)
    b.learn_task(net, *data[2], 2)
    for ma, mb in zip(a.regularizer.memories, b.regularizer.memories):
        torch.testing.assert_close(ma.chol, mb.chol, rtol=0, atol=0)
    torch.testing.assert_close(a.penalty(net), b.penalty(net), rtol=0, atol=0)
    var = a.posterior_variance(net)
    assert var.shape == flat_params(net).shape and bool((var > 0).all())


def test_kron_refuses_layers_it_cannot_factor_and_grown_layers():
    from tests.cases import Scale

    torch.manual_seed(0)
    odd = nn.Sequential(nn.Linear(3, 4), Scale(4), nn.Linear(4, 2)).to(F64).eval()
    x, y = torch.randn(6, 3, dtype=F64), torch.randint(0, 2, (6,))
    with pytest.raises(ValueError, match="Scale has trainable parameters"):
        FROMPMethod(n_points=2, posterior="kron").learn_task(odd, x, y, None)
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).to(F64).eval()
    method = FROMPMethod(n_points=2, posterior="kron")
    method.learn_task(net, x, y, None)
    old = net[2]
    net[2] = nn.Linear(4, 3).to(F64)  # a grown head
    with torch.no_grad():
        net[2].weight[:2] = old.weight
    with pytest.raises(ValueError, match="layers changed since experience 0"):
        method.learn_task(net, x, torch.randint(0, 3, (6,)), None)


def test_scaled_twice_equals_the_curvature_added_to_itself():
    """``c.scaled(2) == c + c`` (a second route: ``__add__``), on a model with a batch-norm
    layer so that the non-KFAC diagonals are scaled too; ``scaled(0.5)`` halves ``B``."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2))
    net = net.to(F64).eval()
    x = torch.randn(6, 3, dtype=F64)
    c = kron_curvature(net, [(x, None)], CategoricalLikelihood(), diag_layers=[net[1]])
    assert c.diag, "the batch-norm parameters should have diagonal terms"
    two, added = c.scaled(2.0), c + c
    assert two.n == added.n == 2 * c.n
    for a, b in zip(two.blocks, added.blocks):
        torch.testing.assert_close(a.A, b.A)
        torch.testing.assert_close(a.B, b.B)
        torch.testing.assert_close(a.B_bias, b.B_bias)
        assert a.n == b.n
    for k in c.diag:
        torch.testing.assert_close(two.diag[k], added.diag[k])
    torch.testing.assert_close(c.scaled(0.5).blocks[0].B, c.blocks[0].B / 2)
