"""No entry point runs code from a checkpoint, and every checkpoint is whole or refused.

A crafted checkpoint whose pickle calls ``exec`` (writing a marker file), in torch's zip
format, its legacy (non-zip) format and as a plain pickle, is given to every loader:
``fromp-bench --resume``, ``fromp-memorable``, ``fromp-gp`` (a checkpoint and ``--weights``),
the runner's reader and ``fromp_avalanche.checkpoint.load_checkpoint`` (the sweep and
``--report-only`` in tests/bench/test_sweep.py and below). Each must refuse it in one line
naming the file and the global it calls, never repeating torch's advice to load with
``weights_only=False``, and the marker must not exist afterwards. Then the integrity of
``fromp_avalanche.checkpoint``: a checksum written beside the file, a flipped byte, a missing
checksum, a truncated file and missing keys refused with the path, and a checkpoint of
another method refused before the strategy's model or optimizer is changed."""

from __future__ import annotations

import copy
import hashlib
import io
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from avalanche.benchmarks.scenarios.deprecated.generators import nc_benchmark
from avalanche.benchmarks.utils import _make_taskaware_tensor_classification_dataset
from avalanche.models import MTSimpleMLP
from fromp_avalanche.checkpoint import (
    CheckpointError as StrategyCheckpointError,
)
from fromp_avalanche.checkpoint import (
    get_rng_state,
    load_checkpoint,
    read_checked,
    save_checkpoint,
    set_rng_state,
    write_checked,
)
from fromp_avalanche.ewc import EWC
from fromp_avalanche.fromp import FROMP
from fromp_bench.__main__ import main
from fromp_bench.cli import gp_main, load_trained, memorable_main
from fromp_bench.plugins import CheckpointError, _read_checkpoint
from torch import nn

QUICK = ["--epochs", "1", "--n-train", "60", "--n-test", "30", "--no-progress"]


class Payload:
    """Pickles as a call of ``exec`` that writes ``marker``: what a crafted file would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


FORMATS = ("zip", "legacy", "pickle")


def _save_raw(path: Path, state: object, kind: str = "zip") -> None:
    """``torch.save`` (``kind``: its zip or its legacy format) or ``pickle.dump``, with a
    matching ``.sha256`` (the checksum proves the file whole, not safe: the refusal must come
    from reading without code)."""
    buf = io.BytesIO()
    if kind == "pickle":
        pickle.dump(state, buf)
    else:
        torch.save(state, buf, _use_new_zipfile_serialization=kind == "zip")
    path.write_bytes(buf.getvalue())
    path.with_name(path.name + ".sha256").write_text(hashlib.sha256(buf.getvalue()).hexdigest())


def _one_line(capsys, *needles: str) -> str:
    err = capsys.readouterr().err.strip()
    for needle in needles:
        assert needle in err, err
    assert "\n" not in err and "Traceback" not in err, err
    assert "weights_only" not in err, err  # never torch's advice to load with code
    return err


@pytest.fixture(scope="module")
def bench_checkpoint(tmp_path_factory):
    """A real ``fromp-bench`` checkpoint (naive, split-digits, stopped after task 2)."""
    out = tmp_path_factory.mktemp("bench")
    assert main(["split-digits", "--strategies", "naive", *QUICK, "--stop-after", "2",
                 "--out", str(out)]) == 0  # fmt: skip
    (ckpt,) = (out / "split-digits" / "checkpoints").glob("naive*.pt")
    return out, ckpt


def _evil_copy(ckpt: Path, dest: Path, marker: Path, kind: str = "zip") -> Path:
    state = torch.load(ckpt, weights_only=True)
    state["extra"] = Payload(marker)
    _save_raw(dest, state, kind)
    return dest


@pytest.mark.parametrize("kind", FORMATS)
def test_the_payload_runs_under_full_pickle(kind, tmp_path):
    """The crafted file is a real threat in every format: full pickle runs it (so the tests
    below that it does not run are meaningful)."""
    marker = tmp_path / "marker"
    _save_raw(tmp_path / "x.pt", {"model": {}, "extra": Payload(marker)}, kind)
    if kind == "pickle":
        pickle.loads((tmp_path / "x.pt").read_bytes())
    else:
        torch.load(tmp_path / "x.pt", weights_only=False)
    assert marker.read_text() == "ran"


@pytest.mark.parametrize("kind", FORMATS)
def test_the_reader_names_what_every_format_calls(kind, tmp_path):
    """Before: a legacy-format or plain pickle was refused with torch's advice cut
    mid-sentence ("Re-running torch.load with weights_only set to False"), naming nothing."""
    marker = tmp_path / "marker"
    _save_raw(tmp_path / "x.pt", {"a": torch.ones(2), "b": Payload(marker)}, kind)
    with pytest.raises(StrategyCheckpointError) as err:
        read_checked(tmp_path / "x.pt")
    text = str(err.value)
    # (a plain pickle of a tensor also calls torch.storage._load_from_bytes, itself code)
    assert "needs code to load (" in text and "builtins.exec" in text, text
    assert "weights_only" not in text, text
    assert "\n" not in text and not marker.exists()


def test_legacy_and_plain_files_without_code_load_or_are_named_unreadable(tmp_path):
    """The scan allows what a weights-only load allows: a legacy-format file of tensors and
    plain containers loads; a plain pickle torch cannot read is refused as unreadable, without
    torch's advice."""
    state = {"a": torch.arange(3.0), "b": [1, (2, "x")]}
    _save_raw(tmp_path / "legacy.pt", state, "legacy")
    got = read_checked(tmp_path / "legacy.pt")
    assert torch.equal(got["a"], state["a"]) and got["b"] == [1, (2, "x")]
    _save_raw(tmp_path / "plain.pt", {"a": 1}, "pickle")
    with pytest.raises(StrategyCheckpointError, match="cannot be read") as err:
        read_checked(tmp_path / "plain.pt")
    assert "weights_only" not in str(err.value) and "needs code" not in str(err.value)


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("tool", ["memorable", "gp"])
def test_clis_refuse_a_checkpoint_that_needs_code(tool, kind, bench_checkpoint, tmp_path, capsys):
    _, ckpt = bench_checkpoint
    marker = tmp_path / "marker"
    evil = _evil_copy(ckpt, tmp_path / "evil.pt", marker, kind)
    run = memorable_main if tool == "memorable" else gp_main
    assert run([str(evil), "--task", "0", "--out", str(tmp_path / "o")]) == 2
    _one_line(capsys, str(evil), "needs code to load", "builtins.exec", "re-create it")
    assert not marker.exists()


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("tool", ["memorable", "gp"])
def test_clis_refuse_weights_that_need_code(tool, kind, tmp_path, monkeypatch, capsys):
    (tmp_path / "usernet_evil.py").write_text(
        "import torch\ndef make():\n    return torch.nn.Sequential(torch.nn.Flatten(), "
        "torch.nn.Linear(64, 2))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    marker = tmp_path / "marker"
    _save_raw(tmp_path / "w.pt", {"0.weight": Payload(marker)}, kind)
    run = memorable_main if tool == "memorable" else gp_main
    argv = ["--model", "usernet_evil:make", "--weights", str(tmp_path / "w.pt"),
            "--benchmark", "split-digits", "--out", str(tmp_path / "o")]  # fmt: skip
    assert run(argv) == 2
    _one_line(capsys, str(tmp_path / "w.pt"), "needs code to load", "builtins.exec")
    assert not marker.exists()


@pytest.mark.parametrize("tool", ["memorable", "gp"])
@pytest.mark.parametrize("fault", ["flipped", "no-checksum"])
def test_clis_verify_the_checksum(tool, fault, bench_checkpoint, tmp_path, capsys):
    """Before: fromp-memorable and fromp-gp analysed a checkpoint with a flipped byte or
    without its .sha256 (exit 0)."""
    _, ckpt = bench_checkpoint
    data = bytearray(ckpt.read_bytes())
    copy = tmp_path / "copy.pt"
    sums = tmp_path / "copy.pt.sha256"
    if fault == "flipped":
        sums.write_text(hashlib.sha256(data).hexdigest())
        data[len(data) // 2] ^= 0x01
    copy.write_bytes(bytes(data))
    run = memorable_main if tool == "memorable" else gp_main
    small = ["--n", "6", "--n-fit", "40"] if tool == "gp" else ["--n-per-class", "2"]
    assert run([str(copy), "--task", "0", *small, "--out", str(tmp_path / "o")]) == 2
    want = "does not match its checksum" if fault == "flipped" else "has no checksum file"
    _one_line(capsys, f"checkpoint {copy} {want}")
    assert not (tmp_path / "o" / "gp.npz").exists()
    assert not (tmp_path / "o" / "memorable.json").exists()
    sums.write_text(hashlib.sha256(ckpt.read_bytes()).hexdigest())
    copy.write_bytes(ckpt.read_bytes())
    assert run([str(copy), "--task", "0", *small, "--out", str(tmp_path / "o")]) == 0


def test_resume_refuses_a_checkpoint_that_needs_code(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["split-digits", "--strategies", "naive", *QUICK, "--out", str(out)]
    assert main([*argv, "--stop-after", "1"]) == 0
    (ckpt,) = (out / "split-digits" / "checkpoints").glob("naive*.pt")
    good = torch.load(ckpt, weights_only=True)
    for kind in FORMATS:
        marker = tmp_path / f"marker-{kind}"
        _save_raw(ckpt, {**good, "extra": Payload(marker)}, kind)
        capsys.readouterr()
        assert main([*argv, "--resume"]) == 2
        _one_line(capsys, str(ckpt), "needs code to load", "builtins.exec",
                  "delete it or drop --resume")  # fmt: skip
        assert not marker.exists()
        with pytest.raises(CheckpointError, match="needs code to load"):
            _read_checkpoint(ckpt)
        assert not marker.exists()


def test_old_plain_checkpoints_still_load(bench_checkpoint, tmp_path):
    """A version-3 file (NumPy's RNG keys as an array, no CUDA states) needs no code: the
    CLIs and --resume's reader still read it; its RNG state restores."""
    _, ckpt = bench_checkpoint
    state = torch.load(ckpt, weights_only=True)
    kind, keys, *rest = state["rng"]["numpy"]
    state["rng"] = {k: v for k, v in state["rng"].items() if k != "cuda"}
    state["rng"]["numpy"] = (kind, keys.numpy().astype(np.uint32), *rest)
    state["version"] = 3
    old = tmp_path / "old.pt"
    _save_raw(old, state)
    assert _read_checkpoint(old)["version"] == 3
    _, _, cfg = load_trained(old)
    assert cfg["benchmark"] == "split-digits"
    np.random.seed(5)  # noqa: NPY002
    set_rng_state(_read_checkpoint(old)["rng"])
    after = np.random.get_state()[1]  # noqa: NPY002
    np.testing.assert_array_equal(after, keys.numpy().astype(np.uint32))


def test_write_checked_refuses_a_state_that_needs_code(tmp_path):
    with pytest.raises(StrategyCheckpointError, match="need code to load"):
        write_checked(tmp_path / "x.pt", {"a": Payload(tmp_path / "m")})
    assert not (tmp_path / "x.pt").exists() and not (tmp_path / "m").exists()


def test_a_directory_is_named_as_a_directory(tmp_path):
    with pytest.raises(StrategyCheckpointError, match=f"checkpoint {tmp_path} is a directory"):
        read_checked(tmp_path)


# ----------------------------------------------------------------------- strategies
N_CLASSES, D_IN = 4, 6


def _stream():
    def data(n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        y = torch.arange(n) % N_CLASSES
        x = torch.randn(n, D_IN, generator=g)
        x[:, :N_CLASSES] += 2.0 * nn.functional.one_hot(y, N_CLASSES).float()
        return _make_taskaware_tensor_classification_dataset(x, y, targets=y.tolist())

    bm = nc_benchmark(data(40, 0), data(20, 1), n_experiences=2, task_labels=True,
                      shuffle=False, fixed_class_order=list(range(N_CLASSES)))  # fmt: skip
    return bm.train_stream


def _strategy(method: str, **kw):
    torch.manual_seed(0)
    model = MTSimpleMLP(input_size=D_IN, hidden_size=5)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    common = dict(model=model, optimizer=opt, train_mb_size=10, train_epochs=1, evaluator=None)
    if method == "fromp":
        return FROMP(tau=1.0, n_points=4, **common, **kw)
    return EWC(**{"ewc_lambda": 1.0, **kw}, **common)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A FROMP and an EWC strategy each saved after one experience."""
    root = tmp_path_factory.mktemp("strat")
    stream = _stream()
    out = {}
    for method in ("fromp", "ewc"):
        s = _strategy(method)
        s.train(stream[0])
        save_checkpoint(s, root / f"{method}.pt", experiences_done=1)
        out[method] = root / f"{method}.pt"
    return stream, out


def _weights(strategy):
    return {k: v.detach().clone() for k, v in strategy.model.state_dict().items()}


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("checksum", [True, False])
def test_strategy_checkpoint_refuses_code(kind, checksum, saved, tmp_path):
    stream, paths = saved
    marker = tmp_path / "marker"
    evil = tmp_path / "evil.pt"
    state = torch.load(paths["ewc"], weights_only=True)
    state["plugins"][0]["state"]["anchors"] = Payload(marker)
    _save_raw(evil, state, kind)
    want = rf"checkpoint {evil} needs code to load \(.*builtins\.exec"
    with pytest.raises(StrategyCheckpointError, match=want) as err:
        load_checkpoint(_strategy("ewc"), evil, stream, checksum=checksum)
    assert "weights_only" not in str(err.value)
    assert not marker.exists()


def test_strategy_checkpoint_has_a_checksum_and_refuses_damage(saved, tmp_path):
    stream, paths = saved
    data = paths["ewc"].read_bytes()
    assert (paths["ewc"].with_name("ewc.pt.sha256").read_text()
            == hashlib.sha256(data).hexdigest())  # fmt: skip
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x10
    bad = tmp_path / "bad.pt"
    bad.write_bytes(bytes(flipped))
    (tmp_path / "bad.pt.sha256").write_text(hashlib.sha256(data).hexdigest())
    with pytest.raises(StrategyCheckpointError, match=f"checkpoint {bad} does not match its"):
        load_checkpoint(_strategy("ewc"), bad, stream)
    (tmp_path / "bad.pt.sha256").unlink()
    bad.write_bytes(data)
    with pytest.raises(StrategyCheckpointError, match=f"checkpoint {bad} has no checksum"):
        load_checkpoint(_strategy("ewc"), bad, stream)
    assert load_checkpoint(_strategy("ewc"), bad, stream, checksum=False) == 1
    cut = tmp_path / "cut.pt"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(StrategyCheckpointError, match=f"checkpoint {cut} cannot be read"):
        load_checkpoint(_strategy("ewc"), cut, stream, checksum=False)


@pytest.mark.parametrize("drop", ["rng", "plugins", "model", "optimizer"])
def test_strategy_checkpoint_names_missing_keys(drop, saved, tmp_path):
    stream, paths = saved
    state = torch.load(paths["ewc"], weights_only=True)
    del state[drop]
    write_checked(tmp_path / "k.pt", state)
    s = _strategy("ewc")
    before = _weights(s)
    with pytest.raises(StrategyCheckpointError, match=rf"missing keys \['{drop}'\]"):
        load_checkpoint(s, tmp_path / "k.pt", stream)
    assert all(torch.equal(before[k], v) for k, v in _weights(s).items())


@pytest.mark.parametrize(("saved_as", "loaded_as"), [("fromp", "ewc"), ("ewc", "fromp")])
def test_another_methods_checkpoint_changes_nothing(saved_as, loaded_as, saved):
    """Before: the weights were overwritten before the plugins were compared."""
    stream, paths = saved
    s = _strategy(loaded_as)
    before, n_params = _weights(s), len(list(s.model.parameters()))
    with pytest.raises(StrategyCheckpointError, match="holds the state of plugins"):
        load_checkpoint(s, paths[saved_as], stream)
    after = _weights(s)
    assert set(after) == set(before) and len(list(s.model.parameters())) == n_params
    assert all(torch.equal(before[k], v) for k, v in after.items())


def test_a_plugin_refusing_its_state_leaves_model_and_optimizer(saved):
    """EWC refuses a state saved with another fisher: the strategy is as it was (its
    model adapted to the trained experiences, its weights and optimizer state restored)."""
    stream, paths = saved
    s = _strategy("ewc", fisher="empirical")
    s.train(stream[0])  # some optimizer state and trained weights to keep,
    with torch.no_grad():  # made unlike the checkpoint's
        for p in s.model.parameters():
            p.add_(0.25)
            for v in s.optimizer.state[p].values():
                if v.dim() > 0:
                    v.mul_(3.0)
    before = _weights(s)
    opt_before = copy.deepcopy(s.optimizer.state_dict())
    with pytest.raises(StrategyCheckpointError, match="fisher"):
        load_checkpoint(s, paths["ewc"], stream)
    assert all(torch.equal(before[k], v) for k, v in _weights(s).items())
    opt_after = s.optimizer.state_dict()
    assert opt_after["state"].keys() == opt_before["state"].keys()
    for k, st in opt_before["state"].items():
        assert all(torch.equal(st[n], opt_after["state"][k][n]) for n in st)


def test_weights_of_another_shape_are_refused_before_loading(saved, tmp_path):
    stream, paths = saved
    state = torch.load(paths["ewc"], weights_only=True)
    name = next(k for k in state["model"] if k.endswith("weight"))
    state["model"][name] = torch.zeros(3, 3)
    write_checked(tmp_path / "s.pt", state)
    s = _strategy("ewc")
    before = _weights(s)
    with pytest.raises(StrategyCheckpointError, match=rf"{name} has shape \(3, 3\)"):
        load_checkpoint(s, tmp_path / "s.pt", stream)
    assert all(torch.equal(before[k], v) for k, v in _weights(s).items())


def test_cuda_rng_states_are_saved_and_restored(monkeypatch):
    """On a CUDA machine the checkpoint holds every device's generator and restores it
    (faked here: the calls and their arguments are what is checked, without a GPU)."""
    states = [torch.tensor([1, 2], dtype=torch.uint8), torch.tensor([3], dtype=torch.uint8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: list(states))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda s: restored.append(s))
    rng = get_rng_state()
    assert [t.tolist() for t in rng["cuda"]] == [[1, 2], [3]]
    buf = io.BytesIO()
    torch.save(rng, buf)
    rng = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    set_rng_state(rng)
    assert [[t.tolist() for t in r] for r in restored] == [[[1, 2], [3]]]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(StrategyCheckpointError, match="RNG states of 2 CUDA devices"):
        set_rng_state(rng)


# ----------------------------------------------------------------------- the runner's state
def test_runner_checkpoints_save_and_restore_cuda_rng_states(monkeypatch):
    """Before: the runner saved the CPU generators only, so a GPU --resume was not exact."""
    from fromp_bench import runner

    states = [torch.tensor([7, 8, 9], dtype=torch.uint8)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: list(states))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda s: restored.append(s))
    saved = runner._rng_state()
    assert [t.tolist() for t in saved["cuda"]] == [[7, 8, 9]]
    runner._set_rng_state(saved)
    assert [[t.tolist() for t in r] for r in restored] == [[[7, 8, 9]]]


def test_plugin_attributes_are_encoded_as_plain_data_and_back():
    from collections import defaultdict

    from avalanche.training.utils import ParamData
    from fromp_bench.plugins import _plain, _unplain

    value = {
        "saved": defaultdict(dict, {0: {"w": ParamData("w", init_tensor=torch.ones(2, 3))}}),
        "size": torch.Size([2, 3]),
        "pair": (1, "a", None),
        "seen": {1, 2},
        "by_tuple": {(0, 1): 2.5},
    }
    plain = _plain(value, "p")
    buf = io.BytesIO()
    torch.save(plain, buf)
    back = _unplain(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    assert isinstance(back["saved"], defaultdict) and back["saved"].default_factory is dict
    assert torch.equal(back["saved"][0]["w"].data, torch.ones(2, 3))
    assert back["saved"][0]["w"].shape == torch.Size([2, 3])
    assert back["size"] == torch.Size([2, 3]) and back["pair"] == (1, "a", None)
    assert back["seen"] == {1, 2} and back["by_tuple"] == {(0, 1): 2.5}
    with pytest.raises(StrategyCheckpointError, match=r"p\['f'\]: a function cannot be"):
        _plain({"f": lambda: 0}, "p")


def test_avalanche_ewc_resumes_exactly_from_a_plain_checkpoint(tmp_path):
    """Avalanche's own EWC plugin has no state_dict: its attributes (ParamData in
    defaultdicts) are stored as plain data, the file loads with weights_only=True and
    nothing allow-listed, and the resumed run equals an uninterrupted one."""
    from fromp_bench.runner import RunConfig, run

    kw = dict(overrides={"train_epochs": 1}, train_size=40, test_size=20, progress=False)
    straight = run(RunConfig("split-digits", "ewc-avalanche", **kw))
    path = tmp_path / "c.pt"
    run(RunConfig("split-digits", "ewc-avalanche", checkpoint=str(path), stop_after=2, **kw))
    state = torch.load(path, weights_only=True)
    assert state["plugins"]["EWCPlugin"]["vars"]["saved_params"]["__plain__"] == "defaultdict"
    resumed = run(RunConfig("split-digits", "ewc-avalanche", checkpoint=str(path), resume=True,
                            **kw))  # fmt: skip
    assert resumed["accuracy_matrix"] == straight["accuracy_matrix"]


@pytest.mark.parametrize("kind", FORMATS)
def test_report_only_refuses_a_pickled_run_record(kind, tmp_path, capsys):
    """``--report-only`` (and a run adding to the folder) reads ``runs/*.json`` as JSON only:
    a crafted pickle there is refused in one line naming it, and nothing of it runs."""
    marker = tmp_path / "marker"
    record = tmp_path / "split-digits" / "runs" / "naive-seed0.json"
    record.parent.mkdir(parents=True)
    _save_raw(record, {"strategy": Payload(marker)}, kind)
    assert main(["split-digits", "--report-only", "--out", str(tmp_path)]) == 2
    _one_line(capsys, str(record), "not a run result")
    assert not marker.exists()
