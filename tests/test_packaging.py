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
