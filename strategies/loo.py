"""An Avalanche plugin recording the leave-one-out estimate of the current experience's
training set after every training epoch (:class:`fromp.memory.loo.LOOTracker`)."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from avalanche.core import SupervisedPlugin
from fromp_avalanche.benchmarks import experience_tensors
from torch import Tensor

from fromp.memory.loo import LOOTracker
from fromp.models import is_multitask, with_task


class LOOPlugin(SupervisedPlugin):
    """After each training epoch, estimate the leave-one-out NLL and accuracy of the
    experience's training examples and append ``{"experience", **record}`` to
    :attr:`history` (``record`` as :meth:`fromp.memory.loo.LOOTracker.__call__`).

    The posterior is the optimizer's own when it has one (IVON, VOGN; list this plugin after
    their plugins so that the mean is back in the model), else a last-layer Laplace with
    ``prior_precision`` (default: the optimizer's weight decay times ``N``).

    Args:
        recorded: estimate from the output layer's inputs recorded during the epoch's own
            forward passes (:meth:`fromp.memory.loo.LOOTracker.recording`): no extra pass over the
            data; with ``hessian_structure="kron"`` the whole estimate costs a few matrix
            products.
        tracker_kwargs: keyword arguments of :class:`~fromp.memory.loo.LOOTracker`
            (``prior_precision``, ``subset_of_weights``, ``hessian_structure``,
            ``max_examples``, ``likelihood``).
    """

    def __init__(self, *, recorded: bool = False, **tracker_kwargs: Any) -> None:
        super().__init__()
        self.tracker = LOOTracker(**tracker_kwargs)
        self.recorded = bool(recorded)
        self.history: list[dict[str, Any]] = []
        self._data: tuple[Tensor, Tensor, int] | None = None
        self._recording: ExitStack | None = None

    def before_training_epoch(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        if self.recorded:
            self._recording = ExitStack()
            self._recording.enter_context(self.tracker.recording(strategy.model))

    def after_forward(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        if self._recording is not None:
            self.tracker.observe(strategy.mb_y)

    def before_training_exp(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        x, y, t = experience_tensors(strategy.experience.dataset)
        tasks = t.unique()
        if len(tasks) != 1:
            raise ValueError(
                f"LOOPlugin needs experiences with one task label each, got {tasks.tolist()}"
            )
        self._data = (x, y, int(tasks[0]))

    def after_training_epoch(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        if self._data is None:
            return
        x, y, task = self._data
        model = strategy.model
        if is_multitask(model):  # the experience's head (Avalanche MultiTaskModule, fromp)
            model = with_task(model, task)
        if self._recording is not None:
            self._recording.close()
            self._recording = None
            rec = self.tracker(model, optimizer=strategy.optimizer)
        else:
            dev = strategy.device
            rec = self.tracker(model, x.to(dev), y.to(dev), strategy.optimizer)
        self.history.append({"experience": strategy.experience.current_experience, **rec})

    def after_training_exp(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        self._data = None
        if self._recording is not None:  # an epoch ended without after_training_epoch
            self._recording.close()
            self._recording = None
