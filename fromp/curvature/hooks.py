"""Forward hooks for the length of a ``with`` block: what every capture of layer inputs or
outputs in fromp (layer capture, last-layer features, leave-one-out recording, the probes of
the checks) registers and removes the same way."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

__all__ = ["forward_hooks"]


@contextmanager
def forward_hooks(
    modules: Iterable[nn.Module], hook: Callable[[nn.Module, Any, Any], Any]
) -> Iterator[None]:
    """``hook(module, inputs, output)`` registered as a forward hook on every module of
    ``modules`` inside the block (a hook that returns a value replaces the module's
    output, as in :meth:`torch.nn.Module.register_forward_hook`); all are removed on exit,
    also after an error."""
    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
