"""``studies.step_overhead`` on the CPU at tiny sizes (split-digits): the per-step records of
Naive, EWC and FROMP through the runner and in plain loops, their tables, the cProfile and
``torch.profiler`` summaries, and the CUDA-graph path with its replay simulated (the
penalty's forward no longer issued per step)."""

from __future__ import annotations

import json

from fromp.continual import methods
from studies import step_overhead

TINY = [
    "--benchmark",
    "split-digits",
    "--n-train",
    "192",
    "--skip",
    "2",
    "--steps",
    "2",
    "--trace-steps",
    "2",
]


def test_records_each_strategy_through_the_runner_and_in_a_plain_loop(tmp_path):
    out = tmp_path / "step.json"
    record = step_overhead.main([*TINY, "--trace", "--out", str(out)])
    assert json.loads(out.read_text())["runner"].keys() == {"naive", "ewc", "fromp"}
    for where in ("runner", "plain"):
        rows = record[where]
        for name in ("naive", "ewc", "fromp"):
            step = rows[name]["step"]
            assert step["steps"] == 2 and step["aten_ops_per_step"]["total"] > 0
            assert step["python_calls_per_step"]["total"] > 0
        assert "penalty" not in rows["naive"]["step"]["aten_ops_per_step"]
        for name in ("ewc", "fromp"):  # the method's penalty is a phase of its own
            assert rows[name]["step"]["aten_ops_per_step"]["penalty"] > 0
            assert rows[name]["step"]["host_uploads_per_step"] == {}
        # FROMP's one read a step in the experience's first 20 (these tiny epochs' steps)
        reads = rows["fromp"]["step"]["host_reads_per_step"]
        assert [k.split(" ")[0] for k in reads if "fromp/" in k] == [
            f"tolist@fromp/continual/methods.py:{_dominance_line()}"
        ]
    assert record["runner"]["fromp"]["iteration_ms"]["steps"] == 2
    assert record["runner"]["fromp"]["cprofile"]["own_time_top"]
    assert "self_cpu" in record["torch_profiler"]["fromp"]
    md = out.with_suffix(".md").read_text()
    assert "## Through the runner's Avalanche strategy" in md and "| aten operations |" in md
    assert "### torch.profiler, fromp, by self_cpu" in md


def _dominance_line() -> int:
    """The line of FROMP's one read back in its dominance check."""
    lines = open(methods.__file__).read().splitlines()
    return next(i for i, ln in enumerate(lines, 1) if ".tolist()  # one read back" in ln)


def test_simulated_cuda_graphs_issue_no_penalty_per_step(tmp_path):
    out = tmp_path / "graphs.json"
    record = step_overhead.main([*TINY, "--strategies", "fromp,ewc", "--no-plain",
                                 "--simulate-graphs", "--out", str(out)])  # fmt: skip
    assert (
        record["simulated_graphs"]
        and "CUDA-graph steps simulated" in out.with_suffix(".md").read_text()
    )
    for name in ("fromp", "ewc"):
        assert "penalty" not in record["runner"][name]["step"]["aten_ops_per_step"]
