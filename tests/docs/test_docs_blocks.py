"""Every ```python block of ``docs/*.md`` runs as written, in an empty namespace (its own
imports and its own small stand-in data), in a temporary working directory, with Avalanche's
``SplitMNIST`` replaced by a small synthetic stream built the same way (no download).

A block may be preceded (on the line before its fence) by one HTML comment that the reader
does not see:

- ``<!-- continues the block above -->``: it runs after the page's previous block, in that
  block's namespace (a checkpoint loop around the strategy built just before);
- ``<!-- needs CUDA -->``: it runs where CUDA is available and is skipped, with that reason,
  elsewhere;
- ``<!-- not run: REASON -->``: illustrative only (a side-by-side comparison, a cluster);
  ``ILLUSTRATIVE`` lists the few there are, so a new one is a deliberate choice.

A block that starts ``torch.distributed`` runs as under ``torchrun`` with one process. The
blocks whose results the text describes run in the tests that check them
(``CHECKED_ELSEWHERE``: ``test_docs_examples.py`` and ``tests/continual/test_vcl.py``, through
:func:`run_block`); this module runs all the others.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
from pathlib import Path

import pytest
import torch

DOCS = Path(__file__).resolve().parents[2] / "docs"
_BLOCK = re.compile(r"(?:<!-- (.*?) -->\n)?```python\n(.*?)```", re.S)
#: (page, reason) of the blocks that are illustrative only
ILLUSTRATIVE = {
    ("distributed.md", "a Ray cluster of 4 GPU workers training split MNIST"),
}
#: blocks run, and their results checked, by a test of their own (page, text before the block)
CHECKED_ELSEWHERE = {
    ("avalanche.md", "## Without Avalanche"): "test_docs_examples.py",
    ("avalanche.md", "VCL in a plain loop"): "tests/continual/test_vcl.py",
    ("continual.md", "## The runner's FROMP in a plain PyTorch loop"): "test_docs_examples.py",
    ("laplace.md", "Classification, the prior"): "test_docs_examples.py",
    ("laplace.md", "Regression, the prior"): "test_docs_examples.py",
    ("laplace.md", "A subnetwork (laplace-torch's"): "test_docs_examples.py",
    ("memory-perturbation.md", "## In code"): "test_docs_examples.py",
}


def page_blocks(doc: str) -> list[tuple[int, str, str]]:
    """``(line of the fence, marker or '', code)`` of every ```python block of ``docs/doc``."""
    text = (DOCS / doc).read_text()
    out = []
    for m in _BLOCK.finditer(text):
        line = text.count("\n", 0, m.start(2))  # the fence's line (1-based)
        out.append((line, m.group(1) or "", m.group(2)))
    return out


def block_index(doc: str, after: str) -> int:
    """The index of the first ```python block of ``docs/doc`` after the text ``after``."""
    text = (DOCS / doc).read_text()
    line = text.count("\n", 0, text.index(after))
    return next(i for i, (at, _, _) in enumerate(page_blocks(doc)) if at > line)


def _checked_elsewhere() -> set[tuple[str, int]]:
    return {(doc, block_index(doc, after)) for doc, after in CHECKED_ELSEWHERE}


def _all_blocks() -> list:
    params, elsewhere = [], _checked_elsewhere()
    for path in sorted(DOCS.glob("*.md")):
        for i, (line, _, _) in enumerate(page_blocks(path.name)):
            if (path.name, i) not in elsewhere:
                params.append(pytest.param(path.name, i, id=f"{path.name}:{line}"))
    return params


def run_block(doc: str, index: int) -> dict:
    """Run block ``index`` of ``doc`` in a new namespace, after the blocks it continues."""
    blocks = page_blocks(doc)
    chain = [index]
    while blocks[chain[0]][1] == "continues the block above":
        chain.insert(0, chain[0] - 1)
    env: dict = {}
    torch.manual_seed(0)
    for i in chain:
        line, _, code = blocks[i]
        exec(compile(code, f"docs/{doc}:{line}", "exec"), env)
    return env


def test_every_python_block_is_found_and_marked_as_known():
    """The block pattern sees every fence, and the illustrative blocks are the listed ones."""
    for path in DOCS.glob("*.md"):
        blocks = page_blocks(path.name)
        assert len(blocks) == path.read_text().count("```python\n"), path.name
        for line, marker, _ in blocks:
            known = marker in ("", "continues the block above", "needs CUDA")
            illustrative = marker.startswith("not run: ")
            assert known or illustrative, f"{path.name}:{line}: unknown marker {marker!r}"
            assert illustrative == ((path.name, marker[9:]) in ILLUSTRATIVE), (path.name, line)


@pytest.mark.parametrize(("doc", "index"), _all_blocks())
def test_docs_python_block_runs_as_written(doc, index, tmp_path, monkeypatch):
    line, marker, code = page_blocks(doc)[index]
    # every block, run or not: valid Python whose imports of fromp's packages resolve
    _check_project_imports(compile(code, f"docs/{doc}:{line}", "exec", ast.PyCF_ONLY_AST))
    if marker.startswith("not run: "):
        return  # illustrative only (ILLUSTRATIVE): checked as far as it can be without running
    if marker == "needs CUDA" and not torch.cuda.is_available():
        pytest.skip(f"docs/{doc}:{line} needs CUDA (torch.cuda.is_available() is False)")
    import avalanche.benchmarks.classic as classic

    from tests.docs.test_readme import _split_mnist_like

    # 200 training examples per experience (FROMP's default 200 memorable points: 100 per
    # class) and 20 test examples
    monkeypatch.setattr(classic, "SplitMNIST", functools.partial(_split_mnist_like, n=(1000, 100)))
    monkeypatch.chdir(tmp_path)
    # as under torchrun with one process (a block that starts torch.distributed)
    torchrun = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    for name, value in {**torchrun, "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(name, value)
    try:
        run_block(doc, index)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _check_project_imports(tree: ast.Module) -> None:
    """Every ``from fromp... import NAME`` (and ``fromp_avalanche``, ``fromp_bench``) of a
    block names a module that imports and a name it has."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _OURS:
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert alias.name == "*" or hasattr(module, alias.name), (
                    f"{node.module} has no {alias.name}"
                )
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in _OURS:
                    importlib.import_module(alias.name)


_OURS = ("fromp", "fromp_avalanche", "fromp_bench")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
