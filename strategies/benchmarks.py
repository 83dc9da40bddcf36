"""An Avalanche experience's dataset as tensors (what the method objects consume)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader

__all__ = ["experience_tensors"]


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
