"""studies/avalanche_models.py refuses a diverged run."""

from __future__ import annotations

import pytest
import torch


def test_the_avalanche_study_refuses_a_diverged_run():
    from types import SimpleNamespace

    from studies.avalanche_models import check_trained

    net = torch.nn.Linear(2, 2)
    check_trained(SimpleNamespace(model=net, loss=torch.tensor(0.3)), "ok")
    with pytest.raises(RuntimeError, match="loss is not finite"):
        check_trained(SimpleNamespace(model=net, loss=torch.tensor(float("nan"))), "x")
    with torch.no_grad():
        net.weight[0, 0] = float("inf")
    with pytest.raises(RuntimeError, match="weights weight are not finite"):
        check_trained(SimpleNamespace(model=net, loss=torch.tensor(0.3)), "x")
