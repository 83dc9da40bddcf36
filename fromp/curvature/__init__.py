"""Jacobians, layer capture, the per-layer rules, GGN products, diagonal curvature and Kronecker
factors: everything that measures a network's curvature."""

from fromp.curvature.diagonal import (  # the names of the former module fromp.curvature
    DataArg,
    diag_ef,
    diag_fisher,
    diag_ggn,
    diag_ggn_linear,
    iter_batches,
)

__all__ = [
    "DataArg",
    "diag_ef",
    "diag_fisher",
    "diag_ggn",
    "diag_ggn_linear",
    "iter_batches",
]
