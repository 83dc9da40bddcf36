"""Command-line tools for trained networks: ``fromp-memorable`` and ``fromp-gp``.

Both read a checkpoint written by ``fromp-bench`` (``runs/<benchmark>/checkpoints/*.pt``),
rebuild the benchmark's network, and work on one task of the benchmark's data::

    fromp-memorable runs/split-mnist/checkpoints/fromp-seed0.pt --task 0 --n-per-class 10
    fromp-gp runs/split-mnist/checkpoints/fromp-seed0.pt --task 0 --n 100

``fromp-memorable`` writes ``memorable.json`` (indices into the task's training set, their
classes and scores) and ``memorable.png`` (a grid of the selected images per class); with
``--map`` also the task's memory map (:func:`write_memory_map`): ``memory_map.png``, each
training example's prediction error against its prediction variance under a Laplace posterior
(by default the Laplace approximation of the training method's own objective: a Kronecker
(KFAC) posterior over all weights whose curvature is that of every task trained so far for a
strategy whose objective keeps its earlier tasks, of the evaluated task alone otherwise
(:func:`_auto_curvature`), the prior precision by the evidence), memorable points marked, and
``memory_map.json`` with the per-example numbers, the estimated leave-one-out NLL and
accuracy (memory perturbation with the example's own curvature removed,
:mod:`fromp.memory.sensitivity`) and the task's test NLL and accuracy beside them.
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
from fromp_avalanche.checkpoint import CheckpointError, read_checked
from fromp_bench.data import CorruptDataError, DataNotFoundError, TaskSequence
from fromp_bench.plugins import check_out
from fromp_bench.registry import STRATEGIES, UnknownNameError, get_benchmark
from fromp_bench.report import image_grid, log_norm, plot_kernel, to_image
from torch import nn

from fromp.models import with_task

__all__ = ["gp_main", "load_trained", "load_user_model", "memorable_main", "write_memory_map"]

warnings.filterwarnings("ignore", message="no QP solver found")


# Errors reported as one line with exit status 2.
_ERRORS = (CheckpointError, UnknownNameError, DataNotFoundError, CorruptDataError, ValueError)


def load_trained(
    path: str | Path, data_root: str | None = None
) -> tuple[nn.Module, TaskSequence, dict[str, Any]]:
    """The trained network of a ``fromp-bench`` checkpoint, its task sequence and run config.

    The file is verified against its ``.sha256`` and read with ``weights_only=True``
    (:func:`fromp_avalanche.checkpoint.read_checked`): a missing or mismatched checksum, a file
    that needs code to load, a directory or an empty file is refused naming the path.

    Returns:
        ``(net, seq, config)``: ``net`` is the :mod:`fromp` model in eval mode (Avalanche
        wrapper removed; for a mean-field Gaussian network, as trained by VCL, the
        deterministic network at the posterior means), ``seq`` the benchmark's tasks
        (subsampled as in the run).
    """
    from fromp_bench.runner import load_sequence

    path = Path(path)
    state = read_checked(path)  # checksum verified, weights only: a checkpoint never runs code
    if not isinstance(state, dict) or "model" not in state or "config" not in state:
        raise CheckpointError(f"{path} is not a fromp-bench checkpoint (no model/config)")
    if not isinstance(state["config"], dict) or not isinstance(state["config"].get("benchmark"),
                                                                str):  # fmt: skip
        raise CheckpointError(f"{path} is not a fromp-bench checkpoint (no benchmark in config)")
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


def load_user_model(
    spec: str,
    weights: str | Path | None,
    benchmark: str,
    data_root: str | None = None,
    *,
    random_init: bool = False,
) -> tuple[nn.Module, TaskSequence, dict[str, Any]]:
    """A user's network and a benchmark's tasks, for ``--model package.module:factory
    --weights state_dict.pt --benchmark NAME``.

    ``factory()`` (no arguments) builds the module; ``weights`` is a file written by
    ``torch.save(model.state_dict(), path)`` (or a dict holding it under ``"state_dict"``
    or ``"model"``), loaded on the CPU with ``weights_only=True`` and strictly (every key
    must match); without ``weights`` the factory's initial weights are used only with
    ``random_init=True`` (``--random-init``). The module maps the benchmark's inputs
    ``[N, *input_shape]`` to logits ``[N, n_outputs]`` (checked on two of the first task's
    inputs); on a multi-head benchmark it takes the task as ``model(x, task=t)`` or
    ``model(x, task_labels)`` (see :func:`fromp.models.with_task`). Returns ``(net, seq,
    config)`` as :func:`load_trained`.

    Raises:
        CheckpointError: one line naming ``--model`` or ``--weights`` and what was expected.
    """
    import importlib

    from fromp_bench.runner import load_sequence

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CheckpointError(f"--model must be package.module:factory, got {spec!r}")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise CheckpointError(f"--model {spec}: {type(err).__name__}: {err}") from err
    if not callable(factory):
        raise CheckpointError(f"--model {spec}: {attr} is a {type(factory).__name__}, expected "
                              "a factory callable with no arguments")  # fmt: skip
    if weights is None and not random_init:
        raise CheckpointError(f"--model {spec} without --weights would analyse the factory's "
                              "random initial weights; pass --weights FILE (a state_dict), or "
                              "--random-init if that is intended")  # fmt: skip
    try:
        net = factory()
    except Exception as err:  # the user's code: any error, reported in one line
        raise CheckpointError(
            f"--model {spec}: calling {attr}() raised {type(err).__name__}: "
            f"{_one_line(err)} (expected a factory taking no arguments)"
        ) from err
    if not isinstance(net, nn.Module):
        raise CheckpointError(f"--model {spec}: the factory returned a {type(net).__name__}, "
                              "not a torch.nn.Module")  # fmt: skip
    if weights is not None:
        path = Path(weights)
        state = read_checked(path, checksum=False, what="--weights")
        if isinstance(state, dict) and isinstance(state.get("state_dict", state.get("model")),
                                                  dict):  # fmt: skip
            state = state.get("state_dict", state.get("model"))
        try:
            net.load_state_dict(state)
        except (RuntimeError, TypeError, AttributeError) as err:
            first = str(err).strip().splitlines()[0]
            raise CheckpointError(f"--weights {path} does not fit --model {spec}: {first}") from err
    seq = load_sequence(get_benchmark(benchmark), data_root, None, None, None, 0)
    _check_fits(net.eval(), seq, spec, benchmark)
    return net.eval(), seq, {"benchmark": benchmark, "model": spec, "weights": str(weights)}


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:200]


def _check_fits(net: nn.Module, seq: TaskSequence, spec: str, benchmark: str) -> None:
    """``net`` maps two of the first task's inputs to ``[2, n_outputs]`` finite logits."""
    task = seq[0]
    x = task.train_x[:2]
    shape = "x".join(str(d) for d in seq.input_shape)
    try:
        with torch.no_grad():
            out = with_task(net, task.task_id if seq.multi_head else None)(x)
    except Exception as err:  # the user's forward: any error, reported in one line
        raise CheckpointError(
            f"--model {spec} does not take {benchmark}'s inputs [N, {shape}] "
            f"({type(err).__name__}: {_one_line(err)})"
        ) from err
    want = (len(x), seq.n_outputs)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want:
        got = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        what = "outputs per head" if seq.multi_head else "classes"
        raise CheckpointError(
            f"--model {spec} gives outputs {got} on {benchmark}'s inputs, expected "
            f"[N, {seq.n_outputs}] (the benchmark's {what})"
        )


def _load(args: argparse.Namespace) -> tuple[nn.Module, TaskSequence, dict[str, Any]]:
    """The network and tasks of a CLI call: a ``fromp-bench`` checkpoint, or ``--model``."""
    if args.model is not None:
        if args.checkpoint is not None:
            raise CheckpointError("give a checkpoint or --model, not both")
        if args.benchmark is None:
            raise CheckpointError("--model needs --benchmark (whose tasks' data to use)")
        return load_user_model(args.model, args.weights, args.benchmark, args.data_root,
                               random_init=args.random_init)  # fmt: skip
    if args.checkpoint is None:
        raise CheckpointError("a checkpoint (.pt of fromp-bench) or --model is required")
    return load_trained(args.checkpoint, args.data_root)


def _model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", nargs="?", help="a fromp-bench checkpoint (.pt)")
    p.add_argument(
        "--model", default=None, help="instead of a checkpoint: a network, package.module:factory"
    )
    p.add_argument("--weights", default=None, help="with --model: a state_dict file (.pt)")
    p.add_argument("--benchmark", default=None, help="with --model: the benchmark's data to use")
    p.add_argument(
        "--random-init",
        action="store_true",
        help="with --model and no --weights: analyse the factory's initial (random) weights",
    )


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


def class_names(seq: TaskSequence, task: Any, labels: torch.Tensor) -> list[int]:
    """The original class of each of a task's labels: a multi-head task's labels are
    positions in its ``classes`` (split MNIST's task 2: 0, 1 for the digits 2, 3); a
    single-head task's labels are the classes already (class-incremental: the digits)."""
    if seq.multi_head and task.classes:
        return [int(task.classes[int(c)]) for c in labels]
    return [int(c) for c in labels]


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
    covariance: str = "diag",
    correction: bool = False,
) -> dict[str, Any]:
    """The memory map of ``(x, y)``: ``memory_map.png`` (prediction error ``|e_i|_1``
    against prediction variance ``sum_k v_ik``, colour: sensitivity, memorable points
    circled) and ``memory_map.json`` (per-example numbers of
    :meth:`fromp.memory.sensitivity.MemoryPerturbation.to_dict`, ``index`` into the data set,
    ``memorable`` flags, the leave-one-out summary and ``meta``) in the directory ``out``.

    Args:
        model: ``[N, ...] -> [N, C]`` in eval mode. posterior: over its parameters (a
            Gaussian or a fitted :func:`fromp.Laplace` of ``model``).
        x: ``[N, ...]``. y: ``[N]``.
        indices: ``[N]`` indices of the examples in their data set (default ``arange``).
        memorable: indices (same numbering as ``indices``) of the memorable examples.
        covariance, correction: the leave-one-out form
            (:func:`fromp.memory.sensitivity.memory_perturbation`).

    Returns:
        The JSON payload.
    """
    from fromp.memory.sensitivity import memory_perturbation

    idx = torch.arange(len(x)) if indices is None else indices.cpu()
    mp = memory_perturbation(
        model, posterior, x, y, covariance=covariance, correction=correction, chunk_size=chunk_size
    )
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
    sc = ax.scatter(err, var, c=sens, s=6, cmap="viridis", norm=log_norm(sens))
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


def memorable_main(argv: list[str] | None = None) -> int:
    """``fromp-memorable``: memorable examples of a trained network on one task."""
    p = argparse.ArgumentParser(
        prog="fromp-memorable",
        description="Select the memorable training examples (largest tr Lambda, balanced per "
        "class) of a trained fromp-bench checkpoint; write JSON and a PNG grid.",
    )
    _model_arguments(p)
    p.add_argument("--task", type=int, default=0, help="task index (default 0)")
    p.add_argument("--n-per-class", type=int, default=10, help="examples per class")
    p.add_argument("--order", default="descending", choices=("descending", "ascending", "random"))
    p.add_argument("--data-root", default=None, help="data root (default: $FROMP_DATA, ./data)")
    p.add_argument("--out", default="memorable", help="output directory")
    p.add_argument(
        "--map",
        action="store_true",
        help="also write the memory map (memory_map.png/.json): each training example's "
        "prediction error, variance, sensitivity, and the estimated leave-one-out NLL and "
        "accuracy, beside the task's test NLL and accuracy",
    )
    p.add_argument(
        "--posterior",
        default="kron",
        choices=tuple(_POSTERIORS),
        help="the Laplace posterior of --map (default kron: all Linear/Conv2d weights, "
        "Kronecker factors, one-step estimate f + V e; last-layer-full: the last layer with "
        "its full GGN, the earlier default; last-layer-kron: its Kronecker factors; diag: all "
        "weights, diagonal GGN)",
    )
    p.add_argument(
        "--curvature",
        default="auto",
        choices=("auto", "task", "trained-tasks"),
        help="with --posterior kron, whose data the curvature sums: the task's, or every "
        "task the checkpoint trained (each through its own head); auto (default): the "
        "training method's objective, trained-tasks for strategies that keep earlier tasks "
        "(FROMP, EWC, VCL, IVON/VOGN with their continual prior, joint), task otherwise",
    )
    p.add_argument(
        "--n-fit",
        type=int,
        default=None,
        help="fit the posterior of --map on the first N training examples (and the memorable "
        "ones) instead of all of the task's training examples (the default)",
    )
    p.add_argument(
        "--prior-precision",
        default="auto",
        help="delta for --map, or 'auto' to maximise the Laplace evidence (default)",
    )
    p.add_argument(
        "--prior-structure",
        default="scalar",
        choices=("scalar", "layerwise"),
        help="with --prior-precision auto: one delta (default) or one per parameter tensor, "
        "each maximising the evidence",
    )
    args = p.parse_args(argv)
    from fromp.continual.memorable import memorability_scores, select_memorable

    try:
        check_out(Path(args.out))  # before any work: a file, or under one, is refused
        net, seq, cfg = _load(args)
        task = _task(seq, args.task, cfg)
        model = with_task(net, task.task_id if seq.multi_head else None)
        with torch.no_grad():
            idx = select_memorable(
                model, task.train_x, task.train_y, n_per_class=args.n_per_class, order=args.order
            )
            scores = memorability_scores(model, task.train_x[idx])
        labels = task.train_y[idx]
        payload = {  # built (and the classes named) before the memory map's work
            "checkpoint": str(args.checkpoint),
            "benchmark": cfg["benchmark"],
            "task": args.task,
            "order": args.order,
            "indices": idx.tolist(),
            "labels": labels.tolist(),
            "classes": class_names(seq, task, labels),
            "scores": scores.tolist(),
        }
        classes = sorted(set(labels.tolist()))
        grid = np.stack(
            [
                np.stack([to_image(task.train_x[i], seq.input_shape) for i in idx[labels == c]])
                for c in classes
            ]
        )
        names = [f"class {c}" for c in class_names(seq, task, torch.tensor(classes))]
        map_args = _map_inputs(args, model, task, idx, (net, seq, cfg)) if args.map else None
    except _ERRORS as err:
        print(f"fromp-memorable: error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memorable.json").write_text(json.dumps(payload, indent=2) + "\n")
    image_grid(grid, names, out / "memorable.png", f"{args.order} tr Λ, task {args.task + 1}")
    print(f"{len(idx)} memorable examples -> {out / 'memorable.json'}, {out / 'memorable.png'}")
    if map_args is not None:
        posterior, sub, delta, curv = map_args
        dtxt = (f"{delta:.3g}" if isinstance(delta, float)
                else "layerwise " + ", ".join(f"{d:.3g}" for d in delta))  # fmt: skip
        with torch.no_grad():
            f_test = model(task.test_x)
        test = {
            "nll": float(torch.nn.functional.cross_entropy(f_test, task.test_y)),
            "accuracy": float((f_test.argmax(1) == task.test_y).double().mean()),
        }
        meta = {
            "command": "fromp-memorable " + shlex.join(sys.argv[1:] if argv is None else argv),
            "checkpoint": str(args.checkpoint),
            "task": args.task,
            "posterior": args.posterior,
            "curvature": curv,
            "loo_form": "corrected" if _POSTERIORS[args.posterior][3] else "one-step (f + V e)",
            "n_fit": len(sub),
            "prior_precision": delta,
            "test": test,
        }
        payload = write_memory_map(
            model,
            posterior,
            task.train_x[sub],
            task.train_y[sub],
            out,
            indices=sub,
            memorable=idx,
            covariance=_POSTERIORS[args.posterior][2],
            correction=_POSTERIORS[args.posterior][3],
            title=f"memory map, {cfg['benchmark']} task {args.task + 1} "
            f"({args.posterior} Laplace, δ={dtxt})",
            meta=meta,
        )
        loo = payload["loo"]
        print(
            f"memory map of {payload['n']} examples ({args.posterior} Laplace, "
            f"{meta['loo_form']} estimate, {_describe(curv)}, fitted on {len(sub)} of the "
            f"task's training examples, prior precision {dtxt} by "
            f"{'the evidence' if args.prior_precision == 'auto' else '--prior-precision'}): "
            "estimated "
            f"leave-one-out NLL {loo['loo_nll']:.4f}, accuracy {100 * loo['loo_accuracy']:.2f} % "
            f"(training {loo['train_nll']:.4f}; test {test['nll']:.4f}, "
            f"{100 * test['accuracy']:.2f} %) -> {out / 'memory_map.png'}, "
            f"{out / 'memory_map.json'}"
        )
    return 0


#: ``--posterior``: (subset, structure, leave-one-out covariance form, correction). The
#: correction ``(I - Lambda V)^{-1}`` needs ``Lambda V < I``, which the exact last-layer GGN
#: guarantees; with a diagonal or Kronecker approximation it can fail, so those keep the
#: uncorrected forms.
_POSTERIORS = {
    "last-layer-full": ("last_layer", "full", "full", True),
    "last-layer-kron": ("last_layer", "kron", "full", False),
    "kron": ("all", "kron", "full", False),
    "diag": ("all", "diag", "diag", False),
}


#: Strategies whose training objective keeps the earlier tasks (a functional or weight-space
#: regulariser, the previous posterior as the prior, or all tasks at once): the Laplace
#: approximation of that objective has every trained task's curvature in the shared layers.
#: ``naive`` fine-tunes on the last task alone. ``ivon`` / ``vogn`` keep their posterior as
#: the next prior unless trained with ``continual=False``.
_KEEPS_EARLIER_TASKS = ("fromp", "fromp-l2", "fromp-kron", "fromp-vogn", "fromp-ivon", "ewc",
                        "ewc-avalanche", "vcl", "vcl-coreset", "ivon", "vogn", "joint")  # fmt: skip


def _auto_curvature(cfg: dict[str, Any]) -> tuple[str, str]:
    """``(curvature, reason)`` of ``--curvature auto`` for a checkpoint's run config:
    ``"trained-tasks"`` when the strategy's objective keeps its earlier tasks, ``"task"``
    otherwise (also for a user's ``--model``, whose objective is unknown)."""
    name = cfg.get("strategy")
    if name is None:
        return "task", "no strategy recorded (--model): the task's data alone"
    kwargs = (cfg.get("settings") or {}).get("kwargs") or {}
    if name in ("ivon", "vogn") and kwargs.get("continual", True) is False:
        return "task", f"{name} trained with continual=False keeps no earlier task"
    if name in _KEEPS_EARLIER_TASKS:
        return "trained-tasks", f"{name}'s objective keeps the earlier tasks"
    return "task", f"{name}'s objective is the last task's data alone"


def _describe(curv: dict[str, Any]) -> str:
    tasks = curv["tasks"]
    span = str(tasks[0]) if len(tasks) == 1 else f"{tasks[0]}-{tasks[-1]}"
    how = f"{curv['option']}: {curv['reason']}" if curv["option"] == "auto" else curv["option"]
    return f"curvature of task{'s' if len(tasks) > 1 else ''} {span} ({how})"


def _map_inputs(
    args: argparse.Namespace, model: nn.Module, task: Any, memorable: torch.Tensor, loaded: tuple
) -> tuple[Any, torch.Tensor, float | list[float], dict[str, Any]]:
    """``(posterior, example indices, delta, curvature)`` of ``--map``: a :func:`fromp.Laplace`
    of the chosen structure fitted on the task's training examples (all of them, or the first
    ``--n-fit`` and the memorable ones), so that each mapped example is in the data its
    leave-one-out estimate removes it from; for ``--posterior kron`` with the curvature
    ``trained-tasks`` (``--curvature``, :func:`_auto_curvature`) the KFAC GGN is summed over
    every task the checkpoint trained, each through its own head
    (:func:`fromp.curvature.kron.kron_curvature_tasks`; the other tasks' first ``--n-fit``
    examples), with the evidence's data term their summed NLL. The prior precision by the Laplace
    evidence unless given. ``curvature``: ``{"option", "used", "tasks", "reason"}``."""
    from fromp import Laplace
    from fromp.curvature.kron import kron_curvature_tasks
    from fromp.likelihood import get_likelihood

    net, seq, cfg = loaded
    n = len(task.train_y)
    if args.n_fit is not None and args.n_fit < 1:
        raise ValueError(f"--n-fit must be >= 1, got {args.n_fit}")
    if args.n_fit is None or args.n_fit >= n:
        sub = torch.arange(n)
    else:
        sub = torch.unique(torch.cat([torch.arange(args.n_fit), memorable]))
    subset, structure, _, _ = _POSTERIORS[args.posterior]
    used, reason = args.curvature, "--curvature " + args.curvature
    if args.curvature == "auto":
        used, reason = (_auto_curvature(cfg) if args.posterior == "kron"
                        else ("task", f"{args.posterior} is fitted on the task"))  # fmt: skip
    if used == "trained-tasks" and args.posterior != "kron":
        raise ValueError("--curvature trained-tasks needs --posterior kron")
    if used == "trained-tasks" and cfg.get("tasks_trained") is None:
        raise ValueError("--curvature trained-tasks needs a fromp-bench checkpoint (the tasks "
                         "it trained)")  # fmt: skip
    if args.prior_precision != "auto":
        try:
            delta = float(args.prior_precision)
        except ValueError as err:
            raise ValueError(f"--prior-precision must be a number or 'auto', got "
                             f"{args.prior_precision!r}") from err  # fmt: skip
        if not (delta > 0 and np.isfinite(delta)):
            raise ValueError(f"--prior-precision must be a finite number > 0, got {delta}")
    la = Laplace(model, "classification", subset, structure,
                 prior_precision=1.0 if args.prior_precision == "auto" else delta)  # fmt: skip
    x, y = task.train_x[sub], task.train_y[sub]
    tasks = [args.task]
    if used == "trained-tasks":  # tasks 0 .. last trained, the evaluated one on its subset
        tasks = list(range(cfg["tasks_trained"]))
        lik, data = get_likelihood("categorical"), []
        for t in tasks:
            tt = seq[t]
            keep = slice(None) if args.n_fit is None else slice(args.n_fit)
            xt, yt = (x, y) if t == args.task else (tt.train_x[keep], tt.train_y[keep])
            data.append((xt, yt, tt.task_id if seq.multi_head else None))
        curv = kron_curvature_tasks(net, [(xt, t) for xt, _, t in data], lik)
        with torch.no_grad():
            loss = sum(float(lik.nll(with_task(net, t)(xt), yt).sum()) for xt, yt, t in data)
        la.use_curvature(curv, curv.n, loss)
    else:
        la.fit([(x[i : i + 1000], y[i : i + 1000]) for i in range(0, len(x), 1000)])
    if args.prior_precision == "auto":
        la.optimize_prior_precision(
            method="marglik", prior_structure=args.prior_structure, optimizer="lbfgs"
        )
    elif args.prior_structure != "scalar":
        raise ValueError("--prior-structure layerwise needs --prior-precision auto")
    delta = la.prior_precision
    info = {"option": args.curvature, "used": used, "tasks": tasks, "reason": reason}
    return la, sub, float(delta) if delta.numel() == 1 else delta.tolist(), info


def gp_main(argv: list[str] | None = None) -> int:
    """``fromp-gp``: the DNN2GP Gaussian process of a trained network on one task."""
    p = argparse.ArgumentParser(
        prog="fromp-gp",
        description="Convert a trained fromp-bench checkpoint into its DNN2GP Gaussian "
        "process on one task; write the kernel and predictive (.npz) and a kernel heatmap.",
    )
    _model_arguments(p)
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
    from fromp.gp.process import dnn2gp
    from fromp.laplace.one_call import fit_laplace, optimize_prior_precision

    try:
        if args.n < 1 or args.n_fit < 1:
            raise ValueError(f"--n and --n-fit must be >= 1, got {args.n} and {args.n_fit}")
        check_out(Path(args.out))  # before any work: a file, or under one, is refused
        net, seq, cfg = _load(args)
        task = _task(seq, args.task, cfg)
        model = with_task(net, task.task_id if seq.multi_head else None)
        fit = (task.train_x[: args.n_fit], task.train_y[: args.n_fit])
        if args.prior_precision == "auto":
            delta = float(optimize_prior_precision(model, fit, "categorical", optimizer="lbfgs"))
        else:
            delta = float(args.prior_precision)
            if not delta > 0:
                raise ValueError(f"--prior-precision must be > 0, got {delta}")
        posterior = fit_laplace(model, fit, "categorical", delta)
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
    plot_kernel(
        torch.einsum("ncmc->nm", kernel).numpy(),
        y.numpy(),
        out / "kernel.png",
        f"DNN2GP kernel Σ_c k_cc, task {args.task + 1} (δ={delta:.3g})",
    )
    acc = (probs.argmax(1) == y).double().mean().item() * 100
    print(
        f"DNN2GP of {cfg['benchmark']} task {args.task + 1}: prior precision {delta:.3g}, "
        f"{len(y)} test inputs, GP accuracy {acc:.1f} % -> {out / 'gp.npz'}, "
        f"{out / 'kernel.png'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(memorable_main())
