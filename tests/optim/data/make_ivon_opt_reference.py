"""Write ``ivon_opt_reference.json``: ivon-opt 0.1.3's weights after the README loops of
``tests/optim/ivon_opt_loops.py`` (float64, seeded draws), which ``tests/optim/test_ivon_opt.py``
compares :class:`fromp.IVON` with. ivon-opt is not a dependency of fromp (and is GPL): run
this in a throwaway environment that has it and torch, from the repository root::

    python3 -m venv /tmp/ivonref && /tmp/ivonref/bin/pip install ivon-opt==0.1.3 torch
    PYTHONPATH=. /tmp/ivonref/bin/python tests/optim/data/make_ivon_opt_reference.py

The file (JSON only, a few KB) also holds the initial weights, so that the comparison does
not depend on torch's initialisation."""

from __future__ import annotations

import json
import sys
from importlib.metadata import version
from pathlib import Path

import ivon
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import ivon_opt_loops as loops  # noqa: E402


def _set_group(opt, i, key, value):
    opt.param_groups[i][key] = value  # ivon-opt reads every group key at every step


def main() -> None:
    torch.set_num_threads(1)
    init = loops.flat_weights(loops.model())
    out = {
        "ivon_opt": version("ivon-opt"),
        "torch": torch.__version__,
        "made_by": "tests/optim/data/make_ivon_opt_reference.py",
        "initial_weights": init,
        "cases": {},
    }
    for name, case in loops.CASES.items():
        net = loops.model(init)
        opt = ivon.IVON(loops.param_groups(net, case), *case.get("positional", []),
                        **case["kwargs"])  # fmt: skip
        out["cases"][name] = loops.run(net, opt, case, _set_group)
    path = HERE / "ivon_opt_reference.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
