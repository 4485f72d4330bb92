"""One rank of a checkpointed distributed ``fit``, launched by ``torchrun`` from ``test_distributed_checkpoints.py``.

``python -m torch.distributed.run ... distributed_fit_worker.py MODE CHECKPOINT_DIR OUT`` with MODE
``data-parallel`` or ``pipeline`` (CHECKPOINT_DIR ``-``: no checkpoints). Each rank rewrites ``OUT/status-<rank>``
with ``"<pid> <step count>"`` after every step and, once ``fit`` returns, writes its final state to
``OUT/final-<rank>.safetensors``.

``DEVICE=cuda``: NCCL, one GPU per rank. ``CHECKPOINT_EVERY`` and ``KEEP_LAST`` override ``fit``'s. ``HOOK_RANK``/``HOOK_FILE``: the first time that
rank replaces a file matching ``HOOK_FILE`` (a glob for a shard or the manifest of one step) it writes its pid to ``OUT/inwrite-<rank>`` and stops between the temporary file and the
rename, so the test can kill it inside the write; ``OUT/hooked`` records that the hook has fired, so a
restarted rank writes through.
"""

from __future__ import annotations

import fnmatch
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import torch_dad as td
from torch_dad import data
from torch_dad.training import DataParallelTrainer, Pipeline, checkpoint

EPOCHS, ROWS, BATCH, EVERY = 3, 240, 16, 4  # 15 steps an epoch; checkpoints every 4 steps and at the end


class Net(td.DADModel):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([
            td.DADLinear(12, 20, num_classes=3), td.DADLinear(20, 16, num_classes=3, activation="tanh"),
            td.DADLinear(16, 14, num_classes=3), td.DADLinear(14, 10, num_classes=3, activation="tanh"),
        ])
        self.classifier = torch.nn.Linear(10, 3)


def _hook(out: Path, rank: int) -> None:
    """Hold this rank inside the chosen write (see the module docstring)."""
    name = os.environ.get("HOOK_FILE")
    if os.environ.get("HOOK_RANK") != str(rank) or not name or (out / "hooked").exists():
        return
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):  # type: ignore[no-untyped-def]
        if fnmatch.fnmatch(str(dst), f"*/{name}") and not (out / "hooked").exists():
            (out / "hooked").touch()
            (out / f"inwrite-{rank}").write_text(str(os.getpid()))
            time.sleep(120)
        return real_replace(src, dst, *args, **kwargs)

    os.replace = replace


def main() -> None:
    mode, folder, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if os.environ.get("DEVICE") == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    folder = folder.format(rank=rank)  # "{rank}" in the path: a folder per rank, not shared
    _hook(out, rank)
    (x, y), (xt, yt) = data.synthetic(num_train=ROWS, num_test=40, num_features=12, num_classes=3, seed=5)
    x, y, test = x.to(device), y.to(device), (xt.to(device), yt.to(device))
    torch.manual_seed(0)
    kwargs = dict(classifier_sample_size=50, dropout=0.1, lr=3e-3)
    trainer = (DataParallelTrainer(Net(), device, **kwargs) if mode == "data-parallel"
               else td.DADTrainer(Net(), device, **kwargs))
    pause = float(os.environ.get("STEP_SECONDS", "0"))

    def reporting(function, ahead):  # type: ignore[no-untyped-def]
        def call(*args, **kw):  # type: ignore[no-untyped-def]
            result = function(*args, **kw)
            (out / f"status-{rank}").write_text(f"{os.getpid()} {trainer.step_count + ahead}")
            time.sleep(pause)
            return result
        return call

    trainer.step = reporting(trainer.step, 0)  # type: ignore[method-assign]
    every = int(os.environ.get("CHECKPOINT_EVERY", EVERY))
    keep = int(os.environ.get("KEEP_LAST", "2"))
    options = dict(checkpoint_dir=folder, checkpoint_every=every, keep_last=keep, resume=True) if folder != "-" else {}
    if mode == "data-parallel":
        records = trainer.fit((x, y), epochs=EPOCHS, eval=test, batch_size=BATCH, progress=True, **options)
    else:
        pipe = Pipeline(trainer)
        first = pipe.is_first
        trainer.train_layers = reporting(trainer.train_layers, 1)  # type: ignore[method-assign]
        records = pipe.fit((x, y) if first else None, epochs=EPOCHS, eval=test if first else None, batch_size=BATCH,
                           progress=True, **options)
    checkpoint.write(out / f"final-{rank}.safetensors", {"trainer": trainer.state_dict(), "records": records})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
