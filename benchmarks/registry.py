"""The benchmarks and strategies the runner knows, with their reference protocols.

A benchmark carries its protocol (how the tasks are built, which network, the training
settings of the FROMP paper) and the published numbers to compare with. A strategy names an
Avalanche strategy class by import path (imported lazily, so a missing optional strategy does
not break the others) and preset keyword arguments; its tuned per-benchmark settings live in
:data:`fromp_bench.settings.SETTINGS`.

Settings are merged in this order, later wins: benchmark defaults,
``SETTINGS[strategy][benchmark]``, the preset's own settings, command-line overrides.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fromp_bench.data import (
    TaskSequence,
    class_incremental,
    permuted_digits,
    permuted_mnist,
    split_cifar,
    split_digits,
    split_fashion_mnist,
    split_mnist,
    split_mnist_ci,
)
from fromp_bench.settings import settings_for
from torch import nn

from fromp.models import CifarCNN, MultiHeadMLP

__all__ = [
    "BENCHMARKS",
    "STRATEGIES",
    "BenchmarkSpec",
    "Published",
    "StrategySpec",
    "UnknownNameError",
    "get_benchmark",
    "get_strategy",
]


class UnknownNameError(ValueError):
    """A benchmark or strategy name that the registry does not know."""


@dataclass(frozen=True)
class Published:
    """A published score: mean of per-task test accuracies after the last task, in %."""

    accuracy: float
    std: float | None
    source: str


@dataclass(frozen=True)
class BenchmarkSpec:
    """A continual-learning benchmark and its reference protocol.

    Attributes:
        name: command-line name.
        description: one line for ``--help`` and reports.
        load: ``data_root -> TaskSequence``.
        model: ``TaskSequence -> nn.Module`` (a :class:`fromp.models.MultiHeadModel`).
        settings: training settings of the FROMP paper (``lr``, ``train_epochs``,
            ``train_mb_size``, ``optimizer``).
        published: strategy name -> published score.
        needs: the data sets the benchmark reads (for messages; empty for built-in data).
        layout: ``(n_tasks, input_shape, n_outputs, multi_head)`` of the task sequence, so
            that settings can be checked on the network before any data is loaded.
    """

    name: str
    description: str
    load: Callable[[str | os.PathLike[str] | None], TaskSequence]
    model: Callable[[TaskSequence], nn.Module]
    settings: Mapping[str, Any]
    published: Mapping[str, Published] = field(default_factory=dict)
    needs: tuple[str, ...] = ()
    layout: tuple[int, tuple[int, ...], int, bool] = (5, (1, 28, 28), 2, True)


def _mlp(hidden: tuple[int, ...]) -> Callable[[TaskSequence], nn.Module]:
    def make(seq: TaskSequence) -> nn.Module:
        in_features = 1
        for s in seq.input_shape:
            in_features *= s
        heads = len(seq) if seq.multi_head else 1
        return MultiHeadMLP(in_features, hidden, n_heads=heads, head_size=seq.n_outputs)

    return make


def _cifar_cnn(seq: TaskSequence) -> nn.Module:
    return CifarCNN(seq.input_shape[0], n_heads=len(seq), head_size=seq.n_outputs)


_FROMP_CODE = "FROMP official code (Pan et al., NeurIPS 2020)"
_SFSVI = "S-FSVI (Rudner et al., ICML 2022)"
_VCL = "VCL paper (Nguyen et al., ICLR 2018)"

BENCHMARKS: dict[str, BenchmarkSpec] = {
    "split-mnist": BenchmarkSpec(
        "split-mnist",
        "Split MNIST: 5 tasks (0/1, 2/3, ...), raw pixels, MLP 784-256-256 with 5 two-way heads",
        lambda root: split_mnist(root),
        _mlp((256, 256)),
        {"optimizer": "adam", "lr": 1e-4, "train_epochs": 15, "train_mb_size": 128},
        {
            "fromp": Published(99.3, 0.0, _FROMP_CODE),
            "fromp-l2": Published(99.3, 0.0, _FROMP_CODE),
            "s-fsvi": Published(99.54, 0.04, _SFSVI),
            "vcl": Published(97.0, None, _VCL),
            "vcl-coreset": Published(98.4, None, _VCL),
            "ewc-avalanche": Published(
                98.44,
                None,
                "Avalanche EWC, lambda=1e4, Adam 1e-3, 15 epochs, on Avalanche's own "
                "SplitMNIST and MTSimpleMLP",
            ),
        },
        ("MNIST",),
        (5, (1, 28, 28), 2, True),
    ),
    "permuted-mnist": BenchmarkSpec(
        "permuted-mnist",
        "Permuted MNIST: 10 tasks (first unpermuted), MLP 784-100-100, one 10-way head",
        lambda root: permuted_mnist(root),
        _mlp((100, 100)),
        {"optimizer": "adam", "lr": 1e-3, "train_epochs": 10, "train_mb_size": 128},
        {
            "fromp": Published(94.8, 0.1, _FROMP_CODE),
            "fromp-l2": Published(94.6, 0.1, _FROMP_CODE),
            "s-fsvi": Published(95.76, 0.02, _SFSVI),
            "vcl-coreset": Published(93.0, None, _VCL),
        },
        ("MNIST",),
        (10, (784,), 10, False),
    ),
    "split-cifar": BenchmarkSpec(
        "split-cifar",
        "Split CIFAR: CIFAR-10, then CIFAR-100 classes 0-49 as 5 tasks; CNN with 6 ten-way heads",
        lambda root: split_cifar(root),
        _cifar_cnn,
        {"optimizer": "adam", "lr": 1e-3, "train_epochs": 80, "train_mb_size": 256},
        {
            "fromp": Published(76.2, 0.4, _FROMP_CODE),
            "fromp-l2": Published(74.6, 0.4, _FROMP_CODE),
            "s-fsvi": Published(77.57, 0.84, _SFSVI),
        },
        ("CIFAR10", "CIFAR100"),
        (6, (3, 32, 32), 10, True),
    ),
    # Class-incremental split MNIST, S-FSVI's single-head protocol ("smnist_sh" in
    # benchmarking/data_loaders/mnist_and_cifar.py of timrudner/S-FSVI): 5 experiences of 2
    # digits, one 10-way head, 200 memory points per experience for every method that keeps
    # examples (FROMP's memorable set, Replay's buffer). The training protocol (network,
    # optimizer, epochs) is the same for every strategy; see benchmarks/settings.py.
    "split-mnist-ci": BenchmarkSpec(
        "split-mnist-ci",
        "Class-incremental split MNIST: 5 experiences of 2 digits, global labels, MLP "
        "784-256-256 with one 10-way head",
        lambda root: split_mnist_ci(root),
        _mlp((256, 256)),
        {"optimizer": "adam", "lr": 1e-3, "train_epochs": 2, "train_mb_size": 128},
        {
            "s-fsvi": Published(92.87, 0.14, _SFSVI + ", single head, 200 coreset points per task"),
        },
        ("MNIST",),
        (5, (1, 28, 28), 10, False),
    ),
    "split-fashion-mnist": BenchmarkSpec(
        "split-fashion-mnist",
        "Split Fashion-MNIST: 5 tasks of 2 classes, raw pixels, MLP 784-256-256, 5 heads",
        lambda root: split_fashion_mnist(root),
        _mlp((256, 256)),
        {"optimizer": "adam", "lr": 1e-4, "train_epochs": 15, "train_mb_size": 128},
        {},
        ("FashionMNIST",),
        (5, (1, 28, 28), 2, True),
    ),
    "split-digits": BenchmarkSpec(
        "split-digits",
        "Split-Digits: scikit-learn's 8x8 digits, 5 tasks of 2 classes, MLP 64-256-256, 5 heads "
        "(built in, no download)",
        lambda root: split_digits(),
        _mlp((256, 256)),
        {"optimizer": "adam", "lr": 1e-3, "train_epochs": 20, "train_mb_size": 32},
        {},
        (),
        (5, (1, 8, 8), 2, True),
    ),
    "permuted-digits": BenchmarkSpec(
        "permuted-digits",
        "Permuted-Digits: scikit-learn's 8x8 digits, 5 tasks (first unpermuted, then 4 pixel "
        "permutations), MLP 64-100-100 with one 10-way head (built in, no download)",
        lambda root: permuted_digits(),
        _mlp((100, 100)),
        {"optimizer": "adam", "lr": 1e-3, "train_epochs": 10, "train_mb_size": 32},
        {},
        (),
        (5, (64,), 10, False),
    ),
    "split-digits-ci": BenchmarkSpec(
        "split-digits-ci",
        "Class-incremental Split-Digits: the 5 experiences of split-digits with global labels "
        "and one 10-way head, MLP 64-256-256 (built in, no download)",
        lambda root: class_incremental(split_digits(), "split-digits-ci"),
        _mlp((256, 256)),
        {"optimizer": "adam", "lr": 1e-3, "train_epochs": 20, "train_mb_size": 32},
        {},
        (),
        (5, (1, 8, 8), 10, False),
    ),
}


@dataclass(frozen=True)
class StrategySpec:
    """A strategy the runner can build.

    Attributes:
        name: command-line name.
        target: ``"module:Class"`` of an Avalanche ``SupervisedTemplate`` subclass.
        description: one line.
        kwargs: preset keyword arguments for the class (e.g. the kernel of FROMP-L2).
        settings: preset settings that override the defaults (e.g. ``optimizer="vogn"``).
        joint: trains on all tasks at once (an upper bound, not a continual learner).
    """

    name: str
    target: str
    description: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    settings: Mapping[str, Any] = field(default_factory=dict)
    joint: bool = False

    def load_class(self) -> type:
        """Import the strategy class (raises ImportError when it is not installed)."""
        module, _, cls = self.target.partition(":")
        return getattr(importlib.import_module(module), cls)

    def available(self) -> bool:
        """Whether the strategy class can be imported."""
        try:
            self.load_class()
        except (ImportError, AttributeError):
            return False
        return True

    def defaults(self, benchmark: str) -> dict[str, Any]:
        """The tuned settings for ``benchmark`` (:data:`fromp_bench.settings.SETTINGS`; may be
        empty)."""
        return settings_for(self.name, benchmark)


STRATEGIES: dict[str, StrategySpec] = {
    s.name: s
    for s in [
        StrategySpec(
            "fromp",
            "fromp_avalanche.fromp:FROMP",
            "FROMP: functional regularisation of memorable past, per-class DNN2GP kernels",
        ),
        StrategySpec(
            "fromp-l2",
            "fromp_avalanche.fromp:FROMP",
            "FROMP-L2: FROMP with the kernel replaced by the identity",
            kwargs={"kernel": "identity"},
        ),
        StrategySpec(
            "fromp-kron",
            "fromp_avalanche.fromp:FROMP",
            "FROMP with Kronecker-factored (KFAC) posterior kernels instead of diagonal ones",
            kwargs={"posterior": "kron"},
        ),
        StrategySpec(
            "fromp-vogn",
            "fromp_avalanche.fromp:FROMP",
            "FROMP trained with VOGN; the kernel uses VOGN's posterior",
            kwargs={"posterior": "vogn"},
            settings={"optimizer": "vogn"},
        ),
        StrategySpec(
            "fromp-ivon",
            "fromp_avalanche.fromp:FROMP",
            "FROMP trained with IVON; the kernel uses IVON's posterior",
            kwargs={"posterior": "ivon"},
            settings={"optimizer": "ivon"},
        ),
        StrategySpec(
            "ivon",
            "fromp_avalanche.ivon:IVONStrategy",
            "IVON: improved variational online Newton, each task's posterior is the next prior",
            settings={"optimizer": "ivon"},
        ),
        StrategySpec(
            "vogn",
            "fromp_avalanche.vogn:VOGNStrategy",
            "VOGN: variational online Gauss-Newton, each task's posterior is the next prior",
            settings={"optimizer": "vogn"},
        ),
        StrategySpec(
            "vcl",
            "fromp_avalanche.vcl:VCL",
            "VCL: mean-field variational continual learning",
        ),
        StrategySpec(
            "vcl-coreset",
            "fromp_avalanche.vcl:VCL",
            "VCL with a random coreset, trained on before evaluation",
            kwargs={"coreset_method": "random"},
        ),
        StrategySpec(
            "ewc",
            "fromp_avalanche.ewc:EWC",
            "EWC with the per-example (sampled) Fisher diagonal",
        ),
        StrategySpec(
            "ewc-avalanche",
            "avalanche.training:EWC",
            "Avalanche's own EWC (squared mini-batch gradients as importance), with the "
            "benchmark's training settings, the same as ewc's",
            kwargs={"ewc_lambda": 1e4, "mode": "separate"},
        ),
        StrategySpec(
            "fromp-coreset",
            "fromp_avalanche.fromp:FROMP",
            "FROMP whose memorable set, drawn at random per class, is also a labelled coreset "
            "in the loss (replay=True)",
            kwargs={"replay": True, "select": "random"},
        ),
        StrategySpec(
            "replay",
            "fromp_avalanche.benchmarks:ExperienceReplay",
            "Avalanche's ReplayPlugin with a fixed buffer per experience "
            "(ExperienceBalancedBuffer, not adaptive): mem_per_experience examples of each",
        ),
        StrategySpec(
            "lwf",
            "fromp_avalanche.benchmarks:LwFStrategy",
            "Avalanche's LwF (distillation of the previous model's outputs), checkpointable",
            kwargs={"alpha": 1.0, "temperature": 2.0},
        ),
        StrategySpec(
            "naive",
            "avalanche.training:Naive",
            "Naive: fine-tuning on each task in turn (lower bound)",
        ),
        StrategySpec(
            "joint",
            "avalanche.training:JointTraining",
            "Joint: all tasks at once (upper bound, not continual)",
            joint=True,
        ),
    ]
}


def _unknown(kind: str, name: str, known: Mapping[str, Any]) -> UnknownNameError:
    return UnknownNameError(f"unknown {kind} {name!r}; choose from: {', '.join(known)}")


def get_benchmark(name: str) -> BenchmarkSpec:
    """The benchmark called ``name``; :class:`UnknownNameError` lists the valid names."""
    if name not in BENCHMARKS:
        raise _unknown("benchmark", name, BENCHMARKS)
    return BENCHMARKS[name]


def get_strategy(name: str) -> StrategySpec:
    """The strategy called ``name``; :class:`UnknownNameError` lists the valid names."""
    if name not in STRATEGIES:
        raise _unknown("strategy", name, STRATEGIES)
    return STRATEGIES[name]
