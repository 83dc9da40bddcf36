"""What installing fromp brings: the package `fromp` imports only torch, numpy and scipy (its
core dependencies in pyproject.toml); Avalanche, torchvision, plotting, progress bars and Ray
are extras for the strategies and the runner."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[2]
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


@pytest.mark.slow
def test_a_users_own_strategies_and_benchmarks_modules_do_not_shadow_ours(tmp_path):
    """A user's ``strategies.py`` and ``benchmarks.py`` beside their script (first on
    ``sys.path``) leave fromp's Avalanche layer and runner importable: the installed names
    are ``fromp_avalanche`` and ``fromp_bench``, and no module of ours imports the folder
    names. Checked in a fork of this process that forgets our two packages and imports them
    again with the user's folder first on ``sys.path`` (torch and Avalanche stay imported, so
    no second interpreter imports them)."""
    import importlib

    from tests.cases import exit_code, forked

    for name in ("strategies", "benchmarks"):
        (tmp_path / f"{name}.py").write_text("raise ImportError('the user module was imported')\n")
    importlib.import_module("fromp_bench.command")  # Avalanche, once, in this process

    def user_script() -> int:
        ours = {"fromp_avalanche", "fromp_bench", "strategies", "benchmarks"}
        for name in [n for n in sys.modules if n.split(".")[0] in ours]:
            del sys.modules[name]
        sys.path.insert(0, str(tmp_path))
        importlib.invalidate_caches()
        for name in ("fromp_avalanche", "fromp_avalanche.fromp", "fromp_bench.runner",
                     "fromp_bench.command"):  # fmt: skip
            importlib.import_module(name)
        assert "strategies" not in sys.modules and "benchmarks" not in sys.modules
        assert sys.modules["fromp_avalanche"].__file__.startswith(str(ROOT))
        return 0

    log = tmp_path / "out.txt"
    assert exit_code(forked(user_script, str(log)), 300) == 0, log.read_text()[-2000:]


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


#: the installed packages' folders (pyproject.toml's package-dir)
PACKAGE_FOLDERS = ("fromp", "strategies", "benchmarks")
#: warnings that announce a future removal: 0.4.0 keeps no deprecated name (before 1.0 a name
#: is renamed or removed in one release, listed in the CHANGELOG)
DEPRECATION_WARNINGS = ("DeprecationWarning", "PendingDeprecationWarning", "FutureWarning")


def shims(source: str) -> list[str]:
    """What in a module's ``source`` keeps an old name alive: a deprecation warning class
    named anywhere, a module-level ``__getattr__`` (a moved name resolved at run time) or an
    import finder put on ``sys.meta_path``."""
    tree = ast.parse(source)
    found = [
        f"line {node.lineno}: {node.id}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Name) and node.id in DEPRECATION_WARNINGS
    ]
    found += [
        f"line {node.lineno}: module __getattr__"
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
    ]
    found += [
        f"line {node.lineno}: sys.meta_path"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr == "meta_path"
    ]
    return found


def test_the_shim_scan_finds_each_kind():
    """The scan itself, on a planted module (so that the next test's empty result means
    something)."""
    source = """
import sys, warnings
def old(x):
    warnings.warn("old is now new", DeprecationWarning, stacklevel=2)
def __getattr__(name): ...
sys.meta_path.insert(0, object())
class C:
    def __getattr__(self, name): ...
"""
    assert [s.split(": ")[1] for s in shims(source)] == [
        "DeprecationWarning", "module __getattr__", "sys.meta_path"
    ]  # fmt: skip


def test_the_packages_hold_no_compatibility_shims():
    """No deprecated alias in 0.4.0: no module of fromp, fromp_avalanche or fromp_bench warns
    of a deprecation, resolves names through a module ``__getattr__`` or installs an import
    finder (``fromp/_compat.py`` is gone); the test run also turns fromp's own
    DeprecationWarnings into errors (pyproject.toml's ``filterwarnings``)."""
    assert not (ROOT / "fromp" / "_compat.py").exists()
    found = [
        f"{f.relative_to(ROOT)}, {where}"
        for folder in PACKAGE_FOLDERS
        for f in sorted((ROOT / folder).rglob("*.py"))
        for where in shims(f.read_text())
    ]
    assert not found, found
    filters = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"][
        "filterwarnings"
    ]
    assert "error::DeprecationWarning:fromp.*" in filters, filters
