"""The code blocks of the user guides under ``docs/`` run as written (on small synthetic
data where they name the user's data), and do what their text says."""

from __future__ import annotations

import re
from pathlib import Path

import torch

DOCS = Path(__file__).resolve().parents[2] / "docs"


def python_block(doc: str, after: str) -> str:
    """The first ```python block of ``docs/doc`` after the heading ``after``."""
    text = (DOCS / doc).read_text()
    start = text.index(after)
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


def test_plain_loop_fromp_method_learns_three_tasks():
    g = torch.Generator().manual_seed(0)
    tasks = []
    for _ in range(3):
        x = torch.randn(96, 784, generator=g)
        tasks.append((x, (x[:, 0] > 0).long()))
    env = {"tasks": tasks}
    torch.manual_seed(0)
    exec(python_block("avalanche.md", "## Without Avalanche"), env)
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


def _classifier_and_loaders():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 5, generator=g)
    y = (x[:, 0] - x[:, 1] > 0).long() + (x[:, 2] > 0.8).long()
    model = torch.nn.Sequential(torch.nn.Linear(5, 12), torch.nn.ReLU(), torch.nn.Linear(12, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[:150]), y[:150]).backward()
        opt.step()
    train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:150], y[:150]), 50)
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[150:], y[150:]), 50)
    return model.eval(), train, val, x[150:]


def test_laplace_torch_classification_example_runs_with_the_fromp_import():
    model, train, val, x = _classifier_and_loaders()
    env = {"model": model, "train_loader": train, "val_loader": val, "x": x}
    exec(python_block("laplace.md", "Classification, the prior"), env)
    pred = env["pred"]
    assert pred.shape == (50, 3)
    torch.testing.assert_close(pred.sum(1), torch.ones(50))
    la = env["la"]
    # gridsearch chose the grid point with the smallest validation NLL
    chosen = float(la.prior_precision)
    assert any(abs(chosen - float(g)) < 1e-6 * float(g) for g in torch.logspace(-4, 4, 100))


def test_laplace_torch_subnetwork_and_lowrank_example_runs():
    model, train, _, x = _classifier_and_loaders()
    env = {"model": model, "train_loader": train, "x": x}
    exec(python_block("laplace.md", "A subnetwork (laplace-torch's"), env)
    sub, low = env["sub"], env["low"]
    assert sub.posterior_precision.shape == (64, 64)
    flat = torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    assert torch.equal(sub.mean_subnet, flat[env["subnetwork_indices"]])
    assert torch.equal(sub.mean, flat)  # laplace-torch's: all weights
    assert low.rank == 20 and low.posterior_precision[0][0].shape == (len(flat), 20)
    torch.testing.assert_close(env["pred"].sum(1), torch.ones(50))


def test_laplace_torch_regression_example_raises_the_evidence():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 2, generator=g)
    y = x @ torch.tensor([[1.5], [-0.5]]) + 0.2 * torch.randn(60, 1, generator=g)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.Adam(model.parameters(), lr=5e-2)
    for _ in range(300):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), 20)
    env = {"model": model.eval(), "train_loader": loader, "n_epochs": 100}
    exec(python_block("laplace.md", "Regression, the prior"), env)
    la = env["la"]
    start = la.log_marginal_likelihood(torch.ones(1).exp(), torch.ones(1).exp())
    end = la.log_marginal_likelihood(env["log_prior"].exp(), env["log_sigma"].exp())
    assert float(end.detach()) > float(start.detach()) + 10  # the noise moved from e towards 0.2
    assert 0.1 < float(env["log_sigma"].detach().exp()) < 1.0


def test_memory_perturbation_guide_example():
    model, train, _, _ = _classifier_and_loaders()
    xs, ys = zip(*train)
    x_train, y_train = torch.cat(xs), torch.cat(ys)
    env = {"model": model, "train_loader": train, "x_train": x_train, "y_train": y_train}
    exec(python_block("memory-perturbation.md", "## In code"), env)
    summary = env["mp"].loo_summary()
    assert summary["loo_nll"] >= summary["train_nll"]
    assert env["mp"].sensitivity.shape == (150,)


def test_the_runners_fromp_in_a_plain_loop_runs_as_written():
    g = torch.Generator().manual_seed(0)
    tasks = []
    for _ in range(2):
        x = torch.randn(300, 784, generator=g)
        tasks.append((x, (x[:, 0] > 0).long()))
    env = {"tasks": tasks}
    torch.manual_seed(0)
    exec(python_block("continual.md", "## The runner's FROMP in a plain PyTorch loop"), env)
    method = env["method"]
    assert method.task_count == 2 and len(method.regularizer) == 2
    assert method.regularizer.num_points == 400 and float(method.last_penalty) > 0
