"""``FROMPMethod(curvature_combine="mean")``: ``Sigma = 1 / ((1/E) sum_e G_e + delta)``
after ``E`` experiences, against dense float64 GGNs and kernels after tasks 1, 2 and 3
(weights moved in between, as training does); the Kronecker posterior's mean; resume;
refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fromp import FROMPMethod
from fromp.likelihood import CategoricalLikelihood
from fromp.models import MultiHeadMLP
from fromp.testing import dense_ggn, dense_jacobian

F64 = torch.float64


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(F64).eval()


def _tasks() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three tasks of 6, 9 and 7 examples, every class in each, inputs shifted per task."""
    g = torch.Generator().manual_seed(1)
    out = []
    for t, n in enumerate((6, 9, 7)):
        x = torch.randn(n, 4, generator=g, dtype=F64) + t
        y = torch.arange(n) % 3
        out.append((x, y))
    return out


def _perturb(net: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _kernel_of(method: FROMPMethod, i: int) -> torch.Tensor:
    mem = method.regularizer.memories[i]
    eye = torch.eye(mem.chol.shape[-1], dtype=mem.chol.dtype)
    return mem.chol @ mem.chol.transpose(-1, -2) - mem.jitter * eye


def _method(combine: str, **kw) -> FROMPMethod:
    kw.setdefault("prior_precision", 0.5)
    return FROMPMethod(tau=1.0, n_points=3, function="logits", curvature_examples=None,
                       curvature_combine=combine, **kw)  # fmt: skip


@pytest.mark.parametrize(("combine", "exponent"), [("mean", 1.0), (0.5, 0.5)])
def test_combined_posterior_and_kernels_after_tasks_one_two_three_equal_dense_references(
    combine, exponent
):
    """``Sigma`` is ``1 / (E^(-a) sum_e diag(G_e) + delta)`` (``a = 1``: the mean), with
    each ``G_e`` the dense GGN at the weights of the end of experience ``e``, and every
    stored logits kernel is ``J_c Sigma J_c^T`` at the current weights; the sum's ``Sigma``
    is checked beside it. Dividing by the experiences before the new one (an off-by-one),
    dividing ``delta`` too, ignoring the exponent or keeping the sum fails this."""
    net, delta = _net(), 0.5
    mean, total = _method(combine), _method("sum")
    lik = CategoricalLikelihood()
    diags = []
    for t, (x, y) in enumerate(_tasks()):
        diags.append(torch.diagonal(dense_ggn(net, x, lik)))
        mean.learn_task(net, x, y, None)
        total.learn_task(net, x, y, None)
        want = 1.0 / (torch.stack(diags).sum(0) / (t + 1) ** exponent + delta)
        torch.testing.assert_close(mean.posterior_variance(net), want, rtol=1e-10, atol=0)
        want_sum = 1.0 / (torch.stack(diags).sum(0) + delta)
        torch.testing.assert_close(total.posterior_variance(net), want_sum, rtol=1e-10, atol=0)
        for i, mem in enumerate(mean.regularizer.memories):
            j = dense_jacobian(net, mem.inputs)  # [M, C, P]
            k = torch.einsum("mcp,p,ncp->cmn", j, want, j)
            torch.testing.assert_close(_kernel_of(mean, i), k, rtol=1e-8, atol=1e-12)
        _perturb(net, t)
    assert len(mean.regularizer.memories) == 3


def test_mean_equals_the_sum_at_the_first_experience_and_counts_new_parameters_as_zero():
    """After one experience both combinations agree exactly; on a multi-head model a head
    first trained at experience 2 gets ``G_2 / 2`` (its GGN is zero at experience 1), not
    its own ``G_2``."""
    torch.manual_seed(0)
    net = MultiHeadMLP(4, (5,), n_heads=2, head_size=3).to(F64).eval()
    mean, total = _method("mean"), _method("sum")
    (x0, y0), (x1, y1) = _tasks()[:2]
    mean.learn_task(net, x0, y0, 0)
    total.learn_task(net, x0, y0, 0)
    torch.testing.assert_close(mean.posterior_variance(net), total.posterior_variance(net),
                               rtol=0, atol=0)  # fmt: skip
    mean.learn_task(net, x1, y1, 1)
    head = dict(net.named_parameters())["heads.1.weight"]
    g_head = mean.ggn_terms[1]["heads.1.weight"]
    names = [n for n, _ in net.named_parameters()]
    start = sum(p.numel() for n, p in net.named_parameters() if names.index(n) < names.index(
        "heads.1.weight"))  # fmt: skip
    var = mean.posterior_variance(net)[start : start + head.numel()]
    torch.testing.assert_close(var, 1.0 / (g_head.flatten() / 2 + 0.5), rtol=1e-12, atol=0)


def test_kron_mean_is_the_sum_with_a_scaled_prior():
    """``Sigma_mean = (G / E + delta)^-1 = E (G + E delta)^-1``: after tasks 2 and 3 every
    Kronecker kernel of the mean with prior ``delta`` is ``E`` times the sum's kernel with
    prior ``E delta`` (the sum is checked against dense KFAC in test_fromp_kron.py)."""
    net, delta = _net(), 0.5
    mean = _method("mean", posterior="kron", prior_precision=delta)
    total = _method("sum", posterior="kron", prior_precision=delta)
    for t, (x, y) in enumerate(_tasks()):
        e = t + 1
        total.prior_precision = e * delta  # every kernel is rebuilt with it below
        mean.learn_task(net, x, y, None)
        total.learn_task(net, x, y, None)
        for i in range(e):
            torch.testing.assert_close(_kernel_of(mean, i), e * _kernel_of(total, i),
                                       rtol=1e-8, atol=1e-12)  # fmt: skip
        _perturb(net, t)


def test_resume_continues_the_mean_and_refuses_a_change():
    net = _net()
    tasks = _tasks()
    run = _method("mean")
    for x, y in tasks[:2]:
        run.learn_task(net, x, y, None)
    state = run.state_dict()
    resumed = _method("mean")
    resumed.load_state_dict(state)
    x, y = tasks[2]
    run.learn_task(net, x, y, None)
    resumed.learn_task(net, x, y, None)
    torch.testing.assert_close(resumed.posterior_variance(net), run.posterior_variance(net),
                               rtol=0, atol=0)  # fmt: skip
    with pytest.raises(ValueError, match="curvature_combine='mean'"):
        _method("sum").load_state_dict(state)
    with pytest.raises(ValueError, match="curvature_combine='mean'"):
        _method(0.5).load_state_dict(state)
    _method(1.0).load_state_dict(state)  # the same exponent, named as a number
    old = dict(state)
    del old["curvature_combine"]  # no older forms: the key is required
    with pytest.raises(ValueError, match=r"missing keys \['curvature_combine'\]"):
        _method("sum").load_state_dict(old)


def test_bad_settings_are_refused_before_any_work():
    for bad in ("average", 1.5, -0.1, True, None):
        with pytest.raises(ValueError, match="curvature_combine must be one of"):
            FROMPMethod(curvature_combine=bad)
    with pytest.raises(ValueError, match="posterior='vogn'"):
        FROMPMethod(curvature_combine="mean", posterior="vogn")


def test_report_labels_an_absent_keyword_with_the_strategys_default():
    """A run without ``curvature_combine`` in its settings summed (the default): the report
    says so beside a run that set it, from the class's signature (FROMP's includes its
    method's), a strategy's preset winning over the class default; a name the registry does
    not know keeps ``None``."""
    from fromp_bench.report import _labels, group_key

    def run(strategy: str, **kw):
        return {"strategy": strategy, "settings": {"lr": 1e-3, "kwargs": {"tau": 0.3, **kw}}}

    runs = [run("fromp-coreset"), run("fromp-coreset", curvature_combine="mean")]
    labels = _labels({group_key(r): [r] for r in runs})
    assert sorted(labels.values()) == [
        "fromp-coreset [curvature_combine=mean]",
        "fromp-coreset [curvature_combine=sum]",
    ]
    runs = [run("fromp-kron"), run("fromp-kron", posterior="ggn")]  # preset: kron
    labels = _labels({group_key(r): [r] for r in runs})
    assert sorted(labels.values()) == ["fromp-kron [posterior=ggn]", "fromp-kron [posterior=kron]"]
    runs = [run("no-such-strategy"), run("no-such-strategy", curvature_combine="mean")]
    labels = _labels({group_key(r): [r] for r in runs})
    assert "no-such-strategy [curvature_combine=None]" in labels.values()
