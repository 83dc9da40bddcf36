"""What one training step of Naive, EWC and FROMP does on the host: aten operations by phase,
host-blocking calls, tensors made from host data, Python calls, wall time, a cProfile of
the strategy's training epoch and (``--trace``) a ``torch.profiler`` table, in one
experience of the runner's own strategies, against plain loops over the methods.

At the split-MNIST sizes (MLP 784-256-256, batches of 128) a GPU step is launch-bound: the
host's Python and dispatcher work per step is the step's time, so the CPU shows it. Each
strategy is built and trained by the runner (``fromp_bench.runner.run``, the registry's
settings; ``--n-train`` examples per task, ``--epochs`` epochs per task) with one probe
plugin added, which in experience ``--experience`` (two earlier ones learnt by default)
measures, epoch by epoch (``S`` the steps of an epoch, after the ``--skip`` first steps of
the experience, which hold FROMP's dominance check):

* epoch 1: the wall time of each iteration (from one ``before_training_iteration`` to the
  next: data loading included), nothing else running in the process;
* epoch 2: the aten operations each step dispatches (forward and backward), by phase (the
  strategy's own methods and the plugins' hooks, the method's penalty apart), the
  host-blocking operations (:data:`tests.cases.HOST_SYNC_OPS`, boolean-mask indexing) and
  the calls that make tensors from host data (``torch.tensor``, ``new_tensor``,
  ``as_tensor``, ``.to``/``.cuda``, ``lift_fresh``, ``scalar_tensor``) with where they are
  called; then the Python function calls per step, by phase (``sys.setprofile``);
* epoch 3: a cProfile of the whole epoch (``training_epoch``), the top functions;
* epoch 4 with ``--trace``: ``torch.profiler`` (CPU and, on CUDA, CUDA activities) over
  ``--trace-steps`` steps after the first ``--skip``, ``key_averages()`` tables kept short.

The plain loops (``--plain``): the same network, optimizer, data and method settings,
``begin_task`` / ``loss_terms`` / ``before_update`` / ``learn_task`` of the method (Naive:
none) in a loop over pre-made batches on the device, timed and counted the same way, so
that the strategy's per-step cost over Naive's splits into the method's and Avalanche's.

    python -m studies.step_overhead --data-root $FROMP_DATA --threads 1 \\
        --out benchmarks/results/gpu/step-overhead-cpu.json
    python -m studies.step_overhead --device cuda --trace --out OUT/step-overhead-cuda.json
"""

from __future__ import annotations

import contextlib
import cProfile
import functools
import io
import os
import pstats
import statistics
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from studies import harness
from tests.cases import StepRecorder, simulated_cuda_graphs

STRATEGIES = ("naive", "ewc", "fromp")
#: the strategy's methods and hooks a training iteration runs, and the phase each is
_PHASES = {
    "_unpack_minibatch": "unpack",
    "_before_training_iteration": "hooks",
    "_make_empty_loss": "loop",
    "_before_forward": "hooks",
    "forward": "forward",
    "_after_forward": "hooks",
    "criterion": "loss",
    "_before_backward": "method: before_backward",
    "backward": "backward",
    "_after_backward": "hooks",
    "_before_update": "method: before_update",
    "optimizer_step": "optimizer",
    "_after_update": "hooks",
    "_after_training_iteration": "hooks: after_iteration",
}


class Phases:
    """The current phase of a training iteration (a stack: the penalty within the method's
    hook), set by wrappers around the strategy's methods."""

    def __init__(self) -> None:
        self.stack: list[str] = []

    def __call__(self) -> str:
        return self.stack[-1] if self.stack else "dataloader"

    def wrap(self, name: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.stack.append(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stack.pop()

        return wrapped

    def install(self, strategy: Any, method: Any) -> None:
        for attr, name in _PHASES.items():
            setattr(strategy, attr, self.wrap(name, getattr(strategy, attr)))
        opt = strategy.optimizer
        opt.zero_grad = self.wrap("zero_grad", opt.zero_grad)
        install_penalty(self, method)


def install_penalty(phases: Phases, method: Any) -> None:
    """Mark the method's penalty (FROMP's ``terms``, EWC's ``_penalty``) as its own phase."""
    for attr in ("terms", "_penalty"):
        if method is not None and hasattr(method, attr):
            setattr(method, attr, phases.wrap("penalty", getattr(method, attr)))


def _roots() -> tuple[str, ...]:
    """The code whose host reads and uploads are named: fromp, the strategies, the runner
    and Avalanche."""
    import avalanche
    import fromp_avalanche
    import fromp_bench

    import fromp

    return tuple(
        str(Path(m.__file__).parent) for m in (fromp, fromp_avalanche, fromp_bench, avalanche)
    )


def _short(where: str) -> str:
    """``op@path:line (phase)`` with the path from its package on."""
    op, _, rest = where.rpartition("@")
    return f"{op}@{_short_path(rest)}" if op else _short_path(where)


def _short_path(where: str) -> str:
    for marker in (
        "/fromp/",
        "/strategies/",
        "/fromp_avalanche/",
        "/benchmarks/",
        "/fromp_bench/",
        "/avalanche/",
    ):
        if marker in where:
            return marker.strip("/") + "/" + where.split(marker, 1)[1]
    return where


def _per_step(counter: Counter, steps: int) -> dict[str, float]:
    out = {k: v / steps for k, v in sorted(counter.items(), key=lambda kv: -kv[1])}
    return {"total": sum(counter.values()) / steps, **out}


class StepWindow:
    """The per-step records of ``steps`` steps: operations (with reads and uploads) in
    one series of steps, Python calls in the next (:class:`tests.cases.StepRecorder`)."""

    def __init__(self, phases: Phases, steps: int) -> None:
        self.steps = steps
        self.ops = StepRecorder(_roots(), phases, what="ops")
        self.calls = StepRecorder(_roots(), phases, what="calls")

    def results(self) -> dict[str, Any]:
        n = self.steps
        names = {p: {k: v / n for k, v in c.most_common(12)} for p, c in self.ops.op_names.items()}
        return {
            "steps": n,
            "aten_ops_per_step": _per_step(self.ops.ops, n),
            "aten_ops_by_name_per_phase": names,
            "host_reads_per_step": {_short(k): v / n for k, v in Counter(self.ops.reads).items()},
            "host_uploads_per_step": {
                _short(k): v / n for k, v in Counter(self.ops.uploads).items()
            },
            "python_calls_per_step": _per_step(self.calls.all_calls, n),
            "own_python_calls_per_step": _per_step(self.calls.python_calls, n),
        }


def _profile_table(prof: Any, cuda: bool, rows: int) -> dict[str, str]:
    avg = prof.key_averages()
    out = {"self_cpu": avg.table(sort_by="self_cpu_time_total", row_limit=rows)}
    if cuda:
        out["self_cuda"] = avg.table(sort_by="self_cuda_time_total", row_limit=rows)
    return out


class Probe:
    """The measurements of one experience, as an Avalanche plugin (built lazily: Avalanche
    is imported by the runner)."""

    def __init__(self, experience: int, skip: int, steps: int, trace: int, device: str) -> None:
        self.experience, self.skip, self.steps, self.trace = experience, skip, steps, trace
        self.device = torch.device(device)
        self.phases = Phases()
        self.window = StepWindow(self.phases, steps)
        self.result: dict[str, Any] = {}
        self.stamps: list[float] = []
        self._active: list[Any] = []
        self._epoch = 0
        self._it = 0
        self._cprofile: cProfile.Profile | None = None
        self._torch_prof: Any = None

    # ---- the hooks
    def plugin(self) -> Any:
        from avalanche.core import SupervisedPlugin

        probe = self

        class ProbePlugin(SupervisedPlugin):
            def before_training_exp(self, strategy, *a, **k):  # type: ignore[no-untyped-def]
                probe._on = strategy.experience.current_experience == probe.experience - 1
                if probe._on:
                    probe.phases.install(
                        strategy,
                        getattr(strategy.plugin, "method", None)
                        if hasattr(strategy, "plugin")
                        else None,
                    )
                    probe._epoch = 0

            def before_training_epoch(self, strategy, *a, **k):  # type: ignore[no-untyped-def]
                if probe._on:
                    probe._epoch += 1
                    probe._it = 0
                    probe.epoch_start()

            def before_training_iteration(self, strategy, *a, **k):  # type: ignore[no-untyped-def]
                if probe._on:
                    probe._it += 1
                    probe.step_start()

            def after_training_iteration(self, strategy, *a, **k):  # type: ignore[no-untyped-def]
                if probe._on:
                    probe.step_end()

            def after_training_epoch(self, strategy, *a, **k):  # type: ignore[no-untyped-def]
                if probe._on:
                    probe.epoch_end()

        probe._on = False
        return ProbePlugin()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def epoch_start(self) -> None:
        if self._epoch == 3:
            self._cprofile = cProfile.Profile()
            self._cprofile.enable()
        elif self._epoch == 4 and self.trace:
            from torch.profiler import ProfilerActivity, profile, schedule

            acts = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                acts.append(ProfilerActivity.CUDA)
            wait = max(0, self.skip - 5)
            self._torch_prof = profile(
                activities=acts,
                record_shapes=False,
                schedule=schedule(wait=wait, warmup=5, active=self.trace, repeat=1),
            )
            self._torch_prof.__enter__()

    def epoch_end(self) -> None:
        if self._epoch == 1:
            gaps = [b - a for a, b in zip(self.stamps, self.stamps[1:])]
            gaps = gaps[self.skip : self.skip + self.steps]
            self.result["iteration_ms"] = {
                "steps": len(gaps),
                "median": 1e3 * statistics.median(gaps) if gaps else None,
                "mean": 1e3 * statistics.fmean(gaps) if gaps else None,
                "min": 1e3 * min(gaps) if gaps else None,
                "load_average": list(os.getloadavg()),
            }
        elif self._epoch == 2:
            self.result["step"] = self.window.results()
        elif self._epoch == 3 and self._cprofile is not None:
            self._cprofile.disable()
            self.result["cprofile"] = cprofile_summary(self._cprofile, self._it)
        elif self._epoch == 4 and self._torch_prof is not None:
            self._torch_prof.__exit__(None, None, None)
            self.result["torch_profiler"] = _profile_table(
                self._torch_prof, self.device.type == "cuda", 25
            )

    def step_start(self) -> None:
        if self._epoch == 1:
            self._sync()
            self.stamps.append(time.perf_counter())
        elif self._epoch == 2:
            k = self._it - self.skip
            if 1 <= k <= self.steps:
                self._active = [self.window.ops]
            elif self.steps < k <= 2 * self.steps:
                self._active = [self.window.calls]
            for rec in self._active:
                rec.start()

    def step_end(self) -> None:
        for rec in self._active:
            rec.stop()
        self._active = []
        if self._epoch == 4 and self._torch_prof is not None:
            self._torch_prof.step()


def cprofile_summary(prof: cProfile.Profile, steps: int, rows: int = 25) -> dict[str, Any]:
    """The top functions by own time, and the cumulative time of the step's parts, per
    step (milliseconds)."""
    stats = pstats.Stats(prof)
    entries = stats.stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in entries.values())

    def label(key: tuple) -> str:
        file, line, name = key
        for marker in ("/fromp/", "/strategies/", "/benchmarks/", "/avalanche/", "/torch/"):
            if marker in file:
                file = marker.strip("/") + "/" + file.split(marker, 1)[1]
                break
        return f"{name} ({file}:{line})"

    own = sorted(entries.items(), key=lambda kv: -kv[1][2])[:rows]
    cumulative = {}
    wanted = (
        "loss_terms",
        "before_update",
        "terms",
        "_penalty",
        "backward",
        "forward",
        "step",
        "clip_grad_norm_",
        "_next_data",
        "after_training_iteration",
        "before_backward",
        "after_backward",
        "training_epoch",
        "_unpack_minibatch",
    )
    for key, (_, ncalls, _tt, ct, _) in entries.items():
        if key[2] in wanted and ncalls >= steps:
            cumulative[label(key)] = {
                "calls_per_step": ncalls / steps,
                "ms_per_step": 1e3 * ct / steps,
            }
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(rows)
    return {
        "steps": steps,
        "total_ms_per_step": 1e3 * total / steps,
        "own_time_top": [
            {
                "function": label(k),
                "calls_per_step": v[1] / steps,
                "own_ms_per_step": 1e3 * v[2] / steps,
                "cumulative_ms_per_step": 1e3 * v[3] / steps,
            }
            for k, v in own
        ],
        "cumulative": dict(sorted(cumulative.items(), key=lambda kv: -kv[1]["ms_per_step"])),
    }


# ------------------------------------------------------------------------ the runner
def through_runner(strategy: str, args: Any) -> dict[str, Any]:
    """``strategy`` trained by the runner with the probe in experience ``args.experience``."""
    from fromp_bench.registry import StrategySpec
    from fromp_bench.runner import RunConfig, run

    trace = args.trace_steps if args.trace else 0
    probe = Probe(args.experience, args.skip, args.steps, trace, args.device)
    original = StrategySpec.load_class

    def load_class(spec: StrategySpec) -> type:
        cls = original(spec)
        init = cls.__init__

        @functools.wraps(init)  # the runner reads the class's signature
        def __init__(self: Any, *a: Any, **k: Any) -> None:
            init(self, *a, **{**k, "plugins": [*(k.get("plugins") or []), probe.plugin()]})

        return type(cls.__name__, (cls,), {"__init__": __init__})

    overrides: dict[str, Any] = {"train_epochs": 4 if args.trace else 3}
    if args.set_kwargs:
        overrides["kwargs"] = dict(args.set_kwargs)
    cfg = RunConfig(
        args.benchmark,
        strategy,
        data_root=args.data_root,
        device=args.device,
        overrides=overrides,
        n_train=args.n_train,
        n_test=64,
        stop_after=args.experience,
        progress=False,
    )
    StrategySpec.load_class = load_class  # type: ignore[method-assign]
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run(cfg)
    finally:
        StrategySpec.load_class = original  # type: ignore[method-assign]
    return {**probe.result, "run_s": time.perf_counter() - t0}


# ------------------------------------------------------------------------ plain loops
def plain_loop(strategy: str, args: Any) -> dict[str, Any]:
    """The strategy's step without Avalanche: the registry's network, optimizer, settings
    and method, over pre-made batches on the device; experiences before
    ``args.experience`` learnt with one epoch each (their number of steps)."""
    from fromp_bench.registry import get_benchmark, get_strategy
    from fromp_bench.runner import load_sequence, resolve_settings

    from fromp.continual.ewc import EWCMethod
    from fromp.continual.methods import FROMPMethod
    from fromp.models import with_task

    bench, strat = get_benchmark(args.benchmark), get_strategy(strategy)
    settings = resolve_settings(bench, strat, {"kwargs": dict(args.set_kwargs or {})})
    seq = load_sequence(bench, args.data_root, args.n_train, 64)
    torch.manual_seed(0)
    dev = torch.device(args.device)
    net = bench.model(seq).to(dev)
    opt = torch.optim.Adam(net.parameters(), lr=float(settings["lr"]))
    b = int(settings["train_mb_size"])
    kwargs = dict(settings["kwargs"])
    method: Any = None
    if strategy == "ewc":
        method = EWCMethod(batch_size=b, **kwargs)
    elif strategy == "fromp":
        method = FROMPMethod(**kwargs)
    phases = Phases()
    install_penalty(phases, method)

    def step(x: torch.Tensor, y: torch.Tensor, t: int) -> None:
        phases.stack.append("forward")
        out = with_task(net, t)(x)
        phases.stack[-1] = "loss"
        loss = F.cross_entropy(out, y)
        if method is not None:
            phases.stack[-1] = "method: loss_terms"
            loss = loss + method.loss_terms(net, x, out, task=t, loss=loss)
        phases.stack[-1] = "zero_grad"
        opt.zero_grad()
        phases.stack[-1] = "backward"
        loss.backward()
        if method is not None:
            phases.stack[-1] = "method: before_update"
            method.before_update(net, opt)
        phases.stack[-1] = "optimizer"
        opt.step()
        phases.stack.pop()

    window = StepWindow(phases, args.steps)
    out: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for e in range(args.experience):
            task = seq[e]
            t = task.task_id if seq.multi_head else 0
            x, y = task.train_x.to(dev), task.train_y.to(dev)
            batches = [(x[s : s + b], y[s : s + b]) for s in range(0, len(x) - b + 1, b)]
            if method is not None:
                method.begin_task(net, task=t, experience=e, ess=len(x), classes=task.classes)
            if e < args.experience - 1:
                for xb, yb in batches:
                    step(xb, yb, t)
                if method is not None:
                    method.learn_task(net, x, y, t, optimizer=opt, experience=e)
                continue
            loop = batches * (1 + (2 * args.skip + 3 * args.steps) // len(batches))
            for xb, yb in loop[: args.skip]:  # FROMP's dominance check: its first steps
                step(xb, yb, t)
            work = loop[args.skip : args.skip + args.steps]
            times = []
            for xb, yb in work:
                t0 = time.perf_counter()
                step(xb, yb, t)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                times.append(time.perf_counter() - t0)
            out["step_ms"] = {
                "median": 1e3 * statistics.median(times),
                "mean": 1e3 * statistics.fmean(times),
                "min": 1e3 * min(times),
                "load_average": list(os.getloadavg()),
            }
            for xb, yb in work:
                with window.ops:
                    step(xb, yb, t)
            for xb, yb in work:
                with window.calls:
                    step(xb, yb, t)
    return {**out, "step": window.results()}


# ------------------------------------------------------------------------ the report
def _cell(r: dict, *path: str) -> str:
    v: Any = r
    for k in path:
        v = v.get(k) if isinstance(v, dict) else None
    return "–" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))


def _table(rows: dict[str, dict], time_key: str) -> list[str]:
    """Per strategy: wall time, operations and Python calls per step by phase, host reads
    and uploads."""
    names = list(rows)
    out = ["| per step | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]

    def line(label: str, *path: str) -> None:
        out.append(f"| {label} | " + " | ".join(_cell(rows[n], *path) for n in names) + " |")

    line("wall ms (median)", time_key, "median")
    for key, label in (
        ("aten_ops_per_step", "aten operations"),
        ("python_calls_per_step", "Python calls"),
    ):
        line(label, "step", key, "total")
        phases: list[str] = []
        for n in names:
            phases += [p for p in rows[n]["step"][key] if p not in phases and p != "total"]
        for p in phases:
            line(f"&nbsp; {p}", "step", key, p)
    line(
        "Python calls of fromp's and the strategies' code",
        "step",
        "own_python_calls_per_step",
        "total",
    )
    for key, label in (
        ("host_reads_per_step", "host reads"),
        ("host_uploads_per_step", "host uploads / device moves"),
    ):
        out.append(
            f"| {label} | "
            + " | ".join(f"{sum(rows[n]['step'][key].values()):g}" for n in names)
            + " |"
        )
    out.append("")
    for n in names:
        found = {
            **rows[n]["step"]["host_reads_per_step"],
            **rows[n]["step"]["host_uploads_per_step"],
        }
        if found:
            out.append(f"- {n}: " + "; ".join(f"`{k}` x{v:g}" for k, v in found.items()))
    return [*out, ""]


def markdown(record: dict[str, Any]) -> str:
    """The record's tables: per step, by strategy (through the runner, then plain)."""
    env = record["environment"]
    lines = [
        f"# Per-step host work of Naive, EWC and FROMP ({record['benchmark']}, "
        f"experience {record['experience']})",
        "",
        f"`{record['command']}`",
        "",
        f"torch {env['torch']}, device {env.get('device')}, {env['threads']} thread(s); "
        f"{record['n_train']} training examples per task, the registry's batches; steps "
        f"{record['skip'] + 1}-{record['skip'] + record['steps']} of the experience (wall "
        f"time, then operations), then the next {record['steps']} (Python calls)."
        + (
            " CUDA-graph steps simulated (the replay a no-op: the host work of a GPU step, "
            "not its values)."
            if record.get("simulated_graphs")
            else ""
        ),
        "",
    ]
    for where, title, key in (
        ("runner", "Through the runner's Avalanche strategy", "iteration_ms"),
        ("plain", "Plain loop over the method (no Avalanche)", "step_ms"),
    ):
        if record.get(where):
            lines += [f"## {title}", "", *_table(record[where], key)]
    for where in ("runner",):
        for name, r in (record.get(where) or {}).items():
            cp = r.get("cprofile")
            if not cp:
                continue
            lines += [
                f"### cProfile, {name}: {cp['total_ms_per_step']:.2f} ms of profiled "
                "Python per step",
                "",
                "| function | calls/step | own ms/step | cum ms/step |",
                "|---|---|---|---|",
            ]
            for row in cp["own_time_top"][:12]:
                lines.append(
                    f"| `{row['function']}` | {row['calls_per_step']:.1f} | "
                    f"{row['own_ms_per_step']:.3f} | "
                    f"{row['cumulative_ms_per_step']:.3f} |"
                )
            lines.append("")
    for name, tables in (record.get("torch_profiler") or {}).items():
        for key, text in tables.items():
            lines += [f"### torch.profiler, {name}, by {key}", "", "```", text.strip(), "```", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = harness.parser(__name__, __doc__)
    ap.add_argument("--benchmark", default="split-mnist")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--n-train", type=int, default=128 * 70, help="examples per task")
    ap.add_argument("--experience", type=int, default=3, help="the experience measured (1-based)")
    ap.add_argument("--skip", type=int, default=20, help="first steps of the epoch not measured")
    ap.add_argument("--steps", type=int, default=20, help="steps measured per kind")
    ap.add_argument("--trace", action="store_true", help="a torch.profiler table (epoch 4)")
    ap.add_argument("--trace-steps", type=int, default=50, help="steps the profiler records")
    ap.add_argument("--no-plain", dest="plain", action="store_false", help="no plain loops")
    ap.add_argument(
        "--set",
        dest="set_kwargs",
        action="append",
        type=_kv,
        default=[],
        help="a method keyword, KEY=VALUE (Python literal), for every strategy",
    )
    ap.add_argument(
        "--simulate-graphs",
        action="store_true",
        help="the CUDA-graph path with its replay a no-op (host work of a GPU step)",
    )
    ap.add_argument("--device", default="cpu")
    harness.add_data_root(ap)
    harness.add_threads(ap, 1)
    harness.add_out(ap)
    args = ap.parse_args(argv)
    out = harness.prepare_out(args.out)
    harness.set_threads(args.threads)
    names = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown or args.experience < 1 or args.steps < 1 or args.skip < 0:
        raise SystemExit(f"--strategies {unknown} / --experience / --steps / --skip refused")
    record: dict[str, Any] = {
        "benchmark": args.benchmark,
        "experience": args.experience,
        "n_train": args.n_train,
        "skip": args.skip,
        "steps": args.steps,
        "runner": {},
        "plain": {},
        "torch_profiler": {},
    }
    record["simulated_graphs"] = args.simulate_graphs
    graphs = simulated_cuda_graphs if args.simulate_graphs else contextlib.nullcontext
    for name in names:
        with graphs():
            res = through_runner(name, args)
            record["torch_profiler"][name] = res.pop("torch_profiler", None) or {}
            record["runner"][name] = res
            if args.plain:
                record["plain"][name] = plain_loop(name, args)
        print(f"{name}: {res.get('iteration_ms')}", flush=True)
    full = harness.write_record(
        out,
        record,
        module=__name__,
        argv=argv,
        device=args.device,
        allow_non_finite=("load_average",),
    )
    out.with_suffix(".md").write_text(markdown(full))
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return full


def _kv(text: str) -> tuple[str, Any]:
    import ast

    key, _, value = text.partition("=")
    with contextlib.suppress(ValueError, SyntaxError):
        return key, ast.literal_eval(value)
    return key, value


if __name__ == "__main__":
    main()
