"""Checkpoints: the file format (safetensors + JSON, no pickle), atomic verified writes, corrupt-file fallback,
mismatch errors, and ``fit(checkpoint_dir=..., resume=True)`` resuming bitwise mid-epoch."""

from __future__ import annotations

import hashlib
import json
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import torch_dad as td
from torch_dad import data
from torch_dad.training import checkpoint

pytest.importorskip("safetensors")

EPOCHS, BATCH = 3, 16
(X, Y), TEST = data.synthetic(num_train=200, num_features=10, num_classes=3, seed=5)  # 13 batches an epoch


class Net(td.DADModel):
    def __init__(self, width=14, dtype=None):
        super().__init__()
        self.l1 = td.DADLinear(10, width, num_classes=3, dtype=dtype)
        self.l2 = td.DADLinear(width, 8, num_classes=3, activation="tanh", dtype=dtype)
        self.classifier = torch.nn.Linear(8, 3, dtype=dtype)


def make_trainer(**kwargs):
    torch.manual_seed(0)
    return td.DADTrainer(Net(kwargs.pop("width", 14)), classifier_sample_size=kwargs.pop("sample", 50), **kwargs)


def fit(trainer, train=(X, Y), **kwargs):
    kwargs = {"epochs": EPOCHS, "batch_size": BATCH, "eval": TEST, "progress": False, **kwargs}
    return trainer.fit(train, **kwargs)


class Interrupt(Exception):
    pass


def interrupted_fit(folder, at_step, trainer=None, **kwargs):
    """``fit`` with checkpoints into ``folder``, interrupted by an exception raised before step ``at_step``."""

    def schedule(step):
        if step + 1 == at_step:
            raise Interrupt
        return 1e-3

    trainer = trainer or make_trainer()
    with pytest.raises(Interrupt):
        fit(trainer, checkpoint_dir=folder, schedule=schedule, **kwargs)
    return trainer


def tensors(trainer):
    return checkpoint.flatten(trainer.state_dict())[1]


def assert_same_state(a, b):
    ta, tb = tensors(a), tensors(b)
    assert ta.keys() == tb.keys() and len(ta) > 10
    for key in ta:
        assert torch.equal(ta[key], tb[key]), key
    assert a.step_count == b.step_count


def without_time(records):
    return [{k: v for k, v in r.items() if k not in ("train_s", "img_per_s")} for r in records]


def saved_steps(folder):
    return sorted(step for step, _ in checkpoint.CheckpointFolder(Path(folder), None, 1).paths())


def constant_lr(step):
    return 1e-3


@pytest.fixture(scope="module")
def straight():
    """The run never interrupted, and its records."""
    trainer = make_trainer()
    records = fit(trainer, schedule=constant_lr)
    return trainer, records


# ------------------------------------------------------------------------------------------ format
def test_flatten_round_trip_keeps_dtypes_scalars_generators_and_none(tmp_path):
    state = {
        "a": {"w": torch.randn(3, 4), "stats": torch.randn(5, dtype=torch.float64), "count": torch.tensor(7)},
        "rng": torch.Generator().manual_seed(3).get_state(),
        "half": torch.randn(2, 2).to(torch.bfloat16),
        "mask": torch.tensor([True, False]),
        "none": None,
        "history": [{"loss": 0.25, "nan": float("nan")}, {"loss": 1 / 3}],
        "config": {"betas": (0.9, 0.999), "name": "adamw", "flag": True},
        "empty": torch.zeros(0, 3),
    }
    checkpoint.write(tmp_path / "c.safetensors", state)
    back = checkpoint.read(tmp_path / "c.safetensors")
    for key in ("rng", "half", "mask", "empty"):
        assert back[key].dtype == state[key].dtype and torch.equal(back[key], state[key])
    for key, value in state["a"].items():
        assert back["a"][key].dtype == value.dtype and back["a"][key].shape == value.shape
        assert torch.equal(back["a"][key], value)
    assert back["none"] is None and back["config"] == {"betas": [0.9, 0.999], "name": "adamw", "flag": True}
    assert back["history"][1]["loss"] == 1 / 3 and back["history"][0]["nan"] != back["history"][0]["nan"]


def test_flatten_rejects_what_json_cannot_hold():
    with pytest.raises(TypeError, match="x.y: dtype"):
        checkpoint.flatten({"x": {"y": torch.float32}})
    with pytest.raises(TypeError, match="key 3"):
        checkpoint.flatten({"x": {3: 1}})
    with pytest.raises(ValueError, match="'a.b'"):
        checkpoint.flatten({"a": {"b": torch.ones(1)}, "a.b": torch.ones(1)})


def test_packed_buffers_given_back_serve_the_next_state_of_their_layout(tmp_path):
    """A finished writer's buffer is taken again by the next save of the same keys, dtypes and shapes (and
    only by one of them); it writes the same file as the tensors themselves."""
    state = {"w": torch.randn(5, 3), "step": torch.tensor(7, dtype=torch.int64)}
    first = checkpoint.PackedTensors.take(state)
    first.give_back()
    assert checkpoint.PackedTensors.take({"w": torch.zeros(5, 3), "step": torch.tensor(0)}) is first
    assert checkpoint.PackedTensors.take(state) is not first  # taken: not handed out twice
    first.give_back()
    other = checkpoint.PackedTensors.take({"w": torch.zeros(5, 4), "step": torch.tensor(0)})
    assert other is not first and not other.matches(state) and first.matches(state)
    first.fill(state)
    digest = checkpoint.write_flat(tmp_path / "packed.safetensors", {}, first)
    assert checkpoint.write_flat(tmp_path / "plain.safetensors", {}, state) == digest


def test_load_runs_no_pickle(tmp_path, monkeypatch):
    trainer = make_trainer()
    fit(trainer, epochs=1)
    trainer.save_checkpoint(tmp_path / "c.safetensors")

    def refuse(*args, **kwargs):
        raise AssertionError("pickle was used")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    fresh = make_trainer()
    fresh.load_checkpoint(tmp_path / "c.safetensors")
    assert_same_state(fresh, trainer)
    assert fresh.history == trainer.history


def test_save_load_checkpoint_then_training_continues_bitwise(tmp_path):
    a, b = make_trainer(), make_trainer()
    fit(a, epochs=1)
    a.save_checkpoint(tmp_path / "c.safetensors")
    b.load_checkpoint(str(tmp_path / "c.safetensors"))
    assert_same_state(a, b)
    for trainer in (a, b):
        for x, y in data.batches(X, Y, 32, seed=9):
            trainer.step(x, y)
    assert_same_state(a, b)
    assert not list(tmp_path.glob(".*"))  # no temporary left behind


def test_save_checkpoint_to_a_folder_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="is a folder"):
        make_trainer().save_checkpoint(tmp_path)


# ------------------------------------------------------------------------------------------ fit resume
@pytest.mark.parametrize("at_step", [6, 13, 14, 27, 39])  # mid-epoch, last batch, first of epoch 2, ..., the end
def test_fit_resumes_mid_epoch_bitwise(tmp_path, straight, at_step):
    interrupted_fit(tmp_path, at_step, checkpoint_every=4)
    resumed = make_trainer()
    records = fit(resumed, checkpoint_dir=tmp_path, checkpoint_every=4, resume=True, schedule=constant_lr)
    reference, reference_records = straight
    assert_same_state(resumed, reference)
    assert without_time(records) == without_time(reference_records)
    assert without_time(resumed.history) == without_time(reference.history)
    assert saved_steps(tmp_path) == [36, 39]  # keep_last=2: the newest step checkpoint and the end of fit


def test_a_step_interval_saves_due_steps_and_the_end_not_epoch_ends(tmp_path):
    fit(make_trainer(), checkpoint_dir=tmp_path, checkpoint_every=4, keep_last=100)
    assert saved_steps(tmp_path) == [4, 8, 12, 16, 20, 24, 28, 32, 36, 39]  # epochs end at 13 and 26: not saved


def test_fit_resumes_an_iterable_by_skipping_consumed_batches(tmp_path):
    loader = list(data.batches(X, Y, BATCH, seed=3))
    reference = make_trainer()
    fit(reference, train=loader, schedule=constant_lr)
    interrupted_fit(tmp_path, 20, train=loader, checkpoint_every=3)
    resumed = make_trainer()
    fit(resumed, train=loader, checkpoint_dir=tmp_path, checkpoint_every=3, resume=True, schedule=constant_lr)
    assert_same_state(resumed, reference)
    assert without_time(resumed.history) == without_time(reference.history)


class FailingEval:
    def __iter__(self):
        raise Interrupt


def test_fit_interrupted_after_an_epochs_last_step_resumes_bitwise(tmp_path, straight):
    # checkpoint_every=13 saves after the last batch of epoch 1, before its evaluation (which fails here)
    with pytest.raises(Interrupt):
        fit(make_trainer(), eval=FailingEval(), checkpoint_dir=tmp_path, checkpoint_every=13, schedule=constant_lr)
    assert checkpoint.read(tmp_path / "checkpoint-000000013.safetensors")["fit"]["batches"] == 13
    resumed = make_trainer()
    records = fit(resumed, checkpoint_dir=tmp_path, checkpoint_every=13, resume=True, schedule=constant_lr)
    assert_same_state(resumed, straight[0])
    assert without_time(records) == without_time(straight[1])


def test_fit_with_dropout_resumes_bitwise(tmp_path):
    # the masks are a function of (dropout_seed, step_count, layer): both are in the checkpoint
    reference = make_trainer(dropout=0.2, dropout_seed=5)
    fit(reference, schedule=constant_lr)
    interrupted_fit(tmp_path, 23, make_trainer(dropout=0.2, dropout_seed=5), checkpoint_every=4)
    resumed = make_trainer(dropout=0.2, dropout_seed=5)
    fit(resumed, checkpoint_dir=tmp_path, checkpoint_every=4, resume=True, schedule=constant_lr)
    assert_same_state(resumed, reference)


def test_resume_of_a_finished_run_trains_nothing(tmp_path, straight):
    done = make_trainer()
    records = fit(done, checkpoint_dir=tmp_path)
    again = make_trainer()
    assert without_time(fit(again, checkpoint_dir=tmp_path, resume=True)) == without_time(records)
    assert again.step_count == done.step_count == EPOCHS * 13


def test_resume_without_checkpoints_starts_fresh_quietly(tmp_path, straight, recwarn):
    trainer = make_trainer()
    fit(trainer, checkpoint_dir=tmp_path / "new", resume=True, schedule=constant_lr)
    assert not [w for w in recwarn if "checkpoint" in str(w.message)]  # a fresh start is no warning
    assert_same_state(trainer, straight[0])
    assert saved_steps(tmp_path / "new") == [26, 39]  # epoch ends only


def test_resume_says_from_which_file_step_and_epoch(tmp_path, capsys):
    def interrupt_at_7(step):
        if step == 7:
            raise Interrupt
        return 1e-3

    with pytest.raises(Interrupt):
        fit(make_trainer(), checkpoint_dir=tmp_path, checkpoint_every=5, schedule=interrupt_at_7)
    fit(make_trainer(), checkpoint_dir=tmp_path, checkpoint_every=5, resume=True, progress=True)
    message = capsys.readouterr().err
    assert f"resumed from {tmp_path}" in message and "step 5, epoch 1, batch 5 of that epoch done" in message


def test_keep_last_and_checkpoint_every(tmp_path):
    fit(make_trainer(), epochs=1, checkpoint_dir=tmp_path, checkpoint_every=2, keep_last=3)
    assert saved_steps(tmp_path) == [10, 12, 13]


def test_resume_with_other_fit_arguments_is_refused(tmp_path):
    interrupted_fit(tmp_path, 10, checkpoint_every=4)
    trainer = make_trainer()
    before = tensors(trainer)
    with pytest.raises(ValueError, match=r"batch_size=32 \(checkpoint: 16\)"):
        fit(trainer, batch_size=32, checkpoint_dir=tmp_path, resume=True)
    with pytest.raises(ValueError, match=r"seed=1 \(checkpoint: 0\)"):
        fit(trainer, seed=1, checkpoint_dir=tmp_path, resume=True)
    after = tensors(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before) and trainer.step_count == 0


def test_fresh_run_into_a_folder_of_a_later_run_is_refused(tmp_path):
    interrupted_fit(tmp_path, 10, checkpoint_every=4)
    with pytest.raises(ValueError, match="checkpoint-000000008.safetensors.*resume=True"):
        fit(make_trainer(), checkpoint_dir=tmp_path)


# ------------------------------------------------------------------------------------------ damaged files
def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_tensor_bit(path):
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x10  # inside the last tensor's bytes
    path.write_bytes(bytes(raw))


def flip_json_digit(path):
    raw = path.read_bytes()
    at = raw.index(b'step_count\\": ') + len(b'step_count\\": ')
    digit = raw[at : at + 1]
    path.write_bytes(raw[:at] + (b"7" if digit != b"7" else b"6") + raw[at + 1 :])


@pytest.mark.parametrize(
    "damage, fault",
    [(truncate, "truncated or corrupted"), (flip_tensor_bit, "sha256"), (flip_json_digit, "sha256")],
)
def test_damaged_checkpoint_load_raises_naming_file_and_fault(tmp_path, damage, fault):
    path = tmp_path / "c.safetensors"
    source = make_trainer()
    fit(source, epochs=1)
    source.save_checkpoint(path)
    damage(path)
    trainer = make_trainer()
    before = tensors(trainer)
    with pytest.raises(ValueError, match=f"{path.name}.*{fault}"):
        trainer.load_checkpoint(path)
    after = tensors(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before) and trainer.step_count == 0


@pytest.mark.parametrize("damage", [truncate, flip_tensor_bit, flip_json_digit])
def test_resume_falls_back_past_a_damaged_newest_checkpoint(tmp_path, straight, damage):
    interrupted_fit(tmp_path, 20, checkpoint_every=4)  # checkpoints at steps 16 and 13 (end of epoch 1)
    damage(tmp_path / "checkpoint-000000016.safetensors")
    resumed = make_trainer()
    with pytest.warns(UserWarning, match="checkpoint-000000016.safetensors.*renamed it to .*corrupt"):
        fit(resumed, checkpoint_dir=tmp_path, checkpoint_every=4, resume=True, schedule=constant_lr)
    assert_same_state(resumed, straight[0])
    assert (tmp_path / "checkpoint-000000016.safetensors.corrupt").exists()


def test_wrong_shape_checkpoint_is_a_clear_error_and_changes_nothing(tmp_path):
    wide = make_trainer(width=20)
    wide.save_checkpoint(tmp_path / "wide.safetensors")
    trainer = make_trainer()
    fit(trainer, epochs=1)
    before, history = tensors(trainer), list(trainer.history)
    with pytest.raises(ValueError, match=r"model\.l1\.weight: checkpoint \(20, 10\), model \(14, 10\)"):
        trainer.load_checkpoint(tmp_path / "wide.safetensors")
    after = tensors(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before) and trainer.history == history
    # fit(resume=True) from such a folder raises the same, without falling back
    interrupted = interrupted_fit(tmp_path / "run", 10, checkpoint_every=4)
    assert interrupted.step_count == 9
    with pytest.raises(ValueError, match=r"l1\.weight: checkpoint \(14, 10\), model \(20, 10\)"):
        fit(make_trainer(width=20), checkpoint_dir=tmp_path / "run", resume=True)


def test_other_configuration_is_a_clear_error(tmp_path):
    make_trainer().save_checkpoint(tmp_path / "c.safetensors")
    with pytest.raises(ValueError, match="classifier_sample.inputs: in the checkpoint only"):
        make_trainer(sample=0).load_checkpoint(tmp_path / "c.safetensors")
    torch.manual_seed(0)
    double = td.DADTrainer(Net(dtype=torch.float64), classifier_sample_size=50)
    with pytest.raises(ValueError, match="model.l1.weight: checkpoint torch.float32, model torch.float64"):
        double.load_checkpoint(tmp_path / "c.safetensors")


def test_load_failure_after_the_checks_restores_the_previous_state(tmp_path):
    trainer = make_trainer()
    fit(trainer, epochs=1)
    trainer.save_checkpoint(tmp_path / "c.safetensors")
    state = checkpoint.read(tmp_path / "c.safetensors")
    state["trainer"]["config"]["unknown"] = 1  # passes the tensor checks, fails in load_state_dict
    checkpoint.write(tmp_path / "c.safetensors", state)
    fresh = make_trainer()
    before = tensors(fresh)
    with pytest.raises(TypeError, match="unknown"):
        fresh.load_checkpoint(tmp_path / "c.safetensors")
    after = tensors(fresh)
    assert all(torch.equal(before[k], after[k]) for k in before) and fresh.step_count == 0


# ------------------------------------------------------------------------------------------ arguments
@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"checkpoint_every": 0}, ValueError, "checkpoint_every=0"),
        ({"checkpoint_every": 2.5}, ValueError, "checkpoint_every=2.5"),
        ({"keep_last": 0}, ValueError, "keep_last=0"),
        ({"resume": "yes"}, TypeError, "resume"),
        ({"checkpoint_dir": 3}, TypeError, "checkpoint_dir"),
        ({"checkpoint_dir": "FILE"}, ValueError, "checkpoint_dir=.* is a file"),
        ({"checkpoint_dir": None, "resume": True}, ValueError, "resume=True needs checkpoint_dir"),
        ({"checkpoint_dir": None, "checkpoint_every": 5}, ValueError, "checkpoint_every=5 needs checkpoint_dir"),
    ],
)
def test_bad_checkpoint_arguments_raise_before_anything_changes(tmp_path, kwargs, error, match):
    (tmp_path / "file").write_text("x")
    kwargs = {"checkpoint_dir": tmp_path / "ckpt", **kwargs}
    if kwargs["checkpoint_dir"] == "FILE":
        kwargs["checkpoint_dir"] = tmp_path / "file"
    trainer = make_trainer()
    before = tensors(trainer)
    with pytest.raises(error, match=match):
        fit(trainer, **kwargs)
    after = tensors(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before) and trainer.step_count == 0
    assert not (tmp_path / "ckpt").exists() and trainer.history == []


# ------------------------------------------------------------------------------------------ dependency
@pytest.mark.slow
def test_safetensors_is_imported_only_when_a_checkpoint_is_written():
    code = "import sys, torch_dad; print('safetensors' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_missing_safetensors_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match=r"torch-dad\[checkpoint\]"):
        make_trainer().save_checkpoint(tmp_path / "c.safetensors")


def test_fit_without_safetensors_fails_before_training_or_making_the_folder(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "safetensors" or m.startswith("safetensors.")] + ["safetensors"]:
        monkeypatch.setitem(sys.modules, name, None)
    trainer = make_trainer()
    before = tensors(trainer)
    for resume in (False, True):
        with pytest.raises(ImportError, match=r"install the checkpoint extra, `pip install 'torch-dad\[checkpoint\]'`"):
            fit(trainer, checkpoint_dir=tmp_path / "runs", resume=resume)
    assert not (tmp_path / "runs").exists()
    after = tensors(trainer)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert trainer.step_count == 0 and trainer.history == []


def test_save_checkpoint_into_a_missing_folder_names_it(tmp_path):
    trainer = make_trainer()
    before = tensors(trainer)
    with pytest.raises(FileNotFoundError, match=f"the folder {tmp_path / 'no' / 'such'} does not exist; create it"):
        trainer.save_checkpoint(tmp_path / "no" / "such" / "c.safetensors")
    assert not (tmp_path / "no").exists()
    after = tensors(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_history_in_the_file_is_json(tmp_path):
    trainer = make_trainer()
    fit(trainer, epochs=1, checkpoint_dir=tmp_path)
    raw = (tmp_path / "checkpoint-000000013.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    document = json.loads(header["__metadata__"]["torch_dad"])
    assert document["format"] == "torch_dad.checkpoint" and document["version"] == 2
    assert document["state"]["trainer"]["history"][0]["loss"] == trainer.history[0]["loss"]
    assert document["state"]["fit"]["epoch"] == 1 and document["state"]["fit"]["batches"] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checkpoint.read(tmp_path / "checkpoint-000000013.safetensors")


def test_a_version_1_file_still_loads_and_its_digest_still_guards_it(tmp_path):
    """Files whose digest interleaves each tensor's description and bytes (format version 1) verify and load."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    tensors = {"b": torch.arange(3.0), "a": torch.ones(2, 2, dtype=torch.float64)}
    state = {"w": {"__tensor__": "a"}, "v": {"__tensor__": "b"}, "n": 3}
    document = json.dumps({"format": "torch_dad.checkpoint", "version": 1, "state": state})
    digest = hashlib.sha256(document.encode())
    for key in sorted(tensors):
        digest.update(f"\0{key}\0{tensors[key].dtype}\0{tuple(tensors[key].shape)}\0".encode())
        digest.update(tensors[key].numpy().tobytes())
    raw = safetensors_torch.save(tensors, metadata={"torch_dad": document, "sha256": digest.hexdigest()})
    (tmp_path / "v1.safetensors").write_bytes(raw)
    loaded = checkpoint.read(tmp_path / "v1.safetensors")
    assert loaded["n"] == 3 and torch.equal(loaded["w"], tensors["a"]) and torch.equal(loaded["v"], tensors["b"])
    altered = bytearray(raw)
    altered[-1] ^= 1
    (tmp_path / "altered.safetensors").write_bytes(bytes(altered))
    with pytest.raises(checkpoint.CheckpointError, match="sha256 does not match"):
        checkpoint.read(tmp_path / "altered.safetensors")


def test_shard_files_read_back_with_safetensors_for_every_dtype_and_shape(tmp_path):
    """The chunked writer of distributed shards produces files that safetensors itself loads, bit for bit."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "f64": torch.randn(3, 5, generator=generator, dtype=torch.float64),
        "bf16": torch.randn(7, generator=generator).to(torch.bfloat16),
        "f16": torch.randn(2, 3, 1, generator=generator).half(),
        "i64": torch.arange(5), "i8": torch.tensor([-3, 4], dtype=torch.int8),
        "bool": torch.tensor([True, False, True]), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
        "u8": torch.arange(3, dtype=torch.uint8), "i32": torch.tensor([7], dtype=torch.int32),
    }
    path = tmp_path / "shard.safetensors"
    digest = checkpoint.write_flat(path, {"x": 1}, tensors)
    loaded = safetensors_torch.load_file(path)
    assert loaded.keys() == tensors.keys()
    for key, tensor in tensors.items():
        assert loaded[key].dtype == tensor.dtype and loaded[key].shape == tensor.shape and torch.equal(loaded[key], tensor)
    skeleton, read, declared = checkpoint.read_parts(path)
    assert skeleton == {"x": 1} and declared == digest == checkpoint.declared_digest(path)
    with pytest.raises(TypeError, match="complex64 has no safetensors code"):
        checkpoint.write_flat(tmp_path / "bad.safetensors", {}, {"c": torch.zeros(2, dtype=torch.complex64)})
    packed = checkpoint.PackedTensors(tensors)
    assert packed.matches(tensors) and not packed.matches({**tensors, "i8": torch.zeros(3, dtype=torch.int8)})
    # a non-contiguous source, packed into the same bytes
    assert not packed.fill({**tensors, "f64": tensors["f64"].T.contiguous().T})
    assert checkpoint.write_flat(tmp_path / "packed.safetensors", {"x": 1}, packed) == digest
    assert (tmp_path / "packed.safetensors").read_bytes() == path.read_bytes()
    with pytest.raises(TypeError, match="complex64 has no safetensors code"):
        checkpoint.PackedTensors({"c": torch.zeros(2, dtype=torch.complex64)})


def test_fit_checkpoints_refuse_a_custom_gradient_reducer(tmp_path):
    """One process's checkpoints would miss the other ranks' state: DataParallelTrainer shards instead."""
    trainer = make_trainer()
    trainer.set_reducers(lambda grads: None)
    with pytest.raises(ValueError, match="use DataParallelTrainer"):
        fit(trainer, checkpoint_dir=tmp_path / "run")
    assert trainer.step_count == 0 and not (tmp_path / "run").exists()


def test_flatten_splits_tensors_from_json_and_names_what_it_cannot_hold():
    """One pass: each tensor under its dotted key, a placeholder in the skeleton, leaf records copied (a later
    change to the live history does not reach a skeleton a writer thread still serializes)."""
    weight, step = torch.ones(2, 3), torch.tensor(4)
    history = [{"loss": 0.5, "epoch": 1}, {"loss": 0.25, "epoch": 2}]
    state = {"model": {"w": weight, "pair": (step, None)}, "history": history, "name": "x"}
    skeleton, tensors = checkpoint.flatten(state, copy=lambda t: t)
    assert set(tensors) == {"model.w", "model.pair.0"} and tensors["model.w"] is weight
    assert skeleton["model"] == {"w": {"__tensor__": "model.w"}, "pair": [{"__tensor__": "model.pair.0"}, None]}
    history[0]["loss"] = 9.0
    assert skeleton["history"] == [{"loss": 0.5, "epoch": 1}, {"loss": 0.25, "epoch": 2}]
    restored = checkpoint.unflatten(skeleton, tensors)
    assert restored["model"]["w"] is weight and restored["model"]["pair"] == [step, None] and restored["name"] == "x"
    assert checkpoint.flatten(state, keep=lambda key: key == "model.w")[1].keys() == {"model.w"}
    with pytest.raises(ValueError, match="two tensors flatten to the key 'a.b'; rename one"):
        checkpoint.flatten({"a.b": weight, "a": {"b": step}})
    with pytest.raises(TypeError, match="checkpoint state a.0: set is neither a tensor nor JSON"):
        checkpoint.flatten({"a": [{1, 2}]})
    with pytest.raises(TypeError, match=r"checkpoint state a: key 3 must be a str other than '__tensor__'"):
        checkpoint.flatten({"a": {3: 1.0}})
    with pytest.raises(TypeError, match=r"checkpoint state <root>: key '__tensor__' must be a str"):
        checkpoint.flatten({"__tensor__": weight})
