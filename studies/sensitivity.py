"""Validation of the memory-perturbation equation against leave-one-out retraining.

An MLP (784-8-10, tanh, float64, 6,370 parameters) is trained to convergence on 1,000 real
MNIST images (objective ``sum_i nll_i + delta/2 |w|^2``, ``delta = 10``, full-batch L-BFGS),
a full-covariance Laplace-GGN posterior is fitted at the optimum (``--posterior diag``: the
diagonal one), and :func:`fromp.memory.sensitivity.memory_perturbation`
estimates every example's leave-one-out logits ``f_i + e_i * v_i`` (and ``f_i + V_i e_i``).
Then the network is retrained without each of the ``--n-each`` most and least sensitive
examples, warm-started from the trained weights (as Nickl et al., 2023, do), and the true
changes of the removed example's logits are compared with the estimates:

* Spearman correlation between estimated and true ``|f_i^{\\i} - f_i|_1`` over the retrained
  examples (target >= 0.8), for ``f + e * v``, ``f + V e`` and the corrected
  ``f + V (I - Lambda V)^{-1} e``;
* the estimated leave-one-out NLL of those examples against the retrained one (target:
  within 10 %);
* the test NLL change: true (retrained) against the first-order estimate
  ``J_test Sigma J_i^T e_i``;
* :func:`fromp.memory.sensitivity.newton_step_loo`: one Newton step on the leave-one-out objective
  from the trained weights, ``w* + (H - H_i)^{-1} g_i``, with ``H`` the exact Hessian of the
  training objective (dense, ``P x P``) and ``H_i`` the example's exact Hessian, the network
  evaluated at the stepped weights (and, for comparison, linearised; and with the GGN
  posterior and ``H_i = J_i^T Lambda_i J_i``, the network evaluated at the step of the
  corrected form).

Usage (real MNIST under ``$FROMP_DATA`` or ``--data-root``)::

    python -m studies.sensitivity [--n-train 1000] [--n-each 50] [--threads 1]

Writes ``benchmarks/results/sensitivity.json`` and ``sensitivity.png``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from fromp_bench.data import load_mnist
from scipy.stats import pearsonr, spearmanr
from torch import Tensor, nn
from torch.func import functional_call, jvp

from fromp.curvature.jacobian import flat_params, unflatten
from fromp.laplace.one_call import fit_laplace
from fromp.likelihood import get_likelihood
from fromp.memory.sensitivity import memory_perturbation, newton_step_loo
from fromp.posterior import FullGaussian
from studies import harness

RESULTS = harness.RESULTS


def _objective(net: nn.Module, x: Tensor, y: Tensor, delta: float):
    def f(w: Tensor) -> Tensor:
        out = functional_call(net, unflatten(net, w), (x,))
        return nn.functional.cross_entropy(out, y, reduction="sum") + 0.5 * delta * w.dot(w)

    return f


def _hessian(fn, w: Tensor, chunk: int = 250) -> Tensor:
    """Dense Hessian ``[P, P]`` of ``fn`` at ``w`` by Hessian-vector products, ``chunk`` at a
    time (forward over reverse), symmetrised."""
    grad_fn = torch.func.grad(fn)
    eye = torch.eye(w.numel(), dtype=w.dtype)
    rows = [
        torch.func.vmap(lambda v: jvp(grad_fn, (w,), (v,))[1])(eye[s : s + chunk])
        for s in range(0, w.numel(), chunk)
    ]
    h = torch.cat(rows)
    return 0.5 * (h + h.T)


def _minimise(fn, w0: Tensor, max_iter: int, tol: float) -> tuple[Tensor, int, float]:
    """Full-batch L-BFGS (strong Wolfe) on a flat float64 vector; returns ``(w, iterations,
    final gradient max-norm)``."""
    w = w0.clone().requires_grad_(True)
    opt = torch.optim.LBFGS(
        [w],
        lr=1.0,
        max_iter=max_iter,
        tolerance_grad=tol,
        tolerance_change=0.0,
        history_size=50,
        line_search_fn="strong_wolfe",
    )

    def closure():
        opt.zero_grad()
        loss = fn(w)
        loss.backward()
        return loss

    opt.step(closure)
    g = torch.autograd.grad(fn(w), w)[0]
    iters = opt.state[opt._params[0]]["n_iter"]
    return w.detach(), int(iters), float(g.abs().max())


def _require_converged(what: str, w: Tensor, max_grad: float, limit: float) -> None:
    """Refuse (``RuntimeError`` naming ``what``) weights that are not finite or whose gradient
    max-norm is above ``limit``: the estimates assume a minimum and the comparison needs
    converged retrains, so such a run yields no numbers."""
    if not bool(torch.isfinite(w).all()) or not max_grad <= limit:
        raise RuntimeError(
            f"{what} did not converge (max |grad| {max_grad:.2e}, limit {limit:.0e}; finite "
            f"weights: {bool(torch.isfinite(w).all())}): no results written"
        )


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    xtr, ytr, xte, yte = load_mnist(args.data_root, download=False)
    x = xtr[: args.n_train].reshape(args.n_train, -1).double()
    y = ytr[: args.n_train]
    xt = xte[: args.n_test].reshape(args.n_test, -1).double()
    yt = yte[: args.n_test]
    torch.manual_seed(args.seed)
    net = nn.Sequential(nn.Linear(784, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 10))
    net = net.double().eval()
    obj = _objective(net, x, y, args.delta)
    t0 = time.perf_counter()
    w_star, iters, gmax = _minimise(obj, flat_params(net), args.max_iter, args.tol)
    train_time = time.perf_counter() - t0
    print(f"trained: {iters} L-BFGS iterations, max |grad| {gmax:.2e}", flush=True)
    _require_converged("training", w_star, gmax, args.max_grad)
    with torch.no_grad():
        for p, v in zip(net.parameters(), unflatten(net, w_star).values()):
            p.copy_(v)
    if args.posterior == "full":
        post = fit_laplace(net, (x, y), "categorical", args.delta, hessian_structure="full")
    else:
        post = fit_laplace(net, (x, y), "categorical", args.delta)
    mp = memory_perturbation(net, post, x, y)
    mp_full = memory_perturbation(net, post, x, y, covariance="full")
    mp_corr = memory_perturbation(net, post, x, y, covariance="full", correction=True)
    order = torch.argsort(mp.sensitivity, descending=True)
    chosen = torch.cat([order[: args.n_each], order[-args.n_each :]])
    # one Newton step on the leave-one-out objective: exact Hessian, network evaluated
    t0 = time.perf_counter()
    post_hess = FullGaussian(w_star, _hessian(obj, w_star))
    newton, step_hess = newton_step_loo(net, post_hess, x[chosen], y[chosen], return_steps=True)
    newton_lin = newton_step_loo(net, post_hess, x[chosen], y[chosen], linearize=True)
    if args.posterior == "full":
        newton_ggn, step_ggn = newton_step_loo(
            net, post, x[chosen], y[chosen], hess_approx="ggn", return_steps=True
        )
    else:
        newton_ggn = torch.full_like(newton, float("nan"))
        step_ggn = torch.full_like(step_hess, float("nan"))
    newton_time = time.perf_counter() - t0
    print(f"Newton-step estimates: {newton_time:.0f} s", flush=True)

    def test_nll(w: Tensor) -> float:
        with torch.no_grad():
            out = functional_call(net, unflatten(net, w), (xt,))
        return nn.functional.cross_entropy(out, yt).item()

    base_test = test_nll(w_star)
    params = unflatten(net, w_star)
    grads = torch.func.vmap(
        torch.func.grad(
            lambda p, xi, yi: nn.functional.cross_entropy(
                functional_call(net, p, (xi.unsqueeze(0),)), yi.unsqueeze(0)
            )
        ),
        in_dims=(None, 0, 0),
    )(params, x[chosen], y[chosen])
    flat_grads = torch.cat([g.reshape(len(chosen), -1) for g in grads.values()], 1)
    # largest eigenvalue of Lambda_i V_i (how far the corrected form is from first order)
    big_lam = get_likelihood("categorical").hessian(mp_full.logits[chosen])
    eig_lam_v = torch.linalg.eigvals(big_lam @ mp_full.covariance[chosen]).real.amax(-1)
    ggn_precision = post.precision if args.posterior == "full" else None

    def step_stats(est: Tensor, true_step: Tensor) -> dict[str, float]:
        return {
            "cosine": nn.functional.cosine_similarity(est, true_step, dim=0).item(),
            "length_ratio": (est.norm() / true_step.norm()).item(),
        }

    rows = []
    t0 = time.perf_counter()
    for k, i in enumerate(chosen.tolist()):
        keep = torch.arange(args.n_train) != i
        w_i, it_i, g_i = _minimise(
            _objective(net, x[keep], y[keep], args.delta), w_star, args.retrain_iter, args.tol
        )
        _require_converged(f"retraining without example {i}", w_i, g_i, args.max_grad)
        with torch.no_grad():
            f_loo = functional_call(net, unflatten(net, w_i), (x[i : i + 1],))[0]
        # first-order test-NLL change: removing i moves w by Sigma J_i^T e_i = Sigma g_i
        if args.posterior == "full":
            move = torch.cholesky_solve(flat_grads[k].unsqueeze(1), post.precision_cholesky)[:, 0]
        else:
            move = post.variance * flat_grads[k]
        shift = unflatten(net, move)
        f_t, df_t = jvp(lambda p: functional_call(net, p, (xt,)), (params,), (shift,))
        est_test = nn.functional.cross_entropy(f_t + df_t, yt).item()
        true_step = w_i - w_star
        _, lin_true = jvp(
            lambda p, xi=x[i : i + 1]: functional_call(net, p, (xi,)),
            (params,),
            (unflatten(net, true_step),),
        )
        diagnostics = {
            "max_eig_lambda_v": eig_lam_v[k].item(),
            "true_step_mahalanobis_ggn": (
                (true_step @ ggn_precision @ true_step).sqrt().item()
                if ggn_precision is not None
                else float("nan")
            ),
            # the linearised network at the retrained weights: its own error
            "true_step_linearised_nll": nn.functional.cross_entropy(
                mp.logits[i][None] + lin_true, y[i : i + 1]
            ).item(),
            "first_order_step": step_stats(move, true_step),
            "newton_ggn_step": step_stats(step_ggn[k], true_step),
            "newton_hessian_step": step_stats(step_hess[k], true_step),
        }
        rows.append(
            {
                "index": i,
                "group": "most" if k < args.n_each else "least",
                "sensitivity": mp.sensitivity[i].item(),
                "true_shift": (f_loo - mp.logits[i]).tolist(),
                "est_shift": (mp.loo_logits[i] - mp.logits[i]).tolist(),
                "est_shift_full": (mp_full.loo_logits[i] - mp.logits[i]).tolist(),
                "est_shift_corrected": (mp_corr.loo_logits[i] - mp.logits[i]).tolist(),
                "true_loo_nll": nn.functional.cross_entropy(f_loo[None], y[i : i + 1]).item(),
                "est_loo_nll": mp.loo_nll()[i].item(),
                "est_loo_nll_full": mp_full.loo_nll()[i].item(),
                "est_loo_nll_corrected": mp_corr.loo_nll()[i].item(),
                "est_shift_newton": (newton[k] - mp.logits[i]).tolist(),
                "est_shift_newton_linear": (newton_lin[k] - mp.logits[i]).tolist(),
                "est_shift_newton_ggn": (newton_ggn[k] - mp.logits[i]).tolist(),
                "est_loo_nll_newton": nn.functional.cross_entropy(
                    newton[k][None], y[i : i + 1]
                ).item(),
                "est_loo_nll_newton_linear": nn.functional.cross_entropy(
                    newton_lin[k][None], y[i : i + 1]
                ).item(),
                "est_loo_nll_newton_ggn": nn.functional.cross_entropy(
                    newton_ggn[k][None], y[i : i + 1]
                ).item(),
                "train_nll": mp.nll()[i].item(),
                "true_test_nll_change": test_nll(w_i) - base_test,
                "est_test_nll_change": est_test - base_test,
                "diagnostics": diagnostics,
                "lbfgs_iterations": it_i,
                "max_grad": g_i,
            }
        )
        if (k + 1) % 10 == 0 or args.verbose:
            print(
                f"retrained {k + 1}/{len(chosen)} ({it_i} iterations, max |grad| {g_i:.1e}, "
                f"{time.perf_counter() - t0:.0f} s)",
                flush=True,
            )
    retrain_time = time.perf_counter() - t0

    def l1(key: str) -> np.ndarray:
        return np.array([np.abs(r[key]).sum() for r in rows])

    true, est, est_full = l1("true_shift"), l1("est_shift"), l1("est_shift_full")
    est_corr = l1("est_shift_corrected")
    est_newton = l1("est_shift_newton")

    def mean_nll(key: str, group: str | None = None) -> float:
        return float(np.mean([r[key] for r in rows if group is None or r["group"] == group]))

    newton_rows = {
        name: {
            "loo_nll": mean_nll(key),
            "loo_nll_most_sensitive": mean_nll(key, "most"),
            "loo_nll_least_sensitive": mean_nll(key, "least"),
            "relative_error": abs(mean_nll(key) - mean_nll("true_loo_nll"))
            / mean_nll("true_loo_nll"),
            "spearman_logit_change": float(spearmanr(l1(shift), l1("true_shift")).statistic),
        }
        for name, key, shift in [
            ("newton_hessian_network", "est_loo_nll_newton", "est_shift_newton"),
            ("newton_hessian_linearised", "est_loo_nll_newton_linear", "est_shift_newton_linear"),
            ("newton_ggn_network", "est_loo_nll_newton_ggn", "est_shift_newton_ggn"),
        ]
    }
    est_nll_corr = np.mean([r["est_loo_nll_corrected"] for r in rows])
    true_nll = np.mean([r["true_loo_nll"] for r in rows])
    est_nll = np.mean([r["est_loo_nll"] for r in rows])
    est_nll_full = np.mean([r["est_loo_nll_full"] for r in rows])
    dt_true = np.array([r["true_test_nll_change"] for r in rows])
    dt_est = np.array([r["est_test_nll_change"] for r in rows])
    summary = {
        "spearman_logit_change": float(spearmanr(est, true).statistic),
        "spearman_logit_change_full_covariance": float(spearmanr(est_full, true).statistic),
        "spearman_logit_change_corrected": float(spearmanr(est_corr, true).statistic),
        "spearman_logit_change_most_sensitive_only": float(
            spearmanr(est[: args.n_each], true[: args.n_each]).statistic
        ),
        "pearson_logit_shift_entries": float(
            pearsonr(
                np.concatenate([r["est_shift"] for r in rows]),
                np.concatenate([r["true_shift"] for r in rows]),
            ).statistic
        ),
        "loo_nll_retrained": float(true_nll),
        "loo_nll_estimated": float(est_nll),
        "loo_nll_relative_error": float(abs(est_nll - true_nll) / true_nll),
        "loo_nll_estimated_full_covariance": float(est_nll_full),
        "loo_nll_estimated_corrected": float(est_nll_corr),
        "loo_nll_relative_error_corrected": float(abs(est_nll_corr - true_nll) / true_nll),
        "train_nll_of_retrained_examples": float(np.mean([r["train_nll"] for r in rows])),
        "spearman_test_nll_change": float(spearmanr(dt_est, dt_true).statistic),
        "loo_nll_retrained_most_sensitive": mean_nll("true_loo_nll", "most"),
        "loo_nll_retrained_least_sensitive": mean_nll("true_loo_nll", "least"),
        "newton_step": newton_rows,
        "true_step_linearised_loo_nll_most_sensitive": float(
            np.mean([r["diagnostics"]["true_step_linearised_nll"] for r in rows[: args.n_each]])
        ),
        "diagnostics_most_sensitive_medians": _diagnostic_medians(
            [r["diagnostics"] for r in rows if r["group"] == "most"]
        ),
        "diagnostics_least_sensitive_medians": _diagnostic_medians(
            [r["diagnostics"] for r in rows if r["group"] == "least"]
        ),
        "loo_summary_all_examples": mp.loo_summary(),
        "loo_summary_all_examples_corrected": mp_corr.loo_summary(),
    }
    print(json.dumps(summary, indent=2), flush=True)
    out = {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "num_params": int(w_star.numel()),
        "train": {"lbfgs_iterations": iters, "max_grad": gmax, "time_s": train_time},
        "retrain_time_s": retrain_time,
        "newton_step_time_s": newton_time,
        "targets": {"spearman": 0.8, "loo_nll_relative_error": 0.1},
        "summary": summary,
        "examples": rows,
    }
    _plot(true, est, est_corr, est_newton, args.n_each, summary, args.png)
    return out


def _diagnostic_medians(diags: list[dict[str, Any]]) -> dict[str, float]:
    """Medians (and ranges) over examples of the per-example diagnostics."""
    out: dict[str, float] = {}
    for key, value in diags[0].items():
        if isinstance(value, dict):
            for sub in value:
                out[f"{key}_{sub}"] = float(np.median([d[key][sub] for d in diags]))
        else:
            vals = [d[key] for d in diags]
            out[key] = float(np.median(vals))
            out[key + "_min"], out[key + "_max"] = float(np.min(vals)), float(np.max(vals))
    return out


def _plot(true, est, est_corr, est_newton, n_each, summary, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.8, 4.4))
    ax.scatter(true[:n_each], est[:n_each], s=14, c="tab:red", label="f + e ⊙ v, most sensitive")
    ax.scatter(true[n_each:], est[n_each:], s=14, c="tab:blue", label="f + e ⊙ v, least sensitive")
    ax.scatter(true, est_corr, s=8, marker="x", c="0.4", label="f + V (I − ΛV)⁻¹ e")
    ax.scatter(
        true, est_newton, s=10, marker="+", c="tab:green", label="Newton step (Hessian), network"
    )
    lo = max(min(true.min(), est.min()), 1e-8)
    hi = max(true.max(), est.max(), est_corr.max())
    ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("true leave-one-out change |Δf_i|₁ (retrained)")
    ax.set_ylabel("estimated |Δf_i|₁")
    newton = summary["newton_step"]["newton_hessian_network"]["loo_nll"]
    ax.set_title(
        f"MNIST MLP, {len(true)} retrained: LOO NLL {summary['loo_nll_retrained']:.3f}\n"
        f"estimated: f + e ⊙ v {summary['loo_nll_estimated']:.3f}, Newton step {newton:.3f}",
        fontsize=8,
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = harness.parser(__name__, __doc__)
    ap.add_argument("--data-root", type=Path, default=None)
    ap.add_argument("--n-train", type=int, default=1000)
    ap.add_argument("--n-test", type=int, default=2000)
    ap.add_argument("--n-each", type=int, default=50, help="most and least sensitive retrained")
    ap.add_argument("--hidden", type=int, default=8)
    ap.add_argument("--delta", type=float, default=10.0, help="prior precision (weight decay)")
    ap.add_argument(
        "--posterior",
        default="full",
        choices=("full", "diag"),
        help="Laplace-GGN posterior: full covariance (default) or diagonal",
    )
    ap.add_argument("--max-iter", type=int, default=3000, help="L-BFGS iterations, training")
    ap.add_argument("--retrain-iter", type=int, default=500, help="L-BFGS iterations, retrain")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--tol", type=float, default=1e-6, help="L-BFGS gradient tolerance")
    ap.add_argument(
        "--max-grad",
        type=float,
        default=1e-4,
        help="refuse the run if training or a retrain ends with a larger gradient max-norm",
    )
    harness.add_seed(ap)
    harness.add_threads(ap, 1)
    harness.add_out(ap, RESULTS / "sensitivity.json")
    ap.add_argument("--png", type=Path, default=RESULTS / "sensitivity.png")
    args = ap.parse_args(argv)
    harness.prepare_out(args.out)
    result = run(args)
    harness.write_record(args.out, result, module=__name__, argv=argv)
    return result


if __name__ == "__main__":
    main()
