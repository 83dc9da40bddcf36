"""Avalanche strategies and plugins built on :mod:`fromp`.

Each strategy is an Avalanche ``SupervisedTemplate`` built from a plugin that delegates the
maths to :mod:`fromp`, so it runs on any Avalanche benchmark with Avalanche's metrics and
loggers.
"""

from strategies.fromp import FROMP, FROMPPlugin
from strategies.ivon import IVONPlugin, IVONStrategy
from strategies.vogn import VOGNPlugin, VOGNStrategy

__all__ = ["FROMP", "FROMPPlugin", "IVONPlugin", "IVONStrategy", "VOGNPlugin", "VOGNStrategy"]
