"""Algorithm R on the device: which batch rows an input sample keeps, and copying only those.

``InputReservoir.add_on_device`` (:mod:`torch_dad.training.input_sample`) decides on the device,
with no host sync, which row of a batch lands in which slot: ``winner[s]`` is the batch row
stored in slot ``s``, or ``-1`` (slot unchanged). :func:`reservoir_store_` then does, for every
slot ``s`` with ``winner[s] >= 0``::

    sample_inputs[s] = inputs[winner[s]]     sample_labels[s] = labels[winner[s]]

Why a kernel: the batch's kept rows are few (``B * capacity / seen`` once the sample is
full) but their number is only known on the device. The twin below copies a row per slot;
here one program per slot reads ``winner[s]`` and returns at once when it is ``-1``, instead of
copying every batch row (``docs/design-engine.md``).

:func:`reservoir_add_` is the whole device step of Algorithm R in two kernels: one program per
1024 batch rows turns the uniform draws into slots and ``atomic_max``-es each kept row's index
into a persistent ``winner`` scratch (the later row of a batch wins a slot, as in the sequential
rule), then the store kernel copies, resets ``winner`` to ``-1`` and advances ``seen``: two
launches where the same step in PyTorch ops (count, draw, two ``where``, a ``full``,
``scatter_reduce_``, the store and ``seen += n``) takes 18.

With ``draws=None`` the draw kernel makes each row's uniform itself, from Philox keyed by the
sample's seed and the row's global index (``seen + i``): see :func:`reservoir_uniforms`. So no
torch generator is in the captured graph. A graph that draws from the default CUDA generator
makes every ``CUDAGraph.replay()`` first launch two ``fill_`` kernels for the generator's seed
and offset, host time that a small, host-bound step pays in full.

The kernels are in :mod:`torch_dad.kernels.reservoir`; CPU tensors take the PyTorch twin.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
from torch import Tensor

from ..kernels import use_triton

__all__ = ["check_seed", "reservoir_add_", "reservoir_store_", "reservoir_uniforms"]


def check_seed(seed: int) -> None:
    """Raise ``ValueError`` unless ``seed`` is an int in ``[0, 2**63)`` (a Philox key)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed={seed!r} must be an int in [0, 2**63)")


def reservoir_store_(
    sample_inputs: Tensor, sample_labels: Tensor, inputs: Tensor, labels: Tensor, winner: Tensor,
    *, backend: str = "auto",
) -> None:
    """``sample[s] = batch[winner[s]]`` for every slot ``s`` with ``winner[s] >= 0`` (in place).

    ``sample_inputs`` (S', D) and ``sample_labels`` (S',) with ``S' >= S = winner.numel()``;
    ``inputs`` (B, D) in any float dtype (cast to the sample's), ``labels`` (B,) int64,
    ``winner`` (S,) int64 in ``[-1, B)``.
    """
    slots = winner.numel()
    _check_shapes(sample_inputs, sample_labels, inputs, labels, slots)
    if not use_triton(inputs, backend) or slots == 0:
        _store_torch(sample_inputs, sample_labels, inputs, labels, winner)
        return
    _kernels().launch_store(sample_inputs, sample_labels, inputs, labels, winner, None, reset=False)


def _check_shapes(sample_inputs: Tensor, sample_labels: Tensor, inputs: Tensor, labels: Tensor, slots: int) -> None:
    if inputs.dim() != 2 or sample_inputs.dim() != 2 or inputs.shape[1] != sample_inputs.shape[1]:
        raise ValueError(
            f"inputs {tuple(inputs.shape)} and sample_inputs {tuple(sample_inputs.shape)} must be 2-D "
            "with the same number of columns"
        )
    if sample_inputs.shape[0] < slots or sample_labels.shape[0] < slots or labels.shape != (inputs.shape[0],):
        raise ValueError(
            f"winner has {slots} slots: sample_inputs/sample_labels need at least that many rows, "
            f"labels one per input row; got {tuple(sample_inputs.shape)}, {tuple(sample_labels.shape)}, "
            f"{tuple(labels.shape)}"
        )


def reservoir_add_(
    sample_inputs: Tensor, sample_labels: Tensor, seen: Tensor, winner: Tensor, inputs: Tensor, labels: Tensor,
    draws: Tensor | None = None, *, seed: int = 0, backend: str = "auto",
) -> None:
    """Offer a batch to a sample of ``S = winner.numel()`` slots (Algorithm R), in place, no host sync.

    Row ``i`` is the ``t = seen + i + 1``-th row seen: it goes to slot ``t - 1`` while ``t <= S``,
    else to slot ``floor(draws[i] * t)`` when that is ``< S``, else nowhere; of two rows drawing
    one slot the later is kept. Then ``seen += B``. ``draws`` (B,) float64 uniforms in [0, 1), or
    ``None``: the kernel makes them, ``draws = reservoir_uniforms(seed, seen, B)`` (Triton only);
    ``seen`` a 0-dim int64 tensor; ``winner`` (S,) int32 scratch, all ``-1`` on entry and on exit.
    """
    batch = inputs.shape[0]
    slots = winner.numel()
    _check_shapes(sample_inputs, sample_labels, inputs, labels, slots)
    if (draws is not None and draws.shape != (batch,)) or seen.dim() != 0 or winner.dtype != torch.int32:
        raise ValueError(
            f"draws must have shape ({batch},), seen must be 0-dim and winner int32; got "
            f"{None if draws is None else tuple(draws.shape)}, {seen.dim()}-dim, {winner.dtype}"
        )
    triton_path = use_triton(inputs, backend) and slots > 0
    if draws is None and not triton_path:
        raise ValueError("draws=None makes the draws in the Triton kernel: pass draws for backend='torch' or CPU "
                         "tensors (e.g. draws=torch.rand(B, dtype=torch.float64))")
    check_seed(seed)
    if batch == 0:
        return
    if not triton_path:
        assert draws is not None
        _add_torch(sample_inputs, sample_labels, seen, inputs, labels, draws, slots)
        return
    kernels = _kernels()
    kernels.launch_draw(seen, draws, winner, batch, seed)
    kernels.launch_store(sample_inputs, sample_labels, inputs, labels, winner, seen, reset=True)


def _add_torch(sample_inputs: Tensor, sample_labels: Tensor, seen: Tensor, inputs: Tensor, labels: Tensor,
               draws: Tensor, slots: int) -> None:
    """The twin of the two kernels: each row's slot, the last row per slot, the copy, ``seen += B``."""
    batch = inputs.shape[0]
    count = seen + torch.arange(1, batch + 1, device=seen.device)
    slot = torch.where(count <= slots, count - 1, (draws * count).long())
    order = torch.arange(batch, device=seen.device)
    # dropped rows each get their own index past the slots, so no index collects thousands
    slot = torch.where(slot < slots, slot, slots + order)
    chosen = torch.full((slots + batch,), -1, dtype=torch.long, device=seen.device)
    chosen.scatter_reduce_(0, slot, order, reduce="amax")
    reservoir_store_(sample_inputs, sample_labels, inputs, labels, chosen[:slots], backend="torch")
    seen.add_(batch)


def reservoir_uniforms(seed: int, start: Tensor | int, n: int, device: torch.device | str = "cuda") -> Tensor:
    """The float64 uniforms in [0, 1) that :func:`reservoir_add_` draws with ``draws=None`` for
    global rows ``start .. start + n - 1`` (Triton; ``start`` a 0-dim int64 tensor or an int).

    Row ``r``'s uniform is ``(a >> 5) * 2**-27 + (b >> 6) * 2**-53`` for the first two 32-bit
    words ``a, b`` of Philox-4x32-10 with key ``seed`` and counter ``(r mod 2**32, r >> 32, 0, 0)``:
    53 random bits, so ``floor(u * t)`` stays uniform over ``[0, t)`` for any reachable ``t``.
    """
    check_seed(seed)
    first = start if isinstance(start, Tensor) else torch.tensor(int(start), dtype=torch.long, device=device)
    out = torch.empty(n, dtype=torch.float64, device=first.device)
    if n:
        _kernels().launch_uniforms(first, out, seed)
    return out


def _store_torch(sample_inputs: Tensor, sample_labels: Tensor, inputs: Tensor, labels: Tensor,
                 winner: Tensor) -> None:
    """The twin: gather a row for every slot, keep the old one where ``winner`` is ``-1``."""
    slots = winner.numel()
    kept = winner >= 0
    rows = winner.clamp(min=0)
    gathered = inputs.index_select(0, rows).to(sample_inputs.dtype)
    head = sample_inputs[:slots]
    head.copy_(torch.where(kept[:, None], gathered, head))
    sample_labels[:slots].copy_(torch.where(kept, labels.index_select(0, rows), sample_labels[:slots]))


@functools.lru_cache(maxsize=1)
def _kernels() -> ModuleType:
    from ..kernels import reservoir as kernels  # imports triton: on the first launch only

    return kernels
