"""Memorable past: the training examples that FROMP keeps to regularise later tasks.

FROMP (Pan et al., 2020) scores an example ``x`` by the trace of the output Hessian of the
loss at the trained network, ``tr Lambda(f(x))``; for a softmax likelihood this is
``sum_k p_k(x) (1 - p_k(x))``, large near the decision boundary. The examples with the
largest scores are the ones whose function values are most informative about the
boundary, so they are kept ("lambda descend"); ``"ascending"`` and ``"random"`` are the
paper's ablations. ``"sensitivity"`` ranks by the memory-perturbation sensitivity
``s_n = sum_k |e_nk lambda_nk v_nk|`` instead (Nickl et al., 2023; :mod:`fromp.memory.sensitivity`):
``tr Lambda`` weighted by how wrong the prediction is and how uncertain under a posterior.
Selection is balanced: the same number of examples per class.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from fromp import distributed
from fromp._checks import check_batch, check_tensor, not_on_meta, probe_outputs
from fromp.likelihood import Likelihood, get_likelihood
from fromp.posterior import DiagonalGaussian

__all__ = ["global_classes", "memorability_scores", "select_memorable"]

_ORDERS = ("descending", "ascending", "random", "sensitivity")


@torch.no_grad()
def memorability_scores(
    model: nn.Module,
    x: Tensor,
    likelihood: str | Likelihood = "categorical",
    *,
    batch_size: int = 1024,
) -> Tensor:
    """Memorability ``s_n = tr Lambda(f(x_n))`` of each example, shape ``[N]``.

    For ``"categorical"`` ``s_n = sum_k p_k (1 - p_k)`` with ``p = softmax(f(x_n))``; for
    ``"bernoulli"`` ``s_n = p (1 - p)``.

    Args:
        model: a module ``[B, ...] -> [B, C]`` (fix a multi-head model's head with
            :func:`fromp.models.with_task`). Its train/eval mode is left as it is.
        x: inputs ``[N, ...]`` (moved to the model's device batch by batch).
        likelihood: a :class:`~fromp.likelihood.Likelihood` or its name.
        batch_size: examples per forward pass.

    Returns:
        ``[N]`` scores on ``x``'s device, in the model's dtype.
    """
    check_batch(x, "x")
    not_on_meta(model)
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size}")
    lik = get_likelihood(likelihood)
    p = next(iter(model.parameters()), None)
    device = p.device if p is not None else x.device  # a model without parameters: x's
    out = []
    for s in range(0, len(x), batch_size):
        f = model(x[s : s + batch_size].to(device))
        out.append(lik.hessian_trace(f).to(x.device))
    return torch.cat(out)


def global_classes(y: Tensor) -> list[int]:
    """The sorted class labels present in ``y`` on any ``torch.distributed`` rank (those of
    ``y`` in a single process)."""
    local = sorted(int(c) for c in y.unique())
    return sorted(set().union(*distributed.gather(local)))


def select_memorable(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    likelihood: str | Likelihood = "categorical",
    n_per_class: int = 20,
    *,
    order: str = "descending",
    classes: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    batch_size: int = 1024,
    posterior: DiagonalGaussian | None = None,
    chunk_size: int = 64,
    points: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """A class-balanced memorable set: ``n_per_class`` examples of each class.

    Within each class ``c`` (examples with ``y == c``) the examples are ranked by
    :func:`memorability_scores` (``tr Lambda``): ``"descending"`` keeps the largest
    scores (FROMP's default), ``"ascending"`` the smallest, ``"random"`` a uniform draw
    without replacement (scores are not computed); ``"sensitivity"`` keeps the largest
    memory-perturbation sensitivities under ``posterior``
    (:func:`fromp.memory.sensitivity.memory_perturbation`; a Jacobian per example, chunks of
    ``chunk_size``: memory ``chunk_size * C * P``). Ties keep the data order.

    **Several processes.** When ``torch.distributed`` is initialised with more than one
    process, ``x`` and ``y`` are this rank's shard and the set is chosen over the data of
    every rank: the result, the same on every rank, is that of one process on the
    concatenation of the shards in rank order (ties keep that order). ``"descending"`` /
    ``"ascending"``: each rank scores its shard and keeps its best ``n_per_class`` per
    class; the candidates, their scores and their positions in the concatenation are
    gathered and the best ``n_per_class`` of each class kept (memory
    ``world_size * n_classes * n_per_class`` inputs). ``"random"`` and ``"sensitivity"``
    gather the shards themselves and select on the union (memory: the data of every rank;
    ``generator`` must be in the same state on every rank). The indices then point into the
    concatenation, which no rank holds: ask for ``points=True``.

    Args:
        model: ``[B, ...] -> [B, C]`` (see :func:`memorability_scores`).
        x: inputs ``[N, ...]`` (this rank's shard under ``torch.distributed``).
        y: class labels ``[N]``.
        likelihood: likelihood or its name, for the score.
        n_per_class: examples kept per class.
        order: ``"descending"``, ``"ascending"``, ``"random"`` or ``"sensitivity"``.
        classes: the classes to draw from, in output order (default: the sorted labels
            present in ``y``, on any rank).
        generator: RNG for ``order="random"``.
        batch_size: examples per forward pass.
        posterior: the weight posterior (mean: the model's weights), needed by
            ``order="sensitivity"`` only; the model must then be in eval mode.
        chunk_size: examples per Jacobian chunk for ``order="sensitivity"``.
        points: return the examples ``(x_mem, y_mem)`` instead of their indices.

    Returns:
        ``LongTensor [len(classes) * n_per_class]`` of indices into ``x`` (into the
        concatenation of every rank's ``x`` under ``torch.distributed``), grouped by class in
        the order of ``classes``, each group in rank order; with ``points=True``
        ``(x_mem [len(classes) * n_per_class, ...], y_mem [len(classes) * n_per_class])``,
        the examples at those indices, on ``x``'s and ``y``'s devices.

    Example:
        >>> import torch
        >>> net = torch.nn.Linear(2, 3)
        >>> x, y = torch.randn(30, 2), torch.arange(30) % 3
        >>> idx = select_memorable(net, x, y, n_per_class=4)
        >>> idx.shape, bool((y[idx] == torch.arange(3).repeat_interleave(4)).all())
        (torch.Size([12]), True)

    Raises:
        TypeError: ``x`` or ``y`` not a tensor.
        ValueError: empty data, NaN/inf inputs, mismatched ``y``, labels outside the model's
            outputs, unknown ``order``, or a class with fewer than ``n_per_class`` examples
            (on all ranks together).
    """
    check_batch(x, "x")
    not_on_meta(model)
    check_tensor(y, "y", f"[N]=[{len(x)}]")
    if y.ndim != 1 or len(y) != len(x):
        raise ValueError(f"y must be a [N] tensor with N={len(x)} labels, got {tuple(y.shape)}")
    if y.is_floating_point() or (len(y) and int(y.min()) < 0):
        raise ValueError("y must hold non-negative integer class labels")
    for name, p in model.named_parameters():
        if not bool(torch.isfinite(p).all()):
            raise ValueError(f"model weights {name} are not finite (NaN or inf)")
    if order not in _ORDERS:
        raise ValueError(f"order must be one of {_ORDERS}, got {order!r}")
    if not isinstance(n_per_class, int) or n_per_class < 1:
        raise ValueError(f"n_per_class must be a positive int, got {n_per_class!r}")
    if order == "sensitivity" and posterior is None:
        raise ValueError("posterior is required for order='sensitivity'")
    width = probe_outputs(model, x).shape[-1]  # two examples: a model may squeeze one
    if get_likelihood(likelihood).name == "bernoulli":
        width = max(width, 2)  # one logit, labels 0 and 1
    if len(y) and int(y.max()) >= width:
        raise ValueError(
            f"y must hold labels in [0, {width}) (the model's output units), got a label "
            f"{int(y.max())}"
        )
    cls = global_classes(y) if classes is None else [int(c) for c in classes]
    if len(cls) == 0:
        raise ValueError("classes is empty: expected at least one class")
    y_cpu = y.long().cpu()
    counts = torch.tensor([int((y_cpu == c).sum()) for c in cls], dtype=torch.long)
    distributed.all_reduce_sum([counts])  # every rank's examples (unchanged in one process)
    for c, k in zip(cls, counts.tolist()):
        if k < n_per_class:
            raise ValueError(f"class {c} has {k} examples, fewer than n_per_class={n_per_class}")
    xs, ys = x, y
    if distributed.is_distributed() and order in ("random", "sensitivity"):
        shards = distributed.gather((x.cpu(), y.cpu()), torch.device("cpu"))
        xs = torch.cat([s[0] for s in shards])
        ys = torch.cat([s[1] for s in shards])
        y_cpu = ys.long()
    members = [torch.nonzero(y_cpu == c).squeeze(1) for c in cls]
    if order == "random":
        picks = [
            idx[torch.randperm(len(idx), generator=generator)[:n_per_class]] for idx in members
        ]
        return _result(torch.cat(picks), xs, ys, x, y, points)
    if order == "sensitivity":
        from fromp.memory.sensitivity import memory_perturbation

        assert posterior is not None
        dev = next(model.parameters()).device
        mp = memory_perturbation(
            model, posterior, xs.to(dev), y_cpu.to(dev), likelihood, chunk_size=chunk_size
        )
        scores = mp.sensitivity.cpu()
    else:
        scores = memorability_scores(model, x, likelihood, batch_size=batch_size).cpu()
    descending = order != "ascending"
    picks = []
    for idx in members:
        rank = torch.sort(scores[idx], descending=descending, stable=True).indices
        picks.append(idx[rank[:n_per_class]])
    if order == "sensitivity" or not distributed.is_distributed():
        return _result(torch.cat(picks), xs, ys, x, y, points)
    # this rank's best n_per_class of each class, with their scores and global positions
    offset = sum(distributed.gather(len(x))[: distributed.rank()])
    mine = [
        (scores[k], k + offset, x[k.to(x.device)].cpu(), y[k.to(y.device)].cpu()) for k in picks
    ]
    everyone = distributed.gather(mine, torch.device("cpu"))
    idx_, xs_, ys_ = [], [], []
    for j in range(len(cls)):
        s = torch.cat([r[j][0] for r in everyone])
        pos = torch.cat([r[j][1] for r in everyone])
        by_pos = torch.argsort(pos)  # data order first, so that ties keep it
        take = by_pos[torch.sort(s[by_pos], descending=descending, stable=True).indices]
        take = take[:n_per_class]
        idx_.append(pos[take])
        xs_.append(torch.cat([r[j][2] for r in everyone])[take])
        ys_.append(torch.cat([r[j][3] for r in everyone])[take])
    if not points:
        return torch.cat(idx_)
    return torch.cat(xs_).to(x.device), torch.cat(ys_).to(y.device)


def _result(
    idx: Tensor, xs: Tensor, ys: Tensor, x: Tensor, y: Tensor, points: bool
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`select_memorable`'s answer: the indices ``idx`` into ``xs`` (``x`` itself, or
    every rank's shards gathered), or with ``points`` the examples, on ``x``'s and ``y``'s
    devices."""
    if not points:
        return idx
    return xs[idx.to(xs.device)].to(x.device), ys[idx.to(ys.device)].to(y.device)
