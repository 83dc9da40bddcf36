"""studies/one_head_defaults.py on fake MNIST files."""

from __future__ import annotations

import json

import pytest


def test_one_head_defaults_study_records_every_task_after_each(tmp_path):
    """The defaults study on fake MNIST files: an accuracy matrix of every task after each
    of 3 tasks per configuration, FROMP built with the configuration's arguments only."""
    from test_integrity import write_mnist

    from studies import one_head_defaults as study

    write_mnist(tmp_path, n_train=400, n_test=50)
    out = tmp_path / "rec.json"
    args = ["--data-root", str(tmp_path), "--out", str(out), "--n-tasks", "3"]
    args += ["--n-train", "300", "--n-test", "30", "--epochs", "1"]
    study.main([*args, "--configs", "naive", "fromp-logits-tau1", "fromp-defaults", "fromp-probs"])
    rec = json.loads(out.read_text())
    assert rec["protocol"]["n_tasks"] == 3 and rec["protocol"]["epochs"] == 1
    names = ["naive", "fromp-logits-tau1", "fromp-defaults", "fromp-probs"]
    assert [r["name"] for r in rec["runs"]] == names
    assert rec["runs"][1]["fromp_kwargs"] == {"function": "logits", "tau": 1.0}
    # the strategy was built with them: the logits, tau = 1 and the default 40 points
    assert rec["runs"][1]["applied"] == {"function": "logits", "tau": 1.0, "n_points": 40}
    assert rec["runs"][0]["applied"] is None
    # the default chooses the logits on this one head that every task fills
    assert rec["runs"][2]["applied"] == {"function": "logits", "tau": 10.0, "n_points": 40}
    assert rec["runs"][3]["applied"] == {"function": "probs", "tau": 10.0, "n_points": 40}
    for r in rec["runs"]:
        m = r["accuracy_matrix"]
        assert [len(row) for row in m] == [3, 3, 3]
        assert all(0 <= a <= 100 for row in m for a in row)
        assert r["mean_accuracy"] == pytest.approx((m[2][0] + m[2][1] + m[2][2]) / 3)
    with pytest.raises(SystemExit):
        study.main([*args[:-2], "--epochs", "0"])
