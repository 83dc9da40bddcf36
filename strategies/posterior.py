"""What the plugins that drive a posterior-keeping optimizer (:class:`fromp.optim.VOGN`,
:class:`fromp.optim.IVON`) share: the optimizer check, the per-experience posteriors and the
task counter, continual prior updates and checkpoints."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from avalanche.training.plugins import SupervisedPlugin

from fromp.continual.experiences import add_experience, experience_key, forget_experience
from fromp.posterior import DiagonalGaussian

__all__ = ["PosteriorOptimizerPlugin"]


class PosteriorOptimizerPlugin(SupervisedPlugin):
    """What the plugins driving a posterior-keeping optimizer (:class:`fromp_avalanche.vogn.
    VOGNPlugin`, :class:`fromp_avalanche.ivon.IVONPlugin`) share: the optimizer check, the
    per-experience posteriors and the task counter, continual prior updates and checkpoints.

    The optimizer keeps its state in torch's ``optimizer.state``, which Avalanche resets the
    first time a strategy trains (``make_optimizer(reset_optimizer_state=True)``): a loaded
    checkpoint is therefore loaded again at the start of the next experience
    (:meth:`before_training_exp`; a subclass that overrides it calls ``super()``).

    Subclasses set ``optimizer_class`` (e.g. :class:`fromp.optim.VOGN`) and ``state_key``
    (``"vogn"``: the key of the optimizer's state dict in the plugin's). ``task_count``:
    the distinct experiences learnt (an experience trained again replaces its posterior).

    Args:
        optimizer: the strategy's optimizer (also found as ``strategy.optimizer`` in the
            hooks; given here so that :meth:`state_dict` works before training).
        continual: at the end of each experience make the posterior the next prior.
    """

    optimizer_class: type
    state_key: str

    def __init__(self, optimizer: Any = None, *, continual: bool = True) -> None:
        super().__init__()
        self.optimizer = optimizer
        self.continual = bool(continual)
        self.posteriors: list[DiagonalGaussian] = []  # one per experience key, in order
        self.experiences: list[int] = []
        self.task_count = 0  # distinct experiences learnt
        self._resume: dict[str, Any] | None = None  # a loaded optimizer state, applied again

    def _opt(self, strategy: Any) -> Any:
        opt = strategy.optimizer
        if not isinstance(opt, self.optimizer_class):
            raise TypeError(
                f"{type(self).__name__} needs a fromp.optim.{self.optimizer_class.__name__} "
                f"optimizer, got {type(opt)}"
            )
        self.optimizer = opt
        return opt

    def _end_experience(
        self, strategy: Any, q: DiagonalGaussian, set_prior: Callable[[], Any]
    ) -> None:
        """Keep the experience's posterior ``q`` (replacing the one of the same experience
        key learnt before); with ``continual``, ``set_prior()`` makes it the next prior."""
        key = experience_key(self.experiences, strategy.experience.current_experience)
        i = forget_experience(self.experiences, key)
        if i is not None:
            del self.posteriors[i]
        self.posteriors.append(q)
        self.task_count = add_experience(self.experiences, key)
        if self.continual:
            set_prior()

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state dict (torch's: its per-parameter state and hyperparameters)
        under ``state_key``, the per-experience posteriors and the task counter (copies)."""
        if self.optimizer is None:
            raise ValueError(
                f"{type(self).__name__} has no optimizer yet: pass optimizer= or train first"
            )
        return {
            self.state_key: copy.deepcopy(self.optimizer.state_dict()),
            "posteriors": [
                {k: v.clone() for k, v in q.state_dict().items()} for q in self.posteriors
            ],
            "task_count": self.task_count,
            "experiences": list(self.experiences),
            "continual": self.continual,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Inverse of :meth:`state_dict`. The optimizer state is loaded now and again at the
        start of the next experience."""
        if self.optimizer is None:
            raise ValueError(
                f"{type(self).__name__} has no optimizer: construct it with optimizer="
            )
        missing = [k for k in (self.state_key, "posteriors", "task_count", "experiences",
                               "continual") if k not in state]  # fmt: skip
        if missing:
            raise ValueError(f"state is missing keys {missing}")
        self._resume = state[self.state_key]
        self._apply_resume()
        self.posteriors = [DiagonalGaussian.from_state_dict(d) for d in state["posteriors"]]
        self.task_count = int(state["task_count"])
        self.experiences = [int(k) for k in state["experiences"]]
        self.continual = bool(state["continual"])

    def _apply_resume(self) -> None:
        """Load the optimizer state of the last :meth:`load_state_dict` (a copy of it)."""
        if self._resume is not None and self.optimizer is not None:
            self.optimizer.load_state_dict(copy.deepcopy(self._resume))

    def before_training_exp(self, strategy: Any, *args: Any, **kwargs: Any) -> None:
        """After Avalanche's first reset of ``optimizer.state``: the loaded state again."""
        if self._resume is not None:
            self._opt(strategy)
            self._apply_resume()
            self._resume = None
