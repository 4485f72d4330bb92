"""Checkpointed distributed ``fit`` on CUDA (NCCL, one process): the GPU snapshot into pinned memory, the
background write and the resume, for ``DataParallelTrainer`` and a one-stage ``Pipeline``.

A run resumed from a mid-run checkpoint ends with the state of the run never interrupted: integer tensors
(counters, labels, generator states) exactly, float tensors within 1e-5 relative, since on CUDA the fused local
error adds with atomics (README, Errors and guarantees).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.conftest import relative_error
from tests.gpu.conftest import requires_cuda
from tests.test_distributed_checkpoints import LAST_STEP, TIMINGS, _final, _run
from torch_dad.training import checkpoint

pytest.importorskip("safetensors")
pytestmark = [requires_cuda, pytest.mark.no_kernel, pytest.mark.slow]

CUDA = {"DEVICE": "cuda", "KEEP_LAST": "20"}


@pytest.mark.parametrize("mode", ["data-parallel", "pipeline"])
def test_resumed_run_ends_where_the_uninterrupted_one_does(tmp_path, mode):
    folder = tmp_path / "checkpoints"
    rc, log = _run(mode, 1, folder, tmp_path / "whole", env=CUDA)
    assert rc == 0, log
    for step_folder in folder.iterdir():  # resume from step 20, mid-epoch 2
        if step_folder.name != "step-000000020":
            shutil.rmtree(step_folder)
    rc, log = _run(mode, 1, folder, tmp_path / "resumed", env=CUDA)
    assert rc == 0 and "step 20, epoch 2, batch 5 of that epoch done" in log, log
    (whole,), (resumed,) = _final(tmp_path / "whole", 1), _final(tmp_path / "resumed", 1)
    a, b = checkpoint.flatten(whole)[1], checkpoint.flatten(resumed)[1]
    assert a.keys() == b.keys() and whole["trainer"]["step_count"] == resumed["trainer"]["step_count"] == LAST_STEP
    for key in a:
        if a[key].is_floating_point():
            assert relative_error(b[key].double(), a[key].double()) <= 1e-5, key
        else:
            assert torch.equal(a[key], b[key]), key
    for records in (whole["records"], resumed["records"]):
        for record in records:
            for name in TIMINGS:
                record.pop(name, None)
    assert [r["epoch"] for r in whole["records"]] == [r["epoch"] for r in resumed["records"]]


def test_packed_snapshot_of_a_gpu_state_writes_the_file_of_its_host_copy(tmp_path):
    """One device-to-host copy of mixed dtypes and devices, odd sizes, a non-contiguous tensor: the same file,
    byte for byte, as the tensors copied to the host one by one."""
    generator = torch.Generator().manual_seed(0)
    host = {
        "w": torch.randn(37, 11, generator=generator), "b": torch.randn(5, generator=generator).to(torch.bfloat16),
        "t": torch.randn(9, 4, generator=generator).T, "step": torch.tensor(3.0), "i8": torch.arange(3, dtype=torch.int8),
        "mask": torch.tensor([True, False]), "f64": torch.randn(3, generator=generator, dtype=torch.float64),
    }
    live = {key: (t if key == "i8" else t.cuda()) for key, t in host.items()}  # one tensor stays on the CPU
    packed = checkpoint.PackedTensors(live)
    assert packed.fill(live) and packed.data.is_pinned()
    torch.cuda.synchronize()
    digest = checkpoint.write_flat(tmp_path / "packed.safetensors", {}, packed)
    assert checkpoint.write_flat(tmp_path / "host.safetensors", {}, {k: t.contiguous() for k, t in host.items()}) == digest
    assert (tmp_path / "packed.safetensors").read_bytes() == (tmp_path / "host.safetensors").read_bytes()
