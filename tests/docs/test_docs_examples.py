"""The code blocks of the user guides under ``docs/`` whose text says what they give run as
written (in an empty namespace, on the small stand-in data they build) and give it
(``test_docs_blocks.CHECKED_ELSEWHERE`` lists them; ``test_docs_blocks.py`` runs the others)."""

from __future__ import annotations

import torch

from tests.docs.test_docs_blocks import block_index, run_block


def run_doc_block(doc: str, after: str) -> dict:
    """The namespace of the first ```python block of ``docs/doc`` after the text ``after``."""
    return run_block(doc, block_index(doc, after))


def test_plain_loop_fromp_method_learns_three_tasks():
    env = run_doc_block("avalanche.md", "## Without Avalanche")
    method = env["method"]
    assert method.task_count == 3 and len(method.regularizer) == 3
    # after task 3 the penalty is zero at the weights reached, positive once they move
    model = env["model"]
    assert float(method.penalty(model).detach()) < 1e-8
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    moved = method.penalty(model).detach()
    assert float(moved) > 1e-6
    # the saved state gives the same penalty in a fresh object
    fresh = env["FROMPMethod"](tau=10.0, n_points=40, grad_clip_norm=0.1)
    fresh.load_state_dict(env["state"])
    torch.testing.assert_close(fresh.penalty(model).detach(), moved)


def test_laplace_torch_classification_example_runs_with_the_fromp_import():
    env = run_doc_block("laplace.md", "Classification, the prior")
    pred = env["pred"]
    assert pred.shape == (50, 3)
    torch.testing.assert_close(pred.sum(1), torch.ones(50))
    la = env["la"]
    # gridsearch chose the grid point with the smallest validation NLL
    chosen = float(la.prior_precision)
    assert any(abs(chosen - float(g)) < 1e-6 * float(g) for g in torch.logspace(-4, 4, 100))


def test_laplace_torch_subnetwork_and_lowrank_example_runs():
    env = run_doc_block("laplace.md", "A subnetwork (laplace-torch's")
    sub, low, model = env["sub"], env["low"], env["model"]
    assert sub.posterior_precision.shape == (64, 64)
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    assert torch.equal(sub.mean_subnet, flat[env["subnetwork_indices"]])
    assert torch.equal(sub.mean, flat)  # laplace-torch's: all weights
    assert low.rank == 20 and low.posterior_precision[0][0].shape == (len(flat), 20)
    torch.testing.assert_close(env["pred"].sum(1), torch.ones(50))


def test_laplace_torch_regression_example_raises_the_evidence():
    env = run_doc_block("laplace.md", "Regression, the prior")
    la = env["la"]
    start = la.log_marginal_likelihood(torch.ones(1).exp(), torch.ones(1).exp())
    end = la.log_marginal_likelihood(env["log_prior"].exp(), env["log_sigma"].exp())
    assert float(end.detach()) > float(start.detach()) + 10  # the noise moved from e towards 0.2
    assert 0.1 < float(env["log_sigma"].detach().exp()) < 1.0


def test_memory_perturbation_guide_example():
    env = run_doc_block("memory-perturbation.md", "## In code")
    summary = env["mp"].loo_summary()
    assert summary["loo_nll"] >= summary["train_nll"]
    assert env["mp"].sensitivity.shape == (150,)


def test_the_runners_fromp_in_a_plain_loop_runs_as_written():
    env = run_doc_block("continual.md", "## The runner's FROMP in a plain PyTorch loop")
    method = env["method"]
    assert method.task_count == 2 and len(method.regularizer) == 2
    assert method.regularizer.num_points == 400 and float(method.last_penalty) > 0
