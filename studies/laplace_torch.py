r"""fromp's Laplace beside laplace-torch 0.3: every subset and structure, same weights, same data.

    python -m studies.laplace_torch --out benchmarks/results/laplace_torch.json
        [--models mlp,cnn,resnet18] [--parts cases,equality,curvlinops] [--threads 1]
        [--subsets all,last_layer] [--prior-precision 30] [--data-root DATA] [--timeout 600]

Networks (eval mode, one head of 10 classes):

* ``mlp``: ``MultiHeadMLP(784, (256, 256), n_heads=1, head_size=10)``, trained for one epoch
  of Adam on real MNIST (seed 0, a few seconds) by the parent process; fitted on the first
  ``n_fit`` MNIST training images, tested on the first ``n_test`` test images (NLL, ECE,
  accuracy mean something here);
* ``cnn``: the split-CIFAR ``CifarCNN`` (one head of 10), initial weights (seed 0);
* ``resnet18``: ``torchvision.models.resnet18(num_classes=10)``, initial weights (seed 0);
  the CNN and ResNet-18 run on standard-normal CIFAR-shaped inputs ``[N, 3, 32, 32]`` with
  uniform labels (:func:`studies.scale._inputs`): their time, memory and the
  agreement of the two libraries are measured, their NLL / ECE are not meaningful.

Three parts (``--parts``):

* ``cases``: for each network, subset ``all`` / ``last_layer`` and structure ``diag`` /
  ``kron`` / ``full``, ``fromp.Laplace`` and ``laplace.Laplace`` (backend ``CurvlinopsGGN``,
  exact GGN, ``stochastic=False``) each in its own subprocess (:func:`run_case`): fit time
  (``fit(loader)``), the log marginal likelihood at ``--prior-precision``, prediction time of
  the GLM probit predictive on the test inputs (``la(x, pred_type="glm",
  link_approx="probit")`` in chunks of ``pred_batch``), test NLL / ECE / accuracy, and the
  process's peak resident set size (``ru_maxrss``; ``base_rss_mb`` is the value once the
  model and data are loaded). The parent compares the two libraries' evidence and predictive
  (relative differences, float32). ``full`` over all weights is skipped (``P x P`` does not fit:
  the reason is in the JSON); ResNet-18's ``all``/``kron`` case freezes its batch-norm
  parameters on both sides (curvlinops' KFAC covers ``Linear`` / ``Conv2d`` only).
* ``equality``: float64, both libraries in one process, on small data: posterior precision
  (diagonal, dense, or per Kronecker block ``B (x) A`` compared through Frobenius inner products
  ``<B1 (x) A1, B2 (x) A2> = <B1, B2> <A1, A2>``, nothing ``P x P`` formed), the evidence and the
  GLM probit predictive, with their relative differences (:func:`rel_diff`).
* ``curvlinops``: ``fromp.curvature.kron.kron_curvature`` against curvlinops' ``KFACLinearOperator``
  (``fisher_type="type-2"``, i.e. exact GGN columns, ``kfac_approx="expand"``) on the same
  batches, one thread: times, their ratio, and the factors' agreement.

laplace-torch, curvlinops and BackPACK are optional (``pip install -e '.[laplace]'``); without
them the study stops with a one-line error naming the package and the extra.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from studies import harness
from studies.laplace_torch_table import compare_rows, markdown_table, rel_diff
from studies.scale import _inputs

RESULTS = harness.RESULTS
MODELS = ("mlp", "cnn", "resnet18")
SUBSETS = ("all", "last_layer")
STRUCTURES = ("diag", "kron", "full")
LIBRARIES = ("fromp", "laplace_torch")
PARTS = ("cases", "equality", "curvlinops")
OPTIONAL = ("laplace", "curvlinops", "backpack")
EXTRA = "pip install -e '.[laplace]'"
# inputs per network: laplace-torch's all-weights diagonal forms per-example Jacobians [B, C, P]
# (ResNet-18: 0.45 GB per input in float32), which sets the batch and the counts
DEFAULTS: dict[str, dict[str, int]] = {
    "mlp": {"n_fit": 2000, "n_test": 500, "batch": 50, "pred_batch": 50},
    "cnn": {"n_fit": 128, "n_test": 64, "batch": 16, "pred_batch": 16},
    "resnet18": {"n_fit": 16, "n_test": 8, "batch": 2, "pred_batch": 2},
}
# fromp's dense GGN limit (FullLaplace's max_params): above it "full" over all weights is skipped
FULL_MAX_PARAMS = 20_000


class MissingExtra(RuntimeError):
    """An optional package of the comparison is not installed."""


def require_extras(names: tuple[str, ...] = OPTIONAL) -> None:
    """Raise :class:`MissingExtra` with a one-line message naming the first missing
    package among ``names`` (import names) and the extra that installs it."""
    pip = {"laplace": "laplace-torch", "curvlinops": "curvlinops-for-pytorch",
           "backpack": "backpack-for-pytorch"}  # fmt: skip
    for name in names:
        if importlib.util.find_spec(name) is None:
            raise MissingExtra(
                f"this study needs {pip.get(name, name)} (import {name!r}), which is not "
                f"installed: {EXTRA}"
            )


def kron_rel_diff(b1: Tensor, a1: Tensor, b2: Tensor, a2: Tensor) -> float:
    """``||B1 (x) A1 - B2 (x) A2||_F / ||B2 (x) A2||_F`` without forming either product.

    The factors' scales differ between libraries (``(c B) (x) (A / c)`` is the same block),
    so ``A1, B1`` are first rescaled to ``||A1|| = ||A2||``; then
    ``B1 (x) A1 - B2 (x) A2 = X + Y`` with ``X = (B1 - B2) (x) A1``, ``Y = B2 (x) (A1 - A2)``,
    and ``||X + Y||^2 = ||X||^2 + ||Y||^2 + 2 <B1 - B2, B2> <A1, A1 - A2>``
    (``<P (x) Q, R (x) S>_F = <P, R>_F <Q, S>_F``): every term is formed from differences,
    so agreement to rounding reads as ~1e-16, not as the ~1e-8 of a difference of squares."""
    b1, a1, b2, a2 = (t.double() for t in (b1, a1, b2, a2))
    tiny = torch.finfo(torch.float64).tiny
    na1, na2 = float(a1.norm()), float(a2.norm())
    if na1 > 0 and na2 > 0:
        s = na2 / na1
        a1, b1 = a1 * s, b1 / s
    db, da = b1 - b2, a1 - a2
    sq = (float(db.norm() * a1.norm()) ** 2 + float(b2.norm() * da.norm()) ** 2
          + 2 * float((db * b2).sum() * (a1 * da).sum()))  # fmt: skip
    return math.sqrt(max(sq, 0.0)) / max(float(b2.norm() * a2.norm()), tiny)


# ---------------------------------------------------------------------------- models and data
def make_model(name: str, state: str | None = None) -> tuple[nn.Module, tuple[int, ...]]:
    """``(network [N, ...] -> [N, 10] in eval mode, per-example input shape)``; ``state``: a
    ``torch.save``-d state dict to load (the trained MLP)."""
    from fromp.models import CifarCNN, MultiHeadMLP

    torch.manual_seed(0)
    if name == "mlp":
        net, shape = MultiHeadMLP(784, (256, 256), n_heads=1, head_size=10), (784,)
    elif name == "cnn":
        net, shape = CifarCNN(n_heads=1, head_size=10), (3, 32, 32)
    elif name == "resnet18":
        import torchvision

        net, shape = torchvision.models.resnet18(num_classes=10), (3, 32, 32)
    elif name == "tiny_mlp":
        net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4), nn.ReLU(),
                            nn.Linear(4, 3))  # fmt: skip
        shape = (6,)
    elif name == "tiny_cnn":
        net = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 2, 2),
                            nn.Tanh(), nn.Flatten(), nn.Linear(2 * 3 * 3, 3))  # fmt: skip
        shape = (2, 4, 4)
    else:
        raise ValueError(f"model must be one of {MODELS}, got {name!r}")
    if state is not None:
        net.load_state_dict(torch.load(state, weights_only=True))
    return net.eval(), shape


def train_mlp(path: Path, data_root: str | None, epochs: int = 1) -> dict[str, float]:
    """Train the MNIST MLP (Adam, lr 1e-3, batch 128, seed 0) and save its state at ``path``."""
    from fromp_bench.data import load_mnist

    x, y, _, _ = load_mnist(data_root, download=False)
    net, _ = make_model("mlp")
    net.train()
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    t0 = time.perf_counter()
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=gen).split(128):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(x[idx]), y[idx])
            loss.backward()
            opt.step()
    net.eval()
    with torch.no_grad():
        train_nll = float(nn.functional.cross_entropy(net(x[:2000]), y[:2000]))
    # a diverged network gives no comparison worth printing: refuse it
    if not (math.isfinite(train_nll) and train_nll < math.log(10)):
        raise RuntimeError(f"the MLP did not train (NLL {train_nll} on 2,000 training images)")
    torch.save(net.state_dict(), path)
    return {"train_s": time.perf_counter() - t0, "epochs": epochs, "n_train": len(x),
            "train_nll_first_2000": train_nll}  # fmt: skip


def require_finite(library: str, **values: Any) -> None:
    """Refuse a case whose evidence or predictive is not finite (NaN / inf), naming it."""
    for name, v in values.items():
        t = torch.as_tensor(v)
        if not bool(torch.isfinite(t).all()):
            raise RuntimeError(f"{library}: {name} is not finite")


def load_data(model: str, n_fit: int, n_test: int, data_root: str | None = None):
    """``(x_fit, y_fit, x_test, y_test)``: MNIST for the MLP (first ``n_fit`` training and
    ``n_test`` test images), standard-normal CIFAR-shaped tensors otherwise."""
    if model == "mlp":
        from fromp_bench.data import load_mnist

        x, y, xt, yt = load_mnist(data_root, download=False)
        return x[:n_fit].flatten(1), y[:n_fit], xt[:n_test].flatten(1), yt[:n_test]
    _, shape = make_model(model)
    x, y = _inputs(shape, n_fit + n_test, 10, torch.device("cpu"))
    return x[:n_fit], y[:n_fit], x[n_fit:], y[n_fit:]


def freeze_norms(net: nn.Module) -> int:
    """Freeze the parameters of every batch-norm layer; returns how many tensors."""
    k = 0
    for m in net.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            for p in m.parameters(recurse=False):
                p.requires_grad_(False)
                k += 1
    return k


def skip_reason(model: str, subset: str, structure: str, n_params: int) -> str | None:
    """Why a (network, subset, structure) case is not run, or None."""
    if subset == "all" and structure == "full" and n_params > FULL_MAX_PARAMS:
        gb = n_params**2 * 4 / 1e9
        return (f"all-weights full GGN of P={n_params:,} parameters is a {gb:,.0f} GB float32 "
                f"matrix (fromp's limit: P <= {FULL_MAX_PARAMS:,}); compared in float64 on a "
                "tiny MLP and CNN in the 'equality' part")  # fmt: skip
    return None


def plan(
    models: list[str], sizes: dict[str, dict[str, int]], subsets: tuple[str, ...] = SUBSETS
) -> list[dict[str, Any]]:
    """One spec per (network, subset, structure, library), skipped cases included with their
    reason (``skip``)."""
    specs = []
    for m in models:
        net, _ = make_model(m)
        p_all = sum(p.numel() for p in net.parameters())
        for subset in subsets:
            for structure in STRUCTURES:
                for lib in LIBRARIES:
                    spec = {"model": m, "subset": subset, "structure": structure,
                            "library": lib, **sizes[m]}  # fmt: skip
                    reason = skip_reason(m, subset, structure, p_all)
                    if reason:
                        spec["skip"] = reason
                    specs.append(spec)
    return specs


# ------------------------------------------------------------------------------------ the cases
def _loader(x: Tensor, y: Tensor, batch: int):
    from torch.utils.data import DataLoader, TensorDataset

    return DataLoader(TensorDataset(x, y), batch_size=batch)


def build(lib: str, net: nn.Module, subset: str, structure: str, prior: float) -> Any:
    """An unfitted Laplace of ``lib`` (laplace-torch: exact GGN through ``CurvlinopsGGN``)."""
    if lib == "fromp":
        from fromp import Laplace

        return Laplace(net, "classification", subset, structure, prior_precision=prior)
    from laplace import Laplace as LTLaplace
    from laplace.curvature import CurvlinopsGGN

    return LTLaplace(net, "classification", subset_of_weights=subset,
                     hessian_structure=structure, prior_precision=prior,
                     backend=CurvlinopsGGN, backend_kwargs={"stochastic": False})  # fmt: skip


def predict(la: Any, x: Tensor, chunk: int) -> Tensor:
    """GLM probit predictive ``[N, C]`` in chunks."""
    outs = [la(x[i : i + chunk], pred_type="glm", link_approx="probit")
            for i in range(0, len(x), chunk)]  # fmt: skip
    return torch.cat([o.detach() for o in outs])


def scores(probs: Tensor, y: Tensor) -> dict[str, float]:
    """Test NLL (mean), ECE (15 bins) and accuracy of predicted probabilities ``[N, C]``."""
    from fromp_bench.plugins import expected_calibration_error

    p = probs.double().clamp_min(1e-12)
    return {
        "nll": float(-p.gather(1, y.reshape(-1, 1)).log().mean()),
        "ece": expected_calibration_error(probs.double(), y),
        "accuracy": float((probs.argmax(1) == y).double().mean()),
    }


def run_case(spec: dict[str, Any]) -> dict[str, Any]:
    """One (network, subset, structure, library) in this process: fit, evidence, predictive,
    scores and peaks; the predictive and evidence are saved to ``spec["save"]`` when given."""
    torch.set_num_threads(spec.get("threads", 1))
    net, _ = make_model(spec["model"], spec.get("state"))
    x, y, xt, yt = load_data(spec["model"], spec["n_fit"], spec["n_test"], spec.get("data_root"))
    out: dict[str, Any] = {}
    if spec["model"] == "resnet18" and spec["subset"] == "all" and spec["structure"] == "kron":
        out["frozen_batchnorm_tensors"] = freeze_norms(net)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    la = build(spec["library"], net, spec["subset"], spec["structure"], spec["prior_precision"])
    loader = _loader(x, y, spec["batch"])
    t0, c0 = time.perf_counter(), time.process_time()
    la.fit(loader)
    out["fit_s"], out["fit_cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
    t0 = time.perf_counter()
    lml = float(la.log_marginal_likelihood())
    out["lml_s"], out["log_marginal_likelihood"] = time.perf_counter() - t0, lml
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad() if spec["library"] == "laplace_torch" else contextlib.nullcontext():
        probs = predict(la, xt, spec["pred_batch"])
    out["predict_s"], out["predict_cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
    require_finite(spec["library"], log_marginal_likelihood=lml, predictive=probs)
    out |= scores(probs, yt)
    out["n_params"] = int(sum(p.numel() for p in net.parameters() if p.requires_grad))
    out["base_rss_mb"] = base
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if spec.get("save"):
        torch.save({"probs": probs, "lml": lml}, spec["save"])
    return out


def map_scores(spec: dict[str, Any]) -> dict[str, float]:
    """Scores of the network's own softmax on the test inputs (no Laplace)."""
    net, _ = make_model(spec["model"], spec.get("state"))
    _, _, xt, yt = load_data(spec["model"], spec["n_fit"], spec["n_test"], spec.get("data_root"))
    with torch.no_grad():
        return scores(torch.softmax(net(xt), 1), yt)


# ---------------------------------------------------------------------------- float64 equality
def _lt_kron_blocks(la: Any) -> list[list[Tensor]]:
    """laplace-torch's Kronecker factors, one list per parameter tensor: ``[B, A]`` for a
    weight, ``[B]`` for a bias (its ``H_facs``)."""
    return [list(f) for f in la.H_facs.kfacs]


def compare_pair(
    net: nn.Module,
    subset: str,
    structure: str,
    data: tuple[Tensor, Tensor, Tensor],
    batch: int,
    prior: float = 1.0,
) -> dict[str, Any]:
    """Fit both libraries on the same float64 network and data; relative differences of
    fromp's numbers from laplace-torch's (the reference): the GGN part of the posterior
    precision, the evidence and the GLM probit predictive."""
    x, y, xt = data
    loader = _loader(x, y, batch)
    ours = build("fromp", net, subset, structure, prior)
    ours.fit(loader)
    theirs = build("laplace_torch", net, subset, structure, prior)
    theirs.fit(loader)
    out: dict[str, Any] = {"subset": subset, "structure": structure, "n": len(x),
                           "batches": math.ceil(len(x) / batch)}  # fmt: skip
    if structure in ("diag", "full"):
        out["precision"] = rel_diff(ours.posterior_precision, theirs.posterior_precision)
    else:
        lt = _lt_kron_blocks(theirs)
        ws, bs = [], []
        k = 0
        for blk, names in zip(ours.H.blocks, ours.H.names):
            b2, a2 = lt[k]
            ws.append(kron_rel_diff(blk.B, blk.A, b2, a2))
            k += 1
            if len(names) > 1:
                bs.append(rel_diff(blk.B_bias, lt[k][0]))
                k += 1
        out["precision_weight_blocks"] = max(ws)
        out["precision_bias_blocks"] = max(bs) if bs else 0.0
        out["precision"] = max(ws + bs)
    out["log_marginal_likelihood"] = rel_diff(
        ours.log_marginal_likelihood().detach(), theirs.log_marginal_likelihood().detach()
    )
    with torch.no_grad():
        p_lt = theirs(xt, pred_type="glm", link_approx="probit")
    out["predictive"] = rel_diff(ours(xt, pred_type="glm", link_approx="probit").detach(), p_lt)
    if structure == "kron" and out["precision_bias_blocks"] > 1e-6:
        # the bias convention is the only difference: give fromp laplace-torch's bias blocks
        for blk in ours.H.blocks:
            if blk.B_bias is not None:
                blk.B_bias = blk.B.clone()
        ours._fitted()
        out["with_laplace_torch_bias_blocks"] = {
            "log_marginal_likelihood": rel_diff(ours.log_marginal_likelihood().detach(),
                                                theirs.log_marginal_likelihood().detach()),
            "predictive": rel_diff(ours(xt, pred_type="glm", link_approx="probit").detach(),
                                   p_lt),
        }  # fmt: skip
    return out


def equality(state: str | None, data_root: str | None, models: list[str]) -> list[dict[str, Any]]:
    """The float64 comparisons (module docstring), one row per (network, data, case)."""
    torch.set_default_dtype(torch.float64)
    rows = []
    try:
        runs: list[tuple[str, int, int, int, list[tuple[str, str]]]] = []
        small = [(s, h) for s in SUBSETS for h in STRUCTURES]
        runs += [("tiny_mlp", 12, 12, 6, small), ("tiny_mlp", 12, 4, 6, small)]
        runs += [("tiny_cnn", 1, 1, 4, small), ("tiny_cnn", 8, 4, 4, small)]
        big = [(s, h) for s in SUBSETS for h in STRUCTURES if (s, h) != ("all", "full")]
        if "mlp" in models:
            runs += [("mlp", 128, 32, 32, big)]
        if "cnn" in models:
            runs += [("cnn", 8, 4, 4, big)]
        if "resnet18" in models:
            runs += [("resnet18", 4, 4, 2, [("last_layer", h) for h in STRUCTURES])]
        for name, n, batch, n_test, cases in runs:
            net, shape = make_model(name, state if name == "mlp" else None)
            net = net.double()
            if name == "mlp":
                x, y, xt, _ = load_data("mlp", n, n_test, data_root)
            else:
                gen = torch.Generator().manual_seed(1)
                x = torch.randn(n + n_test, *shape, generator=gen)
                y = torch.randint(0, 3 if name.startswith("tiny") else 10, (n + n_test,),
                                  generator=gen)  # fmt: skip
                x, y, xt = x[:n], y[:n], x[n:]
            x, xt = x.double(), xt.double()
            for subset, structure in cases:
                row = {"model": name}
                try:
                    row |= compare_pair(net, subset, structure, (x, y, xt), batch)
                except Exception as err:  # a case one library refuses: recorded, not fatal
                    row |= {"subset": subset, "structure": structure,
                            "error": f"{type(err).__name__}: {err}"[:300]}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        torch.set_default_dtype(torch.float32)
    return rows


# ------------------------------------------------------------------------------ curvlinops KFAC
def curvlinops_case(model: str, n: int, batch: int) -> dict[str, Any]:
    """``fromp.curvature.kron.kron_curvature`` against ``KFACLinearOperator`` on the same batches
    (one thread): times, their ratio and the factors' relative differences. ResNet-18's
    batch-norm parameters are frozen for both (and curvlinops' behaviour with them trainable
    is recorded)."""
    from curvlinops import KFACLinearOperator

    from fromp.curvature.kron import kron_curvature
    from fromp.likelihood import CategoricalLikelihood

    torch.set_num_threads(1)
    net, shape = make_model(model)
    x, y = _inputs(shape, n, 10, torch.device("cpu"))
    batches = [(x[i : i + batch], y[i : i + batch]) for i in range(0, n, batch)]
    out: dict[str, Any] = {"model": model, "n": n, "batch": batch}
    loss = nn.CrossEntropyLoss(reduction="sum")
    if model == "resnet18":
        try:
            KFACLinearOperator(net, loss, list(net.parameters()), batches[:1],
                               fisher_type="type-2", check_deterministic=False)  # fmt: skip
            out["curvlinops_with_batchnorm"] = "accepted"
        except Exception as err:
            out["curvlinops_with_batchnorm"] = f"{type(err).__name__}: {err}"[:300]
        out["frozen_batchnorm_tensors"] = freeze_norms(net)
    params = [p for p in net.parameters() if p.requires_grad]
    # one untimed warm-up batch each (first-call set-up of torch's kernels is not the method)
    kron_curvature(net, batches[:1], CategoricalLikelihood())
    KFACLinearOperator(net, loss, params, batches[:1], fisher_type="type-2",
                       check_deterministic=False).compute_kronecker_factors()  # fmt: skip
    t0 = time.process_time()
    ours = kron_curvature(net, batches, CategoricalLikelihood())
    out["fromp_s"] = time.process_time() - t0
    t0 = time.process_time()
    op = KFACLinearOperator(net, loss, params, batches, fisher_type="type-2",
                            kfac_approx="expand", separate_weight_and_bias=True,
                            check_deterministic=False)  # fmt: skip
    op.compute_kronecker_factors()
    out["curvlinops_s"] = time.process_time() - t0
    out["ratio_fromp_over_curvlinops"] = out["fromp_s"] / out["curvlinops_s"]
    names = {id(m): name for name, m in net.named_modules()}
    from fromp.curvature.kron import kron_layers

    ws, bs = [], []
    for blk, m in zip(ours.blocks, kron_layers(net)):
        name = names[id(m)]
        a2, b2 = op._input_covariances[name], op._gradient_covariances[name]
        ws.append(kron_rel_diff(blk.B, blk.A, b2, a2))
        if blk.B_bias is not None:
            bs.append(rel_diff(blk.B_bias, b2))
    out["weight_blocks_max_rel_diff"] = max(ws)
    out["bias_blocks_max_rel_diff"] = max(bs) if bs else 0.0
    out["bias_blocks_rel_diff"] = bs
    return out


# ---------------------------------------------------------------------------------- the driver
def _spawn(payload: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "studies.laplace_torch", "--case-json",
           json.dumps(payload)]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"killed after {timeout:.0f} s (--timeout)"}
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return {"error": lines[-1][:400] if lines else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _dispatch(payload: dict[str, Any]) -> Any:
    kind = payload.get("kind", "case")
    if kind == "case":
        return run_case(payload)
    if kind == "map":
        return map_scores(payload)
    if kind == "equality":
        return equality(payload.get("state"), payload.get("data_root"), payload["models"])
    if kind == "curvlinops":
        return curvlinops_case(payload["model"], payload["n"], payload["batch"])
    raise ValueError(f"unknown kind {kind!r}")


CURVLINOPS_SIZES = {"mlp": (1000, 100), "cnn": (256, 32), "resnet18": (32, 8)}


def main(argv: list[str] | None = None) -> None:
    parser = harness.parser(__name__, __doc__)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--subsets", default=",".join(SUBSETS), help="of the 'cases' part")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prior-precision", type=float, default=30.0)
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--timeout", type=float, default=900.0)
    harness.add_out(parser, RESULTS / "laplace_torch.json")
    parser.add_argument("--case-json", help=argparse.SUPPRESS)
    parser.add_argument(
        "--resummarize",
        type=Path,
        help="recompute the summary and table of this result JSON from its cases (and the "
        "saved predictives in --saved-dir, when still there); runs nothing",
    )
    parser.add_argument("--saved-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if not args.case_json and not args.resummarize:
        harness.prepare_out(args.out)
    if args.resummarize:
        resummarize(args.resummarize, args.saved_dir)
        return
    if args.case_json:
        print(json.dumps(_dispatch(json.loads(args.case_json))))
        return
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    subsets = tuple(s.strip() for s in args.subsets.split(",") if s.strip())
    bad = [m for m in models if m not in MODELS] + [p for p in parts if p not in PARTS]
    bad += [s for s in subsets if s not in SUBSETS]
    if bad or not models or not parts or not subsets:
        parser.error(
            f"--models must be among {MODELS}, --parts among {PARTS} and --subsets among "
            f"{SUBSETS}, got {bad}"
        )
    try:
        require_extras()
    except MissingExtra as err:
        parser.error(str(err))
    record: dict[str, Any] = {
        "command": harness.command("studies.laplace_torch", argv),
        "environment": harness.environment(),
        "torch": torch.__version__,
        "laplace_torch": _version("laplace-torch"),
        "curvlinops": _version("curvlinops-for-pytorch"),
        "threads": args.threads,
        "prior_precision": args.prior_precision,
        "machine": platform.machine(),
        "processor": platform.processor(),
        "sizes": {m: DEFAULTS[m] for m in models},
        "notes": NOTES,
    }
    tmp = Path(tempfile.mkdtemp(prefix="fromp_lt_"))
    state = None
    if "mlp" in models and ({"cases", "equality"} & set(parts)):
        state = str(tmp / "mlp.pt")
        torch.set_num_threads(args.threads)
        record["mlp_training"] = train_mlp(Path(state), args.data_root)
        _write(args.out, record)
    common = {"threads": args.threads, "prior_precision": args.prior_precision,
              "data_root": args.data_root}  # fmt: skip
    if "equality" in parts:
        res = _spawn({"kind": "equality", "state": state, "models": models, **common},
                     args.timeout * 2)  # fmt: skip
        record["equality"] = res
        _write(args.out, record)
        print(json.dumps({"equality": res})[:2000], flush=True)
    if "curvlinops" in parts:
        record["curvlinops"] = []
        for m in models:
            n, b = CURVLINOPS_SIZES[m]
            res = _spawn({"kind": "curvlinops", "model": m, "n": n, "batch": b}, args.timeout)
            record["curvlinops"].append({"model": m, **res})
            _write(args.out, record)
            print(json.dumps(record["curvlinops"][-1]), flush=True)
    if "cases" in parts:
        rows, saved = [], {}
        record["map"] = {}
        for m in models:
            base = {"model": m, "state": state if m == "mlp" else None, **DEFAULTS[m], **common}
            record["map"][m] = _spawn({"kind": "map", **base}, args.timeout)
        for spec in plan(models, DEFAULTS, subsets):
            spec = {**spec, **common, "state": state if spec["model"] == "mlp" else None}
            key = (spec["model"], spec["subset"], spec["structure"], spec["library"])
            if "skip" not in spec:
                spec["save"] = str(tmp / ("_".join(key) + ".pt"))
                saved[key] = spec["save"]
                res = _spawn(spec, args.timeout)
            else:
                res = {}
            row = {k: v for k, v in {**spec, **res}.items()
                   if k not in ("save", "state", "data_root", "threads")}  # fmt: skip
            rows.append(row)
            record["cases"] = rows
            record["summary"] = compare_rows(rows, saved)
            record["table"] = markdown_table(record["summary"]).splitlines()
            _write(args.out, record)
            keep = ("model", "subset", "structure", "library", "fit_s", "predict_s",
                    "peak_rss_mb", "log_marginal_likelihood", "nll", "error")  # fmt: skip
            shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                     if k in keep}  # fmt: skip
            print(json.dumps(shown), flush=True)
    print(f"wrote {args.out}")


def resummarize(path: Path, saved_dir: Path | None) -> None:
    """Recompute ``summary`` and ``table`` of a result file from its ``cases``."""
    record = json.loads(path.read_text())
    rows = record["cases"]
    saved = {}
    if saved_dir is not None:
        for r in rows:
            key = (r["model"], r["subset"], r["structure"], r["library"])
            saved[key] = str(saved_dir / ("_".join(key) + ".pt"))
    record["summary"] = compare_rows(rows, saved)
    record["table"] = markdown_table(record["summary"]).splitlines()
    record["notes"] = NOTES
    _write(path, record)


NOTES = [
    "laplace-torch runs with backend CurvlinopsGGN(stochastic=False): the exact GGN, as fromp.",
    "mlp: trained one epoch on real MNIST; cnn and resnet18: initial weights (seed 0) on "
    "standard-normal CIFAR-shaped inputs: their NLL/ECE/accuracy are not meaningful, only time, "
    "memory and agreement.",
    "One thread, a fresh subprocess per (library, case): *_cpu_s is the process CPU time (the "
    "ratios and the table use it: the machine was shared with other jobs, which inflates "
    "wall-clock *_s); peak_rss_mb is that process's ru_maxrss (Python, torch, model and data "
    "included: see base_rss_mb).",
    "resnet18 all/kron: batch-norm parameters frozen on both sides (curvlinops' KFAC covers "
    "Linear/Conv2d only); fromp's own all-weights Kronecker Laplace with batch norm as diagonal "
    "blocks on 10,000 inputs: 505 s CPU, 2.8 GB (benchmarks/results/scale_kron.json).",
    "Kronecker conventions: both use KFAC-expand, A the mean of u u^T over examples and positions, "
    "B the sum of g g^T, summed over batches the same way (laplace-torch rescales each batch's A "
    "by M/N). The bias: fromp keeps its exact block sum_n (sum_l g)(sum_l g)^T; laplace-torch "
    "uses the weight's B (sum_l g g^T). Equal for Linear layers, different for Conv2d: CNN "
    "kron-all evidence and predictive differ for that reason only (weight blocks agree).",
]


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _write(out: Path, record: dict[str, Any]) -> None:
    harness.write_json(out, record, indent=1)


if __name__ == "__main__":
    main()
