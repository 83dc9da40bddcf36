"""Bounded memory of every predictive path (issue 37): the test inputs are taken a chunk at
a time under one ``memory_budget``, so that

* the peak memory of a predictive does not grow with the number of test inputs beyond the
  outputs themselves, for every subset x structure (measured on the CPU: live tensor
  storage tracked through a ``TorchDispatchMode``);
* chunked and unchunked results are equal to float rounding (GLM probit, functional
  variance, kernel, weight samples), also when ``N`` is not a multiple of the chunk;
* a budget that is not a positive int is refused before any work.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fromp import Laplace
from fromp.curvature.jacobian import default_memory_budget, set_default_memory_budget

F64 = torch.float64
C = 3
CASES = [
    ("all", "diag"),
    ("all", "kron"),
    ("all", "full"),
    ("all", "lowrank"),
    ("all", "gp"),
    ("last_layer", "diag"),
    ("last_layer", "kron"),
    ("last_layer", "full"),
    ("subnetwork", "diag"),
    ("subnetwork", "full"),
]
# structures whose per-input working memory (Jacobian rows [C, P] and their products) is far
# above the outputs': without chunking their peak grows with N by much more than the outputs
# (the last-layer ones work from the features [N, D] and C x C blocks, the outputs' order;
# the all-weights full one's peak is its P x P factorisation, 60 MB here, above any Jacobian
# chunk of these sizes, so its peak does not show the inputs)
WIDE = [c for c in CASES if c[0] != "last_layer" and c != ("all", "full")]


class PeakMemory(TorchDispatchMode):
    """The peak bytes of tensor storage allocated inside the mode and alive at once.

    Every storage an operation returns is held (so its address is not reused) and counted
    until only this tracker holds it (``torch._C._storage_Use_Count`` is 1: every tensor,
    view and autograd saved tensor on it is gone); the sum of the live ones after each
    operation gives the peak. Storage made before the mode (weights, inputs) is not
    counted."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[torch.UntypedStorage, int]] = {}
        self.current = self.peak = 0

    def _sweep(self) -> None:
        dead = [k for k, (s, _) in self.live.items() if torch._C._storage_Use_Count(s._cdata) <= 1]
        for k in dead:
            self.current -= self.live.pop(k)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._sweep()
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                s = t.untyped_storage()
                key, size = s.data_ptr(), s.nbytes()
                old = self.live.get(key, (None, 0))[1]
                if size > old:
                    self.live[key] = (s, size)
                    self.current += size - old
        self.peak = max(self.peak, self.current)
        self._sweep()
        return out


def peak_of(fn):
    with PeakMemory() as m:
        out = fn()
    return m.peak, out


def model_and_data(n: int = 48, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(),
        nn.Linear(75, 16), nn.ReLU(), nn.Linear(16, C),
    ).to(F64)  # fmt: skip
    with torch.no_grad():  # non-trivial batch-norm statistics
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    model.eval()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n, 1, 5, 5, dtype=F64, generator=g)
    y = torch.randint(0, C, (n,), generator=g)
    return model, x, y


def fitted(subset: str, structure: str):
    model, x, y = model_and_data()
    kw = {}
    if subset == "subnetwork":
        p = sum(q.numel() for q in model.parameters())
        kw["subnetwork_indices"] = torch.cat([torch.arange(0, 30, 3), torch.arange(p - 40, p)])
    if structure == "lowrank":
        kw["low_rank"] = 12
    if structure == "gp":
        kw["n_subset"] = 16
    la = Laplace(model, "classification", subset, structure, prior_precision=0.5, **kw)
    la.fit([(x[:24], y[:24]), (x[24:], y[24:])])
    return la, x


def chunk_budget(la, x, rows: int) -> int:
    """A budget that holds exactly ``rows`` inputs of ``la``'s predictive."""
    return rows * la._bytes_per_input(x)


@pytest.mark.parametrize(("subset", "structure"), CASES)
def test_peak_memory_does_not_grow_with_the_number_of_inputs(subset, structure):
    """Peak on 4N inputs minus peak on N, with a budget of one input per chunk, is at most
    the growth of what the call returns and accumulates: the outputs ``f`` [N, C], ``var``
    [N, C, C] and the probabilities [N, C], each held at most 4 times at once (the list of
    chunk results, their concatenation, the link's temporaries), plus 2 bytes per input
    number (the finiteness masks of the input checks), plus 2 KiB of slack for Python-side
    bookkeeping tensors. Without chunking a Jacobian-based structure grows by ``C P`` numbers
    per input (here > 30 KiB per input), far above this bound."""
    la, x = fitted(subset, structure)
    n = 6
    x1, x4 = x[:n].clone(), x[: 4 * n].clone()
    budget = chunk_budget(la, x1, 1)
    p1, out1 = peak_of(lambda: la(x1, memory_budget=budget))
    p4, out4 = peak_of(lambda: la(x4, memory_budget=budget))
    torch.testing.assert_close(out4[:n], out1)
    item = x.element_size()
    out_growth = 3 * n * (2 * C + C * C) * item
    tol = 4 * out_growth + 2 * 3 * n * x[0].numel() + 2048
    assert p4 - p1 <= tol, (p1, p4, tol)


@pytest.mark.parametrize(("subset", "structure"), WIDE)
def test_without_chunks_the_peak_grows(subset, structure):
    """The measurement can fail: one chunk for all inputs (a budget of all of them) grows
    the peak beyond the bound of the test above, for every Jacobian-based structure."""
    la, x = fitted(subset, structure)
    n = 6
    x1, x4 = x[:n].clone(), x[: 4 * n].clone()
    p1, _ = peak_of(lambda: la(x1, memory_budget=1 << 40))
    p4, _ = peak_of(lambda: la(x4, memory_budget=1 << 40))
    item = x.element_size()
    out_growth = 3 * n * (2 * C + C * C) * item
    tol = 4 * out_growth + 2 * 3 * n * x[0].numel() + 2048
    assert p4 - p1 > tol, (p1, p4, tol)


@pytest.mark.parametrize(("subset", "structure"), CASES)
@pytest.mark.parametrize("rows", [1, 4, 5])
def test_chunked_equals_unchunked(subset, structure, rows):
    """Chunks of 1, 4 and 5 inputs over N = 13 (not a multiple of 4 or 5: a short last
    chunk) give the probit predictive and the functional variance of one chunk of all 13,
    to float64 rounding; also the bridge, the MC link with one generator, and the weight
    samples' predictive ("nn", the same draws replayed for every chunk)."""
    la, x = fitted(subset, structure)
    x = x[:13]
    small, big = chunk_budget(la, x, rows), 1 << 40
    assert la._bytes_per_input(x) * rows <= small < la._bytes_per_input(x) * (rows + 1)
    torch.testing.assert_close(la(x, memory_budget=small), la(x, memory_budget=big))
    torch.testing.assert_close(
        la.functional_variance_at(x, memory_budget=small),
        la.functional_variance_at(x, memory_budget=big),
    )
    torch.testing.assert_close(
        la(x, link_approx="mc", n_samples=7, generator=torch.Generator().manual_seed(2),
           memory_budget=small),
        la(x, link_approx="mc", n_samples=7, generator=torch.Generator().manual_seed(2),
           memory_budget=big),
    )  # fmt: skip
    if structure != "gp":
        torch.testing.assert_close(
            la(x, link_approx="bridge", memory_budget=small),
            la(x, link_approx="bridge", memory_budget=big),
        )
        g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
        a = la(x, pred_type="nn", link_approx="mc", n_samples=4, generator=g1, memory_budget=small)
        b = la(x, pred_type="nn", link_approx="mc", n_samples=4, generator=g2, memory_budget=big)
        torch.testing.assert_close(a, b)
        # the stream ends where one call leaves it
        torch.testing.assert_close(torch.rand(3, generator=g1), torch.rand(3, generator=g2))


@pytest.mark.parametrize(("subset", "structure"), [c for c in CASES if c[1] != "gp"])
def test_kernel_blocks_equal_one_block(subset, structure):
    """``la.gp().kernel`` by blocks of 4 inputs (7 and 6 inputs: short last blocks) equals
    the kernel of one block, for one set (the Gram) and for two sets."""
    la, x = fitted(subset, structure)
    x1, x2 = x[:7], x[7:13]
    small = 2 * chunk_budget(la, x1, 4)
    set_default_memory_budget(small)
    try:
        k11, k12 = la.gp().kernel(x1), la.gp().kernel(x1, x2)
    finally:
        set_default_memory_budget(None)
    la.memory_budget = 1 << 40
    torch.testing.assert_close(k11, la.gp().kernel(x1))
    torch.testing.assert_close(k12, la.gp().kernel(x1, x2))
    assert k12.shape == (7, C, 6, C)


def test_kron_variance_equals_dense_jacobian_route():
    """All-weights Kronecker, chunked layer by layer: ``J Sigma J^T`` against the dense
    Jacobians (``torch.func.jacrev``, an independent route) times the dense block-diagonal
    covariance from the posterior precision blocks."""
    la, x = fitted("all", "kron")
    x = x[:5]
    var = la.functional_variance_at(x, memory_budget=chunk_budget(la, x, 2))
    params = dict(la.model.named_parameters())
    buffers = dict(la.model.named_buffers())

    def f(ps, xi):
        return torch.func.functional_call(la.model, (ps, buffers), (xi[None],))[0]

    jac = torch.func.vmap(torch.func.jacrev(f), in_dims=(None, 0))(params, x)
    j = torch.cat([jac[n].flatten(2) for n in params], -1)
    cov = torch.block_diag(*[torch.linalg.inv(b) for b in la.posterior_precision])
    torch.testing.assert_close(var, torch.einsum("ncp,pq,ndq->ncd", j, cov, j))


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "1GB"])
def test_bad_budget_is_refused_before_any_work(bad):
    la, x = fitted("all", "kron")
    calls = []
    h = la.model[0].register_forward_hook(lambda *a: calls.append(1))
    try:
        for call in (
            lambda: la(x[:3], memory_budget=bad),
            lambda: la.functional_samples(x[:3], memory_budget=bad),
            lambda: la.functional_variance_at(x[:3], memory_budget=bad),
        ):
            with pytest.raises(ValueError, match="memory_budget must be a positive int"):
                call()
    finally:
        h.remove()
    assert calls == []
    with pytest.raises(ValueError, match="memory_budget"):
        Laplace(la.model, "classification", "all", "diag", memory_budget=bad)
    with pytest.raises(ValueError, match="memory_budget"):
        set_default_memory_budget(bad)


def test_default_budget():
    """2 GiB on the CPU; a user default replaces it until reset."""
    assert default_memory_budget("cpu") == 2 * 1024**3
    set_default_memory_budget(12345)
    try:
        assert default_memory_budget("cpu") == 12345
    finally:
        set_default_memory_budget(None)
    assert default_memory_budget() == 2 * 1024**3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_default_budget_cuda_is_half_the_free_memory_up_to_4_gib():
    free, _ = torch.cuda.mem_get_info()
    expected = min(4 * 1024**3, free // 2)
    assert abs(default_memory_budget("cuda") - expected) <= 0.1 * free
