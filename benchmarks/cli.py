"""Command-line tools for trained networks: ``fromp-memorable`` and ``fromp-gp``.

Both read a checkpoint written by ``fromp-bench`` (``runs/<benchmark>/checkpoints/*.pt``),
rebuild the benchmark's network, and work on one task of the benchmark's data::

    fromp-memorable runs/split-mnist/checkpoints/fromp-seed0.pt --task 0 --n-per-class 10
    fromp-gp runs/split-mnist/checkpoints/fromp-seed0.pt --task 0 --n 100

``fromp-memorable`` writes ``memorable.json`` (indices into the task's training set, their
classes and scores) and ``memorable.png`` (a grid of the selected images per class); with
``--map`` also the task's memory map (:func:`write_memory_map`): ``memory_map.png``, each
training example's prediction error against its prediction variance under a diagonal
Laplace-GGN posterior, memorable points marked, and ``memory_map.json`` with the
per-example numbers (:mod:`fromp.sensitivity`).
``fromp-gp`` fits a diagonal Laplace-GGN posterior on the task's training data (the prior
precision chosen by the Laplace evidence unless given), converts the network into its DNN2GP
Gaussian process and writes ``gp.npz`` (GP mean, kernel ``[N, C, N, C]``, marginal variances and
predictive probabilities of ``--n`` test inputs sorted by class) and ``kernel.png``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from benchmarks.registry import STRATEGIES, UnknownNameError, get_benchmark
from fromp.data import CorruptDataError, DataNotFoundError, TaskSequence
from fromp.models import with_task

__all__ = ["gp_main", "load_trained", "memorable_main", "write_memory_map"]

warnings.filterwarnings("ignore", message="no QP solver found")


class CheckpointError(ValueError):
    """A file that is not a usable ``fromp-bench`` checkpoint."""


# Errors reported as one line with exit status 2.
_ERRORS = (CheckpointError, UnknownNameError, DataNotFoundError, CorruptDataError, ValueError)


def load_trained(
    path: str | Path, data_root: str | None = None
) -> tuple[nn.Module, TaskSequence, dict[str, Any]]:
    """The trained network of a ``fromp-bench`` checkpoint, its task sequence and run config.

    Returns:
        ``(net, seq, config)``: ``net`` is the :mod:`fromp` model in eval mode (Avalanche
        wrapper removed; for a mean-field Gaussian network, as trained by VCL, the
        deterministic network at the posterior means), ``seq`` the benchmark's tasks
        (subsampled as in the run).
    """
    from benchmarks.runner import load_sequence

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {path} is empty")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # pickle, zip and EOF errors come in many types
        detail = " ".join(str(err).split())[:200]
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({type(err).__name__}: {detail})"
        ) from err
    if not isinstance(state, dict) or "model" not in state or "config" not in state:
        raise CheckpointError(f"{path} is not a fromp-bench checkpoint (no model/config)")
    cfg = dict(state["config"])
    cfg["tasks_trained"] = int(state.get("done", 0))
    bench = get_benchmark(cfg["benchmark"])
    root = data_root if data_root is not None else cfg.get("data_root")
    args = (cfg.get("n_train"), cfg.get("n_test"), cfg.get("valid_fraction"))
    args += (cfg.get("valid_seed", 0),)
    seq = load_sequence(bench, root, *args)
    want = (cfg.get("data") or {}).get("hash")
    if want is not None and seq.fingerprint()["hash"] != want:
        raise CheckpointError(
            f"the data under {root or 'the default data root'} differ from those {path} was "
            "trained on (data fingerprints differ); pass the run's --data-root"
        )
    if cfg.get("strategy") in STRATEGIES and STRATEGIES[cfg["strategy"]].joint:
        cfg["tasks_trained"] = len(seq) if cfg["tasks_trained"] else 0  # one step, all tasks
    net = bench.model(seq)
    weights = {k.removeprefix("net."): v for k, v in state["model"].items()}
    bayes = _bayesian_net_state(state)
    if bayes is not None:
        weights = bayes
    if any(k.endswith("weight_mu") for k in weights):
        # a mean-field Gaussian network (VCL): use its posterior means as the weights
        weights = {
            k.removesuffix("_mu"): v
            for k, v in weights.items()
            if k.endswith(("weight_mu", "bias_mu"))
        }
    try:
        net.load_state_dict(weights)
    except RuntimeError as err:
        first = str(err).strip().splitlines()[0]
        raise CheckpointError(
            f"{path} does not match the {cfg['benchmark']} network: {first}"
        ) from err
    return net.eval(), seq, cfg


def _bayesian_net_state(state: dict[str, Any]) -> dict[str, Any] | None:
    """The state of a mean-field Gaussian network kept by a strategy plugin (VCL trains its
    own Bayesian copy of the network), or None."""
    plugins = state.get("plugins") or {}
    for plugin in plugins.values() if isinstance(plugins, dict) else plugins:
        try:
            net = plugin["state_dict"]["net"]
        except (KeyError, TypeError):
            continue
        if isinstance(net, dict) and any(str(k).endswith("weight_mu") for k in net):
            return net
    return None


def _task(seq: TaskSequence, task: int, cfg: dict[str, Any] | None = None):
    """Task ``task`` of ``seq``; refused when out of range or not trained by the checkpoint."""
    if not 0 <= task < len(seq):
        raise CheckpointError(f"--task must be in [0, {len(seq)}), got {task}")
    trained = (cfg or {}).get("tasks_trained")
    if trained is not None and task >= trained:
        raise CheckpointError(
            f"--task {task}: the checkpoint was saved after {trained} task(s), so it never "
            f"trained task {task} (choose --task in [0, {trained}))"
        )
    return seq[task]


def _image_grid(images: np.ndarray, rows: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_rows, n_cols = images.shape[:2]
    fig, axes = plt.subplots(
        n_rows, n_cols, figsize=(0.9 * n_cols + 1, 0.95 * n_rows + 0.4), squeeze=False
    )
    for i in range(n_rows):
        for j in range(n_cols):
            ax = axes[i][j]
            img = images[i, j]
            ax.imshow(img, cmap=None if img.ndim == 3 else "gray")
            ax.set_xticks([])
            ax.set_yticks([])
        axes[i][0].set_ylabel(rows[i], rotation=0, ha="right", va="center", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _to_image(x: torch.Tensor, shape: tuple[int, ...]) -> np.ndarray:
    img = x.reshape(shape) if x.numel() == int(np.prod(shape)) else x
    if img.ndim == 1:  # flattened MNIST
        side = round(img.numel() ** 0.5)
        img = img.reshape(side, side)
    if img.ndim == 3:
        img = img[0] if img.shape[0] == 1 else img.permute(1, 2, 0)
    return img.numpy()


def write_memory_map(
    model: nn.Module,
    posterior: Any,
    x: torch.Tensor,
    y: torch.Tensor,
    out: Path,
    *,
    indices: torch.Tensor | None = None,
    memorable: torch.Tensor | None = None,
    title: str = "memory map",
    meta: dict[str, Any] | None = None,
    chunk_size: int = 64,
) -> dict[str, Any]:
    """The memory map of ``(x, y)``: ``memory_map.png`` (prediction error ``|e_i|_1``
    against prediction variance ``sum_k v_ik``, colour: sensitivity, memorable points
    circled) and ``memory_map.json`` (per-example numbers of
    :meth:`fromp.sensitivity.MemoryPerturbation.to_dict`, ``index`` into the data set,
    ``memorable`` flags, the leave-one-out summary and ``meta``) in the directory ``out``.

    Args:
        model: ``[N, ...] -> [N, C]`` in eval mode. posterior: over its parameters.
        x: ``[N, ...]``. y: ``[N]``.
        indices: ``[N]`` indices of the examples in their data set (default ``arange``).
        memorable: indices (same numbering as ``indices``) of the memorable examples.

    Returns:
        The JSON payload.
    """
    from fromp.sensitivity import memory_perturbation

    idx = torch.arange(len(x)) if indices is None else indices.cpu()
    if isinstance(posterior, _Precomputed):
        mp = posterior.perturbation
    else:
        mp = memory_perturbation(model, posterior, x, y, chunk_size=chunk_size)
    per = mp.to_dict()
    mem = set() if memorable is None else {int(i) for i in memorable}
    flags = [int(i) in mem for i in idx]
    payload = {
        **(meta or {}),
        "n": len(x),
        "loo": mp.loo_summary(),
        "index": idx.tolist(),
        "memorable": flags,
        **per,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory_map.json").write_text(json.dumps(payload) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    err = np.asarray(per["error_norm"])
    var = np.asarray(per["variance_sum"])
    sens = np.asarray(per["sensitivity"])
    fig, ax = plt.subplots(figsize=(5.2, 4.2))
    sc = ax.scatter(err, var, c=sens, s=6, cmap="viridis", norm=_log_norm(sens))
    fig.colorbar(sc, ax=ax, label="sensitivity Σ|e λ v|")
    flag = np.asarray(flags, dtype=bool)
    if flag.any():
        ax.scatter(
            err[flag], var[flag], s=28, facecolors="none", edgecolors="red", label="memorable"
        )
        ax.legend(loc="lower right", fontsize=8)
    ax.set_xscale("symlog", linthresh=1e-3)
    ax.set_yscale("log")
    ax.set_xlabel("prediction error |p − onehot(y)|₁")
    ax.set_ylabel("prediction variance Σ_k v_k")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "memory_map.png", dpi=110)
    plt.close(fig)
    return payload


def _log_norm(values: np.ndarray):
    from matplotlib.colors import LogNorm

    pos = values[values > 0]
    if len(pos) == 0:
        return None
    return LogNorm(vmin=float(pos.min()), vmax=float(max(pos.max(), pos.min() * 1.0001)))


def memorable_main(argv: list[str] | None = None) -> int:
    """``fromp-memorable``: memorable examples of a trained network on one task."""
    p = argparse.ArgumentParser(
        prog="fromp-memorable",
        description="Select the memorable training examples (largest tr Lambda, balanced per "
        "class) of a trained fromp-bench checkpoint; write JSON and a PNG grid.",
    )
    p.add_argument("checkpoint", help="a fromp-bench checkpoint (.pt)")
    p.add_argument("--task", type=int, default=0, help="task index (default 0)")
    p.add_argument("--n-per-class", type=int, default=10, help="examples per class")
    p.add_argument("--order", default="descending", choices=("descending", "ascending", "random"))
    p.add_argument("--data-root", default=None, help="data root (default: $FROMP_DATA, ./data)")
    p.add_argument("--out", default="memorable", help="output directory")
    p.add_argument(
        "--map",
        action="store_true",
        help="also write the memory map (memory_map.png/.json) and the leave-one-out estimate "
        "of the task's training examples, next to the task's test NLL and accuracy",
    )
    p.add_argument(
        "--posterior",
        default="last-layer",
        choices=("last-layer", "diagonal"),
        help="posterior of --map: 'last-layer' (full Laplace-GGN over the output layer, exact "
        "Newton-step leave-one-out of the head; default) or 'diagonal' (diagonal Laplace-GGN "
        "over all weights)",
    )
    p.add_argument(
        "--n-fit",
        type=int,
        default=None,
        help="training examples for --map: the first N and the memorable ones (default: all "
        "of the task's training examples, the data the network was trained on)",
    )
    p.add_argument(
        "--prior-precision",
        default="trained",
        help="delta for --map: a number, 'trained' (the prior precision the run was trained "
        "with, from the checkpoint's settings; the evidence's choice when they have none; "
        "default) or 'auto' (maximise the Laplace evidence)",
    )
    args = p.parse_args(argv)
    from fromp.memorable import memorability_scores, select_memorable

    try:
        net, seq, cfg = load_trained(args.checkpoint, args.data_root)
        task = _task(seq, args.task, cfg)
        model = with_task(net, task.task_id if seq.multi_head else None)
        with torch.no_grad():
            idx = select_memorable(
                model, task.train_x, task.train_y, n_per_class=args.n_per_class, order=args.order
            )
            scores = memorability_scores(model, task.train_x[idx])
        map_args = _map_inputs(args, model, task, idx, cfg) if args.map else None
    except _ERRORS as err:
        print(f"fromp-memorable: error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    labels = task.train_y[idx]
    payload = {
        "checkpoint": str(args.checkpoint),
        "benchmark": cfg["benchmark"],
        "task": args.task,
        "order": args.order,
        "indices": idx.tolist(),
        "labels": labels.tolist(),
        "classes": [task.classes[int(c)] for c in labels] if task.classes else labels.tolist(),
        "scores": scores.tolist(),
    }
    (out / "memorable.json").write_text(json.dumps(payload, indent=2) + "\n")
    classes = sorted(set(labels.tolist()))
    grid = np.stack(
        [
            np.stack([_to_image(task.train_x[i], seq.input_shape) for i in idx[labels == c]])
            for c in classes
        ]
    )
    names = [f"class {task.classes[c] if task.classes else c}" for c in classes]
    _image_grid(grid, names, out / "memorable.png", f"{args.order} tr Λ, task {args.task + 1}")
    print(f"{len(idx)} memorable examples -> {out / 'memorable.json'}, {out / 'memorable.png'}")
    if map_args is not None:
        posterior, sub, delta, source = map_args
        name = (
            "last-layer full Laplace-GGN"
            if args.posterior == "last-layer"
            else "diagonal Laplace-GGN (all weights)"
        )
        meta = {
            "command": "fromp-memorable " + shlex.join(sys.argv[1:] if argv is None else argv),
            "checkpoint": str(args.checkpoint),
            "task": args.task,
            "posterior": name,
            "prior_precision": delta,
            "prior_precision_source": source,
            "n_fit": len(sub),
            **_test_metrics(model, task),
        }
        payload = write_memory_map(
            model,
            posterior,
            task.train_x[sub],
            task.train_y[sub],
            out,
            indices=sub,
            memorable=idx,
            title=f"memory map, {cfg['benchmark']} task {args.task + 1} ({name}, δ={delta:.3g})",
            meta=meta,
        )
        loo = payload["loo"]
        print(
            f"posterior: {name} on {len(sub)} training examples, δ={delta:.3g} ({source})\n"
            f"estimated leave-one-out NLL {loo['loo_nll']:.4f} (training "
            f"{loo['train_nll']:.4f}), accuracy {100 * loo['loo_accuracy']:.2f} %"
        )
        if "test_nll" in meta:
            print(
                f"test set ({meta['n_test']} examples): NLL {meta['test_nll']:.4f}, accuracy "
                f"{100 * meta['test_accuracy']:.2f} %"
            )
        print(f"-> {out / 'memory_map.png'}, {out / 'memory_map.json'}")
    return 0


def _test_metrics(model: nn.Module, task: Any) -> dict[str, Any]:
    """``{"n_test", "test_nll", "test_accuracy"}`` of the task's test set (empty without
    one)."""
    from fromp.likelihood import get_likelihood

    tx, ty = getattr(task, "test_x", None), getattr(task, "test_y", None)
    if tx is None or ty is None or len(ty) == 0:
        return {}
    with torch.no_grad():
        f = torch.cat([model(b) for b in tx.split(1024)])
    nll = get_likelihood("categorical").nll(f, ty).mean().item()
    acc = (f.argmax(-1) == ty).double().mean().item()
    return {"n_test": len(ty), "test_nll": nll, "test_accuracy": acc}


def _trained_prior_precision(cfg: dict[str, Any], n: int) -> float | None:
    """The prior precision of the run's training objective (summed over the ``n`` examples),
    from the checkpoint's settings: the strategy's ``prior_precision``, else the optimizer's
    ``weight_decay`` times ``n`` (weight decay on a mean-reduced loss); None if neither."""
    settings = cfg.get("settings") or {}
    delta = (settings.get("kwargs") or {}).get("prior_precision")
    if delta is not None and float(delta) > 0:
        return float(delta)
    wd = (settings.get("optimizer_kwargs") or {}).get("weight_decay")
    if wd is not None and float(wd) > 0:
        return float(wd) * n
    return None


def _map_inputs(
    args: argparse.Namespace,
    model: nn.Module,
    task: Any,
    memorable: torch.Tensor,
    cfg: dict[str, Any] | None = None,
) -> tuple[Any, torch.Tensor, float, str]:
    """``(posterior, example indices, delta, where delta came from)`` of ``--map``: the
    mapped examples are all of the task's training examples (or the first ``--n-fit`` and the
    memorable ones); the posterior is fitted on exactly those (so that each is in the data
    its leave-one-out estimate removes it from)."""
    from fromp.gp import optimize_prior_precision
    from fromp.laplace import laplace
    from fromp.sensitivity import last_layer_loo

    n_train = len(task.train_y)
    if args.n_fit is None:
        sub = torch.arange(n_train)
    elif args.n_fit < 1:
        raise ValueError(f"--n-fit must be >= 1, got {args.n_fit}")
    else:
        sub = torch.unique(torch.cat([torch.arange(min(args.n_fit, n_train)), memorable]))
    fit = (task.train_x[sub], task.train_y[sub])
    delta: float | None
    if args.prior_precision == "trained":
        delta = _trained_prior_precision(cfg or {}, len(sub))
        source = "trained with, from the checkpoint's settings"
    elif args.prior_precision == "auto":
        delta, source = None, ""
    else:
        try:
            delta = float(args.prior_precision)
        except ValueError:
            delta = float("nan")
        if not delta > 0:
            raise ValueError(
                f"--prior-precision must be a number > 0, 'trained' or 'auto', got "
                f"{args.prior_precision!r}"
            )
        source = "given"
    if delta is None:
        delta = float(optimize_prior_precision(model, fit, "categorical"))
        source = "Laplace evidence maximised"
    if args.posterior == "last-layer":
        return _Precomputed(last_layer_loo(model, *fit, delta).perturbation), sub, delta, source
    return laplace(model, fit, "categorical", delta), sub, delta, source


class _Precomputed:
    """A posterior whose memory perturbation is already computed (the last-layer one)."""

    def __init__(self, perturbation: Any) -> None:
        self.perturbation = perturbation


def gp_main(argv: list[str] | None = None) -> int:
    """``fromp-gp``: the DNN2GP Gaussian process of a trained network on one task."""
    p = argparse.ArgumentParser(
        prog="fromp-gp",
        description="Convert a trained fromp-bench checkpoint into its DNN2GP Gaussian "
        "process on one task; write the kernel and predictive (.npz) and a kernel heatmap.",
    )
    p.add_argument("checkpoint", help="a fromp-bench checkpoint (.pt)")
    p.add_argument("--task", type=int, default=0, help="task index (default 0)")
    p.add_argument("--n", type=int, default=100, help="test inputs (sorted by class)")
    p.add_argument(
        "--n-fit", type=int, default=2000, help="training examples for the Laplace-GGN fit"
    )
    p.add_argument(
        "--prior-precision",
        default="auto",
        help="delta, or 'auto' to maximise the Laplace evidence (default)",
    )
    p.add_argument("--data-root", default=None, help="data root (default: $FROMP_DATA, ./data)")
    p.add_argument("--out", default="gp", help="output directory")
    args = p.parse_args(argv)
    from fromp.gp import dnn2gp, optimize_prior_precision
    from fromp.laplace import laplace

    try:
        if args.n < 1 or args.n_fit < 1:
            raise ValueError(f"--n and --n-fit must be >= 1, got {args.n} and {args.n_fit}")
        net, seq, cfg = load_trained(args.checkpoint, args.data_root)
        task = _task(seq, args.task, cfg)
        model = with_task(net, task.task_id if seq.multi_head else None)
        fit = (task.train_x[: args.n_fit], task.train_y[: args.n_fit])
        if args.prior_precision == "auto":
            delta = float(optimize_prior_precision(model, fit, "categorical"))
        else:
            delta = float(args.prior_precision)
            if not delta > 0:
                raise ValueError(f"--prior-precision must be > 0, got {delta}")
        posterior = laplace(model, fit, "categorical", delta)
        gp = dnn2gp(model, posterior, "categorical")
        first = torch.arange(min(args.n, len(task.test_y)))  # the first n, sorted by class
        order = first[torch.argsort(task.test_y[first], stable=True)]
        x, y = task.test_x[order], task.test_y[order]
        with torch.no_grad():
            mean = gp.mean(x)
            kernel = gp.kernel(x)
            variance = gp.variance(x)
            probs = gp.predictive(x, "probit")
    except _ERRORS as err:
        print(f"fromp-gp: error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        out / "gp.npz",
        test_indices=order.numpy(),
        labels=y.numpy(),
        mean=mean.numpy(),
        kernel=kernel.numpy(),
        variance=variance.numpy(),
        probs=probs.numpy(),
        prior_precision=np.array(delta),
    )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = torch.einsum("ncmc->nm", kernel).numpy()  # sum over outputs of the diagonal blocks
    fig, ax = plt.subplots(figsize=(5, 4.4))
    im = ax.imshow(k, cmap="viridis")
    fig.colorbar(im, ax=ax)
    ticks = [int(i) for i in np.flatnonzero(np.diff(y.numpy(), prepend=-1))]
    ax.set_xticks(ticks)
    ax.set_yticks(ticks)
    ax.set_title(f"DNN2GP kernel Σ_c k_cc, task {args.task + 1} (δ={delta:.3g})", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "kernel.png", dpi=120)
    plt.close(fig)
    acc = (probs.argmax(1) == y).double().mean().item() * 100
    print(
        f"DNN2GP of {cfg['benchmark']} task {args.task + 1}: prior precision {delta:.3g}, "
        f"{len(y)} test inputs, GP accuracy {acc:.1f} % -> {out / 'gp.npz'}, "
        f"{out / 'kernel.png'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(memorable_main())
