"""``fit(checkpoint_dir=..., resume=True)`` killed with SIGKILL again and again, mid-step and mid-write:
the final state is bitwise that of a run never interrupted."""

from __future__ import annotations

import json
import os
import random
import re
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from torch_dad.training import checkpoint

pytest.importorskip("safetensors")
pytestmark = [pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX SIGKILL"), pytest.mark.slow]

EPOCHS, BATCHES, EVERY = 3, 40, 7  # 120 steps; checkpoints at multiples of 7 and at the end

# The child trains; it prints the step count after every step so the parent can kill it at a chosen step. With
# HOOK_STEP set, the write of that step's checkpoint prints "in-write" and stops between its temporary file and
# the rename, so the parent can kill it inside the write.
CHILD = textwrap.dedent(
    f"""
    import json, os, sys, time
    import torch
    torch.set_num_threads(1)
    import torch_dad as td
    from torch_dad import data

    folder, out = sys.argv[1], sys.argv[2]
    hook = os.environ.get("HOOK_STEP")
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        if hook and os.path.basename(str(dst)) == f"checkpoint-{{int(hook):09d}}.safetensors":
            print("in-write", flush=True)
            time.sleep(60)
        return real_replace(src, dst, *args, **kwargs)

    os.replace = replace

    class Net(td.DADModel):
        def __init__(self):
            super().__init__()
            self.l1 = td.DADLinear(16, 24, num_classes=3)
            self.l2 = td.DADLinear(24, 12, num_classes=3, activation="tanh")
            self.classifier = torch.nn.Linear(12, 3)

    (x, y), test = data.synthetic(num_train={BATCHES} * 16, num_features=16, num_classes=3, seed=7)
    torch.manual_seed(0)
    trainer = td.DADTrainer(Net(), classifier_sample_size=100)
    step = trainer.step

    def printing_step(*args, **kwargs):
        result = step(*args, **kwargs)
        print(trainer.step_count, flush=True)
        return result

    trainer.step = printing_step
    options = dict(checkpoint_dir=folder, checkpoint_every={EVERY}, resume=True) if folder != "-" else {{}}
    records = trainer.fit((x, y), epochs={EPOCHS}, eval=test, batch_size=16, progress=False, **options)
    trainer.save_checkpoint(out)
    with open(out + ".json", "w") as handle:
        json.dump(records, handle)
    """
)


def _start(script: Path, folder: str, out: Path, hook_step: int | None = None):
    env = dict(os.environ)
    if hook_step is not None:
        env["HOOK_STEP"] = str(hook_step)
    log = open(out.with_suffix(".log"), "a")  # noqa: SIM115 - closed with the process below
    proc = subprocess.Popen(
        [sys.executable, str(script), folder, str(out)], stdout=subprocess.PIPE, stderr=log, text=True, env=env
    )
    proc.log = log  # type: ignore[attr-defined]
    return proc


def _finish(proc, out: Path) -> None:
    proc.stdout.read()
    proc.wait(timeout=60)
    proc.log.close()
    assert proc.returncode == 0, out.with_suffix(".log").read_text()


def _kill(proc) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    proc.stdout.close()
    proc.log.close()
    assert proc.returncode == -signal.SIGKILL


def _saved_steps(folder: Path) -> list[int]:
    return sorted(step for step, _ in checkpoint.CheckpointFolder(folder, None, 1).paths())


def _kill_at_step(script: Path, folder: Path, out: Path, target: int, rng: random.Random) -> None:
    proc = _start(script, str(folder), out)
    for line in proc.stdout:
        if int(line) >= target:
            break
    else:
        _finish(proc, out)
        raise AssertionError(f"the run finished before step {target}")
    time.sleep(rng.uniform(0.0, 0.002))  # the kill lands somewhere in the steps after the target
    _kill(proc)


def _kill_in_write(script: Path, folder: Path, out: Path, hook_step: int) -> None:
    proc = _start(script, str(folder), out, hook_step)
    for line in proc.stdout:
        if line.strip() == "in-write":
            break
    else:
        _finish(proc, out)
        raise AssertionError(f"the run never wrote the checkpoint of step {hook_step}")
    _kill(proc)
    # killed between the temporary file and the rename: the file is absent, its temporary is there
    assert hook_step not in _saved_steps(folder)
    assert list(folder.glob(f".checkpoint-{hook_step:09d}.safetensors.tmp-*"))


def _upcoming_checkpoint(folder: Path, rng: random.Random) -> int:
    done = max(_saved_steps(folder), default=0)
    # the steps fit saves: every EVERY-th and the last (an epoch's end only when it is one of those)
    steps = sorted({s for s in range(done + 1, EPOCHS * BATCHES + 1) if s % EVERY == 0 or s == EPOCHS * BATCHES})
    return rng.choice(steps[:3])


def _load(out: Path) -> tuple[dict, list]:
    _, tensors = checkpoint.flatten(checkpoint.read(out))
    records = json.loads(out.with_name(out.name + ".json").read_text())
    return tensors, [{k: v for k, v in r.items() if k not in ("train_s", "img_per_s")} for r in records]


def test_fit_killed_repeatedly_resumes_bitwise(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    folder, rng = tmp_path / "checkpoints", random.Random(0)
    kills = 0
    for kind in ("write", "step", "write", "step", "step", "write"):
        if kind == "write":
            _kill_in_write(script, folder, tmp_path / "out", _upcoming_checkpoint(folder, rng))
        else:
            done = max(_saved_steps(folder), default=0)
            target = rng.randint(done + 1, min(done + 25, EPOCHS * BATCHES - 1))
            _kill_at_step(script, folder, tmp_path / "out", target, rng)
        kills += 1
    # the very last write (the end of fit) is killed too
    _kill_in_write(script, folder, tmp_path / "out", EPOCHS * BATCHES)
    kills += 1
    resumed, straight = tmp_path / "resumed.safetensors", tmp_path / "straight.safetensors"
    _finish(_start(script, str(folder), resumed), resumed)
    _finish(_start(script, "-", straight), straight)

    assert kills >= 5
    (a, records_a), (b, records_b) = _load(resumed), _load(straight)
    assert records_a == records_b and len(records_a) == EPOCHS
    assert a.keys() == b.keys() and len(a) > 10
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert int(checkpoint.read(resumed)["trainer"]["step_count"]) == EPOCHS * BATCHES
    assert _saved_steps(folder) == [EPOCHS * BATCHES - 1, EPOCHS * BATCHES]  # keep_last=2
    assert not list(folder.glob(".*tmp-*"))  # the killed writes' temporaries were removed on resume


# ------------------------------------------------------------------------------------------ kills inside the write
# A forking server: it imports torch once, then for each "train" line forks a child that runs fit(checkpoint_every=1,
# resume=True) on a tiny model whose padding buffer makes each checkpoint a few MiB, so that a write takes long
# enough to be caught; it prints the child's pid, then its wait status. "check" runs the same fit up to its
# first step only. A fresh process per kill would spend most of the test importing torch.
SERVER = textwrap.dedent(
    """
    import os, sys, traceback
    import torch
    torch.set_num_threads(1)
    import torch_dad as td
    from torch_dad import data

    folder = sys.argv[1]

    class Net(td.DADModel):
        def __init__(self):
            super().__init__()
            self.l1 = td.DADLinear(8, 8, num_classes=2)
            self.classifier = torch.nn.Linear(8, 2)
            self.register_buffer("padding", torch.arange(1 << 20, dtype=torch.float32))

    class Stop(Exception):
        pass

    def stop(step):
        raise Stop

    def run(command):
        (x, y), _ = data.synthetic(num_train=16 * 25, num_features=8, num_classes=2, seed=3)
        torch.manual_seed(0)
        trainer = td.DADTrainer(Net(), classifier_sample_size=20)
        schedule = stop if command == "check" else None
        try:
            trainer.fit((x, y), epochs=40, batch_size=16, progress=False, schedule=schedule,
                        checkpoint_dir=folder, checkpoint_every=1, keep_last=2, resume=True)
        except Stop:
            pass

    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            try:
                run(line.strip())
                code = 0
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stderr.flush()
            os._exit(code)
        print(pid, flush=True)
        print(os.waitpid(pid, 0)[1], flush=True)
    """
)
CHECKPOINT = re.compile(r"checkpoint-\d{9}\.safetensors")
TEMPORARY = re.compile(r"\.checkpoint-(\d{9})\.safetensors\.tmp-(\d+)")  # step, pid


def _folder_state(folder: Path) -> list[int]:
    """The pids of the temporaries in ``folder``, after asserting that all else is a checkpoint that reads back."""
    pids = []
    for path in folder.iterdir() if folder.is_dir() else ():
        if TEMPORARY.fullmatch(path.name):
            pids.append(int(TEMPORARY.fullmatch(path.name).group(2)))
        else:
            assert CHECKPOINT.fullmatch(path.name), path.name  # no other file: no .corrupt, no foreign temporary
            checkpoint.read(path)  # complete and verified, or CheckpointError
    return pids


def _wait_for_write(server, log: Path, folder: Path, pid: int, step: int, seconds: float) -> None:
    """Return once process ``pid`` has a temporary for a checkpoint of ``step`` or later in ``folder``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            names = []
        for name in names:
            match = TEMPORARY.fullmatch(name)
            if match and int(match.group(2)) == pid and int(match.group(1)) >= step:
                return
        if select.select([server.stdout], [], [], 0)[0]:  # the server reports the process's end
            raise AssertionError(f"process {pid} ended with status {server.stdout.readline().strip()}: "
                                 f"{log.read_text()}")
    raise AssertionError(f"process {pid} wrote no checkpoint of step {step} or later within {seconds} s: "
                         f"{log.read_text()}")


def test_kills_inside_checkpoint_writes_leave_one_temporary_that_the_next_fit_removes(tmp_path):
    folder, log = tmp_path / "checkpoints", tmp_path / "server.log"
    stderr = log.open("w")
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(folder)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=stderr, text=True)

    def command(line: str) -> int:
        server.stdin.write(line + "\n")
        server.stdin.flush()
        return int(server.stdout.readline())

    try:
        inside, attempts, rng = 0, 0, random.Random(1)  # with this seed the chosen steps alone advance 17 steps
        while inside < 20:
            attempts += 1
            assert attempts <= 100, f"only {inside} of {attempts} kills landed inside a write"
            pid = command("train")
            # a checkpoint 1 to 3 steps after the one it resumes from, so that training advances between kills
            step = max(_saved_steps(folder), default=0) + rng.randint(1, 3)
            _wait_for_write(server, log, folder, pid, step, 60.0)
            os.kill(pid, signal.SIGKILL)
            status = int(server.stdout.readline())
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, log.read_text()
            temporaries = _folder_state(folder)
            assert len(temporaries) <= 1, temporaries  # the next fit removed the earlier kills' temporaries
            inside += temporaries == [pid]
        assert max(_saved_steps(folder)) >= 10  # training advanced between the kills
        command("check")
        assert int(server.stdout.readline()) == 0, log.read_text()
        assert _folder_state(folder) == []  # removed by the next fit(checkpoint_dir=...)
    finally:
        server.stdin.close()
        server.wait(timeout=60)
        stderr.close()
