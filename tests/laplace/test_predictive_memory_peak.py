"""The predictive's peak memory does not grow with the number of test inputs beyond their
outputs (docs/gpu.md): measured as the process's peak resident set on a small CNN whose
activations (131 KB per input in its first layer) dwarf its outputs (40 bytes), at 64 and
then 256 inputs under one 16 MB budget (a few inputs per chunk, so that the smaller call is
already chunked many times over). The fifth audit saw the all-weights diagonal GLM probit
grow by about one first-layer activation per input (546 MB at 4,096 inputs at a 256 MB
budget): each chunk's small result, kept between the chunks' large buffers, pinned their
freed memory."""

from __future__ import annotations

import subprocess
import sys

import pytest

CASES = [("all", "diag", "probit"), ("all", "diag", "variance"), ("all", "kron", "probit"),
         ("all", "diag", "mc"), ("last_layer", "kron", "probit")]  # fmt: skip

# one interpreter imports torch and fromp once, then measures each case in a child of its own
# (os.fork: a fresh peak resident set per case, without a second import)
SCRIPT = r"""
import os, resource, sys, torch, fromp
from torch import nn
torch.set_num_threads(1)
BUDGET = 2**24

def case(subset, structure, call):
    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
                        nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
                        nn.Flatten(), nn.Linear(128, 10)).eval()
    x = torch.randn(256, 3, 32, 32)
    la = fromp.Laplace(cnn, "classification", subset, structure).fit([(x[:8], torch.arange(8))])
    calls = {
        "probit": lambda z: la(z, link_approx="probit", memory_budget=BUDGET),
        "mc": lambda z: la(z, link_approx="mc", n_samples=4, memory_budget=BUDGET),
        "nn": lambda z: la(z, pred_type="nn", n_samples=2, memory_budget=BUDGET),
        "variance": lambda z: la.functional_variance_at(z, memory_budget=BUDGET),
    }
    peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    calls[call](x[:64])
    small = peak()
    calls[call](x)
    return peak() - small

for spec in sys.argv[1:]:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            os.write(write, str(case(*spec.split(","))).encode())
        finally:
            os._exit(0)
    os.close(write)
    got = os.read(read, 64).decode()
    os.close(read)
    _, status = os.waitpid(pid, 0)
    assert got and os.waitstatus_to_exitcode(status) == 0, (spec, status)
    print(spec, got)
"""


@pytest.fixture(scope="module")
def growth() -> dict[tuple[str, str, str], int]:
    """Each case's growth of the peak resident set (MB) from 64 to 256 inputs."""
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, *(",".join(c) for c in CASES)],
        capture_output=True, text=True, timeout=900, env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line.split() for line in out.stdout.splitlines()]
    return {tuple(spec.split(",")): int(mb) for spec, mb in lines}


@pytest.mark.parametrize(("subset", "structure", "call"), CASES)
@pytest.mark.slow
def test_peak_memory_does_not_grow_with_the_inputs(growth, subset, structure, call):
    growth_mb = growth[subset, structure, call]
    # 192 more inputs: 70 MB to 1.2 GB if the budget were ignored (one chunk of 256); their
    # outputs and the inputs already allocated are below 1 MB
    assert growth_mb < 40, f"peak grew by {growth_mb} MB from 64 to 256 inputs"
