"""laplace-torch 0.3's option enums (``laplace.utils.enums``), accepted wherever
:func:`fromp.Laplace` and its classes take the option as a string.

Each is a ``str`` enum: ``Likelihood.CLASSIFICATION == "classification"``. Enum members hash
by their *name* (``"CLASSIFICATION"``), not their value, so fromp turns every option into
its plain string with :func:`option` before it looks it up.

laplace-torch's curvature backends (``laplace.curvature.CurvlinopsGGN``, ...) are mapped by
:func:`check_backend`: the GGN ones to fromp's exact GGN, the others refused naming fromp's
equivalent.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

__all__ = [
    "FunctionalApproximation",
    "HessianStructure",
    "Likelihood",
    "LinkApprox",
    "PredType",
    "PriorStructure",
    "SubsetOfWeights",
    "TuningMethod",
    "check_backend",
    "option",
]


class SubsetOfWeights(str, Enum):
    """``subset_of_weights``."""

    ALL = "all"
    LAST_LAYER = "last_layer"
    SUBNETWORK = "subnetwork"


class HessianStructure(str, Enum):
    """``hessian_structure`` (``"gp"``: :class:`fromp.FunctionalLaplace`)."""

    FULL = "full"
    KRON = "kron"
    DIAG = "diag"
    LOWRANK = "lowrank"
    GP = "gp"


class FunctionalApproximation(str, Enum):
    """``functional_approximation`` of :func:`fromp.Laplace` (``hessian_structure="gp"``):
    fromp offers the subset of data (``"sod"``); the others are refused naming it."""

    SOD = "sod"
    NYSTROM = "nystrom"
    VARIATIONAL = "variational"


class Likelihood(str, Enum):
    """``likelihood`` (laplace-torch's names; fromp's ``likelihood`` attribute equals one)."""

    REGRESSION = "regression"
    CLASSIFICATION = "classification"


class PredType(str, Enum):
    """``pred_type``."""

    GLM = "glm"
    NN = "nn"
    GP = "gp"


class LinkApprox(str, Enum):
    """``link_approx``."""

    MC = "mc"
    PROBIT = "probit"
    BRIDGE = "bridge"
    BRIDGE_NORM = "bridge_norm"


class TuningMethod(str, Enum):
    """``method`` of ``optimize_prior_precision``."""

    MARGLIK = "marglik"
    GRIDSEARCH = "gridsearch"


class PriorStructure(str, Enum):
    """``prior_structure`` of ``optimize_prior_precision``."""

    SCALAR = "scalar"
    DIAG = "diag"
    LAYERWISE = "layerwise"


def option(value: Any) -> Any:
    """``value`` with an enum member replaced by its string value (anything else as is)."""
    return value.value if isinstance(value, Enum) else value


#: laplace-torch backend class names fromp computes (its exact GGN, as ``CurvlinopsGGN``)
_GGN = ("CurvlinopsGGN", "AsdlGGN", "BackPackGGN", "AsdfghjklGGN", "GGNInterface")
_REFUSED = {
    "EF": "fromp.Laplace computes the exact GGN; the empirical Fisher is "
    "fromp.curvature.diag_ef (diagonal) or fromp.curvature.kron.kron_curvature(fisher='ef') "
    "(Kronecker), usable through la.use_curvature(...)",
    "Hessian": "fromp.Laplace computes the exact GGN (positive semi-definite); the full "
    "Hessian is not offered (use the default backend)",
}


def check_backend(backend: Any, backend_kwargs: dict[str, Any] | None) -> str:
    """The name of a laplace-torch ``backend`` (a class, or its name) that fromp computes,
    or a ``ValueError`` naming fromp's equivalent. ``None`` is laplace-torch's default
    (``CurvlinopsGGN``). Stochastic ``backend_kwargs`` (MC samples) are refused: fromp's GGN
    is exact."""
    if backend is None:
        name = "CurvlinopsGGN"
    else:
        name = backend if isinstance(backend, str) else getattr(backend, "__name__", None)
        if not isinstance(name, str):
            raise ValueError(f"backend must be a laplace-torch backend class or its name, "
                             f"got {backend!r}")  # fmt: skip
    if name not in _GGN:
        for key, why in _REFUSED.items():
            if name.endswith(key):
                raise ValueError(f"backend={name} is not supported: {why}")
        raise ValueError(f"backend={name} is not supported: fromp.Laplace computes the exact "
                         f"GGN (laplace-torch's CurvlinopsGGN); pass backend=None")  # fmt: skip
    extra = set(backend_kwargs or {}) - {"low_rank"}
    if extra:
        raise ValueError(
            f"backend_kwargs {sorted(extra)} are not supported: fromp's GGN is exact (no "
            "stochastic estimate); only 'low_rank' (hessian_structure='lowrank') is taken"
        )
    return name
