"""Turn a :class:`fromp.data.TaskSequence` into an Avalanche benchmark."""

from __future__ import annotations

from avalanche.benchmarks.scenarios.dataset_scenario import benchmark_from_datasets
from avalanche.benchmarks.scenarios.generic_scenario import CLScenario
from avalanche.benchmarks.scenarios.supervised import with_classes_timeline
from avalanche.benchmarks.scenarios.task_aware import with_task_labels
from avalanche.benchmarks.utils import _make_taskaware_tensor_classification_dataset

from fromp.data import TaskSequence

__all__ = ["to_avalanche"]


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
