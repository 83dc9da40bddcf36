"""Bad input refused before any work, with the argument named (defects of the third audit
that used to give numbers): labels of the wrong shape or kind for a likelihood,
``select_memorable`` on a network with NaN weights or with negative or fractional labels,
IVON on a NaN loss (``tests/optim/test_ivon.py``), and property-based checks of the likelihoods'
input validation."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fromp import select_memorable
from fromp.likelihood import CategoricalLikelihood, GaussianLikelihood


def test_gaussian_likelihood_refuses_class_labels_against_several_outputs():
    f = torch.randn(6, 3)
    with pytest.raises(ValueError, match=r"outputs' shape \(6, 3\)"):
        GaussianLikelihood().nll(f, torch.randint(0, 3, (6,)))  # broadcast to [6, 6] before
    # [N] targets for one output are fine and equal the [N, 1] form
    g = torch.randn(6, 1)
    y = torch.randn(6)
    torch.testing.assert_close(
        GaussianLikelihood().nll(g, y), GaussianLikelihood().nll(g, y[:, None])
    )


def test_categorical_likelihood_refuses_fractional_and_misshaped_labels():
    f = torch.randn(4, 3)
    with pytest.raises(ValueError, match="fractional"):
        CategoricalLikelihood().nll(f, torch.tensor([0.0, 1.5, 2.0, 1.0]))  # truncated before
    with pytest.raises(ValueError, match=r"\[N\]=\[4\]"):
        CategoricalLikelihood().nll(f, torch.zeros(4, 1, dtype=torch.long))
    whole = torch.tensor([0.0, 1.0, 2.0, 1.0])  # integral floats are class indices
    torch.testing.assert_close(CategoricalLikelihood().nll(f, whole),
                               CategoricalLikelihood().nll(f, whole.long()))  # fmt: skip


def test_select_memorable_refuses_nan_weights_and_bad_labels():
    net = nn.Linear(3, 2)
    x, y = torch.randn(10, 3), torch.arange(10) % 2
    with torch.no_grad():
        net.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match="weights weight are not finite"):
        select_memorable(net, x, y, n_per_class=2)
    net = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="non-negative integer"):
        select_memorable(net, x, y - 1, n_per_class=2)
    with pytest.raises(ValueError, match="non-negative integer"):
        select_memorable(net, x, y.float() + 0.5, n_per_class=2)
    assert len(select_memorable(net, x, y, n_per_class=2)) == 4


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 5),
    c=st.integers(1, 4),
    extra=st.sampled_from([(), (1,), (2,)]),
)
def test_likelihoods_accept_only_the_documented_target_shapes(n, c, extra):
    f = torch.zeros(n, c)
    y = torch.zeros(n, *extra)
    gauss_ok = tuple(y.shape) in ((n, c), (n,) if c == 1 else None)
    if gauss_ok:
        assert GaussianLikelihood().nll(f, y).shape == (n,)
    else:
        with pytest.raises(ValueError, match="shape"):
            GaussianLikelihood().nll(f, y)
    if extra == ():
        assert CategoricalLikelihood().nll(f, y.long()).shape == (n,)
    else:
        with pytest.raises(ValueError, match=r"\[N\]"):
            CategoricalLikelihood().nll(f, y.long())


# ----------------------------------------------------------------------------- runs


def _cfg(path, **kw):
    from fromp_bench.runner import RunConfig

    base = dict(overrides={"train_epochs": 1}, train_size=60, test_size=20, checkpoint=str(path),
                progress=False)  # fmt: skip
    base.update(kw)
    return RunConfig("split-digits", "naive", **base)


def test_a_run_records_its_code_and_environment(tmp_path):
    from fromp_bench.runner import run

    res = run(_cfg(tmp_path / "c.pt", stop_after=1))
    assert set(res["code"]) == {"version", "source_hash", "git_commit"}
    assert len(res["code"]["source_hash"]) == 16
    assert res["env"]["torch"] == torch.__version__ and res["env"]["device"] == "cpu"


def test_resume_refuses_other_code_unless_allowed_and_records_it(tmp_path, monkeypatch):
    import fromp_bench.runner as runner

    path = tmp_path / "c.pt"
    runner.run(_cfg(path, stop_after=1))
    real = runner.code_record()
    other = {**real, "source_hash": "0" * 16}
    monkeypatch.setattr(runner, "code_record", lambda: other)
    with pytest.raises(runner.CheckpointError, match="code"):
        runner.run(_cfg(path, resume=True))
    res = runner.run(_cfg(path, resume=True, allow_code_change=True))
    assert res["resumed_from_code"] == real["source_hash"] and res["complete"]


def test_a_damaged_or_unchecked_checkpoint_is_refused_with_its_path(tmp_path):
    import fromp_bench.runner as runner

    path = tmp_path / "c.pt"
    runner.run(_cfg(path, stop_after=1))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit inside the zip (a CRC torch would skip)
    path.write_bytes(bytes(data))
    with pytest.raises(runner.CheckpointError, match=rf"{path}.*checksum"):
        runner.run(_cfg(path, resume=True))
    path.with_name(path.name + ".sha256").unlink()
    with pytest.raises(runner.CheckpointError, match="no checksum"):
        runner.run(_cfg(path, resume=True))


def test_resume_on_a_device_string_with_an_index(tmp_path):
    """``--device cpu:0``: the checkpoint is read on the CPU and the RNG state restored
    (``torch.set_rng_state`` needs a CPU byte tensor); the resumed run equals a straight one."""
    from fromp_bench.runner import run

    straight = run(_cfg(tmp_path / "a.pt", device="cpu:0"))
    run(_cfg(tmp_path / "b.pt", device="cpu:0", stop_after=2))
    resumed = run(_cfg(tmp_path / "b.pt", device="cpu:0", resume=True))
    assert resumed["accuracy_matrix"] == straight["accuracy_matrix"]


def test_a_crash_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    import os

    import fromp_bench.runner as runner

    path = tmp_path / "c.pt"
    runner.run(_cfg(path, stop_after=1))
    before = path.read_bytes()

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(OSError, match="No space"):
        runner._write_checkpoint(path, {"x": torch.zeros(3)})
    monkeypatch.undo()
    assert path.read_bytes() == before
    runner._read_checkpoint(path)  # still whole and matching its checksum


QUICK = ["--seeds", "1", "--epochs", "1", "--n-train", "40", "--n-test", "20", "--no-progress"]


def test_a_second_job_into_the_same_out_is_refused_and_a_stale_lock_taken_over(tmp_path, capsys):
    import os
    import subprocess
    import sys

    from fromp_bench.__main__ import main

    base = tmp_path / "split-digits"
    base.mkdir()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (base / ".lock").write_text(str(alive.pid))
        argv = ["split-digits", "--strategies", "naive", *QUICK, "--out", str(tmp_path)]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"pid {alive.pid}" in err
    finally:
        alive.kill()
        alive.wait()
    (base / ".lock").write_text(str(alive.pid))  # its process is gone: stale
    assert main(argv) == 0
    assert not (base / ".lock").exists()
    assert os.path.exists(base / "results.json")


def test_a_later_invocation_adds_to_results_json_instead_of_replacing_it(tmp_path, capsys):
    import json

    from fromp_bench.__main__ import main

    out = ["--out", str(tmp_path)]
    assert main(["split-digits", "--strategies", "naive", *QUICK, *out]) == 0
    assert main(["split-digits", "--strategies", "ewc", *QUICK, *out]) == 0
    runs = json.loads((tmp_path / "split-digits" / "results.json").read_text())["runs"]
    assert sorted(r["strategy"] for r in runs) == ["ewc", "naive"]
    # the same (strategy, settings, seed) again replaces its earlier result
    assert main(["split-digits", "--strategies", "ewc", *QUICK, *out]) == 0
    runs = json.loads((tmp_path / "split-digits" / "results.json").read_text())["runs"]
    assert sorted(r["strategy"] for r in runs) == ["ewc", "naive"]


def test_ansi_escapes_never_reach_a_failure_reason():
    from fromp_bench.sweep import failure_reason

    coloured = "\x1b[36mray::ImplicitFunc.train()\x1b[39m (pid=1)\n  boom " + "x" * 400
    reason = failure_reason(RuntimeError(coloured))
    assert "\x1b" not in reason and "[36m" not in reason
    assert reason.startswith("ray::ImplicitFunc.train() (pid=1) boom") and len(reason) == 300
    assert failure_reason(None) == "no result reported"


def test_unwritable_run_directories_and_a_full_disk_are_refused_before_training(
    tmp_path, capsys, monkeypatch
):
    """Found only after a task had trained before (the checkpoint write failed). The
    unwritable directory is simulated (the tests may run as root, which ignores modes)."""
    import shutil
    import tempfile
    from collections import namedtuple
    from pathlib import Path

    import fromp_bench.command as command
    from fromp_bench.__main__ import main

    trained = []
    monkeypatch.setattr(command, "run", lambda cfg: trained.append(cfg) or {})
    argv = ["split-digits", "--strategies", "naive", *QUICK, "--out", str(tmp_path)]
    real = tempfile.NamedTemporaryFile

    def read_only(*args, **kwargs):
        if Path(kwargs.get("dir", ".")).name == "checkpoints":
            raise PermissionError(13, "Permission denied")
        return real(*args, **kwargs)

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", read_only)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "checkpoints: cannot write there (Permission denied)" in err
    monkeypatch.setattr(tempfile, "NamedTemporaryFile", real)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 10**6, 10**6))
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "MB free" in err and len(err.strip().splitlines()) == 1
    assert trained == []  # nothing was trained


def _killed_when_stalled(tmp_path, writer) -> None:
    """Run ``writer`` in a fork of this process and kill it (SIGKILL) once it has written
    ``tmp_path / "stalled"`` (in the middle of its write, where it then sleeps)."""
    import signal
    import time

    from tests.cases import exit_code, forked

    pid = forked(writer)
    deadline = time.monotonic() + 60
    while not (tmp_path / "stalled").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    stalled = (tmp_path / "stalled").exists()
    os.kill(pid, signal.SIGKILL)
    assert exit_code(pid, 10) == -signal.SIGKILL
    assert stalled, "the writer never reached the write"


def test_sigkill_during_a_checkpoint_write_keeps_the_previous_checkpoint(tmp_path):
    """A process killed (SIGKILL) in the middle of writing a checkpoint: the previous
    checkpoint and its checksum are untouched and still load."""
    import time

    from fromp_bench.plugins import _read_checkpoint, _write_checkpoint

    path = tmp_path / "c.pt"
    _write_checkpoint(path, {"version": 3, "config": {}, "model": {"w": torch.ones(3)}})
    before = path.read_bytes()

    def stall(fd):
        (tmp_path / "stalled").write_text("1")
        time.sleep(60)

    def writer():
        os.fsync = stall  # in the child only
        _write_checkpoint(path, {"version": 3, "config": {}, "model": {"w": torch.zeros(1000)}})

    _killed_when_stalled(tmp_path, writer)
    assert path.read_bytes() == before
    state = _read_checkpoint(path)
    assert torch.equal(state["model"]["w"], torch.ones(3))


def test_sigkill_during_a_results_write_keeps_the_previous_results_json(tmp_path):
    """``results.json`` killed (SIGKILL) half-written: the previous file is whole and loads,
    and the next write replaces the half-written temporary file."""
    import json
    import time
    from pathlib import Path

    from fromp_bench.report import save_json

    path = tmp_path / "results.json"
    save_json(path, {"runs": [{"seed": 0}]})
    before = path.read_text()

    def half(self, data, *args, **kwargs):
        with open(self, "w") as f:
            f.write(data[: len(data) // 2])
            f.flush()
        (tmp_path / "stalled").write_bytes(b"1")
        time.sleep(60)

    def writer():
        Path.write_text = half  # in the child only
        save_json(path, {"runs": [{"seed": s} for s in range(1000)]})

    _killed_when_stalled(tmp_path, writer)
    assert path.read_text() == before and json.loads(before) == {"runs": [{"seed": 0}]}
    assert (tmp_path / "results.json.tmp").exists()  # the half-written file, never renamed
    save_json(path, {"runs": [{"seed": 1}]})
    assert json.loads(path.read_text()) == {"runs": [{"seed": 1}]}
