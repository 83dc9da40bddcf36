"""The studies' tests (not part of ``make test``): ``python -m pytest studies/tests`` from the
repository root. The root goes on ``sys.path`` (``import studies``), the project's ``tests/``
folder too (its helpers, e.g. ``test_integrity.write_mnist``), and the project's fixtures
(``mnist_root``, the seeded single-thread default) are taken from ``tests/conftest.py``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for path in (ROOT, ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

_spec = importlib.util.spec_from_file_location("_project_conftest", ROOT / "tests" / "conftest.py")
_project = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_project)
mnist_root = _project.mnist_root
_seed_and_threads = _project._seed_and_threads
