"""The trainer's head sample: a uniform random sample of the ``(input, label)`` rows seen so far.

:meth:`DADTrainer.solve_head` recomputes the classifier's features of this sample with the
current weights and solves the ridge classifier on them (:mod:`torch_dad.ridge`). On CUDA the
sample is updated inside the trainer's CUDA graph by :func:`torch_dad.ops.reservoir.reservoir_add_`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kernels import use_triton
from ..ops.reservoir import check_seed, reservoir_add_

__all__ = ["InputReservoir"]


class InputReservoir(torch.nn.Module):
    """A uniform random sample of the ``(input, label)`` rows seen so far (Algorithm R).

    ``add(x, y)`` keeps each of the ``seen`` rows with probability ``capacity / seen``, with no
    host sync: on CPU the draws come from the sample's own generator (bitwise resumable), on
    CUDA from Philox keyed by ``seed`` and the row's index, inside the trainer's CUDA graph.
    :meth:`DADTrainer.solve_head` recomputes the features of this sample with the *current*
    weights, because Gram statistics streamed during training mix in features from stale
    weights (the comparison: ``docs/design-engine.md``).
    """

    inputs: Tensor
    labels: Tensor
    seen: Tensor
    _winner: Tensor

    def __init__(
        self, capacity: int, num_features: int | tuple[int, ...], device=None, dtype=None, seed: int = 0
    ) -> None:
        """``num_features``: the width of a row, or the shape of one sample (e.g. ``(C, H, W)`` for a
        convolutional first layer); rows are kept in that shape."""
        super().__init__()
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity={capacity!r} must be a positive int")
        check_seed(seed)
        self.capacity = capacity
        # one spare last row, which nothing writes: older checkpoints, whose device path sent the
        # dropped rows there, still load
        shape = (num_features,) if isinstance(num_features, int) else tuple(num_features)
        self.register_buffer("inputs", torch.zeros(capacity + 1, *shape, device=device, dtype=dtype))
        self.register_buffer("labels", torch.zeros(capacity + 1, dtype=torch.long, device=device))
        # rows seen, on the device too: the device path reads it inside a captured CUDA graph
        self.register_buffer("seen", torch.zeros((), dtype=torch.long, device=device))
        # the device path's scratch: the batch row each slot keeps, -1 between calls (not state)
        self.register_buffer("_winner", torch.full((capacity,), -1, dtype=torch.int32, device=device), persistent=False)
        # the CPU path's draws (the device path's kernel draws from Philox keyed by this seed)
        self.seed = seed
        self._generator = torch.Generator().manual_seed(seed)
        self._seen = 0

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[no-untyped-def]
        # the generator state and the Philox seed are extra entries (for bitwise resume), not buffers
        rng = state_dict.pop(prefix + "_rng_state", None)
        seed = state_dict.pop(prefix + "_seed", None)  # absent in older checkpoints
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._seen = int(self.seen)
        if rng is not None:
            self._generator.set_state(rng)
        if seed is not None:
            self.seed = int(seed)

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "_rng_state"] = self._generator.get_state()
        # the device path's Philox key: with `seen` it fixes every later draw
        destination[prefix + "_seed"] = torch.tensor(self.seed, dtype=torch.long)

    @property
    def size(self) -> int:
        """Rows currently held: ``min(seen, capacity)``."""
        return min(self._seen, self.capacity)

    @torch.no_grad()
    def add(self, inputs: Tensor, labels: Tensor) -> None:
        """Offer a batch of rows to the sample (host draws on CPU, device draws elsewhere)."""
        if self.inputs.device.type == "cpu":
            self._add_on_host(inputs, labels)
        else:
            self.add_on_device(inputs, labels)
            self.count_rows(inputs.shape[0])

    def count_rows(self, n: int) -> None:
        """Advance the host copy of ``seen`` by ``n`` (the device path advances the buffer)."""
        self._seen += n

    @torch.no_grad()
    def add_on_device(self, inputs: Tensor, labels: Tensor) -> None:
        """Algorithm R drawn on the device, capturable in a CUDA graph: no host value is read.

        Row t (1-based count) goes to slot ``t - 1`` while ``t <= capacity``, else to a uniform
        slot of ``[0, t)`` when that is ``< capacity``, else it is dropped. Of two rows of one
        batch drawing the same slot the later is kept, as in the sequential rule; only kept rows
        are copied (:func:`torch_dad.ops.reservoir.reservoir_add_`: two kernels on CUDA). With
        the Triton kernels the draw kernel makes its own uniforms, Philox keyed by ``seed`` and each
        row's global index (so a replayed graph touches no torch generator, and a resumed sample
        continues the same stream); elsewhere (the PyTorch twin) they come from the default
        generator of the sample's device. The caller advances the host count (:meth:`count_rows`).
        Drawing on the device keeps the host out of the graphed step (``docs/design-engine.md``).
        """
        # the kernels move rows of a matrix: a sample of (C, H, W) images is viewed as (rows, C*H*W)
        held, rows = self.inputs.flatten(1), inputs.flatten(1)
        if use_triton(inputs, "auto"):
            reservoir_add_(held, self.labels, self.seen, self._winner, rows, labels, seed=self.seed)
            return
        draws = torch.rand(inputs.shape[0], device=self.seen.device, dtype=torch.float64)
        reservoir_add_(held, self.labels, self.seen, self._winner, rows, labels, draws, backend="torch")

    def _add_on_host(self, inputs: Tensor, labels: Tensor) -> None:
        n = inputs.shape[0]
        direct = max(0, min(n, self.capacity - self._seen))
        if direct:
            self.inputs[self._seen : self._seen + direct].copy_(inputs[:direct])
            self.labels[self._seen : self._seen + direct].copy_(labels[:direct])
        rest = n - direct
        if rest:
            # row t (1-based count) replaces a uniform slot of [0, t) when that slot is < capacity;
            # only the kept rows (B * capacity / seen of them) are copied
            counts = torch.arange(self._seen + direct + 1, self._seen + n + 1, dtype=torch.float64)
            slot = (torch.rand(rest, generator=self._generator, dtype=torch.float64) * counts).long()
            rows = (slot < self.capacity).nonzero().squeeze(1)
            if rows.numel():
                # a slot drawn twice in one batch keeps the later row, as the sequential rule does
                slot, rows = slot[rows].flip(0), rows.flip(0)
                first = torch.ones_like(slot, dtype=torch.bool)
                order = torch.argsort(slot, stable=True)
                first[order[1:]] = slot[order[1:]] != slot[order[:-1]]
                slot, rows = slot[first], rows[first] + direct
                self.inputs.index_copy_(0, slot, inputs.index_select(0, rows).to(self.inputs.dtype))
                self.labels.index_copy_(0, slot, labels.index_select(0, rows))
        self._seen += n
        self.seen.fill_(self._seen)

    def reset(self) -> None:
        """Forget every row."""
        self._seen = 0
        self.seen.zero_()

    def batches(self, batch_size: int = 4096):  # type: ignore[no-untyped-def]
        """Yield the held rows as ``(inputs, labels)`` chunks."""
        for start in range(0, self.size, batch_size):
            stop = min(start + batch_size, self.size)
            yield self.inputs[start:stop], self.labels[start:stop]
