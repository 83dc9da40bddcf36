"""The :func:`Laplace` factory: laplace-torch's ``Laplace(model, likelihood,
subset_of_weights, hessian_structure, **kwargs)``. Each class of the package names the pair it
implements in its ``_key`` (laplace-torch's convention), and the factory builds the class of
the pair given; the arguments are the class's own, checked by it."""

from __future__ import annotations

from typing import Any

from torch import nn

import fromp.laplace.functional
import fromp.laplace.lastlayer
import fromp.laplace.lowrank
import fromp.laplace.structures
import fromp.laplace.subnet  # noqa: F401
from fromp.laplace.base import BaseLaplace
from fromp.laplace.options import option
from fromp.likelihood import Likelihood

__all__ = ["Laplace", "laplace_classes"]


def laplace_classes() -> dict[tuple[str, str], type[BaseLaplace]]:
    """``{(subset_of_weights, hessian_structure): class}`` over every subclass of
    :class:`~fromp.laplace.base.BaseLaplace` that sets its own ``_key`` (the package imports
    every structure's module before this one is used)."""
    found, todo = {}, [BaseLaplace]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.__dict__.get("_key") is not None:
            found[cls._key] = cls
    return found


def Laplace(
    model: nn.Module,
    likelihood: str | Likelihood,
    subset_of_weights: str = "last_layer",
    hessian_structure: str = "kron",
    *,
    functional_approximation: str = "sod",
    **kwargs: Any,
) -> BaseLaplace:
    """A Laplace object in laplace-torch's words: ``Laplace(model, "classification",
    subset_of_weights="last_layer", hessian_structure="kron")`` (laplace-torch's defaults),
    then ``.fit(train_loader)``, ``.optimize_prior_precision()``, ``la(x)``.

    Builds the class whose ``_key`` is ``(subset_of_weights, hessian_structure)``
    (:func:`laplace_classes`): ``"all"`` with ``"diag"`` / ``"kron"`` / ``"full"`` /
    ``"lowrank"`` / ``"gp"`` (:class:`DiagLaplace`, :class:`KronLaplace`,
    :class:`FullLaplace`, :class:`LowRankLaplace`, :class:`FunctionalLaplace`),
    ``"last_layer"`` with ``"diag"`` / ``"kron"`` / ``"full"`` / ``"gp"``
    (:class:`DiagLLLaplace`, ...), ``"subnetwork"`` with ``"diag"`` / ``"full"``
    (:class:`DiagSubnetLaplace`, :class:`FullSubnetLaplace`, ``subnetwork_indices=``).
    laplace-torch's enums are accepted for every option. ``functional_approximation``: the
    subset-of-data GP (``"sod"``) only. Keyword arguments go to the class."""
    subset_of_weights, hessian_structure = option(subset_of_weights), option(hessian_structure)
    approx = option(functional_approximation)
    if approx != "sod":
        raise ValueError(f"functional_approximation={approx!r} is not supported: fromp offers the "
                         "subset-of-data GP ('sod', FunctionalLaplace)")  # fmt: skip
    classes = laplace_classes()
    cls = classes.get((subset_of_weights, hessian_structure))
    if cls is None:
        supported = ", ".join(f"({s!r}, {h!r})" for s, h in sorted(classes))
        raise ValueError(
            f"subset_of_weights={subset_of_weights!r} with hessian_structure="
            f"{hessian_structure!r} is not available; supported: {supported}"
        )
    return cls(model, likelihood, **kwargs)
