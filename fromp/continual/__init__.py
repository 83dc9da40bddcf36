"""Continual-learning methods as plain objects: memorable points, FROMP's regulariser and
method, EWC, VCL (mean-field layers, coresets), and the one protocol they implement
(:class:`ContinualMethod`)."""

from fromp.continual.protocol import ContinualMethod

__all__ = ["ContinualMethod"]
