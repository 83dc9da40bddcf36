"""``fromp.curvature.hooks.forward_hooks``: hooks live exactly for the block, also when it
raises, and a hook's return value replaces the module's output (layer capture relies on it)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fromp.curvature.hooks import forward_hooks


def test_hooks_run_inside_the_block_only_and_are_removed_after_an_error():
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    seen: list[nn.Module] = []
    linears = [net[0], net[2]]
    x = torch.randn(5, 3)
    with forward_hooks(linears, lambda m, i, o: seen.append(m)):
        net(x)
    assert seen == linears
    net(x)
    assert len(seen) == 2  # removed on exit
    with (
        pytest.raises(RuntimeError, match="boom"),
        forward_hooks(linears, lambda m, i, o: seen.append(m)),
    ):
        raise RuntimeError("boom")
    net(x)
    assert len(seen) == 2 and not net[0]._forward_hooks and not net[2]._forward_hooks


def test_a_returned_value_replaces_the_output():
    lin = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    with forward_hooks([lin], lambda m, i, o: torch.zeros_like(o)):
        assert torch.equal(lin(x), torch.zeros(4, 2))
    assert not torch.equal(lin(x), torch.zeros(4, 2))
