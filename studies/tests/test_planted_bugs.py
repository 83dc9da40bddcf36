"""The planted-bug study's machinery on a toy tree (fast): a bug its test catches, one it
misses, substitutions that apply zero or two times (reported, never skipped), the working
tree never written; and every planted bug of the real list applies exactly once to the
current code and names tests that exist."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from studies import planted_bugs as pb

TOY = {
    "toy/__init__.py": "",
    "toy/maths.py": (
        "def double(x):\n    return 2 * x\n\n\n"
        "def square(x):\n    return x * x\n\n\n"
        "def twice_twice(x):\n    return 2 * 2 * x\n"
    ),
    "tests/test_toy.py": (
        "from toy.maths import double\n\n\ndef test_double():\n    assert double(3) == 6\n"
    ),
}


def _toy(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    for rel, text in TOY.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(text)
    return src


def _bug(name: str, old: str, new: str, tests=("tests/test_toy.py",)) -> pb.Bug:
    return pb.Bug(name, "toy", name, "toy/maths.py", old, new, tuple(tests))


def test_caught_missed_and_not_applied_on_a_toy_tree(tmp_path):
    src = _toy(tmp_path)
    before = {p: (src / p).read_text() for p in TOY}
    bugs = [
        _bug("caught", "return 2 * x\n", "return 3 * x\n"),
        _bug("missed", "return x * x", "return x + x"),  # square is untested
        _bug("absent", "return 4 * x", "return 5 * x"),
        _bug("twice", "2 * ", "3 * "),
        _bug("no_tests", "return 2 * x\n", "return 3 * x\n", ("tests/test_toy.py::nope",)),
    ]
    log: list[str] = []
    out = pb.run_bugs(bugs, src, parts=("toy", "tests"), timeout=120, log=log.append)
    by = {r["name"]: r for r in out["bugs"]}
    assert out["baseline"]["outcome"] == "passed"
    assert by["caught"]["outcome"] == "caught"
    assert "test_double" in by["caught"]["detail"]
    assert by["missed"]["outcome"] == "missed"
    assert by["absent"]["outcome"] == "not_applied"
    assert "occurs 0 times" in by["absent"]["detail"]
    assert by["twice"]["outcome"] == "not_applied"
    assert "occurs 3 times" in by["twice"]["detail"]
    assert by["no_tests"]["outcome"] == "error"
    assert (out["caught"], out["total"]) == (1, 5)
    # each bug ran on an unmutated copy: "missed" after "caught" means the file was restored
    assert {p: (src / p).read_text() for p in TOY} == before  # the tree itself untouched
    assert len(log) == 6 and json.dumps(out)


def test_a_failing_baseline_stops_before_any_bug(tmp_path):
    src = _toy(tmp_path)
    (src / "tests/test_toy.py").write_text("def test_fails():\n    assert False\n")
    out = pb.run_bugs([_bug("caught", "return 2 * x\n", "return 3 * x\n")], src,
                      parts=("toy", "tests"), timeout=120, log=lambda s: None)  # fmt: skip
    assert out["baseline"]["outcome"] == "failed" and out["bugs"] == [] and out["caught"] == 0


def test_apply_refuses_a_missing_file(tmp_path):
    bug = pb.Bug("x", "toy", "x", "toy/none.py", "a", "b", ("tests",))
    with pytest.raises(pb.MutationError, match="does not exist"):
        pb.apply(tmp_path, bug)


def test_every_planted_bug_applies_exactly_once_and_names_existing_tests():
    assert len(pb.BUGS) == 30 and len({b.name for b in pb.BUGS}) == 30
    for bug in pb.BUGS:
        assert bug.file.split("/")[0] in ("fromp", "strategies"), bug.name
        text = (pb.ROOT / bug.file).read_text()
        assert text.count(bug.old) == 1, f"{bug.name}: {bug.file} changed; update the bug"
        assert bug.old != bug.new and bug.tests, bug.name
        for t in bug.tests:
            path, _, name = t.partition("::")
            assert (pb.ROOT / path).is_file(), f"{bug.name}: {path}"
            if name:
                assert f"def {name}(" in (pb.ROOT / path).read_text(), f"{bug.name}: {t}"


def test_the_committed_record_covers_the_list():
    rec = json.loads((pb.ROOT / "benchmarks/results/planted_bugs.json").read_text())
    assert {r["name"] for r in rec["bugs"]} == {b.name for b in pb.BUGS}
    assert rec["baseline"]["outcome"] == "passed"
    assert rec["caught"] == sum(r["outcome"] == "caught" for r in rec["bugs"])
    assert rec["caught"] >= 26


def test_cli_lists_and_refuses_unknown_names(capsys):
    pb.main(["--list"])
    assert "wrong_head" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown bug names"):
        pb.main(["--only", "no_such_bug", "--out", str(Path(sys.prefix) / "x.json")])


def test_a_rerun_of_some_bugs_replaces_their_rows_and_keeps_what_they_were():
    first, second = pb.BUGS[0].name, pb.BUGS[1].name
    prev = {
        "command": "python -m studies.planted_bugs",
        "baseline": {"outcome": "passed"},
        "bugs": [{"name": first, "outcome": "caught"}, {"name": second, "outcome": "missed"}],
        "caught": 1,
        "total": 2,
    }
    rerun = {"baseline": {"outcome": "passed"}, "bugs": [{"name": second, "outcome": "caught"}]}
    out = pb.merge(prev, rerun, "python -m studies.planted_bugs --only x")
    assert [r["outcome"] for r in out["bugs"]] == ["caught", "caught"]
    assert (out["caught"], out["total"]) == (2, 2)
    assert out["first_command"] == prev["command"]
    assert out["reruns"][0]["before"] == {second: "missed"}
    again = pb.merge(out, rerun, "again")
    assert again["first_command"] == prev["command"] and len(again["reruns"]) == 2
