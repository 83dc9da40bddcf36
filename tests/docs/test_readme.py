"""The README is a front page, and its three examples run as written, each in an empty
namespace (its own imports); each block's results are then checked for what the README says
they are."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from avalanche.benchmarks.scenarios.deprecated.generators import nc_benchmark
from avalanche.benchmarks.utils import _make_taskaware_tensor_classification_dataset
from torch import nn

README = Path(__file__).resolve().parents[2] / "README.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_is_a_front_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    assert max(len(line) for line in text.splitlines()) <= 200
    for link in re.findall(r"\]\(((?:docs|examples|benchmarks)/[^)#]+)", text):
        assert (README.parent / link).exists(), link
    assert len(blocks()) == 3


def test_plain_loop_example(capsys):
    """The plain-PyTorch FROMP loop, run as written (its own imports, nothing given): five
    tasks learnt and kept, with the memorable points and one penalty term per task."""
    env: dict = {}
    exec(blocks()[0], env)
    out = capsys.readouterr().out
    acc = [float(a) for a in re.findall(r"task \d: ([\d.]+) % correct", out)]
    assert len(acc) == 5 and min(acc) > 90, out  # chance: 50; Naive forgets the first tasks
    assert env["method"].task_count == 5 and len(env["method"].regularizer) == 5


def _split_mnist_like(
    n_experiences=5, return_task_id=True, class_ids_from_zero_in_each_exp=False, *, n=(1500, 300)
):
    """A synthetic stand-in for ``SplitMNIST`` with ``n`` = (train, test) examples."""
    g = torch.Generator().manual_seed(0)

    def ds(n):
        y = torch.arange(n) % 10
        x = 0.3 * torch.randn(n, 784, generator=g)
        x[:, :10] += 4.0 * nn.functional.one_hot(y, 10).float()
        return _make_taskaware_tensor_classification_dataset(x, y, targets=y.tolist())

    return nc_benchmark(
        ds(n[0]), ds(n[1]), n_experiences=n_experiences, task_labels=return_task_id,
        shuffle=False, fixed_class_order=list(range(10)),
        class_ids_from_zero_in_each_exp=class_ids_from_zero_in_each_exp,
    )  # fmt: skip


def test_avalanche_example(monkeypatch, capsys):
    """Run as written; Avalanche's ``SplitMNIST`` is replaced by a small synthetic stream built
    the same way (5 experiences of 2 classes with task labels, 784 inputs)."""
    import avalanche.benchmarks.classic as classic

    monkeypatch.setattr(classic, "SplitMNIST", _split_mnist_like)
    env: dict = {}
    exec(blocks()[1], env)
    out = capsys.readouterr().out
    assert out.count("Top1_Acc_Stream") >= 5  # one evaluation per experience
    final = env["strategy"].eval(env["benchmark"].test_stream)
    accs = [v for k, v in final.items() if k.startswith("Top1_Acc_Exp")]
    assert len(accs) == 5 and min(accs) > 0.75, final  # every task learnt and kept (chance: 0.5)
    (fromp,) = [p for p in env["strategy"].plugins if hasattr(p, "method")]
    assert fromp.method.task_count == 5 and len(fromp.method.regularizer) == 5


def test_gaussian_process_and_memorable_example(capsys):
    """Run as written: shapes, a probability simplex, a symmetric kernel, 10 memorable points
    per class, one sensitivity per example."""
    env: dict = {}
    exec(blocks()[2], env)
    probs, k, y = env["probs"], env["K"], env["y"]
    assert probs.shape == (100, 3)
    torch.testing.assert_close(probs.sum(1), torch.ones(100))
    assert k.shape == (100, 3, 100, 3)
    torch.testing.assert_close(k, k.permute(2, 3, 0, 1))  # a kernel is symmetric
    idx, mp = env["idx"], env["mp"]
    assert len(set(idx.tolist())) == 30
    assert torch.bincount(y[idx], minlength=3).tolist() == [10, 10, 10]
    assert mp.sensitivity.shape == (512,) and bool((mp.sensitivity >= 0).all())
    assert "torch.Size([512])" in capsys.readouterr().out


@pytest.mark.parametrize("doc", sorted((README.parent / "docs").glob("*.md")))
def test_docs_links_resolve(doc):
    text = doc.read_text()
    for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (doc.parent / link).exists(), f"{doc.name}: {link}"
