"""The package's shape: no import circle between the project's modules (imports inside
functions included), ``fromp`` never imports Avalanche or the other packages, no module
over 700 lines, at most 10 modules at the top of ``benchmarks/``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fromp", "strategies", "benchmarks")


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = f.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = f
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Project modules imported anywhere in the file (module level or inside functions)."""
    found = set()
    tree = ast.parse(path.read_text())
    typing_only = {  # `if TYPE_CHECKING:` imports are for annotations, never run
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and getattr(block.test, "id", None) == "TYPE_CHECKING"
        for n in ast.walk(block)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
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
        graph[m] = {t for t in graph[m] if not (t in PACKAGES and m.startswith(t + "."))}
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
        if not name.startswith("fromp"):
            continue
        text = path.read_text()
        for bad in ("avalanche", "strategies", "benchmarks"):
            tree = ast.parse(text)
            for node in ast.walk(tree):
                mods = []
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module:
                    mods = [node.module]
                assert not any(m.split(".")[0] == bad for m in mods), f"{name} imports {bad}"


def test_module_sizes_and_benchmarks_top_level():
    long = {n: len(p.read_text().splitlines()) for n, p in modules().items()}
    assert not {n: k for n, k in long.items() if k > 700}
    top = [p for p in (ROOT / "benchmarks").glob("*.py") if p.name != "__init__.py"]
    assert len(top) <= 10, sorted(p.name for p in top)


def test_public_surface_and_moved_names():
    """About 40 names at the top of ``fromp``; the names that moved in 0.3.0 still resolve,
    with a DeprecationWarning naming their module, to the same objects."""
    import warnings

    import fromp
    from fromp.bayesian import to_bayesian
    from fromp.jacobian import vjp_sum

    assert 35 <= len(fromp.__all__) <= 45
    assert all(hasattr(fromp, n) for n in fromp.__all__)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fromp.to_bayesian is to_bayesian and fromp.vjp_sum is vjp_sum
    assert [str(w.message) for w in caught] == [
        "fromp.to_bayesian moved to fromp.bayesian.to_bayesian",
        "fromp.vjp_sum moved to fromp.jacobian.vjp_sum",
    ]
    try:
        fromp.no_such_name
    except AttributeError as err:
        assert "no_such_name" in str(err)
    else:
        raise AssertionError("an unknown name must raise AttributeError")
