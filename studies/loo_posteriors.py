r"""Leave-one-out (corrected memory perturbation) of one task under several all-weights
Laplace-GGN posteriors built from the same per-example Jacobian rows (issue 29).

For an MLP of ``nn.Linear`` layers ``z_l = W_l u_l + b_l`` and the task's ``N`` training
examples, one pass stores per layer the inputs ``u_n [in]`` and the output gradients
``g_nc = d f_c / d z_l`` ``[C, out]``; with ``Lambda_n`` ``[C, C]`` the output Hessian, the
GGN of ``W_l`` is ``sum_n (G_n^T Lambda_n G_n) (x) u_n u_n^T``. Posteriors (prior ``delta I``,
one scalar ``delta`` chosen by the Laplace evidence on a log grid, block-diagonal across
layers, so the functional covariances add: ``V_n = sum_l V_n^(l)``):

* ``kron``: KFAC ``B (x) A`` (``A = (1/N) sum u u^T``, ``B = sum G^T Lambda G``), the bias
  its own exact block ``B`` (fromp's :mod:`fromp.curvature.kron` convention);
* ``ekfac``: KFAC's eigenbases ``Q_B, Q_A`` with the exact GGN diagonal in that basis,
  ``s_ij = sum_n (sum_cd gt_nci Lambda_ncd gt_ndi) ut_nj^2`` (``gt = G Q_B``, ``ut = Q_A^T u``;
  George et al. 2018), the bias as in ``kron``;
* ``mixed`` / ``mixed-ekfac``: the exact full GGN of the last layer (weight and bias jointly,
  ``[C (D+1)]^2``) and ``kron`` / ``ekfac`` blocks for the hidden layers;
* ``last``: the exact last layer alone (the other layers fixed), ``fromp-memorable --map``'s
  default ``last-layer-full``.

With the eigenvalues ``e`` of a block, its functional covariance is
``V_n[c, d] = sum_ij gt_nci gt_ndi ut_nj^2 / (e_ij + delta)`` (``O(N C out in)``), and the
evidence ``-sum_n nll_n - delta |theta|^2 / 2 + P log(delta) / 2 - sum log(e + delta) / 2``.

Usage (``OMP_NUM_THREADS=1 FROMP_DATA=...``)::

    python -m studies.loo_posteriors CHECKPOINT TASK [--variants kron,mixed,...]

prints one line per variant and, with ``--out FILE``, writes them as JSON.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from fromp_bench.cli import _load, _task
from torch import Tensor, nn

from fromp.curvature.capture import capture_calls
from fromp.likelihood import get_likelihood
from fromp.memory.loo import _corrected_loo
from fromp.models import with_task
from studies import harness

VARIANTS = ("last", "kron", "ekfac", "mixed", "mixed-ekfac")


def rows(model: nn.Module, x: Tensor, chunk: int = 500) -> tuple[Tensor, list, list]:
    """``f [N, C]``, the called ``Linear`` layers in call order and per layer ``(u [N, in],
    g [N, C, out])`` (float64)."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    fs, us, gs, order = [], None, None, None
    for s in range(0, len(x), chunk):
        with torch.enable_grad(), capture_calls(linears) as calls:
            f = model(x[s : s + chunk])
        order = [c.module for c in calls]
        zs = [c.z for c in calls]
        per = [[] for _ in calls]
        for c in range(f.shape[1]):
            v = torch.zeros_like(f)
            v[:, c] = 1
            for j, g in enumerate(torch.autograd.grad(f, zs, v, retain_graph=True)):
                per[j].append(g.detach().double())
        if us is None:
            us, gs = [[] for _ in calls], [[] for _ in calls]
        for j, c in enumerate(calls):
            us[j].append(c.a.reshape(len(c.a), -1).double())
            gs[j].append(torch.stack(per[j], 1))
        fs.append(f.detach().double())
    return torch.cat(fs), order, [(torch.cat(u), torch.cat(g)) for u, g in zip(us, gs)]


class Block:
    """One layer's posterior block: eigenvalues of its GGN and the data in its eigenbasis."""

    def __init__(self, kind: str, u: Tensor, g: Tensor, fit: tuple[Tensor, Tensor, Tensor]):
        """``u [N, in]``, ``g [N, C, out]``: the rows the covariances are wanted for;
        ``fit = (u', g', Lambda')``: those the curvature is summed over (with ``Lambda'``
        ``[N', C, C]``)."""
        self.kind = kind
        uf, gf, lam = fit
        if kind == "exact":  # last layer, weight and bias jointly
            phi_f = torch.cat([uf, uf.new_ones(len(uf), 1)], 1)  # [N', D1]
            c, d1 = g.shape[1], phi_f.shape[1]
            # J_n = I_C (x) phi_n^T (the last layer's z is f)
            ggn = torch.einsum("ncd,ni,nj->cidj", lam, phi_f, phi_f).reshape(c * d1, c * d1)
            self.e, self.q = torch.linalg.eigh(ggn)
            self.e = self.e.clamp_min(0)
            self.phi, self.c, self.d1 = torch.cat([u, u.new_ones(len(u), 1)], 1), c, d1
            return
        a = uf.T @ uf / len(uf)
        b = torch.einsum("nco,ncd,ndp->op", gf, lam, gf)
        la, qa = torch.linalg.eigh(a)
        lb, qb = torch.linalg.eigh(b)
        la, lb = la.clamp_min(0), lb.clamp_min(0)
        self.gt = g @ qb  # [N, C, out]
        self.ut2 = (u @ qa) ** 2  # [N, in]
        if kind == "kron":
            self.e = torch.outer(lb, la)
        else:  # ekfac: exact diagonal in the Kronecker eigenbasis
            gtf = gf @ qb
            h = torch.einsum("nci,ncd,ndi->ni", gtf, lam, gtf)
            self.e = h.T @ (uf @ qa) ** 2
        self.eb = lb  # bias block (exact: B, diagonal in Q_B)

    def logdet(self, delta: float) -> float:
        t = (self.e + delta).log().sum()
        if self.kind != "exact":
            t = t + (self.eb + delta).log().sum()
        return float(t)

    def size(self) -> int:
        return self.e.numel() + (0 if self.kind == "exact" else self.eb.numel())

    def cov(self, delta: float) -> Tensor:
        """``V_n`` ``[N, C, C]`` of this block."""
        if self.kind == "exact":
            sig = (self.q / (self.e + delta)) @ self.q.T
            sig = sig.reshape(self.c, self.d1, self.c, self.d1)
            return torch.einsum("ni,cidj,nj->ncd", self.phi, sig, self.phi)
        m = self.ut2 @ (1.0 / (self.e + delta)).T  # [N, out]
        m = m + 1.0 / (self.eb + delta)
        return torch.einsum("nci,ni,ndi->ncd", self.gt, m, self.gt)


def _fmt(d: float | list[float]) -> str:
    return f"{d:9.4f}" if isinstance(d, float) else str([round(t, 3) for t in d])


def _evidence(d: float, sq: float, blocks: list[Block]) -> float:
    """The Laplace evidence's ``delta``-dependent part for blocks of parameter norm ``sq``."""
    size = sum(b.size() for b in blocks)
    return -0.5 * d * sq + 0.5 * size * math.log(d) - 0.5 * sum(b.logdet(d) for b in blocks)


def _best(fn) -> float:
    """The maximiser of ``fn`` on a log grid of ``[1e-4, 1e5]`` refined to 1 %."""
    best = max(torch.logspace(-4, 5, 91).tolist(), key=fn)
    return max([best * 10 ** (k / 500) for k in range(-50, 51)], key=fn)


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__name__, __doc__)
    p.add_argument("checkpoint")
    p.add_argument("task", type=int)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--prior", choices=("scalar", "layerwise"), default="scalar")
    p.add_argument("--curvature", choices=("task", "all-tasks"), default="task",
                   help="sum each layer's GGN over the task's examples, or over every trained "
                   "task's examples that reach the layer (the shared trunk)")  # fmt: skip
    p.add_argument("--out", type=Path, help="where the JSON record goes (default: print only)")
    a = p.parse_args(argv)
    if a.out is not None:
        harness.prepare_out(a.out)
    torch.set_num_threads(1)
    ns = argparse.Namespace(checkpoint=a.checkpoint, data_root=None, task=a.task,
                            model=None, model_kwargs=None, benchmark=None)  # fmt: skip
    net, seq, cfg = _load(ns)
    task = _task(seq, a.task, cfg)
    model = with_task(net, task.task_id if seq.multi_head else None).eval()
    lik = get_likelihood("categorical")
    x, y = task.train_x, task.train_y
    with torch.no_grad():
        ft = model(task.test_x)
    tn = float(lik.nll(ft, task.test_y).mean())
    ta = float((ft.argmax(1) == task.test_y).double().mean())
    t0 = time.time()
    f, layers, data = rows(model, x)
    lam = lik.hessian(f)
    nll_sum = float(lik.nll(f, y.to(f.device)).sum())
    tr = nll_sum / len(x)
    print(f"task {a.task}: N {len(x)} test nll {tn:.4f} acc {100 * ta:.2f} train nll {tr:.4f} "
          f"layers {[tuple(m.weight.shape) for m in layers]} [{time.time() - t0:.0f}s]",
          flush=True)  # fmt: skip
    norms = [
        float(m.weight.detach().double().pow(2).sum() + m.bias.detach().double().pow(2).sum())
        for m in layers
    ]
    fits = [(u, g, lam) for u, g in data]
    if a.curvature == "all-tasks":
        fits = [([], [], []) for _ in data]
        for t in range(cfg.get("tasks_trained") or len(seq)):
            tt = seq[t]
            mt = with_task(net, tt.task_id if seq.multi_head else None).eval()
            ft_, lt, dt = rows(mt, tt.train_x)
            lam_t = lik.hessian(ft_)
            for j, m in enumerate(layers):
                if j < len(lt) and lt[j] is m:
                    fits[j][0].append(dt[j][0])
                    fits[j][1].append(dt[j][1])
                    fits[j][2].append(lam_t)
        fits = [tuple(torch.cat(z) for z in fj) for fj in fits]
        print(f"  curvature over {[len(fj[0]) for fj in fits]} examples per layer", flush=True)
    out = {"task": a.task, "n": len(x), "test_nll": tn, "test_accuracy": ta, "train_nll": tr,
           "rows": []}  # fmt: skip
    for v in a.variants.split(","):
        t0 = time.time()
        hidden = {"last": None, "kron": "kron", "ekfac": "ekfac", "mixed": "kron",
                  "mixed-ekfac": "ekfac"}[v]  # fmt: skip
        last = "exact" if v in ("last", "mixed", "mixed-ekfac") else hidden
        blocks, used = [], []
        for j, (u, g) in enumerate(data):
            kind = last if j == len(data) - 1 else hidden
            if kind is not None:
                blocks.append(Block(kind, u, g, fits[j]))
                used.append(j)
        if a.prior == "scalar":
            sq = sum(norms[j] for j in used)
            delta = _best(lambda d, sq=sq, bl=blocks: _evidence(d, sq, bl))
            deltas = [delta] * len(blocks)
        else:  # one delta per layer, each by its own (separable) term of the evidence
            deltas = [_best(lambda d, sq=norms[j], bl=[b]: _evidence(d, sq, bl))
                      for j, b in zip(used, blocks)]  # fmt: skip
            delta = deltas
        cov = sum(b.cov(d) for b, d in zip(blocks, deltas))
        mp = _corrected_loo(f, y.to(f.device), cov, lik, torch.float64)
        fu = f + torch.einsum("ncd,nd->nc", cov, mp.error)  # uncorrected: f + V e
        yy = y.to(f.device)
        for form, lf in (("corrected", mp.loo_logits), ("one-step", fu)):
            nll = float(lik.nll(lf, yy).mean())
            acc = float((lf.argmax(1) == yy).double().mean())
            row = {
                "posterior": v,
                "loo_form": form,
                "prior_precision": delta,
                "loo_nll": nll,
                "loo_accuracy": acc,
                "nll_ratio_loo_over_test": nll / tn,
                "loo_over_train_nll": nll / tr,
                "accuracy_gap_points": 100 * (acc - ta),
            }
            out["rows"].append(row)
            print(f"  {v:12s} {form:9s} delta {_fmt(delta)} loo {nll:.4f} ({nll / tn:.2f}x test,"
                  f" {nll / tr:.2f}x train) acc {100 * acc:.2f} (gap {100 * (acc - ta):+.2f})"
                  f" [{time.time() - t0:.0f}s]", flush=True)  # fmt: skip
    if a.out:
        harness.write_record(a.out, out, module=__name__, argv=argv, indent=1)


if __name__ == "__main__":
    main()
