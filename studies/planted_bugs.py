"""Planted bugs: does the test suite catch realistic mistakes in the maths?

Each :class:`Bug` is one exact text substitution in one file of ``fromp/`` or
``strategies/`` (a wrong sign, a dropped factor, a transposed factor, the wrong head, an
off-by-one chunk, state not restored, ...) together with the tests that should catch it. For
every bug the study copies the tree to a temporary directory (the working tree is never
written), checks that the substitution applies exactly once (a refactor that moved the code
is reported as ``not_applied``, never skipped silently), runs the named tests with
``pytest -x -q`` on the mutated copy and records ``caught`` (a test failed), ``missed``
(they all passed), ``error`` (pytest could not run them: a collection error or no test
selected) or ``timeout``. Before the bugs, the union of all the named tests runs once on
the unmutated copy (``baseline``): a selection that fails without a bug would make every
"caught" meaningless, so then the study stops.

    nice -n 5 python -m studies.planted_bugs --out benchmarks/results/planted_bugs.json

``--only NAME[,NAME]`` runs some bugs; ``--list`` prints them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from studies import harness

ROOT = Path(__file__).resolve().parents[1]
#: what a mutated copy needs: the packages, the tests and the project's configuration
PARTS = ("fromp", "strategies", "benchmarks", "tests", "pyproject.toml")
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", "results", "data")


@dataclass(frozen=True)
class Bug:
    """One planted bug: replace ``old`` by ``new`` (exactly once) in ``file`` (a path
    relative to the tree's root); ``tests`` are pytest node ids or files that should fail."""

    name: str
    kind: str
    what: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


class MutationError(ValueError):
    """The substitution does not apply exactly once (the code it targets has changed)."""


def apply(root: Path, bug: Bug) -> str:
    """Apply ``bug`` under ``root``; returns the original text of the file. Raises
    :class:`MutationError` when ``old`` occurs other than once or the file is missing."""
    path = root / bug.file
    if not path.is_file():
        raise MutationError(f"{bug.name}: {bug.file} does not exist")
    text = path.read_text()
    count = text.count(bug.old)
    if count != 1:
        raise MutationError(f"{bug.name}: the text to replace occurs {count} times in {bug.file}")
    path.write_text(text.replace(bug.old, bug.new))
    return text


def copy_tree(src: Path, dst: Path, parts: Iterable[str] = PARTS) -> Path:
    """Copy ``parts`` of ``src`` (those that exist) into ``dst`` without caches or results."""
    for part in parts:
        p = src / part
        if p.is_dir():
            shutil.copytree(p, dst / part, ignore=_IGNORE)
        elif p.is_file():
            shutil.copy2(p, dst / part)
    return dst


def run_tests(
    root: Path, tests: Sequence[str], timeout: float, python: str = sys.executable
) -> tuple[str, float, str]:
    """Run ``pytest -x -q tests`` in ``root`` (its packages first on the path, no bytecode
    written); returns ``(outcome, seconds, first failing test or last output line)`` with
    outcome ``"failed"`` (exit 1), ``"passed"`` (0), ``"timeout"`` or ``"error"``."""
    names = harness.import_names_dir(root, Path(root) / ".import-names")
    env = {
        **os.environ,
        "PYTHONPATH": f"{root}{os.pathsep}{names}",
        "PYTHONDONTWRITEBYTECODE": "1",
        "OMP_NUM_THREADS": "1",
    }
    cmd = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - t0, f"over {timeout:g} s"
    seconds = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    failed = re.findall(r"^FAILED (\S+)", out, flags=re.M)
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    detail = failed[0] if failed else (lines[-1] if lines else "")
    outcome = {0: "passed", 1: "failed"}.get(proc.returncode, "error")
    return outcome, seconds, detail


def run_bugs(
    bugs: Sequence[Bug],
    src: Path = ROOT,
    *,
    parts: Iterable[str] = PARTS,
    timeout: float = 600.0,
    baseline: bool = True,
    python: str = sys.executable,
    log=print,
) -> dict[str, Any]:
    """Run every bug in one temporary copy of ``src`` (each file restored after its bug);
    returns ``{"baseline": ..., "bugs": [...], "caught": k, "total": n}``."""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="planted-") as tmp:
        root = copy_tree(src, Path(tmp), parts)
        base: dict[str, Any] | None = None
        if baseline:
            union = list(dict.fromkeys(t for b in bugs for t in b.tests))
            outcome, seconds, detail = run_tests(root, union, timeout * 3, python)
            base = {"outcome": outcome, "seconds": round(seconds, 1), "detail": detail}
            log(f"baseline: {outcome} in {seconds:.0f} s")
            if outcome != "passed":
                return {"baseline": base, "bugs": [], "caught": 0, "total": len(bugs)}
        for bug in bugs:
            row: dict[str, Any] = asdict(bug)
            row["tests"] = list(bug.tests)
            try:
                original = apply(root, bug)
            except MutationError as err:
                row.update(outcome="not_applied", seconds=0.0, detail=str(err))
                rows.append(row)
                log(f"{bug.name}: not applied ({err})")
                continue
            try:
                outcome, seconds, detail = run_tests(root, bug.tests, timeout, python)
            finally:
                (root / bug.file).write_text(original)
            result = {"failed": "caught", "passed": "missed"}.get(outcome, outcome)
            row.update(outcome=result, seconds=round(seconds, 1), detail=detail)
            rows.append(row)
            log(f"{bug.name}: {result} in {seconds:.0f} s ({detail})")
    caught = sum(r["outcome"] == "caught" for r in rows)
    return {"baseline": base, "bugs": rows, "caught": caught, "total": len(bugs)}


def _b(name: str, kind: str, what: str, file: str, old: str, new: str, *tests: str) -> Bug:
    return Bug(name, kind, what, file, old, new, tuple(tests))


T = "tests/"
# fmt: off
BUGS: tuple[Bug, ...] = (
    # ---------------------------------------------------------------- likelihoods
    _b("softmax_lambda_missing_ppT", "dropped term", "softmax Λ = diag(p), the −ppᵀ dropped",
       "fromp/likelihood.py",
       "return torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)",
       "return torch.diag_embed(p)",
       T + "core/test_likelihood.py::test_hessian_and_sqrt_match_autograd"),
    _b("gaussian_lambda_sigma_not_squared", "dropped factor", "Gaussian Λ = I/σ, not I/σ²",
       "fromp/likelihood.py",
       "return eye.expand(len(f), -1, -1) / self.sigma**2",
       "return eye.expand(len(f), -1, -1) / self.sigma",
       T + "core/test_likelihood.py::test_hessian_and_sqrt_match_autograd"),
    _b("bernoulli_lambda_p", "dropped factor", "Bernoulli Λ = p, the (1 − p) dropped",
       "fromp/likelihood.py",
       "return (p * (1 - p)).unsqueeze(-1)",
       "return p.unsqueeze(-1)",
       T + "core/test_likelihood.py::test_hessian_and_sqrt_match_autograd"),
    _b("softmax_root_transposed", "transposed factor", "softmax Λ^½ = diag(s) − s pᵀ (transposed)",
       "fromp/likelihood.py",
       "return torch.diag_embed(s) - p.unsqueeze(-1) * s.unsqueeze(-2)",
       "return torch.diag_embed(s) - s.unsqueeze(-1) * p.unsqueeze(-2)",
       T + "core/test_likelihood.py::test_hessian_and_sqrt_match_autograd"),
    _b("probit_scale_dropped", "dropped factor", "probit 1/√(1 + v), the π/8 dropped",
       "fromp/link.py",
       "torch.rsqrt(1 + PROBIT_SCALE * torch.diagonal(var, dim1=-2, dim2=-1))",
       "torch.rsqrt(1 + torch.diagonal(var, dim1=-2, dim2=-1))",
       T + "gp/test_process.py::test_predictive_classification",
       T + "core/test_link.py::test_probit_scale_is_one_over_sqrt_one_plus_pi_over_8_var",
       T + "core/test_link.py::test_laplace_probit_predictive_against_the_dense_glm"),
    # ---------------------------------------------------------------- models and the GP
    _b("wrong_head", "wrong head", "an int task always goes to head 0",
       "fromp/models.py",
       "return self.heads[task](h)",
       "return self.heads[0](h)",
       T + "core/test_models.py::test_heads_are_selected_by_task"),
    _b("gp_last_chunk_dropped", "off-by-one chunk", "GP chunks range(0, n − 1, step)",
       "fromp/gp/process.py",
       "return [slice(s, min(s + step, n)) for s in range(0, n, step)]",
       "return [slice(s, min(s + step, n)) for s in range(0, n - 1, step)]",
       T + "gp/test_process.py::test_kernel_matches_dense_at_posterior_mean"),
    # ---------------------------------------------------------------- Kronecker factors
    _b("kron_input_factor_wrong_count", "wrong normaliser",
       "KFAC A divided by all examples, not those that reached the layer",
       "fromp/curvature/kron.py",
       "a = a.detach().div_(max(k, 1))",
       "a = a.detach().div_(max(n, 1))",
       T + "curvature/test_kron_routing.py"),
    _b("kron_conv_positions_summed", "dropped factor",
       "KFAC A of a conv sums the L positions instead of averaging them",
       "fromp/curvature/kron.py",
       "a_sum[i].addmm_(u2.T, u2, alpha=1.0 / u.shape[1])",
       "a_sum[i].addmm_(u2.T, u2, alpha=1.0)",
       T + "curvature/test_kron.py::test_one_example_kfac_and_norm_diagonal_against_dense",
       T + "laplace/test_structures_kron_eigenbasis.py"),
    _b("kron_rotation_QB_not_transposed", "transposed factor", "Q_B M Q_A for Q_Bᵀ M Q_A",
       "fromp/curvature/kron.py",
       "return self.qb[i].T @ m @ self.qa[i]",
       "return self.qb[i] @ m @ self.qa[i]",
       T + "laplace/test_structures_kron_eigenbasis.py"),
    # ---------------------------------------------------------------- Laplace
    _b("laplace_temperature_twice", "applied twice", "classification curvature divided by T²",
       "fromp/laplace/base.py",
       "else 1.0 / self.temperature\n",
       "else 1.0 / self.temperature**2\n",
       T + "laplace/test_checks_properties.py::test_evidence_is_the_dense_formula"),
    _b("prior_precision_per_tensor_reversed", "broadcast wrong",
       "per-tensor δ assigned to the tensors in reverse order",
       "fromp/laplace/base.py",
       "return torch.repeat_interleave(d, torch.tensor(self.sizes, device=d.device))",
       "return torch.repeat_interleave(d.flip(0), torch.tensor(self.sizes, device=d.device))",
       T + "laplace/test_one_call_fit.py::"
         "test_evidence_matches_dense_for_scalar_layer_and_parameter_delta"),
    _b("log_det_ratio_sign", "wrong sign", "log det P + log det D in the evidence",
       "fromp/laplace/base.py",
       "return self._log_det_posterior(delta, factor) - self._delta_vector(delta).log().sum()",
       "return self._log_det_posterior(delta, factor) + self._delta_vector(delta).log().sum()",
       T + "laplace/test_checks_properties.py::test_evidence_is_the_dense_formula",
       T + "laplace/test_one_call_fit.py::"
         "test_evidence_matches_dense_for_scalar_layer_and_parameter_delta"),
    _b("scatter_ignores_prior_mean", "dropped term", "(θ − m0)ᵀ D (θ − m0) with m0 dropped",
       "fromp/laplace/base.py",
       "return (self._delta_vector(d) * (self._mu - self.prior_mean) ** 2).sum()",
       "return (self._delta_vector(d) * self._mu**2).sum()",
       T + "laplace/test_checks_properties.py::test_evidence_is_the_dense_formula"),
    _b("evidence_half_dropped", "dropped factor", "log p(D) − (scatter + log det), the ½ dropped",
       "fromp/laplace/base.py",
       "return ll - 0.5 * (",
       "return ll - (",
       T + "laplace/test_checks_properties.py::test_evidence_is_the_dense_formula"),
    # ---------------------------------------------------------------- optimizers
    _b("ivon_bias_correction", "bias correction", "IVON's 1 − β1ᵗ written 1 − β1",
       "fromp/optim/ivon.py",
       "bc1 = 1 - b1**t",
       "bc1 = 1 - b1",
       T + "optim/test_ivon.py::test_update_matches_formulas_by_hand"),
    _b("vogn_bias_correction_off_by_one", "bias correction", "VOGN's s / (1 − β2^(t+1))",
       "fromp/optim/vogn.py",
       'return 1.0 / (1.0 - beta2 ** st["step"])',
       'return 1.0 / (1.0 - beta2 ** (st["step"] + 1))',
       T + "optim/test_vogn.py::test_vogn_ggn_linear_regression_mean_and_precision",
       T + "optim/test_vogn.py::test_one_step_formula_and_regulariser_only_in_gradient"),
    _b("vogn_prior_without_kl_weight", "dropped factor", "VOGN's δ~ = δ/N, kl_weight dropped",
       "fromp/optim/vogn.py",
       'st["prior_precision"] * (key[1] / key[0])',
       'st["prior_precision"] * (1.0 / key[0])',
       T + "optim/test_vogn.py::test_ogn_ggn_recovers_exact_posterior_of_linear_regression"),
    # ---------------------------------------------------------------- memory perturbation
    _b("loo_sign", "wrong sign", "leave-one-out outputs f − V e",
       "fromp/memory/sensitivity.py",
       "loo_logits=f + shift,",
       "loo_logits=f - shift,",
       T + "memory/test_sensitivity.py::test_every_quantity_against_dense"),
    _b("loo_correction_sign", "wrong sign", "corrected diagonal LOO divides by 1 + λv",
       "fromp/memory/sensitivity.py",
       "denom = 1 - lam * var",
       "denom = 1 + lam * var",
       T + "memory/test_sensitivity.py::test_every_quantity_against_dense",
       T + "memory/test_sensitivity.py::"
         "test_leave_one_out_matches_exact_retraining_to_first_order"),
    _b("last_layer_loo_sign", "wrong sign", "closed-form last-layer LOO f − V (I − ΛV)⁻¹ e",
       "fromp/memory/loo.py",
       'loo = f + torch.einsum("ncd,nd->nc", cov, rhs)',
       'loo = f - torch.einsum("ncd,nd->nc", cov, rhs)',
       T + "memory/test_loo.py::test_softmax_regression_against_dense_hessian_and_retraining"),
    # ---------------------------------------------------------------- FROMP
    _b("fromp_penalty_half_dropped", "dropped factor", "R = rᵀK⁻¹r, the ½ dropped",
       "fromp/continual/regularizer.py",
       "pen = 0.5 * (z * z).sum()",
       "pen = (z * z).sum()",
       T + "continual/test_regularizer.py::test_penalty_gradient_equals_brute_force_multihead",
       T + "continual/test_regularizer.py::test_penalty_single_head_plain_module"),
    _b("fromp_joint_kernel_example_major", "transposed factor",
       "joint kernel flattened example-major, residuals class-major",
       "fromp/continual/regularizer.py",
       "return k.permute(1, 0, 3, 2).reshape(1, c * m, c * m)",
       "return k.reshape(1, m * c, m * c)",
       T + "continual/test_regularizer.py::test_stored_kernel_equals_dense"),
    _b("fromp_jitter_on_every_entry", "wrong axis",
       "jitter added to every entry of K, not its diagonal",
       "fromp/continual/regularizer.py",
       "chol, info = torch.linalg.cholesky_ex(k + self.jitter * eye)",
       "chol, info = torch.linalg.cholesky_ex(k + self.jitter)",
       T + "continual/test_regularizer.py::test_stored_kernel_equals_dense",
       T + "continual/test_regularizer.py::test_jitter_warning_and_failure"),
    _b("memorable_order_reversed", "order reversed", "the smallest tr Λ kept, not the largest",
       "fromp/continual/memorable.py",
       'descending = order != "ascending"',
       'descending = order == "ascending"',
       T + "continual/test_memorable.py::test_selection_matches_brute_force_sort"),
    _b("bn_statistics_not_restored", "state not restored",
       "batch-norm buffers swapped in for the penalty are never swapped back",
       "fromp/continual/named_state.py",
       "            mod._buffers[attr] = old\n",
       "            pass  # the original buffer is not put back\n",
       T + "continual/test_fromp_batchnorm.py::"
         "test_penalty_never_writes_running_buffers_nor_the_mode"),
    _b("fromp_tau_twice", "applied twice", "the method adds τ² R to the loss",
       "fromp/continual/methods.py",
       "                weighted = self.tau * pen.to(dtype) if penalised else None\n"
       "                summed = None",
       "                weighted = self.tau * self.tau * pen.to(dtype) if penalised else None\n"
       "                summed = None",
       T + "strategies/test_fromp_class_incremental.py::"
         "test_penalty_matches_dense_float64_after_tasks_2_and_3",
       T + "continual/test_protocol.py::test_fromp_loss_terms_are_the_weighted_closed_forms"),
    _b("coreset_weight_sets_not_counted", "dropped factor",
       "class-incremental coreset weight b_s = N_s / M_s, the 1 / S dropped",
       "fromp/continual/methods.py",
       "            b = (sizes / (len(mem) * points)).to(device)\n",
       "            b = (sizes / points).to(device)\n",
       T + "continual/test_fromp_ci_defaults.py::test_coreset_weights_follow_the_experiences_sizes",
       T + "continual/test_protocol.py::"
         "test_fromp_class_incremental_defaults_plain_loop_equals_the_strategy"),
    _b("coreset_drawn_by_default", "wrong branch",
       "the default class-incremental coreset loss drawn (ceil(B / S) per set), not exact",
       "fromp/continual/methods.py",
       "        if not isinstance(self._memory_batch, int) or not len(self.regularizer):\n"
       "            return None\n"
       "        return -(-self._memory_batch // len(self.regularizer))\n",
       "        n = self._batch or self.n_points  # memory_batch ignored: always drawn\n"
       "        if not len(self.regularizer):\n"
       "            return None\n"
       "        return -(-n // len(self.regularizer))\n",
       T + "continual/test_fromp_ci_defaults.py::"
         "test_the_default_replays_every_stored_point_exactly_and_an_int_draws",
       T + "continual/test_protocol.py::"
         "test_fromp_class_incremental_defaults_plain_loop_equals_the_strategy"),
    _b("per_point_kernel_diagonal_only", "dropped term",
       "the per-point kernel keeps each point's output variances, not their covariances",
       "fromp/continual/regularizer.py",
       "            return gp.variance(x, method=method)\n",
       "            v = gp.variance(x, method=method)\n"
       "            return torch.diag_embed(torch.diagonal(v, 0, 1, 2))\n",
       T + "continual/test_regularizer.py::test_stored_kernel_equals_dense",
       T + "continual/test_fromp_ci_defaults.py::"
         "test_penalty_on_the_first_points_of_each_set_matches_dense_float64"),
    _b("per_point_kernel_by_default_on_probs", "wrong branch",
       "kernel='auto' takes the per-point kernel with the probabilities (singular blocks)",
       "fromp/continual/methods.py",
       'per_point = self.class_incremental and self.regularizer.function == "logits"',
       "per_point = self.class_incremental",
       T + "continual/test_fromp_ci_defaults.py::"
         "test_replay_turned_off_is_named_once_at_the_start_of_each_experience_with_new_classes"),
    _b("graph_key_misses_set_weights", "state not updated",
       "the captured FROMP term keeps stale coreset weights b_s (not in its key)",
       "fromp/continual/methods.py",
       "self.tau, self.replay, self.replay_weight, Same(weights), self.bn_statistics,",
       "self.tau, self.replay, self.replay_weight, self.bn_statistics,",
       T + "continual/test_graphed.py::"
         "test_class_incremental_defaults_are_captured_with_their_set_weights_in_the_key"),
    # ---------------------------------------------------------------- EWC
    _b("ewc_penalty_batch_dropped", "dropped factor",
       "EWC penalty (λ / B) Σ F (w − w*)² on Avalanche's scale, the 1/B dropped",
       "fromp/continual/ewc.py",
       "self._coefficient = self.ewc_lambda / self.batch_size",
       "self._coefficient = self.ewc_lambda",
       T + "strategies/test_ewc.py::test_minibatch_fisher_and_penalty_equal_avalanche_ewc"),
    _b("ewc_fisher_not_averaged", "dropped factor", "EWC Fisher summed, the 1/N dropped",
       "fromp/continual/ewc.py",
       "return f / count",
       "return f",
       T + "continual/test_ewc.py::test_fisher_matches_per_example_loop"),
    _b("ewc_online_anchor_not_updated", "state not updated",
       "online EWC keeps the first task's anchor",
       "fromp/continual/ewc.py",
       "self.anchors = [w]",
       "self.anchors = self.anchors[:1] or [w]",
       T + "continual/test_ewc.py::test_penalty_value_and_online_accumulation",
       T + "continual/test_ewc_consolidated.py",
       T + "core/test_link.py::"
       "test_online_ewc_anchors_at_the_last_task_and_sums_decayed_fishers_against_dense"),
)
# fmt: on


def main(argv: Sequence[str] | None = None) -> None:
    p = harness.parser(__name__, __doc__)
    harness.add_out(p, harness.RESULTS / "planted_bugs.json")
    p.add_argument("--only", default=None, help="comma-separated bug names")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per bug")
    p.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    p.add_argument("--list", action="store_true", help="print the bugs and exit")
    args = p.parse_args(argv)
    if args.list:
        for b in BUGS:
            print(f"{b.name:40s} {b.file}: {b.what}")
        return
    bugs = list(BUGS)
    if args.only:
        names = [n for n in args.only.split(",") if n]
        unknown = sorted(set(names) - {b.name for b in BUGS})
        if unknown:
            raise SystemExit(f"--only: unknown bug names {unknown}")
        bugs = [b for b in BUGS if b.name in names]
    out = harness.prepare_out(args.out)
    result = run_bugs(bugs, timeout=args.timeout, baseline=not args.no_baseline)
    if args.only and out.is_file():
        result = merge(json.loads(out.read_text()), result, harness.command(__name__, argv))
    harness.write_record(out, result, module=__name__, argv=argv)
    print(f"caught {result['caught']} of {result['total']}")


def merge(previous: dict[str, Any], rerun: dict[str, Any], command: str) -> dict[str, Any]:
    """A rerun of some bugs (``--only``) folded into the previous record of the whole list:
    their rows replaced, the count recomputed, the earlier outcome of each kept under
    ``reruns`` (with the rerun's command and baseline), the previous command kept as
    ``first_command``."""
    rows = {r["name"]: r for r in previous["bugs"]}
    before = {r["name"]: rows[r["name"]]["outcome"] for r in rerun["bugs"] if r["name"] in rows}
    rows.update({r["name"]: r for r in rerun["bugs"]})
    order = [b.name for b in BUGS if b.name in rows]
    bugs = [rows[n] for n in order]
    return {
        "first_command": previous.get("first_command", previous.get("command")),
        "baseline": previous.get("baseline"),
        "bugs": bugs,
        "caught": sum(r["outcome"] == "caught" for r in bugs),
        "total": len(bugs),
        "reruns": [
            *previous.get("reruns", []),
            {"command": command, "baseline": rerun["baseline"], "before": before},
        ],
    }


if __name__ == "__main__":
    main()
