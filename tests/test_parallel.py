"""torch_dad.training.parallel on CPU/gloo: 2 spawned processes against single-process DADTrainer.

One spawn (module fixture) runs every distributed scenario and saves what each rank saw;
the tests compare it with a single-process run computed here. Equality is what the math
promises: data-parallel global batch 2B == single-process batch 2B, pipeline == sequential.
"""

from __future__ import annotations

import itertools
import os
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_dad as td
from torch_dad import data
from torch_dad.training import DataParallelTrainer, Pipeline
from torch_dad.training.pipeline import partition_layers

from .conftest import relative_error
from .test_sequence_heads import SEQ, VOCAB

WORLD = 2
D_IN, CLASSES = 21, 5
DEVICE = "cpu"  # set per rank in _worker: "cpu" (gloo) or "cuda:<rank>" (nccl)
TWO_GPUS = torch.cuda.is_available() and torch.cuda.device_count() >= 2
# fp32: the 2-rank sum of two half-batch means differs from the full-batch mean by rounding
# only; measured worst relative error after 10 AdamW steps is printed by the tests (~1e-7).
TOL = 1e-6


# the fused engine (backend="fused": Triton kernels on CUDA, their PyTorch twins on CPU)
# implements these activations; gelu takes the eager path
FUSED_ACTS = ("relu", "tanh", "identity", "relu")


class Net(td.DADModel):
    def __init__(self, widths=(D_IN, 37, 19, 13), classifier=True, acts=("relu", "gelu", "tanh", "relu")):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            td.DADLinear(a, b, num_classes=CLASSES, activation=acts[i % 4])
            for i, (a, b) in enumerate(zip(widths[:-1], widths[1:]))
        )
        if classifier:
            self.classifier = torch.nn.Linear(widths[-1], CLASSES)


class ConvNet(td.DADModel):
    """A conv stem, a residual DADBlock and a dense layer: the layer types a stage may hold."""

    def __init__(self):
        super().__init__()
        self.stem = td.DADConv2d(1, 4, 3, padding=1, num_classes=CLASSES, pool="max")
        self.block = td.DADBlock(_Residual(4), num_classes=CLASSES, head_features=4)
        self.dense = td.DADLinear(4 * 3 * 3, 11, num_classes=CLASSES)
        self.classifier = torch.nn.Linear(11, CLASSES)


class _Residual(torch.nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv = torch.nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return torch.relu(x + self.conv(x))


def make_images(n=107, seed=3):
    x, y, _, _ = make_data(n, seed)
    return x[:, :18].reshape(n, 1, 6, 3).repeat(1, 1, 1, 2), y  # 1 x 6 x 6 images


def make_data(n=107, seed=3):
    (x, y), (xt, yt) = data.synthetic(num_train=n, num_test=49, num_features=D_IN, num_classes=CLASSES, seed=seed)
    return x, y, xt, yt  # 107 = 4 * 24 + 11: the last global batch splits 5 / 6 over 2 ranks


def full_state(trainer):
    state = trainer.state_dict()
    flat = {f"model.{k}": v for k, v in state["model"].items()}
    flat.update({f"head.{k}": v for k, v in (state["classifier_state"] or {}).items()})
    flat.update({f"stats.{k}": v for k, v in (state["classifier_statistics"] or {}).items()})
    return {k: v.detach().cpu().clone() for k, v in flat.items()}


def trainer_kwargs():
    # solve_head() from streamed statistics on both sides (what the parallel trainers use)
    return {"lr": 3e-2, "weight_decay": 0.01, "classifier_sample_size": 0}


def fused_kwargs():
    # the non-finite guard (default "raise" on CPU) runs only in the eager layer loop: without
    # "ignore" a CPU trainer with backend="fused" would take the eager path
    return {**trainer_kwargs(), "on_nonfinite": "ignore"}


# ---------------------------------------------------------------------------- worker
def _catch(fn):
    try:
        fn()
    except (ValueError, TypeError) as err:
        return f"{type(err).__name__}: {err}"
    return None


def _data_parallel(rank, out, overlap, epochs):
    # a different seed per rank: the trainer must copy rank 0's initial weights everywhere
    torch.manual_seed(100 + rank)
    trainer = DataParallelTrainer(Net(), DEVICE, overlap=overlap, **trainer_kwargs())
    x, y, xt, yt = make_data()
    records = trainer.fit((x, y), epochs=epochs, batch_size=24, progress=False, eval=(xt, yt))
    out["records"] = records
    out["local_state"] = full_state(trainer)  # head statistics still per rank here
    out["solution"] = trainer.solve_head(lambda_reg=0.1)
    out["solved"] = full_state(trainer)
    out["evaluate"] = trainer.evaluate((xt, yt), batch_size=10)
    before = full_state(trainer)
    out["bad_batch"] = _catch(lambda: trainer.fit((x, y), batch_size=25, progress=False))
    out["bad_seed"] = _catch(lambda: trainer.fit((x, y), batch_size=24, seed=None, progress=False))
    out["bad_batch_unchanged"] = all(torch.equal(v, full_state(trainer)[k]) for k, v in before.items())
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    out["bad_loader"] = _catch(lambda: trainer.fit(loader, progress=False))
    sampler = torch.utils.data.distributed.DistributedSampler(
        torch.utils.data.TensorDataset(x, y), shuffle=True, seed=0
    )
    good = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, sampler=sampler)
    out["epochs_before_sampler"] = len(trainer.history)
    out["sampler_records"] = trainer.fit(good, epochs=2, progress=False)
    out["sampler_epoch"] = sampler.epoch


def _data_parallel_fused(rank, out):
    torch.manual_seed(100 + rank)
    trainer = DataParallelTrainer(Net(acts=FUSED_ACTS), DEVICE, backend="fused", **fused_kwargs())
    out["engine"] = type(trainer.engine).__name__ if trainer.uses_engine else "not applied"
    x, y, xt, yt = make_data()
    out["records"] = trainer.fit((x, y), epochs=2, batch_size=24, progress=False, eval=(xt, yt))
    out["local_state"] = full_state(trainer)


def _pipeline_fused(rank, out):
    torch.manual_seed(200 + rank)
    trainer = td.DADTrainer(Net(acts=FUSED_ACTS), DEVICE, backend="fused", **fused_kwargs())
    out["engine"] = type(trainer.engine).__name__ if trainer.uses_engine else "not applied"
    pipe = Pipeline(trainer, balance=[1, 2])
    x, y, xt, yt = make_data()
    out["records"] = pipe.fit((x, y) if rank == 0 else None, epochs=2, batch_size=16, progress=False,
                              eval=(xt, yt) if rank == 0 else None)
    pipe.synchronize()
    out["synced"] = full_state(trainer)


def _data_parallel_sampled(rank, out):
    # the default classifier_sample_size: each rank samples its own rows for solve_head()
    torch.manual_seed(100 + rank)
    trainer = DataParallelTrainer(Net(), DEVICE, lr=3e-2, weight_decay=0.01)
    x, y, _, _ = make_data()
    trainer.fit((x, y), epochs=2, batch_size=24, progress=False)
    sample = trainer.classifier_sample
    out["sample"] = (sample.inputs[: sample.size].cpu().clone(), sample.labels[: sample.size].cpu().clone())
    stats = trainer.classifier_statistics  # not even allocated in the sampled mode
    out["gram_count"] = None if stats is None else float(stats.count)
    out["model"] = {k: v.cpu().clone() for k, v in trainer.model.state_dict().items()}
    out["solution"] = trainer.solve_head(lambda_reg=0.1)
    out["sample_after"] = sample.size


def _pipeline_sampled(rank, out):
    torch.manual_seed(200 + rank)
    trainer = td.DADTrainer(Net(), DEVICE, lr=3e-2, weight_decay=0.01, classifier_sample_size=50)
    pipe = Pipeline(trainer, balance=[1, 2])
    x, y, _, _ = make_data()
    pipe.fit((x, y) if rank == 0 else None, epochs=2, batch_size=16, progress=False)
    out["has_sample"] = trainer.classifier_sample is not None
    out["evaluate"] = pipe.evaluate((x, y) if rank == 0 else None, batch_size=10)  # must not feed the sample
    stats = trainer.classifier_statistics  # not even allocated in the sampled mode
    out["gram_count"] = None if stats is None else float(stats.count)
    out["solution"] = pipe.solve_head(lambda_reg=0.1)
    out["again"] = _catch(lambda: pipe.solve_head(lambda_reg=0.1))  # the sample was reset by the solve


def _pipeline(rank, out, balance):
    torch.manual_seed(200 + rank)
    trainer = td.DADTrainer(Net(), DEVICE, **trainer_kwargs())
    pipe = Pipeline(trainer, balance=balance)
    out["bounds"] = pipe.bounds
    x, y, xt, yt = make_data()
    first = rank == 0
    out["records"] = pipe.fit((x, y) if first else None, epochs=2, batch_size=16, progress=False,
                              eval=(xt, yt) if first else None)
    out["stage_state"] = {k: v.clone() for k, v in full_state(trainer).items()}
    out["solution"] = pipe.solve_head(lambda_reg=0.1)
    out["streamed_solution"] = pipe.solve_head(lambda_reg=0.1, data=(x, y) if first else None)
    out["evaluate"] = pipe.evaluate((xt, yt) if first else None, batch_size=10)
    pipe.synchronize()
    out["synced"] = full_state(trainer)


def _conv_models(rank, out):
    torch.manual_seed(400 + rank)
    trainer = DataParallelTrainer(ConvNet(), DEVICE, **trainer_kwargs())
    x, y = make_images()
    trainer.fit((x, y), epochs=1, batch_size=24, progress=False)
    out["dp_state"] = full_state(trainer)
    torch.manual_seed(500 + rank)
    trainer = td.DADTrainer(ConvNet(), DEVICE, **trainer_kwargs())
    pipe = Pipeline(trainer, balance=[1, 2])  # the conv | the block and the dense layer
    pipe.fit((x, y) if rank == 0 else None, epochs=1, batch_size=16, progress=False)
    pipe.synchronize()
    out["pipe_state"] = full_state(trainer)


class _PrefixMix(torch.nn.Module):
    """``x + tanh(W mean(x[:, :t+1]))`` at every position t: causal, and every weight gets a gradient (an
    attention layer's key bias gets none but rounding, which AdamW scales up to a full step)."""

    def __init__(self, width):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)

    def forward(self, x):
        prefix = x.cumsum(1) / torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)[:, None]
        return x + torch.tanh(self.linear(prefix))


class TokenNet(td.DADModel):
    """Three token-level DADBlocks (bucket, low-rank and fused vocabulary heads; the last is the LM head)."""

    def __init__(self, width=8):
        super().__init__()
        torch.manual_seed(6)  # the same model on every rank and in the reference
        first = torch.nn.Sequential(torch.nn.Embedding(VOCAB, width), _PrefixMix(width))
        self.blocks = torch.nn.ModuleList(
            td.DADBlock(module, head, num_classes=VOCAB, head_features=width)
            for module, head in zip((first, _PrefixMix(width), _PrefixMix(width)), ("bucket", "lowrank", "fused"))
        )


def token_data(rows=24, seed=7):
    """Token ids (rows, SEQ) and next-token labels, about a third ignored (-100) at random: the rows, and
    so the ranks' shards, hold different numbers of labelled tokens."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (rows, SEQ), generator=generator)
    y = (x + 1) % VOCAB
    y[torch.rand(rows, SEQ, generator=generator) < 0.35] = -100
    return x, y


def _token_models(rank, out):
    x, y = token_data()
    xt, yt = token_data(11, seed=8)
    trainer = DataParallelTrainer(TokenNet(), DEVICE, lr=1e-2)
    out["dp_records"] = trainer.fit((x, y), batch_size=8, progress=False, eval=(xt, yt))
    out["dp_state"] = full_state(trainer)
    out["dp_evaluate"] = trainer.evaluate((xt, yt), batch_size=4)
    trainer = td.DADTrainer(TokenNet(), DEVICE, lr=1e-2)
    pipe = Pipeline(trainer, balance=[1, 2])
    first = rank == 0
    out["pipe_records"] = pipe.fit((x, y) if first else None, batch_size=8, progress=False,
                                   eval=(xt, yt) if first else None)
    out["pipe_evaluate"] = pipe.evaluate((xt, yt) if first else None, batch_size=4)
    out["pipe_solve"] = _catch(lambda: pipe.solve_head(data=(x, y) if first else None))
    unlabelled = (xt, torch.full_like(yt, -100))
    out["pipe_unlabelled"] = _catch(lambda: pipe.evaluate(unlabelled if first else None))
    pipe.synchronize()
    out["pipe_state"] = full_state(trainer)


def _errors(rank, out):
    torch.manual_seed(0)
    out["too_many_stages"] = _catch(lambda: Pipeline(td.DADTrainer(Net(widths=(D_IN, 7)), DEVICE)))
    widths = (D_IN, 37, 19, 13) if rank == 0 else (D_IN, 36, 19, 13)
    out["mismatched_model"] = _catch(lambda: DataParallelTrainer(Net(widths=widths), DEVICE))
    out["mismatched_lr"] = _catch(lambda: DataParallelTrainer(Net(), DEVICE, lr=1e-3 * (rank + 1)))
    out["bad_balance"] = _catch(lambda: Pipeline(td.DADTrainer(Net(), DEVICE), balance=[2, 2]))
    out["mismatched_balance"] = _catch(
        lambda: Pipeline(td.DADTrainer(Net(), DEVICE), balance=[1, 2] if rank == 0 else [2, 1])
    )


def autograd_net():
    from torch_dad.nn.autograd import DADAutogradLinear

    return torch.nn.Sequential(
        torch.nn.Flatten(),
        DADAutogradLinear(D_IN, 37, num_classes=CLASSES, activation="relu", update="grad"),
        DADAutogradLinear(37, 19, num_classes=CLASSES, activation="gelu", update="grad"),
        DADAutogradLinear(19, CLASSES, update="grad"),
    )


def autograd_steps(model, x, y, shard=slice(None), steps=3, batch=24):
    """``update="grad"`` DAD layers + torch AdamW; ``model`` may be DDP-wrapped (then ``shard`` picks rows)."""
    from torch_dad.nn.autograd import label_context

    plain = getattr(model, "module", model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for t in range(steps):
        xb, yb = x[t * batch : (t + 1) * batch][shard], y[t * batch : (t + 1) * batch][shard]
        with label_context(plain, yb):
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().cpu().clone() for k, v in plain.state_dict().items()}


def _ddp_autograd(rank, out):
    torch.manual_seed(300 + rank)
    model = autograd_net()
    ids = [rank] if DEVICE != "cpu" else None
    # DDP copies rank 0's weights; no find_unused_parameters
    ddp = torch.nn.parallel.DistributedDataParallel(model.to(DEVICE), device_ids=ids)
    x, y = (t.to(DEVICE) for t in make_data()[:2])
    out["state"] = autograd_steps(ddp, x, y, shard=slice(rank * 12, (rank + 1) * 12))


def _worker(rank, world, port, outdir, backend):
    global DEVICE
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        DEVICE = f"cuda:{rank}"
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device(DEVICE))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    out: dict = {}
    try:
        for name, fn in [
            ("dp_overlap", lambda o: _data_parallel(rank, o, True, 2)),
            ("dp_blocking", lambda o: _data_parallel(rank, o, False, 1)),
            ("pipe_auto", lambda o: _pipeline(rank, o, None)),
            ("pipe_1_2", lambda o: _pipeline(rank, o, [1, 2])),
            ("dp_fused", lambda o: _data_parallel_fused(rank, o)),
            ("pipe_fused", lambda o: _pipeline_fused(rank, o)),
            ("dp_sampled", lambda o: _data_parallel_sampled(rank, o)),
            ("pipe_sampled", lambda o: _pipeline_sampled(rank, o)),
            ("errors", lambda o: _errors(rank, o)),
            ("conv", lambda o: _conv_models(rank, o)),
            ("tokens", lambda o: _token_models(rank, o)),
            ("ddp_autograd", lambda o: _ddp_autograd(rank, o)),
        ]:
            out[name] = {}
            fn(out[name])
    except Exception:  # noqa: BLE001 - reported to the parent test
        out["crash"] = traceback.format_exc()
    finally:
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Ranks(list):
    """What each rank saved, plus the device the single-process reference must use."""

    device = "cpu"


@pytest.fixture(
    scope="module",
    params=["gloo", pytest.param("nccl", marks=pytest.mark.skipif(not TWO_GPUS, reason="needs 2 CUDA GPUs"))],
)
def ranks(request, tmp_path_factory):
    backend = request.param
    outdir = tmp_path_factory.mktemp(f"parallel-{backend}")
    mp.spawn(_worker, args=(WORLD, _free_port(), str(outdir), backend), nprocs=WORLD, join=True)
    results = Ranks(torch.load(outdir / f"rank{r}.pt", weights_only=False, map_location="cpu") for r in range(WORLD))
    results.device = "cuda:0" if backend == "nccl" else "cpu"
    for r, res in enumerate(results):
        assert "crash" not in res, f"rank {r} crashed:\n{res['crash']}"
    return results


# ---------------------------------------------------------------------------- single-process references
@pytest.fixture(autouse=True)
def _one_thread():
    # the workers use one thread; a GEMM's fp32 summation order depends on the thread count
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reference(epochs, batch_size, seed_rank0, device="cpu", fused=False):
    torch.manual_seed(seed_rank0)
    if fused:
        trainer = td.DADTrainer(Net(acts=FUSED_ACTS), device, backend="fused", **fused_kwargs())
        assert trainer.uses_engine
    else:
        trainer = td.DADTrainer(Net(), device, **trainer_kwargs())
    x, y, xt, yt = make_data()
    records = trainer.fit((x, y), epochs=epochs, batch_size=batch_size, progress=False, eval=(xt, yt))
    return trainer, records


def ridge_condition(trainer, batches, lambda_reg=0.1):
    """cond(G + lambda I) of the centred Gram matrix of ``trainer``'s features on ``batches``: how much
    a ridge solve can magnify a relative perturbation of its inputs."""
    from torch_dad.ridge import GramAccumulator

    head = trainer.model.classifier
    stats = GramAccumulator(head.in_features, head.out_features, device=trainer.device)
    with torch.no_grad():
        for x, y in batches:
            stats.update(trainer.model.features(x.to(trainer.device)), y.to(trainer.device))
    eig = torch.linalg.eigvalsh(stats.centred()[0].cpu())
    return float((eig.max() + lambda_reg) / (eig.min().clamp_min(0) + lambda_reg))


def assert_close_states(got, want, tol, skip=()):
    assert got.keys() == want.keys()
    worst = 0.0
    for k in want:
        if any(k.startswith(p) for p in skip):
            continue
        err = relative_error(got[k], want[k]) if want[k].norm() > 0 else float((got[k] - want[k]).abs().max())
        assert err <= tol, f"{k}: relative error {err:.2e} > {tol:.0e}"
        worst = max(worst, err)
    return worst


# ---------------------------------------------------------------------------- data parallel
@pytest.mark.parametrize("name,epochs", [("dp_overlap", 2), ("dp_blocking", 1)])
@pytest.mark.slow
def test_data_parallel_global_batch_equals_single_process(ranks, name, epochs):
    trainer, records = reference(epochs, 24, seed_rank0=100, device=ranks.device)
    want = full_state(trainer)
    r0, r1 = ranks[0][name], ranks[1][name]
    # weights, local heads, optimizer moments: equal to single process, and bitwise equal across ranks
    worst = assert_close_states(r0["local_state"], want, TOL, skip=("stats.",))
    print(f"{name}: worst relative error vs single process {worst:.1e}")
    for k, v in r0["local_state"].items():
        if not k.startswith("stats."):
            assert torch.equal(v, r1["local_state"][k]), k
    # Gram statistics: each rank holds its shards' part (window-decayed); their sum is the single run's
    for k in [k for k in want if k.startswith("stats.")]:
        total = r0["local_state"][k] + r1["local_state"][k]
        assert relative_error(total, want[k]) <= TOL, k
    # records: global loss and the accuracy after each epoch
    for got, ref in zip(r0["records"], records):
        assert got["accuracy"] == ref["accuracy"]
        assert abs(got["eval_loss"] - ref["eval_loss"]) <= 1e-5 * abs(ref["eval_loss"])
    # solve_head sums statistics over ranks: the same closed-form head as single process
    solution = trainer.solve_head(lambda_reg=0.1)
    for r in (r0, r1):
        assert relative_error(r["solution"].weight, solution.weight.cpu()) <= 1e-5
        assert r["solution"].num_samples == solution.num_samples
    assert_close_states(r0["solved"], full_state(trainer), 1e-5)
    metrics = trainer.evaluate(make_data()[2:], batch_size=10)
    for r in (r0, r1):
        assert r["evaluate"]["samples"] == metrics["samples"]
        assert r["evaluate"]["accuracy"] == metrics["accuracy"]
        assert abs(r["evaluate"]["loss"] - metrics["loss"]) <= 1e-5 * metrics["loss"]


@pytest.mark.slow
def test_conv_and_block_models_data_parallel_and_pipeline(ranks):
    """DADConv2d and DADBlock train alike with data parallelism (global batch 24 over 2 ranks) and
    in a pipeline (conv on one stage, block and dense layer on the other) as on one process."""
    x, y = make_images()
    for key, seed, batch_size, tol in (("dp_state", 400, 24, 1e-5), ("pipe_state", 500, 16, 0.0)):
        torch.manual_seed(seed)
        trainer = td.DADTrainer(ConvNet(), ranks.device, **trainer_kwargs())
        trainer.fit((x, y), epochs=1, batch_size=batch_size, progress=False)
        want = full_state(trainer)
        for rank in ranks:
            got = rank["conv"][key]
            skip = ("stats.",) if key == "dp_state" else ()  # per-rank Gram statistics
            if tol == 0.0 and ranks.device == "cpu":
                assert all(torch.equal(got[k], want[k]) for k in want), key
            else:
                assert_close_states(got, want, max(tol, TOL), skip=skip)


@pytest.mark.slow
def test_token_models_data_parallel_and_pipeline(ranks):
    """Token labels (batch, T): data parallelism (global batch 8 over 2 ranks, shards with different numbers
    of labelled tokens) equals one process to TOL, a pipeline equals sequential training bit for bit on CPU;
    evaluate counts labelled tokens as one process does, and solve_head refuses on every rank."""
    x, y = token_data()
    xt, yt = token_data(11, seed=8)
    trainer = td.DADTrainer(TokenNet(), ranks.device, lr=1e-2)
    records = trainer.fit((x, y), batch_size=8, progress=False, eval=(xt, yt))
    want, metrics = full_state(trainer), trainer.evaluate((xt, yt), batch_size=4)
    assert metrics["samples"] == int((yt != -100).sum())
    # fit's first (only) epoch: the shards' labelled tokens differ, so a share of rows would not be exact
    order = torch.randperm(24, generator=torch.Generator().manual_seed(0))
    halves = [(y[order[i : i + 4]] != -100).sum() - (y[order[i + 4 : i + 8]] != -100).sum() for i in (0, 8, 16)]
    assert any(int(d) != 0 for d in halves)
    exact = ranks.device == "cpu"
    for rank in ranks:
        out = rank["tokens"]
        assert_close_states(out["dp_state"], want, TOL)
        assert_close_states(out["pipe_state"], want, 0.0 if exact else TOL)
        for key in ("dp_evaluate", "pipe_evaluate"):
            assert out[key]["samples"] == metrics["samples"] and out[key]["accuracy"] == metrics["accuracy"]
            assert abs(out[key]["loss"] - metrics["loss"]) <= (0.0 if exact and key == "pipe_evaluate" else 1e-5)
        for got in (out["dp_records"][0], out["pipe_records"][0]):
            assert got["accuracy"] == records[0]["accuracy"]
            assert abs(got["eval_loss"] - records[0]["eval_loss"]) <= 1e-5 * records[0]["eval_loss"]
        # the pipeline's loss: the mean of the last stage's per-token step losses, as one process
        assert abs(out["pipe_records"][0]["loss"] - records[0]["loss"]) <= (0.0 if exact else 1e-6)
        assert out["pipe_solve"].startswith("ValueError: solve_head() needs model.classifier")
        assert "token labels (batch, T): no solve" in out["pipe_solve"]
        assert out["pipe_unlabelled"] == "ValueError: evaluate() got no batches (or no labelled position)"


@pytest.mark.slow
def test_data_parallel_bad_configuration(ranks):
    for res in ranks:
        out = res["dp_overlap"]
        assert out["bad_batch"].startswith("ValueError") and "multiple of the world size 2" in out["bad_batch"]
        assert out["bad_seed"].startswith("ValueError") and "pass an int seed" in out["bad_seed"]
        assert out["bad_batch_unchanged"]
        assert "DistributedSampler" in out["bad_loader"]
        # a DistributedSampler loader trains; set_epoch gets the number of epochs trained before each epoch
        assert out["sampler_epoch"] == out["epochs_before_sampler"] + 1 and len(out["sampler_records"]) == 2
        assert all(r["loss"] == r["loss"] for r in out["sampler_records"])


# ---------------------------------------------------------------------------- pipeline
@pytest.mark.parametrize("name,bounds", [("pipe_auto", None), ("pipe_1_2", [(0, 1), (1, 3)])])
@pytest.mark.slow
def test_pipeline_equals_sequential(ranks, name, bounds):
    trainer, records = reference(2, 16, seed_rank0=200, device=ranks.device)
    # CPU: same kernels, same inputs, same order, so bitwise equal; two GPUs: to rounding
    same = torch.equal if ranks.device == "cpu" else (lambda a, b: relative_error(a, b) <= TOL)
    r0, r1 = ranks[0][name], ranks[1][name]
    if bounds is not None:
        assert r0["bounds"] == bounds
    start, stop = r0["bounds"][1]
    want = full_state(trainer)
    # each stage's own layers match the sequential run (the other stage's copy is stale)
    for stage, res in enumerate((r0, r1)):
        lo, hi = res["bounds"][stage]
        mine = [k for k in want if k.startswith("model.layers.") and lo <= int(k.split(".")[2]) < hi]
        assert mine
        for k in mine:
            assert same(res["stage_state"][k], want[k]), k
    for k in want:
        if k.startswith(("model.classifier", "head.", "stats.")):
            assert same(r1["stage_state"][k], want[k]), k
    for got, ref in zip(r0["records"], records):
        assert got["accuracy"] == ref["accuracy"]
        assert abs(got["loss"] - ref["loss"]) <= 1e-6 * ref["loss"]
    assert r0["records"] == r1["records"]
    # solve_head on the last stage from the training statistics, then from streamed features
    solution = trainer.solve_head(lambda_reg=0.1)
    assert r0["solution"] is None and relative_error(r1["solution"].weight, solution.weight.cpu()) <= 1e-5
    streamed = trainer.solve_head(lambda_reg=0.1, loader=[make_data()[:2]])
    assert r0["streamed_solution"] is None
    # On CUDA the stages' weights agree to TOL (asserted above), the Gram statistics sum with
    # atomics (index_add_), and a ridge solve moves a relative input perturbation e by up to
    # cond(G + lambda I) * e: the bound below is that, with e = 10 * TOL. Measured over NCCL on
    # 2 x H200 (2026-11-30): 4.0e-5 against a former fixed 1e-5.
    cond = 0.0
    if ranks.device == "cpu":
        assert torch.equal(r1["streamed_solution"].weight, streamed.weight.cpu())
    else:
        cond = ridge_condition(trainer, [make_data()[:2]])
        error = relative_error(r1["streamed_solution"].weight, streamed.weight.cpu())
        assert error <= 10 * TOL * cond, (error, cond)
    metrics = trainer.evaluate(make_data()[2:], batch_size=10)
    for r in (r0, r1):
        assert r["evaluate"]["accuracy"] == metrics["accuracy"]
        assert abs(r["evaluate"]["loss"] - metrics["loss"]) <= 1e-5 * metrics["loss"]
    # after synchronize() every rank holds the whole sequentially trained model
    final = full_state(trainer)
    # on CUDA the classifier now holds the streamed ridge solution, bounded above by the conditioning
    # (it differed by 3.5e-5 / 5.5e-5 over NCCL, 2026-11-30); everything else stays within 1e-5
    solved = () if ranks.device == "cpu" else ("model.classifier.",)
    for r in (r0, r1):
        assert_close_states(r["synced"], final, 1e-5, skip=solved)
        for k in [k for k in final if solved and k.startswith(solved)]:
            assert relative_error(r["synced"][k], final[k]) <= 10 * TOL * cond, (k, cond)


@pytest.mark.slow
def test_fused_engine_data_parallel_and_pipeline_equal_single_process(ranks):
    # the fused engine's distributed paths: data parallel (per-layer all-reduce, AdamW one
    # layer later) and a pipeline stage span, against the fused single-process step
    for res in ranks:
        assert res["dp_fused"]["engine"] == res["pipe_fused"]["engine"] == "FusedStep"
    trainer, records = reference(2, 24, seed_rank0=100, device=ranks.device, fused=True)
    want = full_state(trainer)
    r0, r1 = ranks[0]["dp_fused"], ranks[1]["dp_fused"]
    worst = assert_close_states(r0["local_state"], want, TOL, skip=("stats.",))
    print(f"fused data parallel: worst relative error vs single process {worst:.1e}")
    for k, v in r0["local_state"].items():
        if not k.startswith("stats."):
            assert torch.equal(v, r1["local_state"][k]), k
    for k in [k for k in want if k.startswith("stats.")]:
        assert relative_error(r0["local_state"][k] + r1["local_state"][k], want[k]) <= TOL, k
    for got, ref in zip(r0["records"], records):
        assert got["accuracy"] == ref["accuracy"]
    # pipeline: the same kernels on the same rows in the same order as the sequential fused run
    trainer, records = reference(2, 16, seed_rank0=200, device=ranks.device, fused=True)
    want = full_state(trainer)
    for res in ranks:
        worst = assert_close_states(res["pipe_fused"]["synced"], want, 0.0 if ranks.device == "cpu" else TOL)
        print(f"fused pipeline: worst relative error vs sequential {worst:.1e}")
    for got, ref in zip(ranks[0]["pipe_fused"]["records"], records):
        assert got["accuracy"] == ref["accuracy"]
        assert abs(got["loss"] - ref["loss"]) <= 1e-6 * ref["loss"]


@pytest.mark.slow
def test_solve_head_from_input_samples(ranks):
    # data parallel: each rank's sample, features recomputed with the current weights, the Gram
    # statistics summed: the single-process solve on the union of both samples, with the same
    # weights (training itself is checked above; a ridge solve magnifies its 1e-7 rounding)
    r0, r1 = ranks[0]["dp_sampled"], ranks[1]["dp_sampled"]
    trainer = td.DADTrainer(Net(), ranks.device)
    trainer.model.load_state_dict(r0["model"])
    x, y, _, _ = make_data()
    assert r0["gram_count"] is r1["gram_count"] is None  # no Gram statistics kept, nor streamed per step
    assert r0["sample"][0].shape[0] > 0 and not torch.equal(r0["sample"][0], r1["sample"][0])
    union = [tuple(t.to(ranks.device) for t in r["sample"]) for r in (r0, r1)]
    # CPU: to 1e-5. CUDA: index_add_ sums the per-class features with atomics in any order, and
    # the solve magnifies that ~1e-7 by up to the conditioning (NCCL, 2 x H200, 2026-11-30: 3.4e-5)
    tol = 1e-5 if ranks.device == "cpu" else 10 * TOL * ridge_condition(trainer, union)
    want = trainer.solve_head(lambda_reg=0.1, loader=union)
    assert want.num_samples == r0["solution"].num_samples == r0["sample"][0].shape[0] + r1["sample"][0].shape[0]
    for r in (r0, r1):
        assert relative_error(r["solution"].weight, want.weight.cpu()) <= tol, tol
        assert r["sample_after"] == 0
    # pipeline: stage 0's sample streamed through the stages = DADTrainer.solve_head()'s own sample
    torch.manual_seed(200)
    trainer = td.DADTrainer(Net(), ranks.device, lr=3e-2, weight_decay=0.01, classifier_sample_size=50)
    trainer.fit((x, y), epochs=2, batch_size=16, progress=False)
    p0, p1 = ranks[0]["pipe_sampled"], ranks[1]["pipe_sampled"]
    want = trainer.solve_head(lambda_reg=0.1)
    assert p0["has_sample"] and not p1["has_sample"] and p1["gram_count"] is None
    assert p0["solution"] is None and p1["solution"].num_samples == want.num_samples == 50
    # CUDA: the stages' weights agree to TOL, the solve magnifies that by up to the conditioning
    # (NCCL, 2 x H200, 2026-11-30: 1.1e-5)
    tol = 1e-5 if ranks.device == "cpu" else 10 * TOL * ridge_condition(trainer, [(x, y)])
    assert relative_error(p1["solution"].weight, want.weight.cpu()) <= tol, tol
    for p in (p0, p1):
        assert p["again"].startswith("ValueError") and "sampled no rows" in p["again"]


@pytest.mark.slow
def test_pipeline_bad_configuration(ranks):
    for res in ranks:
        out = res["errors"]
        assert out["too_many_stages"].startswith("ValueError")
        assert "2 pipeline stages but the model has only 1 DADLinear" in out["too_many_stages"]
        assert "balance=[2, 2]" in out["bad_balance"]
        assert "ranks disagree" in out["mismatched_balance"] and "balance" in out["mismatched_balance"]


@pytest.mark.slow
def test_mismatched_ranks_raise_on_every_rank(ranks):
    for res in ranks:
        out = res["errors"]
        assert out["mismatched_model"].startswith("ValueError: ranks disagree")
        assert "layers.0.weight" in out["mismatched_model"] and "rank 1" in out["mismatched_model"]
        assert "config" in out["mismatched_lr"]


# ---------------------------------------------------------------------------- single-process checks
def test_needs_an_initialised_process_group():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="init_process_group"):
        DataParallelTrainer(Net(), "cpu")
    with pytest.raises(ValueError, match="init_process_group"):
        Pipeline(td.DADTrainer(Net(), "cpu"))


def test_partition_layers_is_optimal_and_contiguous():
    gen = torch.Generator().manual_seed(0)
    for n in range(1, 7):
        for stages in range(1, n + 1):
            costs = (torch.rand(n, generator=gen) * 10 + 0.1).tolist()
            bounds = partition_layers(costs, stages)
            assert bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(a < b for a, b in bounds) and all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:]))
            got = max(sum(costs[a:b]) for a, b in bounds)
            best = min(
                max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, n)))
                for cuts in itertools.combinations(range(1, n), stages - 1)
            )
            assert got == pytest.approx(best)
    with pytest.raises(ValueError, match="3 pipeline stages but the model has only 2"):
        partition_layers([1.0, 2.0], 3)
    with pytest.raises(ValueError, match="num_stages"):
        partition_layers([1.0], 0)


# ---------------------------------------------------------------------------- DADAutogradLinear under DDP
@pytest.mark.slow
def test_autograd_update_grad_under_ddp_equals_single_process(ranks):
    # DDP would raise "Expected to have finished reduction in the prior iteration" at step 2
    # if any parameter (local heads included) missed its gradient; 3 steps ran on both ranks
    torch.manual_seed(300)
    model = autograd_net().to(ranks.device)
    init = {k: v.cpu().clone() for k, v in model.state_dict().items()}
    x, y = (t.to(ranks.device) for t in make_data()[:2])
    want = autograd_steps(model, x, y)
    # every layer and local head trained (not a vacuous comparison of untouched weights)
    assert all(not torch.equal(init[k], want[k]) for k in want)
    for res in ranks:
        got = res["ddp_autograd"]["state"]
        assert got.keys() == want.keys()
        for k in want:
            assert relative_error(got[k], want[k]) <= TOL, k
