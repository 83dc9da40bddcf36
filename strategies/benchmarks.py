"""Avalanche benchmarks from :class:`fromp.data.TaskSequence` and their datasets as tensors."""

from __future__ import annotations

from typing import Any

import torch
from avalanche.benchmarks.scenarios.dataset_scenario import benchmark_from_datasets
from avalanche.benchmarks.scenarios.generic_scenario import CLScenario
from avalanche.benchmarks.scenarios.supervised import with_classes_timeline
from avalanche.benchmarks.scenarios.task_aware import with_task_labels
from avalanche.benchmarks.utils import _make_taskaware_tensor_classification_dataset
from torch import Tensor
from torch.utils.data import DataLoader

from fromp.data import TaskSequence

__all__ = ["experience_tensors", "to_avalanche"]


def to_avalanche(seq: TaskSequence) -> CLScenario:
    """An Avalanche scenario with ``train_stream`` and ``test_stream``, one experience per
    task. Multi-head sequences carry task labels ``0..T-1`` (the head index); single-head
    ones (permuted MNIST) carry task label 0 everywhere."""
    if len(seq) == 0:
        raise ValueError(f"task sequence {seq.name!r} has no tasks")

    def make(x, y, t):
        label = t if seq.multi_head else 0
        return _make_taskaware_tensor_classification_dataset(
            x, y, task_labels=label, targets=y.tolist()
        )

    train = [make(t.train_x, t.train_y, t.task_id) for t in seq]
    test = [make(t.test_x, t.test_y, t.task_id) for t in seq]
    return with_classes_timeline(with_task_labels(benchmark_from_datasets(train=train, test=test)))


def experience_tensors(
    dataset: Any, batch_size: int = 2048, *, eval_transforms: bool = True
) -> tuple[Tensor, Tensor, Tensor]:
    """All ``(x [N, ...], y [N], task_labels [N])`` of an Avalanche dataset (or any dataset of
    ``(x, y[, t])`` tuples) as three tensors in dataset order; labels and task labels as
    ``long``, task labels 0 when the dataset has none.

    Args:
        dataset: the dataset; its ``collate_fn`` is used when it has one.
        batch_size: examples per loader batch.
        eval_transforms: use the dataset's evaluation transforms (``dataset.eval()``) when
            it has them; False keeps the dataset as it is (its training transforms).
    """
    if eval_transforms and hasattr(dataset, "eval"):
        dataset = dataset.eval()
    collate = getattr(dataset, "collate_fn", None)
    xs, ys, ts = [], [], []
    for batch in DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=collate):
        xs.append(batch[0])
        ys.append(batch[1])
        ts.append(batch[2] if len(batch) > 2 else torch.zeros_like(batch[1]))
    if not xs:
        raise ValueError("dataset is empty: expected at least one example")
    return torch.cat(xs), torch.cat(ys).long(), torch.cat(ts).long()
