"""The README's three examples run as written: Avalanche's ``SplitMNIST`` is replaced by a
small synthetic stream built the same way (5 experiences of 2 classes with task labels, 784
inputs), the user's trained model and data by a small trained MLP; each block's results are
then checked for what the README says they are."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from avalanche.benchmarks.scenarios.deprecated.generators import nc_benchmark
from avalanche.benchmarks.utils import _make_taskaware_tensor_classification_dataset
from torch import nn

README = Path(__file__).resolve().parents[1] / "README.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_is_a_front_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    for link in re.findall(r"\]\(((?:docs|examples|benchmarks)/[^)#]+)", text):
        assert (README.parent / link).exists(), link
    assert len(blocks()) == 3


def _split_mnist_like(
    n_experiences=5, return_task_id=True, class_ids_from_zero_in_each_exp=False, **_
):
    g = torch.Generator().manual_seed(0)

    def ds(n):
        y = torch.arange(n) % 10
        x = 0.3 * torch.randn(n, 784, generator=g)
        x[:, :10] += 4.0 * nn.functional.one_hot(y, 10).float()
        return _make_taskaware_tensor_classification_dataset(x, y, targets=y.tolist())

    return nc_benchmark(
        ds(1500), ds(300), n_experiences=n_experiences, task_labels=return_task_id,
        shuffle=False, fixed_class_order=list(range(10)),
        class_ids_from_zero_in_each_exp=class_ids_from_zero_in_each_exp,
    )  # fmt: skip


def test_avalanche_example(monkeypatch, capsys):
    import avalanche.benchmarks.classic as classic

    monkeypatch.setattr(classic, "SplitMNIST", _split_mnist_like)
    env = {"torch": torch}
    exec(blocks()[0], env)
    out = capsys.readouterr().out
    assert out.count("Top1_Acc_Stream") >= 5  # one evaluation per experience
    final = env["strategy"].eval(env["benchmark"].test_stream)
    accs = [v for k, v in final.items() if k.startswith("Top1_Acc_Exp")]
    assert len(accs) == 5 and min(accs) > 0.75, final  # every task learnt and kept (chance: 0.5)
    (fromp,) = [p for p in env["strategy"].plugins if hasattr(p, "method")]
    assert fromp.method.task_count == 5 and len(fromp.method.regularizer) == 5


def _trained_mlp():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(240, 6, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(200):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.eval(), x, y


def test_gaussian_process_example():
    model, x, y = _trained_mlp()
    loader = [(x[i : i + 60], y[i : i + 60]) for i in range(0, 240, 60)]
    env = {"model": model, "train_loader": loader, "x_test": x[:120]}
    exec(blocks()[1], env)
    probs, k = env["probs"], env["K"]
    assert probs.shape == (120, 3)
    torch.testing.assert_close(probs.sum(1), torch.ones(120))
    assert k.shape == (100, 3, 100, 3)
    torch.testing.assert_close(k, k.permute(2, 3, 0, 1))  # a kernel is symmetric


def test_memorable_and_memory_perturbation_example():
    model, x, y = _trained_mlp()
    env = {"model": model, "x": x, "y": y}
    exec("import fromp\n" + blocks()[2].replace("import fromp\n", ""), env)
    idx, mp = env["idx"], env["mp"]
    assert len(idx) == 30 and len(set(idx.tolist())) == 30  # 10 per class, distinct
    assert torch.bincount(y[idx], minlength=3).tolist() == [10, 10, 10]
    assert mp.sensitivity.shape == (240,) and bool((mp.sensitivity >= 0).all())
    summary = mp.loo_summary()
    assert summary["loo_nll"] >= summary["train_nll"]  # leaving an example out costs


@pytest.mark.parametrize("doc", sorted((README.parent / "docs").glob("*.md")))
def test_docs_links_resolve(doc):
    text = doc.read_text()
    for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (doc.parent / link).exists(), f"{doc.name}: {link}"
