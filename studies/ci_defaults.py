"""FROMP's defaults on class-incremental streams against Avalanche's Replay, as a user runs them.

The user's script (issue 56): Avalanche's ``SplitMNIST(n_experiences=5, seed=s)`` with its
default labels, an MLP 784-256-256 with Avalanche's ``IncrementalClassifier`` (masking on),
Adam 10⁻³, batches of 128, 2 epochs per experience; Avalanche's ``Replay(mem_size=1000)``
against ``FROMP(n_points=200)`` (nothing else set: the class-incremental defaults). A
``--fraction`` below 1 trains on that share of each experience's training examples (the
same draw, seeded by the run's seed, for every strategy); the test sets stay whole.

``--dataset digits`` runs the same script on scikit-learn's 8×8 digits (built in, no
download): the 5 experiences of the runner's ``split-digits-ci`` (digits 0/1, ..., 8/9,
global labels, about 290 training images each, a stratified quarter held out for test) as an
Avalanche stream, an MLP 64-256-256 with an ``IncrementalClassifier``, Adam 10⁻³, and the
runner's protocol for this size (batches of 32, 20 epochs); FROMP keeps 20 points per
experience (``n_points=20``, the runner's ``split-digits-ci`` memory) against
``Replay(mem_size=100)`` (FROMP's memory after the fifth experience, as on MNIST).

Per seed the strategies run in one process, interleaved experience by experience (the order
alternating), so that their times see the same machine load; each keeps its own random
state, so its result is that of the run alone. Recorded per run: the
accuracy after the last experience on every experience's test set, their mean, the newest
experience's, the seconds of each experience's ``train`` (FROMP's after-experience work
included) and the warnings FROMP printed.

    OMP_NUM_THREADS=1 python -m studies.ci_defaults --data-root DATA --seeds 0 1 2 3 4 \\
        --fraction 0.2 --configs replay fromp --out benchmarks/results/ci_defaults/mnist-20.json

``--norm batch`` / ``--norm layer`` put a ``BatchNorm1d`` / ``LayerNorm`` after each hidden
layer of the MLP (a user's network with normalisation layers).

``--set NAME=JSON`` adds a FROMP configuration of keyword arguments (``--set
w3='{"replay_weight": 3}'``) for screening; ``--quick`` runs 300 examples per experience and
one epoch (what the tests run).
"""

from __future__ import annotations

import json
import time
import warnings
from typing import Any

import torch
from torch import nn

from studies import harness

#: the configurations: (kind, keyword arguments)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "naive": ("naive", {}),
    "replay": ("replay", {}),  # mem_size: 5 x the dataset's n_points
    "fromp": ("fromp", {}),  # n_points only: the defaults
    "fromp-recipe": (  # docs/avalanche.md's class-incremental recipe before issue 56
        "fromp",
        {
            "replay": True,
            "replay_weight": 30.0,
            "function": "logits",
            "tau": 0.1,
            "context_tau": 0.3,
        },
    ),
}

#: per data set: input features, n_points, Replay's mem_size, batch size, epochs
DATASETS: dict[str, dict[str, int]] = {
    "mnist": {"inputs": 784, "n_points": 200, "mem_size": 1000, "batch": 128, "epochs": 2},
    "digits": {"inputs": 64, "n_points": 20, "mem_size": 100, "batch": 32, "epochs": 20},
}


def _benchmark(dataset: str, seed: int, data_root: str | None):
    if dataset == "mnist":
        from avalanche.benchmarks.classic import SplitMNIST
        from fromp_bench.data import resolve_data_root

        return SplitMNIST(
            n_experiences=5, seed=seed, dataset_root=str(resolve_data_root(data_root))
        )
    from fromp_bench.data import class_incremental, split_digits, to_avalanche

    return to_avalanche(class_incremental(split_digits(), "split-digits-ci"))


def _subset(bench, fraction: float, seed: int, cap: int | None):
    """Each experience's training set cut to ``fraction`` of it (at most ``cap`` examples),
    drawn by a generator seeded with ``seed``; the test sets whole (``cap``: cut too)."""
    from avalanche.benchmarks.scenarios.dataset_scenario import benchmark_from_datasets
    from avalanche.benchmarks.scenarios.supervised import with_classes_timeline
    from avalanche.benchmarks.scenarios.task_aware import with_task_labels

    if fraction == 1 and cap is None:
        return bench
    g = torch.Generator().manual_seed(seed)
    train = []
    for e in bench.train_stream:
        n = len(e.dataset)
        k = max(1, round(fraction * n)) if cap is None else min(cap, n)
        train.append(e.dataset.subset(torch.randperm(n, generator=g)[:k].tolist()))
    test = [e.dataset for e in bench.test_stream]
    if cap is not None:
        test = [d.subset(range(min(cap, len(d)))) for d in test]
    return with_classes_timeline(with_task_labels(benchmark_from_datasets(train=train, test=test)))


#: ``--norm``: the normalisation layer after each hidden linear layer of the MLP
NORMS = {"none": None, "batch": nn.BatchNorm1d, "layer": nn.LayerNorm}


def _model(inputs: int, norm_name: str = "none") -> nn.Module:
    """The MLP ``inputs``-256-256 with an ``IncrementalClassifier``, with ``NORMS[norm_name]``
    after each hidden linear layer."""
    from avalanche.models import IncrementalClassifier

    layer = NORMS[norm_name]

    def norm() -> list[nn.Module]:
        return [] if layer is None else [layer(256)]

    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(inputs, 256),
        *norm(),
        nn.ReLU(),
        nn.Linear(256, 256),
        *norm(),
        nn.ReLU(),
        IncrementalClassifier(256),
    )


def _strategy(kind: str, kwargs: dict[str, Any], model: nn.Module, common: dict, sizes: dict):
    from avalanche.evaluation.metrics import accuracy_metrics
    from avalanche.training import Naive, Replay
    from avalanche.training.plugins import EvaluationPlugin
    from fromp_avalanche.fromp import FROMP

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    args = dict(
        model=model,
        optimizer=opt,
        evaluator=EvaluationPlugin(accuracy_metrics(experience=True), loggers=[]),
        **common,
    )
    if kind == "fromp":
        return FROMP(**args, n_points=sizes["n_points"], **kwargs)
    args["criterion"] = nn.CrossEntropyLoss()
    if kind == "naive":
        return Naive(**args)
    return Replay(**args, mem_size=sizes["mem_size"], **kwargs)


def _accuracies(res: dict[str, Any]) -> list[float]:
    keys = sorted(k for k in res if k.startswith("Top1_Acc_Exp/eval_phase/test_stream"))
    return [100 * float(res[k]) for k in keys]


class _Run:
    """One strategy's run of the user's script, trained one experience at a time
    (:meth:`train`) so that runs can be interleaved; it keeps its own random state (torch,
    NumPy, Python), so its result is that of the run alone."""

    def __init__(
        self,
        dataset: str,
        name: str,
        kind: str,
        kwargs: dict[str, Any],
        seed: int,
        fraction: float,
        data_root: str | None,
        quick: bool,
        norm: str = "none",
    ) -> None:
        from fromp_avalanche.checkpoint import get_rng_state
        from fromp_bench.runner import _seed_everything

        self.name, self.kind, self.kwargs, self.seed, self.fraction = (
            name,
            kind,
            kwargs,
            seed,
            fraction,
        )
        sizes = dict(DATASETS[dataset])
        _seed_everything(seed)
        self.bench = _subset(
            _benchmark(dataset, seed, data_root), fraction, seed, 300 if quick else None
        )
        torch.manual_seed(seed)
        model = _model(sizes["inputs"], norm)
        epochs = 1 if quick else sizes["epochs"]
        common = dict(train_mb_size=sizes["batch"], train_epochs=epochs, eval_mb_size=1000,
                      device="cpu")  # fmt: skip
        self.strategy = _strategy(kind, kwargs, model, common, sizes)
        self.seconds: list[float] = []
        self.caught: list[Any] = []
        self._state = get_rng_state()

    def _swap(self) -> dict[str, Any]:
        """Put this run's random state in place; returns the one it replaced."""
        from fromp_avalanche.checkpoint import get_rng_state, set_rng_state

        theirs = get_rng_state()
        set_rng_state(self._state)
        return theirs

    def _restore(self, theirs: dict[str, Any]) -> None:
        """Keep this run's random state and put ``theirs`` back."""
        from fromp_avalanche.checkpoint import get_rng_state, set_rng_state

        self._state = get_rng_state()
        set_rng_state(theirs)

    def train(self, e: int) -> None:
        """Train experience ``e`` (timed: the strategy's ``train``, FROMP's work after the
        experience included)."""
        theirs = self._swap()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                t0 = time.perf_counter()
                self.strategy.train(self.bench.train_stream[e])
                self.seconds.append(time.perf_counter() - t0)
            self.caught += [str(w.message) for w in caught]
        finally:
            self._restore(theirs)

    def result(self) -> dict[str, Any]:
        """The accuracies after the last experience and the seconds."""
        theirs = self._swap()
        try:
            acc = _accuracies(self.strategy.eval(self.bench.test_stream))
        finally:
            self._restore(theirs)
        plugin = next((p for p in self.strategy.plugins if hasattr(p, "method")), None)
        out = {
            "config": self.name,
            "kind": self.kind,
            "kwargs": self.kwargs,
            "seed": self.seed,
            "fraction": self.fraction,
            "accuracy": acc,
            "mean_accuracy": sum(acc) / len(acc),
            "newest_accuracy": acc[-1],
            "train_seconds": self.seconds,
            "total_train_seconds": sum(self.seconds),
            "fromp_warnings": sorted({m for m in self.caught if "FROMP" in m}),
        }
        if plugin is not None:
            out["after_experience_seconds"] = [dict(t) for t in plugin.method.timings]
            method = plugin.method
            out["resolved"] = {
                "class_incremental": method.class_incremental,
                "tau": method.tau,
                "replay": method.replay,
                "replay_weight": method.replay_weight,
                "context_tau": method.context_tau,
                "function": method.function,
                "select": method.select,
                "kernel": method.kernel,
                "memory_points": method.memory_points(),
            }
        return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = harness.parser(__name__, __doc__)
    harness.add_data_root(parser)
    harness.add_out(parser)
    parser.add_argument("--dataset", choices=list(DATASETS), default="mnist")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--fraction", type=float, default=1.0)
    parser.add_argument("--configs", nargs="+", default=["replay", "fromp"])
    parser.add_argument("--set", action="append", default=[], metavar="NAME=JSON",
                        help="a FROMP configuration of keyword arguments")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="300 examples, 1 epoch")
    parser.add_argument("--norm", choices=list(NORMS), default="none",
                        help="a normalisation after each hidden layer of the MLP")  # fmt: skip
    args = parser.parse_args(argv)
    if not 0 < args.fraction <= 1:
        parser.error(f"--fraction must be in (0, 1], got {args.fraction}")
    configs = dict(CONFIGS)
    for item in args.set:
        name, _, text = item.partition("=")
        try:
            kw = json.loads(text)
        except json.JSONDecodeError as e:
            parser.error(f"--set {item!r}: not NAME=JSON ({e})")
        if not name or not isinstance(kw, dict):
            parser.error(f"--set {item!r}: not NAME=JSON object")
        configs[name] = ("fromp", kw)
    unknown = [c for c in args.configs if c not in configs]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; known: {sorted(configs)}")
    harness.prepare_out(args.out)
    protocol = {**DATASETS[args.dataset], "dataset": args.dataset, "fraction": args.fraction,
                "seeds": args.seeds, "quick": args.quick,
                "norm": args.norm}  # fmt: skip
    record: dict[str, Any] = {"protocol": protocol, "runs": []}
    for seed in args.seeds:
        runs = [
            _Run(args.dataset, name, *configs[name], seed, args.fraction, args.data_root,
                 args.quick, args.norm)
            for name in args.configs
        ]  # fmt: skip
        for e in range(len(runs[0].bench.train_stream)):  # interleaved: the order alternates
            for run in runs if (e + seed) % 2 == 0 else runs[::-1]:
                run.train(e)
        for run in runs:
            out = run.result()
            record["runs"].append(out)
            show = {k: out[k] for k in ("config", "seed", "mean_accuracy", "newest_accuracy")}
            print(json.dumps({**show, "seconds": round(out["total_train_seconds"], 1)}), flush=True)
        harness.write_record(args.out, record, module=__name__, argv=argv)
    return record


if __name__ == "__main__":
    main()
