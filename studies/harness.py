"""One harness for the studies: their command line, the record they write and how.

Every study is ``python -m studies.NAME ... --out FILE.json``; through this module
each one

* builds its parser with :func:`parser` (``prog`` and description from the study's module,
  the shared options ``--out``, ``--data-root``, ``--seed``, ``--threads``, ``--device`` added
  with one call each);
* checks its output before any work (:func:`prepare_out`: a directory, a path under a file or
  a place it cannot write is refused in one line naming ``--out``);
* writes one JSON record with :func:`write_record`: the command that reproduces it, the
  environment (Python, torch, fromp, machine, threads, device), the study's own keys; written
  atomically (a killed study leaves the previous file whole), and refused when any number in
  it is NaN or infinite (a diverged run is a failed run, never a number in a table) unless the
  study names the keys where a non-finite value is meaningful.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
#: installed import name -> repository folder (pyproject.toml's package-dir)
IMPORT_NAMES = {"fromp_avalanche": "strategies", "fromp_bench": "benchmarks"}


def import_names_dir(root: str | os.PathLike, into: str | os.PathLike) -> Path:
    """A folder of links ``fromp_avalanche -> root/strategies``, ``fromp_bench ->
    root/benchmarks``: put it on ``PYTHONPATH`` (after ``root``) to import a checkout that is
    not installed (a copy of the tree, a machine that receives only the checkout)."""
    into = Path(into)
    into.mkdir(parents=True, exist_ok=True)
    for name, folder in IMPORT_NAMES.items():
        link = into / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(Path(root).resolve() / folder, target_is_directory=True)
    return into


def module_name(module: str) -> str:
    """A study's importable name, also when it runs as ``python -m`` (``__name__`` is then
    ``"__main__"``)."""
    if module == "__main__":
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        if spec is not None and spec.name:
            return spec.name
    return module


def parser(module: str, doc: str | None = None) -> argparse.ArgumentParser:
    """The study's parser: ``prog`` is ``python -m <module>``, the description its docstring's
    first paragraph (``module`` is the study's ``__name__``; ``doc`` its ``__doc__``)."""
    summary = (doc or "").strip().split("\n\n")[0]
    return argparse.ArgumentParser(
        prog=f"python -m {module_name(module)}",
        description=" ".join(summary.split()) or None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_out(p: argparse.ArgumentParser, default: str | os.PathLike | None = None) -> None:
    """``--out FILE.json`` (required when there is no default)."""
    if default is None:
        p.add_argument("--out", type=Path, required=True, help="where the JSON record goes")
    else:
        p.add_argument("--out", type=Path, default=Path(default), help="the JSON record")


def add_data_root(p: argparse.ArgumentParser) -> None:
    """``--data-root`` (else ``$FROMP_DATA``, else ``./data``)."""
    p.add_argument("--data-root", default=None, help="data root (else $FROMP_DATA, else ./data)")


def add_seed(p: argparse.ArgumentParser, default: int = 0) -> None:
    p.add_argument("--seed", type=int, default=default, help="random seed")


def add_threads(p: argparse.ArgumentParser, default: int | None = None) -> None:
    """``--threads N``: torch's intra-op threads (default: torch's own choice)."""
    p.add_argument("--threads", type=int, default=default, help="torch threads")


def set_threads(n: int | None) -> None:
    """Apply ``--threads`` (refusing a count below 1)."""
    if n is None:
        return
    if n < 1:
        raise SystemExit(f"--threads must be a positive integer, got {n}")
    torch.set_num_threads(n)


def command(module: str, argv: Sequence[str] | None) -> str:
    """The command line that reproduces the study (``argv`` None: this process's), its
    output and data paths written ``OUT`` and ``DATA``."""
    from fromp_bench.report import command_line

    args = list(sys.argv[1:] if argv is None else argv)
    return command_line(["python", "-m", module_name(module), *args])


def environment(device: str | torch.device | None = None) -> dict[str, Any]:
    """What the numbers were measured on."""
    import fromp

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "fromp": fromp.__version__,
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }
    dev = torch.device(device) if device is not None else None
    if dev is not None:
        env["device"] = str(dev)
        if dev.type == "cuda" and torch.cuda.is_available():
            env["device_name"] = torch.cuda.get_device_name(dev)
    return env


def sync(device: str | torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA runs kernels asynchronously, so a time
    read without it is the time to queue the work); nothing on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prepare_out(path: str | os.PathLike) -> Path:
    """Check, before any work, that the record can be written at ``path``; returns it.

    Refused in one line naming ``--out``: a directory, a path below a regular file, a folder
    where a file cannot be created (checked by creating and removing one)."""
    out = Path(path)
    if out.is_dir():
        raise SystemExit(f"--out {out}: is a directory; give a file name such as {out}/x.json")
    parent = out.parent
    for p in (parent, *parent.parents):
        if p.exists():
            if not p.is_dir():
                raise SystemExit(f"--out {out}: {p} is a file, not a directory")
            break
    try:
        parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{out.name}.", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise SystemExit(f"--out {out}: cannot write there ({e.strerror or e})") from None
    return out


def non_finite(obj: Any, where: str = "", allow: Iterable[str] = ()) -> list[str]:
    """The key paths (``rows[3].nll``) of the NaN or infinite floats in ``obj``; keys named in
    ``allow`` (a key's last part) are skipped."""
    allow = set(allow)
    found: list[str] = []
    if isinstance(obj, float):
        if not math.isfinite(obj):
            found.append(where or "<value>")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if str(k) not in allow:
                found += non_finite(v, f"{where}.{k}" if where else str(k), allow)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            found += non_finite(v, f"{where}[{i}]", allow)
    return found


def write_record(
    out: str | os.PathLike,
    record: dict[str, Any],
    *,
    module: str,
    argv: Sequence[str] | None,
    device: str | torch.device | None = None,
    allow_non_finite: Iterable[str] = (),
    indent: int = 2,
) -> dict[str, Any]:
    """Write ``record`` (with ``command`` and ``environment`` added where it has none) to
    ``out`` atomically; refuse it when a number in it is NaN or infinite outside the keys in
    ``allow_non_finite``. Returns the record written."""
    full = {"command": command(module, argv), "environment": environment(device), **record}
    bad = non_finite(full, allow=allow_non_finite)
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise SystemExit(
            f"{module_name(module)}: not writing {out}: non-finite numbers at {shown} "
            "(a diverged or failed measurement is refused, not recorded)"
        )
    write_json(out, full, indent=indent)
    return full


def _plain(obj: Any) -> Any:
    """JSON for the values a record may hold beside plain data: paths as strings."""
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise TypeError(f"a study record holds a {type(obj).__name__}, which JSON cannot write")


def write_json(out: str | os.PathLike, obj: Any, *, indent: int = 2) -> None:
    """Write ``obj`` as JSON to ``out`` atomically (a temporary file, then a rename): a study
    killed while writing leaves the previous file whole. Paths are written as strings; any
    other value JSON cannot hold is refused before the file is touched."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(obj, indent=indent, default=_plain) + "\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
