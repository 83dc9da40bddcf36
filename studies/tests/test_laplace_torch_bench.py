"""The side-by-side study with laplace-torch (``python -m studies.laplace_torch``):
its helpers (relative differences, the Kronecker-block comparison, the case table, the
summary), the fromp side on tiny settings, the one-line refusal without laplace-torch, and,
where laplace-torch is installed, the float64 comparison itself."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

from studies import laplace_torch as study
from studies.laplace_torch import (
    MissingExtra,
    compare_rows,
    kron_rel_diff,
    markdown_table,
    plan,
    rel_diff,
    require_extras,
    run_case,
    skip_reason,
)

F64 = torch.float64


def test_rel_diff():
    a = torch.tensor([3.0, 4.0])
    assert rel_diff(a, a) == 0.0
    assert rel_diff(torch.zeros(3), torch.zeros(3)) == 0.0
    assert rel_diff(torch.tensor([3.0, 5.0]), a) == pytest.approx(1 / 5)  # ||(0, 1)|| / 5
    assert rel_diff(2.0, 1.0) == pytest.approx(1.0)
    assert rel_diff(1.0, 2.0) == pytest.approx(0.5)  # relative to the second (the reference)
    assert rel_diff(torch.tensor([1.0]), torch.zeros(1)) > 1e300  # any difference from zero
    assert math.isnan(rel_diff(torch.tensor([math.nan]), torch.ones(1)))
    with pytest.raises(ValueError, match="shapes differ"):
        rel_diff(torch.ones(2), torch.ones(3))


def test_kron_rel_diff_against_dense_products():
    g = torch.Generator().manual_seed(0)
    b1, a1 = torch.randn(3, 3, generator=g, dtype=F64), torch.randn(4, 4, generator=g, dtype=F64)
    b2 = b1 + 0.1 * torch.randn(3, 3, generator=g, dtype=F64)
    a2 = a1 + 0.1 * torch.randn(4, 4, generator=g, dtype=F64)
    dense = rel_diff(torch.kron(b1, a1), torch.kron(b2, a2))
    assert kron_rel_diff(b1, a1, b2, a2) == pytest.approx(dense, rel=1e-10)
    # the same block written with other factor scales: equal, to rounding (not to ~1e-8)
    assert kron_rel_diff(7.0 * b1, a1 / 7.0, b1, a1) < 1e-14
    # a small difference is resolved, not lost under a difference-of-squares floor
    tiny = a1.clone()
    tiny[0, 0] += 1e-12
    got = kron_rel_diff(b1, tiny, b1, a1)
    want = rel_diff(torch.kron(b1, tiny), torch.kron(b1, a1))
    assert got == pytest.approx(want, rel=1e-3) and got > 0


def test_case_table_and_skips():
    specs = plan(["mlp", "cnn", "resnet18"], study.DEFAULTS)
    assert len(specs) == 3 * 2 * 3 * 2  # networks x subsets x structures x libraries
    skipped = {(s["model"], s["subset"], s["structure"]) for s in specs if "skip" in s}
    assert skipped == {(m, "all", "full") for m in ("mlp", "cnn", "resnet18")}
    reason = next(s["skip"] for s in specs if "skip" in s and s["model"] == "mlp")
    assert "P=269,322" in reason and "GB" in reason
    only = plan(["cnn"], study.DEFAULTS, ("last_layer",))
    assert [(s["structure"], s["library"]) for s in only] == [
        (h, lib) for h in ("diag", "kron", "full") for lib in ("fromp", "laplace_torch")
    ]
    assert all(s["subset"] == "last_layer" and "skip" not in s for s in only)
    assert skip_reason("mlp", "last_layer", "full", 10**7) is None
    assert skip_reason("tiny", "all", "full", 100) is None
    for s in specs:
        assert s["n_fit"] % s["batch"] == 0  # equal batches: the same KFAC sums in both
        assert s["library"] in ("fromp", "laplace_torch")


def test_summary_ratios_and_table(tmp_path):
    p1, p2 = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({"probs": torch.tensor([[0.5, 0.5]]), "lml": -1.0}, p1)
    torch.save({"probs": torch.tensor([[0.6, 0.4]]), "lml": -2.0}, p2)
    rows = [
        {"model": "mlp", "subset": "all", "structure": "diag", "library": "fromp",
         "fit_cpu_s": 1.0, "predict_cpu_s": 2.0, "log_marginal_likelihood": -1.0, "nll": 0.1},
        {"model": "mlp", "subset": "all", "structure": "diag", "library": "laplace_torch",
         "fit_cpu_s": 4.0, "predict_cpu_s": 1.0, "log_marginal_likelihood": -2.0, "nll": 0.2},
        {"model": "mlp", "subset": "all", "structure": "full", "library": "fromp", "skip": "x"},
        {"model": "mlp", "subset": "all", "structure": "full", "library": "laplace_torch",
         "skip": "x"},
    ]  # fmt: skip
    saved = {("mlp", "all", "diag", "fromp"): str(p1),
             ("mlp", "all", "diag", "laplace_torch"): str(p2)}  # fmt: skip
    summary = compare_rows(rows, saved)
    assert len(summary) == 2
    s = summary[0]
    assert s["fit_ratio"] == 0.25 and s["predict_ratio"] == 2.0
    assert s["lml_rel_diff"] == pytest.approx(0.5)
    assert s["predictive_rel_diff"] == pytest.approx(
        rel_diff(torch.tensor([[0.5, 0.5]]), torch.tensor([[0.6, 0.4]]))
    )
    assert summary[1] == {"model": "mlp", "subset": "all", "structure": "full", "skip": "x"}
    table = markdown_table(summary).splitlines()
    assert len(table) == 4 and "(0.25)" in table[2] and "(2.00)" in table[2]
    assert "skipped" in table[3]


def test_fromp_side_smoke():
    """The study's fromp side on a CNN with 4 synthetic inputs: each structure runs and gives
    probabilities, a finite evidence and peak memory."""
    base = {"model": "cnn", "n_fit": 4, "n_test": 2, "batch": 2, "pred_batch": 2,
            "library": "fromp", "prior_precision": 30.0}  # fmt: skip
    for subset, structure in (("all", "kron"), ("all", "diag"), ("last_layer", "full")):
        out = run_case({**base, "subset": subset, "structure": structure})
        assert math.isfinite(out["log_marginal_likelihood"]) and out["fit_s"] > 0
        assert 0 <= out["ece"] <= 1 and out["nll"] > 0 and 0 <= out["accuracy"] <= 1
        assert out["peak_rss_mb"] >= out["base_rss_mb"] > 0
        assert out["n_params"] > 10**6


def test_a_diverged_case_is_refused_not_tabulated(monkeypatch):
    """A library whose evidence or predictive is NaN fails its case (the row then carries
    the error, never numbers): here fromp's model is poisoned with a NaN weight."""
    make = study.make_model

    def poisoned(*args, **kwargs):
        net, shape = make(*args, **kwargs)
        with torch.no_grad():
            next(net.parameters()).view(-1)[0] = float("nan")
        return net, shape

    monkeypatch.setattr(study, "make_model", poisoned)
    base = {"model": "cnn", "n_fit": 4, "n_test": 2, "batch": 2, "pred_batch": 2,
            "library": "fromp", "prior_precision": 30.0, "subset": "last_layer",
            "structure": "kron"}  # fmt: skip
    with pytest.raises((RuntimeError, ValueError), match="finite"):
        run_case(base)
    with pytest.raises(RuntimeError, match="laplace_torch: predictive is not finite"):
        study.require_finite("laplace_torch", log_marginal_likelihood=-3.0,
                             predictive=torch.tensor([[0.5, float("nan")]]))  # fmt: skip
    study.require_finite("fromp", log_marginal_likelihood=-3.0, predictive=torch.ones(2, 2))


def test_refuses_without_laplace_torch(monkeypatch, capsys, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "laplace" else real(name, *a))  # fmt: skip
    with pytest.raises(MissingExtra) as err:
        require_extras()
    msg = str(err.value)
    assert "laplace-torch" in msg and "pip install -e '.[laplace]'" in msg and "\n" not in msg
    out = tmp_path / "lt.json"
    with pytest.raises(SystemExit):
        study.main(["--models", "mlp", "--out", str(out)])
    err_text = capsys.readouterr().err.strip().splitlines()[-1]
    assert "laplace-torch" in err_text and ".[laplace]" in err_text
    assert not out.exists()
    for bad in (["--models", "vgg"], ["--subsets", "subnetwork"], ["--parts", "plots"]):
        with pytest.raises(SystemExit):
            study.main([*bad, "--out", str(out)])
        assert "--models must be among" in capsys.readouterr().err


def test_matches_laplace_torch_in_float64():
    """Where laplace-torch is installed: fromp's posterior precision, evidence and GLM probit
    predictive equal laplace-torch's (exact GGN) in float64 for all six cases on a tiny MLP
    (one batch and several); on a tiny CNN the Kronecker bias convention is the only
    difference."""
    pytest.importorskip("laplace")
    pytest.importorskip("curvlinops")
    # laplace-torch's full GGN multiplies curvlinops' operator by torch.eye(P) in the
    # default dtype: float64 all through needs the default dtype float64
    default = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    try:
        _compare_tiny()
    finally:
        torch.set_default_dtype(default)


def _compare_tiny() -> None:
    net, shape = study.make_model("tiny_mlp")
    net = net.to(F64)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, *shape, generator=g, dtype=F64)
    y = torch.randint(0, 3, (12,), generator=g)
    xt = torch.randn(5, *shape, generator=g, dtype=F64)
    for batch in (12, 4):
        for subset in study.SUBSETS:
            for structure in study.STRUCTURES:
                row = study.compare_pair(net, subset, structure, (x, y, xt), batch, prior=0.7)
                for key in ("precision", "log_marginal_likelihood", "predictive"):
                    assert row[key] < 1e-10, (subset, structure, batch, key, row)
    net, shape = study.make_model("tiny_cnn")
    net = net.to(F64)
    x = torch.randn(4, *shape, generator=g, dtype=F64)
    xt = torch.randn(3, *shape, generator=g, dtype=F64)
    row = study.compare_pair(net, "all", "kron", (x, y[:4], xt), 2)
    assert row["precision_weight_blocks"] < 1e-10 and row["precision_bias_blocks"] > 1e-3
    assert row["log_marginal_likelihood"] > 1e-6
    fixed = row["with_laplace_torch_bias_blocks"]
    assert fixed["log_marginal_likelihood"] < 1e-10 and fixed["predictive"] < 1e-10
    json.dumps(row)  # the row goes into the JSON as is
