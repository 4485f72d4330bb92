"""``DADLMHead(cuda_graphs=True)``: the recomputing sweep replayed from CUDA graphs, against float64 and eager."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as TF

from torch_dad import functional
from torch_dad.nn.lm_head import DADLMHead
from torch_dad.optim import OptimizerConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def case(n, d, v, seed, ignored=0.2):
    """Hidden states and targets, about ``ignored`` of the positions ignored, a different set (and count) for each
    seed: the graphs are kept per batch shape and replay with each batch's own count of scored tokens."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = torch.randint(0, v, (n,), generator=g)
    y[torch.rand(n, generator=g) < ignored] = -100
    return h, y


def head_pair(d, v, **kwargs):
    """An eager and a graphed head with the same weights."""
    eager = DADLMHead(d, v, device="cuda", sweep="recompute", **kwargs)
    graphed = DADLMHead(d, v, device="cuda", sweep="recompute", cuda_graphs=True, **kwargs)
    graphed.load_state_dict(eager.state_dict())
    return eager, graphed


def step(head, h, y, **kwargs):
    x = h.clone().requires_grad_(head.backprop_gradients)
    out = head.fused_loss(x, y, shift=False, **kwargs)
    out.loss.backward()
    return out.loss.detach(), x.grad


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(509, 96, 5003), (4097, 576, 49152)])
def test_every_graphed_step_applies_the_float64_gradient(dtype, tol, shape):
    # plain SGD with a large lr: the update is -lr * dL/dW, compared with float64 at each step, the
    # eager first, the captured second and the replayed third and fourth
    n, d, v = shape
    head = DADLMHead(d, v, device="cuda", sweep="recompute", cuda_graphs=True, compute_dtype=dtype,
                     backprop_gradients=True, weight_chunk_size=1000)
    head.config = OptimizerConfig(name="sgd", lr=100.0, momentum=0.0, weight_decay=0.0)
    w = head.weight.detach().double().clone()
    for seed in range(4):
        h, y = case(n, d, v, seed)
        with torch.no_grad():
            head.weight.copy_(w)  # in place: the graphs keep their addresses
        ref = functional.head_loss_and_gradients(h.cuda(), w.cuda(), None, y.cuda())
        hh = h.cuda().requires_grad_(True)
        (ref_dh,) = torch.autograd.grad(TF.cross_entropy(TF.linear(hh, w.cuda()), y.cuda()), hh)
        loss, dh = step(head, h.float().cuda(), y.cuda())
        assert head.last_sweep == "recompute"
        assert rel(head.weight.detach().double() - w.cuda(), -100.0 * ref.grad_weight) <= tol
        assert rel(dh, ref_dh) <= tol
        assert abs(float(loss) - float(ref.loss)) <= tol * abs(float(ref.loss))
        assert head.num_cuda_graphs == (0, 2, 2, 2)[seed]  # both captured at step 2, replayed from then on


@pytest.mark.parametrize("backprop_gradients", [False, True])
def test_graphed_adamw_steps_equal_eager_ones(backprop_gradients):
    eager, graphed = head_pair(96, 5003, lr=1e-2, weight_decay=0.1, compute_dtype=torch.bfloat16,
                               backprop_gradients=backprop_gradients, weight_chunk_size=777)
    for seed in range(6):
        # every position scored: a graphed head multiplies the ignored rows too (at zero weight), an eager one
        # leaves them out, so only then are the two the same sums (ignored rows: against float64 above)
        h, y = case(600, 96, 5003, seed, ignored=0.0)
        if seed == 4:  # a new lr reaches the replayed graph
            eager.config.lr = graphed.config.lr = 3e-3
        le, dhe = step(eager, h.float().cuda(), y.cuda())
        lg, dhg = step(graphed, h.float().cuda(), y.cuda())
        assert rel(lg, le) <= 1e-6
        if backprop_gradients:
            assert dhg.dtype == dhe.dtype and rel(dhg, dhe) <= 1e-3  # bf16 dL/dh
        else:
            assert dhg is None and dhe is None
        for name, tensor in eager.state_dict().items():
            assert rel(graphed.state_dict()[name], tensor) <= 1e-6, name
    assert graphed.num_cuda_graphs == 2 and eager.num_cuda_graphs == 0


def test_two_forwards_before_one_backward_fall_back_to_eager():
    # the second forward finds the graphs' buffers taken by the first and runs eagerly
    eager, graphed = head_pair(64, 3001, lr=1e-2, compute_dtype=torch.bfloat16, backprop_gradients=True)
    # every position scored, so that the eager and the graphed head sum the same rows (see the AdamW test above)
    batches = [case(300, 64, 3001, seed, ignored=0.0) for seed in range(4)]
    for head in (eager, graphed):
        for h, y in batches[:2]:  # warm-up and capture
            step(head, h.float().cuda(), y.cuda())
        xs = [h.float().cuda().requires_grad_(True) for h, _ in batches[2:]]
        losses = [head.fused_loss(x, y.cuda(), shift=False).loss for x, (_, y) in zip(xs, batches[2:])]
        (losses[0] + losses[1]).backward()
        head.grads = [x.grad for x in xs]
    for a, b in zip(graphed.grads, eager.grads):
        assert rel(a, b) <= 1e-3
    assert rel(graphed.weight, eager.weight) <= 1e-6 and float(graphed.optim_state.step) == 4.0


def test_each_batch_shape_gets_its_graphs_and_copies_start_without():
    head = DADLMHead(64, 3001, device="cuda", sweep="recompute", cuda_graphs=True, compute_dtype=torch.bfloat16)
    for n in (100, 100, 100, 37, 37, 100):
        h, y = case(n, 64, 3001, n)
        step(head, h.float().cuda(), y.cuda())
    assert head.num_cuda_graphs == 4
    clone = copy.deepcopy(head)
    assert clone.num_cuda_graphs == 0 and torch.equal(clone.weight, head.weight)
    h, y = case(100, 64, 3001, 1)
    step(clone, h.float().cuda(), y.cuda())  # the copy's own weight: its first step runs eagerly
    assert clone.num_cuda_graphs == 0 and not torch.equal(clone.weight, head.weight)


def test_bad_labels_of_a_replayed_step_raise_and_change_nothing():
    head = DADLMHead(64, 3001, device="cuda", sweep="recompute", cuda_graphs=True, compute_dtype=torch.bfloat16,
                     backprop_gradients=True)
    for seed in range(3):  # eager, captured, replayed
        h, y = case(300, 64, 3001, seed)
        step(head, h.float().cuda(), y.cuda())
    before = copy.deepcopy(head.state_dict())
    h, y = case(300, 64, 3001, 3)
    y[7] = 3001  # one id past the vocabulary, found after the forward was queued
    with pytest.raises(ValueError, match="labels must lie in"):
        step(head, h.float().cuda(), y.cuda())
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    # the graphs are free again: the next step replays them and trains
    y[7] = 5
    step(head, h.float().cuda(), y.cuda())
    assert head.num_cuda_graphs == 2 and not torch.equal(head.weight, before["weight"])


def test_an_all_ignored_batch_leaves_a_graphed_head_unchanged():
    head = DADLMHead(64, 3001, device="cuda", sweep="recompute", cuda_graphs=True, compute_dtype=torch.bfloat16,
                     backprop_gradients=True)
    for seed in range(3):
        h, y = case(300, 64, 3001, seed)
        step(head, h.float().cuda(), y.cuda())
    before = copy.deepcopy(head.state_dict())
    h, _ = case(300, 64, 3001, 3)
    loss, dh = step(head, h.float().cuda(), torch.full((300,), -100, device="cuda"))
    assert float(loss) == 0.0 and (dh is None or not dh.any())
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, before[name]), name


@pytest.mark.parametrize("label_dtype", [torch.int64, torch.int32])
def test_labels_are_shifted_checked_and_counted_inside_the_forward_graph(label_dtype):
    # a replayed forward takes the labels unshifted: their shift, mask and count come from the graph, per batch
    eager, graphed = head_pair(64, 3001, lr=1e-2, compute_dtype=torch.bfloat16)
    masks = []
    for seed in range(5):  # eager, captured, then replayed with a different count of scored tokens each step
        h, y = case(4 * 75, 64, 3001, seed, ignored=0.1 * seed)
        h, y = h.float().cuda().reshape(4, 75, 64), y.to(label_dtype).cuda().reshape(4, 75)
        outs = [head.fused_loss(h, y) for head in (eager, graphed)]
        for out in outs:
            out.loss.backward()
        want = torch.cat([y[:, 1:], torch.full_like(y[:, :1], -100)], dim=1) != -100
        assert torch.equal(outs[1].label_mask, want) and torch.equal(outs[0].label_mask, want)
        assert rel(outs[1].loss, outs[0].loss) <= 1e-5
        masks.append((outs[1].label_mask, outs[0].label_mask.clone()))
    assert graphed.num_cuda_graphs == 2
    for kept, expected in masks:  # what a step returned is not overwritten by later replays
        assert torch.equal(kept, expected)
    # the shift leaves positions ignored: the eager head leaves them out of its GEMMs and the graphed one multiplies
    # them at zero weight, so their float32 sums run in different orders. One step's dL/dW then differs by 1.5e-7
    # (relative, on the H200) and the weights after these five AdamW steps by 2.2e-6
    assert rel(graphed.weight, eager.weight) <= 1e-5


def test_a_replayed_step_keeps_nothing_of_its_inputs_alive():
    # copying a batch into the graph's buffers must not tie the buffers into that batch's autograd graph: a step
    # dropped before its backward frees its hidden states (tanh's backward would hold them)
    import weakref

    head = DADLMHead(64, 3001, device="cuda", sweep="recompute", cuda_graphs=True, compute_dtype=torch.bfloat16,
                     backprop_gradients=True)
    for seed in range(2):  # eager, captured
        h, y = case(300, 64, 3001, seed)
        step(head, h.float().cuda(), y.cuda())
    h, y = case(300, 64, 3001, 2)
    hidden = torch.tanh(h.float().cuda().requires_grad_(True))
    ref = weakref.ref(hidden)
    out = head.fused_loss(hidden, y.cuda(), shift=False)
    assert out.loss.requires_grad and head.num_cuda_graphs == 2
    del hidden, out
    assert ref() is None
    step(head, h.float().cuda(), y.cuda())  # the graphs are free again and replay
    assert head.num_cuda_graphs == 2


def test_an_option_changed_between_steps_is_not_replayed_from_the_old_graphs():
    # the weight decay is part of the backward graph: changing it makes a new signature (eager, captured, replayed),
    # never a replay of the old graphs
    eager, graphed = head_pair(64, 3001, lr=1e-2, compute_dtype=torch.bfloat16, backprop_gradients=True)
    for seed in range(6):
        if seed == 3:
            for head in (eager, graphed):
                head.config.weight_decay = 0.5
        h, y = case(300, 64, 3001, seed, ignored=0.0)  # the same rows in both heads' sums
        for head in (eager, graphed):
            step(head, h.float().cuda(), y.cuda())
    assert graphed.num_cuda_graphs == 4 and rel(graphed.weight, eager.weight) <= 1e-6


def test_the_capture_thread_orders_its_work_with_the_callers_stream():
    """Eager steps and captures of graphed heads run on one worker thread: its kernels come after the caller's and
    before whatever the caller queues next, with the caller's grad mode; its exceptions reach the caller."""
    import threading

    from torch_dad.ops.cuda_graphs import on_capture_thread

    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(50_000_000)  # keeps the caller's stream busy: unordered work would read zeros
    x.fill_(3.0)

    def job():
        return threading.current_thread().name, torch.is_grad_enabled(), x * 2

    with torch.no_grad():
        name, grad_enabled, doubled = on_capture_thread(x.device, job)
    assert name.startswith("torch_dad-capture") and not grad_enabled
    doubled.add_(1.0)  # queued on the caller's stream, after the job's kernels
    assert torch.equal(doubled, torch.full_like(x, 7.0))
    # a job may itself ask for the thread (it runs in place), and its error is raised in the caller
    assert on_capture_thread(x.device, lambda: on_capture_thread(x.device, lambda: 5)) == 5
    with pytest.raises(ZeroDivisionError):
        on_capture_thread(x.device, lambda: 1 / 0)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_default_head_graphs_a_repeated_shape_and_applies_the_float64_gradient(dtype, tol):
    # sweep="auto", cuda_graphs=None: 509 x 96 x 5003 is under AUTO_GRAPHS_MAX_PRODUCT and too many tokens for the
    # vocabulary sweep, so a shape's first step runs the token sweep, the repeat the eager recomputing sweep, the
    # third captures it and the rest replay
    n, d, v = 509, 96, 5003
    head = DADLMHead(d, v, device="cuda", compute_dtype=dtype, backprop_gradients=True)
    head.config = OptimizerConfig(name="sgd", lr=100.0, momentum=0.0, weight_decay=0.0)
    w = head.weight.detach().double().clone()
    for seed in range(5):
        h, y = case(n, d, v, seed)
        with torch.no_grad():
            head.weight.copy_(w)
        ref = functional.head_loss_and_gradients(h.cuda(), w.cuda(), None, y.cuda())
        hh = h.cuda().requires_grad_(True)
        (ref_dh,) = torch.autograd.grad(TF.cross_entropy(TF.linear(hh, w.cuda()), y.cuda()), hh)
        loss, dh = step(head, h.float().cuda(), y.cuda())
        assert head.last_sweep == ("tokens", "recompute", "recompute", "recompute", "recompute")[seed]
        assert head.num_cuda_graphs == (0, 0, 2, 2, 2)[seed]
        assert rel(head.weight.detach().double() - w.cuda(), -100.0 * ref.grad_weight) <= tol
        assert rel(dh, ref_dh) <= tol
        assert abs(float(loss) - float(ref.loss)) <= tol * abs(float(ref.loss))


def test_default_head_captures_nothing_for_changing_shapes_or_without_graphs():
    # shapes that alternate never repeat the previous step's: the token sweep every step, no graphs; the same
    # with cuda_graphs=False on a repeated shape, and with an explicit sweep="recompute" (eager, as asked)
    heads = {"auto": DADLMHead(96, 5003, device="cuda", compute_dtype=torch.bfloat16),
             "off": DADLMHead(96, 5003, device="cuda", compute_dtype=torch.bfloat16, cuda_graphs=False),
             "recompute": DADLMHead(96, 5003, device="cuda", compute_dtype=torch.bfloat16, sweep="recompute")}
    for seed in range(5):
        h, y = case((509, 515)[seed % 2], 96, 5003, seed)
        step(heads["auto"], h.float().cuda(), y.cuda())
        assert heads["auto"].last_sweep == "tokens"
        h, y = case(509, 96, 5003, seed)
        step(heads["off"], h.float().cuda(), y.cuda())
        step(heads["recompute"], h.float().cuda(), y.cuda())
        assert heads["off"].last_sweep == "tokens" and heads["recompute"].last_sweep == "recompute"
    assert all(head.num_cuda_graphs == 0 for head in heads.values())


def test_default_head_at_a_vocab_sweep_shape_captures_nothing():
    # few tokens against a wide hidden size: the vocabulary sweep, eager, however often the shape repeats
    head = DADLMHead(512, 3001, device="cuda", compute_dtype=torch.bfloat16)
    for seed in range(4):
        h, y = case(300, 512, 3001, seed)
        step(head, h.float().cuda(), y.cuda())
        assert head.last_sweep == "vocab"
    assert head.num_cuda_graphs == 0
