"""The relative differences and the summary table of :mod:`studies.laplace_torch`."""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch import Tensor

__all__ = ["compare_rows", "markdown_table", "rel_diff"]


def rel_diff(a: Tensor | float, b: Tensor | float) -> float:
    """``||a - b|| / max(||b||, tiny)``: the relative difference of ``a`` from the reference
    ``b`` (Frobenius norm over all entries; both in float64). Equal inputs give 0, also
    when both are zero; a NaN in either gives NaN."""
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} and {tuple(b.shape)}")
    num = float((a - b).norm())
    den = float(b.norm())
    if math.isnan(num) or math.isnan(den):
        return math.nan
    return num / max(den, torch.finfo(torch.float64).tiny) if num > 0 else 0.0


def compare_rows(rows: list[dict[str, Any]], saved: dict[tuple, str]) -> list[dict[str, Any]]:
    """One summary row per (network, subset, structure): both libraries' numbers, the time
    ratios ``fromp / laplace-torch`` and the relative differences of the evidence and of
    the predictive (fromp's from laplace-torch's)."""
    out = []
    keys = list(dict.fromkeys((r["model"], r["subset"], r["structure"]) for r in rows))
    for key in keys:
        pair = {r["library"]: r for r in rows if (r["model"], r["subset"], r["structure"]) == key}
        f, lt = pair.get("fromp", {}), pair.get("laplace_torch", {})
        row: dict[str, Any] = dict(zip(("model", "subset", "structure"), key))
        if "skip" in f:
            row["skip"] = f["skip"]
            out.append(row)
            continue
        for lib, r in (("fromp", f), ("laplace_torch", lt)):
            for k in ("fit_cpu_s", "predict_cpu_s", "fit_s", "predict_s", "peak_rss_mb",
                      "log_marginal_likelihood", "nll",
                      "ece", "accuracy", "error"):  # fmt: skip
                if k in r:
                    row[f"{lib}_{k}"] = r[k]
        if "fit_cpu_s" in f and "fit_cpu_s" in lt:
            # process CPU time of one thread: robust to other load on a shared machine
            row["fit_ratio"] = f["fit_cpu_s"] / lt["fit_cpu_s"]
            row["predict_ratio"] = f["predict_cpu_s"] / lt["predict_cpu_s"]
            row["lml_rel_diff"] = rel_diff(f["log_marginal_likelihood"],
                                           lt["log_marginal_likelihood"])  # fmt: skip
            pf, pl = saved.get((*key, "fromp")), saved.get((*key, "laplace_torch"))
            if pf and pl and os.path.exists(pf) and os.path.exists(pl):
                a = torch.load(pf, weights_only=True)["probs"]
                b = torch.load(pl, weights_only=True)["probs"]
                row["predictive_rel_diff"] = rel_diff(a, b)
        out.append(row)
    return out


def markdown_table(summary: list[dict[str, Any]]) -> str:
    """The summary as a markdown table (times in seconds, memory in MB)."""

    def fmt(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    head = ("| network | subset | structure | fit CPU s fromp / l-t (ratio) | predict CPU s "
            "fromp / l-t "
            "(ratio) | peak MB fromp / l-t | evidence rel. diff | predictive rel. diff | "
            "NLL fromp / l-t | ECE fromp / l-t |")  # fmt: skip
    lines = [head, "|" + "---|" * 10]
    for r in summary:
        lead = f"| {r['model']} | {r['subset']} | {r['structure']} |"
        if "skip" in r:
            lines.append(lead + " skipped: " + r["skip"].split(";")[0] + " |" + " |" * 6)
            continue
        g = r.get
        if g("fromp_error") or g("laplace_torch_error"):
            err = g("fromp_error") or g("laplace_torch_error")
            lines.append(lead + f" error: {err[:80]} |" + " |" * 6)
            continue
        lines.append(
            lead
            + f" {fmt(g('fromp_fit_cpu_s'), '.2f')} / {fmt(g('laplace_torch_fit_cpu_s'), '.2f')} "
            f"({fmt(g('fit_ratio'), '.2f')}) |"
            f" {fmt(g('fromp_predict_cpu_s'), '.2f')} /"
            f" {fmt(g('laplace_torch_predict_cpu_s'), '.2f')} "
            f"({fmt(g('predict_ratio'), '.2f')}) |"
            f" {fmt(g('fromp_peak_rss_mb'), '.0f')} /"
            f" {fmt(g('laplace_torch_peak_rss_mb'), '.0f')} |"
            f" {fmt(g('lml_rel_diff'), '.1e')} | {fmt(g('predictive_rel_diff'), '.1e')} |"
            f" {fmt(g('fromp_nll'), '.4f')} / {fmt(g('laplace_torch_nll'), '.4f')} |"
            f" {fmt(g('fromp_ece'), '.4f')} / {fmt(g('laplace_torch_ece'), '.4f')} |"
        )
    return "\n".join(lines)
