"""A small synthetic task sequence in the format of the runner's real ones, shared by the tests
of the strategies and the runner (no data set needed)."""

from __future__ import annotations

import torch
from fromp_bench.data import TaskSequence, split_tasks
from torch import Tensor


def synthetic_split(
    *,
    n_tasks: int = 3,
    classes_per_task: int = 2,
    input_shape: tuple[int, ...] = (1, 28, 28),
    n_train: int = 64,
    n_test: int = 32,
    multi_head: bool = True,
    seed: int = 0,
) -> TaskSequence:
    """A small, learnable synthetic sequence in the format of the real ones.

    Each class is a random prototype image plus noise, clipped to [0, 1].
    """
    g = torch.Generator().manual_seed(seed)
    n_classes = n_tasks * classes_per_task
    protos = torch.rand(n_classes, *input_shape, generator=g)

    def draw(n: int) -> tuple[Tensor, Tensor]:
        y = torch.arange(n) % n_classes
        x = (protos[y] + 0.3 * torch.randn(n, *input_shape, generator=g)).clamp(0, 1)
        return x, y

    xtr, ytr = draw(n_train * n_tasks)
    xte, yte = draw(n_test * n_tasks)
    groups = [list(range(s, s + classes_per_task)) for s in range(0, n_classes, classes_per_task)]
    tasks = split_tasks(xtr, ytr, xte, yte, groups)
    return TaskSequence("synthetic", tasks, multi_head, tuple(input_shape), classes_per_task)
