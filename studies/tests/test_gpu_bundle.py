"""make gpu-bundle (studies/gpu_bundle.py): the bundle pins its wheels from constraints.txt,
checks its sources before any work and prints a device command within the tool's limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from studies import gpu_bundle


def test_the_bundle_pins_every_wheel_from_constraints(tmp_path):
    pins = gpu_bundle.pins(gpu_bundle.ROOT / "constraints.txt")
    assert set(pins) == set(gpu_bundle.WHEELS) and pins["avalanche-lib"].startswith("0.6")
    c = tmp_path / "c.txt"
    c.write_text("Avalanche_Lib==0.6.0\ndill==0.4.1 ; python_version>'3'\n")
    assert gpu_bundle.pins(c, ("avalanche-lib", "dill")) == {"avalanche-lib": "0.6.0",
                                                             "dill": "0.4.1"}  # fmt: skip
    with pytest.raises(ValueError, match="gdown"):
        gpu_bundle.pins(c, ("dill", "gdown"))


def test_the_device_command_fits_the_limit_and_reads_the_bundle():
    cmd = gpu_bundle.device_command(gpu_bundle.BUNDLE, 400)
    assert len(cmd) <= gpu_bundle.COMMAND_LIMIT
    assert ".gpu-bundle/whl/*.whl" in cmd and "FROMP_DATA=$PWD/.gpu-bundle/data" in cmd
    assert "bash studies/gpu_step.sh $OUT 400" in cmd
    assert cmd.index("pip install") < cmd.index("gpu_step.sh")


def _mnist(root: Path) -> Path:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for f in gpu_bundle.MNIST:
        (raw / f).write_bytes(b"")
    return root


def test_the_bundle_dry_run_checks_and_prints_without_fetching(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gpu_bundle, "fetch", lambda *a: pytest.fail("fetched"))
    dest = gpu_bundle.ROOT / ".gpu-bundle" / "test-dry-run"
    rc = gpu_bundle.main(["--dry-run", "--data", str(_mnist(tmp_path)), "--dest", str(dest)])
    out = capsys.readouterr().out
    assert rc == 0 and "command: set -o pipefail;" in out and "carry" in out
    assert not dest.exists()


def test_the_bundle_refuses_missing_data_or_a_tracked_folder(tmp_path, capsys):
    assert gpu_bundle.main(["--dry-run", "--data", str(tmp_path)]) == 2
    assert "--data" in capsys.readouterr().err
    data = str(_mnist(tmp_path / "d"))
    assert gpu_bundle.main(["--dry-run", "--data", data, "--dest", str(tmp_path / "b")]) == 2
    assert "inside the checkout" in capsys.readouterr().err
    if (gpu_bundle.ROOT / ".git").exists():
        tracked = gpu_bundle.ROOT / "benchmarks" / "bundle-x"
        assert gpu_bundle.main(["--dry-run", "--data", data, "--dest", str(tracked)]) == 2
        assert "does not ignore" in capsys.readouterr().err
    assert gpu_bundle.main(["--dry-run", "--data", data, "--budget", "500"]) == 2
    assert "--budget" in capsys.readouterr().err
