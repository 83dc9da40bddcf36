"""What a machine with a GPU but no package index needs for ``make gpu-check``, gathered in
one folder that git ignores (``.gpu-bundle/``), and the one command to run there
(``make gpu-bundle``; docs/gpu.md, "Running the GPU check").

    python -m studies.gpu_bundle [--dest .gpu-bundle] [--data DIR] [--budget 400]
                                            [--dry-run]

The folder holds

* ``whl/``: wheels of Avalanche and the small packages it imports that such a machine lacks
  (its image has torch, torchvision, pytest, matplotlib, scikit-learn, tqdm, tensorboard,
  torchmetrics, psutil): :data:`WHEELS`, at the versions of ``constraints.txt``, fetched with
  ``pip download --no-deps`` for CPython 3.12 on manylinux x86-64 (GPUtil, published only as
  a source archive, is built here into a pure-Python wheel with ``pip wheel --no-deps``);
* ``stub/wandb/``: a stand-in for Weights & Biases, which Avalanche's metrics import when they
  load but which fromp never uses (the real package and its own dependencies are tens of MB);
  any use of it raises ``AttributeError`` naming the stand-in;
* ``data/MNIST/raw/*.gz``: the four MNIST files (about 11 MB), copied from ``--data``
  (default ``$FROMP_DATA``, else ``../shared/data`` beside the checkout).

It prints the command (at most 2,000 characters) and the paths to carry with it: the command
installs the wheels into ``/tmp/site``, puts the checkout, the wheels and the stand-in on
``PYTHONPATH`` and runs ``bash studies/gpu_step.sh $OUT B`` (the GPU check under ``--budget
B``, then the step profile, each logged under ``$OUT``). ``--dry-run`` checks the sources
and prints the command without fetching or copying anything.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from studies import harness

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ".gpu-bundle"
WHEELS = (
    "avalanche-lib",
    "dill",
    "gdown",
    "beautifulsoup4",
    "soupsieve",
    "pytorchcv",
    "qpsolvers",
    "GPUtil",
)
SOURCE_ONLY = {"GPUtil"}
MNIST = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
COMMAND_LIMIT = 2000
CARRY_LIMIT_MB = 64
WANDB_STUB = '''"""A stand-in for wandb on the GPU check's machine (see gpu_bundle.py):
Avalanche imports wandb when its metrics load; fromp never uses it."""


def __getattr__(name):
    raise AttributeError(f"wandb.{name}: wandb is not installed here (a stand-in for imports)")
'''


def pins(constraints: Path, names: tuple[str, ...] = WHEELS) -> dict[str, str]:
    """``{name: version}`` of ``names`` from ``constraints`` (``NAME==VERSION`` lines, names
    compared as pip does: case and ``-``/``_``/``.`` ignored); refuses a missing one."""
    norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()  # noqa: E731
    found: dict[str, str] = {}
    for line in constraints.read_text().splitlines():
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*==\s*([^\s;#]+)", line)
        if m:
            found[norm(m.group(1))] = m.group(2)
    missing = [n for n in names if norm(n) not in found]
    if missing:
        raise ValueError(f"{constraints}: no pinned version (NAME==VERSION) of {missing}")
    return {n: found[norm(n)] for n in names}


def device_command(dest: str = BUNDLE, budget: float = 400) -> str:
    """The command for the device machine (run from the checkout's root there)."""
    site = "/tmp/site"
    return (
        "set -o pipefail; "
        f"python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
        f"--target {site} {dest}/whl/*.whl || exit 1; "
        "mkdir -p /tmp/names; "
        + "".join(f"ln -sfn $PWD/{d} /tmp/names/{n}; " for n, d in harness.IMPORT_NAMES.items())
        + f"export PYTHONPATH=$PWD:/tmp/names:{site}:$PWD/{dest}/stub PYTHONUNBUFFERED=1 "
        f"FROMP_DATA=$PWD/{dest}/data; nvidia-smi -L; "
        f"bash studies/gpu_step.sh $OUT {budget:g}"
    )


def mnist_source(arg: str | None) -> Path:
    """``--data``, else ``$FROMP_DATA``, else ``../shared/data`` beside the checkout."""
    return Path(arg or os.environ.get("FROMP_DATA") or ROOT.parent / "shared" / "data")


def check_sources(data: Path, dest: Path) -> None:
    """Refuse, before any work, MNIST missing under ``data`` or a ``dest`` git would track."""
    raw = data / "MNIST" / "raw"
    missing = [f for f in MNIST if not (raw / f).is_file()]
    if missing:
        raise ValueError(f"--data {data}: {raw} lacks {missing} (the MNIST .gz files)")
    try:
        rel = dest.resolve().relative_to(ROOT)
    except ValueError as err:
        raise ValueError(
            f"--dest {dest}: must lie inside the checkout {ROOT} (it travels with the working tree)"
        ) from err
    if shutil.which("git") and (ROOT / ".git").exists():
        ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", f"{rel}/x"])
        if ignored.returncode != 0:
            raise ValueError(
                f"--dest {dest}: git does not ignore it; add /{rel}/ to .gitignore "
                "(a bundle must never be committed)"
            )


def fetch(dest: Path, versions: dict[str, str]) -> None:
    """Wheels into ``dest/whl`` (pip download, or pip wheel for source-only packages)."""
    whl = dest / "whl"
    whl.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    binary = [f"{n}=={v}" for n, v in versions.items() if n not in SOURCE_ONLY]
    plats = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run(
        [
            *pip,
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--implementation",
            "cp",
            *plats,
            "-d",
            str(whl),
            *binary,
        ],
        check=True,
    )
    for n in SOURCE_ONLY & set(versions):
        subprocess.run(
            [*pip, "wheel", "--no-deps", "-w", str(whl), f"{n}=={versions[n]}"], check=True
        )


def assemble(dest: Path, data: Path) -> None:
    """The wandb stand-in and the MNIST files into ``dest``."""
    stub = dest / "stub" / "wandb"
    stub.mkdir(parents=True, exist_ok=True)
    (stub / "__init__.py").write_text(WANDB_STUB)
    raw = dest / "data" / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for f in MNIST:
        shutil.copyfile(data / "MNIST" / "raw" / f, raw / f)


def size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__name__, __doc__)
    p.add_argument("--dest", type=Path, default=ROOT / BUNDLE, help="the bundle's folder")
    p.add_argument("--data", default=None, help="data root holding MNIST/raw/*.gz")
    p.add_argument("--budget", type=float, default=400.0, help="gpu_check's --budget (s)")
    p.add_argument("--dry-run", action="store_true", help="check and print; fetch nothing")
    args = p.parse_args(argv)
    data = mnist_source(args.data)
    try:
        if not 60 <= args.budget <= 420:
            raise ValueError(
                f"--budget must lie in [60, 420] s (one device command runs at most 600 s, "
                f"the step profile up to 150 s after the check), got {args.budget:g}"
            )
        versions = pins(ROOT / "constraints.txt")
        check_sources(data, args.dest)
    except ValueError as err:
        print(f"gpu_bundle: {err}", file=sys.stderr)
        return 2
    rel = args.dest.resolve().relative_to(ROOT).as_posix()
    if not args.dry_run:
        fetch(args.dest, versions)
        assemble(args.dest, data)
        mb = size_mb(args.dest)
        print(
            f"{args.dest}: {mb:.1f} MB (the working tree and carried paths travel within "
            f"{CARRY_LIMIT_MB} MiB)"
        )
    cmd = device_command(rel, args.budget)
    if len(cmd) > COMMAND_LIMIT:
        print(
            f"gpu_bundle: the command has {len(cmd)} characters, over {COMMAND_LIMIT}",
            file=sys.stderr,
        )
        return 2
    print("Device command (run from the repository root; timeout_s 600):")
    print(f"  command: {cmd}")
    print(f'  carry: {shlex.quote(rel)}  (as a list: ["{rel}"])')
    print(
        "Then copy <date>-<device>.json / .md and <date>-cuda-step-profile.json / .md from "
        "the returned files to benchmarks/results/gpu/ and commit them."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
