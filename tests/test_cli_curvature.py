"""``fromp-memorable --map``'s curvature set (issue 29): the KFAC GGN summed over the trained
tasks, each through its own head, against dense per-example sums on a small float64
multi-head MLP; ``--curvature auto`` choosing it from the checkpoint's strategy."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from fromp_bench.cli import _auto_curvature, load_trained, memorable_main
from fromp_bench.plugins import _write_checkpoint
from fromp_bench.runner import RunConfig, run
from torch.func import functional_call, jacrev

from fromp import Laplace
from fromp.curvature.kron import kron_curvature, kron_curvature_tasks
from fromp.likelihood import get_likelihood
from fromp.memory.sensitivity import memory_perturbation
from fromp.models import MultiHeadMLP, TaskView, with_task


def _dense_factors(net, x, task):
    """Per layer called by ``with_task(net, task)``: ``(sum_n G_n^T Lambda_n G_n [out, out],
    sum_n u_n u_n^T [in, in])`` from each example's own Jacobian ``G_n = d f / d z`` (of the
    bias: ``z = W u + b``) and input ``u_n``, one example at a time."""
    lik = get_likelihood("categorical")
    view = with_task(net, task)
    names = [n for n, _ in view.named_parameters() if n.endswith(".bias")]
    params = dict(view.named_parameters())
    out = {n.removeprefix("model."): [0.0, 0.0] for n in names}
    inputs: dict[str, torch.Tensor] = {}
    hooks = [
        view.get_submodule(k).register_forward_hook(
            lambda m, a, o, k=k: inputs.__setitem__(k, a[0][0])
        )
        for k in (n.removesuffix(".bias") for n in names)
    ]
    for xn in x:
        inputs.clear()
        with torch.no_grad():
            f = view(xn[None])[0]
        lam = lik.hessian(f.detach()[None])[0]  # [C, C]
        jac = jacrev(lambda p, xn=xn: functional_call(view, {**params, **p}, (xn[None],))[0])(
            {n: params[n] for n in names}
        )
        for n in names:
            if n.removesuffix(".bias") not in inputs:  # another task's head: not called
                continue
            g, u = jac[n], inputs[n.removesuffix(".bias")]  # [C, out], [in]
            k = n.removeprefix("model.")
            out[k][0] = out[k][0] + g.T @ lam @ g
            out[k][1] = out[k][1] + torch.outer(u, u)
    for h in hooks:
        h.remove()
    return out


def test_trained_tasks_kfac_sums_each_task_through_its_own_head():
    """Tasks 0 and 1 of a 3-head MLP: each trunk layer's ``B`` is the sum of both tasks'
    dense ``sum_n G^T Lambda G`` and its ``A`` the mean of ``u u^T`` over both tasks'
    examples; head ``t`` has task ``t``'s alone, the untrained head 2 none; a Kronecker
    Laplace on it has the dense ``B (x) A + delta I`` blocks."""
    torch.manual_seed(0)
    net = MultiHeadMLP(4, (5, 3), n_heads=3, head_size=2).double().eval()
    xs = [torch.randn(7, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)]
    lik = get_likelihood("categorical")
    curv = kron_curvature_tasks(net, [(xs[0], 0), (xs[1], 1)], lik, batch_size=3)
    dense = [_dense_factors(net, x, t) for t, x in enumerate(xs)]
    assert curv.n == 11
    by_name = {names[0].removeprefix("model.").removesuffix(".weight"): blk
               for names, blk in zip(curv.names, curv.blocks)}  # fmt: skip
    for layer in ("body.1", "body.3"):  # the shared trunk: both tasks
        b = sum(d[layer + ".bias"][0] for d in dense)
        a = sum(d[layer + ".bias"][1] for d in dense) / 11
        torch.testing.assert_close(by_name[layer].B, b)
        torch.testing.assert_close(by_name[layer].B_bias, b)
        torch.testing.assert_close(by_name[layer].A, a)
    for t in (0, 1):  # each head: its own task only
        b, a = dense[t][f"heads.{t}.bias"]
        torch.testing.assert_close(by_name[f"heads.{t}"].B, b)
        torch.testing.assert_close(by_name[f"heads.{t}"].A, a / len(xs[t]))
        assert by_name[f"heads.{t}"].n == len(xs[t])
    assert by_name["heads.2"].B.abs().max() == 0 and by_name["heads.2"].n == 0
    # the one-task term is kron_curvature of that task's view
    one = kron_curvature(TaskView(net, 1), [(xs[1], None)], lik)
    torch.testing.assert_close(kron_curvature_tasks(net, [(xs[1], 1)], lik).blocks[0].B,
                               one.blocks[0].B)  # fmt: skip
    la = Laplace(with_task(net, 1), "classification", "all", "kron", prior_precision=0.7)
    la.use_curvature(curv, curv.n, loss=1.0)
    for blk, prec in zip(curv.blocks, la.posterior_precision[::2]):
        want = torch.kron(blk.B, blk.A) + 0.7 * torch.eye(blk.B.shape[0] * blk.A.shape[0],
                                                          dtype=torch.float64)  # fmt: skip
        torch.testing.assert_close(prec, want)


def test_auto_curvature_follows_the_strategys_objective():
    """Strategies that keep their earlier tasks get every trained task's curvature; Naive,
    an IVON run without its continual prior and a user's model the task's alone."""
    for name in ("fromp", "fromp-kron", "fromp-l2", "ewc", "vcl", "vcl-coreset", "ivon", "joint"):
        assert _auto_curvature({"strategy": name})[0] == "trained-tasks", name
    assert _auto_curvature({"strategy": "naive"})[0] == "task"
    off = {"strategy": "ivon", "settings": {"kwargs": {"continual": False}}}
    assert _auto_curvature(off)[0] == "task"
    assert _auto_curvature({"model": "pkg:make"})[0] == "task"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A Naive split-digits checkpoint, and the same weights recorded as a FROMP run saved
    after its third task (tasks 3 and 4 never trained)."""
    root = tmp_path_factory.mktemp("ckpt")
    path = root / "naive.pt"
    cfg = RunConfig("split-digits", "naive", overrides={"train_epochs": 3}, n_train=150,
                    n_test=50, checkpoint=str(path), progress=False)  # fmt: skip
    run(cfg)
    state = torch.load(path, map_location="cpu", weights_only=True)
    state["config"]["strategy"], state["done"] = "fromp", 3
    _write_checkpoint(root / "fromp.pt", state)
    return path, root / "fromp.pt"


def test_map_default_is_the_objectives_kron_laplace(checkpoints, tmp_path, capsys):
    """The default ``--map`` posterior: Kronecker over all weights, one-step estimate, the
    curvature of tasks 0..2 for the FROMP checkpoint (the trained ones, not 3-4) with the
    evidence's delta of that Laplace, of the task alone for the Naive one; the choice is
    printed and recorded."""
    naive, fromp_ckpt = checkpoints
    for path, want in ((fromp_ckpt, [0, 1, 2]), (naive, [1])):
        out = tmp_path / path.stem
        args = [str(path), "--task", "1", "--n-per-class", "3", "--n-fit", "20", "--map"]
        assert memorable_main([*args, "--out", str(out)]) == 0
        printed = capsys.readouterr().out
        payload = json.loads((out / "memory_map.json").read_text())
        assert payload["posterior"] == "kron" and payload["loo_form"] == "one-step (f + V e)"
        curv = payload["curvature"]
        assert curv["option"] == "auto" and curv["tasks"] == want
        assert curv["used"] == ("trained-tasks" if len(want) > 1 else "task")
        span = "tasks 0-2" if len(want) > 1 else "task 1"
        assert f"curvature of {span} (auto: {'fromp' if len(want) > 1 else 'naive'}" in printed
        # the same posterior built independently: one Laplace fitted task after task
        net, seq, _ = load_trained(path)
        view = TaskView(net, 0)
        la = Laplace(view, "classification", "all", "kron", prior_precision=1.0)
        idx = payload["index"]
        for k, t in enumerate(want):
            x, y = (seq[t].train_x[idx], seq[t].train_y[idx]) if t == 1 else \
                (seq[t].train_x[:20], seq[t].train_y[:20])  # fmt: skip
            view.task = t
            la.fit((x, y), override=k == 0)
        view.task = 1
        la.optimize_prior_precision(method="marglik", optimizer="lbfgs")
        assert payload["prior_precision"] == pytest.approx(float(la.prior_precision), rel=1e-4)
        x, y = seq[1].train_x[idx], seq[1].train_y[idx]
        mp = memory_perturbation(view, la, x, y, covariance="full", correction=False)
        np.testing.assert_allclose(payload["sensitivity"], mp.sensitivity.tolist(), rtol=1e-4)
        loo = mp.loo_summary()
        assert payload["loo"]["loo_nll"] == pytest.approx(loo["loo_nll"], rel=1e-5)
    # chosen by name; trained-tasks only for the all-weights Kronecker posterior
    args = [str(fromp_ckpt), "--task", "1", "--n-per-class", "3", "--n-fit", "20", "--map"]
    assert memorable_main([*args, "--curvature", "task", "--out", str(tmp_path / "t")]) == 0
    assert json.loads((tmp_path / "t" / "memory_map.json").read_text())["curvature"]["tasks"] == [1]
    bad = [*args, "--posterior", "last-layer-full", "--curvature", "trained-tasks"]
    assert memorable_main([*bad, "--out", str(tmp_path / "b")]) == 2
    assert "needs --posterior kron" in capsys.readouterr().err
