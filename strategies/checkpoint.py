"""Save a strategy mid-stream in a user's own Avalanche loop and resume it exactly.

One file holds everything the next experience depends on: the model's ``state_dict``
(with an Avalanche dynamic module's grown heads and masks), the optimizer's state, the
state of every method plugin of :mod:`fromp_avalanche` (FROMP's memorable sets and GGN terms,
EWC's anchors and Fisher, VCL's priors), the number of experiences trained, and the RNG
states (Python, NumPy, torch CPU and every CUDA device) that drive shuffling and sampling.

Usage::

    for i, exp in enumerate(stream):
        if i < start:
            continue
        strategy.train(exp)
        save_checkpoint(strategy, "ckpt.pt", experiences_done=i + 1)

    # later, in a fresh process, with the strategy built as before:
    start = load_checkpoint(strategy, "ckpt.pt", stream)

Safety and integrity: the file holds only tensors and plain containers (numbers, strings,
lists, tuples, dicts) and is read with ``torch.load(..., weights_only=True)``, so a crafted
file cannot run code: a checkpoint that needs code to load is refused in one line naming it
(re-create it by saving again with this version). It is written atomically (a temporary file,
flushed, then renamed) with its SHA-256 in ``<path>.sha256`` beside it, written the same way;
loading refuses a missing or mismatched checksum, a truncated file, missing keys, plugins of
another method and weights of other names or shapes, all before the strategy's model,
optimizer or plugins are changed.

Loading reads the file on the CPU (``map_location="cpu"``, so a GPU checkpoint opens on a
machine without one) and then moves each tensor to where it belongs: the model's and the
optimizer's state into the model's device, the method's into the model's device.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import os
import pickle
import random
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "CheckpointError",
    "get_rng_state",
    "load_checkpoint",
    "read_checked",
    "save_checkpoint",
    "set_rng_state",
    "write_checked",
]

#: The keys every :func:`save_checkpoint` file holds.
KEYS = ("experiences_done", "model", "optimizer", "plugins", "rng")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, damaged, unchecked, needing code to load, or
    of another strategy (one-line message naming the file)."""


# ----------------------------------------------------------------------- RNG states
def get_rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU and all CUDA generators' states, as tensors and plain
    containers (NumPy's key array as an int64 tensor)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()  # noqa: NPY002 (global state)
    return {
        "python": random.getstate(),
        "numpy": (
            str(kind),
            torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        ),
        "torch": torch.get_rng_state(),
        "cuda": list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else [],
    }


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore :func:`get_rng_state` (CUDA states only where CUDA is available and the
    device count matches; a CPU-only checkpoint leaves CUDA generators as they are). NumPy's
    key array may be a tensor (this version) or an array (older files)."""
    cuda = list(state.get("cuda") or [])
    if cuda and torch.cuda.is_available() and len(cuda) != torch.cuda.device_count():
        raise CheckpointError(
            f"checkpoint holds RNG states of {len(cuda)} CUDA devices, this machine has "
            f"{torch.cuda.device_count()}"
        )
    random.setstate(_tuples(state["python"]))
    kind, keys, *rest = state["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
    np.random.set_state((kind, keys.astype(np.uint32), *rest))  # noqa: NPY002
    torch.set_rng_state(state["torch"].cpu())
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in cuda])


def _tuples(obj: Any) -> Any:
    """``random.setstate`` needs tuples where a round trip may have left lists."""
    return tuple(_tuples(v) for v in obj) if isinstance(obj, list | tuple) else obj


# ----------------------------------------------------------------------- files
def _sum_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def write_checked(path: str | os.PathLike, state: Any) -> None:
    """Write ``state`` (tensors and plain containers) to ``path`` atomically with its SHA-256
    in ``path.sha256``: each file's bytes go to a temporary file, are flushed to disk and then
    renamed over the target, so a crash leaves the previous pair whole. The state is checked
    to load with ``weights_only=True`` before anything is written."""

    path = Path(path)
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"checkpoint {path}: the state holds objects that need code to load "
            f"({_first_line(err)}); save tensors and plain containers only"
        ) from err
    path.parent.mkdir(parents=True, exist_ok=True)
    for target, payload in ((path, data), (_sum_path(path), hashlib.sha256(data).hexdigest())):
        tmp = target.with_name(target.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(payload if isinstance(payload, bytes) else payload.encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)


def _first_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return (text[:200] if text else type(err).__name__).rstrip(".")


def _numpy_rng_globals() -> list[Any]:
    """The NumPy names an older file's RNG state needs (a ``uint32`` array): data, no code."""
    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def read_checked(
    path: str | os.PathLike,
    *,
    hint: str = "",
    checksum: bool = True,
    what: str = "checkpoint",
    unchecked: str = "",
) -> Any:
    """The content of a file written by :func:`write_checked`, read on the CPU with
    ``torch.load(..., weights_only=True)``.

    Refused with :class:`CheckpointError`, one line naming the file (and ``hint``, e.g. what
    to do): a missing file or a directory, an empty file, a missing or mismatched
    ``.sha256`` (``checksum=True``), a file that needs code to load (its pickle, in torch's
    zip or legacy format or a plain pickle, names functions or classes beyond tensors and
    plain containers: they are named, read from the opcodes, and nothing of it is run), and a
    truncated or unreadable one (never with torch's advice to load with
    ``weights_only=False``). ``unchecked``: what to do about a missing checksum (said
    in that message instead of ``hint``).
    """
    path = Path(path)
    tail = f"; {hint}" if hint else ""
    if path.is_dir():
        raise CheckpointError(f"{what} {path} is a directory, expected a file{tail}")
    if not path.is_file():
        raise CheckpointError(f"{what} {path} does not exist{tail}")
    if path.stat().st_size == 0:
        raise CheckpointError(f"{what} {path} is empty{tail}")
    if checksum:
        sums = _sum_path(path)
        if not sums.is_file():
            todo = f"; {unchecked}" if unchecked else tail
            raise CheckpointError(f"{what} {path} has no checksum file {sums.name}{todo}")
        if hashlib.sha256(path.read_bytes()).hexdigest() != sums.read_text().strip():
            raise CheckpointError(f"{what} {path} does not match its checksum {sums.name} (a "
                                  f"damaged or truncated file){tail}")  # fmt: skip
    try:
        with torch.serialization.safe_globals(_numpy_rng_globals()), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected pickle protocol")  # refused next
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # pickle, zip and EOF errors come in many types
        code = _code_needed(path)
        if code:
            raise CheckpointError(
                f"{what} {path} needs code to load ({', '.join(code[:4])}), refused: a "
                "checkpoint must hold tensors and plain containers only; re-create it with "
                f"this version (rerun the job, or save the state again){tail}"
            ) from err
        raise CheckpointError(
            f"{what} {path} cannot be read ({type(err).__name__}: {_load_reason(err)}){tail}"
        ) from err


def _load_reason(err: BaseException) -> str:
    """The reason of a failed load in one line, without torch's advice to load with
    ``weights_only=False`` (which would run the file's code): of a weights-only refusal only
    the unpickler's own finding is kept."""
    text = str(err)
    if "Weights only load failed" in text:
        lines = [ln.strip() for ln in text.splitlines()[1:] if ln.strip()]
        kept = [ln for ln in lines if "weights_only" not in ln and "torch.load" not in ln]
        text = " ".join(kept) or "a weights-only load refused it"
    return _first_line(err if not text else RuntimeError(text))


#: Opcodes that push a string (a module or a name for ``STACK_GLOBAL``).
_STRING_OPS = {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "SHORT_BINUNICODE",
               "BINUNICODE", "BINUNICODE8"}  # fmt: skip
#: A legacy ``torch.save`` file is five pickles back to back (magic number, protocol, system
#: information, the object, the storage keys), then raw storage bytes.
_LEGACY_PICKLES = 5


def _pickle_globals(data: bytes) -> list[str]:
    """The ``module.name`` of every function or class the pickles in ``data`` import
    (``GLOBAL``, ``INST``, ``STACK_GLOBAL``), in order, read from the opcodes with
    :mod:`pickletools`; nothing is run. ``data`` holds up to five pickles back to back (a
    plain pickle, or a legacy, non-zip ``torch.save`` file); the scan stops at the first bytes
    that are not a pickle (a legacy file's raw storages)."""
    import pickletools

    names: list[str] = []
    stream = io.BytesIO(data)
    for _ in range(_LEGACY_PICKLES):
        start = stream.tell()
        if start >= len(data):
            break
        memo: dict[int, Any] = {}
        pushed: list[Any] = []  # the strings pushed so far (names of STACK_GLOBAL)
        try:
            for op, arg, _pos in pickletools.genops(stream):
                name = op.name
                if name in _STRING_OPS:
                    pushed.append(arg if isinstance(arg, str) else None)
                elif name in ("GLOBAL", "INST"):
                    names.append(_global_name(*str(arg).split(" ", 1)))
                elif name == "STACK_GLOBAL" and len(pushed) >= 2:
                    module, attr = pushed[-2], pushed[-1]
                    ok = isinstance(module, str) and isinstance(attr, str)
                    names.append(_global_name(module, attr) if ok else "<computed name>")
                elif name == "MEMOIZE":
                    memo[len(memo)] = pushed[-1] if pushed else None
                elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                    memo[int(arg)] = pushed[-1] if pushed else None
                elif name in ("GET", "BINGET", "LONG_BINGET"):
                    pushed.append(memo.get(int(arg)))
        except Exception:  # not (or no longer) a pickle: raw bytes after the pickles
            break
        if stream.tell() == start:
            break
    return names


def _global_name(module: str, name: str = "") -> str:
    """``module.name`` as unpickling would import it (Python 2 names, which protocols 0-2
    write, mapped as :mod:`pickle` maps them: ``__builtin__.exec`` is ``builtins.exec``)."""
    import _compat_pickle

    module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
    return f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{name}"


def _archive_pickles(path: Path) -> list[bytes]:
    """The pickles of a file: a zip ``torch.save`` file's ``data.pkl``, else the file."""
    import zipfile

    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            return [z.read(n) for n in z.namelist() if n.endswith("data.pkl")]
    return [path.read_bytes()]


def _code_needed(path: Path) -> list[str]:
    """The functions and classes a file's pickles name beyond those :func:`read_checked`
    allows (torch's weights-only set and NumPy's RNG array), zip, legacy ``torch.save`` or
    plain pickle alike (read from the opcodes by :func:`_pickle_globals`; nothing is run);
    [] when it names none or cannot be scanned."""
    from torch import _weights_only_unpickler as weights_only

    allowed = {f"{g.__module__}.{g.__qualname__}" for g in _numpy_rng_globals()}
    allowed |= {"numpy.core.multiarray._reconstruct", "numpy._core.multiarray._reconstruct"}
    allowed |= set(weights_only._get_allowed_globals())
    try:
        names = [n for data in _archive_pickles(path) for n in _pickle_globals(data)]
    except (OSError, ValueError):  # a damaged zip: reported as unreadable
        return []
    out = [n for n in names if n not in allowed and not n.startswith("numpy.dtypes.")]
    return list(dict.fromkeys(out))


# ----------------------------------------------------------------------- strategies
def _method_plugins(strategy: Any) -> list[Any]:
    """The strategy's plugins from :mod:`fromp_avalanche` that carry state."""
    return [
        p
        for p in strategy.plugins
        if type(p).__module__.startswith("fromp_avalanche.")
        and callable(getattr(type(p), "state_dict", None))
        and callable(getattr(type(p), "load_state_dict", None))
    ]


def save_checkpoint(strategy: Any, path: str | os.PathLike, *, experiences_done: int) -> None:
    """Write ``strategy``'s full state after ``experiences_done`` experiences to ``path``
    and its SHA-256 to ``path.sha256`` (:func:`write_checked`: atomic, an interrupted save
    leaves the old files)."""
    if isinstance(experiences_done, bool) or not isinstance(experiences_done, int):
        raise ValueError(f"experiences_done must be an int >= 0, got {experiences_done!r}")
    if experiences_done < 0:
        raise ValueError(f"experiences_done must be >= 0, got {experiences_done}")
    state = {
        "experiences_done": int(experiences_done),
        "model": strategy.model.state_dict(),
        "optimizer": strategy.optimizer.state_dict(),
        "plugins": [
            {"class": type(p).__qualname__, "state": p.state_dict()}
            for p in _method_plugins(strategy)
        ],
        "rng": get_rng_state(),
    }
    write_checked(path, state)


def _check_state(state: Any, path: Path) -> int:
    """Keys and types of a :func:`save_checkpoint` file; the experiences it trained."""
    if not isinstance(state, Mapping):
        raise CheckpointError(f"checkpoint {path} holds a {type(state).__name__}, not a "
                              "strategy checkpoint (a dict)")  # fmt: skip
    missing = [k for k in KEYS if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path} is missing keys {missing} (a strategy "
                              f"checkpoint holds {list(KEYS)})")  # fmt: skip
    done = state["experiences_done"]
    if isinstance(done, bool) or not isinstance(done, int) or done < 0:
        raise CheckpointError(f"checkpoint {path}: experiences_done must be an int >= 0, got "
                              f"{done!r}")  # fmt: skip
    for key, kind in (("model", Mapping), ("optimizer", Mapping), ("plugins", list),
                      ("rng", Mapping)):  # fmt: skip
        if not isinstance(state[key], kind):
            raise CheckpointError(f"checkpoint {path}: {key} is a {type(state[key]).__name__}, "
                                  f"expected a {kind.__name__}")  # fmt: skip
    opt = state["optimizer"]
    if "state" not in opt or "param_groups" not in opt:
        raise CheckpointError(f"checkpoint {path}: optimizer state has no state/param_groups")
    for key in ("python", "numpy", "torch"):
        if key not in state["rng"]:
            raise CheckpointError(f"checkpoint {path}: rng is missing {key!r}")
    for i, d in enumerate(state["plugins"]):
        if not isinstance(d, Mapping) or "class" not in d or "state" not in d:
            raise CheckpointError(f"checkpoint {path}: plugins[{i}] has no class/state")
    return done


def _check_weights(model: torch.nn.Module, saved: Mapping[str, Any], path: Path) -> None:
    """The saved weights have the model's names and shapes (strict, as ``load_state_dict``;
    a model with its own ``load_state_dict``, e.g. a mean-field twin that grows its
    variances on loading, is checked on the shapes of the names both hold)."""
    mine = model.state_dict()
    missing = sorted(set(mine) - set(saved))
    extra = sorted(set(saved) - set(mine))
    own = type(model).load_state_dict is not torch.nn.Module.load_state_dict
    if (missing or extra) and not own:
        raise CheckpointError(
            f"checkpoint {path} does not fit the strategy's model: missing {missing[:5]}, "
            f"unexpected {extra[:5]}"
        )
    for name, value in mine.items():
        if name not in saved:
            continue
        got = saved[name]
        if not isinstance(got, torch.Tensor) or got.shape != value.shape:
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise CheckpointError(f"checkpoint {path}: {name} has shape {shape}, the "
                                  f"strategy's model {tuple(value.shape)}")  # fmt: skip


def _grows(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds an Avalanche dynamic module (one that adapts to experiences)."""
    from avalanche.models import DynamicModule

    return any(isinstance(m, DynamicModule) for m in model.modules())


def _adapted_copy(strategy: Any, stream: Sequence[Any], done: int) -> torch.nn.Module:
    """A copy of the strategy's model adapted to the first ``done`` experiences (the
    strategy's own model is not touched)."""
    model = copy.deepcopy(strategy.model)
    model.train()  # Avalanche's masks record classes in training mode only
    saved = strategy.experience
    try:
        for i in range(done):
            strategy.experience = stream[i]
            model = strategy.model_adaptation(model)
    finally:
        strategy.experience = saved
    return model


def load_checkpoint(
    strategy: Any,
    path: str | os.PathLike,
    stream: Sequence[Any] | None = None,
    *,
    map_location: str | torch.device = "cpu",
    checksum: bool = True,
) -> int:
    """Restore :func:`save_checkpoint` into a freshly built ``strategy`` (same model class,
    optimizer and method settings); returns the number of experiences already trained.

    ``stream`` (the training stream) is needed for models that grow (Avalanche dynamic
    modules): the model is first adapted to the experiences already trained, so that its
    parameters have the saved shapes. The file is read on the CPU with
    ``weights_only=True`` (``map_location`` is kept for compatibility: reading is always on
    the CPU) and every tensor is then moved to the model's device. ``checksum=False`` reads a
    file without its ``.sha256`` (one written before checksums; save it again to add one).

    Raises:
        CheckpointError: one line naming the file: missing, a directory, empty, truncated, a
            missing or mismatched checksum, a file needing code to load, missing keys, the
            plugins of another method, or weights of other names or shapes; checked before
            the model, the optimizer or a plugin is changed. A plugin refusing its own state
            (other settings) leaves the model's weights and the optimizer's state as they
            were.
    """
    del map_location  # always the CPU, then each tensor to its device
    path = Path(path)
    todo = "load_checkpoint(..., checksum=False) reads a file saved before checksums"
    state = read_checked(path, checksum=checksum, unchecked=f"{todo}; save it again")
    done = _check_state(state, path)
    plugins = _method_plugins(strategy)
    saved = state["plugins"]
    if [type(p).__qualname__ for p in plugins] != [d["class"] for d in saved]:
        raise CheckpointError(
            f"checkpoint {path} holds the state of plugins {[d['class'] for d in saved]}, the "
            f"strategy has {[type(p).__qualname__ for p in plugins]}"
        )
    if stream is not None and len(stream) < done:
        raise CheckpointError(
            f"checkpoint {path} was taken after {done} experiences, the stream has {len(stream)}"
        )
    target = _adapted_copy(strategy, stream, done) if stream is not None else strategy.model
    try:
        _check_weights(target, state["model"], path)
    except CheckpointError as err:
        if stream is None and _grows(strategy.model):
            raise CheckpointError(
                f"{err}; the model grows with the experiences (Avalanche dynamic modules): "
                "pass load_checkpoint(..., stream=the training stream)"
            ) from None
        raise
    cuda = list(state["rng"].get("cuda") or [])
    if cuda and torch.cuda.is_available() and len(cuda) != torch.cuda.device_count():
        raise CheckpointError(f"checkpoint {path} holds RNG states of {len(cuda)} CUDA devices, "
                              f"this machine has {torch.cuda.device_count()}")  # fmt: skip

    # everything checked: now change the strategy
    if stream is not None:
        was_training = strategy.model.training
        strategy.model.train()
        for i in range(done):
            strategy.experience = stream[i]
            strategy.model = strategy.model_adaptation()
        strategy.model.train(was_training)
        strategy.experience = None
    before = {k: v.detach().clone() for k, v in strategy.model.state_dict().items()}
    opt_before = copy.deepcopy(strategy.optimizer.state_dict())
    strategy.model.load_state_dict(state["model"])
    # Avalanche's first make_optimizer maps names to parameters and clears the state: do it
    # now, so that the state loaded next survives the next experience's update
    strategy.optimized_param_id = None
    if hasattr(strategy, "make_optimizer"):
        strategy.make_optimizer(reset_optimizer_state=True)
    device = next(strategy.model.parameters()).device
    try:
        strategy.optimizer.load_state_dict(state["optimizer"])
        for p, d in zip(plugins, saved):
            if "device" in _kwargs(p.load_state_dict):
                p.load_state_dict(d["state"], device=device)
            else:
                p.load_state_dict(d["state"])
    except (ValueError, KeyError, TypeError, RuntimeError) as err:
        strategy.model.load_state_dict(before)
        with contextlib.suppress(ValueError, KeyError):  # groups of another size: left empty
            strategy.optimizer.load_state_dict(opt_before)
        raise CheckpointError(
            f"checkpoint {path} cannot be restored into this strategy "
            f"({type(err).__name__}: {_first_line(err)})"
        ) from err
    set_rng_state(state["rng"])
    return done


def _kwargs(fn: Any) -> set[str]:
    import inspect

    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()
