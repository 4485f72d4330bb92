"""Supervised fine-tuning of a causal LM with TRL's ``SFTTrainer`` and a DAD LM head.

``DADSFTTrainer`` is ``trl.SFTTrainer`` whose ``lm_head`` is a :class:`torch_dad.DADLMHead`: the head computes
its loss in token chunks (the full logits never exist in training) and updates itself inside ``backward()`` with
its own AdamW, so the trainer's optimizer holds no vocabulary-sized moments. ``dL/dhidden`` still flows to the
rest of the model, so a full fine-tune or LoRA adapters (``--lora``) train as usual::

    python examples/sft_trl.py --model DIR --text FILE          # a local HF model folder, one example per line
    python examples/sft_trl.py --model DIR --text FILE --lora --steps 200 --save out/
    python examples/sft_trl.py --smoke                          # a tiny random Llama on CPU, seconds

``DIR`` is anything ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` read from disk
(for example a folder written by ``save_pretrained``); nothing is downloaded. A tied input/output embedding is
untied first (``untie_embeddings=True``): the DAD head owns its weight. Needs the ``trl`` extra
(``pip install torch-dad[trl]``).

A side-by-side with stock ``SFTTrainer`` and Liger-Kernel on an H200 (tokens/s, peak memory, loss curves) is
``benchmarks/sft_gpu.py``; its results are in ``docs/lm_head.md``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is read from disk

SMOKE_WORDS = [f"w{i}" for i in range(40)]


def smoke_model_and_tokenizer() -> tuple[Any, Any]:
    """A 2-layer random Llama and a word-level tokenizer over ``SMOKE_WORDS`` (ids 3..42)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(SMOKE_WORDS)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    config = transformers.LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, eos_token_id=1, bos_token_id=1, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config), tokenizer


def smoke_texts(n: int = 256) -> list[str]:
    """Counting sequences ``w{k} w{k+1} ...`` from random starts: a pattern the model can learn in a few steps."""
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(SMOKE_WORDS) - 12, (n,), generator=g).tolist()
    return [" ".join(SMOKE_WORDS[s : s + 12]) for s in starts]


def load(args: argparse.Namespace) -> tuple[Any, Any, list[str]]:
    """``(model, tokenizer, texts)``: the smoke set, or the model folder and the text file (one example per line)."""
    if args.smoke:
        model, tokenizer = smoke_model_and_tokenizer()
        return model, tokenizer, smoke_texts()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    texts = [line.strip() for line in Path(args.text).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not texts:
        raise ValueError(f"--text {args.text} has no non-empty lines; put one training example per line")
    return model, tokenizer, texts


def make_trainer(args: argparse.Namespace, model: Any, tokenizer: Any, texts: list[str], out_dir: str) -> Any:
    """``DADSFTTrainer`` on ``texts`` (``SFTConfig`` with a constant lr: the head's own AdamW has no scheduler)."""
    from datasets import Dataset
    from trl import SFTConfig

    from torch_dad.integrations.trl import DADSFTTrainer

    config = SFTConfig(
        output_dir=out_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
        learning_rate=args.lr, lr_scheduler_type="constant", max_length=args.max_length, logging_steps=1,
        report_to=[], save_strategy="no", disable_tqdm=args.smoke, use_cpu=args.device == "cpu",
        bf16=args.device != "cpu" and torch.cuda.is_bf16_supported(), seed=0, dataloader_num_workers=0,
    )
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    head = {"lr": args.head_lr or args.lr, "untie_embeddings": True, "weight_chunk_size": args.weight_chunk_size}
    return DADSFTTrainer(
        model=model, args=config, train_dataset=Dataset.from_dict({"text": texts}), processing_class=tokenizer,
        peft_config=peft_config, dad_head=head,
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a local Hugging Face causal LM folder")
    parser.add_argument("--text", help="a UTF-8 text file, one training example per line")
    parser.add_argument("--smoke", action="store_true", help="tiny random Llama and synthetic text, CPU, seconds")
    parser.add_argument("--lora", action="store_true", help="LoRA r 16 on q/k/v/o; the DAD head trains as well")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default 100; --smoke 40)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--lr", type=float, default=None, help="default 2e-5; --smoke 3e-3")
    parser.add_argument("--head-lr", type=float, default=None, help="the DAD head's AdamW lr (default: --lr)")
    parser.add_argument("--weight-chunk-size", type=int, default=None,
                        help="cast the head's weight this many rows at a time instead of holding a bf16 copy of "
                             "all of it: less memory for large vocabularies (docs/lm_head.md), e.g. 8192")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--save", help="folder for trainer.save_model()")
    args = parser.parse_args(argv)
    if not args.smoke and (args.model is None or args.text is None):
        parser.error("give --model DIR and --text FILE, or --smoke")
    if args.smoke:
        args.device = "cpu"
    args.steps = args.steps or (40 if args.smoke else 100)
    args.lr = args.lr or (3e-3 if args.smoke else 2e-5)
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    """Train, print the first and last logged loss and the tokens/s; return them."""
    args = parse_args(argv)
    model, tokenizer, texts = load(args)
    with tempfile.TemporaryDirectory() as scratch:  # the trainer's output_dir; --save writes the model
        trainer = make_trainer(args, model, tokenizer, texts, scratch)
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
    logs = [h for h in trainer.state.log_history if "loss" in h]
    losses = [h["loss"] for h in logs]
    print(f"training loss: first step {losses[0]:.4f}, last step {losses[-1]:.4f} ({len(losses)} steps, {seconds:.1f} s)")
    tokens = logs[-1].get("num_tokens")  # TRL logs the running count of trained tokens
    if tokens:
        print(f"tokens/s: {tokens / seconds:,.0f} (logging and evaluation included)")
    if args.save:
        trainer.save_model(args.save)
        print(f"saved to {args.save}")
    return {"first_loss": losses[0], "last_loss": losses[-1], "seconds": seconds}


if __name__ == "__main__":
    main()
