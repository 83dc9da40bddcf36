"""The package's shape: no import circle between the project's modules of any kind (imports
inside functions and type-only imports included); ``fromp`` never imports Avalanche or the
other packages; ``fromp``'s subpackages depend on each other in one direction (a declared
order of layers), no private name crosses a subpackage, at most 12 modules at the top of
``fromp`` and 11 at the top of ``benchmarks/``; the 0.3 module paths and top-level names that
moved are gone (no shim resolves them); the tests mirror the package."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: folder -> installed import name (pyproject.toml's package-dir)
PACKAGES = {"fromp": "fromp", "strategies": "fromp_avalanche", "benchmarks": "fromp_bench"}


def modules() -> dict[str, Path]:
    out = {}
    for folder, pkg in PACKAGES.items():
        for f in sorted((ROOT / folder).rglob("*.py")):
            parts = (pkg, *f.relative_to(ROOT / folder).with_suffix("").parts)
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = f
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules imported anywhere in the file (module level or inside functions)."""
    found = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):  # `if TYPE_CHECKING:` imports count: a circle of types too
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):
                found.add(t)
    return found


def test_no_import_circles():
    mods = modules()
    graph = {m: imports(m, p, set(mods)) for m, p in mods.items()}
    # a package's __init__ re-exporting its submodules is not a circle back to the package
    for m in graph:
        graph[m] = {t for t in graph[m] if not (t in PACKAGES.values() and m.startswith(t + "."))}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join([*stack[stack.index(t) :], t]))
            elif t not in state:
                visit(t, [*stack, t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


def test_fromp_imports_no_avalanche_and_no_upper_layer():
    for name, path in modules().items():
        if name.split(".")[0] != "fromp":
            continue
        bad = {"avalanche", "fromp_avalanche", "fromp_bench", "strategies", "benchmarks"}
        for node in ast.walk(ast.parse(path.read_text())):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module]
            found = {m.split(".")[0] for m in mods} & bad
            assert not found, f"{name} imports {found.pop()}"


#: fromp's units (a subpackage, or a module at the top) from the bottom layer up: a unit may
#: import only from its own layer or a lower one. The layers: shared checks and data types;
#: curvature (Jacobians, capture, GGN, Kronecker factors); the optimizers and the GP; the
#: Laplace posteriors; the memory-perturbation and leave-one-out estimates; the continual
#: methods; the package's front page.
LAYERS = [
    {"fromp._checks", "fromp.distributed", "fromp.likelihood", "fromp.link"},
    {"fromp.models"},
    {"fromp.posterior", "fromp.curvature"},
    {"fromp.gp", "fromp.optim"},
    {"fromp.laplace"},
    {"fromp.utils"},
    {"fromp.memory"},
    {"fromp.continual"},
    {"fromp"},
    {"fromp.testing"},  # the public dense references: nothing in fromp may import it
]


def unit(module: str) -> str:
    """A module's unit: ``fromp.laplace.base`` -> ``fromp.laplace``; a top module is its own."""
    parts = module.split(".")
    if len(parts) >= 2 and (ROOT / "fromp" / parts[1]).is_dir():
        return ".".join(parts[:2])
    return module


def test_fromp_units_depend_in_one_direction():
    mods = {m: p for m, p in modules().items() if m.split(".")[0] == "fromp"}
    level = {u: i for i, layer in enumerate(LAYERS) for u in layer}
    units = {unit(m) for m in mods}
    assert units == set(level), f"every unit has a layer: {sorted(units ^ set(level))}"
    upward = []
    for m, p in mods.items():
        for t in imports(m, p, set(mods)):
            if t.split(".")[0] == "fromp" and level[unit(t)] > level[unit(m)]:
                upward.append(f"{m} -> {t}")
    assert not upward, "imports against the layers:\n" + "\n".join(sorted(upward))


def test_no_private_name_crosses_a_unit():
    """A name with a leading underscore is used only inside its unit (``_checks`` and the
    front page excepted): what another subpackage needs is public."""
    crossing = []
    for m, p in modules().items():
        if not m.startswith("fromp.") or m == "fromp":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                src = node.module
                if not src.startswith("fromp.") or src == "fromp._checks":
                    continue
                if unit(src) == unit(m):
                    continue
                crossing += [f"{m}: {src}.{a.name}" for a in node.names if a.name[0] == "_"]
    assert not crossing, "\n".join(crossing)


def test_top_levels():
    top = [p.stem for p in (ROOT / "fromp").glob("*.py") if p.name != "__init__.py"]
    assert len(top) <= 12, sorted(top)
    subpackages = [p.name for p in (ROOT / "fromp").iterdir() if (p / "__init__.py").exists()]
    assert {"laplace", "curvature", "continual", "memory", "optim", "gp"} <= set(subpackages)
    top = [p for p in (ROOT / "benchmarks").glob("*.py") if p.name != "__init__.py"]
    assert len(top) <= 11, sorted(p.name for p in top)  # the runner's tools and the GPU check


def test_public_surface_without_the_moved_names():
    """About 40 names at the top of ``fromp``; the names and module paths that moved in 0.3 and
    0.4 resolve only at their new place (no finder, no module ``__getattr__``)."""
    import sys

    import fromp
    import fromp.gp

    assert 35 <= len(fromp.__all__) <= 46
    assert all(hasattr(fromp, n) for n in fromp.__all__)
    for gone in ("to_bayesian", "vjp_sum", "kron", "no_such_name"):
        with pytest.raises(AttributeError, match=gone):
            getattr(fromp, gone)
    with pytest.raises(AttributeError, match="LaplaceGP"):
        fromp.gp.LaplaceGP
    assert not hasattr(fromp, "__getattr__") and not hasattr(fromp.gp, "__getattr__")
    assert not any(type(f).__module__.startswith("fromp") for f in sys.meta_path)
    for old in ("fromp.jacobian", "fromp.kron", "fromp.loo", "fromp.baselaplace"):
        sys.modules.pop(old, None)
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
    # the packages that kept a module's name still have its public names
    from fromp.curvature import diag_ggn
    from fromp.gp import GP
    from fromp.laplace import fit_laplace, log_marginal_likelihood

    assert diag_ggn.__module__ == "fromp.curvature.diagonal" and GP.__name__ == "GP"
    assert callable(fit_laplace) and callable(log_marginal_likelihood)


#: test folder -> what it tests: fromp's subpackages, its top-level modules (core), the
#: strategies, the runner and the documentation
TEST_AREAS = {
    "core": "fromp/*.py",
    "curvature": "fromp/curvature",
    "gp": "fromp/gp",
    "laplace": "fromp/laplace",
    "memory": "fromp/memory",
    "continual": "fromp/continual",
    "optim": "fromp/optim",
    "strategies": "strategies",
    "bench": "benchmarks",
    "docs": "README.md, docs/, examples/",
}


def test_tests_mirror_the_package():
    """Every test module sits in the folder of the part it tests; the top of ``tests/`` holds
    only the shared configuration, the shared cases and this file."""
    tests = ROOT / "tests"
    top = {p.name for p in tests.iterdir() if p.is_file() and p.suffix == ".py"}
    assert top == {"__init__.py", "conftest.py", "cases.py", "test_layout.py"}, sorted(top)
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(TEST_AREAS), sorted(folders)
    for area in TEST_AREAS:
        assert (tests / area / "__init__.py").exists(), area
        assert any((tests / area).glob("test_*.py")), area
    for sub in ("curvature", "gp", "laplace", "memory", "continual", "optim"):
        assert (ROOT / "fromp" / sub / "__init__.py").exists(), sub  # one test folder each


def test_the_runners_installed_code_stays_within_6000_lines():
    """``benchmarks/`` (installed as ``fromp_bench``) holds the runner and its tools; studies
    and one-off measurements live in ``studies/``, outside the package."""
    lines = sum(len(p.read_text().splitlines()) for p in (ROOT / "benchmarks").rglob("*.py"))
    assert lines <= 6000, lines


def test_one_place_per_mechanism():
    """``register_forward_hook`` only in the hook helper, ``F.unfold`` only in the layer
    rules, the batch-norm types written once: a second copy is a bug waiting to diverge."""
    texts = {p: p.read_text() for p in (ROOT / "fromp").rglob("*.py")}
    hooks = sorted(p.name for p, t in texts.items() if "register_forward_hook(" in t)
    assert hooks == ["hooks.py"], hooks
    unfold = sorted(p.name for p, t in texts.items() if ".unfold(" in t and "F.unfold" in t)
    assert len(unfold) <= 1, unfold
    bn = sorted(p.name for p, t in texts.items() if "nn.BatchNorm1d, nn.BatchNorm2d" in t)
    assert len(bn) <= 1, bn
