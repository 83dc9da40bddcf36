"""Time and peak memory of Laplace / GGN / DNN2GP on real-size networks, beside laplace-torch.

    python -m studies.scale [--models mlp,cnn,resnet18] [--cases kernel,...]
                                       [--device cpu]
                                       [--threads 1]

Networks (random weights, eval mode; the cost does not depend on the weights):

* ``mlp``: FROMP's split-MNIST ``MultiHeadMLP(784, (256, 256), 5 heads of 2)``, head 0;
* ``cnn``: FROMP's split-CIFAR ``CifarCNN`` (6 heads of 10), head 0, ``[N, 3, 32, 32]``;
* ``resnet18``: ``torchvision.models.resnet18(num_classes=10)`` on ``[N, 3, 32, 32]``.

Cases (inputs are standard-normal tensors of the network's input shape, labels uniform):

* ``laplace``: ``fromp.fit_laplace(net, x, "categorical", 1.0)`` (diagonal GGN through layer
  capture, default memory budget) for ``--n-ggn`` inputs;
* ``laplace_torch``: laplace-torch 0.3 ``DiagLaplace(net, "classification").fit(loader)``
  (its default backend, per-example Jacobians) on the same inputs, batch ``--lt-batch``.
  Where a network's ``--lt-max`` is below ``n`` it is timed on ``--lt-max`` inputs and the
  time scaled linearly to ``n`` (the cost is linear in ``n``; the JSON says so);
* ``kernel``: ``GP(net, q, "categorical").kernel(x, diagonal_outputs=True)`` (FROMP's
  per-class blocks ``[C, N, N]``), ``q`` a random diagonal posterior, default memory budget
  (the structured kernel derives its example chunk from it);
* ``kernel_full``: the same with ``diagonal_outputs=False`` (all ``C x C`` output pairs,
  ``[N, C, N, C]``);
* ``predictive``: ``GP.predictive(x, "probit")`` for ``--n-pred`` inputs;
* ``laplace_kron``: ``fromp.Laplace(net, "classification", "all", "kron").fit(batches)``
  (KFAC of every ``Linear`` / ``Conv2d``, diagonal blocks for batch norm) and its evidence;
  above a network's ``kron_max`` inputs it is timed on ``kron_max`` and scaled linearly;
* ``laplace_predictive``: ``fromp.Laplace(net, "classification", "all", structure)`` for
  ``structure`` ``"kron"`` and ``"diag"``, fitted once on ``pred_fit`` inputs (``fit_s``),
  then the GLM probit predictive ``la(x[:n])`` for each ``n`` of ``ns`` (100 and 1,000;
  ``--lpred-n`` to change) in ascending order: ``pred_s`` its wall time,
  ``pred_peak_rss_mb`` the process's peak resident set after it (``fit_rss_mb``: before the
  first; ``peak_cuda_mb``: the predictive's own peak on a GPU). With
  ``--memory-budget`` the predictive takes that many bytes per chunk of inputs; without,
  the default (half the GPU's free memory, 2 GiB on the CPU);
* ``check``: fromp's and laplace-torch's GGN diagonals on 8 inputs, max relative difference.

Every case runs in a fresh subprocess: ``peak_rss_mb`` is that process's peak resident set
size (``ru_maxrss``, including Python, torch and the model: ``base_rss_mb`` is the value
before the case starts). ``cpu_s`` is the process CPU time, ``wall_s`` the wall time (on a
shared machine wall time depends on other load). Cases over ``--timeout`` seconds are killed
and recorded as such. Results go to ``benchmarks/results/scale.json`` with the command.

``--device cuda`` (a GPU): the same cases on ``cuda``; every timing is bracketed by
``torch.cuda.synchronize`` and ``peak_cuda_mb`` is ``torch.cuda.max_memory_allocated``
after ``reset_peak_memory_stats``. A device that is not available is refused before any
case runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from studies import harness

RESULTS = harness.RESULTS
MODELS = ("resnet18", "cnn", "mlp")
DEFAULTS: dict[str, dict[str, Any]] = {
    # inputs per case; laplace-torch is run on at most lt_max inputs (linear extrapolation)
    "mlp": {"ggn": [1000, 10000], "kernel": [256, 1024], "kernel_full": [256, 1024],
            "pred": 256, "lt_max": 1000, "lt_batch": 256, "gp_chunk": 64,
            "kron": [1000, 10000], "kron_max": 10000, "kron_batch": 256,
            "lpred": [100, 1000], "pred_fit": 256},
    "cnn": {"ggn": [1000, 10000], "kernel": [256, 1024], "kernel_full": [256, 1024],
            "pred": 256, "lt_max": 1000, "lt_batch": 32, "gp_chunk": 16,
            "kron": [1000, 10000], "kron_max": 10000, "kron_batch": 64,
            "lpred": [100, 1000], "pred_fit": 64},
    "resnet18": {"ggn": [1000, 10000], "kernel": [256, 1024], "kernel_full": [256],
                 "pred": 256, "lt_max": 16, "lt_batch": 2, "gp_chunk": 32,
                 "kron": [1000, 10000], "kron_max": 10000, "kron_batch": 32,
                 "lpred": [100, 1000], "pred_fit": 32},
}  # fmt: skip


def make_model(name: str) -> tuple[nn.Module, tuple[int, ...]]:
    """``(module [N, ...] -> [N, C], per-example input shape)``."""
    from fromp.models import CifarCNN, MultiHeadMLP, with_task

    torch.manual_seed(0)
    if name == "mlp":
        return with_task(MultiHeadMLP(784, (256, 256), n_heads=5, head_size=2).eval(), 0), (784,)
    if name == "cnn":
        return with_task(CifarCNN(n_heads=6, head_size=10).eval(), 0), (3, 32, 32)
    if name == "resnet18":
        import torchvision

        return torchvision.models.resnet18(num_classes=10).eval(), (3, 32, 32)
    raise ValueError(f"model must be one of {MODELS}, got {name!r}")


def _inputs(shape: tuple[int, ...], n: int, c: int, device: torch.device):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, *shape, generator=gen)
    y = torch.randint(0, c, (n,), generator=gen)
    return x.to(device), y.to(device)


def _laplace_torch_fit(net: nn.Module, x, y, batch: int) -> torch.Tensor:
    from laplace import DiagLaplace
    from torch.utils.data import DataLoader, TensorDataset

    la = DiagLaplace(net, "classification", prior_precision=1.0)
    la.fit(DataLoader(TensorDataset(x, y), batch_size=batch))
    return la.H.detach()


def run_case(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one case in this process and return its measurements."""
    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    net, shape = make_model(spec["model"])
    net = net.to(device)
    with torch.no_grad():
        c = net(torch.zeros(1, *shape, device=device)).shape[1]
    n = spec["n"]
    x, y = _inputs(shape, n, c, device)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    out: dict[str, Any] = {}
    harness.sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    if spec["case"] == "laplace":
        from fromp import fit_laplace

        q = fit_laplace(net, x, "categorical", 1.0)
        out["precision_sum"] = float(q.precision.sum())
    elif spec["case"] == "laplace_kron":
        from fromp import Laplace

        b = spec["kron_batch"]
        batches = [(x[i : i + b], y[i : i + b]) for i in range(0, n, b)]
        la = Laplace(net, "classification", "all", "kron", prior_precision=1.0).fit(batches)
        out["log_marginal_likelihood"] = float(la.log_marginal_likelihood())
        out["kron_blocks"], out["diagonal_tensors"] = len(la.H.blocks), len(la.H.diag)
    elif spec["case"] == "laplace_predictive":
        from fromp import Laplace

        m = spec["pred_fit"]
        xf, yf = _inputs(shape, m, c, device)
        la = Laplace(net, "classification", "all", spec["structure"], prior_precision=1.0)
        la.fit([(xf[i : i + 16], yf[i : i + 16]) for i in range(0, m, 16)])
        kw = {} if spec.get("memory_budget") is None else {"memory_budget": spec["memory_budget"]}
        harness.sync(device)
        out["fit_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        out["fit_s"] = time.perf_counter() - t0
        out["predictive"] = []
        for k in sorted(spec.get("ns", [n])):  # ascending: ru_maxrss only grows
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t1 = time.perf_counter()
            with torch.no_grad():
                p = la(x[:k], **kw)
            harness.sync(device)
            row = {"n": k, "pred_s": time.perf_counter() - t1,
                   "pred_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                   "prob_sum_mean": float(p.sum(1).mean())}  # fmt: skip
            if device.type == "cuda":
                row["peak_cuda_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
            out["predictive"].append(row)
    elif spec["case"] == "laplace_torch":
        h = _laplace_torch_fit(net, x, y, spec["lt_batch"])
        out["precision_sum"] = float(h.sum()) + h.numel()
    elif spec["case"] in ("kernel", "kernel_full", "predictive"):
        from fromp.curvature.jacobian import flat_params
        from fromp.gp.process import GP
        from fromp.posterior import DiagonalGaussian

        mean = flat_params(net)
        prec = 1.0 + torch.rand(mean.shape, generator=torch.Generator().manual_seed(1))
        q = DiagonalGaussian(mean, prec.to(mean))
        if spec["case"] == "predictive":
            gp = GP(net, q, "categorical", chunk_size=spec["gp_chunk"])
            p = gp.predictive(x, "probit")
            out["shape"] = list(p.shape)
        else:
            gp = GP(net, q, "categorical")
            k = gp.kernel(x, diagonal_outputs=spec["case"] == "kernel")
            out["shape"] = list(k.shape)
            out["method"] = "structured" if gp._structured else "jacobian"
    elif spec["case"] == "check":
        from fromp.curvature.diagonal import diag_ggn

        ours = diag_ggn(net, x, "categorical")
        theirs = _laplace_torch_fit(net, x, y, spec["lt_batch"]).to(ours)
        scale = float(theirs.abs().max())
        out["max_abs_diff_over_max"] = float((ours - theirs).abs().max()) / scale
    else:
        raise ValueError(f"unknown case {spec['case']!r}")
    harness.sync(device)
    out["wall_s"] = time.perf_counter() - t0
    out["cpu_s"] = time.process_time() - c0
    out["base_rss_mb"] = base
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if device.type == "cuda":
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def _spawn(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "studies.scale", "--case-json", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"killed after {timeout:.0f} s (--timeout)"}
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


CASES = (
    "check", "laplace", "laplace_torch", "laplace_kron", "kernel", "kernel_full", "predictive",
    "laplace_predictive",
)  # fmt: skip


def _plan(models: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    cases = getattr(args, "cases", None) or CASES
    specs = []
    lpred = getattr(args, "lpred_n", None)
    for m in models:
        d = dict(DEFAULTS[m])
        if lpred:
            d["lpred"] = [int(v) for v in lpred.split(",")]
        base = {"model": m, "device": args.device, "threads": args.threads,
                "lt_batch": d["lt_batch"], "gp_chunk": d["gp_chunk"]}  # fmt: skip
        specs.append({**base, "case": "check", "n": 8})
        for n in d["kron"]:  # above kron_max: timed on kron_max inputs, scaled linearly
            specs.append({**base, "case": "laplace_kron", "n": min(n, d["kron_max"]),
                          "target_n": n, "kron_batch": d["kron_batch"]})  # fmt: skip
        for n in d["ggn"]:
            specs.append({**base, "case": "laplace", "n": n})
            if not args.skip_laplace_torch:
                n_lt = min(n, d["lt_max"])
                specs.append({**base, "case": "laplace_torch", "n": n_lt, "target_n": n})
        for case in ("kernel", "kernel_full"):
            for n in d[case]:
                specs.append({**base, "case": case, "n": n})
        specs.append({**base, "case": "predictive", "n": d["pred"]})
        for structure in ("kron", "diag"):  # one fit, then the predictive on each n
            specs.append({**base, "case": "laplace_predictive", "n": max(d["lpred"]),
                          "ns": d["lpred"], "structure": structure, "pred_fit": d["pred_fit"],
                          "memory_budget": getattr(args, "memory_budget", None)})  # fmt: skip
    return [s for s in specs if s["case"] in cases]


def check_device(device: str) -> str:
    """``device`` if torch can use it, else a ``ValueError`` naming ``--device``."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"--device must be a torch device such as 'cpu' or 'cuda', got "
                         f"{device!r}") from err  # fmt: skip
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine "
                         "(torch.cuda.is_available() is False)")  # fmt: skip
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be 'cpu' or 'cuda[:i]', got {device!r}")
    return device


def main(argv: list[str] | None = None) -> None:
    parser = harness.parser(__name__, __doc__)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--skip-laplace-torch", action="store_true")
    parser.add_argument(
        "--lpred-n", default=None, help="comma-separated input counts for laplace_predictive"
    )
    parser.add_argument(
        "--memory-budget",
        type=int,
        default=None,
        help="bytes for laplace_predictive's chunks (default: the device's)",
    )
    harness.add_out(parser, RESULTS / "scale.json")
    parser.add_argument("--case-json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.case_json:
        harness.prepare_out(args.out)
    if args.case_json:
        print(json.dumps(run_case(json.loads(args.case_json))))
        return
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    bad = [m for m in models if m not in MODELS]
    if bad:
        parser.error(f"--models must be among {MODELS}, got {bad}")
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in args.cases if c not in CASES]
    if bad or not args.cases:
        parser.error(f"--cases must be among {CASES}, got {bad or args.cases}")
    if args.memory_budget is not None and args.memory_budget < 1:
        parser.error(
            f"--memory-budget must be a positive number of bytes, got {args.memory_budget}"
        )
    try:
        check_device(args.device)
    except ValueError as err:
        parser.error(str(err))
    results = []
    for spec in _plan(models, args):
        res = _spawn(spec, args.timeout)
        row = {**spec, **res}
        scaled = spec["case"] in ("laplace_torch", "laplace_kron")
        if scaled and spec["n"] < spec["target_n"] and "cpu_s" in res:
            f = spec["target_n"] / spec["n"]
            row["extrapolated_from_n"] = spec["n"]
            row["n"] = spec["target_n"]
            row["cpu_s_extrapolated"] = res["cpu_s"] * f
            row["wall_s_extrapolated"] = res["wall_s"] * f
        results.append(row)
        _write(args.out, argv, results)
        shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                 if k not in ("device", "threads", "lt_batch", "gp_chunk")}  # fmt: skip
        print(json.dumps(shown), flush=True)
    print(f"wrote {args.out}")


def _write(out: Path, argv: list[str] | None, results: list[dict[str, Any]]) -> None:
    """Write the results so far (a killed run keeps what it measured)."""
    record = {
        "command": harness.command("studies.scale", argv),
        "environment": harness.environment(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "processor": platform.processor(),
        "results": results,
    }
    harness.write_json(out, record, indent=1)


if __name__ == "__main__":
    main()
