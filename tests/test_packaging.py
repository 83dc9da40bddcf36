"""What installing fromp brings: the package `fromp` imports only torch, numpy and scipy (its
core dependencies in pyproject.toml); Avalanche, torchvision, plotting, progress bars and Ray
are extras for the strategies and the runner."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]
EXTRAS_ONLY = ("avalanche", "torchvision", "matplotlib", "tqdm", "sklearn", "ray", "laplace")


def test_fromp_imports_without_the_extras():
    """Every module of `fromp` imports with the extras' packages made unimportable."""
    code = f"""
import importlib, pkgutil, sys
for name in {EXTRAS_ONLY!r}:
    sys.modules[name] = None  # `import name` now raises ImportError
import fromp
for info in pkgutil.walk_packages(fromp.__path__, "fromp."):
    importlib.import_module(info.name)
print("ok")
"""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")


def test_core_dependencies_are_what_fromp_needs():
    """The core dependencies name no package that only the strategies or the runner use."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {d.split(">")[0].split("<")[0].split("=")[0].strip() for d in project["dependencies"]}
    assert core == {"torch", "numpy", "scipy"}
    extras = project["optional-dependencies"]
    assert any(d.startswith("avalanche-lib") for d in extras["avalanche"])
    assert "fromp[bench,ray]" in extras["dev"]


#: repository folder -> installed import name (pyproject.toml's package-dir)
FOLDERS = {"fromp": "fromp", "strategies": "fromp_avalanche", "benchmarks": "fromp_bench"}


def test_installed_package_list_is_every_folder_under_its_import_name():
    """pyproject.toml lists each package explicitly (the folders strategies/ and benchmarks/
    install as ``fromp_avalanche`` and ``fromp_bench``): a new subpackage missing from the
    list would be left out of the wheel."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert tool["package-dir"] == {
        "": ".",
        "fromp_avalanche": "strategies",
        "fromp_bench": "benchmarks",
    }
    want = set()
    for folder, name in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            want.add(".".join((name, *rel)))
    assert set(tool["packages"]) == want
    assert not {"strategies", "benchmarks"} & {p.split(".")[0] for p in tool["packages"]}


def test_a_users_own_strategies_and_benchmarks_modules_do_not_shadow_ours(tmp_path):
    """A user's ``strategies.py`` and ``benchmarks.py`` beside their script (first on
    ``sys.path``) leave fromp's Avalanche layer and runner importable: the installed names
    are ``fromp_avalanche`` and ``fromp_bench``, and no module of ours imports the folder
    names."""
    for name in ("strategies", "benchmarks"):
        (tmp_path / f"{name}.py").write_text("raise ImportError('the user module was imported')\n")
    code = (
        "import fromp_avalanche, fromp_avalanche.fromp, fromp_bench.runner, fromp_bench.command;"
        "import sys; assert 'strategies' not in sys.modules and 'benchmarks' not in sys.modules;"
        "print('ok')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"


def test_the_studies_are_not_installed_and_no_test_imports_one():
    """The product is the library, the strategies, the runner and its tools: the one-off
    studies live in the top-level ``studies/`` folder, outside every installed package, and
    the project's tests (``make test``) import none of them (their own tests are in
    ``studies/tests``, not collected)."""
    import ast

    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    assert not any("studies" in p for p in tool["setuptools"]["packages"])
    assert not (ROOT / "benchmarks" / "studies").exists()
    assert "studies" not in tool["pytest"]["ini_options"]["testpaths"]
    importing = []
    for f in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            importing += [f"{f.name}: {n}" for n in names if n.split(".")[0] == "studies"
                          or n.startswith("fromp_bench.studies")]  # fmt: skip
    assert not importing, importing


def test_the_version_is_one_number_in_pyproject_the_package_and_the_changelog():
    """``pyproject.toml``'s version, ``fromp.__version__`` and the version of the CHANGELOG's
    first ``## `` heading (``## 0.4.0 (2026-11-28)``) are the same release."""
    import re

    import fromp

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    headings = [
        line[3:] for line in (ROOT / "CHANGELOG.md").read_text().splitlines() if line[:3] == "## "
    ]
    assert headings, "CHANGELOG.md has no '## ' heading"
    top = re.match(r"(\d+\.\d+\.\d+)\b", headings[0])
    assert top, f"CHANGELOG.md's first heading {headings[0]!r} names no version"
    assert project["version"] == fromp.__version__ == top.group(1), (
        project["version"],
        fromp.__version__,
        headings[0],
    )
