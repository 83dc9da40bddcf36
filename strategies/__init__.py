"""Avalanche strategies and plugins built on :mod:`fromp`.

Each strategy is an Avalanche ``SupervisedTemplate`` built from a plugin that delegates the
maths to :mod:`fromp`, so it runs on any Avalanche benchmark with Avalanche's metrics and
loggers.
"""

from strategies.benchmarks import experience_tensors
from strategies.ewc import EWC, EWCPlugin
from strategies.fromp import FROMP, FROMPPenaltyMetric, FROMPPlugin
from strategies.ivon import IVONPlugin, IVONStrategy
from strategies.vcl import VCL, VCLPlugin
from strategies.vogn import VOGNPlugin, VOGNStrategy

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
