"""Checkpoint files: one safetensors file each, written atomically and verified on load.

A checkpoint holds a nested state (dicts, lists, tensors, ints, floats, strings, bools, ``None``), such as
``DADTrainer.state_dict()``. Its tensors go into the safetensors file under flattened keys
(``"trainer.model.l1.weight"``); everything else is JSON in the file's metadata, where each tensor is the
placeholder ``{"__tensor__": key}``. Loading runs no code: no pickle, no ``torch.load``.

The metadata (``str -> str``) holds two entries: ``"torch_dad"``, the JSON document
``{"format", "version", "state"}``, and ``"sha256"``, the hex digest of that JSON text followed by, for every
tensor in sorted key order, its key, dtype, shape and raw bytes. A truncated or altered file fails to parse or
fails the digest, and :func:`read` raises :class:`CheckpointError` (a ``ValueError``) naming the file.

:func:`write` serializes the file in memory, writes it to a temporary file of its own in the target's folder
(``.<name>.tmp-<pid>``, the only file a kill mid-write can leave), flushes and ``fsync``\\ s it, renames it over
the target with ``os.replace`` and ``fsync``\\ s the folder: a reader sees the old file or the new one, never a
part. :class:`CheckpointFolder` numbers a training run's checkpoints by step, keeps the newest ``keep_last``
(deleting older ones only once the new one is durable) and skips corrupt ones when resuming.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "CheckpointError",
    "CheckpointFolder",
    "declared_digest",
    "FitProgress",
    "PackedTensors",
    "flatten",
    "load_or_roll_back",
    "mismatches",
    "fill",
    "read",
    "read_parts",
    "unflatten",
    "write",
    "write_flat",
]

FORMAT = "torch_dad.checkpoint"
VERSION = 2
TENSOR_TAG = "__tensor__"
SUFFIX = ".safetensors"
_NAME = re.compile(r"checkpoint-(\d+)\.safetensors")
_TEMPORARY = ".tmp-"


class CheckpointError(ValueError):
    """A checkpoint file that cannot be trusted: truncated, altered, or not a checkpoint of this format."""


def _safetensors() -> Any:
    """``safetensors.torch``, imported on first use so that ``import torch_dad`` needs only torch and numpy."""
    try:
        import safetensors.torch
    except ImportError:
        raise ImportError(
            "checkpoints are safetensors files: install the checkpoint extra, `pip install 'torch-dad[checkpoint]'` "
            "(or `pip install safetensors`)"
        ) from None
    return safetensors.torch


# ---------------------------------------------------------------------------------------- state <-> tensors + JSON
_JSON_SCALARS = (bool, int, float, str, type(None))


def _split(tree: Any, path: str, tensors: dict[str, Tensor]) -> Any:
    """``tree`` with every tensor replaced by ``{TENSOR_TAG: flat key}`` (tuples become lists), adding each tensor
    to ``tensors`` under its key; ``TypeError`` on anything JSON cannot hold. One pass, scalars first: a long
    history is walked at every save."""
    if isinstance(tree, _JSON_SCALARS):
        return tree
    if isinstance(tree, Tensor):
        if path in tensors:
            raise ValueError(f"checkpoint state: two tensors flatten to the key {path!r}; rename one")
        tensors[path] = tree
        return {TENSOR_TAG: path}
    prefix = f"{path}." if path else ""
    if isinstance(tree, Mapping):
        if all(isinstance(value, _JSON_SCALARS) for value in tree.values()) and all(
            isinstance(key, str) and key != TENSOR_TAG for key in tree
        ):
            return dict(tree)  # a leaf record, such as a history entry
        skeleton = {}
        for key, value in tree.items():
            if not isinstance(key, str) or key == TENSOR_TAG:
                raise TypeError(f"checkpoint state {path or '<root>'}: key {key!r} must be a str other than {TENSOR_TAG!r}")
            skeleton[key] = _split(value, prefix + key, tensors)
        return skeleton
    if isinstance(tree, (list, tuple)):
        return [_split(value, f"{prefix}{index}", tensors) for index, value in enumerate(tree)]
    raise TypeError(f"checkpoint state {path}: {type(tree).__name__} is neither a tensor nor JSON")


def to_host(tensor: Tensor) -> Tensor:
    """A contiguous CPU copy of ``tensor``."""
    return tensor.detach().to("cpu", copy=True).contiguous()


def flatten(tree: Any, keep: Callable[[str], bool] | None = None,
            copy: Callable[[Tensor], Tensor] = to_host) -> tuple[Any, dict[str, Tensor]]:
    """``(skeleton, tensors)``: ``tensors`` maps each tensor's dotted path (those ``keep`` accepts, default all)
    to ``copy(tensor)`` (a contiguous CPU copy), ``skeleton`` is ``tree`` with placeholders instead (see
    :func:`unflatten`)."""
    found: dict[str, Tensor] = {}
    skeleton = _split(tree, "", found)
    return skeleton, {key: copy(tensor) for key, tensor in found.items() if keep is None or keep(key)}


def unflatten(skeleton: Any, tensors: Mapping[str, Tensor]) -> Any:
    """The inverse of :func:`flatten`: ``skeleton`` with each placeholder replaced by its tensor."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {TENSOR_TAG}:
            return tensors[skeleton[TENSOR_TAG]]
        return {key: unflatten(value, tensors) for key, value in skeleton.items()}
    if isinstance(skeleton, list):
        return [unflatten(value, tensors) for value in skeleton]
    return skeleton


def load_or_roll_back(current: Any, load: Callable[[Any], None], state: Any) -> None:
    """``load(state)``; if that raises, ``load`` a copy of ``current`` taken before, then re-raise."""
    skeleton, tensors = flatten(current)
    try:
        load(state)
    except Exception:
        load(unflatten(skeleton, tensors))
        raise


def mismatches(expected: Any, found: Any, limit: int = 8) -> list[str]:
    """Where the tensors of ``found`` (a checkpoint's state) differ from ``expected`` (the live state) in
    presence, shape or dtype, e.g. ``"model.l1.weight: checkpoint (512, 784), model (256, 784)"``."""
    ours: dict[str, Tensor] = {}
    theirs: dict[str, Tensor] = {}
    _split(expected, "", ours)
    _split(found, "", theirs)
    problems = []
    for key, a in ours.items():  # in the live state's order: a model's first layer first
        b = theirs.get(key)
        if b is None:
            problems.append(f"{key}: in this model only")
        elif a.shape != b.shape:
            problems.append(f"{key}: checkpoint {tuple(b.shape)}, model {tuple(a.shape)}")
        elif a.dtype != b.dtype:
            problems.append(f"{key}: checkpoint {b.dtype}, model {a.dtype}")
    problems += [f"{key}: in the checkpoint only" for key in theirs if key not in ours]
    return problems[:limit] + ([f"and {len(problems) - limit} more"] if len(problems) > limit else [])


#: one tensor of a file: ``(key, dtype, shape, its bytes)``, in the file's (sorted key) order
Entry = tuple[str, torch.dtype, tuple[int, ...], Any]


def _entries(tensors: Mapping[str, Tensor]) -> list[Entry]:
    """The entries of contiguous CPU ``tensors``, their bytes without a copy."""
    return [(key, tensors[key].dtype, tuple(tensors[key].shape), _bytes(tensors[key])) for key in sorted(tensors)]


def _bytes(tensor: Tensor) -> Any:
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def _digest(document: str, entries: list[Entry], version: int = VERSION, data: list[Any] | None = None) -> str:
    """sha256 of ``document``, then of each tensor's key, dtype and shape in sorted key order, then of their
    bytes in that order (``data``: the same bytes in fewer buffers). Version 1 files interleave each
    tensor's description and bytes."""
    digest = hashlib.sha256(document.encode())
    if version == 1:
        for key, dtype, shape, tensor_bytes in entries:
            digest.update(f"\0{key}\0{dtype}\0{shape}\0".encode())
            digest.update(tensor_bytes)
        return digest.hexdigest()
    # one update per buffer: a background writer then takes the GIL back once, not once per tensor
    digest.update("".join(f"\0{key}\0{dtype}\0{shape}\0" for key, dtype, shape, _ in entries).encode())
    for buffer in data if data is not None else [entry[3] for entry in entries]:
        digest.update(buffer)
    return digest.hexdigest()


class PackedTensors:
    """Host tensors laid out back to back in sorted key order in one buffer (pinned for a GPU state): the data
    section of their safetensors file as it is, filled from a live state in one device-to-host copy and written
    with one hash update of its bytes and one write call."""

    def __init__(self, like: Mapping[str, Tensor]) -> None:
        self.layout = _layout(like)
        self.specs = [(key, like[key].dtype, tuple(like[key].shape), like[key].numel() * like[key].element_size())
                      for key in sorted(like)]
        for key, dtype, _, _ in self.specs:
            _check_dtype(key, dtype)
        self.data = torch.empty(sum(n for *_, n in self.specs), dtype=torch.uint8,
                                pin_memory=any(t.is_cuda for t in like.values()))
        whole, offset, self.entries = self.data.numpy().data, 0, []
        for key, dtype, shape, size in self.specs:
            self.entries.append((key, dtype, shape, whole[offset : offset + size]))
            offset += size

    @classmethod
    def take(cls, like: Mapping[str, Tensor]) -> PackedTensors:
        """A buffer for states laid out like ``like``: the one last given back if it fits, else a new one."""
        with _SPARE_LOCK:
            spare = _SPARE.pop(_layout(like), None)
        return spare if spare is not None else cls(like)

    def give_back(self) -> None:
        """Keep this buffer for the next :meth:`take` of its layout (one is kept): pinning host memory stalls
        the GPU's work for tens of milliseconds, once per process instead of once per ``fit``."""
        with _SPARE_LOCK:
            _SPARE.clear()
            _SPARE[self.layout] = self

    def matches(self, tensors: Mapping[str, Tensor]) -> bool:
        """Whether ``tensors`` have this buffer's keys, dtypes, shapes and kind of memory."""
        return _layout(tensors) == self.layout

    def fill(self, tensors: Mapping[str, Tensor]) -> bool:
        """Copy ``tensors`` in; ``True`` if that is an asynchronous copy from a GPU, which the reader of
        :attr:`data` must wait for (a CUDA event recorded after this call)."""
        parts = [tensors[key].detach().reshape(-1).view(torch.uint8) for key, *_ in self.specs]
        device = next((p.device for p in parts if p.is_cuda), None)
        if device is None:
            offset = 0
            for part in parts:
                self.data[offset : offset + part.numel()].copy_(part)
                offset += part.numel()
            return False
        packed = torch.cat([p.to(device, non_blocking=True) for p in parts])  # one buffer on the GPU, one transfer
        self.data.copy_(packed, non_blocking=True)
        return True


def _layout(tensors: Mapping[str, Tensor]) -> tuple[Any, ...]:
    """Keys, dtypes and shapes in sorted key order, and whether any tensor is on a GPU (a pinned buffer)."""
    return (*((k, t.dtype, tuple(t.shape)) for k, t in sorted(tensors.items())), any(t.is_cuda for t in tensors.values()))


#: the last buffer a finished writer gave back (:meth:`PackedTensors.give_back`)
_SPARE: dict[tuple[Any, ...], PackedTensors] = {}
_SPARE_LOCK = threading.Lock()


# ---------------------------------------------------------------------------------------- files
def _fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (POSIX; elsewhere the rename is all the OS offers)."""
    if os.name != "posix":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes | list[Any]) -> None:
    """Write ``data`` (bytes, or a list of buffers written in order) to a temporary file in ``path``'s folder,
    fsync it, ``os.replace`` it onto ``path`` and fsync the folder."""
    temporary = path.with_name(f".{path.name}{_TEMPORARY}{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            for chunk in [data] if isinstance(data, bytes) else data:
                handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)


def write(path: str | os.PathLike[str], state: Any, keep: Callable[[str], bool] | None = None) -> str:
    """Write ``state`` to ``path`` as one verified safetensors file, atomically (see the module docstring);
    returns its sha256. With ``keep``, only the tensors whose flat key it accepts are stored (a shard: the
    others stay placeholders, for the reader to fill from elsewhere, see :func:`read_parts`)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"checkpoint path {path} is a folder; pass a file path such as {path / 'model.safetensors'}")
    if not path.parent.is_dir():
        raise FileNotFoundError(
            f"checkpoint path {path}: the folder {path.parent} does not exist; create it first "
            f"(os.makedirs({str(path.parent)!r})) or pass a path in an existing folder"
        )
    _safetensors()
    return write_flat(path, *flatten(state, keep))


def write_flat(path: Path, skeleton: Any, tensors: Mapping[str, Tensor] | PackedTensors) -> str:
    """:func:`write` of a state already split by :func:`flatten` (CPU tensors, or packed); returns the sha256."""
    document = json.dumps({"format": FORMAT, "version": VERSION, "state": skeleton})
    if isinstance(tensors, PackedTensors):
        entries, data = tensors.entries, [tensors.data.numpy().data]
    else:
        for key, tensor in tensors.items():
            _check_dtype(key, tensor.dtype)
        entries = _entries(tensors)
        data = [entry[3] for entry in entries]
    digest = _digest(document, entries, data=data)
    atomic_write(path, [_safetensors_header(entries, {"torch_dad": document, "sha256": digest}), *data])
    return digest


_SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


def _check_dtype(key: str, dtype: torch.dtype) -> None:
    if dtype not in _SAFETENSORS_DTYPES:
        raise TypeError(f"checkpoint state {key}: dtype {dtype} has no safetensors code")


def _safetensors_header(entries: list[Entry], metadata: dict[str, str]) -> bytes:
    """The safetensors header (8-byte length, JSON) of ``entries``' bytes laid out back to back. Written before
    the tensors' own bytes, without a copy: ``safetensors.torch.save`` builds the whole file in memory while
    holding the GIL, which stalls a training thread while a background thread saves."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for key, dtype, shape, data in entries:
        header[key] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                       "data_offsets": [offset, offset + data.nbytes]}
        offset += data.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(encoded)) + encoded


def _metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file's header (8-byte little-endian length, then JSON)."""
    if len(data) < 8:
        raise ValueError(f"{len(data)} bytes, shorter than a safetensors header")
    (length,) = struct.unpack("<Q", data[:8])
    if 8 + length > len(data):
        raise ValueError(f"header of {length} bytes but the file has {len(data)}")
    metadata = json.loads(data[8 : 8 + length]).get("__metadata__")
    if not isinstance(metadata, dict) or not {"torch_dad", "sha256"} <= metadata.keys():
        raise ValueError("no torch_dad checkpoint metadata")
    return metadata


def declared_digest(path: str | os.PathLike[str]) -> str:
    """The sha256 a checkpoint file's header declares (read without loading or verifying its tensors)."""
    with open(path, "rb") as handle:
        head = handle.read(8)
        (length,) = struct.unpack("<Q", head) if len(head) == 8 else (0,)
        return str(_metadata(head + handle.read(length))["sha256"])


def read_parts(path: str | os.PathLike[str]) -> tuple[Any, dict[str, Tensor], str]:
    """``(skeleton, tensors, sha256)`` of a file written by :func:`write`, verified; :class:`CheckpointError` if
    it is truncated, altered or not a checkpoint, ``FileNotFoundError`` if it does not exist."""
    path = Path(path)
    data = path.read_bytes()
    try:
        metadata = _metadata(data)
        tensors = _safetensors().load(data)
        document = json.loads(metadata["torch_dad"])
    except ImportError:
        raise
    except Exception as exc:  # any parse failure means a damaged file: safetensors, json and struct errors alike
        raise CheckpointError(f"checkpoint {path} is truncated or corrupted: {exc}") from exc
    version = document.get("version") if isinstance(document, dict) else None
    if _digest(metadata["torch_dad"], _entries(tensors), version if version == 1 else VERSION) != metadata["sha256"]:
        raise CheckpointError(f"checkpoint {path} is corrupted: its sha256 does not match its contents")
    if (
        not isinstance(document, dict)
        or document.get("format") != FORMAT
        or not isinstance(document.get("version"), int)
    ):
        raise CheckpointError(f"{path} is not a {FORMAT} file")
    if document["version"] > VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format version {document['version']}; this torch_dad reads up to {VERSION}"
        )
    return document["state"], tensors, metadata["sha256"]


def read(path: str | os.PathLike[str]) -> Any:
    """The state saved by :func:`write` (tensors on the CPU); :class:`CheckpointError` if the file is
    truncated, altered or not a checkpoint, ``FileNotFoundError`` if it does not exist."""
    skeleton, tensors, _ = read_parts(path)
    return fill(skeleton, tensors, path)


def fill(skeleton: Any, tensors: Mapping[str, Tensor], path: str | os.PathLike[str]) -> Any:
    """:func:`unflatten`, raising :class:`CheckpointError` naming ``path`` if a placeholder has no tensor."""
    try:
        return unflatten(skeleton, tensors)
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {path} names a tensor it does not hold: {exc}") from exc


# ---------------------------------------------------------------------------------------- a training run's folder
def check_folder(value: object, name: str = "checkpoint_dir") -> Path:
    """``Path(value)`` for a folder path (existing or not), else ``TypeError``/``ValueError`` naming ``name``;
    ``ImportError`` naming the extra to install if safetensors is missing."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a folder path (str or os.PathLike), got {type(value).__name__}")
    folder = Path(value)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{name}={str(value)!r} is a file; pass a folder path (it is created if missing)")
    _safetensors()  # a missing package fails here, before any training or folder
    return folder


class CheckpointFolder:
    """The checkpoints of one training run: ``folder/checkpoint-<step>.safetensors``, newest ``keep_last`` kept.

    ``every``: :meth:`due` is true every that many steps (``None``: never; the caller then saves at epoch ends).
    """

    def __init__(self, folder: Path, every: int | None, keep_last: int) -> None:
        self.folder = folder
        self.every = every
        self.keep_last = keep_last

    def paths(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every checkpoint in the folder, newest first."""
        if not self.folder.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.folder.iterdir() if (m := _NAME.fullmatch(p.name))]
        return sorted(found, reverse=True)

    def due(self, step: int) -> bool:
        return self.every is not None and step % self.every == 0

    def save(self, step: int, state: Any) -> Path:
        """Write ``state`` as the checkpoint of ``step``; once it is durable, delete all but the newest ``keep_last``."""
        _safetensors()
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"checkpoint-{step:09d}{SUFFIX}"
        write(path, state)
        for _, old in self.paths()[self.keep_last :]:
            old.unlink(missing_ok=True)
        return path

    def flush(self) -> None:
        """Nothing to wait for: :meth:`save` returns once the file is durable."""

    def newest(self) -> tuple[Path, Any] | None:
        """``(path, state)`` of the newest checkpoint that reads back intact, or ``None``. Each corrupt one
        on the way is renamed to ``<name>.corrupt`` (kept for inspection, never read again) with a warning."""
        for _, path in self.paths():
            try:
                return path, read(path)
            except CheckpointError as exc:
                aside = path.with_name(path.name + ".corrupt")
                os.replace(path, aside)
                warnings.warn(
                    f"{exc}; renamed it to {aside.name} and trying the previous checkpoint", UserWarning, stacklevel=4
                )
        return None

    def check_fresh_start(self, step: int) -> None:
        """Raise ``ValueError`` if the folder holds a checkpoint of a later step than ``step``: a new run
        there would have its own checkpoints rotated away in favour of the older run's."""
        later = [path.name for saved, path in self.paths() if saved > step]
        if later:
            raise ValueError(
                f"checkpoint_dir={str(self.folder)!r} holds {later[0]}, from a later step than this trainer's {step}; "
                "pass resume=True to continue from it, or another (or an empty) checkpoint_dir"
            )

    def remove_temporaries(self) -> None:
        """Delete temporary files left by a write that was killed before its rename."""
        if self.folder.is_dir():
            for path in self.folder.glob(f".checkpoint-*{SUFFIX}{_TEMPORARY}*"):
                path.unlink(missing_ok=True)


@dataclass
class FitProgress:
    """Where ``DADTrainer.fit`` stands: ``epoch`` epochs of this call done, then ``batches`` batches of the next
    (``seen`` rows, summed loss ``loss_sum``, ``seconds`` of training), its data order drawn from a generator
    in ``generator_state``; ``history_start`` is the length of the trainer's history when the call began."""

    args: dict[str, Any]
    history_start: int
    generator_state: Tensor
    loss_sum: Tensor
    epoch: int = 0
    batches: int = 0
    seen: int = 0
    seconds: float = 0.0

    def state(self) -> dict[str, Any]:
        return dict(vars(self))

    @classmethod
    def from_state(cls, state: Mapping[str, Any], path: Path, device: torch.device) -> FitProgress:
        try:
            progress = cls(**state)
        except TypeError as exc:
            raise CheckpointError(f"checkpoint {path} has no fit progress this version reads: {exc}") from exc
        progress.loss_sum = progress.loss_sum.to(device)
        return progress

    def next_epoch(self, generator_state: Tensor) -> None:
        """Start the next epoch: nothing consumed yet, its order drawn from ``generator_state``."""
        self.epoch += 1
        self.batches, self.seen, self.seconds = 0, 0, 0.0
        self.loss_sum = torch.zeros_like(self.loss_sum)
        self.generator_state = generator_state

    def checkpoint(self, trainer_state: dict[str, Any]) -> dict[str, Any]:
        """The state ``fit`` saves: the trainer's and this progress."""
        return {"trainer": trainer_state, "fit": self.state()}

    def check_args(self, args: Mapping[str, Any], path: Path) -> None:
        """``ValueError`` naming each argument of this ``fit`` call that differs from the checkpoint's run."""
        changed = [
            f"{key}={args[key]!r} (checkpoint: {self.args.get(key)!r})"
            for key in args
            if self.args.get(key) != args[key]
        ]
        if changed:
            raise ValueError(
                f"resume=True: {path} was written by a fit() run with other arguments: {', '.join(changed)}; "
                "pass the same arguments, or resume=False with another checkpoint_dir"
            )
