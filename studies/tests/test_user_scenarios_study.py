"""The user-scenarios study (studies.user_scenarios): bad sizes and unknown cases
refused before any work, a failing case recorded with its error and never a number, the
synthetic cost stream's labels, and (with real MNIST) the class-incremental cases end to end
on small sizes."""

from __future__ import annotations

import json

import pytest
import torch

from studies import user_scenarios


@pytest.mark.parametrize("flag", ["--ci-epochs", "--bn-train", "--bn-epochs", "--cost-train"])
def test_a_size_below_one_is_refused(tmp_path, flag):
    with pytest.raises(SystemExit):
        user_scenarios.main([flag, "0", "--out", str(tmp_path / "x.json")])
    assert not (tmp_path / "x.json").exists()


def test_an_unknown_case_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        user_scenarios.main(["--only", "ci/nope", "--out", str(tmp_path / "x.json")])
    assert "ci/nope" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_a_failing_case_is_recorded_with_its_error_and_no_number(tmp_path, monkeypatch):
    def boom(name, args, device):
        raise RuntimeError(f"{name} broke")

    def fine(name, args, device):
        return {"mean_accuracy": 50.0}

    monkeypatch.setattr(user_scenarios, "CASES", {"ci": (["ci/a", "ci/b"], boom),
                                                  "bn": (["bn/c"], fine)})  # fmt: skip
    out = tmp_path / "r.json"
    user_scenarios.main(["--device", "cpu", "--cases", "ci", "bn", "--out", str(out)])
    cases = json.loads(out.read_text())["cases"]
    assert cases["ci/a"]["status"] == "error" and "a broke" in cases["ci/a"]["reason"]
    assert "mean_accuracy" not in cases["ci/a"] and "mean_accuracy" not in cases["ci/b"]
    assert cases["bn/c"] == {"status": "ok", "mean_accuracy": 50.0,
                             "seconds": cases["bn/c"]["seconds"]}  # fmt: skip


def test_the_cost_stream_shifts_the_second_experience_labels():
    bench = user_scenarios._templates_stream(200, 100, seed=0)
    d0, d1 = bench.train_stream[0].dataset, bench.train_stream[1].dataset
    assert len(d0) == len(d1) == 200 and len(bench.test_stream[0].dataset) == 100
    # the same template carries label c in the first experience and (c + 3) % 10 in the second
    t0 = torch.stack([d0[i][0] for i in range(200)])
    t1 = torch.stack([d1[i][0] for i in range(200)])
    assert t0.shape == t1.shape == (200, 3, 32, 32)
    l0 = torch.tensor([int(d0[i][1]) for i in range(200)])
    l1 = torch.tensor([int(d1[i][1]) for i in range(200)])
    near = torch.cdist(t1.flatten(1), t0.flatten(1)).argmin(1)  # a nearest first-exp. image
    agree = ((l0[near] + 3) % 10 == l1).float().mean()
    assert agree > 0.9


def test_class_incremental_cases_end_to_end(tmp_path, mnist_root):
    out = tmp_path / "r.json"
    user_scenarios.main(["--device", "cpu", "--quick", "--cases", "ci", "--only", "ci/naive",
                         "ci/fromp-recipe", "--data-root", str(mnist_root),
                         "--out", str(out)])  # fmt: skip
    cases = json.loads(out.read_text())["cases"]
    assert set(cases) == {"ci/naive", "ci/fromp-recipe"}
    for case in cases.values():
        assert case["status"] == "ok", case.get("reason")
        rows = case["accuracy_matrix"]
        assert len(rows) == 5 and all(len(r) == 5 for r in rows)
        assert case["mean_accuracy"] == pytest.approx(sum(rows[-1]) / 5)
    assert len(cases["ci/fromp-recipe"]["fromp_phase_seconds"]) == 5  # one per experience
    assert "fromp_phase_seconds" not in cases["ci/naive"]


def test_a_run_whose_weights_diverged_is_refused_not_scored():
    """An experience that leaves non-finite weights stops the case before its evaluation."""

    class Diverging:
        def __init__(self) -> None:
            self.plugins: list = []
            self.loss = torch.tensor(0.5)
            self.model = torch.nn.Linear(2, 2)
            self.evaluated = 0

        def train(self, exp) -> None:
            with torch.no_grad():
                self.model.weight[0, 0] = float("nan")

        def eval(self, stream):
            self.evaluated += 1
            return {"Top1_Acc_Exp/eval_phase/test_stream/Exp000": 0.1}

    strategy = Diverging()
    with pytest.raises(RuntimeError, match=r"experience 0: weights weight are not finite"):
        user_scenarios._run_stream(strategy, [0], [0], torch.device("cpu"))
    assert strategy.evaluated == 0
