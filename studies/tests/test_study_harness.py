"""The studies' one harness (studies.harness): the checks before any work, the
record's command and environment, atomic writes, refusal of non-finite numbers, and every
study built on it."""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from studies import harness

ROOT = Path(__file__).resolve().parents[2]
NOT_STUDIES = {"__init__", "harness", "laplace_torch_table"}
STUDIES = sorted(p for p in (ROOT / "studies").glob("*.py") if p.stem not in NOT_STUDIES)


def test_prepare_out_refuses_before_any_work(tmp_path):
    with pytest.raises(SystemExit, match=r"--out .*: is a directory"):
        harness.prepare_out(tmp_path)
    blocker = tmp_path / "file.json"
    blocker.write_text("{}")
    with pytest.raises(SystemExit, match="is a file, not a directory"):
        harness.prepare_out(blocker / "sub" / "x.json")
    out = harness.prepare_out(tmp_path / "new" / "x.json")
    assert out.parent.is_dir() and not out.exists()  # the probe file is gone
    assert [p.name for p in out.parent.iterdir()] == []


def test_write_record_adds_command_and_environment(tmp_path):
    out = tmp_path / "r.json"
    rec = harness.write_record(
        out, {"rows": [{"nll": 0.5}]}, module="studies.x", argv=["--n", "3 4"]
    )
    back = json.loads(out.read_text())
    assert back == rec
    assert back["command"] == "python -m studies.x --n '3 4'"
    assert back["environment"]["torch"] and back["environment"]["threads"] >= 1
    # a study's own command is kept (a resummarised file keeps the command that measured it)
    harness.write_record(out, {"command": "python -m a --b"}, module="m", argv=[])
    assert json.loads(out.read_text())["command"] == "python -m a --b"


def test_non_finite_numbers_are_refused_and_the_old_file_kept(tmp_path):
    out = tmp_path / "r.json"
    harness.write_record(out, {"rows": [{"nll": 1.0}]}, module="m", argv=[])
    before = out.read_text()
    for bad in (math.nan, math.inf, -math.inf):
        with pytest.raises(SystemExit, match=r"non-finite numbers at rows\[1\]\.nll"):
            harness.write_record(out, {"rows": [{"nll": 1.0}, {"nll": bad}]}, module="m", argv=[])
        assert out.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # no temporary left
    # a key where a non-finite value means something can be named
    harness.write_record(out, {"bound": math.inf}, module="m", argv=[], allow_non_finite=["bound"])
    assert json.loads(out.read_text())["bound"] == math.inf


def test_non_finite_paths():
    obj = {"a": [1.0, {"b": math.nan}], "c": {"d": -math.inf, "e": 2}, "f": "nan"}
    assert harness.non_finite(obj) == ["a[1].b", "c.d"]
    assert harness.non_finite(obj, allow=["d"]) == ["a[1].b"]


def test_module_name_under_python_dash_m(tmp_path):
    code = (
        "import sys; sys.argv[0]='x';"
        "from studies import harness;"
        "print(harness.module_name('__main__'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "__main__"  # no spec: the name is kept as given
    out = subprocess.run(
        [sys.executable, "-m", "studies.kernel_profile", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "python -m studies.kernel_profile" in out.stdout


@pytest.mark.parametrize("path", STUDIES, ids=lambda p: p.stem)
def test_every_study_builds_its_parser_on_the_harness(path):
    """No study builds its own ArgumentParser or writes its JSON by hand."""
    src = path.read_text()
    tree = ast.parse(src)
    calls = {
        ast.unparse(n.func)
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, (ast.Attribute, ast.Name))
    }
    assert "argparse.ArgumentParser" not in calls, path.name
    assert "harness.parser" in calls, path.name
    assert "write_text(json.dumps" not in src and "json.dump(" not in src, path.name


def test_paths_in_a_record_are_written_as_strings_and_other_objects_refused(tmp_path):
    """Two studies crashed at their last line writing an ``argparse`` Path (after all their
    work): a Path is written as its string; an object JSON cannot hold is refused and the
    earlier file is kept."""
    out = tmp_path / "r.json"
    harness.write_json(out, {"out": tmp_path / "x.json", "n": 1})
    assert json.loads(out.read_text()) == {"out": str(tmp_path / "x.json"), "n": 1}
    with pytest.raises(TypeError, match="set"):
        harness.write_json(out, {"bad": {1, 2}})
    assert json.loads(out.read_text())["n"] == 1
