"""The DNN2GP kernel now against the kernel of an earlier revision, side by side in one process.

    python -m studies.kernel_vs_revision [--rev c35553b~1] [--repo DIR] [--n 1024]
                                                    [--repeats 3]
                                            [--data-root DIR] [--out FILE]

A regression check for speed: ``fromp/gp.py`` of ``--rev`` (``git show REV:fromp/gp.py``,
loaded as a separate module beside the current package; it must import against the current
``fromp``) and the current :class:`fromp.gp.GP` compute the kernel of split MNIST's
``MultiHeadMLP(784, (256, 256), 5 heads of 2)`` (head 0, random diagonal posterior) on the
first ``--n`` MNIST test images (uniform noise of MNIST's shape when MNIST is not found; the
output says so), per-class blocks ``[C, N, N]`` and the full ``[N, C, N, C]`` kernel, each
with its own default chunking. The two run alternately ``--repeats`` times after a warm-up,
on one thread; times are process CPU seconds. The default revision is the last one before
the kernel was rebuilt on :mod:`fromp.curvature.capture`. Results (with the command, the maximum
relative difference of the kernels, and the time ratios) go to ``--out``
(``benchmarks/results/kernel_vs_revision.json``).
"""

from __future__ import annotations

import importlib.util
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from studies import harness
from studies.kernel_speed import _posterior, load_images, make_model

__all__ = ["main"]

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


#: where the GP's module lives: ``fromp/gp/process.py`` since 0.4, ``fromp/gp.py`` before
GP_PATHS = ("fromp/gp/process.py", "fromp/gp.py")


def load_revision(rev: str, repo: Path = ROOT) -> Any:
    """The GP's module (:data:`GP_PATHS`) at git revision ``rev`` of the repository ``repo``
    as a module (``fromp._gp_at_rev``)."""
    msg = ""
    for where in GP_PATHS:
        try:
            src = subprocess.run(
                ["git", "show", f"{rev}:{where}"], cwd=repo, check=True,
                capture_output=True, text=True,
            ).stdout  # fmt: skip
            break
        except (OSError, subprocess.CalledProcessError) as err:
            msg = (getattr(err, "stderr", "") or str(err)).strip()
    else:
        raise SystemExit(f"--rev {rev!r}: cannot read {' or '.join(GP_PATHS)} there ({msg})")
    path = Path(tempfile.mkdtemp()) / "gp_at_rev.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("fromp._gp_at_rev", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = harness.parser(__name__, __doc__)
    parser.add_argument("--rev", default="c35553b~1", help="git revision to compare with")
    parser.add_argument("--n", type=int, default=1024, help="images in the kernel")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--repo", type=Path, default=ROOT, help="git repository holding --rev (default: this one)"
    )
    parser.add_argument("--data-root", default=None, help="holds MNIST/raw (else $FROMP_DATA)")
    harness.add_out(parser, RESULTS / "kernel_vs_revision.json")
    args = parser.parse_args(argv)
    harness.prepare_out(args.out)
    if args.n < 2 or args.repeats < 1:
        parser.error("need --n >= 2 and --repeats >= 1")
    torch.set_num_threads(1)
    from fromp.gp.process import GP

    old_mod = load_revision(args.rev, args.repo)
    x, source = load_images(args.n, args.data_root)
    _, view = make_model("mlp")
    post = _posterior(view)
    gps = {"revision": old_mod.GP(view, post, "categorical"), "now": GP(view, post, "categorical")}
    print(f"data: {source}, n={args.n}, revision {args.rev}")
    report: dict[str, Any] = {
        "revision": args.rev,
        "data": source,
        "n": args.n,
        "threads": 1,
        "seconds": "process CPU time (shared machine; the two alternate, so load hits both)",
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "kernels": {},
    }
    for kind, diag in (("per_class", True), ("full", False)):
        times: dict[str, list[float]] = {k: [] for k in gps}
        outs: dict[str, torch.Tensor] = {}
        for g in gps.values():
            g.kernel(x[:2], diagonal_outputs=diag)  # warm-up
        for _ in range(args.repeats):
            for name, g in gps.items():
                t0 = time.process_time()
                outs[name] = g.kernel(x, diagonal_outputs=diag)
                times[name].append(time.process_time() - t0)
        ref = outs["revision"]
        rel = float((outs["now"] - ref).abs().max() / ref.abs().max())
        best = {k: min(v) for k, v in times.items()}
        report["kernels"][kind] = {
            "seconds": times,
            "best": best,
            "ratio_now_over_revision": best["now"] / best["revision"],
            "max_rel_diff": rel,
        }
        print(f"{kind:9s}: revision {best['revision']:.2f} s, now {best['now']:.2f} s "
              f"(x{best['now'] / best['revision']:.2f}), max rel diff {rel:.1e}")  # fmt: skip
    harness.write_record(args.out, report, module=__name__, argv=argv, indent=1)
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
