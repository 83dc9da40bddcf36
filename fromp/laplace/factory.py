"""The :func:`Laplace` factory: laplace-torch's ``Laplace(model, likelihood,
subset_of_weights, hessian_structure, **kwargs)``, one class per (subset, structure):

* ``"all"``: ``"diag"`` :class:`~fromp.laplace.structures.LaplaceDiag`, ``"kron"``
  :class:`~fromp.laplace.structures.KronLaplace`, ``"full"``
  :class:`~fromp.laplace.structures.LaplaceFull`, ``"lowrank"``
  :class:`~fromp.laplace.lowrank.LowRankLaplace`;
* ``"last_layer"``: ``"diag"`` / ``"kron"`` / ``"full"``: ``DiagLLLaplace``,
  ``KronLLLaplace``, ``FullLLLaplace`` (:mod:`fromp.laplace.lastlayer`);
* ``"subnetwork"``: ``"diag"`` / ``"full"``: :class:`~fromp.laplace.subnet.DiagSubnetLaplace`,
  :class:`~fromp.laplace.subnet.FullSubnetLaplace`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fromp.laplace.base import STRUCTURES, SUBSETS, BaseLaplace
from fromp.laplace.functional import FunctionalLaplace
from fromp.laplace.lastlayer import DiagLLLaplace, FullLLLaplace, KronLLLaplace
from fromp.laplace.lowrank import LowRankLaplace
from fromp.laplace.options import option
from fromp.laplace.structures import KronLaplace, LaplaceDiag, LaplaceFull
from fromp.laplace.subnet import DiagSubnetLaplace, FullSubnetLaplace
from fromp.likelihood import Likelihood

__all__ = ["Laplace"]


_CLASSES = {
    ("all", "diag"): LaplaceDiag,
    ("all", "full"): LaplaceFull,
    ("all", "kron"): KronLaplace,
    ("last_layer", "diag"): DiagLLLaplace,
    ("last_layer", "full"): FullLLLaplace,
    ("last_layer", "kron"): KronLLLaplace,
    ("subnetwork", "diag"): DiagSubnetLaplace,
    ("subnetwork", "full"): FullSubnetLaplace,
    ("all", "lowrank"): LowRankLaplace,
}


def Laplace(
    model: nn.Module,
    likelihood: str | Likelihood,
    subset_of_weights: str = "last_layer",
    hessian_structure: str = "kron",
    **kwargs: Any,
) -> BaseLaplace:
    """A fitted-Laplace object in laplace-torch's words: ``Laplace(model, "classification",
    subset_of_weights="last_layer", hessian_structure="kron")`` (laplace-torch's defaults),
    then ``.fit(train_loader)``, ``.optimize_prior_precision()``, ``la(x)``.

    ``subset_of_weights``: ``"all"``, ``"last_layer"`` (the last ``nn.Linear``, whose
    output must be the model's) or ``"subnetwork"`` (``subnetwork_indices=`` a 1-D
    ``torch.long`` tensor of indices into ``parameters_to_vector(model.parameters())``:
    :class:`fromp.laplace.subnet.SubnetLaplace`). ``hessian_structure``: ``"diag"``,
    ``"kron"``, ``"full"`` or, for all weights, ``"lowrank"`` (``low_rank=k`` top GGN
    eigenpairs: :class:`fromp.laplace.lowrank.LowRankLaplace`); a subnetwork takes
    ``"full"`` or ``"diag"``. Keyword arguments: those of :class:`BaseLaplace`
    (``sigma_noise``, ``prior_precision``, ``prior_mean``, ``temperature``,
    ``chunk_size``, ...) and of the class chosen. laplace-torch's enums are accepted for
    every option; ``damping`` (Kronecker) only as False (fromp uses the exact eigenvalues of
    the Kronecker sum); ``hessian_structure="gp"`` is
    :class:`fromp.laplace.functional.FunctionalLaplace`."""
    subset_of_weights, hessian_structure = option(subset_of_weights), option(hessian_structure)
    approx = option(kwargs.pop("functional_approximation", "sod"))
    if approx != "sod":
        raise ValueError(f"functional_approximation={approx!r} is not supported: fromp offers the "
                         "subset-of-data GP ('sod', FunctionalLaplace)")  # fmt: skip
    if hessian_structure == "gp":
        if subset_of_weights != "all":
            raise ValueError("hessian_structure='gp' (FunctionalLaplace) needs "
                             "subset_of_weights='all'")  # fmt: skip
        return FunctionalLaplace(model, likelihood, **kwargs)
    if "damping" in kwargs:
        damping = kwargs.pop("damping")
        if hessian_structure != "kron":
            raise ValueError("damping is for hessian_structure='kron' (laplace-torch's)")
        if damping:
            raise ValueError(
                "damping=True is not supported: fromp's Kronecker posterior uses the exact "
                "eigenvalues of G / (s^2 T) + delta I (damping=False)"
            )
    if subset_of_weights not in SUBSETS:
        raise ValueError(f"subset_of_weights must be one of {SUBSETS}, got {subset_of_weights!r}")
    if hessian_structure not in STRUCTURES:
        raise ValueError(
            f"hessian_structure must be one of {STRUCTURES}, got {hessian_structure!r}"
        )
    if subset_of_weights != "last_layer":
        for key in ("last_layer_name", "feature_reduction"):
            if kwargs.get(key) is not None:
                raise ValueError(f"{key} is for subset_of_weights='last_layer'")
            kwargs.pop(key, None)
    if subset_of_weights != "subnetwork" and "subnetwork_indices" in kwargs:
        raise ValueError("subnetwork_indices is for subset_of_weights='subnetwork'")
    cls = _CLASSES.get((subset_of_weights, hessian_structure))
    if cls is None:
        supported = ", ".join(f"({s!r}, {h!r})" for s, h in _CLASSES)
        raise ValueError(
            f"subset_of_weights={subset_of_weights!r} with hessian_structure="
            f"{hessian_structure!r} is not available; supported: {supported}"
        )
    return cls(model, likelihood, **kwargs)
