"""Benchmarks, the ``fromp-bench`` runner and the command-line tools.

Avalanche imports an optional QP-solver package that warns when no solver is installed; no
benchmark here uses it, so the warning is silenced before anything imports Avalanche.
"""

import warnings

warnings.filterwarnings("ignore", message="no QP solver found")
