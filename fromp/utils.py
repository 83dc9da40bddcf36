"""What laplace-torch users import from ``laplace.utils``, under ``fromp.utils``: the
subnetwork masks (:mod:`fromp.laplace.subnet_masks`), diagonal SWAG, and the option enums
(:mod:`fromp.laplace.options`; ``Likelihood`` here is laplace-torch's enum of likelihood
*names*, while ``fromp.Likelihood`` is fromp's likelihood class)."""

from __future__ import annotations

from fromp.laplace.options import (
    FunctionalApproximation,
    HessianStructure,
    Likelihood,
    LinkApprox,
    PredType,
    PriorStructure,
    SubsetOfWeights,
    TuningMethod,
)
from fromp.laplace.subnet_masks import (
    LargestMagnitudeSubnetMask,
    LargestVarianceDiagLaplaceSubnetMask,
    LargestVarianceSWAGSubnetMask,
    LastLayerSubnetMask,
    ModuleNameSubnetMask,
    ParamNameSubnetMask,
    RandomSubnetMask,
    ScoreBasedSubnetMask,
    SubnetMask,
    fit_diagonal_swag_var,
)

__all__ = [
    "FunctionalApproximation",
    "HessianStructure",
    "LargestMagnitudeSubnetMask",
    "LargestVarianceDiagLaplaceSubnetMask",
    "LargestVarianceSWAGSubnetMask",
    "LastLayerSubnetMask",
    "Likelihood",
    "LinkApprox",
    "ModuleNameSubnetMask",
    "ParamNameSubnetMask",
    "PredType",
    "PriorStructure",
    "RandomSubnetMask",
    "ScoreBasedSubnetMask",
    "SubnetMask",
    "SubsetOfWeights",
    "TuningMethod",
    "fit_diagonal_swag_var",
]
