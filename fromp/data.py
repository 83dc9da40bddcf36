"""Data discovery and the continual-learning task sequences used throughout the project.

Everything that reads a data set goes through :func:`resolve_data_root`: the root is the
``data_root`` argument (the ``--data-root`` option of the command-line tools), else the
``FROMP_DATA`` environment variable, else ``./data``. The layout is torchvision's::

    <root>/MNIST/raw/train-images-idx3-ubyte[.gz] ...
    <root>/FashionMNIST/raw/...
    <root>/cifar-10-batches-py/...
    <root>/cifar-100-python/...

When the files are missing, torchvision's download is tried; when that fails too,
:class:`DataNotFoundError` names the paths searched, the files expected and how to get them.

A task sequence is a list of :class:`Task`, each holding plain tensors (inputs as float32 in
[0, 1], labels relabelled ``0..k-1`` within the task for multi-head protocols). Nothing here
imports Avalanche; ``strategies.benchmarks`` turns a sequence into an Avalanche benchmark.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "DATA_ENV_VAR",
    "DataNotFoundError",
    "Task",
    "TaskSequence",
    "load_cifar10",
    "load_cifar100",
    "load_fashion_mnist",
    "load_mnist",
    "permuted_mnist",
    "resolve_data_root",
    "split_cifar",
    "split_digits",
    "split_fashion_mnist",
    "split_mnist",
    "split_tasks",
    "synthetic_split",
]

DATA_ENV_VAR = "FROMP_DATA"

_EXPECTED = {
    "MNIST": (
        "MNIST/raw",
        [
            "train-images-idx3-ubyte",
            "train-labels-idx1-ubyte",
            "t10k-images-idx3-ubyte",
            "t10k-labels-idx1-ubyte",
        ],
    ),
    "FashionMNIST": (
        "FashionMNIST/raw",
        [
            "train-images-idx3-ubyte",
            "train-labels-idx1-ubyte",
            "t10k-images-idx3-ubyte",
            "t10k-labels-idx1-ubyte",
        ],
    ),
    "CIFAR10": (
        "cifar-10-batches-py",
        [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"],
    ),
    "CIFAR100": ("cifar-100-python", ["train", "test", "meta"]),
}


class DataNotFoundError(FileNotFoundError):
    """A data set is neither in the data root nor downloadable."""


def resolve_data_root(data_root: str | os.PathLike[str] | None = None) -> Path:
    """The data root: ``data_root`` if given, else ``$FROMP_DATA``, else ``./data``."""
    if data_root is not None and str(data_root) != "":
        return Path(data_root).expanduser()
    env = os.environ.get(DATA_ENV_VAR, "")
    if env:
        return Path(env).expanduser()
    return Path("data")


def _not_found(name: str, root: Path, cause: BaseException | None) -> DataNotFoundError:
    sub, files = _EXPECTED[name]
    where = (root / sub).resolve()
    how = (
        f"Put the files in {where} (torchvision's layout), point --data-root or "
        f"${DATA_ENV_VAR} at a directory that holds '{sub}/', or run where "
        f"torchvision.datasets.{name}(root, download=True) can reach the internet."
    )
    detail = " ".join(str(cause).split())  # one line, whatever the cause printed
    reason = f" Download failed: {type(cause).__name__}: {detail}." if cause else ""
    return DataNotFoundError(
        f"{name} not found. Searched {where} for {', '.join(files)} "
        f"(data root {root.resolve()!s}, from "
        f"{'--data-root / $' + DATA_ENV_VAR + ' / ./data'}).{reason} {how}"
    )


def _torchvision_dataset(name: str, root: Path, train: bool, download: bool):
    import torchvision.datasets as tvd

    cls = {
        "MNIST": tvd.MNIST,
        "FashionMNIST": tvd.FashionMNIST,
        "CIFAR10": tvd.CIFAR10,
        "CIFAR100": tvd.CIFAR100,
    }[name]
    try:
        return cls(str(root), train=train, download=False)
    except (RuntimeError, FileNotFoundError, OSError) as first:
        if not download:
            raise _not_found(name, root, None) from first
        try:
            return cls(str(root), train=train, download=True)
        except Exception as err:  # network errors come in many types
            raise _not_found(name, root, err) from err


def _as_images(data: Tensor | np.ndarray) -> Tensor:
    x = torch.as_tensor(np.asarray(data)).float() / 255.0
    if x.ndim == 4:  # CIFAR: N, H, W, C -> N, C, H, W
        x = x.permute(0, 3, 1, 2).contiguous()
    return x


def _load(
    name: str, data_root: str | os.PathLike[str] | None, download: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    root = resolve_data_root(data_root)
    out = []
    for train in (True, False):
        ds = _torchvision_dataset(name, root, train, download)
        out += [_as_images(ds.data), torch.as_tensor(np.asarray(ds.targets), dtype=torch.long)]
    return out[0], out[1], out[2], out[3]


def load_mnist(
    data_root: str | os.PathLike[str] | None = None, *, download: bool = True
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """MNIST as ``(x_train [60000, 28, 28], y_train [60000], x_test [10000, 28, 28], y_test)``.

    Pixels are float32 in [0, 1] (FROMP's protocol: no normalisation).
    """
    return _load("MNIST", data_root, download)


def load_fashion_mnist(
    data_root: str | os.PathLike[str] | None = None, *, download: bool = True
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Fashion-MNIST, shapes and scaling as :func:`load_mnist`."""
    return _load("FashionMNIST", data_root, download)


def load_cifar10(
    data_root: str | os.PathLike[str] | None = None, *, download: bool = True
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """CIFAR-10 as ``(x_train [50000, 3, 32, 32], y_train, x_test [10000, 3, 32, 32], y_test)``."""
    return _load("CIFAR10", data_root, download)


def load_cifar100(
    data_root: str | os.PathLike[str] | None = None, *, download: bool = True
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """CIFAR-100 (fine labels), shapes as :func:`load_cifar10`."""
    return _load("CIFAR100", data_root, download)


@dataclass
class Task:
    """One task of a continual-learning sequence.

    Attributes:
        train_x: ``[N, ...]`` float inputs.
        train_y: ``[N]`` long labels, ``0..n_classes-1`` within the task.
        test_x: ``[N_test, ...]``.
        test_y: ``[N_test]``.
        task_id: position in the sequence; selects the head of a multi-head model.
        classes: the original class labels of the task, in label order.
    """

    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    task_id: int
    classes: list[int] = field(default_factory=list)

    @property
    def n_classes(self) -> int:
        return len(self.classes)

    def __post_init__(self) -> None:
        for name in ("train", "test"):
            x, y = getattr(self, f"{name}_x"), getattr(self, f"{name}_y")
            if len(x) == 0:
                raise ValueError(f"task {self.task_id}: {name}_x is empty")
            if len(x) != len(y):
                raise ValueError(
                    f"task {self.task_id}: {name}_x has {len(x)} examples but {name}_y has {len(y)}"
                )


@dataclass
class TaskSequence:
    """A named list of tasks with the protocol facts a strategy needs.

    Attributes:
        name: benchmark name, e.g. ``"split-mnist"``.
        tasks: the tasks in training order.
        multi_head: True when each task has its own output head (task-incremental); False for
            a single shared head (domain-incremental, e.g. permuted MNIST).
        input_shape: shape of one input, e.g. ``(1, 28, 28)``.
        n_outputs: width of one head.
    """

    name: str
    tasks: list[Task]
    multi_head: bool
    input_shape: tuple[int, ...]
    n_outputs: int

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self):
        return iter(self.tasks)

    def __getitem__(self, i: int) -> Task:
        return self.tasks[i]

    def subsample(self, n_train: int | None, n_test: int | None, seed: int = 0) -> TaskSequence:
        """A copy keeping the first ``n_train`` / ``n_test`` examples of each task after a
        seeded shuffle (for quick runs and tests)."""
        g = torch.Generator().manual_seed(seed)
        tasks = []
        for t in self.tasks:
            itr = torch.randperm(len(t.train_x), generator=g)[:n_train]
            ite = torch.randperm(len(t.test_x), generator=g)[:n_test]
            tasks.append(
                Task(
                    t.train_x[itr],
                    t.train_y[itr],
                    t.test_x[ite],
                    t.test_y[ite],
                    t.task_id,
                    list(t.classes),
                )
            )
        return TaskSequence(self.name, tasks, self.multi_head, self.input_shape, self.n_outputs)


def split_tasks(
    x_train: Tensor,
    y_train: Tensor,
    x_test: Tensor,
    y_test: Tensor,
    class_groups: Sequence[Sequence[int]],
    *,
    relabel: bool = True,
    first_task_id: int = 0,
) -> list[Task]:
    """Split a labelled data set into tasks, one per group of classes.

    With ``relabel`` the labels of each task become the positions of its classes in the
    group (``0..k-1``), as a multi-head model expects.
    """
    if len(class_groups) == 0:
        raise ValueError("class_groups is empty: expected at least one group of classes")
    tasks = []
    for i, group in enumerate(class_groups):
        group = [int(c) for c in group]
        if len(group) == 0:
            raise ValueError(f"class_groups[{i}] is empty")
        lookup = {c: j for j, c in enumerate(group)}
        parts = []
        for x, y in ((x_train, y_train), (x_test, y_test)):
            mask = torch.isin(y, torch.tensor(group))
            ys = y[mask]
            if relabel:
                ys = torch.tensor([lookup[int(v)] for v in ys.tolist()], dtype=torch.long)
            parts += [x[mask], ys]
        if len(parts[0]) == 0:
            raise ValueError(f"task {i}: no training examples of classes {group}")
        tasks.append(Task(*parts, task_id=first_task_id + i, classes=group))
    return tasks


def _pairs(n_classes: int) -> list[list[int]]:
    return [[c, c + 1] for c in range(0, n_classes, 2)]


def split_mnist(
    data_root: str | os.PathLike[str] | None = None, *, download: bool = True
) -> TaskSequence:
    """Split MNIST as in FROMP: 5 tasks (0/1, 2/3, 4/5, 6/7, 8/9), raw pixels, multi-head."""
    xtr, ytr, xte, yte = load_mnist(data_root, download=download)
    tasks = split_tasks(xtr.unsqueeze(1), ytr, xte.unsqueeze(1), yte, _pairs(10))
    return TaskSequence("split-mnist", tasks, True, (1, 28, 28), 2)


def split_fashion_mnist(
    data_root: str | os.PathLike[str] | None = None, *, download: bool = True
) -> TaskSequence:
    """Split Fashion-MNIST: 5 tasks of 2 classes in order, raw pixels, multi-head."""
    xtr, ytr, xte, yte = load_fashion_mnist(data_root, download=download)
    tasks = split_tasks(xtr.unsqueeze(1), ytr, xte.unsqueeze(1), yte, _pairs(10))
    return TaskSequence("split-fashion-mnist", tasks, True, (1, 28, 28), 2)


def permuted_mnist(
    data_root: str | os.PathLike[str] | None = None,
    *,
    n_tasks: int = 10,
    seed: int = 0,
    download: bool = True,
) -> TaskSequence:
    """Permuted MNIST as in FROMP: ``n_tasks`` tasks, the first unpermuted, single head.

    Inputs are flattened ``[N, 784]``; the permutations are drawn from ``seed``.
    """
    if n_tasks < 1:
        raise ValueError(f"n_tasks must be >= 1, got {n_tasks}")
    xtr, ytr, xte, yte = load_mnist(data_root, download=download)
    xtr, xte = xtr.reshape(len(xtr), -1), xte.reshape(len(xte), -1)
    rng = np.random.default_rng(seed)
    tasks = []
    for t in range(n_tasks):
        perm = torch.arange(784) if t == 0 else torch.as_tensor(rng.permutation(784))
        tasks.append(Task(xtr[:, perm], ytr.clone(), xte[:, perm], yte.clone(), t, list(range(10))))
    return TaskSequence("permuted-mnist", tasks, False, (784,), 10)


def split_cifar(
    data_root: str | os.PathLike[str] | None = None, *, download: bool = True
) -> TaskSequence:
    """Split CIFAR as in FROMP: CIFAR-10 as task 1, then CIFAR-100 classes 0-49 as 5 tasks
    of 10 classes; multi-head (10 outputs per head), no augmentation, pixels in [0, 1]."""
    c10 = load_cifar10(data_root, download=download)
    c100 = load_cifar100(data_root, download=download)
    tasks = split_tasks(*c10, [list(range(10))])
    tasks += split_tasks(*c100, [list(range(s, s + 10)) for s in range(0, 50, 10)], first_task_id=1)
    return TaskSequence("split-cifar", tasks, True, (3, 32, 32), 10)


def split_digits(*, test_fraction: float = 0.25, seed: int = 0) -> TaskSequence:
    """Split-Digits: scikit-learn's bundled 8x8 digits (1,797 images), 5 tasks of 2 classes.

    Needs no download, so it is the built-in default when MNIST is not available. Pixels
    are scaled to [0, 1]; the train/test split is stratified and fixed by ``seed``.
    """
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.as_tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.as_tensor(d.target, dtype=torch.long)
    rng = np.random.default_rng(seed)
    test = np.zeros(len(y), dtype=bool)
    for c in range(10):
        idx = np.flatnonzero(d.target == c)
        test[rng.choice(idx, round(test_fraction * len(idx)), replace=False)] = True
    te = torch.as_tensor(test)
    tasks = split_tasks(x[~te], y[~te], x[te], y[te], _pairs(10))
    return TaskSequence("split-digits", tasks, True, (1, 8, 8), 2)


def synthetic_split(
    *,
    n_tasks: int = 3,
    classes_per_task: int = 2,
    input_shape: tuple[int, ...] = (1, 28, 28),
    n_train: int = 64,
    n_test: int = 32,
    multi_head: bool = True,
    seed: int = 0,
) -> TaskSequence:
    """A small, learnable synthetic sequence in the format of the real ones (for tests).

    Each class is a random prototype image plus noise, clipped to [0, 1].
    """
    g = torch.Generator().manual_seed(seed)
    n_classes = n_tasks * classes_per_task
    protos = torch.rand(n_classes, *input_shape, generator=g)

    def draw(n: int) -> tuple[Tensor, Tensor]:
        y = torch.arange(n) % n_classes
        x = (protos[y] + 0.3 * torch.randn(n, *input_shape, generator=g)).clamp(0, 1)
        return x, y

    xtr, ytr = draw(n_train * n_tasks)
    xte, yte = draw(n_test * n_tasks)
    groups = [list(range(s, s + classes_per_task)) for s in range(0, n_classes, classes_per_task)]
    tasks = split_tasks(xtr, ytr, xte, yte, groups)
    return TaskSequence("synthetic", tasks, multi_head, tuple(input_shape), classes_per_task)
