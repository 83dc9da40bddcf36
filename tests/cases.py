"""Shared test cases: small float64 networks and data, references for fromp's continual
methods, and the operation counter and host-work recorders of the speed
tests (as curvlinops keeps its cases in ``test/cases.py``). The dense references of the
curvature, GP and posterior are public, in :mod:`fromp.testing`.

The networks (:func:`tiny_mlp`, :func:`tiny_cnn` with or without batch norm,
:func:`multihead_mlp`, :func:`conv_zoo`) are float64 and take an optional ``seed``; with
``seed=None`` they draw their weights from torch's global generator (as ``nn.Module``
constructors do). :class:`NetCase` pairs a network with matching inputs; :data:`NETS` lists
the kinds. :func:`toy_regression` and :func:`toy_classification` give small seeded data.
:func:`dense_fromp_penalty` and :func:`dense_ewc_penalty` write FROMP's regulariser and EWC's
penalty from their formulas. :func:`count_aten_ops` counts the operations a step runs,
:func:`host_syncs` the ones that would make the host wait for a GPU, :class:`StepRecorder` a
training step's host work by phase (:func:`simulated_cuda_graphs`: as a CUDA-graph step would
do it). :func:`synthetic_split` is a small task sequence in the format of the runner's real
ones (no data set needed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from fromp.testing import forward_at

if TYPE_CHECKING:
    from fromp_bench.data import TaskSequence


# ------------------------------------------------------------------------ continual methods
def _inverse_link(link: str) -> Callable[[Tensor], Tensor]:
    if link == "softmax":
        return lambda f: torch.softmax(f, -1)
    if link == "sigmoid":
        return torch.sigmoid
    if link == "identity":
        return lambda f: f
    raise ValueError(f"link must be 'softmax', 'sigmoid' or 'identity', got {link!r}")


def dense_fromp_penalty(
    model: nn.Module,
    x: Tensor,
    w_old: Tensor,
    variance: Tensor,
    w_new: Tensor,
    *,
    kernel: str = "per_class",
    jitter: float = 0.0,
    link: str = "softmax",
) -> Tensor:
    """FROMP's regulariser for one memorable set, from its formula.

    ``p(w) = link(f_w(x))`` ``[M, C]``; targets ``m = p(w_old)``; ``G = dp(w_old)/dw``
    ``[M, C, P]`` by autograd; ``Sigma = diag(variance)`` ``[P]``. ``"per_class"``: ``K_c =
    G[:, c] Sigma G[:, c]^T + jitter I`` ``[M, M]`` and ``R = 1/2 sum_c r_c^T K_c^{-1} r_c``
    with ``r_c = p_c(w_new) - m_c``; ``"joint"``: ``K [C M, C M]`` class-major (index ``(c,
    m)``) and ``R = 1/2 r^T K^{-1} r``; ``"identity"``: ``R = 1/2 ||r||^2``. Dense inverses,
    float64. Returns a scalar."""
    inv = _inverse_link(link)
    w_old, w_new, variance = w_old.double(), w_new.double(), variance.double()
    g = torch.autograd.functional.jacobian(lambda v: inv(forward_at(model, v, x)), w_old)
    with torch.no_grad():
        r = inv(forward_at(model, w_new, x)) - inv(forward_at(model, w_old, x))
    m, c = r.shape
    if kernel == "identity":
        return 0.5 * (r * r).sum()
    if kernel == "per_class":
        total = torch.zeros((), dtype=torch.float64)
        for k in range(c):
            gk = g[:, k, :]  # [M, P]
            kk = gk @ torch.diag(variance) @ gk.T + jitter * torch.eye(m, dtype=torch.float64)
            total = total + 0.5 * r[:, k] @ torch.linalg.inv(kk) @ r[:, k]
        return total
    if kernel == "joint":
        gj = g.permute(1, 0, 2).reshape(c * m, -1)  # class-major rows (c, m)
        kk = gj @ torch.diag(variance) @ gj.T + jitter * torch.eye(c * m, dtype=torch.float64)
        rj = r.T.reshape(-1)
        return 0.5 * rj @ torch.linalg.inv(kk) @ rj
    raise ValueError(f"kernel must be 'per_class', 'joint' or 'identity', got {kernel!r}")


def dense_ewc_penalty(
    w: Tensor,
    anchors: Sequence[Tensor],
    importances: Sequence[Tensor],
    ewc_lambda: float,
    batch_size: int = 1,
) -> Tensor:
    """EWC's penalty on Avalanche's scale, ``(lambda / B) sum_t sum_p F_{t,p} (w_p -
    w*_{t,p})^2`` (``F`` the per-example Fisher, ``B`` the mini-batch size), by an explicit
    loop over tasks ``t`` and weights ``p`` (flat ``[P]`` vectors; a scalar). The
    per-example scale ``(lambda' / 2) sum F d^2`` is ``ewc_lambda = lambda'``,
    ``batch_size = 2``."""
    total = torch.zeros((), dtype=torch.float64)
    for a, f in zip(anchors, importances, strict=True):
        for p in range(w.numel()):
            total = total + float(f[p]) * (float(w[p]) - float(a[p])) ** 2
    return ewc_lambda / batch_size * total


# ------------------------------------------------------------------------------- networks
@contextlib.contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    """Draw from a generator seeded with ``seed`` without touching the global state (None:
    the global generator)."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def tiny_mlp(d_in: int = 4, hidden: int = 5, c: int = 3, *, seed: int | None = None) -> nn.Module:
    """``Linear(d_in, hidden) -> Tanh -> Linear(hidden, c)``, float64; input ``[N, d_in]``."""
    with _seeded(seed):
        return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, c)).double()


class TinyCNN(nn.Module):
    """Conv (weight sharing) -> [BatchNorm (eval)] -> ReLU -> conv -> max-pool -> linear;
    input ``[N, 1, 6, 6]``, output ``[N, c]``. With batch norm its statistics and affine
    weights are randomised so that eval mode is not the identity. The weights of the convs
    and the linear layer are drawn in the same order with or without batch norm."""

    def __init__(self, c: int = 3, batch_norm: bool = True) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 2, 3, padding=1)
        self.bn = nn.BatchNorm2d(2) if batch_norm else None
        self.conv2 = nn.Conv2d(2, 2, 3)
        self.fc = nn.Linear(2 * 2 * 2, c)
        if self.bn is not None:
            with torch.no_grad():
                self.bn.running_mean.uniform_(-0.5, 0.5)
                self.bn.running_var.uniform_(0.5, 2.0)
                self.bn.weight.uniform_(0.5, 1.5)
                self.bn.bias.uniform_(-0.5, 0.5)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(x)
        h = torch.relu(h if self.bn is None else self.bn(h))
        h = torch.nn.functional.max_pool2d(torch.tanh(self.conv2(h)), 2)
        return self.fc(h.flatten(1))


def tiny_cnn(c: int = 3, *, batch_norm: bool = True, seed: int | None = None) -> nn.Module:
    """:class:`TinyCNN` in float64; with batch norm in eval mode (it uses its running
    statistics), without it in the default training mode (which changes nothing)."""
    with _seeded(seed):
        net = TinyCNN(c, batch_norm).double()
    return net.eval() if batch_norm else net


def multihead_mlp(
    c: int = 3, n_heads: int = 3, d_in: int = 4, hidden: int = 5, *, seed: int | None = None
) -> nn.Module:
    """:class:`fromp.models.MultiHeadMLP` ``d_in -> hidden -> n_heads heads of c``, float64
    (one head per task; see :func:`fromp.models.with_task`)."""
    from fromp.models import MultiHeadMLP

    with _seeded(seed):
        return MultiHeadMLP(d_in, (hidden,), n_heads=n_heads, head_size=c).double()


class Scale(nn.Module):
    """``x * s`` per channel: a parametrised layer with no capture rule (``fromp``'s
    engines must fall back to Jacobians for it)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.s.view(1, -1, *([1] * (x.ndim - 2)))


class ConvZoo(nn.Module):
    """Conv2d with stride/dilation/reflect padding, grouped conv with 'same' circular
    padding, BatchNorm2d (eval), GroupNorm, a 1x1-output conv (Gram route), Conv1d with
    stride, LayerNorm on a sequence, a sequence Linear, a Scale layer (fallback); input
    ``[N, 2, 8, 8]``, output ``[N, c]``."""

    def __init__(self, c: int = 3) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(2, 4, 3, stride=2, dilation=1, padding=1, padding_mode="reflect")
        self.bn = nn.BatchNorm2d(4)
        self.c2 = nn.Conv2d(4, 4, 3, padding="same", dilation=2, groups=2, padding_mode="circular")
        self.gn = nn.GroupNorm(2, 4)
        self.scale = Scale(4)
        self.c3 = nn.Conv2d(4, 6, 4, stride=2, bias=False)  # 4x4 -> 1x1 output
        self.c1d = nn.Conv1d(1, 3, 3, stride=2, padding=1)  # on a 1-d view of the input
        self.ln = nn.LayerNorm(3)
        self.seq = nn.Linear(3, 2)
        self.fc = nn.Linear(6 + 2, c)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)
            for norm in (self.bn, self.gn, self.ln):
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.bn(self.c1(x)))  # B, 4, 4, 4
        h = torch.relu(self.scale(self.gn(self.c2(h))))
        h = torch.tanh(self.c3(h)).flatten(1)  # B, 6
        s = self.c1d(x[:, :1].flatten(2)[..., :15])  # B, 3, 8
        s = self.seq(torch.tanh(self.ln(s.transpose(1, 2)))).mean(1)  # B, 2
        return self.fc(torch.cat([h, s], 1))


def conv_zoo(c: int = 3, *, seed: int | None = None) -> nn.Module:
    """:class:`ConvZoo` in float64 and eval mode."""
    with _seeded(seed):
        return ConvZoo(c).double().eval()


def _mlp(c: int = 3) -> nn.Module:
    return tiny_mlp(4, 5, c)


def _cnn(c: int = 3) -> nn.Module:
    return tiny_cnn(c, batch_norm=False)


def _bn(c: int = 3) -> nn.Module:
    return tiny_cnn(c, batch_norm=True)


#: kind -> (factory(c) -> network, input shape of one example)
NETS: dict[str, tuple[Callable[[int], nn.Module], tuple[int, ...]]] = {
    "mlp": (_mlp, (4,)),
    "cnn": (_cnn, (1, 6, 6)),
    "multihead": (multihead_mlp, (4,)),
    "bn": (_bn, (1, 6, 6)),
}


class NetCase:
    """A test network with matching inputs: ``net``, ``inputs(n)``, ``kind`` and, for
    multi-head networks, ``n_heads`` (``head(t)`` is the network seen through head ``t``).

    ``NetCase(kind, c, seed)`` seeds torch's global generator with ``seed`` and builds
    ``NETS[kind][0](c)``: equal calls give equal weights."""

    def __init__(self, kind: str, c: int = 3, seed: int = 0) -> None:
        if kind not in NETS:
            raise ValueError(f"kind must be one of {sorted(NETS)}, got {kind!r}")
        factory, self.input_shape = NETS[kind]
        torch.manual_seed(seed)
        self.kind, self.c, self.net = kind, c, factory(c)
        self.n_heads = getattr(self.net, "n_heads", 1)

    def inputs(self, n: int, seed: int = 1) -> Tensor:
        """``n`` float64 standard-normal inputs ``[n, *input_shape]`` from ``seed``."""
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, *self.input_shape, generator=g, dtype=torch.float64)

    def head(self, task: int | None = None) -> nn.Module:
        from fromp.models import with_task

        return with_task(self.net, task if self.n_heads > 1 else None)


# ----------------------------------------------------------------------------------- data
def toy_regression(
    n: int = 20, d: int = 3, noise: float = 0.1, *, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """``x [n, d]``, ``y [n, 1] = x w + noise * eps`` and the true ``w [d, 1]``, float64."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(d, 1, generator=g, dtype=torch.float64)
    y = x @ w + noise * torch.randn(n, 1, generator=g, dtype=torch.float64)
    return x, y, w


def toy_classification(
    n: int = 20, d: int = 4, c: int = 3, *, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """``x [n, d]`` float64 and labels ``y [n]`` (int64 in ``[0, c)``) from a random linear
    rule ``argmax(x W)``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    w = torch.randn(d, c, generator=g, dtype=torch.float64)
    return x, (x @ w).argmax(1)


# ---------------------------------------------------------------------------- operations
def count_aten_ops(fn: Callable[[], Any]) -> int:
    """The number of aten operations ``fn()`` dispatches (forward and any backward it
    runs), counted with a :class:`~torch.utils._python_dispatch.TorchDispatchMode`: the
    deterministic form of "this step's cost does not grow with ``n``" (equal counts for
    two sizes of the state it reads, e.g. the tasks learnt)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.n


#: aten operations that, on a CUDA device, make the host wait for the GPU: a value read
#: back (``.item()``, ``float(t)``, ``bool(t)``: ``_local_scalar_dense``), a tensor made
#: from host data (``torch.tensor``, ``t.new_tensor``: ``lift_fresh``, a blocking copy from
#: pageable memory) and the operations whose output size depends on the data (``nonzero``,
#: ``masked_select``, ``unique``; :func:`host_syncs` also names indexing with a boolean
#: mask).
HOST_SYNC_OPS = frozenset(
    {
        "_local_scalar_dense",
        "lift_fresh",
        "lift_fresh_copy",
        "nonzero",
        "masked_select",
        "_unique",
        "_unique2",
        "unique_dim",
        "unique_consecutive",
        "equal",
    }
)


def _bool_index(args: tuple) -> bool:
    """Whether an ``aten.index`` / ``index_put`` call indexes with a boolean mask."""
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices)


def host_syncs(
    fn: Callable[[], Any], within: Sequence[str] = (), out: list[str] | None = None
) -> list[str]:
    """The aten operations of ``fn()`` (forward and any backward it runs) that would make
    the host wait for a CUDA device (:data:`HOST_SYNC_OPS`), in the order they ran: ``[]``
    for a step that keeps the GPU's queue full. Recorded with a
    :class:`~torch.utils._python_dispatch.TorchDispatchMode` on whatever device the tensors
    are, so a CPU test catches a per-step sync that only a GPU would pay for.

    ``within``: folder or file paths; when given, only the operations called with a frame
    of one of them on the Python stack count, each as ``"op@file:line"`` of the innermost
    such frame (the code under test, not the training loop around it). Operations that
    autograd's engine runs in the backward have no Python stack: test those with ``fn``
    calling ``backward()`` and no ``within``. ``out``: the list to append to (returned), so
    that the caller can interleave its own marks, e.g. where each training step begins."""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    found: list[str] = [] if out is None else out
    roots = tuple(str(w) for w in within)

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = func.overloadpacket.__name__
            if name in ("index", "index_put", "index_put_") and _bool_index(args):
                name = f"{name}(boolean mask)"  # a nonzero inside, on a GPU
            if name in HOST_SYNC_OPS or name.endswith("(boolean mask)"):
                if not roots:
                    found.append(name)
                else:
                    ours = [
                        f
                        for f in traceback.extract_stack()
                        if f.filename.startswith(roots) and f.filename != __file__
                    ]
                    if ours:
                        where = ours[-1]
                        found.append(f"{name}@{where.filename}:{where.lineno}")
            return func(*args, **(kwargs or {}))

    with Record():
        fn()
    return found


#: aten operations that make a tensor from host data (a blocking copy to a CUDA device from
#: pageable memory): ``torch.tensor`` / ``new_tensor`` (``lift_fresh``), a Python number made
#: a tensor (``scalar_tensor``)
HOST_DATA_OPS = frozenset({"lift_fresh", "lift_fresh_copy", "scalar_tensor"})
#: torch functions that make a tensor from host data or move one between devices (recorded
#: by :class:`StepRecorder` when called from the code under test; ``to`` only with a device
#: or a tensor among its arguments), and those that read a tensor's values on the host (on
#: the CPU they dispatch no operation a dispatch mode would see)
HOST_DATA_FUNCTIONS = frozenset({"tensor", "as_tensor", "new_tensor", "from_numpy", "to", "cuda"})
HOST_READ_FUNCTIONS = frozenset({"cpu", "tolist", "numpy", "item", "__bool__", "__float__",
                                 "__int__"})  # fmt: skip


def _moves(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a call of the torch function ``name`` makes a tensor from host data or
    moves one (``to`` with only a dtype does not)."""
    if name != "to":
        return True
    values = [*args[1:], *kwargs.values()]
    return any(isinstance(v, (torch.device, str, Tensor)) for v in values)


class StepRecorder:
    """What a training step does on the host, recorded on any device (a CPU run catches
    what a GPU would pay for): enter it before the step and leave it after (``with``, or
    :meth:`start` / :meth:`stop` from a training loop's hooks).

    Args:
        within: folder or file paths of the code under test (e.g. ``fromp`` and the
            strategies): its calls are counted and the host reads and uploads it makes are
            named ``"op@file:line"`` (its innermost frame).
        phase: returns the step's current phase (e.g. ``"penalty"`` while a wrapper of the
            penalty runs); operations are counted per phase.
        what: ``"all"``, ``"ops"`` (the modes only) or ``"calls"`` (the Python calls only:
            the modes' own Python work, per operation, would be counted with them).

    After :meth:`stop`: ``ops`` (``Counter`` of aten operations per phase, forward and
    backward; ``op_names``: per phase, by operation), ``reads`` (:data:`HOST_SYNC_OPS` but
    ``lift_fresh``, and boolean-mask indexing, called from ``within``, and the calls of
    :data:`HOST_READ_FUNCTIONS` made directly from ``within``), ``uploads``
    (:data:`HOST_DATA_OPS` and the calls of :data:`HOST_DATA_FUNCTIONS` called directly
    from ``within``; each ``"op@file:line (phase)"``), ``python_calls`` (Python
    function calls whose code is in ``within``, per phase: ``sys.setprofile``) and
    ``all_calls`` (every Python function call, per phase: in a phase of the code under
    test, what it costs in Python with the library code it calls)."""

    def __init__(
        self,
        within: Sequence[str],
        phase: Callable[[], str] = lambda: "step",
        *,
        what: str = "all",
    ) -> None:
        from collections import Counter

        if what not in ("all", "ops", "calls"):
            raise ValueError(f"what must be 'all', 'ops' or 'calls', got {what!r}")
        self.roots = tuple(str(w) for w in within)
        self.phase, self.what = phase, what
        self.ops: Counter = Counter()
        self.op_names: dict[str, Counter] = {}
        self.python_calls: Counter = Counter()
        self.all_calls: Counter = Counter()
        self.reads: list[str] = []
        self.uploads: list[str] = []
        self._modes: list[Any] = []
        self._profile: Any = None

    def _where(self, direct: bool = False) -> str | None:
        """The innermost frame of the code under test (``direct``: only when it is the
        caller itself: a device move inside a torch function the code calls is torch's), as
        ``file:line``; None when there is none."""
        import traceback

        frames = [f for f in traceback.extract_stack() if f.filename != __file__]
        if direct:
            frames = frames[-1:]
        ours = [f for f in frames if f.filename.startswith(self.roots)]
        return f"{ours[-1].filename}:{ours[-1].lineno}" if ours else None

    def _modes_for(self) -> list[Any]:
        from collections import Counter

        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        rec = self

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                name = func.overloadpacket.__name__
                phase = rec.phase()
                rec.ops[phase] += 1
                rec.op_names.setdefault(phase, Counter())[name] += 1
                if name in ("index", "index_put", "index_put_") and _bool_index(args):
                    name = f"{name}(boolean mask)"
                read = name in HOST_SYNC_OPS - HOST_DATA_OPS or name.endswith("(boolean mask)")
                if read or name in HOST_DATA_OPS:
                    where = rec._where()
                    if where is not None:
                        (rec.reads if read else rec.uploads).append(f"{name}@{where} ({phase})")
                return func(*args, **(kwargs or {}))

        class Functions(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                name = getattr(func, "__name__", "")
                read = name in HOST_READ_FUNCTIONS
                if read or (name in HOST_DATA_FUNCTIONS and _moves(name, args, kwargs or {})):
                    where = rec._where(direct=True)
                    if where is not None:
                        (rec.reads if read else rec.uploads).append(
                            f"{name}@{where} ({rec.phase()})"
                        )
                return func(*args, **(kwargs or {}))

        return [Functions(), Ops()]

    def _count(self, frame: Any, event: str, arg: Any) -> None:
        name = frame.f_code.co_filename
        if event == "call" and name != __file__:
            phase = self.phase()
            self.all_calls[phase] += 1
            if name.startswith(self.roots):
                self.python_calls[phase] += 1

    def start(self) -> None:
        import sys

        self._modes = self._modes_for() if self.what != "calls" else []
        for m in self._modes:
            m.__enter__()
        if self.what != "ops":
            self._profile = sys.getprofile()
            sys.setprofile(self._count)

    def stop(self) -> None:
        import sys

        if self.what != "ops":
            sys.setprofile(self._profile)
        for m in reversed(self._modes):
            m.__exit__(None, None, None)
        self._modes = []

    def __enter__(self) -> StepRecorder:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def simulated_cuda_graphs() -> Iterator[None]:
    """Within the block, the CUDA-graph path of :mod:`fromp.continual.graphed` runs on any
    device with its replay a no-op: the "capture" computes the term and its gradient once
    (eagerly) into the static buffers, and each step then does exactly the host work of a
    replayed step on a GPU (the key check, the replay call, the outputs copied, the scaled
    gradient in the backward) without the work the graph would replay. For counting what
    the host does per step (:class:`StepRecorder`), not for values: every step returns the
    capture's value and gradient."""
    from fromp.continual import graphed

    class Replay:
        def replay(self) -> None:
            pass

        def reset(self) -> None:
            pass

    def capture(term: graphed.StaticTerm) -> None:
        term._static = term._pair()
        term._cuda_graph = Replay()  # type: ignore[assignment]
        term.captures += 1

    saved = graphed.uses_graph, graphed.StaticTerm._capture
    graphed.uses_graph = lambda mode, params, net: None if mode == "off" else True  # type: ignore[assignment]
    graphed.StaticTerm._capture = capture  # type: ignore[method-assign]
    try:
        yield
    finally:
        graphed.uses_graph, graphed.StaticTerm._capture = saved  # type: ignore[method-assign]


# ------------------------------------------------------------------ a synthetic task sequence


def synthetic_split(
    *,
    n_tasks: int = 3,
    classes_per_task: int = 2,
    input_shape: tuple[int, ...] = (1, 28, 28),
    train_size: int = 64,
    test_size: int = 32,
    multi_head: bool = True,
    seed: int = 0,
) -> TaskSequence:
    """A small, learnable synthetic sequence in the format of the real ones: ``train_size`` /
    ``test_size`` examples per task.

    Each class is a random prototype image plus noise, clipped to [0, 1].
    """
    from fromp_bench.data import TaskSequence, split_tasks

    g = torch.Generator().manual_seed(seed)
    n_classes = n_tasks * classes_per_task
    protos = torch.rand(n_classes, *input_shape, generator=g)

    def draw(n: int) -> tuple[Tensor, Tensor]:
        y = torch.arange(n) % n_classes
        x = (protos[y] + 0.3 * torch.randn(n, *input_shape, generator=g)).clamp(0, 1)
        return x, y

    xtr, ytr = draw(train_size * n_tasks)
    xte, yte = draw(test_size * n_tasks)
    groups = [list(range(s, s + classes_per_task)) for s in range(0, n_classes, classes_per_task)]
    tasks = split_tasks(xtr, ytr, xte, yte, groups)
    return TaskSequence("synthetic", tasks, multi_head, tuple(input_shape), classes_per_task)


# ------------------------------------------------------------------ a process to kill or stop
def forked(target: Callable[[], int | None], output: str | None = None) -> int:
    """The pid of a fork of this process running ``target`` (torch, fromp and Avalanche
    already imported, so no interpreter starts and imports them again); the child exits with
    ``target``'s return value (0 for None, 1 on an exception), its stdout and stderr written
    to the file ``output`` (or discarded), SIGTERM and SIGINT at their defaults until
    ``target`` sets its own. Wait for it with :func:`exit_code`."""
    import os
    import signal
    import sys
    import traceback

    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:  # the child: never returns into the test session
        fd = os.open(output or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = sys.stderr = open(fd, "w", buffering=1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:
            code = int(target() or 0)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException:
            traceback.print_exc()
    finally:
        os._exit(code)


def exit_code(pid: int, timeout: float) -> int:
    """The exit code of the child ``pid`` (minus the signal's number when one killed it), or
    an ``AssertionError`` after ``timeout`` seconds (the child killed)."""
    import os
    import signal
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"the child {pid} did not end within {timeout} s")
