"""Save a strategy mid-stream in a user's own Avalanche loop and resume it exactly.

One file holds everything the next experience depends on: the model's ``state_dict``
(with an Avalanche dynamic module's grown heads and masks), the optimizer's state, the
state of every method plugin of :mod:`strategies` (FROMP's memorable sets and GGN terms,
EWC's anchors and Fisher, VCL's priors), the number of experiences trained, and the RNG
states (Python, NumPy, torch CPU and every CUDA device) that drive shuffling and sampling.

Usage::

    for i, exp in enumerate(stream):
        if i < start:
            continue
        strategy.train(exp)
        save_checkpoint(strategy, "ckpt.pt", experiences_done=i + 1)

    # later, in a fresh process, with the strategy built as before:
    start = load_checkpoint(strategy, "ckpt.pt", stream)

Loading reads the file on the CPU (``map_location="cpu"``, so a GPU checkpoint opens on a
machine without one) and then moves each tensor to where it belongs: the model's and the
optimizer's state into the model's device, the method's into the model's device.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["get_rng_state", "load_checkpoint", "save_checkpoint", "set_rng_state"]


def get_rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU and all CUDA generators' states."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),  # noqa: NPY002 (the global state users seed)
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`get_rng_state` (CUDA states only where CUDA is available and the
    device count matches; a CPU-only checkpoint leaves CUDA generators as they are)."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])  # noqa: NPY002
    torch.set_rng_state(state["torch"].cpu())
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available():
        if len(cuda) != torch.cuda.device_count():
            raise ValueError(
                f"checkpoint holds RNG states of {len(cuda)} CUDA devices, this machine has "
                f"{torch.cuda.device_count()}"
            )
        torch.cuda.set_rng_state_all([s.cpu() for s in cuda])


def _method_plugins(strategy: Any) -> list[Any]:
    """The strategy's plugins from :mod:`strategies` that carry state."""
    return [
        p
        for p in strategy.plugins
        if type(p).__module__.startswith("strategies.")
        and callable(getattr(type(p), "state_dict", None))
        and callable(getattr(type(p), "load_state_dict", None))
    ]


def save_checkpoint(strategy: Any, path: str | os.PathLike, *, experiences_done: int) -> None:
    """Write ``strategy``'s full state after ``experiences_done`` experiences to ``path``
    (written to a temporary file, then renamed: an interrupted save leaves the old file)."""
    if experiences_done < 0:
        raise ValueError(f"experiences_done must be >= 0, got {experiences_done}")
    state = {
        "experiences_done": int(experiences_done),
        "model": strategy.model.state_dict(),
        "optimizer": strategy.optimizer.state_dict(),
        "plugins": [
            {"class": type(p).__qualname__, "state": p.state_dict()}
            for p in _method_plugins(strategy)
        ],
        "rng": get_rng_state(),
    }
    tmp = f"{os.fspath(path)}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(
    strategy: Any,
    path: str | os.PathLike,
    stream: Sequence[Any] | None = None,
    *,
    map_location: str | torch.device = "cpu",
) -> int:
    """Restore :func:`save_checkpoint` into a freshly built ``strategy`` (same model class,
    optimizer and method settings); returns the number of experiences already trained.

    ``stream`` (the training stream) is needed for models that grow (Avalanche dynamic
    modules): the model is first adapted to the experiences already trained, so that its
    parameters have the saved shapes. The file is read with ``map_location`` (default the
    CPU) and every tensor is then moved to the model's device.
    """
    state = torch.load(path, map_location=map_location, weights_only=False)
    done = int(state["experiences_done"])
    if stream is not None:
        if len(stream) < done:
            raise ValueError(
                f"stream has {len(stream)} experiences, the checkpoint was taken after {done}"
            )
        was_training = strategy.model.training
        strategy.model.train()  # Avalanche's masks record classes in training mode only
        for i in range(done):
            strategy.experience = stream[i]
            strategy.model = strategy.model_adaptation()
        strategy.model.train(was_training)
        strategy.experience = None
    strategy.model.load_state_dict(state["model"])
    # Avalanche's first make_optimizer maps names to parameters and clears the state: do it
    # now, so that the state loaded next survives the next experience's update
    strategy.optimized_param_id = None
    if hasattr(strategy, "make_optimizer"):
        strategy.make_optimizer(reset_optimizer_state=True)
    strategy.optimizer.load_state_dict(state["optimizer"])
    plugins = _method_plugins(strategy)
    saved = state["plugins"]
    if [type(p).__qualname__ for p in plugins] != [d["class"] for d in saved]:
        raise ValueError(
            f"checkpoint holds the state of plugins {[d['class'] for d in saved]}, the "
            f"strategy has {[type(p).__qualname__ for p in plugins]}"
        )
    device = next(strategy.model.parameters()).device
    for p, d in zip(plugins, saved):
        if "device" in _kwargs(p.load_state_dict):
            p.load_state_dict(d["state"], device=device)
        else:
            p.load_state_dict(d["state"])
    set_rng_state(state["rng"])
    return done


def _kwargs(fn: Any) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()
