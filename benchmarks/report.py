"""Reports: a Markdown table next to the published numbers, accuracy matrices, JSON, plots."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from fromp_bench.registry import STRATEGIES, BenchmarkSpec

__all__ = [
    "aggregate",
    "command_line",
    "group_key",
    "image_grid",
    "kwarg_defaults",
    "log_norm",
    "markdown_report",
    "plot_accuracy",
    "plot_kernel",
    "portable",
    "save_json",
    "select",
    "to_image",
]


def _mean_std(values: Sequence[float | None]) -> tuple[float | None, float | None, int]:
    v = [x for x in values if x is not None]
    if not v:
        return None, None, 0
    return float(np.mean(v)), float(np.std(v)) if len(v) > 1 else 0.0, len(v)


def _nan_to_none(rows: Any) -> Any:
    if isinstance(rows, list):
        return [_nan_to_none(r) for r in rows]
    return None if rows is None or np.isnan(rows) else float(rows)


_PHASES = ("training_s", "memorable_s", "curvature_s", "kernel_s", "evaluation_s")


_CODE: dict[str, Any] = {}


def code_record() -> dict[str, Any]:
    """Which code made a run: the package version, a SHA-256 of the sources of ``fromp``,
    ``strategies`` and ``benchmarks`` (every ``.py`` file, path and content, in sorted order)
    and the git commit when the checkout is clean (None otherwise or outside git)."""
    if not _CODE:
        import hashlib
        import subprocess
        from pathlib import Path

        import fromp

        root = Path(__file__).resolve().parents[1]
        h = hashlib.sha256()
        for pkg in _PACKAGES:
            for f in sorted((root / pkg).rglob("*.py")):
                h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
        commit = None
        try:
            git = ["git", "-C", str(root)]
            dirty = subprocess.run([*git, "status", "--porcelain", "--", *_PACKAGES],
                                   capture_output=True, text=True, timeout=10)  # fmt: skip
            head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True,
                                  timeout=10)  # fmt: skip
            if dirty.returncode == 0 and not dirty.stdout.strip() and head.returncode == 0:
                commit = head.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
        _CODE.update(version=fromp.__version__, source_hash=h.hexdigest()[:16], git_commit=commit)
    return dict(_CODE)


_PACKAGES = ("fromp", "strategies", "benchmarks")


def env_record(device: str) -> dict[str, Any]:
    """Python, torch and NumPy versions and the device a run used."""
    import platform

    import torch

    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor()
    return {"python": platform.python_version(), "torch": torch.__version__,
            "numpy": np.__version__, "device": device, "device_name": name}  # fmt: skip


def group_key(run: dict[str, Any]) -> str:
    """What must be identical for two runs to be seeds of one experiment: the benchmark,
    strategy, resolved settings, subsample sizes, validation split, number of processes
    (data-parallel runs), data fingerprint and the code that made them (runs of two code
    versions are never averaged)."""
    cfg = run.get("config", {})
    data = run.get("data") or {}
    key = {
        "benchmark": run.get("benchmark"),
        "strategy": run.get("strategy"),
        "settings": run.get("settings"),
        "n_train": cfg.get("n_train"),
        "n_test": cfg.get("n_test"),
        "valid_fraction": cfg.get("valid_fraction"),
        "valid_seed": cfg.get("valid_seed", 0),
        "world_size": (run.get("distributed") or {}).get("world_size", 1),
        "data": (data.get("fingerprint") or {}).get("hash"),
        "code": (run.get("code") or {}).get("source_hash"),
    }
    return json.dumps(key, sort_keys=True)


def _flat(settings: dict[str, Any]) -> dict[str, Any]:
    # a run without lr_schedule / lr_warmup / optimizer_state (the keys are absent unless set,
    # so earlier runs keep their settings ids) ran the constant step size without warm-up and
    # kept the optimizer's state
    out: dict[str, Any] = {"lr_schedule": "constant", "lr_warmup": 0, "optimizer_state": "keep"}
    out.update({k: v for k, v in settings.items() if k not in ("kwargs", "optimizer_kwargs")})
    out.update(settings.get("kwargs") or {})
    out.update({f"opt.{k}": v for k, v in (settings.get("optimizer_kwargs") or {}).items()})
    return out


def kwarg_defaults(strategy: str) -> dict[str, Any]:
    """The keyword defaults of ``strategy``'s class (its registry target; FROMP's include
    its method's), or nothing when the name or class cannot be resolved."""
    import inspect

    spec = STRATEGIES.get(strategy)
    if spec is None:
        return {}
    try:
        params = inspect.signature(spec.load_class()).parameters
    except (ImportError, AttributeError, TypeError, ValueError):
        return {}
    out = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
    out.update(spec.kwargs)  # the strategy's presets (e.g. fromp-l2's kernel)
    return out


def _fill_defaults(
    strategy: str, flats: dict[str, dict[str, Any]], settings: list[dict[str, Any]]
) -> None:
    """A keyword argument set in some of a strategy's groups and absent from others took
    the class's default there: fill it in, so that labels say ``curvature_combine=sum``
    rather than ``None``."""
    keys = {k for s in settings for k in (s.get("kwargs") or {})}
    missing = {k for k in keys if any(k not in fl for fl in flats.values())}
    if not missing:
        return
    defaults = kwarg_defaults(strategy)
    for fl in flats.values():
        for k in missing:
            if k not in fl and k in defaults:
                fl[k] = defaults[k]


def _labels(groups: dict[str, list[dict[str, Any]]]) -> dict[str, str]:
    """A row label per group: the strategy name, plus the settings that differ from the other
    groups of the same strategy (``fromp [tau=30]``), plus ``(n_train=..)``-style notes when
    only the protocol differs."""
    by_strategy: dict[str, list[str]] = {}
    for key, runs in groups.items():
        by_strategy.setdefault(runs[0]["strategy"], []).append(key)
    labels = {}
    for name, keys in by_strategy.items():
        if len(keys) == 1:
            labels[keys[0]] = name
            continue
        flats = {k: _flat(groups[k][0].get("settings") or {}) for k in keys}
        _fill_defaults(name, flats, [groups[k][0].get("settings") or {} for k in keys])
        protos = {k: {kk: v for kk, v in json.loads(k).items() if kk != "settings"} for k in keys}
        for k in keys:
            parts = []
            for field in sorted({f for fl in flats.values() for f in fl}):
                values = {json.dumps(flats[o].get(field), sort_keys=True) for o in keys}
                if len(values) > 1:
                    parts.append(f"{field}={flats[k].get(field)}")
            for field in sorted(protos[k]):
                values = {json.dumps(protos[o].get(field)) for o in keys}
                if len(values) > 1:
                    value = protos[k][field]
                    parts.append(f"{field}={value[:8] if field == 'data' and value else value}")
            labels[k] = f"{name} [{', '.join(parts)}]"
    return labels


def aggregate(results: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Group complete runs by :func:`group_key` (runs with different settings or data are
    never averaged together); mean and std over seeds of every score. Failed and incomplete
    runs are left out; a seed given twice in a group counts once (the later run).

    Returns:
        ``{label: {"strategy", "settings", "seeds": [...], "mean_accuracy": {mean, std}, ...,
        "accuracy_matrix": mean matrix, "timing": mean seconds per phase}}`` in first-seen
        order; ``label`` is the strategy name, with the differing settings when a strategy
        has several groups.
    """
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        if r.get("complete") and not r.get("failed"):
            runs = groups.setdefault(group_key(r), [])
            # the same (strategy, settings, seed) twice (e.g. --grid tau=10 and --set tau=10):
            # one run, the later kept, never averaged with itself
            runs[:] = [o for o in runs if o.get("seed") != r.get("seed")]
            runs.append(r)
    labels = _labels(groups)
    out: dict[str, dict[str, Any]] = {}
    for key, runs in groups.items():
        row: dict[str, Any] = {
            "strategy": runs[0]["strategy"],
            "settings": runs[0].get("settings"),
            "seeds": [r["seed"] for r in runs],
        }
        for stat in (
            "mean_accuracy",
            "mean_valid_accuracy",
            "forgetting",
            "backward_transfer",
            "mean_nll",
            "mean_ece",
            "wall_time_s",
        ):
            mean, std, _ = _mean_std([r.get(stat) for r in runs])
            row[stat] = {"mean": mean, "std": std}
        mats = [np.array(r["accuracy_matrix"], dtype=float) for r in runs]
        if len({m.shape for m in mats}) == 1:
            stacked = np.stack(mats)
            seen = ~np.isnan(stacked).all(axis=0)
            mean = np.full(stacked.shape[1:], np.nan)
            mean[seen] = np.nanmean(stacked[:, seen], axis=0)
            row["accuracy_matrix"] = _nan_to_none(mean.tolist())
        finals = np.array([r["final_accuracies"] for r in runs], dtype=float)
        row["final_accuracies"] = _nan_to_none(np.nanmean(finals, axis=0).tolist())
        timings = [r.get("timing") or [] for r in runs]
        if all(timings):
            row["timing"] = {
                ph: float(np.mean([sum(t.get(ph, 0.0) for t in tm) for tm in timings]))
                for ph in _PHASES
            }
            n = min(len(tm) for tm in timings)
            row["timing_per_task"] = [
                float(np.mean([sum(tm[j].get(ph, 0.0) for ph in _PHASES) for tm in timings]))
                for j in range(n)
            ]
        out[labels[key]] = row
    return out


def select(agg: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per strategy, the group with the highest mean validation accuracy (ties: first seen).

    Returns:
        ``{strategy: {"selected": label, "candidates": {label: mean validation accuracy}}}``
        for every strategy whose groups all have validation results.

    Raises:
        ValueError: a group without validation accuracy (run with a validation split).
    """
    out: dict[str, dict[str, Any]] = {}
    for label, row in agg.items():
        val = row.get("mean_valid_accuracy", {}).get("mean")
        if val is None:
            raise ValueError(
                f"{label} has no validation accuracy: run it with --valid-fraction to select "
                "on validation"
            )
        entry = out.setdefault(row["strategy"], {"selected": label, "candidates": {}})
        entry["candidates"][label] = val
        if val > entry["candidates"][entry["selected"]]:
            entry["selected"] = label
    return out


def _fmt(stat: dict[str, float | None], digits: int = 2, scale: float = 1.0) -> str:
    if stat["mean"] is None:
        return "–"
    s = f"{stat['mean'] * scale:.{digits}f}"
    if stat["std"]:
        s += f" ± {stat['std'] * scale:.{digits}f}"
    return s


def markdown_report(
    bench: BenchmarkSpec,
    agg: dict[str, dict[str, Any]],
    *,
    failed: Sequence[dict[str, Any]] = (),
    selection: dict[str, dict[str, Any]] | None = None,
) -> str:
    """The results table (mean ± std over seeds, with the published score), the time spent per
    phase and its ratio to Naive's, then the mean accuracy matrix of every group (row: after
    training task j; column: task i). ``failed`` runs are listed, never averaged. With
    ``selection`` (:func:`select`), the table holds the validation-selected setting of each
    strategy, and a second table the validation accuracy of every candidate."""
    if selection is not None:
        chosen = {v["selected"] for v in selection.values()}
        candidates = agg
        agg = {k: v for k, v in agg.items() if k in chosen}
    lines = [f"## {bench.name}", "", bench.description, ""]
    if selection is not None:
        lines += [
            "Settings selected on validation accuracy (held-out training examples); test "
            "accuracy reported for the selected setting only.",
            "",
        ]
    if agg:
        lines += [
            "| strategy | seeds | accuracy (%) | published (%) | forgetting | BWT | NLL | ECE (%) "
            "| time (s) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
    else:
        lines.append("No complete run to report.")
    for name, row in agg.items():
        pub = bench.published.get(row.get("strategy", name))
        pub_s = "–"
        if pub is not None:
            pub_s = f"{pub.accuracy:.2f}" + (f" ± {pub.std:.2f}" if pub.std else "")
        lines.append(
            f"| {name} | {len(row['seeds'])} | {_fmt(row['mean_accuracy'])} | {pub_s} "
            f"| {_fmt(row['forgetting'])} | {_fmt(row['backward_transfer'])} "
            f"| {_fmt(row['mean_nll'], 4)} | {_fmt(row['mean_ece'], 2, 100.0)} "
            f"| {_fmt(row['wall_time_s'], 0)} |"
        )
    if failed:
        lines += [""]
        for r in failed:
            f = r.get("failed") or {}
            lines.append(
                f"FAILED (not in the table): {r['strategy']} seed {r['seed']}, task "
                f"{f.get('task')}: {f.get('reason')}"
            )
    lines += _timing_table(agg)
    if selection is not None:
        lines += [
            "",
            "Validation accuracy (%) of every candidate (mean over its seeds):",
            "",
            "| strategy | candidate | seeds | validation (%) | selected |",
            "|---|---|---|---|---|",
        ]
        for strat, sel in selection.items():
            for label, val in sel["candidates"].items():
                mark = "yes" if label == sel["selected"] else ""
                n = len(candidates[label]["seeds"])
                lines.append(f"| {strat} | {label} | {n} | {val:.2f} | {mark} |")
    ran = {row.get("strategy", k) for k, row in agg.items()}
    others = [(k, p) for k, p in bench.published.items() if k not in ran]
    if others:
        lines += [
            "",
            "Published, not run here: "
            + "; ".join(f"{k} {p.accuracy:.2f} ({p.source})" for k, p in others),
        ]
    sources = sorted({p.source for k, p in bench.published.items() if k in ran})
    if sources:
        lines += ["", "Published numbers: " + "; ".join(sources) + "."]
    for name, row in agg.items():
        mat = row.get("accuracy_matrix")
        if not mat:
            continue
        n = len(mat[0])
        lines += [
            "",
            f"Accuracy matrix of {name} (%, row j: after task j; column i: task i)",
            "",
            "| after \\ task | " + " | ".join(str(i + 1) for i in range(n)) + " |",
            "|---" * (n + 1) + "|",
        ]
        for j, r in enumerate(mat):
            cells = ["" if (v is None or np.isnan(v)) else f"{v:.2f}" for v in r]
            lines.append(f"| {j + 1} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _timing_table(agg: dict[str, dict[str, Any]]) -> list[str]:
    rows = {k: r for k, r in agg.items() if r.get("timing")}
    if not rows:
        return []
    naive = [r for r in rows.values() if r.get("strategy") == "naive"]
    base = sum(naive[0]["timing"].values()) if naive else None
    lines = [
        "",
        "Time per run (s, mean over seeds): training steps, memorable selection, curvature, "
        "kernel set-up, evaluation (validation and test); ratio of the total to Naive's in the "
        "same report.",
        "",
        "| strategy | training | memorable | curvature | kernel | evaluation | total "
        "| per task | × Naive |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        t = r["timing"]
        total = sum(t.values())
        ratio = f"{total / base:.2f}" if base else "–"
        per_task = ", ".join(f"{v:.1f}" for v in r.get("timing_per_task", []))
        lines.append(
            f"| {name} | {t['training_s']:.1f} | {t['memorable_s']:.2f} | {t['curvature_s']:.2f}"
            f" | {t['kernel_s']:.2f} | {t['evaluation_s']:.1f} | {total:.1f} | {per_task} "
            f"| {ratio} |"
        )
    return lines


#: Command-line options whose value is a path of the machine, and what a record writes instead.
PATH_OPTIONS = {"--out": "OUT", "--data-root": "DATA", "--data": "DATA"}


def command_line(words: Sequence[str]) -> str:
    """``words`` (a command and its arguments) as one line for a record, the output folder and
    the data root written ``OUT`` and ``DATA`` (a record names no path of the machine)."""
    import shlex

    out = []
    for i, w in enumerate(words):
        flag, eq, _ = w.partition("=")
        if eq and flag in PATH_OPTIONS:
            w = f"{flag}={PATH_OPTIONS[flag]}"
        elif i and words[i - 1] in PATH_OPTIONS:
            w = PATH_OPTIONS[words[i - 1]]
        out.append(w)
    return shlex.join(out)


def portable(run: dict[str, Any], base: Path) -> dict[str, Any]:
    """A run result as its record holds it: the checkpoint's path relative to the output
    folder ``base`` (``checkpoints/<run>.pt``), the data root written ``DATA`` (the data are
    identified by ``data.fingerprint``); no path of the machine that ran it."""
    out = {**run, "config": dict(run.get("config") or {}), "data": dict(run.get("data") or {})}
    if out["config"].get("checkpoint"):
        path, base = Path(out["config"]["checkpoint"]).resolve(), base.resolve()
        rel = path.relative_to(base) if path.is_relative_to(base) else Path(path.name)
        out["config"]["checkpoint"] = str(rel)
    for d, key in ((out["config"], "data_root"), (out["data"], "root")):
        if d.get(key) is not None:
            d[key] = "DATA"
    return out


def save_json(path: Path, payload: Any) -> None:
    """Write ``payload`` as indented JSON (atomically)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n")
    tmp.replace(path)


def plot_accuracy(bench: BenchmarkSpec, agg: dict[str, dict[str, Any]], path: Path) -> Path:
    """PNG: per strategy, the test accuracy of every task over training time (mean over
    seeds), and a bar chart of the final per-task accuracies of all strategies."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, r in agg.items() if r.get("accuracy_matrix")]
    ncols = len(names) + 1
    fig, axes = plt.subplots(1, ncols, figsize=(3.6 * ncols, 3.4), squeeze=False)
    for ax, name in zip(axes[0], names):
        mat = np.array(agg[name]["accuracy_matrix"], dtype=float)  # None -> nan
        steps = np.arange(1, mat.shape[0] + 1)
        for i in range(mat.shape[1]):
            ax.plot(steps, mat[:, i], marker="o", ms=3, label=f"task {i + 1}")
        ax.set_title(name)
        ax.set_xlabel("after training task")
        ax.set_ylabel("test accuracy (%)")
        ax.set_xticks(steps)
        ax.grid(alpha=0.3)
    if names:
        axes[0][0].legend(fontsize=7)
    ax = axes[0][-1]
    width = 0.8 / max(len(agg), 1)
    n_tasks = 0
    for k, (name, row) in enumerate(agg.items()):
        finals = np.array(row["final_accuracies"], dtype=float)
        n_tasks = max(n_tasks, len(finals))
        ax.bar(
            np.arange(1, len(finals) + 1) + (k - (len(agg) - 1) / 2) * width,
            finals,
            width,
            label=name,
        )
    ax.set_xticks(np.arange(1, n_tasks + 1))
    ax.set_title("after the last task")
    ax.set_xlabel("task")
    ax.set_ylabel("test accuracy (%)")
    lo = min(
        (np.nanmin(np.array(r["final_accuracies"], dtype=float)) for r in agg.values()),
        default=0.0,
    )
    ax.set_ylim(max(0.0, lo - 5.0), 100.0)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.suptitle(bench.name)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def image_grid(images: np.ndarray, rows: list[str], path: Path, title: str) -> None:
    """``images`` ``[rows, cols, H, W(, 3)]`` as a grid with a label per row, saved to
    ``path``."""
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


def to_image(x: Any, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor input of a benchmark of ``input_shape`` ``shape`` as an image array."""
    img = x.reshape(shape) if x.numel() == int(np.prod(shape)) else x
    if img.ndim == 1:  # flattened MNIST
        side = round(img.numel() ** 0.5)
        img = img.reshape(side, side)
    if img.ndim == 3:
        img = img[0] if img.shape[0] == 1 else img.permute(1, 2, 0)
    return img.numpy()


def log_norm(values: np.ndarray) -> Any:
    """A matplotlib LogNorm over the positive ``values`` (None when none is positive)."""
    from matplotlib.colors import LogNorm

    pos = values[values > 0]
    if len(pos) == 0:
        return None
    return LogNorm(vmin=float(pos.min()), vmax=float(max(pos.max(), pos.min() * 1.0001)))


def plot_kernel(k: np.ndarray, labels: np.ndarray, path: Path, title: str) -> None:
    """A kernel matrix ``[N, N]`` as a heatmap, ticks where the (sorted) ``labels`` change."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4.4))
    im = ax.imshow(k, cmap="viridis")
    fig.colorbar(im, ax=ax)
    ticks = [int(i) for i in np.flatnonzero(np.diff(labels, prepend=-1))]
    ax.set_xticks(ticks)
    ax.set_yticks(ticks)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
