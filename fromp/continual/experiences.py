"""Which experiences a continual method has learnt: the one bookkeeping of FROMP's and EWC's
experience keys and their task counter.

A method keeps one entry per learnt experience (:class:`~fromp.continual.methods.FROMPMethod`:
a memorable set and a GGN term; :class:`~fromp.continual.ewc.EWCMethod`: an anchor and a
Fisher) and a list ``experiences`` of the entries' keys, in the same order. Learning a key
again replaces its entry instead of adding a second one. A ``learn_task`` call goes through
three steps:

1. :func:`experience_key`: the call's key, checked (an int), or the next one after every
   key learnt so far (``max(experiences) + 1``, ``0`` first) when none is given;
2. :func:`forget_experience`: a key learnt before is taken out of ``experiences``, and its
   old position is returned so that the method drops the entry at that position from its
   own lists;
3. :func:`add_experience`: the key is appended; the returned length of ``experiences`` is
   the method's ``task_count`` (experiences learnt, a re-learnt one counted once).
"""

from __future__ import annotations

import operator

__all__ = ["add_experience", "experience_key", "forget_experience"]


def experience_key(experiences: list[int], experience: object = None) -> int:
    """``experience`` as an int key (``ValueError`` naming it otherwise, bools included), or
    ``max(experiences) + 1`` (``0`` for the first) when it is None."""
    if experience is None:
        return max(experiences, default=-1) + 1
    try:
        if isinstance(experience, bool):
            raise TypeError
        return operator.index(experience)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"experience must be an int key or None, got {experience!r}") from None


def forget_experience(experiences: list[int], experience: int) -> int | None:
    """Take ``experience`` out of ``experiences`` (in place) when it was learnt before and
    return its old position (the caller drops its entry there); None for a new key."""
    if experience not in experiences:
        return None
    i = experiences.index(experience)
    del experiences[i]
    return i


def add_experience(experiences: list[int], experience: int) -> int:
    """Append ``experience`` to ``experiences`` (in place); returns the task count, the
    number of keys learnt."""
    experiences.append(experience)
    return len(experiences)
