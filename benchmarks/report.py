"""Reports: a Markdown table next to the published numbers, accuracy matrices, JSON, plots."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.registry import BenchmarkSpec

__all__ = ["aggregate", "markdown_report", "plot_accuracy", "save_json"]


def _mean_std(values: Sequence[float | None]) -> tuple[float | None, float | None, int]:
    v = [x for x in values if x is not None]
    if not v:
        return None, None, 0
    return float(np.mean(v)), float(np.std(v)) if len(v) > 1 else 0.0, len(v)


def _nan_to_none(rows: Any) -> Any:
    if isinstance(rows, list):
        return [_nan_to_none(r) for r in rows]
    return None if rows is None or np.isnan(rows) else float(rows)


def aggregate(results: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Group complete runs by strategy; mean and std over seeds of every score.

    Returns:
        ``{strategy: {"seeds": [...], "mean_accuracy": (mean, std), ..., "accuracy_matrix":
        mean matrix, "wall_time_s": (mean, std)}}`` in first-seen order.
    """
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        if r.get("complete"):
            groups.setdefault(r["strategy"], []).append(r)
    out: dict[str, dict[str, Any]] = {}
    for name, runs in groups.items():
        row: dict[str, Any] = {"seeds": [r["seed"] for r in runs]}
        for key in (
            "mean_accuracy",
            "forgetting",
            "backward_transfer",
            "mean_nll",
            "mean_ece",
            "wall_time_s",
        ):
            mean, std, _ = _mean_std([r.get(key) for r in runs])
            row[key] = {"mean": mean, "std": std}
        mats = [np.array(r["accuracy_matrix"], dtype=float) for r in runs]
        if len({m.shape for m in mats}) == 1:
            stacked = np.stack(mats)
            seen = ~np.isnan(stacked).all(axis=0)
            mean = np.full(stacked.shape[1:], np.nan)
            mean[seen] = np.nanmean(stacked[:, seen], axis=0)
            row["accuracy_matrix"] = _nan_to_none(mean.tolist())
        finals = np.array([r["final_accuracies"] for r in runs], dtype=float)
        row["final_accuracies"] = _nan_to_none(np.nanmean(finals, axis=0).tolist())
        out[name] = row
    return out


def _fmt(stat: dict[str, float | None], digits: int = 2, scale: float = 1.0) -> str:
    if stat["mean"] is None:
        return "–"
    s = f"{stat['mean'] * scale:.{digits}f}"
    if stat["std"]:
        s += f" ± {stat['std'] * scale:.{digits}f}"
    return s


def markdown_report(bench: BenchmarkSpec, agg: dict[str, dict[str, Any]]) -> str:
    """The results table (mean ± std over seeds, with the published score), then the mean
    accuracy matrix of every strategy (row: after training task j; column: task i)."""
    lines = [
        f"## {bench.name}",
        "",
        bench.description,
        "",
        "| strategy | seeds | accuracy (%) | published (%) | forgetting | BWT | NLL | ECE (%) "
        "| time (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in agg.items():
        pub = bench.published.get(name)
        pub_s = "–"
        if pub is not None:
            pub_s = f"{pub.accuracy:.2f}" + (f" ± {pub.std:.2f}" if pub.std else "")
        lines.append(
            f"| {name} | {len(row['seeds'])} | {_fmt(row['mean_accuracy'])} | {pub_s} "
            f"| {_fmt(row['forgetting'])} | {_fmt(row['backward_transfer'])} "
            f"| {_fmt(row['mean_nll'], 4)} | {_fmt(row['mean_ece'], 2, 100.0)} "
            f"| {_fmt(row['wall_time_s'], 0)} |"
        )
    others = [(k, p) for k, p in bench.published.items() if k not in agg]
    if others:
        lines += [
            "",
            "Published, not run here: "
            + "; ".join(f"{k} {p.accuracy:.2f} ({p.source})" for k, p in others),
        ]
    sources = sorted({p.source for k, p in bench.published.items() if k in agg})
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
