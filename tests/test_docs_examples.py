"""The code blocks of the user guides under ``docs/`` run as written (on small synthetic
data where they name the user's data), and do what their text says."""

from __future__ import annotations

import re
from pathlib import Path

import torch

DOCS = Path(__file__).resolve().parents[1] / "docs"


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
    assert method.tasks_done == 3 and len(method.regularizer) == 3
    # after task 3 the penalty is zero at the weights reached, positive once they move
    model = env["model"]
    assert float(method.penalty(model).detach()) < 1e-8
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    moved = method.penalty(model).detach()
    assert float(moved) > 1e-6
    # the saved state gives the same penalty in a fresh object
    fresh = env["FROMPMethod"](tau=10.0, n_points=40)
    fresh.load_state_dict(env["state"])
    torch.testing.assert_close(fresh.penalty(model).detach(), moved)
