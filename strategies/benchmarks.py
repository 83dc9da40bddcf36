"""An Avalanche experience's dataset as tensors (what the method objects consume), and the
Avalanche baselines the benchmark runner builds beside fromp's strategies."""

from __future__ import annotations

import copy
from typing import Any

import torch
from avalanche.core import SupervisedPlugin
from avalanche.training.plugins import LwFPlugin, ReplayPlugin
from avalanche.training.templates import SupervisedTemplate
from torch import Tensor, nn
from torch.utils.data import DataLoader

__all__ = ["ExperienceReplay", "LwFStatePlugin", "LwFStrategy", "ReplayBufferPlugin",
           "experience_tensors"]  # fmt: skip


def experience_tensors(
    dataset: Any, batch_size: int = 2048, *, eval_transforms: bool = True
) -> tuple[Tensor, Tensor, Tensor]:
    """All ``(x [N, ...], y [N], task_labels [N])`` of an Avalanche dataset (or any dataset of
    ``(x, y[, t])`` tuples; its ``collate_fn`` used when it has one) as three tensors in
    dataset order; labels and task labels ``long``, task labels 0 when it has none.
    ``eval_transforms``: the dataset's evaluation transforms (``dataset.eval()``) when it has
    them; False keeps it as it is (its training transforms)."""
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


class ReplayBufferPlugin(ReplayPlugin):
    """Avalanche's ``ReplayPlugin`` over an ``ExperienceBalancedBuffer`` whose buffer can be
    saved and restored (``state_dict`` / ``load_state_dict``: per experience, the kept
    examples as tensors and their reservoir weights), so that a run resumed from a
    checkpoint replays the same examples."""

    def state_dict(self) -> dict[str, Any]:
        policy = self.storage_policy
        groups = {}
        for key, group in policy.buffer_groups.items():
            x, y, t = experience_tensors(group.buffer, eval_transforms=False)
            weights, size = group._buffer_weights.clone(), int(group.max_size)
            groups[int(key)] = {"x": x, "y": y, "t": t, "weights": weights, "max_size": size}
        return {"num_exps": int(policy._num_exps), "groups": groups}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from avalanche.benchmarks.utils import _make_taskaware_tensor_classification_dataset
        from avalanche.training.storage_policy import ReservoirSamplingBuffer

        policy = self.storage_policy
        policy.buffer_groups = {}
        for key, g in sorted(state["groups"].items()):
            group = ReservoirSamplingBuffer(g["max_size"])
            group.buffer = _make_taskaware_tensor_classification_dataset(
                g["x"], g["y"], task_labels=g["t"].tolist(), targets=g["y"].tolist()
            )
            group._buffer_weights = g["weights"].clone()
            policy.buffer_groups[int(key)] = group
        policy._num_exps = int(state["num_exps"])

    def after_training_exp(self, strategy: Any, **kwargs: Any) -> None:
        """The buffer takes the experience just trained (as Avalanche's ``ReplayPlugin``)."""
        self.storage_policy.post_adapt(strategy, strategy.experience)


class _PluginStrategy(SupervisedTemplate):
    """Avalanche's supervised template with one method plugin first (cross-entropy when no
    criterion is given); the baselines below build their plugin and pass it here."""

    def __init__(
        self, *, plugin: SupervisedPlugin, plugins: list[Any] | None = None, **kwargs: Any
    ):
        kwargs["criterion"] = kwargs.get("criterion") or nn.CrossEntropyLoss()
        super().__init__(plugins=[plugin, *(plugins or [])], **kwargs)


class ExperienceReplay(_PluginStrategy):
    """Avalanche's replay with ``mem_per_experience`` (default 200, S-FSVI's) random examples
    of each experience kept (an ``ExperienceBalancedBuffer`` without adaptive size), the
    memory FROMP takes with ``n_points=mem_per_experience`` (Avalanche's ``Replay(mem_size=m)``
    splits ``m`` over the experiences seen). Each mini-batch is joined by ``batch_size_mem``
    (None: ``train_mb_size``) buffer examples; the other keyword arguments are Avalanche's."""

    def __init__(
        self,
        *,
        mem_per_experience: int = 200,
        n_experiences: int = 5,
        batch_size_mem: int | None = None,
        **kwargs: Any,
    ) -> None:
        from avalanche.training.storage_policy import ExperienceBalancedBuffer

        sizes = (("mem_per_experience", mem_per_experience), ("n_experiences", n_experiences))
        for name, v in sizes:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        size = mem_per_experience * n_experiences
        buffer = ExperienceBalancedBuffer(size, adaptive_size=False, num_experiences=n_experiences)
        plugin = ReplayBufferPlugin(size, batch_size_mem=batch_size_mem, storage_policy=buffer)
        super().__init__(plugin=plugin, **kwargs)
        self.mem_per_experience = mem_per_experience


class LwFStatePlugin(LwFPlugin):
    """Avalanche's ``LwFPlugin`` whose state (the previous model's weights, the classes seen
    per task, the experience count) can be saved and restored, for checkpoints."""

    def __init__(self, model: nn.Module, alpha: float = 1.0, temperature: float = 2.0) -> None:
        super().__init__(alpha=alpha, temperature=temperature)
        self._model = model  # the architecture a restored previous model is built from

    def state_dict(self) -> dict[str, Any]:
        lwf = self.lwf
        prev = None if lwf.prev_model is None else lwf.prev_model.state_dict()
        classes = {int(k): sorted(int(c) for c in v) for k, v in lwf.prev_classes_by_task.items()}
        return {"expcount": int(lwf.expcount), "classes": classes, "prev_model": prev}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        lwf = self.lwf
        lwf.expcount = int(state["expcount"])
        lwf.prev_classes_by_task.clear()
        lwf.prev_classes_by_task.update({int(k): set(v) for k, v in state["classes"].items()})
        lwf.prev_model = None
        if state["prev_model"] is not None:
            lwf.prev_model = copy.deepcopy(self._model)
            lwf.prev_model.load_state_dict(state["prev_model"])


class LwFStrategy(_PluginStrategy):
    """Avalanche's LwF (``avalanche.training.LwF``: distillation of the previous model's
    softened outputs on the units of the classes seen, ``alpha * KL``) with a checkpointable
    plugin (:class:`LwFStatePlugin`); the same training as Avalanche's ``LwF``. Keyword
    arguments: ``alpha``, ``temperature`` and Avalanche's ``SupervisedTemplate`` ones."""

    def __init__(self, *, alpha: float = 1.0, temperature: float = 2.0, **kwargs: Any) -> None:
        plugin = LwFStatePlugin(kwargs["model"], alpha=alpha, temperature=temperature)
        super().__init__(plugin=plugin, **kwargs)
