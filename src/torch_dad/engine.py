"""The fused (and CUDA-graph-captured) ``DADTrainer.step``: same math, far fewer launches.

Selected by ``DADTrainer(..., backend=...)``:

- ``"eager"``: the reference path in :mod:`torch_dad.layers` (pure PyTorch, any setting);
- ``"fused"``: this module's step, run op by op. On CUDA its local error, AdamW and Gram
  updates are Triton kernels (:mod:`torch_dad.kernels`); on CPU their PyTorch twins run;
- ``"cuda-graph"``: the fused step captured whole into one CUDA graph per input shape;
- ``"auto"``: ``"cuda-graph"`` on CUDA when the fused step supports the model and triton is
  installed, else ``"eager"``.

Per DAD layer the fused step launches: the forward ``addmm`` with bias and ReLU fused by
cuBLASLt, two local-error kernels, the ``d_z^T a`` GEMM (output in the compute dtype, as the
eager step rounds it), and one AdamW kernel that updates weight and bias and rewrites their
bf16 copies (the copies the next forward reads, so no per-step casts), and one more for its local head.
The measured reason: on an H200 at B=1024 an MLP step is bound by launches, not FLOPs
(see ``docs/benchmarks-gpu.md``). Under ``"cuda-graph"`` the weight GEMM and AdamW of layer
``i`` run on a side stream, overlapping the forward of layer ``i + 1``: DAD allows it because
layer ``i + 1`` never waits for a gradient from above. For models no wider than 1024, layer ``i``'s local
error runs beside that forward too, on a stream of its own (``FusedStep.local_error_off_main``). Layers with at least
``FusedStep.update_chunk_numel`` weights compute that GEMM and AdamW in row blocks (4 up to 2048 rows, else 2),
each block's AdamW beside the next block's GEMM (fmnist-wide-2's 4096 x 4096 layer at B=1024: 367 -> 353 us a step).
Models without such layers are captured with stream priorities (``FusedStep.stream_priorities``): forwards and
local errors first, weight-gradient GEMMs next, every AdamW last (deep-8x1024 at B=1024: 322 -> 280 us a step).

Semantics match the eager step: outputs and losses come from the pre-update weights, every
layer's optimizer state and step counter advance as in :mod:`torch_dad.optim`, the classifier
is trained as an output head and its Gram statistics accumulate. What differs is rounding
(fp32 accumulation of the local head products) and, where rows are split across programs,
the fp32 summation order of the atomically added gradients.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from .kernels import triton_available
from .kernels.adamw import adamw_with_shadow_
from .kernels.gram import gram_update_
from .kernels.gram import mm_fp32 as _mm_fp32
from .kernels.local_error import FUSED_ACTIVATIONS, local_error
from .kernels.weight_update import weight_grad_adamw_

if TYPE_CHECKING:
    from .layers import DADLinear
    from .trainer import DADTrainer

__all__ = ["BACKENDS", "FusedStep", "unsupported_reason"]

#: the widest DAD layer for which ``FusedStep.local_error_off_main=None`` takes the local errors
#: off the main stream (measured at widths 256-1024 and 4096; see that attribute)
LOCAL_ERROR_OFF_MAIN_MAX_WIDTH = 1024
#: the largest batch for which ``FusedStep.update_chunks=None`` updates a large layer in 4 row blocks (else 2)
UPDATE_CHUNKS_SMALL_BATCH = 2048

BACKENDS: tuple[str, ...] = ("auto", "eager", "fused", "cuda-graph")


def unsupported_reason(trainer: DADTrainer) -> str | None:
    """Why the fused step cannot run this trainer's model, or ``None`` if it can."""
    if trainer.config.name != "adamw":
        return f"optimizer={trainer.config.name!r} (the fused step implements adamw)"
    for layer in trainer.model.dad_layers:
        if layer.activation not in FUSED_ACTIVATIONS:
            return f"activation={layer.activation!r} (fused: {', '.join(FUSED_ACTIVATIONS)})"
        if layer.label_smoothing:
            return "label_smoothing > 0"
        if getattr(layer, "local_loss", "ce") != "ce":
            return f"local_loss={layer.local_loss!r} (the fused step implements 'ce')"
        if getattr(layer, "normalize", None) is not None:
            return f"normalize={layer.normalize!r} (the fused step has no normalisation)"
        if layer.weight.dtype != torch.float32:
            return f"master weights in {layer.weight.dtype} (fused: float32)"
    if trainer.gradient_reducer is not None:
        return "a gradient_reducer is set (distributed training uses the eager step)"
    if getattr(trainer, "dropout", 0.0):
        return "dropout > 0 (the fused step has no dropout)"
    return None


def _forward(a: Tensor, weight: Tensor, bias: Tensor | None, activation: str) -> Tensor:
    """``act(a @ weight.T + bias)``; ReLU rides in the cuBLASLt epilogue (one launch)."""
    if bias is not None and activation == "relu":
        return torch._addmm_activation(bias, a, weight.T)
    z = torch.addmm(bias, a, weight.T) if bias is not None else a @ weight.T
    if activation == "relu":
        return z.relu_()
    if activation == "tanh":
        return z.tanh_()
    return z


class FusedStep:
    """The fused step for one trainer; :meth:`__call__` runs it, eagerly or as a CUDA graph."""

    #: a layer whose weight has at least this many entries gets its weight gradient and AdamW
    #: in ``update_chunks`` row blocks, each block's AdamW (on its own stream under overlap)
    #: running beside the next block's GEMM instead of after the whole GEMM
    update_chunk_numel: int = 8 * 2**20
    #: ``None``: 4 blocks for batches up to ``UPDATE_CHUNKS_SMALL_BATCH`` rows, else 2. At B=1024 the AdamW of a
    #: block (memory-bound, 470 MB for the whole 4096 x 4096 layer) outlasts its GEMM, so more blocks start it
    #: sooner; at B=4096 the GEMM is 3.7x longer, and fewer, larger blocks run it faster. H200, device call 33,
    #: fmnist-wide-2, µs a step by blocks 2 / 4 / 8 / 16: B=1024 352.4 / **330.9** / 351.1 / 398.5, B=4096
    #: **701.8** / 720.4 / 750.5 / 849.9 (5 rounds each, every round agreeing); lowering ``update_chunk_numel``
    #: to 2 M or 0.5 M was slower on fmnist-wide-2, cifar10-medium-3 and deep-8x1024
    update_chunks: int | None = None
    #: on CUDA, the weight-gradient GEMM writes its output in the compute dtype (bf16/fp16,
    #: accumulated in fp32), rounded as the eager step rounds it; ``True`` keeps it in fp32.
    #: The AdamW kernel reads it and widens it, so a 2-byte gradient saves 4 of the ~34 bytes
    #: a weight's update moves (GEMM write + AdamW read). H200, device call 19, µs a step, fp32 ->
    #: bf16: fmnist-wide-2 B=1024 353.6 -> 337.1, mnist-medium-3 B=1024 129.4 -> 115.8,
    #: deep-8x1024 B=4096 555.3 -> 538.7
    fp32_weight_grads: bool = False
    #: compute each layer's weight gradient and AdamW in one kernel
    #: (:func:`torch_dad.kernels.weight_update.weight_grad_adamw_`), the gradient kept in fp32
    #: registers and never written (``fp32_weight_grads`` and the row blocks then do not apply).
    #: Off by default: only deep-8x1024 at B=1024 ran faster with it (1-3%). Alone it is slower than the cuBLAS GEMM +
    #: AdamW kernel pair it replaces at every layer shape of the four benchmark topologies (H200,
    #: device call 36, 4096 x 4096 at B=1024: 189-237 µs against 165). Its K-loop runs at
    #: 59-75 µs against cuBLAS's 51, and its tile-shaped AdamW epilogue alone takes 149-156 µs
    #: against 115 for the flat AdamW kernel. In the step (µs, unfused vs fused, 5 rounds):
    #: - everywhere (call 35): fmnist-wide-2 B=1024 335.0 vs 480.2, every B=4096 setting slower
    #:   (deep-8x1024 536.3 vs 626.1), deep-8x1024 B=1024 326.7 vs 317.3;
    #: - only in layers under ``update_chunk_numel`` at <= 2048 rows (call 37): fmnist-wide-2
    #:   B=1024 334.2 vs 374.8, cifar10-medium-3 B=1024 148.6 vs 164.3, deep-8x1024 323.2 vs 320.8
    fused_weight_update: bool = False
    #: capture the step with stream priorities: the forwards and local errors highest, the
    #: weight-gradient GEMMs next, every AdamW (memory-bound, thousands of short programs) and
    #: the head sample lowest, so that a pending forward or GEMM gets the next free SM instead
    #: of waiting for an AdamW to finish dispatching. Seen in the H200 timeline of fmnist-wide-2
    #: at B=1024 (device call 38): the layer-1 AdamW delayed the layer-2 local error by 12 µs.
    #: ``None``: on unless a layer has at least ``update_chunk_numel`` weights, whose row-block
    #: AdamW chain is then the step's critical path and must not wait. H200, device call 39, µs a
    #: step, default streams vs priorities (5 interleaved rounds; call 41 repeated all but fmnist):
    #: deep-8x1024 B=1024 323.5 vs 282.8 (322.1 vs 279.9), B=4096 532.3 vs 506.3 (544.5 vs
    #: 505.6); cifar10-medium-3 B=4096 225.1 vs 217.6 (224.5 vs 217.6), B=1024 140.0 vs 155.3
    #: with rounds spread over 125-192 (139.4 vs 131.6); mnist-medium-3 B=1024 150.0 vs 140.4
    #: (102.6 vs 87.4), B=4096 152.0 vs 149.4 (150.4 vs 148.3); but fmnist-wide-2 B=1024 333.4
    #: vs 342.6, B=4096 700.8 vs 711.2. Read once, when the engine creates its streams (the first
    #: captured step): set it on the class or right after building the trainer
    stream_priorities: bool | None = None
    #: the CUDA stream priority per role under ``stream_priorities`` (lower is more urgent; the H200
    #: offers 0 to -3)
    STREAM_PRIORITIES: dict[str, int] = {"critical": -2, "gemm": -1, "sample": 0, "background": 0}
    #: run each layer's weight gradient and AdamW on side streams inside the captured step,
    #: beside the next layer's forward (``False``: one stream, for comparison). Measured on the
    #: H200 (device call 23, µs a step, overlap vs one stream): deep-8x1024 B=4096 536 vs 576,
    #: fmnist-wide-2 B=1024 334 vs 386, cifar10-medium-3 B=4096 229 vs 246. Raising the main
    #: stream's priority over the side streams' (or the reverse) gained nothing consistent
    overlap_updates: bool = True
    #: under ``overlap_updates``, also take each layer's local error off the forward chain: it
    #: runs on an error stream beside the next layer's forward, and the weight gradient and
    #: AdamW follow it on the side stream, so the main stream only runs the forwards. ``None``:
    #: on when no DAD layer is wider than ``LOCAL_ERROR_OFF_MAIN_MAX_WIDTH``. H200, device call 28,
    #: µs a step, on the main stream vs off it (3 interleaved rounds, each round agreeing):
    #: cifar10-medium-3 B=1024 145.7 vs 137.4, B=4096 228.5 vs 223.7; mnist-medium-3 B=4096
    #: 153.1 vs 147.8; deep-8x1024 B=4096 530.2 vs 527.0, B=1024 315.8 vs 318.6; but
    #: fmnist-wide-2 (4096 wide) B=1024 330.9 vs 339.7: there the error kernels beside the
    #: 4096 x 4096 forward GEMM slow it more than they save
    local_error_off_main: bool | None = None
    #: update each local head (and the classifier) right after its local error with the AdamW
    #: kernel (1024 elements a program), instead of all of them in one ``torch._fused_adamw_``
    #: at the end of the step: that launch gives each small tensor one CTA, and took 36.8 µs
    #: alone for fmnist-wide-2's 10 x 4096 heads as the step's last kernel (H200, device call
    #: 44). Device call 45, µs a step, one launch vs per layer (5 interleaved rounds):
    #: deep-8x1024 B=1024 283.5 vs 271.7, mnist-medium-3 B=1024 90.7 vs 82.7, cifar10-medium-3
    #: B=4096 218.1 vs 210.8, fmnist-wide-2 B=1024 331.3 vs 333.1 and B=4096 700.1 vs 700.7.
    #: A gradient reducer (data parallelism) always takes the single launch, after one all-reduce
    head_updates_per_layer: bool = True

    def __init__(self, trainer: DADTrainer, graphed: bool) -> None:
        self.trainer = trainer
        self.graphed = graphed
        self.device = trainer.device
        self._shadows: dict[torch.dtype, list[tuple[Tensor, Tensor | None]]] = {}
        self._lr = torch.full((), trainer.config.lr, device=self.device, dtype=torch.float32)
        self._lr_value = trainer.config.lr
        self._graphs: dict[tuple[Any, ...], tuple[Any, Tensor, Tensor, Tensor, Tensor]] = {}
        self._seen: set[tuple[Any, ...]] = set()
        self._side: torch.cuda.Stream | None = None
        self._update_stream: torch.cuda.Stream | None = None
        self._error_stream: torch.cuda.Stream | None = None
        self._sample_stream: torch.cuda.Stream | None = None
        self._capture_stream: torch.cuda.Stream | None = None
        self._pool: Any = None
        self._tracked: list[Tensor] | None = None

    # ------------------------------------------------------------------ state
    def _layer_tensors(self, layer: DADLinear) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        params = layer._trained_tensors()
        return params, layer.optim_state.moments("exp_avg"), layer.optim_state.moments("exp_avg_sq")

    def _shadow_list(self, dtype: torch.dtype) -> list[tuple[Tensor, Tensor | None]]:
        """bf16/fp16 copies of every layer's (weight, bias), refreshed by the AdamW kernel."""
        layers = self.trainer.model.dad_layers
        cached = self._shadows.get(dtype)
        if cached is None or len(cached) != len(layers):
            cached = []
            for layer in layers:
                w = layer.weight.detach().to(dtype)
                b = layer.bias.detach().to(dtype) if layer.bias is not None else None
                cached.append((w, b))
            self._shadows[dtype] = cached
        return cached

    def refresh_shadows(self) -> None:
        """Re-copy the low-precision weights from the fp32 masters (after an outside edit)."""
        for dtype, pairs in self._shadows.items():
            for layer, (w, b) in zip(self.trainer.model.dad_layers, pairs):
                w.copy_(layer.weight.detach())
                if b is not None and layer.bias is not None:
                    b.copy_(layer.bias.detach())
            del dtype

    def _signature(self) -> tuple[int, ...]:
        """Storage addresses a captured graph baked in: a change forces a re-capture.

        The tensor list is gathered once (walking the modules costs ~30 us a step); a tensor
        whose ``.data`` is replaced is caught by its address, a replaced Parameter object is
        not: call :meth:`reset` after swapping modules or parameters.
        """
        if self._tracked is None:
            t = self.trainer
            tracked = list(t.model.parameters()) + list(t.model.buffers())
            if t.head_state is not None:
                tracked += list(t.head_state.buffers())
            if t.head_statistics is not None:
                tracked += list(t.head_statistics.buffers())
            tracked.append(t._loss_sum)
            self._tracked = tracked
        return tuple(p.data_ptr() for p in self._tracked)

    def reset(self) -> None:
        """Drop captured graphs and low-precision copies (rebuilt from the masters next step)."""
        self._graphs.clear()
        self._seen.clear()
        self._shadows.clear()
        self._tracked = None

    # ------------------------------------------------------------------ the step
    def _body(
        self,
        x: Tensor,
        y: Tensor,
        compute: torch.dtype | None,
        overlap: bool,
        *,
        span: tuple[int, int] | None = None,
        with_head: bool = True,
        reducer: Any = None,
        count_loss: bool = True,
        sample: bool = True,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The step on layers ``span`` (default: all), then the classifier if ``with_head``.

        Returns ``(logits, loss, features)``: the last trained part's logits and loss, and the
        span's output (the next stage's input in a pipeline). ``count_loss`` adds the loss to
        the trainer's running sum (callers that use ``DADTrainer._end_step`` pass ``False``);
        ``sample`` adds the rows to the head sample on CUDA (``False``: the caller did). With ``reducer`` (a
        :class:`torch_dad.parallel.GradientAllReduce`) every gradient is all-reduced before
        its update: a layer's weight gradient starts reducing as soon as it exists and its
        AdamW waits one layer, so the collective runs under the next layer's GEMMs.
        """
        t = self.trainer
        config = t.config
        lo, hi = span if span is not None else (0, len(t.model.dad_layers))
        layers = t.model.dad_layers[lo:hi]
        head = t.model.head if with_head else None
        low = compute is not None and compute != torch.float32
        shadows = self._shadow_list(compute)[lo:hi] if low and compute is not None else None
        steps = [_tensor(layer.optim_state.step) for layer in layers]
        if head is not None and t.head_state is not None:
            steps.append(_tensor(t.head_state.step))
        torch._foreach_add_(steps, 1.0)
        sample_stream = None
        if sample and t.head_sample is not None and x.is_cuda and lo == 0:
            if overlap:
                # on its own stream, beside the layers: on the critical path the ~14 small
                # kernels cost 40-90 us a step (mnist-medium-3 at B=1024: 186 us vs 99 us)
                if self._sample_stream is None:
                    self._sample_stream = self._stream("sample")
                sample_stream = self._sample_stream
                sample_stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(sample_stream):
                    t.head_sample.add_on_device(x, y)
            else:
                t.head_sample.add_on_device(x, y)
        lr = self._lr if x.is_cuda else self._lr_value
        small_p: list[Tensor] = []
        small_g: list[Tensor] = []
        small_m: list[Tensor] = []
        small_v: list[Tensor] = []
        small_s: list[Tensor] = []
        keep: list[Tensor] = []
        main = torch.cuda.current_stream() if overlap else None
        side = self._side
        error_stream = None
        if overlap and self._local_error_off_main(layers):
            if self._error_stream is None:
                self._error_stream = self._stream("critical")
            error_stream = self._error_stream
        a = x if compute is None or x.dtype == compute else x.to(compute)
        result = None
        pending: list[tuple[Any, list[Tensor], list[Tensor], list[Tensor], list[Tensor], list[Tensor | None], Tensor]] = []
        for i, layer in enumerate(layers):
            if shadows is not None:
                w, b = shadows[i]
            else:
                w, b = layer.weight.detach(), (layer.bias.detach() if layer.bias is not None else None)
            h = _forward(a, w, b, layer.activation)
            head_w, head_b = _tensor(layer.head_weight), _tensor(layer.head_bias)
            step_t = _tensor(layer.optim_state.step)
            if error_stream is not None and main is not None:
                error_stream.wait_stream(main)
                keep.append(h)
                with torch.cuda.stream(error_stream):
                    err = local_error(h, head_w, head_b, y, layer.activation)
            else:
                err = local_error(h, head_w, head_b, y, layer.activation)
            params, exp_avg, exp_avg_sq = self._layer_tensors(layer)
            nb = 2 if layer.bias is not None else 1
            assert err.d_z is not None and err.grad_bias is not None
            if overlap and side is not None and main is not None:
                side.wait_stream(main)
                if error_stream is not None:
                    side.wait_stream(error_stream)
                ctx: Any = torch.cuda.stream(side)
                keep += [a, err.d_z, err.grad_bias]
            else:
                ctx = _Null()
            with ctx:
                shadow: list[Tensor | None] = [w, b][:nb] if shadows is not None else [None] * nb
                targets = [p.data for p in params[:nb]]
                fused = reducer is None and self.fused_weight_update
                chunked = not fused and reducer is None and layer.weight.numel() >= self.update_chunk_numel
                grad_w: Tensor | None = None
                if fused:  # the GEMM with AdamW in its epilogue: no gradient in memory
                    weight_grad_adamw_(
                        err.d_z, a, targets, err.grad_bias if nb == 2 else None, exp_avg[:nb], exp_avg_sq[:nb],
                        shadow, step_t, self._lr, betas=config.betas, eps=config.eps,
                        weight_decay=config.weight_decay,
                    )
                    grads: list[Tensor] = []
                elif chunked:  # the GEMM and its AdamW, in row blocks
                    grad_w = self._chunked_update(
                        err.d_z, a, err.grad_bias, targets, exp_avg[:nb], exp_avg_sq[:nb], shadow, step_t, overlap, keep
                    )
                    grads = []
                else:
                    grad_w = self._weight_grad(err.d_z.T, a, exact=reducer is not None)
                    grads = [grad_w, err.grad_bias][:nb]
                if reducer is None and not chunked and not fused:
                    if overlap and self._stream_priorities():
                        # the AdamW at background priority too, so it yields to the next forward
                        update = self._background_update_stream()
                        update.wait_stream(torch.cuda.current_stream())
                        keep += grads
                        with torch.cuda.stream(update):
                            self._adamw(None, targets, grads, exp_avg[:nb], exp_avg_sq[:nb], shadow, step_t)
                    else:
                        self._adamw(None, targets, grads, exp_avg[:nb], exp_avg_sq[:nb], shadow, step_t)
                elif reducer is not None:
                    # launch() copies the gradients into its buffer at once; the update uses that buffer
                    _, work, views = reducer.launch(grads)
                    pending.append((work, targets, views, exp_avg[:nb], exp_avg_sq[:nb], shadow, step_t))
                    while len(pending) > 1:
                        self._adamw(*pending.pop(0))
                if overlap and grad_w is not None:
                    keep.append(grad_w)
                head_grads = [err.grad_head_weight, err.grad_head_bias]
                if reducer is None and self.head_updates_per_layer:
                    if overlap:
                        keep += head_grads
                    self._adamw(None, [head_w, head_b], head_grads, exp_avg[nb:], exp_avg_sq[nb:], [None, None], step_t)
            if reducer is not None or not self.head_updates_per_layer:
                small_p += [head_w, head_b]
                small_g += head_grads
                small_m += exp_avg[nb:]
                small_v += exp_avg_sq[nb:]
                small_s += [step_t] * 2
            result = (err.logits, err.loss)
            # drop this layer's B x width temporaries before the next forward allocates: at
            # 16 x 4096, B=16384 that keeps the peak at ~3.5 such tensors instead of ~4.5
            del err, grad_w, grads
            a = h
            del h
        assert result is not None
        logits, loss = result
        if error_stream is not None and main is not None:
            # the head gradients, logits and loss of every layer come from the error stream
            main.wait_stream(error_stream)
        if head is not None:
            assert t.head_state is not None and t.head_statistics is not None
            if t.accumulate_head_statistics:
                gram_update_(t.head_statistics, a, y)
            hb = head.bias.detach() if head.bias is not None else torch.zeros(
                head.out_features, device=a.device, dtype=torch.float32
            )
            err = local_error(a, head.weight.detach(), hb, y, with_dz=False)
            hp = [head.weight.data] + ([head.bias.data] if head.bias is not None else [])
            head_grads = [err.grad_head_weight, err.grad_head_bias][: len(hp)]
            head_moments = t.head_state.moments("exp_avg"), t.head_state.moments("exp_avg_sq")
            if reducer is None and self.head_updates_per_layer:
                self._adamw(None, hp, head_grads, *head_moments, [None] * len(hp), _tensor(t.head_state.step))
            else:
                small_p += hp
                small_g += head_grads
                small_m += head_moments[0]
                small_v += head_moments[1]
                small_s += [_tensor(t.head_state.step)] * len(hp)
            logits, loss = err.logits, err.loss
        if reducer is not None:
            reducer(small_g)  # every local head and the classifier: one small blocking all-reduce
            for item in pending:
                self._adamw(*item)
        if small_p:  # the heads together (with a reducer, or head_updates_per_layer=False)
            torch._fused_adamw_(
                small_p, small_g, small_m, small_v, [], small_s, amsgrad=False, lr=lr, beta1=config.betas[0],
                beta2=config.betas[1], weight_decay=config.weight_decay, eps=config.eps, maximize=False,
            )
        if count_loss:
            t._loss_sum += loss
        if overlap and side is not None and main is not None:
            main.wait_stream(side)
            if self._update_stream is not None:
                main.wait_stream(self._update_stream)
        if sample_stream is not None:
            torch.cuda.current_stream().wait_stream(sample_stream)
        del keep
        return logits, loss, a

    def _local_error_off_main(self, layers: list[DADLinear]) -> bool:
        """``local_error_off_main``, with ``None`` resolved by the widest of ``layers``."""
        if self.local_error_off_main is not None:
            return self.local_error_off_main
        return max(layer.out_features for layer in layers) <= LOCAL_ERROR_OFF_MAIN_MAX_WIDTH

    def _chunked_update(
        self, d_z: Tensor, a: Tensor, grad_bias: Tensor, params: list[Tensor], exp_avg: list[Tensor],
        exp_avg_sq: list[Tensor], shadow: list[Tensor | None], step_t: Tensor, overlap: bool, keep: list[Tensor],
    ) -> Tensor:
        """``W -= AdamW(d_z.T @ a)`` (and the bias) in row blocks of the weight; returns the
        last block's gradient. Per block: ``g = d_z[:, rows].T @ a``, then AdamW on
        ``W[rows]``, ``b[rows]`` and their moments and copies, elementwise as in one launch.
        Under ``overlap`` (called on the side stream) each block's AdamW runs on an update
        stream, beside the next block's GEMM."""
        out_features = d_z.shape[1]
        rows = -(-out_features // self._update_chunks(d_z.shape[0]))
        side = torch.cuda.current_stream() if overlap else None
        if overlap:
            self._background_update_stream()
        grad = d_z
        for r0 in range(0, out_features, rows):
            r1 = min(out_features, r0 + rows)
            grad = self._weight_grad(d_z[:, r0:r1].T, a, exact=False)
            block = [p[r0:r1] for p in params]
            block_grads = [grad, grad_bias[r0:r1]][: len(params)]
            moments = [m[r0:r1] for m in exp_avg], [v[r0:r1] for v in exp_avg_sq]
            copies = [c[r0:r1] if c is not None else None for c in shadow]
            if overlap and side is not None and self._update_stream is not None:
                self._update_stream.wait_stream(side)
                keep.append(grad)
                with torch.cuda.stream(self._update_stream):
                    self._adamw(None, block, block_grads, *moments, copies, step_t)
            else:
                self._adamw(None, block, block_grads, *moments, copies, step_t)
        return grad

    def _background_update_stream(self) -> torch.cuda.Stream:
        """The stream the (chunked, or under ``stream_priorities`` every) AdamW runs on."""
        if self._update_stream is None:
            self._update_stream = self._stream("background")
        return self._update_stream

    def _stream_priorities(self) -> bool:
        """``stream_priorities``, with ``None`` resolved by the largest DAD layer."""
        if self.stream_priorities is not None:
            return self.stream_priorities
        return all(layer.weight.numel() < self.update_chunk_numel for layer in self.trainer.model.dad_layers)

    def _stream(self, role: str) -> torch.cuda.Stream:
        """A side stream for ``role``: under ``stream_priorities`` "critical" (forwards, local
        errors) is the highest priority, "gemm" (weight gradients) the next, "background"
        (AdamW) and "sample" (the head sample) the default (see ``STREAM_PRIORITIES``); otherwise all
        default."""
        priority = self.STREAM_PRIORITIES[role] if self._stream_priorities() else 0
        return torch.cuda.Stream(device=self.device, priority=priority)

    def _update_chunks(self, batch: int) -> int:
        """``update_chunks``, with ``None`` resolved by the batch's rows."""
        if self.update_chunks is not None:
            return self.update_chunks
        return 4 if batch <= UPDATE_CHUNKS_SMALL_BATCH else 2

    def _weight_grad(self, d_z_t: Tensor, a: Tensor, exact: bool) -> Tensor:
        """``d_z.T @ a``, fp32-accumulated: in the compute dtype on CUDA (see
        ``fp32_weight_grads``), in fp32 when ``exact`` (an all-reduce sums it across processes)
        and on CPU (whose AdamW twin needs the master dtype)."""
        if exact or self.fp32_weight_grads or not d_z_t.is_cuda or d_z_t.dtype == torch.float32:
            return _mm_fp32(d_z_t, a)
        return d_z_t @ a

    def _adamw(self, work: Any, params: list[Tensor], grads: list[Tensor], exp_avg: list[Tensor],
               exp_avg_sq: list[Tensor], shadow: list[Tensor | None], step_t: Tensor) -> None:
        """One layer's AdamW (weight and bias, and their low-precision copies), after ``work`` (its
        all-reduce), if any, has finished."""
        if work is not None:
            work.wait()
        config = self.trainer.config
        adamw_with_shadow_(
            params, grads, exp_avg, exp_avg_sq, shadow, step_t, self._lr,
            betas=config.betas, eps=config.eps, weight_decay=config.weight_decay,
        )

    def set_lr(self, lr: float) -> None:
        """The learning rate the next step uses (a device tensor the graphs read)."""
        if lr != self._lr_value:
            self._lr_value = lr
            self._lr.fill_(lr)

    def run_span(
        self, x: Tensor, y: Tensor, lr: float, compute: torch.dtype | None, *, span: tuple[int, int] | None = None,
        with_head: bool = True, reducer: Any = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The fused step, uncaptured, on layers ``span`` (a pipeline stage) and/or with a gradient
        ``reducer`` (data parallelism): ``(logits, loss, span output)``. Large distributed
        batches are bound by GEMMs, not launches, so no graph is needed there. The caller
        offers the rows to the head sample (``DADTrainer._begin_step``) and counts the loss."""
        self.set_lr(lr)
        return self._body(x, y, compute, overlap=False, span=span, with_head=with_head, reducer=reducer,
                          count_loss=False, sample=False)

    def __call__(self, x: Tensor, y: Tensor, lr: float, compute: torch.dtype | None) -> tuple[Tensor, Tensor]:
        """One step on validated ``x`` (B, in) and int64 ``y``; returns fresh ``(logits, loss)``."""
        self.set_lr(lr)
        sample = self.trainer.head_sample
        if sample is not None:
            if x.is_cuda:
                sample.count_rows(x.shape[0])  # _body adds the rows on the device
            else:
                sample.add(x, y)
        if not self.graphed:
            logits, loss, _ = self._body(x, y, compute, overlap=False)
            return logits, loss
        key = (tuple(x.shape), x.dtype, compute, self.trainer.accumulate_head_statistics, self._signature())
        entry = self._graphs.get(key)
        if entry is None:
            if key not in self._seen:
                # first sight of a shape: run eagerly (compiles the Triton kernels, warms cuBLAS);
                # a shape seen twice is captured, so a ragged last batch costs no capture
                self._seen.add(key)
                logits, loss, _ = self._body(x, y, compute, overlap=False)
                return logits, loss
            entry = self._capture(key, x, y, compute)
        graph, static_x, static_y, out_logits, out_loss = entry
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        return out_logits.clone(), out_loss.clone()

    def _capture(
        self, key: tuple[Any, ...], x: Tensor, y: Tensor, compute: torch.dtype | None
    ) -> tuple[Any, Tensor, Tensor, Tensor, Tensor]:
        if len(self._graphs) >= 8:
            self._graphs.clear()
        if self._side is None:
            self._side = self._stream("gemm")
        if self._capture_stream is None and self._stream_priorities():
            self._capture_stream = self._stream("critical")
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        # the input buffer holds the compute dtype: its copy_ is also the cast
        static_x = torch.empty(x.shape, device=self.device, dtype=compute or x.dtype)
        static_y = torch.empty_like(y)
        static_x.copy_(x)
        static_y.copy_(y)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        # No garbage collection during capture: collecting an unreachable trainer's graph
        # (trainer <-> engine is a reference cycle) resets a CUDAGraph mid-capture, which
        # invalidates this capture (seen on the H200: "operation not permitted when stream is
        # capturing (function reset)" after several trainers were built in one process).
        gc.collect()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self._pool, stream=self._capture_stream):
                out_logits, out_loss, _ = self._body(static_x, static_y, compute, overlap=self.overlap_updates)
        finally:
            gc.enable()
        entry = (graph, static_x, static_y, out_logits, out_loss)
        self._graphs[key] = entry
        return entry


def _tensor(value: object) -> Tensor:
    """A module attribute that is a registered buffer, typed as the tensor it is."""
    return cast(Tensor, value)


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None


def resolve_backend(trainer: DADTrainer, backend: str) -> FusedStep | None:
    """The engine ``backend`` asks for, ``None`` for eager; raises if it cannot run."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} must be one of {', '.join(BACKENDS)}")
    if backend == "eager":
        return None
    reason = unsupported_reason(trainer)
    cuda = trainer.device.type == "cuda"
    if backend == "auto":
        if reason is not None or not cuda or not triton_available():
            return None
        return FusedStep(trainer, graphed=True)
    if reason is not None:
        raise ValueError(f"backend={backend!r} cannot run this model: {reason}; use backend='eager'")
    if backend == "cuda-graph" and not cuda:
        raise ValueError(f"backend='cuda-graph' needs a CUDA device, got {trainer.device}; use 'fused' or 'eager'")
    return FusedStep(trainer, graphed=backend == "cuda-graph")
