"""The runner on synthetic files in torchvision's CIFAR format, to time split CIFAR where the
real data cannot be fetched (a GPU machine without a network): the files have the layout
and pickle format of ``cifar-10-batches-py/`` and ``cifar-100-python/`` (each class a random
template plus noise, every class equally often, ``--scale`` times CIFAR's sizes: 50,000
training and 10,000 test images each), torchvision's checksum check is accepted for them,
and ``fromp_bench``'s command line runs with the arguments after ``--``:

    python -m studies.synthetic_cifar --scale 1 -- split-cifar --strategies fromp \\
        --device cuda --epochs 1 --seeds 1 --data-root DIR --out OUT

The files are written under the runner's ``--data-root`` (required) when they are not there
at this scale already (``synthetic-cifar.json`` records it), and never over real CIFAR files
(a folder without that record is refused). Timing only: the accuracies mean nothing.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from pathlib import Path

import numpy as np

STAMP = "synthetic-cifar.json"
#: (folder, {file: (examples at scale 1, label key)}, meta file, its key, classes)
LAYOUT = (
    ("cifar-10-batches-py",
     {**{f"data_batch_{i}": (10_000, "labels") for i in range(1, 6)},
      "test_batch": (10_000, "labels")}, "batches.meta", "label_names", 10),
    ("cifar-100-python", {"train": (50_000, "fine_labels"), "test": (10_000, "fine_labels")},
     "meta", "fine_label_names", 100),
)  # fmt: skip


def write(root: Path, scale: float, seed: int = 0) -> None:
    """The synthetic files under ``root`` at ``scale`` (nothing when they are there)."""
    stamp = root / STAMP
    if stamp.exists() and json.loads(stamp.read_text()) == {"scale": scale, "seed": seed}:
        return
    for folder, *_ in LAYOUT:
        if (root / folder).exists() and not stamp.exists():
            raise SystemExit(
                f"{root / folder} exists and is not synthetic: give another --data-root"
            )
    rng = np.random.default_rng(seed)
    for folder, files, meta, key, classes in LAYOUT:
        (root / folder).mkdir(parents=True, exist_ok=True)
        templates = rng.integers(0, 256, size=(classes, 3 * 32 * 32), dtype=np.int16)
        for name, (n, labels_key) in files.items():
            n = max(classes, round(n * scale))
            labels = np.arange(n) % classes
            noise = rng.integers(-48, 49, size=(n, 3 * 32 * 32), dtype=np.int16)
            data = np.clip(templates[labels] + noise, 0, 255).astype(np.uint8)
            with open(root / folder / name, "wb") as fh:
                pickle.dump({"data": data, labels_key: labels.tolist()}, fh)
        with open(root / folder / meta, "wb") as fh:
            pickle.dump({key: [f"class{i}" for i in range(classes)]}, fh)
    stamp.write_text(json.dumps({"scale": scale, "seed": seed}))


def accept_synthetic_files() -> None:
    """torchvision's checksum checks of the CIFAR files pass (the files are synthetic)."""
    import torchvision.datasets as tvd

    tvd.CIFAR10._check_integrity = lambda self: True  # type: ignore[method-assign]
    tvd.cifar.check_integrity = lambda path, md5=None: True  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    ours, runner = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(prog="python -m studies.synthetic_cifar",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--scale", type=float, default=1.0, help="times CIFAR's sizes")
    args = p.parse_args(ours)
    if not (0 < args.scale <= 1):
        raise SystemExit(f"--scale must be in (0, 1], got {args.scale}")
    if "--data-root" not in runner:
        raise SystemExit("the runner's arguments (after --) must give --data-root")
    root = Path(runner[runner.index("--data-root") + 1])
    write(root, args.scale)
    accept_synthetic_files()
    from fromp_bench.__main__ import main as run

    return run(runner)


if __name__ == "__main__":
    sys.exit(main())
