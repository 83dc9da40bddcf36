r"""laplace-torch 0.3's ``marglik_training`` (Immer et al. 2021, "Scalable marginal
likelihood estimation for model selection in deep learning", Algorithm 1): the network's
weights and the hyperparameters (prior precision ``delta``, regression noise ``s``) trained
together.

Each epoch takes optimiser steps on the network over ``train_loader`` with the loss

    ``mean_n l(f(x_n), y_n) + (w^T diag(delta) w) / (2 N c)``,

``l`` the cross-entropy (``c = T``) or the squared error averaged over outputs (``c = T / (2
s^2)``), ``delta`` and ``s`` held fixed. Every ``marglik_frequency``-th epoch after
``n_epochs_burnin``, an all-weights :func:`fromp.Laplace` is fitted at the current weights
and ``n_hypersteps`` Adam steps (rate ``lr_hyp``) are taken on ``log delta`` (and ``log s``
unless ``fix_sigma_noise``) to maximise its evidence. The weights with the best evidence
are restored at the end, and the Laplace refitted there.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import parameters_to_vector

from fromp._checks import check_positive
from fromp.laplace.base import BaseLaplace
from fromp.laplace.factory import Laplace
from fromp.laplace.options import check_backend, option

__all__ = ["marglik_training"]


def _batch(data: Any, key_x: str, key_y: str, device: torch.device) -> tuple[Any, Tensor]:
    """``(model input, y)``: a mapping batch is the model's input as a whole (laplace-torch's),
    its targets at ``key_y``."""
    if isinstance(data, Mapping):
        for key in (key_x, key_y):
            if key not in data:
                name = "dict_key_x" if key == key_x else "dict_key_y"
                raise ValueError(f"a mapping batch of train_loader lacks {name}={key!r} (keys: "
                                 f"{list(data)})")  # fmt: skip
        return data, data[key_y].to(device)
    x, y = data[0], data[1]
    return x.to(device), y.to(device)


def _forward(model: nn.Module, x: Any) -> Tensor:
    """``model(x)``; a model that cannot take a mapping batch is named."""
    if not isinstance(x, Mapping):
        return model(x)
    try:
        return model(x)
    except (TypeError, IndexError, KeyError) as err:
        raise ValueError("the model cannot be called on train_loader's mapping batches: as in "
                         "laplace-torch it is called on the whole mapping (its forward reads "
                         f"the inputs at dict_key_x): {err}") from err  # fmt: skip


def _count(train_loader: Any, key_x: str, key_y: str) -> int:
    """``N``: ``len(train_loader.dataset)`` or the examples of a list of batches."""
    dataset = getattr(train_loader, "dataset", None)
    if dataset is not None:
        return len(dataset)
    return sum(len(_batch(b, key_x, key_y, torch.device("cpu"))[1]) for b in train_loader)


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def marglik_training(
    model: nn.Module,
    train_loader: Any,
    likelihood: str = "classification",
    hessian_structure: str = "kron",
    backend: Any = None,
    optimizer_cls: type[torch.optim.Optimizer] = torch.optim.Adam,
    optimizer_kwargs: dict[str, Any] | None = None,
    scheduler_cls: Any = None,
    scheduler_kwargs: dict[str, Any] | None = None,
    n_epochs: int = 300,
    lr_hyp: float = 1e-1,
    prior_structure: str = "layerwise",
    n_epochs_burnin: int = 0,
    n_hypersteps: int = 10,
    marglik_frequency: int = 1,
    prior_prec_init: float = 1.0,
    sigma_noise_init: float = 1.0,
    temperature: float = 1.0,
    fix_sigma_noise: bool = False,
    progress_bar: bool = False,
    enable_backprop: bool = False,
    dict_key_x: str = "input_ids",
    dict_key_y: str = "labels",
) -> tuple[BaseLaplace, nn.Module, list[float], list[float]]:
    """Train ``model`` and its hyperparameters by the Laplace evidence (module docstring).

    Arguments are laplace-torch's (``backend``: ``None`` or a GGN backend, fromp's exact
    GGN; ``scheduler_cls`` is stepped after every batch; ``progress_bar`` shows nothing).
    The network trains in the mode it is given; the first Laplace fit leaves it in eval mode
    (as laplace-torch's does). ``train_loader`` needs ``len(train_loader.dataset)`` or is a
    list of ``(x, y)`` batches or of mappings (the model is called on the whole mapping, its
    targets at ``dict_key_y``, as in laplace-torch). ``n_epochs``, ``marglik_frequency`` and
    ``n_hypersteps`` must be ints ``>= 1``, ``prior_prec_init``, ``sigma_noise_init``,
    ``temperature`` and ``lr_hyp`` positive numbers, and ``train_loader`` not empty: each is
    refused, naming it, before any step.

    Returns:
        ``(la, model, margliks, losses)``: the Laplace fitted at the best weights (with the
        best hyperparameters), the model holding them, the negative log evidence after every
        hyperparameter step, and the training loss per epoch (per example).
    """
    likelihood, hessian_structure = option(likelihood), option(hessian_structure)
    prior_structure = option(prior_structure)
    if likelihood not in ("classification", "regression"):
        raise ValueError(f"likelihood must be 'classification' or 'regression', got "
                         f"{likelihood!r}")  # fmt: skip
    if prior_structure not in ("scalar", "layerwise", "diag"):
        raise ValueError(f"prior_structure must be 'scalar', 'layerwise' or 'diag', got "
                         f"{prior_structure!r}")  # fmt: skip
    check_backend(backend, None)
    for value, name in ((n_epochs, "n_epochs"), (marglik_frequency, "marglik_frequency"),
                        (n_hypersteps, "n_hypersteps")):  # fmt: skip
        _positive_int(value, name)
    if n_epochs_burnin != 0:
        _positive_int(n_epochs_burnin, "n_epochs_burnin")
    prior_prec_init = check_positive(prior_prec_init, "prior_prec_init")
    sigma_noise_init = check_positive(sigma_noise_init, "sigma_noise_init")
    temperature = check_positive(temperature, "temperature")
    lr_hyp = check_positive(lr_hyp, "lr_hyp")
    optimizer_kwargs = dict(optimizer_kwargs or {})
    if optimizer_kwargs.get("weight_decay"):
        raise ValueError("optimizer_kwargs weight_decay must be 0: the prior precision is the "
                         "weight decay, and it is learnt")  # fmt: skip
    ref = next(model.parameters())
    device, dtype = ref.device, ref.dtype
    n = _count(train_loader, dict_key_x, dict_key_y)
    if n == 0:
        raise ValueError("train_loader is empty: expected at least one batch of examples")
    trainable = [p for p in model.parameters() if p.requires_grad]
    sizes = torch.tensor([p.numel() for p in trainable], device=device)
    n_shapes = {"scalar": 1, "layerwise": len(trainable), "diag": int(sizes.sum())}
    log_delta = torch.full((n_shapes[prior_structure],), math.log(temperature * prior_prec_init),
                           device=device, dtype=dtype, requires_grad=True)  # fmt: skip
    hypers = [log_delta]
    regression = likelihood == "regression"
    log_sigma = torch.full((1,), math.log(sigma_noise_init), device=device, dtype=dtype,
                           requires_grad=True)  # fmt: skip
    if regression:
        hypers.append(log_sigma)
    criterion = nn.MSELoss() if regression else nn.CrossEntropyLoss()
    optimizer = optimizer_cls(model.parameters(), **optimizer_kwargs)
    scheduler = None
    if scheduler_cls is not None:
        scheduler = scheduler_cls(optimizer, **(scheduler_kwargs or {}))
    hyper_optimizer = torch.optim.Adam(hypers, lr=lr_hyp)

    def expand(prior_precision: Tensor) -> Tensor:
        if len(prior_precision) == 1:
            return prior_precision.expand(int(sizes.sum()))
        if len(prior_precision) == int(sizes.sum()):
            return prior_precision
        return torch.repeat_interleave(prior_precision, sizes)

    def sigma_now() -> float | Tensor:
        if not regression:
            return 1.0
        return sigma_noise_init if fix_sigma_noise else log_sigma.exp()

    common = {"temperature": temperature, "subset_of_weights": "all",
              "dict_key_x": dict_key_x, "dict_key_y": dict_key_y}  # fmt: skip
    best, best_state, best_delta, best_sigma = math.inf, None, None, None
    losses: list[float] = []
    margliks: list[float] = []
    for epoch in range(1, n_epochs + 1):
        epoch_loss = 0.0
        for data in train_loader:
            x, y = _batch(data, dict_key_x, dict_key_y, device)
            optimizer.zero_grad()
            s = sigma_now()
            s = s.detach() if isinstance(s, Tensor) else s
            factor = temperature / (2 * s**2) if regression else temperature
            theta = parameters_to_vector([p for p in model.parameters() if p.requires_grad])
            delta = expand(log_delta.detach().exp())
            loss = criterion(_forward(model, x), y) + 0.5 * (delta * theta) @ theta / n / factor
            loss.backward()
            optimizer.step()
            epoch_loss += float(loss.detach()) * len(y)
            if scheduler is not None:
                scheduler.step()
        losses.append(epoch_loss / n)
        if epoch % marglik_frequency != 0 or epoch < n_epochs_burnin:
            continue
        s = sigma_now()
        la = Laplace(model, likelihood, hessian_structure=hessian_structure,
                     sigma_noise=float(s) if regression else None,
                     prior_precision=log_delta.detach().exp(), **common)  # fmt: skip
        model.eval()
        la.fit(train_loader)
        for _ in range(n_hypersteps):
            hyper_optimizer.zero_grad()
            s = log_sigma.exp() if regression and not fix_sigma_noise else None
            delta = log_delta.exp()
            neg = -la.log_marginal_likelihood(delta, s)
            neg.backward()
            hyper_optimizer.step()
            margliks.append(float(neg.detach()))
        if margliks[-1] < best:
            best, best_state = margliks[-1], copy.deepcopy(model.state_dict())
            best_delta = delta.detach().clone()
            best_sigma = (float(s.detach()) if s is not None else
                          (sigma_noise_init if regression else None))  # fmt: skip
    if best_state is not None:
        model.load_state_dict(best_state)
        delta, s = best_delta, best_sigma
    else:
        delta = log_delta.detach().exp()
        s = float(sigma_now()) if regression else None
    la = Laplace(model, likelihood, hessian_structure=hessian_structure, sigma_noise=s,
                 prior_precision=delta, enable_backprop=enable_backprop, **common)  # fmt: skip
    model.eval()
    la.fit(train_loader)
    return la, model, margliks, losses
