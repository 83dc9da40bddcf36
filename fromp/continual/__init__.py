"""Continual-learning methods as plain objects: memorable points, FROMP's regulariser and
method, EWC, VCL (mean-field layers, coresets), and the one base class they share
(:class:`ContinualMethod`, whose ``begin_task`` hands its hook a :class:`TaskStart`)."""

from fromp.continual.protocol import ContinualMethod, TaskStart

__all__ = ["ContinualMethod", "TaskStart"]
