"""The settings where FROMP used to fall below Naive, re-run as a user runs them in Avalanche.

Each case is a plain Avalanche script (the strategy built from its class, the model from
Avalanche or torchvision, the benchmark from Avalanche's classic ones where one exists), so
the numbers are what a user of ``fromp_avalanche`` gets without the runner's settings:

* ``ci/<config>``: class-incremental ``SplitMNIST(n_experiences=5, seed=0)`` with its default
  labels, an MLP 784-256-256 with Avalanche's ``IncrementalClassifier`` (masking on, its
  default), Adam 10⁻³, batches of 128, ``--ci-epochs`` epochs per experience on the whole
  training set. Configurations (:data:`CI_CONFIGS`): Avalanche's Naive, LwF (α = 1,
  temperature 2), Replay with a buffer of 200 and of 1,000 examples in all (``mem_size``);
  ``FROMP()`` with its defaults, with 200 memorable points per experience, and the
  class-incremental recipe of docs/avalanche.md (200 points per experience replayed as a
  labelled coreset with weight 30, the logits' penalty at τ = 0.1, the context term at 0.3).
  FROMP's 200 points per experience hold 1,000 examples after the fifth experience, the
  memory of Replay(1000); Replay(200) is a fifth of it.
* ``bn/<model>/<config>``: batch norm with running statistics on one head: two permuted-MNIST
  experiences of ``--bn-train`` training examples (the test sets whole), the images padded
  to 32 x 32 and repeated over 3 channels, Avalanche's ``SlimResNet18`` and torchvision's
  ``resnet18(num_classes=10)``, Adam 10⁻³, batches of 32, ``--bn-epochs`` epochs; Naive
  against ``FROMP()`` with its defaults.
* ``cost/resnet18``: what FROMP's after-experience step costs against training on a ResNet:
  torchvision's ResNet-18 on two experiences of ``--cost-train`` CIFAR-shaped examples
  ``[3, 32, 32]`` (ten class templates plus noise; the second experience's labels permuted),
  one epoch each at batch 128 with Adam 10⁻³, Naive and ``FROMP()`` with its defaults (curvature on
  a subsample of 1,000 examples). Recorded: each experience's training seconds (synchronised;
  Naive's and FROMP's, whose second experience carries the penalty), FROMP's after-experience
  phases (memorable selection, curvature, kernels) and their total over the first
  experience's training epoch.

Every case records the test accuracy matrix (row ``j``: every experience's accuracy after
experience ``j``, in %), the mean after the last experience, the seconds, and whether FROMP's
dominance warning fired. A case that raises is recorded with its error, never with a number;
the record is rewritten after each case.

    python -m studies.user_scenarios --device cuda --data-root DATA \\
        --out benchmarks/results/gpu/user_scenarios.json [--cases ci bn cost] [--quick]

``--quick`` runs every case on small sizes (a few hundred examples, one epoch): what the
tests run on the CPU.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from studies import harness

#: class-incremental configurations: (kind, keyword arguments)
CI_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "naive": ("naive", {}),
    "lwf": ("lwf", {"alpha": 1.0, "temperature": 2.0}),
    "replay-200": ("replay", {"mem_size": 200}),
    "replay-1000": ("replay", {"mem_size": 1000}),
    "fromp-defaults": ("fromp", {}),
    "fromp-200": ("fromp", {"n_points": 200}),
    "fromp-recipe": (
        "fromp",
        {
            "n_points": 200,
            "replay": True,
            "replay_weight": 30.0,
            "function": "logits",
            "tau": 0.1,
            "context_tau": 0.3,
        },
    ),
}
BN_MODELS = ("slimresnet18", "resnet18")
BN_CONFIGS = ("naive", "fromp-defaults")


def _evaluator():
    from avalanche.evaluation.metrics import accuracy_metrics
    from avalanche.training.plugins import EvaluationPlugin

    return EvaluationPlugin(accuracy_metrics(experience=True), loggers=[])


def _strategy(kind: str, kwargs: dict[str, Any], model: nn.Module, optimizer, common: dict):
    from avalanche.training import LwF, Naive, Replay
    from fromp_avalanche.fromp import FROMP

    args = dict(model=model, optimizer=optimizer, evaluator=_evaluator(), **common)
    if kind != "fromp":  # Avalanche's baselines take the criterion as a required keyword
        args["criterion"] = nn.CrossEntropyLoss()
    if kind == "naive":
        return Naive(**args)
    if kind == "lwf":
        return LwF(**args, **kwargs)
    if kind == "replay":
        return Replay(**args, **kwargs)
    if kind == "fromp":
        return FROMP(**args, **kwargs)
    raise ValueError(f"unknown strategy kind {kind!r}")


def _accuracies(res: dict[str, Any]) -> list[float]:
    keys = sorted(k for k in res if k.startswith("Top1_Acc_Exp/eval_phase/test_stream"))
    return [100 * float(res[k]) for k in keys]


def _run_stream(strategy, train_stream, test_stream, device: torch.device) -> dict[str, Any]:
    """Train on each experience, evaluate on the whole test stream after each; seconds of
    each experience's ``train`` (synchronised), FROMP's phase timings when it has them. A
    run whose loss or weights are not finite after an experience is refused
    (:func:`~studies.avalanche_models.check_trained`), so the case is recorded
    as an error, never with an accuracy."""
    from studies.avalanche_models import check_trained

    rows, train_s = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for exp in train_stream:
            harness.sync(device)
            t0 = time.perf_counter()
            strategy.train(exp)
            harness.sync(device)
            train_s.append(time.perf_counter() - t0)
            check_trained(strategy, f"experience {len(train_s) - 1}")
            rows.append(_accuracies(strategy.eval(test_stream)))
    plugin = next((p for p in strategy.plugins if hasattr(p, "method")), None)
    out: dict[str, Any] = {
        "accuracy_matrix": rows,
        "mean_accuracy": sum(rows[-1]) / len(rows[-1]),
        "train_seconds": train_s,
        "dominance_warning": [str(w.message) for w in caught if "dominates" in str(w.message)][:1],
    }
    if plugin is not None:
        out["fromp_phase_seconds"] = [dict(t) for t in plugin.method.timings]
    return out


def _mlp_incremental() -> nn.Module:
    from avalanche.models import IncrementalClassifier

    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 256),
        nn.ReLU(),
        nn.Linear(256, 256),
        nn.ReLU(),
        IncrementalClassifier(256),
    )


def case_ci(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from avalanche.benchmarks.classic import SplitMNIST
    from fromp_bench.data import resolve_data_root

    kind, kwargs = CI_CONFIGS[name]
    torch.manual_seed(args.seed)
    # torchvision's MNIST under the data root (--data-root, $FROMP_DATA or ./data), read
    # from its extracted files (MNIST/raw/*-ubyte)
    root = str(resolve_data_root(args.data_root))
    bench = SplitMNIST(n_experiences=5, seed=0, dataset_root=root)
    if args.quick:  # the same experiences, 200 examples of each
        from avalanche.benchmarks.scenarios.dataset_scenario import benchmark_from_datasets
        from avalanche.benchmarks.scenarios.supervised import with_classes_timeline
        from avalanche.benchmarks.scenarios.task_aware import with_task_labels

        part = {
            s: [e.dataset.subset(range(200)) for e in getattr(bench, f"{s}_stream")]
            for s in ("train", "test")
        }
        bench = with_classes_timeline(with_task_labels(benchmark_from_datasets(**part)))
    train_stream, test_stream = bench.train_stream, bench.test_stream
    model = _mlp_incremental()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    common = dict(train_mb_size=128, train_epochs=args.ci_epochs, eval_mb_size=1000, device=device)
    strategy = _strategy(kind, kwargs, model, opt, common)
    return {
        "strategy": kind,
        "kwargs": kwargs,
        **_run_stream(strategy, train_stream, test_stream, device),
    }


def _scenario(name: str, tasks: list[tuple[torch.Tensor, ...]]):
    """An Avalanche scenario of one-head experiences from ``(train_x, train_y, test_x,
    test_y)`` tuples."""
    from fromp_bench.data import Task, TaskSequence, to_avalanche

    seq = TaskSequence(
        name=name,
        tasks=[
            Task(a, b, c, d, task_id=i, classes=list(range(10)))
            for i, (a, b, c, d) in enumerate(tasks)
        ],
        multi_head=False,
        input_shape=(3, 32, 32),
        n_outputs=10,
    )
    return to_avalanche(seq)


def _permuted_32(data_root: str, n_train: int, n_test: int | None, seed: int):
    """Two permuted-MNIST experiences (the first unpermuted) as 3 x 32 x 32 images."""
    from fromp_bench.data import load_mnist

    xtr, ytr, xte, yte = load_mnist(data_root, download=False)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(len(xtr), generator=g)[:n_train]
    perms = [torch.arange(784), torch.randperm(784, generator=g)]

    def image(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        x = x.reshape(len(x), 784)[:, p].reshape(len(x), 1, 28, 28)
        return F.pad(x, (2, 2, 2, 2)).expand(-1, 3, -1, -1).contiguous()

    xte, yte = xte[:n_test], yte[:n_test]
    return _scenario(
        "permuted-mnist-32", [(image(xtr[idx], p), ytr[idx], image(xte, p), yte) for p in perms]
    )


def _bn_model(name: str) -> nn.Module:
    if name == "slimresnet18":
        from avalanche.models import SlimResNet18

        return SlimResNet18(10)
    import torchvision

    return torchvision.models.resnet18(num_classes=10)


def case_bn(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    model_name, config = name.split("/")
    torch.manual_seed(args.seed)
    bench = _permuted_32(args.data_root, args.bn_train, 200 if args.quick else None, args.seed)
    model = _bn_model(model_name)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    common = dict(train_mb_size=32, train_epochs=args.bn_epochs, eval_mb_size=500, device=device)
    kind = "naive" if config == "naive" else "fromp"
    strategy = _strategy(kind, {}, model, opt, common)
    return {
        "strategy": kind,
        "model": model_name,
        **_run_stream(strategy, bench.train_stream, bench.test_stream, device),
    }


def _templates_stream(n_train: int, n_test: int, seed: int):
    """Two CIFAR-shaped experiences: ten fixed class templates plus noise; the second
    experience maps template ``c`` to label ``(c + 3) % 10``."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(10, 3, 32, 32, generator=g)

    def draw(n: int, shift: int):
        c = torch.randint(0, 10, (n,), generator=g)
        x = templates[c] + 2.0 * torch.randn(n, 3, 32, 32, generator=g)
        return x, (c + shift) % 10

    return _scenario("templates-32", [(*draw(n_train, s), *draw(n_test, s)) for s in (0, 3)])


def case_cost(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for config in ("naive", "fromp-defaults"):
        torch.manual_seed(args.seed)
        bench = _templates_stream(args.cost_train, max(args.cost_train // 5, 100), args.seed)
        model = _bn_model("resnet18")
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        common = dict(train_mb_size=128, train_epochs=1, eval_mb_size=500, device=device)
        kind = "naive" if config == "naive" else "fromp"
        strategy = _strategy(kind, {}, model, opt, common)
        out[config] = _run_stream(strategy, bench.train_stream, bench.test_stream, device)
        if kind == "fromp":
            out["steps"] = _step_times(strategy, bench, device, args.quick)
    fromp = out["fromp-defaults"]
    phases = fromp["fromp_phase_seconds"][0]
    after = sum(float(v) for v in phases.values())
    training = fromp["train_seconds"][0] - after
    out["after_experience_seconds"] = after
    out["first_epoch_training_seconds"] = training
    out["after_experience_over_epoch"] = after / training
    # the second experience's training with the penalty, its after-experience step apart
    second = fromp["train_seconds"][1] - sum(
        float(v) for v in fromp["fromp_phase_seconds"][1].values()
    )
    out["second_experience_training_over_naive"] = second / out["naive"]["train_seconds"][1]
    return out


def _timed(fn, device: torch.device, reps: int) -> float:
    """The median seconds of ``reps`` synchronised calls of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        harness.sync(device)
        t0 = time.perf_counter()
        fn()
        harness.sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _step_times(strategy, bench, device: torch.device, quick: bool) -> dict[str, float]:
    """After FROMP's second experience, on its network (eval mode for the curvature, train
    mode for the steps): the diagonal GGN of 1,000 training examples with the kernels'
    Jacobian chunk (64, FROMP's curvature chunk before) and with the device's memory budget
    (FROMP's now); one training step of a batch of 128 (forward, cross-entropy, backward)
    without and with FROMP's penalty ``tau * R``."""
    from fromp.curvature.diagonal import diag_ggn
    from fromp.curvature.jacobian import default_memory_budget

    net, method = strategy.model, strategy.plugin.method
    data = bench.train_stream[1].dataset
    n = 64 if quick else 1000
    x = torch.stack([data[i][0] for i in range(n)]).to(device)
    xb, yb = x[:128], torch.stack([torch.as_tensor(data[i][1]) for i in range(len(x[:128]))])
    yb = yb.to(device)
    out: dict[str, float] = {"curvature_examples": n}
    net.eval()
    for key, kw in (
        ("chunk_64", {"chunk_size": 64}),
        ("memory_budget", {"memory_budget": default_memory_budget(device)}),
    ):
        out[f"diag_ggn_{key}_s"] = _timed(
            lambda kw=kw: diag_ggn(net, x, "categorical", **kw), device, 1 if quick else 3
        )
    net.train()

    def step(with_penalty: bool) -> None:
        net.zero_grad(set_to_none=True)
        loss = F.cross_entropy(net(xb), yb)
        if with_penalty:
            loss = loss + method.tau * method.penalty(net)
        loss.backward()

    reps = 2 if quick else 20
    out["step_s"] = _timed(lambda: step(False), device, reps)
    out["step_with_penalty_s"] = _timed(lambda: step(True), device, reps)
    out["memorable_points"] = sum(len(m.inputs) for m in method.regularizer.memories)
    net.zero_grad(set_to_none=True)
    return out


CASES = {
    "ci": ([f"ci/{n}" for n in CI_CONFIGS], case_ci),
    "bn": ([f"bn/{m}/{c}" for m in BN_MODELS for c in BN_CONFIGS], case_bn),
    "cost": (["cost/resnet18"], case_cost),
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = harness.parser(__name__, __doc__)
    harness.add_data_root(parser)
    harness.add_out(parser, harness.RESULTS / "gpu" / "user_scenarios.json")
    harness.add_seed(parser)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="case names to run (e.g. ci/naive), of those --cases selects",
    )
    parser.add_argument("--ci-epochs", type=int, default=5)
    parser.add_argument("--bn-train", type=int, default=500)
    parser.add_argument("--bn-epochs", type=int, default=3)
    parser.add_argument("--cost-train", type=int, default=10000)
    parser.add_argument("--quick", action="store_true", help="small sizes, 1 epoch")
    args = parser.parse_args(argv)
    for key in ("ci_epochs", "bn_train", "bn_epochs", "cost_train"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.quick:
        args.ci_epochs, args.bn_train, args.bn_epochs, args.cost_train = 1, 64, 1, 256
    device = torch.device(args.device)
    harness.prepare_out(args.out)
    names = [(n, fn) for key in args.cases for n, fn in [(m, CASES[key][1]) for m in CASES[key][0]]]
    if args.only:
        unknown = sorted(set(args.only) - {n for n, _ in names})
        if unknown:
            parser.error(f"--only: unknown case(s) {unknown}; known: {[n for n, _ in names]}")
        names = [(n, fn) for n, fn in names if n in args.only]
    protocol = {
        k: getattr(args, k)
        for k in ("ci_epochs", "bn_train", "bn_epochs", "cost_train", "seed", "quick")
    }
    record: dict[str, Any] = {
        "protocol": protocol,
        "cases": {n: {"status": "pending"} for n, _ in names},
    }
    for name, fn in names:
        t0 = time.perf_counter()
        try:
            sub = name.split("/", 1)[1]
            result = {"status": "ok", **fn(sub, args, device)}
        except Exception as e:  # recorded, never a number
            result = {
                "status": "error",
                "reason": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-2000:],
            }
        result["seconds"] = time.perf_counter() - t0
        record["cases"][name] = result
        print(
            json.dumps(
                {
                    "case": name,
                    "status": result["status"],
                    "mean_accuracy": result.get("mean_accuracy"),
                    "seconds": round(result["seconds"], 1),
                }
            ),
            flush=True,
        )
        harness.write_record(args.out, record, module=__name__, argv=argv, device=device)
    return record


if __name__ == "__main__":
    main()
