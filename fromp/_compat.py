"""Module paths that moved in 0.4, still importable for one minor version.

``import fromp.jacobian`` (and every other flat module of 0.3 that now lives in a
subpackage) gives the module at its new path, with a ``DeprecationWarning`` naming it. The
modules are the same objects, so ``fromp.jacobian.unflatten is fromp.curvature.jacobian
.unflatten``. Listed in the CHANGELOG; the old paths go in 0.5.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

#: 0.3 module path -> 0.4 module path
MOVED_MODULES: dict[str, str] = {
    "fromp.baselaplace": "fromp.laplace.base",
    "fromp.laplace_structures": "fromp.laplace.structures",
    "fromp.laplace_subnet": "fromp.laplace.subnet",
    "fromp.laplace_lowrank": "fromp.laplace.lowrank",
    "fromp.laplace_factory": "fromp.laplace.factory",
    "fromp.jacobian": "fromp.curvature.jacobian",
    "fromp.capture": "fromp.curvature.capture",
    "fromp.layer_rules": "fromp.curvature.layer_rules",
    "fromp.ggn": "fromp.curvature.ggn",
    "fromp.kron": "fromp.curvature.kron",
    "fromp.kernel": "fromp.gp.kernel",
    "fromp.memorable": "fromp.continual.memorable",
    "fromp.regularizer": "fromp.continual.regularizer",
    "fromp.methods": "fromp.continual.methods",
    "fromp.ewc": "fromp.continual.ewc",
    "fromp.vcl": "fromp.continual.vcl",
    "fromp.coreset": "fromp.continual.coreset",
    "fromp.bayesian": "fromp.continual.bayesian",
    "fromp.sensitivity": "fromp.memory.sensitivity",
    "fromp.loo": "fromp.memory.loo",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a 0.3 module path and loads the module at its new path."""

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED_MODULES[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; the old path goes in fromp 0.5",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """The module was executed at its new path."""


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if any(isinstance(f, _MovedModules) for f in sys.meta_path):
        return
    # right after the path finder (before any finder an editable install adds), so that an
    # old path always resolves to the module at its new path
    finders = [getattr(f, "__name__", type(f).__name__) for f in sys.meta_path]
    at = finders.index("PathFinder") + 1 if "PathFinder" in finders else len(sys.meta_path)
    sys.meta_path.insert(at, _MovedModules())


def moved_module(name: str) -> ModuleType | None:
    """``fromp.<name>`` for a moved module's short name (``from fromp import kron``)."""
    full = f"fromp.{name}"
    if full not in MOVED_MODULES:
        return None
    warnings.warn(
        f"{full} moved to {MOVED_MODULES[full]}; the old path goes in fromp 0.5",
        DeprecationWarning,
        stacklevel=3,
    )
    return importlib.import_module(MOVED_MODULES[full])
