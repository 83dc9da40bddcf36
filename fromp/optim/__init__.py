"""Optimisers that maintain a posterior over the weights: :class:`VOGN`, :class:`OGN` and
:class:`IVON`."""

from fromp.optim.ivon import IVON
from fromp.optim.vogn import OGN, VOGN, per_example_grad_stats, predict_mc, predict_mean

__all__ = ["IVON", "OGN", "VOGN", "per_example_grad_stats", "predict_mc", "predict_mean"]
