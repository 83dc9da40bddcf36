"""docs/glossary.md matches the signatures: every call written in a code span
(``Name(arg=...)``) names a real parameter of a real class or function, and the glossary's
parameter names are those of the classes that use them; one name per quantity in every public
signature of ``fromp``, ``fromp_avalanche`` and ``fromp_bench`` (an AST scan: no ``n_train``,
``n_examples``, ``lik``, ``delta`` or ``prior_var``; ``curvature`` only for a curvature object,
never the name of a kind)."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

import fromp

ROOT = Path(__file__).resolve().parents[2]
GLOSSARY = ROOT / "docs" / "glossary.md"
#: where a name written in the glossary is looked up, in order
MODULES = (
    "fromp",
    "fromp.optim",
    "fromp.continual.methods",
    "fromp.continual.ewc",
    "fromp.laplace.base",
    "fromp_avalanche.vcl",
)


def _resolve(name: str):
    for mod in MODULES:
        obj = getattr(importlib.import_module(mod), name, None)
        if obj is not None:
            return obj
    raise AssertionError(f"docs/glossary.md names {name}, which is not in {MODULES}")


def _parameters(obj) -> set[str]:
    fn = obj.__init__ if inspect.isclass(obj) else obj
    return set(inspect.signature(fn).parameters)


def _calls() -> list[tuple[str, str, list[str]]]:
    """``(span, callee, keyword names)`` of every code span holding a call with keywords."""
    out = []
    for span in re.findall(r"`([^`]+)`", GLOSSARY.read_text()):
        for callee, args in re.findall(r"(?:\b|\.)(\w+)\(([^()]*)\)", span):
            keys = re.findall(r"(\w+)\s*=", args)
            if keys:
                out.append((span, callee, keys))
    return out


CALLS = _calls()


def test_the_glossary_writes_calls():
    assert len(CALLS) >= 5  # the parser finds them (IVON, VOGN, VCL, ...)


@pytest.mark.parametrize(("span", "callee", "keys"), CALLS, ids=[c[0] for c in CALLS])
def test_every_call_in_the_glossary_names_real_parameters(span, callee, keys):
    params = _parameters(_resolve(callee))
    missing = [k for k in keys if k not in params]
    assert not missing, f"`{span}`: {callee} has no parameter {missing}"


@pytest.mark.parametrize(
    ("name", "users"),
    [
        ("ess", ("IVON", "VOGN")),
        ("kl_weight", ("VOGN",)),
        ("hess_init", ("IVON",)),
        ("prior_precision", ("BaseLaplace", "VOGN", "FROMPMethod", "VCLMethod", "VCL")),
        ("prior_mean", ("VOGN",)),
        ("sigma_noise", ("BaseLaplace",)),
        ("temperature", ("BaseLaplace",)),
        ("tau", ("FROMPMethod",)),
        ("n_points", ("FROMPMethod",)),
        ("jitter", ("FROMPMethod",)),
        ("ewc_lambda", ("EWCMethod",)),
        ("weight_decay", ("IVON",)),
    ],
)
def test_glossary_parameter_names_are_the_signatures(name, users):
    text = GLOSSARY.read_text()
    assert f"`{name}`" in text
    for user in users:
        assert name in _parameters(_resolve(user)), f"{user} has no parameter {name!r}"


def test_fromp_exports_the_optimizers():
    assert fromp.IVON is _resolve("IVON") and fromp.VOGN is _resolve("VOGN")


#: the folders of the installed packages (pyproject.toml's package-dir)
PACKAGES = {"fromp": "fromp", "strategies": "fromp_avalanche", "benchmarks": "fromp_bench"}
#: other names of quantities that have one name (docs/glossary.md): N is ``ess`` (``n_data``
#: on a fitted Laplace, laplace-torch's attribute), ``batch_size`` for a mini-batch's count;
#: delta is ``prior_precision``; the likelihood is ``likelihood``
FORBIDDEN = ("n_train", "n_examples", "lik", "delta", "prior_var")


def _is_dataclass(node: ast.ClassDef) -> bool:
    for d in node.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        if (isinstance(d, ast.Name) and d.id == "dataclass") or (
            isinstance(d, ast.Attribute) and d.attr == "dataclass"
        ):
            return True
    return False


def _arguments(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[ast.arg, ast.expr | None]]:
    """``(parameter, default)`` of every parameter of ``fn``, ``*args`` and ``**kwargs`` too."""
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out = list(zip(positional, defaults))
    out += list(zip(a.kwonlyargs, a.kw_defaults))
    out += [(v, None) for v in (a.vararg, a.kwarg) if v is not None]
    return out


def public_signatures(source: str) -> list[tuple[str, str, ast.expr | None, ast.expr | None]]:
    """``(where, parameter, annotation, default)`` of every parameter of the public functions,
    the public methods and ``__init__`` of the public classes (a dataclass's fields: its
    generated ``__init__``) at the top of a module's ``source``."""
    out = []

    def add(where: str, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        out.extend((where, p.arg, p.annotation, d) for p, d in _arguments(fn))

    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name[0] != "_":
            add(node.name, node)
        elif isinstance(node, ast.ClassDef) and node.name[0] != "_":
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and (
                    item.name[0] != "_" or item.name == "__init__"
                ):
                    add(f"{node.name}.{item.name}", item)
                elif (
                    isinstance(item, ast.AnnAssign)
                    and isinstance(item.target, ast.Name)
                    and _is_dataclass(node)
                ):
                    out.append((f"{node.name}()", item.target.id, item.annotation, item.value))
    return out


def _public_modules() -> list[tuple[str, Path]]:
    """``(import name, file)`` of every module of the three packages whose path has no
    ``_``-prefixed part (``__init__`` counts as its package)."""
    out = []
    for folder, package in PACKAGES.items():
        for f in sorted((ROOT / folder).rglob("*.py")):
            parts = f.relative_to(ROOT / folder).with_suffix("").parts
            if any(p[0] == "_" and p != "__init__" for p in parts):
                continue
            out.append((".".join((package, *parts)), f))
    return out


def _scan() -> list[tuple[str, str, ast.expr | None, ast.expr | None]]:
    return [
        (f"{module}:{where}", name, annotation, default)
        for module, f in _public_modules()
        for where, name, annotation, default in public_signatures(f.read_text())
    ]


def test_the_signature_scan_sees_functions_methods_and_dataclass_fields():
    """The scan itself: it finds a planted name in each place it reads, and skips what is
    private (so that an empty result of the next test means something)."""
    source = """
from dataclasses import dataclass

def fit(model, n_train): ...
def _private(lik): ...
class Tracker:
    def __init__(self, *, delta=1.0): ...
    def step(self, x, **n_examples): ...
    def _inner(self, lik): ...
@dataclass
class Config:
    prior_var: float = 1.0
class _Hidden:
    def run(self, lik): ...
"""
    found = {(where, name) for where, name, _, _ in public_signatures(source)}
    assert {("fit", "n_train"), ("Tracker.__init__", "delta"), ("Tracker.step", "n_examples"),
            ("Config()", "prior_var")} <= found  # fmt: skip
    assert not {name for _, name in found} & {"lik"}
    modules = dict(_public_modules())
    assert {"fromp.laplace.base", "fromp_avalanche.fromp", "fromp_bench.runner"} <= set(modules)
    assert not any("._" in m.replace(".__init__", "") for m in modules)


def test_public_signatures_use_one_name_per_quantity():
    """None of the other names of ``N``, ``delta`` and the likelihood in a public signature
    (docs/glossary.md gives the one name of each)."""
    bad = [f"{where}({name})" for where, name, _, _ in _scan() if name in FORBIDDEN]
    assert not bad, f"use the glossary's names (docs/glossary.md): {bad}"


def test_curvature_names_a_curvature_object_only():
    """``curvature`` has one meaning in public signatures: the fitted curvature object of
    ``fromp.laplace`` (``la.use_curvature(curvature, n_data)``). The kind of curvature an
    optimizer or an estimate uses is ``hess_approx`` (``VOGN(hess_approx="ggn")``,
    ``newton_step_loo(hess_approx="ggn")``, ``IVON(hess_approx="price")``)."""
    kinds = []
    users = []
    for where, name, annotation, default in _scan():
        if name != "curvature":
            continue
        users.append(where)
        text = ast.unparse(annotation) if annotation is not None else ""
        if re.search(r"\bstr\b|Literal", text) or (
            isinstance(default, ast.Constant) and isinstance(default.value, str)
        ):
            kinds.append(where)
    assert users, "the scan finds use_curvature(curvature, ...)"
    assert all(w.startswith("fromp.laplace") for w in users), users
    assert not kinds, f"curvature= names a kind here; write hess_approx=: {kinds}"
    hess = [where for where, name, _, _ in _scan() if name == "hess_approx"]
    assert {"fromp.optim.vogn:VOGN.__init__", "fromp.optim.ivon:IVON.__init__"} <= set(hess)
    assert "fromp.memory.sensitivity:newton_step_loo" in hess
