"""Optimisers that maintain a posterior over the weights: :class:`VOGN` and :class:`OGN`."""

from fromp.optim.vogn import OGN, VOGN, per_example_grad_stats, predict_mc, predict_mean

__all__ = ["OGN", "VOGN", "per_example_grad_stats", "predict_mc", "predict_mean"]
