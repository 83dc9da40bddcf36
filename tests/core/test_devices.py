"""Samplers draw on their generator's device and return on the tensors' device: a CPU
generator gives the same draws for tensors on ``cpu``, ``cpu:0`` and (with a GPU) ``cuda``;
a CUDA generator draws on the GPU. CUDA cases skip without a GPU."""

from __future__ import annotations

import pytest
import torch

from fromp.likelihood import get_likelihood
from fromp.posterior import DiagonalGaussian

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = ["cpu", "cpu:0", pytest.param("cuda", marks=CUDA)]


def _draws(device: str, gen_device: str = "cpu"):
    g = torch.Generator(device=gen_device).manual_seed(0)
    q = DiagonalGaussian(torch.zeros(5, device=device), torch.full((5,), 4.0, device=device))
    f = torch.randn(7, 3, generator=torch.Generator().manual_seed(1)).to(device)
    return [
        q.sample(3, generator=g),
        get_likelihood("categorical").sample(f, generator=g),
        get_likelihood("gaussian").sample(f, generator=g),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_cpu_generator_draws_the_same_on_every_device(device):
    ref = _draws("cpu")
    got = _draws(device)
    for r, d in zip(ref, got):
        assert d.device.type == torch.device(device).type
        torch.testing.assert_close(d.cpu(), r, rtol=0, atol=0)


@CUDA
def test_cuda_generator_draws_on_the_gpu():
    got = _draws("cuda", gen_device="cuda")
    assert all(d.is_cuda for d in got)
