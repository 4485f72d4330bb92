"""The fused / graphed ``DADTrainer.step`` against the eager reference step (GPU, or interpreter)."""

from __future__ import annotations

import pytest
import torch

import torch_dad as td
from tests.conftest import relative_error
from tests.gpu.conftest import DEVICE, requires_cuda, requires_kernels

pytestmark = requires_kernels


class Net(td.DADModel):
    def __init__(self, widths, activation="relu", classifier=True):  # type: ignore[no-untyped-def]
        super().__init__()
        self.layers = torch.nn.ModuleList(
            td.DADLinear(a, b, num_classes=7, activation=activation) for a, b in zip(widths[:-1], widths[1:])
        )
        if classifier:
            self.classifier = torch.nn.Linear(widths[-1], 7)


def _pair(backend, amp, activation="relu", classifier=True, options=None):  # type: ignore[no-untyped-def]
    torch.manual_seed(3)
    ref = Net([45, 33, 19, 21], activation, classifier)
    new = Net([45, 33, 19, 21], activation, classifier)
    new.load_state_dict(ref.state_dict())
    # on_nonfinite="ignore": under the CPU interpreter the default guard ("raise") would route the
    # step through the eager layer loop
    fused = td.DADTrainer(
        new, device=DEVICE, amp_dtype=amp, backend=backend, on_nonfinite="ignore", engine_options=options
    )
    assert fused.uses_engine
    return td.DADTrainer(ref, device=DEVICE, amp_dtype=amp, backend="eager"), fused


BACKENDS = ["fused"] + (["cuda-graph"] if DEVICE == "cuda" else [])
AMPS = [None] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("amp", AMPS)
@pytest.mark.parametrize("activation,classifier,chunked", [
    ("relu", True, False), ("tanh", False, False), ("identity", True, False),
    ("relu", True, True),  # every layer's weight gradient and AdamW in row blocks
    ("relu", True, 2),  # ... in 2 blocks (the default above 2048 rows)
    ("tanh", True, True),
])
def test_fused_step_matches_eager(backend, amp, activation, classifier, chunked):  # type: ignore[no-untyped-def]
    from torch_dad.training import EngineOptions

    options = None
    if chunked:
        options = EngineOptions(update_chunk_numel=1, update_chunks=None if chunked is True else chunked)
    eager, fused = _pair(backend, amp, activation, classifier, options)
    tol = 1e-4 if amp is None else 3e-2
    for i in range(5):
        batch = 61 if i < 4 else 17  # a ragged last batch runs uncaptured
        x = torch.randn(batch, 45, device=DEVICE)
        y = torch.randint(0, 7, (batch,), device=DEVICE)
        lr = 1e-3 if i < 3 else 5e-4  # a new lr must not need a re-capture
        l1, s1 = eager.step(x, y, lr=lr)
        l2, s2 = fused.step(x, y, lr=lr)
        assert l2.dtype == torch.float32 and l2.shape == l1.shape
        assert relative_error(l2, l1) <= tol, i
        assert abs(float(s2) - float(s1)) <= tol * max(1.0, abs(float(s1)))
    assert fused.step_count == eager.step_count == 5
    assert abs(fused.running_loss - eager.running_loss) <= tol * 2
    a, b = eager.state_dict(), fused.state_dict()
    for key, want in a["model"].items():
        if want.is_floating_point() and float(want.norm()) > 0:
            assert relative_error(b["model"][key], want) <= 5 * tol, key
    assert (a["classifier_statistics"] is None) == (b["classifier_statistics"] is None)
    if classifier and a["classifier_statistics"] is not None:
        for key, want in a["classifier_statistics"].items():
            if float(want.norm()) > 0:
                assert relative_error(b["classifier_statistics"][key], want) <= 5 * tol, key
    if backend == "cuda-graph":
        assert fused.engine.num_graphs == 1  # one shape captured; lr change reused it


@pytest.mark.parametrize("amp", AMPS)
@pytest.mark.parametrize("widths", [[45, 33, 33, 21], [33, 33, 33]])
def test_streamed_op_by_op_step_matches_the_whole_batch_eager_step(monkeypatch, amp, widths):  # type: ignore[no-untyped-def]
    # op by op, every layer runs in row blocks of 8 rows (a later one written over its input, whose width it
    # keeps); the eager reference runs each layer on the whole batch
    from torch_dad.nn import linear as linear_module

    streamed, reused = [], []
    original = td.DADLinear._streamed_gradients

    def counted(layer, rows, *args):  # type: ignore[no-untyped-def]
        result = original(layer, rows, *args)
        streamed.append(layer)
        reused.append(result[0].output.data_ptr() == rows.data_ptr())
        return result

    monkeypatch.setattr(td.DADLinear, "_streamed_gradients", counted)

    torch.manual_seed(5)
    ref, new = Net(widths), Net(widths)
    new.load_state_dict(ref.state_dict())
    eager = td.DADTrainer(ref, device=DEVICE, amp_dtype=amp, backend="torch")
    fused = td.DADTrainer(new, device=DEVICE, amp_dtype=amp, backend="triton", on_nonfinite="ignore")
    whole = linear_module.STREAM_MIN_BYTES, linear_module.STREAM_BLOCK_BYTES
    tol = 1e-4 if amp is None else 3e-2
    try:
        for i in range(4):
            x = torch.randn(61, widths[0], device=DEVICE)
            y = torch.randint(0, 7, (61,), device=DEVICE)
            linear_module.STREAM_MIN_BYTES, linear_module.STREAM_BLOCK_BYTES = whole
            l1, s1 = eager.step(x, y)
            linear_module.STREAM_MIN_BYTES, linear_module.STREAM_BLOCK_BYTES = 0, 8 * 33 * 4
            l2, s2 = fused.step(x.clone(), y)
            assert relative_error(l2, l1) <= tol, i
            assert abs(float(s2) - float(s1)) <= tol * max(1.0, abs(float(s1)))
    finally:
        linear_module.STREAM_MIN_BYTES, linear_module.STREAM_BLOCK_BYTES = whole
    layers = len(widths) - 1
    assert len(streamed) == 4 * layers  # the fused step's layers only: the eager steps ran whole
    # the first layer's input is the batch; a later one of the same width is written over
    assert reused == [False, *(a == b for a, b in zip(widths[1:], widths[2:]))] * 4
    a, b = eager.state_dict()["model"], fused.state_dict()["model"]
    for key, want in a.items():
        if want.is_floating_point() and float(want.norm()) > 0:
            assert relative_error(b[key], want) <= 5 * tol, key


@requires_cuda
@pytest.mark.parametrize("overlap, error_off_main, priorities", [
    (True, False, False), (False, False, False), (True, True, False), (True, False, True), (True, True, True),
])
def test_graphed_step_with_and_without_update_overlap_equals_fused(overlap, error_off_main, priorities):  # type: ignore[no-untyped-def]
    """The captured step with its updates on side streams, or all on one stream
    (``EngineOptions.overlap``), or with the local errors on a stream of their own too
    (``EngineOptions.local_error_off_main``), or with every AdamW on a low-priority stream
    (``EngineOptions.stream_priorities``), computes what the uncaptured fused step computes."""
    from torch_dad.training import EngineOptions

    options = EngineOptions(overlap=overlap, local_error_off_main=error_off_main, stream_priorities=priorities)
    _, plain = _pair("fused", torch.bfloat16)
    _, graphed = _pair("cuda-graph", torch.bfloat16, options=options)
    for i in range(4):
        x = torch.randn(61, 45, device=DEVICE)
        y = torch.randint(0, 7, (61,), device=DEVICE)
        l1, s1 = plain.step(x, y)
        l2, s2 = graphed.step(x, y)
        assert relative_error(l2, l1) <= 1e-2, i
    assert graphed.engine.num_graphs == 1
    a, b = plain.model.state_dict(), graphed.model.state_dict()
    for key, want in a.items():
        if want.is_floating_point() and float(want.norm()) > 0:
            assert relative_error(b[key], want) <= 1e-2, key


@requires_cuda
def test_graph_follows_outside_weight_edits_and_reload():  # type: ignore[no-untyped-def]
    eager, fused = _pair("cuda-graph", torch.bfloat16)
    x = torch.randn(64, 45, device=DEVICE)
    y = torch.randint(0, 7, (64,), device=DEVICE)
    for _ in range(3):
        eager.step(x, y)
        fused.step(x, y)
    state = eager.state_dict()
    fused.load_state_dict(state)  # in-place copies: the graph stays valid, bf16 copies refresh
    l1, _ = eager.step(x, y)
    l2, _ = fused.step(x, y)
    assert relative_error(l2, l1) <= 3e-2


@requires_cuda
def test_bad_input_leaves_graphed_trainer_unchanged():  # type: ignore[no-untyped-def]
    _, fused = _pair("cuda-graph", torch.bfloat16)
    x = torch.randn(64, 45, device=DEVICE)
    y = torch.randint(0, 7, (64,), device=DEVICE)
    fused.step(x, y)
    fused.step(x, y)
    before = {k: v.clone() for k, v in fused.model.state_dict().items()}
    with pytest.raises(ValueError, match="labels"):
        fused.step(x, y[:-1])
    with pytest.raises(ValueError, match="expected"):
        fused.step(x[:, :-1], y)
    for k, v in fused.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert fused.step_count == 2


@requires_cuda
@pytest.mark.parametrize("backend", ["fused", "cuda-graph"])
def test_classifier_sample_is_filled_inside_the_fused_step(backend):  # type: ignore[no-untyped-def]
    """The engine adds the rows to the head sample on the device (inside the graph): after 2,048
    rows the 64-row sample holds 64 distinct rows of the stream, spread over all of it, and
    solve_head() fits the classifier on them."""
    torch.manual_seed(0)
    trainer = td.DADTrainer(Net([45, 33, 21]), device=DEVICE, backend=backend, classifier_sample_size=64)
    stream = torch.randn(2048, 45, device=DEVICE)
    stream[:, 0] = torch.arange(2048, device=DEVICE, dtype=torch.float32)  # the row index, exact in fp32
    labels = torch.randint(0, 7, (2048,), device=DEVICE)
    for start in range(0, 2048, 128):
        trainer.step(stream[start : start + 128], labels[start : start + 128])
    sample = trainer.classifier_sample
    assert sample.size == 64 and int(sample.seen) == 2048
    index = sample.inputs[:64, 0].long()
    assert len(set(index.tolist())) == 64
    assert torch.equal(sample.inputs[:64], stream[index]) and torch.equal(sample.labels[:64], labels[index])
    assert int(index.min()) < 512 and int(index.max()) > 1536  # not just the last rows
    if backend == "cuda-graph":
        assert trainer.engine.num_graphs == 1
    trainer.solve_head()
    assert sample.size == 0 and int(sample.seen) == 0


@requires_cuda
def test_classifier_sample_resumes_its_device_stream_from_a_checkpoint():  # type: ignore[no-untyped-def]
    """The graphed step's sample draws from Philox keyed by (seed, row index), so a trainer restored from a
    checkpoint keeps exactly the rows the uninterrupted one keeps, and no torch generator is consumed."""
    torch.manual_seed(0)
    stream = torch.randn(4096, 45, device=DEVICE)
    labels = torch.randint(0, 7, (4096,), device=DEVICE)
    first = td.DADTrainer(Net([45, 33, 21]), device=DEVICE, classifier_sample_size=64)
    for start in range(0, 2048, 128):
        first.step(stream[start : start + 128], labels[start : start + 128])
    second = td.DADTrainer(Net([45, 33, 21]), device=DEVICE, classifier_sample_size=64)
    second.load_state_dict(first.state_dict())
    rng = torch.cuda.get_rng_state()
    for start in range(2048, 4096, 128):
        first.step(stream[start : start + 128], labels[start : start + 128])
        second.step(stream[start : start + 128], labels[start : start + 128])
    assert torch.equal(torch.cuda.get_rng_state(), rng)
    a, b = first.classifier_sample, second.classifier_sample
    assert int(a.seen) == int(b.seen) == 4096
    assert torch.equal(a.inputs[:64], b.inputs[:64]) and torch.equal(a.labels[:64], b.labels[:64])

