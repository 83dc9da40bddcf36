"""The predictive's peak memory does not grow with the number of test inputs beyond their
outputs (docs/gpu.md): measured as the process's peak resident set on a small CNN whose
activations (131 KB per input in its first layer) dwarf its outputs (40 bytes), at 128 and
then 512 inputs under one 16 MB budget (a few inputs per chunk, so that the smaller call is
already chunked many times over). The fifth audit saw the all-weights diagonal GLM probit
grow by about one first-layer activation per input (546 MB at 4,096 inputs at a 256 MB
budget): each chunk's small result, kept between the chunks' large buffers, pinned their
freed memory."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = r"""
import resource, sys, torch, fromp
from torch import nn
torch.set_num_threads(1)
torch.manual_seed(0)
subset, structure, call = sys.argv[1:4]
BUDGET = 2**24
cnn = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1),
                    nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(128, 10)).eval()
x = torch.randn(512, 3, 32, 32)
la = fromp.Laplace(cnn, "classification", subset, structure).fit([(x[:8], torch.arange(8))])
calls = {
    "probit": lambda z: la(z, link_approx="probit", memory_budget=BUDGET),
    "mc": lambda z: la(z, link_approx="mc", n_samples=4, memory_budget=BUDGET),
    "nn": lambda z: la(z, pred_type="nn", n_samples=2, memory_budget=BUDGET),
    "variance": lambda z: la.functional_variance_at(z, memory_budget=BUDGET),
}
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
calls[call](x[:128])
small = peak()
calls[call](x)
print(peak() - small)
"""


@pytest.mark.parametrize(
    ("subset", "structure", "call"),
    [("all", "diag", "probit"), ("all", "diag", "variance"), ("all", "kron", "probit"),
     ("all", "diag", "mc"), ("last_layer", "kron", "probit")],
)  # fmt: skip
def test_peak_memory_does_not_grow_with_the_inputs(subset, structure, call):
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, subset, structure, call],
        capture_output=True, text=True, timeout=600, env={"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    growth_mb = int(out.stdout.split()[-1])
    # 384 more inputs: 50 MB of first-layer activations if they were kept, 150 MB to 2.5 GB
    # if the budget were ignored (one chunk of 512); their outputs and the inputs already
    # allocated are below 1 MB
    assert growth_mb < 40, f"peak grew by {growth_mb} MB from 128 to 512 inputs"
