"""Checkpointed ``fit`` of ``DataParallelTrainer`` and ``Pipeline`` under real ``torchrun`` (gloo, CPU).

A rank killed with SIGKILL at random moments, once inside a checkpoint write, makes torchrun restart the
group (``--max-restarts``); every rank resumes from the newest complete checkpoint and the final state equals
an uninterrupted run's bit for bit. Damaged checkpoints are set aside with a warning; a changed layout or a
folder the ranks do not share is refused with an error naming it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from torch_dad.training import checkpoint

pytest.importorskip("safetensors")
pytestmark = [pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX SIGKILL"), pytest.mark.slow]

WORKER = Path(__file__).with_name("distributed_fit_worker.py")
LAST_STEP = 45  # the worker's 3 epochs of 15 steps
KILLS = 5
TIMINGS = ("train_s", "img_per_s")
# torchrun shares its rendezvous store with the workers by default, and a restarted gloo group can then read its
# peers' addresses from the attempt before (pytorch/pytorch#135712): docs/distributed.md gives the same setting
RESTARTABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def _torchrun(mode: str, world: int, folder: Path | str, out: Path, *, restarts: int = 0,
              env: dict[str, str] | None = None) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               f"--max-restarts={restarts}", "--monitor-interval=0.1", str(WORKER), mode, str(folder), str(out)]
    log = open(out / "torchrun.log", "a")  # noqa: SIM115 - closed by _wait
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", **RESTARTABLE, **(env or {})})
    proc.log = log  # type: ignore[attr-defined]
    return proc


def _wait(proc: subprocess.Popen, out: Path, seconds: float = 240) -> str:
    try:
        proc.wait(timeout=seconds)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.log.close()  # type: ignore[attr-defined]
        _kill_workers(out)
    return (out / "torchrun.log").read_text()


def _kill_workers(out: Path) -> None:
    """SIGKILL any worker of this run still alive: torchrun starts them outside our process group, so killpg misses them."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(out) in cmdline.read_bytes().decode(errors="replace") and WORKER.name in cmdline.read_text():
                os.kill(int(cmdline.parent.name), signal.SIGKILL)
        except (OSError, ValueError):
            pass


def _run(mode: str, world: int, folder: Path | str, out: Path, env: dict[str, str] | None = None) -> tuple[int, str]:
    proc = _torchrun(mode, world, folder, out, env=env)
    log = _wait(proc, out)
    return proc.returncode, log


def _final(out: Path, world: int) -> list[dict]:
    return [checkpoint.read(out / f"final-{rank}.safetensors") for rank in range(world)]


def _assert_same_final(got: list[dict], want: list[dict]) -> None:
    for rank, (a, b) in enumerate(zip(got, want)):
        ta, tb = checkpoint.flatten(a)[1], checkpoint.flatten(b)[1]
        assert ta.keys() == tb.keys()
        different = [key for key in ta if not torch.equal(ta[key], tb[key])]
        assert not different, f"rank {rank}: {different[:5]}"
        for records in (a["records"], b["records"], a["trainer"]["history"], b["trainer"]["history"]):
            for record in records:
                for key in TIMINGS:
                    record.pop(key, None)
        assert a["records"] == b["records"] and a["trainer"]["history"] == b["trainer"]["history"]
        assert a["trainer"]["step_count"] == LAST_STEP


def _status(out: Path, world: int) -> dict[int, tuple[int, str]]:
    found = {}
    for rank in range(world):
        try:
            pid, step = (out / f"status-{rank}").read_text().split()
        except (FileNotFoundError, ValueError):
            continue
        found[rank] = (int(pid), step)
    return found


def _wait_for(condition, proc: subprocess.Popen, what: str, seconds: float = 120):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"torchrun ended (rc {proc.returncode}) while waiting for {what}")
        time.sleep(0.005)
    raise AssertionError(f"timed out waiting for {what}")


def _fresh_group(out: Path, world: int, dead: set[int]) -> dict[int, tuple[int, str]] | None:
    """Every rank's status once each comes from a process not killed before, else ``None``."""
    status = _status(out, world)
    return status if len(status) == world and not {pid for pid, _ in status.values()} & dead else None


def _held_pid(out: Path, rank: int) -> int:
    """The pid of ``rank``'s process held inside the hooked write (0 if none, or not yet written)."""
    path = out / f"inwrite-{rank}"
    return int(path.read_text() or 0) if path.exists() else 0


def _victim_ready(out: Path, world: int, hooked_hit: bool, victim: int, target: int) -> tuple[int, int, str] | None:
    """``(rank, pid, where)`` to kill now: a rank held inside a write, else ``victim`` once at ``target``."""
    status = _status(out, world)
    if (out / "hooked").exists() and not hooked_hit:  # the hooked rank is inside (or entering) its write
        held = [rank for rank in range(world) if _held_pid(out, rank)]
        return (held[0], _held_pid(out, held[0]), "in-write") if held else None
    pid, step = status.get(victim, (0, "0"))
    return (victim, pid, f"step {step}") if step.isdigit() and int(step) >= target else None


def _kill_repeatedly(proc: subprocess.Popen, out: Path, world: int, rng: random.Random) -> list[str]:
    """SIGKILL a random rank at least ``KILLS`` times, each after a fresh group has started, and until one
    kill has hit the rank held inside a write. Returns what each kill hit."""
    dead: set[int] = set()
    hits: list[str] = []
    while len(hits) < KILLS or not any("in-write" in hit for hit in hits):
        fresh = _wait_for(partial(_fresh_group, out, world, set(dead)), proc, "a restarted group")
        now = max((int(step) for _, step in fresh.values() if step.isdigit()), default=0)
        victim, target = rng.randrange(world), min(now + rng.randint(2, 8), LAST_STEP - 8)  # room to kill
        hooked_hit = any("in-write" in hit for hit in hits)
        ready = partial(_victim_ready, out, world, hooked_hit, victim, target)
        rank, pid, where = _wait_for(ready, proc, f"rank {victim} at step {target}")
        time.sleep(rng.uniform(0, 0.01))
        if pid == _held_pid(out, rank):  # a random victim that the hook holds: this kill is the in-write one
            where = "in-write"
        dead |= {p for p, _ in _status(out, world).values()}
        os.kill(pid, signal.SIGKILL)
        hits.append(f"rank {rank} {where}")
    return hits


CASES = [  # mode, world, the write the hooked rank is killed inside
    ("data-parallel", 2, 1, "step-000000008/rank-00001-*.safetensors"),
    ("data-parallel", 4, 0, "step-000000008/manifest.json"),
    ("pipeline", 2, 0, "step-000000008/manifest.json"),
    ("pipeline", 4, 3, "step-000000008/rank-00003-*.safetensors"),
]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One uninterrupted checkpointed run per mode and world size: ``(out, folder)``."""
    base = tmp_path_factory.mktemp("reference")
    runs = {}
    for mode, world, _, _ in CASES:
        out, folder = base / f"{mode}-{world}", base / f"{mode}-{world}-checkpoints"
        rc, log = _run(mode, world, folder, out)
        assert rc == 0, log
        runs[mode, world] = out, folder
    return runs


@pytest.mark.parametrize("mode,world,hook_rank,hook_file", CASES)
def test_killed_ranks_resume_bitwise_under_torchrun(references, tmp_path, mode, world, hook_rank, hook_file):
    out, folder = tmp_path / "out", tmp_path / "checkpoints"
    rng = random.Random(f"{mode}-{world}")
    env = {"STEP_SECONDS": "0.01", "HOOK_RANK": str(hook_rank), "HOOK_FILE": hook_file}
    proc = _torchrun(mode, world, folder, out, restarts=2 * KILLS, env=env)
    try:
        hits = _kill_repeatedly(proc, out, world, rng)
    finally:
        log = _wait(proc, out)
    assert proc.returncode == 0, log
    assert "in-write" in " ".join(hits), hits  # one kill landed inside the hooked checkpoint write
    assert "incomplete: no manifest.json" in log  # and the restart set that checkpoint aside
    assert log.count("resumed from") >= KILLS - 1
    _assert_same_final(_final(out, world), _final(references[mode, world][0], world))


def _copy(references, mode: str, world: int, tmp_path: Path) -> tuple[Path, list[Path]]:
    folder = tmp_path / "checkpoints"
    shutil.copytree(references[mode, world][1], folder)
    return folder, sorted((p for p in folder.iterdir() if p.is_dir()), reverse=True)


@pytest.mark.parametrize("damage", ["truncated", "altered", "no-manifest", "missing-shard", "two-steps"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(references, tmp_path, damage):
    mode, world = "pipeline", 2
    folder, (newest, previous) = _copy(references, mode, world, tmp_path)
    (shard,) = newest.glob("rank-00001-*.safetensors")
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "altered":
        data = bytearray(shard.read_bytes())
        data[-5] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "no-manifest":
        (newest / "manifest.json").unlink()
    elif damage == "missing-shard":
        shard.unlink()
    else:
        shutil.copy(next(previous.glob("rank-00001-*.safetensors")), shard)
    out = tmp_path / "out"
    rc, log = _run(mode, world, folder, out)
    assert rc == 0, log
    expected = {"truncated": "truncated or corrupted", "altered": "corrupted", "no-manifest": "no manifest.json",
                "missing-shard": "which is missing", "two-steps": "shards from two steps"}[damage]
    assert expected in log and "trying the previous checkpoint" in log, log
    assert f"resumed from {previous}" in log
    _assert_same_final(_final(out, world), _final(references[mode, world][0], world))


def test_changed_layout_is_refused_naming_both(references, tmp_path):
    folder, (newest, _) = _copy(references, "data-parallel", 2, tmp_path)
    rc, log = _run("data-parallel", 4, folder, tmp_path / "out")
    assert rc != 0 and "world_size: checkpoint 2, this run 4" in log, log
    folder, (newest, _) = _copy(references, "pipeline", 2, tmp_path / "split")
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["layout"]["bounds"] = [[0, 1], [1, 4]]
    (newest / "manifest.json").write_text(json.dumps(manifest))
    rc, log = _run("pipeline", 2, folder, tmp_path / "out-split")
    assert rc != 0 and "bounds: checkpoint [[0, 1], [1, 4]], this run" in log, log


def test_a_folder_the_ranks_do_not_share_is_refused(tmp_path):
    rc, log = _run("data-parallel", 2, str(tmp_path / "rank-{rank}"), tmp_path / "out")
    assert rc != 0 and "is not shared between the ranks: rank 1 does not see" in log, log


def test_a_due_step_that_ends_an_epoch_is_saved_twice_and_the_second_save_is_the_checkpoint(references, tmp_path):
    """Every 5 steps with 15-step epochs: step 45 is due and ends the fit, so it is saved as due, then again at
    the end (its fit progress moved on); the manifest names the second save's shards and the first save's are gone."""
    mode, world, folder = "pipeline", 2, tmp_path / "checkpoints"
    rc, log = _run(mode, world, folder, tmp_path / "out", env={"CHECKPOINT_EVERY": "5"})
    assert rc == 0, log
    _assert_same_final(_final(tmp_path / "out", world), _final(references[mode, world][0], world))
    for step_folder in folder.iterdir():
        manifest = json.loads((step_folder / "manifest.json").read_text())
        assert sorted(p.name for p in step_folder.glob("rank-*")) == sorted(e["file"] for e in manifest["shards"])
    last = folder / "step-000000045"
    for entry in json.loads((last / "manifest.json").read_text())["shards"]:
        skeleton, _, digest = checkpoint.read_parts(last / entry["file"])
        assert digest == entry["sha256"] and (skeleton["fit"]["epoch"], skeleton["fit"]["batches"]) == (3, 0)
