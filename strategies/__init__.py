"""Avalanche strategies and plugins built on :mod:`fromp`.

Each strategy is an Avalanche ``SupervisedTemplate`` built from a plugin that delegates the
maths to :mod:`fromp`, so it runs on any Avalanche benchmark with Avalanche's metrics and
loggers.
"""

from fromp_avalanche.benchmarks import experience_tensors
from fromp_avalanche.ewc import EWC, EWCPlugin
from fromp_avalanche.fromp import FROMP, FROMPPenaltyMetric, FROMPPlugin
from fromp_avalanche.ivon import IVONPlugin, IVONStrategy
from fromp_avalanche.vcl import VCL, VCLPlugin
from fromp_avalanche.vogn import VOGNPlugin, VOGNStrategy

__all__ = [
    "EWC",
    "FROMP",
    "VCL",
    "EWCPlugin",
    "FROMPPenaltyMetric",
    "FROMPPlugin",
    "IVONPlugin",
    "IVONStrategy",
    "VCLPlugin",
    "VOGNPlugin",
    "VOGNStrategy",
    "experience_tensors",
]
