"""Checkpoints of a run on several ranks: one shard per rank and a manifest written last.

``folder/step-<step>/`` holds ``rank-<r>-<save>.safetensors`` for every rank ``r`` (a :mod:`checkpoint` file each:
safetensors + JSON, verified by sha256, no pickle) and ``manifest.json``. Rank 0 writes the manifest only once
every rank has written its shard; it names each shard with its sha256, the step and the run's layout (world
size, and for a pipeline the stage split). A save copies the shard to host memory and writes it on a
background thread while training goes on; rank 0's thread writes the manifest once every shard file is there. A checkpoint counts only when its manifest is there and every shard
it names reads back with that sha256 and that step: a kill at any moment leaves either the previous complete
checkpoint or the new one.

Each shard holds the whole state's structure (its JSON) but only the tensors its rank owns (``owner``): for
data parallelism rank 0 writes the state every rank shares and each rank its own input sample and fit
progress; for a pipeline each stage its layers, the last stage the classifier. On resume each rank fills the
tensors it does not own from the shard of ``shared_from`` (data parallelism: rank 0), else from its live
state (a pipeline: the layers of other stages, which a stage never updates).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from . import checkpoint
from .checkpoint import CheckpointError

__all__ = ["ShardedFolder"]

FORMAT = "torch_dad.sharded_checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
_PREFIX = "step-"
_SHARD_TIMEOUT = 1800.0  # seconds rank 0 waits for the other ranks' shards, as long as a collective's default


def _step_of(path: Path) -> int | None:
    name = path.name
    digits = name[len(_PREFIX):]
    return int(digits) if name.startswith(_PREFIX) and digits.isdigit() else None


class ShardedFolder:
    """The checkpoints of one run on the ranks of ``group``; every method is called by every rank together.

    ``layout`` (JSON) must match between the run that saved and the run that resumes. ``owner(key)`` gives
    the rank that stores a flat state key, or ``None`` for a key every rank stores for itself. ``live()``
    is the current state, whose tensors fill what a rank's shard (and ``shared_from``'s) lacks.
    """

    def __init__(self, folder: Path, every: int | None, keep_last: int, *, group: Any, layout: dict[str, Any],
                 owner: Callable[[str], int | None], shared_from: int | None, live: Callable[[], Any]) -> None:
        self.folder, self.every, self.keep_last = folder, every, keep_last
        self.group, self.layout, self.owner = group, layout, owner
        self.shared_from, self.live = shared_from, live
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        # one writer thread: shards and manifests reach the disk in the order they were saved
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch_dad-checkpoint")
        self._last: Future[None] | None = None
        self._saves = 0
        # the host copy each save fills: reused, since a save first waits for the previous write
        self._host: checkpoint.PackedTensors | None = None
        self._check_shared()

    # ------------------------------------------------------------------ collectives
    def _gather(self, value: Any) -> list[Any]:
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, value, group=self.group)
        return everyone

    def _from_rank0(self, value: Any) -> Any:
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group)
        return box[0]

    def _raise_if_any(self, problem: str | None) -> None:
        """Raise the first rank's problem, the same ``ValueError`` on every rank."""
        problems = [p for p in self._gather(problem) if p]
        if problems:
            raise ValueError(problems[0])

    def _check_shared(self) -> None:
        """``ValueError`` on every rank unless each rank sees the file rank 0 writes into the folder."""
        probe = None
        if self.rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            probe = self.folder / f".shared-{os.getpid()}-{id(self)}"
            probe.touch()
        name = self._from_rank0(None if probe is None else probe.name)
        seen = (self.folder / name).is_file()
        everyone = self._gather(seen)
        if probe is not None:
            probe.unlink()
        blind = [rank for rank, ok in enumerate(everyone) if not ok]
        if blind:
            raise ValueError(
                f"checkpoint_dir={str(self.folder)!r} is not shared between the ranks: rank {blind[0]} does not see "
                "the file rank 0 wrote there; pass the same folder on a file system that every rank mounts"
            )

    # ------------------------------------------------------------------ the folder
    def paths(self) -> list[tuple[int, Path]]:
        """``(step, folder)`` of every checkpoint folder, complete or not, newest first."""
        if not self.folder.is_dir():
            return []
        found = [(step, p) for p in self.folder.iterdir() if p.is_dir() and (step := _step_of(p)) is not None]
        return sorted(found, reverse=True)

    def due(self, step: int) -> bool:
        return self.every is not None and step % self.every == 0

    @staticmethod
    def _shard(rank: int, save: int) -> str:
        # the save's number in the name: a second save of the same step (a due step that ends an epoch)
        # cannot be mistaken for the first while its files replace them
        return f"rank-{rank:05d}-{save:06d}{checkpoint.SUFFIX}"

    def save(self, step: int, state: Any) -> Path:
        """Copy this rank's shard of ``state`` to host memory and write it on a background thread while
        training goes on; rank 0's thread then waits for every rank's shard and writes the manifest. A kill
        before the manifest leaves the previous checkpoint as the newest complete one."""
        if self._last is not None:
            # one save in flight at most, so host memory stays bounded; a failed write raises here, on its
            # rank, and torchrun restarts the group
            self._last.result()
        target = self.folder / f"{_PREFIX}{step:09d}"
        self._saves += 1
        skeleton, live = checkpoint.flatten(state, lambda key: self.owner(key) in (None, self.rank), lambda t: t)
        host = self._host_for(live)
        copied = None
        if host.fill(live):  # from a GPU: the writer thread waits for the transfer, not this one
            copied = torch.cuda.Event()
            copied.record()
        self._last = self._writer.submit(self._write, step, self._saves, target, skeleton, host, copied)
        return target

    def _host_for(self, live: Mapping[str, Tensor]) -> checkpoint.PackedTensors:
        """The pinned host buffer for states shaped like ``live`` (made again only when the shapes change)."""
        if self._host is None or not self._host.matches(live):
            if self._host is not None:
                self._host.give_back()
            self._host = checkpoint.PackedTensors.take(live)
        return self._host

    def flush(self) -> None:
        """Wait until the last save is complete on every rank (the end of ``fit``)."""
        problem = None
        if self._last is not None:
            try:
                self._last.result()
            except Exception as exc:  # every rank must learn that one rank's write failed
                problem = f"rank {self.rank} could not write its checkpoint shard: {exc!r}"
        if self._host is not None:  # the next fit of this state takes it instead of pinning memory again
            self._host.give_back()
            self._host = None
        self._raise_if_any(problem)

    def _write(self, step: int, save: int, target: Path, skeleton: Any, tensors: checkpoint.PackedTensors,
               copied: torch.cuda.Event | None) -> None:
        target.mkdir(parents=True, exist_ok=True)
        if copied is not None:
            copied.synchronize()  # the device-to-host copies of the snapshot have landed
        checkpoint.write_flat(target / self._shard(self.rank, save), skeleton, tensors)
        if self.rank != 0:
            return
        files = [self._shard(rank, save) for rank in range(self.world_size)]
        shards = [{"rank": rank, "file": name, "sha256": self._wait_for_shard(target / name)}
                  for rank, name in enumerate(files)]
        manifest = {"format": FORMAT, "version": VERSION, "step": step, "layout": self.layout, "shards": shards}
        checkpoint.atomic_write(target / MANIFEST, json.dumps(manifest, indent=1).encode())
        for shard in target.glob(f"rank-*{checkpoint.SUFFIX}"):  # an earlier save of the same step, not a later one
            if int(shard.name[len("rank-00000-"):-len(checkpoint.SUFFIX)]) < save:
                shard.unlink(missing_ok=True)
        self._rotate()

    @staticmethod
    def _wait_for_shard(path: Path) -> str:
        """The sha256 that the shard at ``path`` declares, once its file is there (renamed into place, so
        complete)."""
        deadline = time.monotonic() + _SHARD_TIMEOUT
        while not path.is_file():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the shard {path} did not appear within {_SHARD_TIMEOUT:.0f} s")
            time.sleep(0.005)
        return checkpoint.declared_digest(path)

    def _rotate(self) -> None:
        complete = [path for _, path in self.paths() if (path / MANIFEST).is_file()]
        for old in complete[self.keep_last :]:
            shutil.rmtree(old, ignore_errors=True)

    def check_fresh_start(self, step: int) -> None:
        """Raise ``ValueError`` if the folder holds a checkpoint of a later step than ``step``."""
        later = [path.name for saved, path in self.paths() if saved > step and (path / MANIFEST).is_file()]
        if later:
            raise ValueError(
                f"checkpoint_dir={str(self.folder)!r} holds {later[0]}, from a later step than this trainer's {step}; "
                "pass resume=True to continue from it, or another (or an empty) checkpoint_dir"
            )

    def remove_temporaries(self) -> None:
        """Delete the checkpoint folders without a manifest (saves that did not finish)."""
        if self.rank == 0:
            for _, path in self.paths():
                if not (path / MANIFEST).is_file():
                    shutil.rmtree(path, ignore_errors=True)
        dist.barrier(group=self.group)

    # ------------------------------------------------------------------ resuming
    def newest(self) -> tuple[Path, Any] | None:
        """``(folder, state)`` of the newest complete checkpoint, verified on every rank, or ``None``. Each
        incomplete or damaged one on the way is set aside (``.corrupt``) or, without a manifest, removed, with
        a warning that says which checkpoint is tried next."""
        for _, path in self._from_rank0([(s, str(p)) for s, p in self.paths()] if self.rank == 0 else None):
            path = Path(path)
            manifest = self._from_rank0(self._read_manifest(path) if self.rank == 0 else None)
            if isinstance(manifest, dict):
                self._check_layout(manifest, path)
                found = self._read_shards(manifest, path)
                problems = [p for p in self._gather(found if isinstance(found, str) else None) if p]
                if not problems:
                    assert not isinstance(found, str)
                    return path, found
                reason, aside = problems[0], path.with_name(path.name + ".corrupt")
            else:
                reason, aside = f"{path} is incomplete: {manifest}", None
            self._set_aside(path, aside, reason)
        return None

    def _read_manifest(self, path: Path) -> dict[str, Any] | str:
        """The manifest of ``path``, or why it cannot be used."""
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except FileNotFoundError:
            return f"no {MANIFEST} (its save did not finish)"
        except (OSError, ValueError) as exc:
            return f"{MANIFEST} does not parse ({exc})"
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("step") != _step_of(path):
            return f"{MANIFEST} is not a {FORMAT} manifest of step {_step_of(path)}"
        return manifest

    def _check_layout(self, manifest: Mapping[str, Any], path: Path) -> None:
        saved = manifest.get("layout")
        if saved == self.layout:
            return
        keys = sorted(k for k in set(self.layout) | set(saved or {}) if (saved or {}).get(k) != self.layout.get(k))
        differences = ", ".join(f"{k}: checkpoint {(saved or {}).get(k)!r}, this run {self.layout.get(k)!r}"
                                for k in keys)
        raise ValueError(
            f"resume=True: {path} was written by a run laid out differently ({differences}); launch the run the "
            "checkpoint was written by (same number of processes and stage split), or use another checkpoint_dir"
        )

    def _read_shards(self, manifest: Mapping[str, Any], path: Path) -> Any:
        """This rank's state from its shard (and ``shared_from``'s), each checked against the manifest; a
        ``str`` saying what is wrong instead."""
        entries = {entry.get("rank"): entry for entry in manifest.get("shards", []) if isinstance(entry, dict)}
        parts = []
        for rank in dict.fromkeys([self.shared_from, self.rank]):
            if rank is None:
                continue
            entry = entries.get(rank)
            if entry is None:
                return f"{path}/{MANIFEST} names no shard of rank {rank}"
            try:
                skeleton, tensors, digest = checkpoint.read_parts(path / str(entry.get("file")))
            except FileNotFoundError:
                return f"{path}/{MANIFEST} names {entry.get('file')}, which is missing"
            except CheckpointError as exc:
                return str(exc)
            if digest != entry.get("sha256"):
                return self._mismatch(path, entry, skeleton, manifest["step"])
            parts.append((skeleton, tensors))
        live = checkpoint.flatten(self.live())[1] if self.shared_from is None else {}
        merged: dict[str, Tensor] = {**live}
        for _, tensors in parts:
            merged.update(tensors)
        return checkpoint.fill(parts[-1][0], merged, path)

    @staticmethod
    def _mismatch(path: Path, entry: Mapping[str, Any], skeleton: Any, step: int) -> str:
        held = skeleton.get("trainer", {}).get("step_count") if isinstance(skeleton, dict) else None
        if held is not None and held != step:
            return f"{path}/{entry.get('file')} holds step {held}, the manifest step {step}: shards from two steps"
        return f"{path}/{entry.get('file')} is not the shard the manifest names (its sha256 differs)"

    def _set_aside(self, path: Path, aside: Path | None, reason: str) -> None:
        """Rank 0 moves ``path`` to ``aside`` (or deletes it) and warns; the other ranks wait for it."""
        if self.rank == 0:
            if aside is None:
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.replace(path, aside)
            action = "removed it" if aside is None else f"renamed it to {aside.name}"
            warnings.warn(f"{reason}; {action} and trying the previous checkpoint", UserWarning, stacklevel=5)
        dist.barrier(group=self.group)
