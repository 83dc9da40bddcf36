"""docs/glossary.md matches the signatures: every call written in a code span
(``Name(arg=...)``) names a real parameter of a real class or function, and the glossary's
parameter names are those of the classes that use them."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

import fromp

GLOSSARY = Path(__file__).resolve().parents[1] / "docs" / "glossary.md"
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
