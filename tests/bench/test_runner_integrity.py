"""The runner refuses what it cannot use and never reports a wrong number: one test per case
of issue 15 (non-finite runs, bad settings, changed data on resume, mixed settings in a
report, bad output directories, corrupt checkpoints and data, Ctrl-C, untrained tasks)."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from fromp_bench import command as bench_main
from fromp_bench import data as D
from fromp_bench.__main__ import main
from fromp_bench.cli import gp_main, memorable_main
from fromp_bench.plugins import _write_checkpoint
from fromp_bench.report import aggregate, command_line
from fromp_bench.runner import (
    CheckpointError,
    RunConfig,
    expected_calibration_error,
    method_plugins,
    run,
)

QUICK = ["--epochs", "1", "--n-train", "60", "--n-test", "30", "--no-progress"]


def _one_line_error(capsys, needle: str) -> str:
    err = capsys.readouterr().err.strip()
    assert needle in err, err
    assert "\n" not in err and "Traceback" not in err, err
    return err


# ----------------------------------------------------------------------- fake MNIST files
def _idx(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
        int(d).to_bytes(4, "big") for d in array.shape
    )
    return header + array.astype(np.uint8).tobytes()


def write_mnist(root: Path, n_train: int = 400, n_test: int = 200, seed: int = 0) -> Path:
    """Tiny MNIST-format files (random images, balanced labels) under ``root/MNIST/raw``."""
    rng = np.random.default_rng(seed)
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(_idx(rng.integers(0, 256, (n, 28, 28))))
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(_idx(np.arange(n) % 10))
    return raw


# ----------------------------------------------------------------------- non-finite runs
def test_diverged_run_is_failed_not_averaged(tmp_path, capsys):
    argv = ["split-digits", "--strategies", "naive", "--set", "optimizer='sgd'", "--lr", "1e8"]
    assert main([*argv, *QUICK, "--out", str(tmp_path)]) == 3
    captured = capsys.readouterr()
    assert "FAILED on task 1" in captured.out and "run(s) failed" in captured.err
    payload = json.loads((tmp_path / "split-digits" / "results.json").read_text())
    assert payload["aggregate"] == {}
    assert (
        payload["failed"][0]["task"] == 1 and "not finite" in payload["failed"][0]["reason"]
    ) or ("nan" in payload["failed"][0]["reason"])
    assert (
        "FAILED (not in the table): naive seed 0, task 1"
        in (tmp_path / "split-digits" / "report.md").read_text()
    )


def test_failed_run_is_left_out_of_the_aggregate():
    ok = {"strategy": "naive", "seed": 0, "complete": True, "failed": None, "settings": {}}
    ok.update(mean_accuracy=90.0, accuracy_matrix=[[90.0]], final_accuracies=[90.0])
    bad = {**ok, "seed": 1, "complete": False, "failed": {"task": 2, "reason": "nan"}}
    agg = aggregate([ok, bad])
    assert agg["naive"]["seeds"] == [0] and agg["naive"]["mean_accuracy"]["mean"] == 90.0


def test_ece_does_not_hide_nan():
    y = torch.tensor([0, 1])
    probs = torch.tensor([[float("nan"), float("nan")], [0.2, 0.8]])
    assert math.isnan(expected_calibration_error(probs, y))


def test_nan_weights_after_a_task_fail_the_run_with_that_task(tmp_path, monkeypatch):
    """Weights that become NaN without a NaN loss (e.g. an optimizer's update) are caught
    after the task, which is named."""
    from avalanche.training import Naive

    calls = {"n": 0}
    original = Naive.train

    def poisoned(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 2:  # task 2's weights
            with torch.no_grad():
                next(self.model.parameters()).fill_(float("nan"))
        return out

    monkeypatch.setattr(Naive, "train", poisoned)
    cfg = RunConfig(
        "split-digits", "naive", overrides={"train_epochs": 1}, train_size=40, test_size=20
    )
    cfg.progress = False
    res = run(cfg)
    assert not res["complete"] and res["failed"]["task"] == 2
    assert "not finite" in res["failed"]["reason"]
    assert len(res["accuracy_matrix"]) == 1 and "mean_accuracy" not in res


# ----------------------------------------------------------------------- settings
@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--epochs", "-1"], "--epochs must be >= 1, got -1"),
        (["--epochs", "0"], "--epochs must be >= 1, got 0"),
        (["--n-train", "-5"], "--n-train must be >= 1, got -5"),
        (["--n-train", "0"], "--n-train must be >= 1, got 0"),
        (["--n-test", "0"], "--n-test must be >= 1"),
        (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--lr", "-1"], "--lr must be a finite number > 0"),
        (["--seeds", "0"], "--seeds must be >= 1"),
        (["--valid-fraction", "1.5"], "--valid-fraction must be in (0, 1)"),
        (["--select-on", "validation"], "--select-on validation needs --valid-fraction"),
        (["--strategies", "fromp", "--set", "tau=abc"], "tau must be a number or 'auto', got str"),
        (["--strategies", "fromp", "--set", "tau=-1"], "tau must be a finite number >= 0"),
        (["--strategies", "fromp", "--set", "n_points=2.5"], "--set n_points=2.5: expected int"),
        (["--strategies", "naive", "--set", "nope=1"], "--set nope: not a setting"),
        (["--strategies", "naive", "--set", "optimizer='rmsprop'"], "optimizer must be one of"),
        (["--strategies", "naive", "--grid", "lr"], "--grid expects key=value1,value2"),
        (["--strategies", "ivon", "--set", "opt.beta2=1.5"], "betas must be two floats in [0, 1)"),
        (["--strategies", "naive", "--set", "opt.nope=1"], "--set opt.nope: not a keyword arg"),
        (["--strategies", "naive", "--set", "opt.betas=0.5"], "--set opt.betas=0.5: expected a"),
        (["--strategies", "naive", "--set", "opt.eps='x'"], "--set opt.eps='x': expected a num"),
        (["--strategies", ""], "--strategies '': expected comma-separated names"),
        (["--strategies", "naive,,ewc"], "with no empty name"),
        (["--strategies", "naive,naive"], "naive listed twice"),
        (["--strategies", "naive", "--grid", "lr=0.1,0.1"], "a value is listed twice"),
        (["--strategies", "naive", "--set", "opt.=1"], "expected opt.NAME"),
    ],
)
def test_bad_setting_is_one_line_before_any_data(extra, needle, tmp_path, capsys, monkeypatch):
    def no_data(*args, **kwargs):
        raise AssertionError("data loaded before the settings were checked")

    monkeypatch.setattr(bench_main, "load_sequence", no_data)
    monkeypatch.setattr(bench_main, "check_data", no_data)
    assert main(["split-digits", *extra, "--out", str(tmp_path), "--no-progress"]) == 2
    _one_line_error(capsys, needle)


def test_n_points_above_the_smallest_class_is_refused_before_training(tmp_path, capsys):
    argv = ["split-digits", "--strategies", "fromp", "--n-train", "30", "--out", str(tmp_path)]
    assert main(argv) == 2
    err = _one_line_error(capsys, "n_points=40 asks for 20 memorable examples per class")
    assert "lower n_points" in err
    assert not list(tmp_path.rglob("*.pt"))  # nothing trained


def test_device_without_hardware_is_refused(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["split-digits", "--device", "cuda", "--out", str(tmp_path)]) == 2
    _one_line_error(capsys, "--device cuda: CUDA is not available")
    assert main(["split-digits", "--device", "gpu0", "--out", str(tmp_path)]) == 2
    _one_line_error(capsys, "--device 'gpu0': not a torch device")


def test_unusable_out_is_refused(tmp_path, capsys):
    file = tmp_path / "file"
    file.write_text("x")
    assert main(["split-digits", "--strategies", "naive", "--out", str(file)]) == 2
    _one_line_error(capsys, f"--out {file}: is a file")
    assert main(["split-digits", "--strategies", "naive", "--out", str(file / "sub")]) == 2
    _one_line_error(capsys, "cannot write there")


# ----------------------------------------------------------------------- resume
def test_resume_refuses_another_data_root(tmp_path, capsys):
    a, b = write_mnist(tmp_path / "a").parents[1], write_mnist(tmp_path / "b", seed=1).parents[1]
    argv = ["split-mnist", "--strategies", "naive", *QUICK, "--out", str(tmp_path / "out")]
    assert main([*argv, "--data-root", str(a), "--stop-after", "2"]) == 0
    capsys.readouterr()
    assert main([*argv, "--data-root", str(b), "--resume"]) == 2
    err = _one_line_error(capsys, "was written by a different run")
    assert "data_root" in err and "data hash" in err
    (run_file,) = (tmp_path / "out" / "split-mnist" / "runs").glob("naive-*seed0.json")
    payload = json.loads(run_file.read_text())
    assert len(payload["data"]["fingerprint"]["tasks"]) == 5
    # the records name no path of the machine: the data root is DATA (the data are identified
    # by their fingerprint), the checkpoint relative to the output folder, the command's paths
    # OUT and DATA (before, the absolute paths, e.g. /work/... and /tmp/..., were recorded)
    assert payload["data"]["root"] == payload["config"]["data_root"] == "DATA"
    assert payload["config"]["checkpoint"] == f"checkpoints/{run_file.stem}.pt"
    results = (tmp_path / "out" / "split-mnist" / "results.json").read_text()
    assert str(tmp_path) not in run_file.read_text() + results
    words = ["fromp-bench", "split-mnist", "--out", str(tmp_path), f"--data-root={a}", "--seeds"]
    assert (
        command_line([*words, "2"])
        == "fromp-bench split-mnist --out OUT --data-root=DATA --seeds 2"
    )


def test_resume_refuses_changed_data_under_the_same_root(tmp_path, capsys):
    root = write_mnist(tmp_path / "d").parents[1]
    argv = ["split-mnist", "--strategies", "naive", *QUICK, "--data-root", str(root)]
    argv += ["--out", str(tmp_path / "out")]
    assert main([*argv, "--stop-after", "1"]) == 0
    write_mnist(tmp_path / "d", seed=5)  # same sizes, other pixels
    bench_main.load_sequence.__globals__["_SEQ_CACHE"].clear()
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 2
    err = _one_line_error(capsys, "different run")
    assert "data hash" in err and "data_root" not in err


def test_resume_after_a_settings_change_is_one_line(tmp_path, capsys, monkeypatch):
    """Other settings are another run (other files): --resume says it starts it from the
    beginning and keeps the earlier run's checkpoint; a checkpoint of the same label written
    with other settings (here: planted) is refused naming the setting."""
    argv = ["split-digits", "--strategies", "naive", *QUICK, "--out", str(tmp_path)]
    assert main([*argv, "--stop-after", "1"]) == 0
    (first,) = (tmp_path / "split-digits" / "checkpoints").glob("naive*.pt")
    before = first.read_bytes()
    capsys.readouterr()
    assert main([*argv, "--resume", "--lr", "0.5", "--stop-after", "1"]) == 0
    err = capsys.readouterr().err
    assert "no checkpoint of these settings" in err and first.name in err
    assert first.read_bytes() == before
    monkeypatch.setattr(bench_main, "settings_id", lambda *a, **k: "same")
    assert main([*argv, "--stop-after", "1"]) == 0
    capsys.readouterr()
    assert main([*argv, "--resume", "--lr", "0.5"]) == 2
    _one_line_error(capsys, "lr")


@pytest.mark.parametrize("content", [b"", b"\x80\x04garbage", None])
def test_corrupt_checkpoint_is_one_line(content, tmp_path, capsys):
    argv = ["split-digits", "--strategies", "naive", *QUICK, "--out", str(tmp_path)]
    assert main([*argv, "--stop-after", "1"]) == 0
    (ckpt,) = (tmp_path / "split-digits" / "checkpoints").glob("naive*.pt")
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 2] if content is None else content)
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 2
    err = _one_line_error(capsys, str(ckpt))
    assert "empty" in err or "does not match its checksum" in err


def _del(key):
    def edit(s):
        del s[key]

    return edit


def _del_weight(s):
    del s["model"][next(iter(s["model"]))]


def _reshape_weight(s):
    name = next(iter(s["model"]))
    s["model"][name] = torch.zeros(3, 3)


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda s: s.update(done=-1), "done=-1, expected 0 <= done <= 5"),
        (lambda s: s.update(done=99), "done=99, expected 0 <= done <= 5"),
        (lambda s: s.update(done=True), "done is a bool"),
        (lambda s: s.update(done=3), "matrix has 2 entries, expected 3 (done=3)"),
        (lambda s: s.update(matrix=s["matrix"][:1]), "matrix has 1 entries, expected 2"),
        (lambda s: s.update(timing=[]), "timing has 0 entries, expected 2"),
        (lambda s: s["matrix"][0].append(50.0), "a row of matrix is"),
        (lambda s: s["matrix"][1].__setitem__(0, "x"), "a row of matrix is"),
        (lambda s: s.update(valid_matrix=[[1.0]]), "valid_matrix has 1 entries, expected 0"),
        (lambda s: s.update(elapsed=float("nan")), "elapsed=nan"),
        (_del("rng"), "is missing keys ['rng']"),
        (lambda s: s["rng"].pop("numpy"), "rng is missing ['numpy']"),
        (_del("matrix"), "is missing keys ['matrix']"),
        (lambda s: s.update(plugins=[]), "plugins is a list, expected a Mapping"),
        (_del_weight, "does not fit the strategy's model: missing"),
        (_reshape_weight, "has shape (3, 3)"),
    ],
)  # fmt: skip
def test_resume_checks_the_content_of_a_checksummed_checkpoint(edit, needle, tmp_path, capsys):
    """Before: a checkpoint whose checksum matched was trusted: done=-1 resumed into a
    10-row matrix reported complete, done=99 stayed incomplete forever, a missing rng entry
    or model tensor ended in a traceback. Each is refused in one line naming the file and
    the entry, and nothing is trained or written."""
    from fromp_avalanche.checkpoint import read_checked, write_checked

    argv = ["split-digits", "--strategies", "naive", *QUICK, "--out", str(tmp_path)]
    assert main([*argv, "--stop-after", "2"]) == 0
    (ckpt,) = (tmp_path / "split-digits" / "checkpoints").glob("naive*.pt")
    state = read_checked(ckpt)
    edit(state)
    write_checked(ckpt, state)  # the checksum matches the edited content
    before = {f: f.read_bytes() for f in (tmp_path / "split-digits").rglob("*") if f.is_file()}
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 2
    err = _one_line_error(capsys, f"checkpoint {ckpt}")
    assert needle in err and "delete it or drop --resume" in err, err
    after = {f: f.read_bytes() for f in (tmp_path / "split-digits").rglob("*") if f.is_file()}
    assert after == before


def test_ctrl_c_says_how_to_resume(tmp_path, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_main, "run", interrupted)
    argv = ["split-digits", "--strategies", "naive", *QUICK, "--out", str(tmp_path)]
    assert main(argv) == 130
    _one_line_error(capsys, "run the same command with --resume")


def test_plugin_state_is_keyed_by_name_and_restored(tmp_path):
    """FROMP with non-default settings, stopped after 2 tasks and resumed: the plugin state
    is stored under the plugin's class name and the results equal an uninterrupted run."""
    kw = dict(overrides={"train_epochs": 1, "kwargs": {"tau": 3.0, "n_points": 8}}, train_size=60)
    kw.update(test_size=30, progress=False)
    full = run(RunConfig("split-digits", "fromp", checkpoint=str(tmp_path / "a.pt"), **kw))
    part = RunConfig("split-digits", "fromp", checkpoint=str(tmp_path / "b.pt"), **kw)
    part.stop_after = 2
    run(part)
    state = torch.load(tmp_path / "b.pt", weights_only=True)
    assert "FROMPPlugin" in state["plugins"] and "Clock" in state["plugins"]
    assert state["plugins"]["FROMPPlugin"]["state_dict"]["tau"] == 3.0
    part.stop_after, part.resume = None, True
    resumed = run(part)
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    state["plugins"]["OtherPlugin"] = state["plugins"].pop("FROMPPlugin")
    _write_checkpoint(tmp_path / "b.pt", state)  # a consistent file with other plugins
    with pytest.raises(CheckpointError, match="OtherPlugin"):
        run(part)


def test_method_plugins_are_named_by_class():
    class A:
        pass

    class Fake:
        def __init__(self) -> None:
            self.plugins, self.evaluator = [A(), A()], None

    assert list(method_plugins(Fake())) == ["A", "A#2"]


# ----------------------------------------------------------------------- report grouping
def test_report_only_never_mixes_settings(tmp_path, capsys):
    base = ["split-digits", "--strategies", "naive", *QUICK, "--out", str(tmp_path)]
    assert main(base) == 0
    assert main([*base[:-2], "--lr", "0.01", "--seed-offset", "1", "--out", str(tmp_path)]) == 0
    capsys.readouterr()
    assert main(["split-digits", "--report-only", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| naive [lr=0.001] | 1 |" in out and "| naive [lr=0.01] | 1 |" in out
    assert "| naive | 2 |" not in out


# ----------------------------------------------------------------------- corrupt data
def _mnist_error(tmp_path, capsys, argv_extra=()):
    argv = ["split-mnist", "--strategies", "naive", *QUICK, "--data-root", str(tmp_path)]
    assert main([*argv, *argv_extra, "--out", str(tmp_path / "out")]) == 2
    return _one_line_error(capsys, "fromp-bench: error:")


def test_truncated_mnist_file_is_named(tmp_path, capsys):
    raw = write_mnist(tmp_path)
    f = raw / "train-images-idx3-ubyte"
    f.write_bytes(f.read_bytes()[:5000])
    err = _mnist_error(tmp_path, capsys)
    assert str(f) in err and "truncated" in err and "not found" not in err


def test_garbage_mnist_file_is_named(tmp_path, capsys):
    raw = write_mnist(tmp_path)
    f = raw / "t10k-labels-idx1-ubyte"
    f.write_bytes(b"this is not an idx file at all")
    err = _mnist_error(tmp_path, capsys)
    assert str(f) in err and "not an IDX file" in err


def test_gzipped_garbage_is_named(tmp_path, capsys):
    raw = write_mnist(tmp_path)
    f = raw / "train-labels-idx1-ubyte"
    f.unlink()
    gz = raw / "train-labels-idx1-ubyte.gz"
    gz.write_bytes(gzip.compress(b"\x00\x00\x08\x01\x00\x00\x00\xff")[:-4])
    err = _mnist_error(tmp_path, capsys)
    assert str(gz) in err


@pytest.mark.parametrize("bench_name", ["split-mnist", "permuted-mnist"])
def test_labels_out_of_range_are_refused(bench_name, tmp_path, capsys):
    raw = write_mnist(tmp_path)
    labels = np.arange(400) % 10
    labels[7] = 17
    (raw / "train-labels-idx1-ubyte").write_bytes(_idx(labels))
    argv = [bench_name, "--strategies", "naive", *QUICK, "--data-root", str(tmp_path)]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = _one_line_error(capsys, "labels out of range (first: 17 at index 7; expected 0..9)")
    assert "train-labels-idx1-ubyte" in err


def test_read_idx_roundtrip_and_trailing_bytes(tmp_path):
    a = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    f = tmp_path / "x-idx3-ubyte"
    f.write_bytes(_idx(a))
    np.testing.assert_array_equal(D.read_idx(f), a)
    f.write_bytes(_idx(a) + b"\x00")
    with pytest.raises(D.CorruptDataError, match="trailing bytes"):
        D.read_idx(f)


# ----------------------------------------------------------------------- CLIs
@pytest.mark.parametrize("tool", [memorable_main, gp_main])
def test_cli_refuses_a_task_the_checkpoint_never_trained(tool, tmp_path, capsys):
    argv = ["split-digits", "--strategies", "naive", *QUICK, "--out", str(tmp_path)]
    assert main([*argv, "--stop-after", "2"]) == 0
    (ckpt,) = (tmp_path / "split-digits" / "checkpoints").glob("naive*.pt")
    capsys.readouterr()
    assert tool([str(ckpt), "--task", "3", "--out", str(tmp_path / "t")]) == 2
    _one_line_error(capsys, "never trained task 3")
    small = ["--n", "10"] if tool is gp_main else ["--n-per-class", "3"]
    assert tool([str(ckpt), "--task", "1", *small, "--out", str(tmp_path / "t")]) == 0


@pytest.mark.parametrize("tool", [memorable_main, gp_main])
def test_cli_names_an_empty_checkpoint(tool, tmp_path, capsys):
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    assert tool([str(empty)]) == 2
    _one_line_error(capsys, f"checkpoint {empty} is empty")


@pytest.mark.parametrize("fault", ["type_code", "image_size"])
def test_mnist_with_a_wrong_type_code_or_image_size_is_refused(fault, tmp_path, capsys):
    """Read as data before: a float32 IDX file (type code 0x0D) decodes to numbers, and
    other image sizes broke the network only after loading."""
    raw = write_mnist(tmp_path)
    f = raw / "train-images-idx3-ubyte"
    if fault == "type_code":
        a = np.zeros((400, 28, 28), dtype=">f4")
        f.write_bytes(bytes([0, 0, 0x0D, 3]) + b"".join(int(d).to_bytes(4, "big")
                      for d in a.shape) + a.tobytes())  # fmt: skip
        want = "type code 0x08"
    else:
        f.write_bytes(_idx(np.zeros((400, 32, 32))))
        want = "28x28"
    argv = ["split-mnist", "--strategies", "naive", *QUICK, "--data-root", str(tmp_path)]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = _one_line_error(capsys, want)
    assert "train-images-idx3-ubyte" in err


@pytest.mark.parametrize("setting", ["tau=inf", "jitter=inf", "tau=nan"])
def test_infinite_fromp_settings_are_refused_before_training(setting, tmp_path, capsys):
    argv = ["split-digits", "--strategies", "fromp", *QUICK, "--set", setting]
    assert main([*argv, "--out", str(tmp_path)]) == 2
    _one_line_error(capsys, setting.split("=")[0])


def test_n_train_above_a_tasks_size_is_refused(tmp_path, capsys):
    """Accepted silently before (the task kept all its examples, the run recorded n_train)."""
    argv = ["split-digits", "--strategies", "naive", "--seeds", "1", "--epochs", "1",
            "--n-train", "100000", "--no-progress", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 2
    _one_line_error(capsys, "--n-train 100000 is more than the smallest task")
