"""fromp-memorable and fromp-gp on a checkpoint written by the runner."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from fromp_bench.cli import gp_main, load_trained, load_user_model, memorable_main
from fromp_bench.plugins import _write_checkpoint
from fromp_bench.runner import RunConfig, run

from fromp.continual.memorable import memorability_scores
from fromp.models import with_task


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "naive.pt"
    cfg = RunConfig(
        "split-digits",
        "naive",
        overrides={"train_epochs": 3},
        train_size=150,
        test_size=50,
        checkpoint=str(path),
        progress=False,
    )
    run(cfg)
    return path


def test_load_trained_restores_the_network(checkpoint):
    net, seq, cfg = load_trained(checkpoint)
    assert cfg["benchmark"] == "split-digits" and len(seq) == 5
    acc = (net(seq[0].test_x, task=0).argmax(1) == seq[0].test_y).float().mean()
    assert acc > 0.9


def test_memorable_cli(checkpoint, tmp_path, capsys):
    assert (
        memorable_main(
            [str(checkpoint), "--task", "2", "--n-per-class", "4", "--out", str(tmp_path)]
        )
        == 0
    )
    payload = json.loads((tmp_path / "memorable.json").read_text())
    net, seq, _ = load_trained(checkpoint)
    task = seq[2]
    idx = torch.tensor(payload["indices"])
    assert sorted(payload["classes"]) == [4] * 4 + [5] * 4
    # the selected examples are the 4 largest scores of each class (brute-force sort)
    with torch.no_grad():
        scores = memorability_scores(with_task(net, 2), task.train_x)
    for c in (0, 1):
        members = torch.nonzero(task.train_y == c).squeeze(1)
        best = members[torch.argsort(scores[members], descending=True, stable=True)[:4]]
        assert set(best.tolist()) == set(idx[task.train_y[idx] == c].tolist())
    assert (tmp_path / "memorable.png").stat().st_size > 1000


@pytest.fixture(scope="module")
def ci_checkpoint(tmp_path_factory):
    """A class-incremental run (one head over the digits, labels the digits), two tasks."""
    path = tmp_path_factory.mktemp("ci") / "naive.pt"
    run(RunConfig("split-digits-ci", "naive", overrides={"train_epochs": 1}, train_size=60,
                  test_size=20, checkpoint=str(path), progress=False, stop_after=2))  # fmt: skip
    return path


def test_memorable_cli_names_the_classes_of_a_class_incremental_task(ci_checkpoint, tmp_path):
    """Before: every task but the first crashed after its work (IndexError: the labels, the
    digits 2 and 3 already, were used as positions in the task's two classes), and nothing
    was written, also after a whole --map."""
    out = tmp_path / "m1"
    argv = [str(ci_checkpoint), "--task", "1", "--n-per-class", "3", "--out", str(out)]
    assert memorable_main(argv) == 0
    payload = json.loads((out / "memorable.json").read_text())
    assert payload["labels"] == payload["classes"]  # one head: the labels are the digits
    assert sorted(payload["classes"]) == [2, 2, 2, 3, 3, 3]
    assert (out / "memorable.png").stat().st_size > 1000


def test_gp_cli(checkpoint, tmp_path):
    argv = [str(checkpoint), "--task", "1", "--n", "20", "--n-fit", "100", "--out", str(tmp_path)]
    assert gp_main([*argv, "--prior-precision", "3.0"]) == 0
    data = np.load(tmp_path / "gp.npz")
    n = len(data["labels"])
    assert data["kernel"].shape == (n, 2, n, 2) and data["variance"].shape == (n, 2, 2)
    assert np.all(np.diff(data["labels"]) >= 0)
    k = data["kernel"].reshape(2 * n, 2 * n)
    assert np.allclose(k, k.T, atol=1e-6)
    diag = np.stack([data["kernel"][i, :, i, :] for i in range(n)])
    assert np.allclose(diag, data["variance"], rtol=1e-4, atol=1e-7)
    assert np.allclose(data["probs"].sum(1), 1.0, atol=1e-5)
    assert (tmp_path / "kernel.png").stat().st_size > 1000


@pytest.mark.parametrize("main", [memorable_main, gp_main])
def test_clear_errors(main, checkpoint, tmp_path, capsys):
    assert main([str(tmp_path / "missing.pt")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main([str(checkpoint), "--task", "9"]) == 2
    assert "--task must be in [0, 5)" in capsys.readouterr().err


def test_vcl_checkpoint_loads_posterior_means(tmp_path):
    """A VCL checkpoint (mean-field Gaussian layers) gives the deterministic network at the
    posterior means, usable by both tools."""
    path = tmp_path / "vcl.pt"
    cfg = RunConfig(
        "split-digits",
        "vcl",
        overrides={"train_epochs": 2},
        train_size=60,
        test_size=20,
        checkpoint=str(path),
        progress=False,
    )
    run(cfg)
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert "mean_field" in state["plugins"]["VCLPlugin"]["state_dict"]  # the log-variances
    net, _, _ = load_trained(path)
    # VCL trains the model itself: its weights are the posterior means
    means = {k.split(".", 1)[-1]: v for k, v in state["model"].items()}
    assert means
    for name, value in net.state_dict().items():
        torch.testing.assert_close(value, means[name])
    assert memorable_main([str(path), "--n-per-class", "2", "--out", str(tmp_path / "m")]) == 0


def test_mismatched_checkpoint_is_one_line(checkpoint, tmp_path, capsys):
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    state["model"] = {k: v for k, v in state["model"].items() if "heads" not in k}
    bad = tmp_path / "bad.pt"
    _write_checkpoint(bad, state)
    assert gp_main([str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fromp-gp: error:") and "does not match" in err
    assert len(err.splitlines()) == 1


def test_memorable_cli_memory_map(checkpoint, tmp_path):
    """``--map``: by default a last-layer full-GGN Laplace fitted on the task's training
    examples; the per-example numbers are those of the memory-perturbation equation under
    that posterior (``--posterior diag``: under the all-weights diagonal one), the test-set
    NLL and accuracy are reported beside the leave-one-out estimate."""
    from fromp import Laplace
    from fromp.laplace.one_call import fit_laplace
    from fromp.memory.sensitivity import memory_perturbation

    net, seq, _ = load_trained(checkpoint)
    model = with_task(net, 1)
    for posterior in ("last-layer-full", "diag"):
        out = tmp_path / posterior
        args = [str(checkpoint), "--task", "1", "--n-per-class", "3", "--out", str(out)]
        extra = ["--n-fit", "20", "--prior-precision", "2.0", "--posterior", posterior]
        assert memorable_main([*args, "--map", *extra]) == 0
        payload = json.loads((out / "memory_map.json").read_text())
        chosen = json.loads((out / "memorable.json").read_text())["indices"]
        idx = payload["index"]
        assert set(range(20)) <= set(idx) and set(chosen) <= set(idx)
        assert [i in chosen for i in idx] == payload["memorable"]
        assert sum(payload["memorable"]) == 6
        assert payload["posterior"] == posterior and payload["n_fit"] == len(idx)
        x, y = seq[1].train_x[idx], seq[1].train_y[idx]
        if posterior == "diag":
            q = fit_laplace(model, (x, y), "categorical", 2.0)
        else:
            q = Laplace(model, "classification", "last_layer", "full", prior_precision=2.0)
            q.fit((x, y))
        full = posterior != "diag"  # the exact last-layer GGN allows the corrected form
        mp = memory_perturbation(
            model, q, x, y, covariance="full" if full else "diag", correction=full
        )
        np.testing.assert_allclose(payload["sensitivity"], mp.sensitivity.tolist(), rtol=1e-4)
        np.testing.assert_allclose(payload["variance_sum"], mp.variance.sum(-1).tolist(), rtol=1e-4)
        assert payload["loo"]["loo_nll"] >= payload["loo"]["train_nll"]
        with torch.no_grad():
            f = model(seq[1].test_x)
        want = float(torch.nn.functional.cross_entropy(f, seq[1].test_y))
        assert payload["test"]["nll"] == pytest.approx(want, rel=1e-6)
        assert payload["command"].startswith("fromp-memorable ") and "--map" in payload["command"]
        assert (out / "memory_map.png").stat().st_size > 1000
    # default: all of the task's training examples
    out = tmp_path / "default"
    args = [str(checkpoint), "--task", "1", "--n-per-class", "3", "--out", str(out)]
    assert memorable_main([*args, "--map"]) == 0
    payload = json.loads((out / "memory_map.json").read_text())
    assert payload["n_fit"] == len(seq[1].train_y) == payload["n"]
    assert memorable_main([*args, "--map", "--n-fit", "0"]) == 2
    # one evidence-chosen delta per parameter tensor: the Laplace's own layerwise optimum
    out = tmp_path / "layerwise"
    args = [str(checkpoint), "--task", "1", "--n-per-class", "3", "--out", str(out)]
    lw = ["--map", "--posterior", "kron", "--n-fit", "20", "--prior-structure", "layerwise"]
    assert memorable_main([*args, *lw]) == 0
    payload = json.loads((out / "memory_map.json").read_text())
    x, y = seq[1].train_x[payload["index"]], seq[1].train_y[payload["index"]]
    la = Laplace(model, "classification", "all", "kron", prior_precision=1.0).fit((x, y))
    want = la.optimize_prior_precision(
        method="marglik", prior_structure="layerwise", optimizer="lbfgs"
    )
    assert len(payload["prior_precision"]) == len(want) > 1
    np.testing.assert_allclose(payload["prior_precision"], want.tolist(), rtol=1e-4)
    assert memorable_main([*args, *lw, "--prior-precision", "2.0"]) == 2


USER_MODULE = '''
import torch
from torch import nn


class Net(nn.Module):
    """A user's multi-head network for Split-Digits: forward(x, task=t)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 32), nn.ReLU())
        self.heads = nn.ModuleList(nn.Linear(32, 2) for _ in range(5))

    def forward(self, x, task=0):
        return self.heads[task](self.body(x.flatten(1)))


def make():
    torch.manual_seed(0)
    return Net()
'''


@pytest.mark.parametrize("tool", ["memorable", "gp"])
def test_clis_take_a_users_model_and_weights(tool, tmp_path, monkeypatch, capsys):
    """``--model package.module:factory --weights state_dict.pt --benchmark NAME``: the
    user's network (here a multi-head module of their own) gives the same memorable points
    or GP as the same weights would; bad specifications are one-line errors."""
    (tmp_path / "usernet.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import usernet

    net = usernet.make()
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(1.5)
    torch.save(net.state_dict(), tmp_path / "w.pt")
    main = memorable_main if tool == "memorable" else gp_main
    out = tmp_path / "out"
    base = ["--model", "usernet:make", "--weights", str(tmp_path / "w.pt"),
            "--benchmark", "split-digits", "--task", "1", "--out", str(out)]  # fmt: skip
    extra = ["--n-per-class", "3"] if tool == "memorable" else ["--n", "8"]
    assert main([*base, *extra]) == 0
    if tool == "memorable":
        from fromp import select_memorable

        chosen = json.loads((out / "memorable.json").read_text())["indices"]
        _, seq, _ = load_user_model("usernet:make", tmp_path / "w.pt", "split-digits")
        loaded = usernet.make()
        loaded.load_state_dict(torch.load(tmp_path / "w.pt"))
        want = select_memorable(with_task(loaded.eval(), 1), seq[1].train_x, seq[1].train_y,
                                n_per_class=3)  # fmt: skip
        assert chosen == want.tolist()
    else:
        assert (out / "gp.npz").exists()
    capsys.readouterr()
    for bad, msg in (
        (["--model", "usernet", "--benchmark", "split-digits"], "package.module:factory"),
        (["--model", "nosuchmod:make", "--benchmark", "split-digits"], "ModuleNotFoundError"),
        (["--model", "usernet:make"], "--model needs --benchmark"),
        ([], "a checkpoint"),
    ):
        assert main([*bad, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and msg in err, err
    torch.save({"other": torch.zeros(1)}, tmp_path / "bad.pt")
    bad = ["--model", "usernet:make", "--weights", str(tmp_path / "bad.pt"),
           "--benchmark", "split-digits"]  # fmt: skip
    assert main([*bad, "--out", str(out)]) == 2
    assert "does not fit --model usernet:make" in capsys.readouterr().err
