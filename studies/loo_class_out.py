"""Leave a class out: predict how every test example's predicted probabilities change when all
training examples of one class are removed (:func:`fromp.memory.loo.last_layer_remove`: Newton's
method on the output layer, and its first step alone), and compare with retraining without
that class.

MNIST MLP (784-100-100-10), Adam with weight decay, a training subset. Retraining: (a) the
output layer alone, features fixed (what the estimate models), from the trained head, by
full-batch L-BFGS on the same objective; (b) the whole network from the trained weights for
``--epochs-retrain`` epochs of Adam. Reported: the Pearson correlation of the predicted and
the retrained changes of the probabilities ``[M, 10]`` over the test examples, and against
(a) less the change of refitting the head on all examples (Adam leaves the head short of
its optimum; the estimate, which treats the trained head as the optimum, excludes that).

    FROMP_DATA=... python -m studies.loo_class_out --classes 0,1,2 \\
        --out benchmarks/results/loo_class_out_mnist.json
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from fromp.memory.loo import last_layer_features, last_layer_remove
from studies import harness
from studies.loo_tracking import _load, _model


def _train(model, x, y, wd, epochs, seed):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=wd)
    for epoch in range(epochs):
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + epoch))
        model.train()
        for i in range(0, len(x), 128):
            b = perm[i : i + 128]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[b]), y[b]).backward()
            opt.step()
    return model.eval()


def _refit_head(model, x, y, delta, phi_eval):
    """Probabilities ``[M, C]`` at the features ``phi_eval`` of the output layer refitted on
    ``(x, y)`` with the features fixed: full-batch L-BFGS on ``sum nll + delta/2 |theta|^2``
    from the trained head (float64)."""
    phi, head = last_layer_features(model, x)
    new_head = nn.Linear(head.in_features, head.out_features)
    new_head.load_state_dict(head.state_dict())
    new_head.double()
    phi = phi.double()
    opt = torch.optim.LBFGS(new_head.parameters(), lr=1, max_iter=500,
                            tolerance_grad=1e-10, line_search_fn="strong_wolfe")  # fmt: skip

    def closure():
        opt.zero_grad()
        sq = sum(q.pow(2).sum() for q in new_head.parameters())
        loss = nn.functional.cross_entropy(new_head(phi), y, reduction="sum")
        loss = loss + 0.5 * delta * sq
        loss.backward()
        return loss

    for _ in range(3):
        opt.step(closure)
    with torch.no_grad():
        return torch.softmax(new_head(phi_eval.double()), -1).float()


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]).double())[0, 1])


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__name__, __doc__)
    harness.add_data_root(p)
    p.add_argument("--n-train", type=int, default=5000)
    p.add_argument("--n-test", type=int, default=2000)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--epochs-retrain", type=int, default=5)
    p.add_argument("--wd", type=float, default=1e-3)
    p.add_argument("--classes", default="0,1,2")
    harness.add_seed(p)
    harness.add_out(p)
    args = p.parse_args(argv)
    out = harness.prepare_out(args.out)
    x, y, xt, _ = _load(args.data_root)
    g = torch.Generator().manual_seed(args.seed)
    keep = torch.randperm(len(x), generator=g)[: args.n_train]
    x, y, xt = x[keep, None], y[keep], xt[: args.n_test, None]
    torch.manual_seed(args.seed)
    model = _train(_model("mlp"), x, y, args.wd, args.epochs, 0)
    delta = args.wd * len(x)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    phi_t, _ = last_layer_features(model, xt)
    all_refit = _refit_head(model, x, y, delta, phi_t)  # the head's own optimum, nothing removed
    rows = []
    for c in [int(v) for v in args.classes.split(",")]:
        remove = y == c
        before, after = last_layer_remove(model, x, y, remove, delta, xt)
        p0, pred = torch.softmax(before, -1), torch.softmax(after, -1) - torch.softmax(before, -1)
        one = torch.softmax(last_layer_remove(model, x, y, remove, delta, xt, steps=1)[1], -1)
        one = one - p0
        # (a) head alone retrained without the class, features fixed; and, to separate the
        # removal from the head's unfinished training, refitted on all examples
        head_change = _refit_head(model, x[~remove], y[~remove], delta, phi_t) - p0
        drift = all_refit - p0
        # (b) the whole network retrained from the trained weights without the class
        net = _model("mlp")
        net.load_state_dict(state)
        net = _train(net, x[~remove], y[~remove], args.wd, args.epochs_retrain, 100)
        with torch.no_grad():
            net_change = torch.softmax(net(xt), -1) - p0
        row = {
            "class": c,
            "n_removed": int(remove.sum()),
            "pearson_head_retrained": _pearson(pred, head_change),
            "pearson_network_retrained": _pearson(pred, net_change),
            "pearson_one_step_head_retrained": _pearson(one, head_change),
            "pearson_one_step_network_retrained": _pearson(one, net_change),
            "pearson_head_retrained_net_of_refit": _pearson(pred, head_change - drift),
            "mean_abs_change_head_refit_all": drift.abs().mean().item(),
            "mean_abs_change_predicted": pred.abs().mean().item(),
            "mean_abs_change_one_step": one.abs().mean().item(),
            "mean_abs_change_head_retrained": head_change.abs().mean().item(),
            "mean_abs_change_network_retrained": net_change.abs().mean().item(),
        }
        rows.append(row)
        print(
            f"class {c}: Pearson(predicted, head retrained) {row['pearson_head_retrained']:.3f}, "
            f"(predicted, network retrained) {row['pearson_network_retrained']:.3f}; one step "
            f"{row['pearson_one_step_head_retrained']:.3f} / "
            f"{row['pearson_one_step_network_retrained']:.3f}",
            flush=True,
        )
    payload = {
        "config": vars(args),
        "rows": rows,
    }
    harness.write_record(out, payload, module=__name__, argv=argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
