"""The benchmark runner: results, reports, resumption and command-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from fromp_bench.__main__ import main
from fromp_bench.registry import BENCHMARKS, STRATEGIES, get_benchmark, get_strategy
from fromp_bench.runner import RunConfig, expected_calibration_error, resolve_settings, run

QUICK = {"train_epochs": 2, "train_mb_size": 32}


def _cfg(tmp_path, strategy="naive", **kw):
    base = dict(
        benchmark="split-digits",
        strategy=strategy,
        seed=0,
        overrides=dict(QUICK),
        train_size=120,
        test_size=60,
        checkpoint=str(tmp_path / f"{strategy}.pt"),
        progress=False,
    )
    base.update(kw)
    return RunConfig(**base)


def test_run_reports_matrix_and_scores(tmp_path):
    res = run(_cfg(tmp_path))
    assert res["complete"]
    mat = res["accuracy_matrix"]
    assert len(mat) == 5
    for j, row in enumerate(mat):
        assert all(v is not None for v in row[: j + 1]) and all(v is None for v in row[j + 1 :])
    assert res["final_accuracies"] == mat[-1]
    assert res["mean_accuracy"] == pytest.approx(sum(mat[-1]) / 5)
    forgetting = [max(mat[j][k] for j in range(k, 4)) - mat[4][k] for k in range(4)]
    assert res["forgetting"] == pytest.approx(sum(forgetting) / 4)
    assert res["backward_transfer"] == pytest.approx(
        sum(mat[4][k] - mat[k][k] for k in range(4)) / 4
    )
    assert res["mean_nll"] > 0 and 0 <= res["mean_ece"] <= 1
    json.dumps(res, allow_nan=False)


def test_resume_after_kill_gives_identical_results(tmp_path):
    full = run(_cfg(tmp_path / "a", strategy="ewc-avalanche"))
    part = run(_cfg(tmp_path / "b", strategy="ewc-avalanche", stop_after=2))
    assert not part["complete"] and len(part["accuracy_matrix"]) == 2
    resumed = run(_cfg(tmp_path / "b", strategy="ewc-avalanche", resume=True))
    assert resumed["complete"]
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    assert resumed["per_task"] == full["per_task"]


def test_resume_refuses_a_foreign_checkpoint(tmp_path):
    run(_cfg(tmp_path, stop_after=1))
    with pytest.raises(ValueError, match="different run"):
        run(_cfg(tmp_path, seed=1, resume=True))


def test_settings_precedence():
    bench, strat = get_benchmark("split-mnist"), get_strategy("ewc-avalanche")
    s = resolve_settings(bench, strat, {"lr": 0.5, "kwargs": {"ewc_lambda": 3.0}})
    assert s["lr"] == 0.5 and s["train_epochs"] == 15 and s["train_mb_size"] == 128
    assert s["kwargs"] == {"ewc_lambda": 3.0, "mode": "separate"}
    # the two EWCs are compared under the same training settings (the benchmark's protocol)
    ours = resolve_settings(bench, get_strategy("ewc"), {})
    theirs = resolve_settings(bench, strat, {})
    for key in ("optimizer", "lr", "train_epochs", "train_mb_size"):
        assert ours[key] == theirs[key] == bench.settings[key], key


def test_ece_of_perfectly_calibrated_and_overconfident_predictions():
    import torch

    y = torch.tensor([0, 1, 0, 1])
    exact = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    assert expected_calibration_error(exact, y) == pytest.approx(0.0)
    wrong = torch.tensor([[0.9, 0.1]] * 4)
    assert expected_calibration_error(wrong, y) == pytest.approx(0.4)


def test_cli_writes_json_table_and_plot(tmp_path, capsys):
    code = main(
        [
            "split-digits",
            "--strategies",
            "naive,joint",
            "--seeds",
            "2",
            "--epochs",
            "1",
            "--n-train",
            "80",
            "--n-test",
            "40",
            "--out",
            str(tmp_path),
            "--no-progress",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "| naive | 2 |" in out and "| joint | 2 |" in out
    base = tmp_path / "split-digits"
    payload = json.loads((base / "results.json").read_text())
    assert len(payload["runs"]) == 4 and set(payload["aggregate"]) == {"naive", "joint"}
    assert (base / "report.md").read_text().startswith("## split-digits")
    assert (base / "accuracy.png").stat().st_size > 1000


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["nope"], "unknown benchmark 'nope'"),
        (["split-digits", "--strategies", "naive,foo"], "unknown strategy 'foo'"),
        (["split-digits", "--set", "tau"], "--set expects key=value"),
    ],
)
def test_cli_errors_are_one_line(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and "Traceback" not in err


def test_cli_missing_data_is_one_line(tmp_path, capsys, monkeypatch):
    import torchvision.datasets as tvd

    class Offline(tvd.MNIST):
        def download(self):
            raise RuntimeError("offline")

    monkeypatch.setattr(tvd, "MNIST", Offline)
    argv = ["split-mnist", "--strategies", "naive", "--data-root", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fromp-bench: error: MNIST not found") and "\n" not in err


def test_registry_is_consistent():
    for name, spec in BENCHMARKS.items():
        assert spec.name == name
        assert {"lr", "train_epochs", "train_mb_size", "optimizer"} <= set(spec.settings)
    for name, spec in STRATEGIES.items():
        assert spec.name == name
    for name in ("naive", "joint", "ewc-avalanche"):
        assert STRATEGIES[name].available()


def test_demo_falls_back_to_permuted_digits_and_says_why(tmp_path, capsys, monkeypatch):
    import torchvision.datasets as tvd

    class Offline(tvd.MNIST):
        def download(self):
            raise RuntimeError("offline")

    monkeypatch.setattr(tvd, "MNIST", Offline)
    argv = ["demo", "--data-root", str(tmp_path / "empty"), "--out", str(tmp_path / "out")]
    argv += ["--strategies", "naive", "--epochs", "1", "--n-train", "60", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "demo: MNIST not found" in out and "running the built-in Permuted-Digits" in out
    # the line names where it looked and how to point it elsewhere
    assert f"in data root {(tmp_path / 'empty').resolve()} (from --data-root, $FROMP_DATA" in out
    assert "| naive | 1 |" in out
    payload = json.loads((tmp_path / "out" / "permuted-digits" / "results.json").read_text())
    (run_,) = payload["runs"]
    assert len(run_["accuracy_matrix"]) == 5 and run_["forgetting"] is not None
    assert out.rstrip().endswith(f"demo: naive forgets {run_['forgetting']:.1f} points of "
                                 "accuracy on earlier tasks.")  # fmt: skip


def test_permuted_digits_is_listed_built_in_on_one_head_with_one_protocol(capsys):
    """The demo's built-in stream: listed, no data to find, its layout what it loads, one
    10-way head that every task fills (so FROMP keeps the logits), and the same training
    protocol for the four strategies the demo compares."""
    from fromp_bench.command import DEMO_STRATEGIES

    from fromp import FROMPMethod

    bench = get_benchmark("permuted-digits")
    seq = bench.load(None)
    assert bench.needs == ()
    assert (len(seq), seq.input_shape, seq.n_outputs, seq.multi_head) == bench.layout
    net = bench.model(seq)
    assert net(seq[0].train_x[:3]).shape == (3, 10)
    assert FROMPMethod.auto_function(net, seq[0].train_x, seq[0].train_y) == "logits"
    got = {s: resolve_settings(bench, get_strategy(s), {}) for s in DEMO_STRATEGIES}
    protocol = {
        s: (v["optimizer"], v["lr"], v["train_epochs"], v["train_mb_size"]) for s, v in got.items()
    }
    assert set(protocol.values()) == {("adam", 1e-3, 10, 32)}, protocol
    assert main(["--list"]) == 0
    assert f"permuted-digits        {bench.description}" in capsys.readouterr().out


def test_class_default_memorable_points_are_checked_before_training(tmp_path, capsys):
    """FROMP has no settings of its own on permuted-digits: its class's 40 memorable points
    per task are checked against the data before training all the same."""
    from fromp_bench.settings import SETTINGS

    assert "permuted-digits" not in SETTINGS["fromp"]
    argv = ["permuted-digits", "--strategies", "fromp", "--n-train", "30", "--out", str(tmp_path)]
    assert main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "n_points=40 asks for 4 memorable examples per class" in err and "\n" not in err
    assert not list(tmp_path.rglob("*.pt"))  # nothing trained


def test_takeaway_reads_the_forgetting_column_against_naive():
    from fromp_bench.command import takeaway

    def row(forgetting, accuracy):
        return {"forgetting": {"mean": forgetting, "std": 1.0},
                "mean_accuracy": {"mean": accuracy, "std": 0.5}}  # fmt: skip

    agg = {"fromp": row(1.22, 92.31), "vcl": row(60.0, 50.0), "ewc [tau=3]": row(25.0, 62.5)}
    agg["naive"] = row(53.44, 52.71)
    assert takeaway(agg) == (
        "demo: naive forgets 53.4 points of accuracy on earlier tasks; fromp 1.2 (52.2 less), "
        "ewc [tau=3] 25.0 (28.4 less), vcl 60.0 (6.6 more); most accurate at the end: fromp "
        "(92.3 %, naive 52.7 %)."
    )
    agg["naive"] = row(53.44, 95.0)  # Naive the most accurate: no comparison with itself
    assert takeaway(agg).endswith("; most accurate at the end: naive (95.0 %).")
    del agg["naive"]
    assert takeaway(agg) == (
        "demo: forgetting on earlier tasks, in points of accuracy: fromp 1.2, ewc [tau=3] 25.0, "
        "vcl 60.0; most accurate at the end: fromp (92.3 %)."
    )
    agg["vcl"] = row(None, 99.0)  # no forgetting (one task): left out, accuracy too
    assert "vcl" not in takeaway(agg)
    assert takeaway({"naive": row(None, 50.0)}) is None and takeaway({}) is None


def _cli_args(out):
    return [
        "split-digits",
        "--strategies",
        "naive",
        "--epochs",
        "4",
        "--n-train",
        "150",
        "--n-test",
        "60",
        "--out",
        str(out),
        "--no-progress",
    ]


def _killed_in_task_2(argv: list[str]) -> int:
    """A forked child's body: ``main(argv)``, killed (SIGKILL, by itself) after training and
    evaluating task 2, before writing that task's checkpoint: task 2's work is lost and the
    checkpoint holds task 1."""
    import os
    import signal

    import fromp_bench.runner as R

    write = R._write_checkpoint

    def write_or_die(path, state):
        if state["done"] == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        write(path, state)

    R._write_checkpoint = write_or_die
    return main(argv)


def test_killed_process_resumes_to_the_same_table(tmp_path):
    """A run killed (SIGKILL) in task 2, after its first checkpoint, then resumed, ends with
    the same accuracy matrix as an uninterrupted run. The killed run is this process forked
    (torch and Avalanche already imported, single-threaded), killed at the same point every
    time (before: it polled for ``naive-seed0.pt``, a name without the settings id that never
    appeared, so the run always finished and the test skipped)."""
    import signal

    import torch

    from tests.cases import exit_code, forked

    ckpts = tmp_path / "killed" / "split-digits" / "checkpoints"
    pid = forked(lambda: _killed_in_task_2(_cli_args(tmp_path / "killed")))
    code = exit_code(pid, 900)  # a loaded machine: two tasks may take minutes
    assert code == -signal.SIGKILL, code
    (ckpt,) = ckpts.glob("naive-*seed0.pt")  # naive-<settings id>-seed0.pt
    assert torch.load(ckpt, weights_only=True)["done"] == 1
    assert not (tmp_path / "killed" / "split-digits" / "results.json").exists()
    assert main([*_cli_args(tmp_path / "killed"), "--resume"]) == 0
    assert main(_cli_args(tmp_path / "fresh")) == 0
    resumed = json.loads((tmp_path / "killed/split-digits/results.json").read_text())
    fresh = json.loads((tmp_path / "fresh/split-digits/results.json").read_text())
    assert resumed["runs"][0]["accuracy_matrix"] == fresh["runs"][0]["accuracy_matrix"]


def test_report_only_rebuilds_from_run_files(tmp_path, capsys):
    assert main(_cli_args(tmp_path)) == 0
    base = tmp_path / "split-digits"
    (base / "report.md").unlink()
    capsys.readouterr()
    assert main(["split-digits", "--report-only", "--out", str(tmp_path)]) == 0
    assert "| naive | 1 |" in capsys.readouterr().out
    assert (base / "report.md").exists()
    assert main(["split-mnist", "--report-only", "--out", str(tmp_path)]) == 2


def test_validation_metrics_do_not_change_the_test_results(tmp_path):
    """Evaluating the validation sets (under a forked RNG) leaves the test results as they
    are: VCL samples at evaluation, so a shared RNG would change them."""
    kw = dict(overrides={"train_epochs": 1}, train_size=60, test_size=30, progress=False)
    seq_cfg = dict(benchmark="split-digits", strategy="vcl", valid_fraction=0.2)
    with_val = run(RunConfig(**seq_cfg, **kw))
    assert len(with_val["valid_accuracy_matrix"]) == 5
    assert 0 <= with_val["mean_valid_accuracy"] <= 100
    import fromp_bench.runner as R

    no_val_view = R._validation_view
    try:
        R._validation_view = lambda seq: None
        without = run(RunConfig(**seq_cfg, **kw))
    finally:
        R._validation_view = no_val_view
    assert without["accuracy_matrix"] == with_val["accuracy_matrix"]


def test_select_on_validation_reports_the_best_validation_setting(tmp_path, capsys):
    argv = ["split-digits", "--strategies", "naive", "--grid", "lr=0.00001,0.01"]
    argv += ["--epochs", "1", "--n-train", "60", "--n-test", "30", "--no-progress"]
    argv += ["--valid-fraction", "0.2", "--select-on", "validation", "--out", str(tmp_path)]
    assert main(argv) == 0
    payload = json.loads((tmp_path / "split-digits" / "results.json").read_text())
    sel = payload["selection"]["naive"]
    assert set(sel["candidates"]) == {"naive [lr=1e-05]", "naive [lr=0.01]"}
    best = max(sel["candidates"], key=sel["candidates"].get)
    assert sel["selected"] == best
    report = (tmp_path / "split-digits" / "report.md").read_text()
    table = report.split("Time per run")[0]
    assert f"| {best} | 1 |" in table
    other = next(c for c in sel["candidates"] if c != best)
    assert f"| {other} | 1 |" not in table  # the other candidate's test accuracy is not shown
    assert "Settings selected on validation accuracy" in report
    assert {r["config"]["valid_fraction"] for r in payload["runs"]} == {0.2}
    # the selection is rebuilt from the run files alone (their validation results)
    (tmp_path / "split-digits" / "results.json").unlink()
    rebuilt = ["split-digits", "--report-only", "--select-on", "validation", "--out", str(tmp_path)]
    assert main(rebuilt) == 0
    again = json.loads((tmp_path / "split-digits" / "results.json").read_text())
    assert again["selection"] == payload["selection"]


def test_demo_leaks_no_warnings_and_ends_with_its_takeaway(tmp_path, capsys, monkeypatch, recwarn):
    import warnings

    import torchvision.datasets as tvd

    class Offline(tvd.MNIST):
        def download(self):
            raise RuntimeError("offline")

    monkeypatch.setattr(tvd, "MNIST", Offline)
    warnings.simplefilter("always")
    argv = ["demo", "--data-root", str(tmp_path / "empty"), "--out", str(tmp_path / "out")]
    argv += ["--epochs", "1", "--n-train", "160", "--n-test", "40", "--batch-size", "8"]  # bars
    assert main(argv) == 0
    out = capsys.readouterr().out
    for name in ("fromp", "ewc", "vcl", "naive"):
        assert f"| {name} | 1 |" in out
    leaked = [
        str(w.message)
        for w in recwarn
        if issubclass(w.category, UserWarning | RuntimeWarning)
        and "QP solver" not in str(w.message)
        and "No loggers specified" not in str(w.message)
    ]
    assert leaked == []
    from fromp_bench.command import takeaway

    payload = json.loads((tmp_path / "out" / "permuted-digits" / "results.json").read_text())
    assert set(payload["aggregate"]) == {"fromp", "ewc", "vcl", "naive"}
    assert out.rstrip().endswith(takeaway(payload["aggregate"]))


def test_opt_prefix_sets_optimizer_keyword_arguments():
    from fromp_bench.command import _merge, _parse_set, grid_tag, parse_grid

    parsed = _parse_set(["opt.beta2=0.999", "tau=0.5", "lr=0.1"])
    assert parsed == {"optimizer_kwargs": {"beta2": 0.999}, "kwargs": {"tau": 0.5}, "lr": 0.1}
    points = parse_grid(["opt.hess_init=0.1,1.0", "tau=1"])
    assert [p["optimizer_kwargs"] for p in points] == [{"hess_init": 0.1}, {"hess_init": 1.0}]
    assert grid_tag(points[1]) == "opt.hess_init=1.0,tau=1"
    merged = _merge(parsed, points[1])  # the grid point wins, the rest is kept
    assert merged["optimizer_kwargs"] == {"beta2": 0.999, "hess_init": 1.0}
    assert merged["kwargs"] == {"tau": 1} and merged["lr"] == 0.1
    # the optimizer keyword arguments reach resolve_settings over SETTINGS and the preset
    s = resolve_settings(get_benchmark("split-mnist"), get_strategy("ivon"), merged)
    assert s["optimizer_kwargs"]["beta2"] == 0.999 and s["optimizer_kwargs"]["hess_init"] == 1.0
    assert s["optimizer_kwargs"]["weight_decay"] == 1e-4  # from fromp_bench/settings.py


# ----------------------------------------------------------------- class-incremental split


def test_class_incremental_sequence_has_global_labels_and_one_head():
    from fromp_bench.data import class_incremental

    from tests.cases import synthetic_split

    split = synthetic_split(n_tasks=3, train_size=20, test_size=10)
    seq = class_incremental(split)
    assert (seq.multi_head, seq.n_outputs, len(seq)) == (False, 6, 3)
    for t, s in zip(seq, split):
        assert t.classes == s.classes == [2 * t.task_id, 2 * t.task_id + 1]
        # the label of every example is its original class, not its place in the task
        assert torch.equal(t.train_y, s.train_y + 2 * t.task_id)
        assert torch.equal(t.test_y, s.test_y + 2 * t.task_id)
        assert torch.equal(t.train_x, s.train_x)
    with pytest.raises(ValueError, match="single-head already"):
        class_incremental(seq)


def test_split_mnist_ci_standardises_pixels_as_avalanche_splitmnist(tmp_path):
    # Avalanche's default MNIST transform: ToTensor (pixels / 255) then Normalize(0.1307,
    # 0.3081); the multi-head split MNIST keeps FROMP's raw [0, 1] pixels
    from fromp_bench.data import split_mnist, split_mnist_ci

    from tests.bench.test_runner_integrity import write_mnist

    write_mnist(tmp_path, n_train=100, n_test=50)
    raw = split_mnist(tmp_path, download=False)
    ci = split_mnist_ci(tmp_path, download=False)
    for t, r in zip(ci, raw):
        assert float(r.train_x.min()) >= 0 and float(r.train_x.max()) <= 1
        for got, pix in ((t.train_x, r.train_x), (t.test_x, r.test_x)):
            expected = (pix.double() * 255).round() / 255  # the stored bytes
            want = (expected - 0.1307) / 0.3081
            torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
        assert t.train_y.tolist() == (r.train_y + 2 * r.task_id).tolist()


@pytest.mark.parametrize("name", ["split-mnist-ci", "split-digits-ci"])
def test_class_incremental_benchmarks_share_protocol_and_memory(name):
    bench = get_benchmark(name)
    n_tasks, _, n_out, multi = bench.layout
    assert (n_tasks, n_out, multi) == (5, 10, False)
    got = {
        s: resolve_settings(bench, get_strategy(s), {})
        for s in ("fromp", "fromp-coreset", "replay", "naive", "lwf", "ewc-avalanche")
    }
    protocol = {
        s: (v["optimizer"], v["lr"], v["train_epochs"], v["train_mb_size"]) for s, v in got.items()
    }
    assert len(set(protocol.values())) == 1, protocol
    memory = got["replay"]["kwargs"]["mem_per_experience"]
    assert got["fromp-coreset"]["kwargs"]["n_points"] == memory
    assert got["fromp"]["kwargs"]["n_points"] == memory
    assert got["fromp-coreset"]["kwargs"]["replay"] is True
    assert got["replay"]["kwargs"]["n_experiences"] == n_tasks
    if name == "split-mnist-ci":  # S-FSVI's single-head split MNIST: 200 per task
        assert memory == 200


def test_permuted_coreset_is_fromp_with_s_fsvis_memory_replayed():
    """fromp-coreset on permuted MNIST: fromp's penalty (logits, jitter, clipping, full
    curvature), epochs and batches with S-FSVI's "pmnist" memory of 200 points per task
    replayed with their labels; besides the coreset's settings only what was selected on
    validation under the coreset differs (the step size and its schedule, the prior)."""
    bench = get_benchmark("permuted-mnist")
    own = resolve_settings(bench, get_strategy("fromp"), {})
    core = resolve_settings(bench, get_strategy("fromp-coreset"), {})
    for key in ("optimizer", "train_epochs", "train_mb_size"):
        assert core[key] == own[key], key
    assert own.get("lr_schedule", "constant") == "constant"
    assert core["lr_schedule"] == "cosine" and core["lr"] == 2e-3 and core["lr_warmup"] == 0.05
    assert own.get("lr_warmup", 0) == 0
    assert core["kwargs"]["n_points"] == own["kwargs"]["n_points"] == 200
    assert core["kwargs"]["replay"] is True and core["kwargs"]["select"] == "random"
    assert core["kwargs"]["replay_weight"] > 1
    changed = {k for k in core["kwargs"] if core["kwargs"][k] != own["kwargs"].get(k)}
    assert changed <= {
        "replay",
        "select",
        "replay_weight",
        "tau",
        "prior_precision",
        "curvature_combine",
    }, changed
    assert core["kwargs"]["prior_precision"] == 1e-4
    assert core["kwargs"]["curvature_combine"] == 0.5 and core["kwargs"]["tau"] == 0.7
    assert own["kwargs"].get("curvature_combine", "sum") == "sum"
    for key in ("function", "jitter", "grad_clip_norm"):
        assert core["kwargs"][key] == own["kwargs"][key], key
    assert core["kwargs"]["function"] == "logits"
    assert core["kwargs"]["curvature_examples"] is None


def test_class_incremental_digits_one_ten_way_head_and_every_method_in_the_table(tmp_path):
    bench = get_benchmark("split-digits-ci")
    seq = bench.load(None)
    net = bench.model(seq)
    x = seq[0].train_x[:3]
    assert net(x).shape == (3, 10)
    assert getattr(net, "n_heads", 1) == 1
    for t in seq:  # labels are the digits themselves
        assert set(t.train_y.unique().tolist()) == set(t.classes)
    names = ["naive", "replay", "lwf", "ewc-avalanche", "fromp", "fromp-coreset"]
    argv = ["split-digits-ci", "--strategies", ",".join(names), "--epochs", "1"]
    argv += ["--n-train", "60", "--n-test", "20", "--no-progress", "--out", str(tmp_path)]
    argv += ["--valid-fraction", "0.2", "--select-on", "validation"]
    assert main(argv) == 0
    payload = json.loads((tmp_path / "split-digits-ci" / "results.json").read_text())
    assert set(payload["aggregate"]) == set(names)
    report = (tmp_path / "split-digits-ci" / "report.md").read_text()
    for n in names:
        assert f"| {n} | 1 |" in report


def test_experience_replay_keeps_its_memory_per_experience_and_restores_it():
    from fromp_avalanche.benchmarks import ExperienceReplay, experience_tensors
    from fromp_bench.data import class_incremental, to_avalanche

    from tests.cases import synthetic_split

    seq = class_incremental(synthetic_split(n_tasks=3, input_shape=(6,), train_size=30))
    scenario = to_avalanche(seq)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 6))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    sizes = {"mem_per_experience": 4, "n_experiences": 3}
    strategy = ExperienceReplay(model=net, optimizer=opt, train_mb_size=8, evaluator=None, **sizes)
    plugin = strategy.plugins[0]
    for t, exp in enumerate(scenario.train_stream):
        strategy.train(exp)
        groups = plugin.storage_policy.buffer_groups
        assert sorted(groups) == list(range(t + 1))  # after tasks 1, 2 and 3
        for k, g in groups.items():
            _, y, _ = experience_tensors(g.buffer)
            assert len(y) == 4 and set(y.tolist()) <= set(seq[k].classes)
    state = plugin.state_dict()
    other = ExperienceReplay(
        model=net, optimizer=opt, mem_per_experience=4, n_experiences=3, evaluator=None
    ).plugins[0]
    other.load_state_dict(state)
    again = other.state_dict()
    assert again["num_exps"] == 3
    for k in state["groups"]:
        for key in ("x", "y", "weights"):
            assert torch.equal(again["groups"][k][key], state["groups"][k][key])
    with pytest.raises(ValueError, match="mem_per_experience"):
        ExperienceReplay(model=net, optimizer=opt, mem_per_experience=0)


def test_each_run_seed_draws_its_own_memory(monkeypatch):
    # FROMP's random memorable points come from the method's own generator: a runner that
    # left its seed at the default (0) gave every run seed the same memory, so the spread
    # over seeds hid the memory's draw
    from fromp_bench.runner import strategy_kwargs

    from fromp import FROMPMethod

    drawn: dict[int, list] = {}
    learn = FROMPMethod.learn_task

    def spy(self, net, x, y, task, *args, **kwargs):
        out = learn(self, net, x, y, task, *args, **kwargs)
        drawn.setdefault(self.seed, []).append(self.regularizer.memories[-1].inputs.clone())
        return out

    monkeypatch.setattr(FROMPMethod, "learn_task", spy)
    kw = dict(train_size=40, test_size=10, overrides={"train_epochs": 1}, progress=False)
    for seed in (0, 1):
        run(RunConfig("split-digits-ci", "fromp-coreset", seed=seed, **kw))
    assert sorted(drawn) == [0, 1]  # the method got the run's seed
    assert not torch.equal(drawn[0][0], drawn[1][0])  # and drew other points
    # a seed named in the settings wins, for every run seed
    drawn.clear()
    pinned = {**kw, "overrides": {"train_epochs": 1, "kwargs": {"seed": 7}}}
    for seed in (0, 1):
        run(RunConfig("split-digits-ci", "fromp-coreset", seed=seed, **pinned))
    assert list(drawn) == [7] and torch.equal(drawn[7][0], drawn[7][5])
    # strategies without a seed argument, or whose seed defaults to None (VCL's: drawn from
    # the global generator, which the run's seed sets), are left as they were
    from fromp_avalanche.vcl import VCL

    assert strategy_kwargs(torch.nn.Linear, {"in_features": 2}, 3) == {"in_features": 2}
    assert strategy_kwargs(VCL, {"coreset_size": 2}, 3) == {"coreset_size": 2}
    assert strategy_kwargs(FROMPMethod, {}, 3) == {"seed": 3}
