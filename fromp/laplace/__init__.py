"""Laplace posteriors: the base class, one module per structure (``structures``, ``lastlayer``,
``subnet``, ``lowrank``, ``functional``), the ``Laplace`` factory, the predictives, the prior-
precision search, the checks, and the one-call functions (``one_call``)."""

from fromp.laplace.laplace_gp import LaplaceGP
from fromp.laplace.one_call import (  # the names of the former module fromp.laplace
    DiagLaplace,
    FullGaussian,
    FullLaplace,
    accumulate_ggn,
    laplace,
    laplace_full,
    log_evidence_grid,
    log_marginal_likelihood,
    optimize_prior_precision,
    prior_precision_vector,
    require_eval,
)

__all__ = [
    "DiagLaplace",
    "FullGaussian",
    "FullLaplace",
    "LaplaceGP",
    "accumulate_ggn",
    "laplace",
    "laplace_full",
    "log_evidence_grid",
    "log_marginal_likelihood",
    "optimize_prior_precision",
    "prior_precision_vector",
    "require_eval",
]
