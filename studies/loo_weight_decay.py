"""Weight decay without a validation set: choose it by the leave-one-out estimate, by the
Laplace evidence or by a validation split, and compare the test NLL each choice reaches.

MNIST MLP (784-100-100-10), Adam, a training subset; for each weight decay of the grid the
network is trained on the training examples minus a held-out validation split, then

* LOO: the last-layer leave-one-out NLL (:func:`fromp.memory.loo.last_layer_loo`, delta =
  weight decay x N) of the training examples;
* evidence: the diagonal Laplace-GGN log evidence at that delta
  (:func:`fromp.laplace.log_marginal_likelihood`);
* validation: the NLL of the held-out split;

and each criterion picks one weight decay; the test NLL and accuracy of the picked networks
are reported.

    FROMP_DATA=... python -m studies.loo_weight_decay \\
        --out benchmarks/results/loo_weight_decay_mnist.json
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from fromp.laplace.one_call import log_marginal_likelihood
from fromp.memory.loo import last_layer_loo
from studies import harness
from studies.loo_tracking import _load, _model, _test


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__name__, __doc__)
    harness.add_data_root(p)
    p.add_argument("--n-train", type=int, default=5000)
    p.add_argument("--n-valid", type=int, default=1000)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--grid", default="1e-5,1e-4,1e-3,3e-3,1e-2,3e-2")
    harness.add_seed(p)
    harness.add_out(p)
    args = p.parse_args(argv)
    out = harness.prepare_out(args.out)
    x, y, xt, yt = _load(args.data_root)
    g = torch.Generator().manual_seed(args.seed)
    keep = torch.randperm(len(x), generator=g)[: args.n_train + args.n_valid]
    tr, va = keep[: args.n_train], keep[args.n_train :]
    xtr, ytr, xva, yva = x[tr, None], y[tr], x[va, None], y[va]
    xte, yte = xt[:, None], yt
    rows = []
    for wd in [float(v) for v in args.grid.split(",")]:
        torch.manual_seed(args.seed)
        model = _model("mlp")
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=wd)
        for epoch in range(args.epochs):
            perm = torch.randperm(len(xtr), generator=torch.Generator().manual_seed(epoch))
            model.train()
            for i in range(0, len(xtr), 128):
                b = perm[i : i + 128]
                opt.zero_grad()
                nn.functional.cross_entropy(model(xtr[b]), ytr[b]).backward()
                opt.step()
        model.eval()
        delta = wd * len(xtr)
        loo = last_layer_loo(model, xtr, ytr, delta).perturbation.loo_summary()
        evidence = float(log_marginal_likelihood(model, (xtr, ytr), "categorical", delta))
        valid_nll, valid_acc = _test(model, xva, yva)
        test_nll, test_acc = _test(model, xte, yte)
        rows.append(
            {"weight_decay": wd, "prior_precision": delta, "loo_nll": loo["loo_nll"],
             "loo_accuracy": loo["loo_accuracy"], "train_nll": loo["train_nll"],
             "log_evidence": evidence, "valid_nll": valid_nll, "valid_accuracy": valid_acc,
             "test_nll": test_nll, "test_accuracy": test_acc}
        )  # fmt: skip
        print(
            f"wd {wd:g}: LOO {loo['loo_nll']:.4f}, evidence {evidence:.1f}, valid "
            f"{valid_nll:.4f}, test {test_nll:.4f} ({100 * test_acc:.2f} %)",
            flush=True,
        )
    picks = {
        "loo": min(rows, key=lambda r: r["loo_nll"]),
        "evidence": max(rows, key=lambda r: r["log_evidence"]),
        "validation": min(rows, key=lambda r: r["valid_nll"]),
    }
    chosen = {
        k: {"weight_decay": r["weight_decay"], "test_nll": r["test_nll"],
            "test_accuracy": r["test_accuracy"]}
        for k, r in picks.items()
    }  # fmt: skip
    ratio = chosen["loo"]["test_nll"] / chosen["validation"]["test_nll"]
    payload = {
        "config": vars(args),
        "rows": rows,
        "chosen": chosen,
        "loo_over_validation_test_nll": ratio,
    }
    harness.write_record(out, payload, module=__name__, argv=argv)
    for k, c in chosen.items():
        print(
            f"{k:10s}: weight decay {c['weight_decay']:g}, test NLL {c['test_nll']:.4f}, "
            f"accuracy {100 * c['test_accuracy']:.2f} %"
        )
    print(f"LOO-chosen test NLL / validation-chosen: {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
