"""Laplace posteriors in laplace-torch's words: everything ``laplace`` (laplace-torch 0.3)
exports under its own name (the :func:`Laplace` factory, one class per (subset of weights,
structure), ``marglik_training``, the option enums), and fromp's one-call functions
(:mod:`fromp.laplace.one_call`). The modules: ``base`` (``BaseLaplace``,
``ParametricLaplace``), one module per structure (``structures``, ``lastlayer``, ``subnet``,
``lowrank``, ``functional``), ``factory``, ``predictive``, ``tuning``, ``checks``,
``marglik``, ``options``, ``subnet_masks``."""

from fromp.laplace.base import BaseLaplace, ParametricLaplace
from fromp.laplace.factory import Laplace
from fromp.laplace.functional import FunctionalLaplace
from fromp.laplace.laplace_gp import LaplaceGP
from fromp.laplace.lastlayer import DiagLLLaplace, FullLLLaplace, KronLLLaplace, LLLaplace
from fromp.laplace.lowrank import LowRankLaplace
from fromp.laplace.marglik import marglik_training
from fromp.laplace.one_call import (
    fit_laplace,
    log_evidence_grid,
    log_marginal_likelihood,
    optimize_prior_precision,
)
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
from fromp.laplace.structures import DiagLaplace, FullLaplace, KronLaplace
from fromp.laplace.subnet import DiagSubnetLaplace, FullSubnetLaplace, SubnetLaplace

__all__ = [
    "BaseLaplace",
    "DiagLLLaplace",
    "DiagLaplace",
    "DiagSubnetLaplace",
    "FullLLLaplace",
    "FullLaplace",
    "FullSubnetLaplace",
    "FunctionalApproximation",
    "FunctionalLaplace",
    "HessianStructure",
    "KronLLLaplace",
    "KronLaplace",
    "LLLaplace",
    "Laplace",
    "LaplaceGP",
    "Likelihood",
    "LinkApprox",
    "LowRankLaplace",
    "ParametricLaplace",
    "PredType",
    "PriorStructure",
    "SubnetLaplace",
    "SubsetOfWeights",
    "TuningMethod",
    "fit_laplace",
    "log_evidence_grid",
    "log_marginal_likelihood",
    "marglik_training",
    "optimize_prior_precision",
]
