"""``benchmarks/sft_gpu.py``'s Unsloth systems on CPU: skipped with a reason, and the model builder's calls (on a
stand-in ``unsloth`` module, since Unsloth itself needs CUDA)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import sft_gpu  # noqa: E402

CPU = torch.device("cpu")


def test_unsloth_systems_are_opt_in() -> None:
    assert set(sft_gpu.UNSLOTH_SYSTEMS) <= set(sft_gpu.SYSTEMS)
    assert not set(sft_gpu.UNSLOTH_SYSTEMS) & set(sft_gpu.DEFAULT_SYSTEMS)
    assert sft_gpu.DEFAULT_SYSTEMS == ("stock", "liger", "dad", "dad-liger")


def test_skipped_without_cuda_without_importing_unsloth() -> None:
    imported = "unsloth" in sys.modules
    for system in sft_gpu.UNSLOTH_SYSTEMS:
        assert sft_gpu.skip_reason(system, CPU) == "unsloth needs CUDA"
    assert sft_gpu.skip_reason("stock", CPU) is None
    assert sft_gpu.skip_reason("dad-liger", CPU) == sft_gpu.skip_reason("liger", CPU) is not None
    assert ("unsloth" in sys.modules) == imported


def test_skipped_where_unsloth_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert sft_gpu.skip_reason("unsloth", torch.device("cuda")) == "unsloth is not importable"


def test_run_grid_records_the_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sft_gpu, "environment", lambda: {})
    args = argparse.Namespace(smoke=True, shapes=["smoke"], modes=["full", "lora"],
                              systems=list(sft_gpu.UNSLOTH_SYSTEMS), in_process=True, tokens=None, repeats=1)
    rows = sft_gpu.run_grid(args, CPU)
    assert [(r["system"], r["mode"]) for r in rows] == [(s, m) for m in ("full", "lora") for s in sft_gpu.UNSLOTH_SYSTEMS]
    assert all(r["skipped"] == "unsloth needs CUDA" and "losses" not in r for r in rows)
    # the run's environment, beside its rows in the record, names the Unsloth stack's versions
    assert set(sft_gpu.grid_environment()["versions"]) >= {"unsloth", "unsloth_zoo", "bitsandbytes"}


def fake_unsloth(monkeypatch: pytest.MonkeyPatch, full_finetuning: bool) -> list[tuple[str, dict[str, Any]]]:
    """An ``unsloth`` module whose ``FastLanguageModel`` records its calls and loads the saved model with
    transformers."""
    calls: list[tuple[str, dict[str, Any]]] = []

    def from_pretrained(model_name: str, dtype: Any = None, load_in_4bit: bool = True, max_seq_length: int = 2048,
                        **kwargs: Any) -> tuple[Any, Any]:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        calls.append(("from_pretrained", {"model_name": model_name, "dtype": dtype, "load_in_4bit": load_in_4bit,
                                          "max_seq_length": max_seq_length, **kwargs}))
        return AutoModelForCausalLM.from_pretrained(model_name, dtype=dtype), AutoTokenizer.from_pretrained(model_name)

    def with_full(model_name: str, dtype: Any = None, load_in_4bit: bool = True, max_seq_length: int = 2048,
                  full_finetuning: bool | None = None, **kwargs: Any) -> tuple[Any, Any]:
        if full_finetuning is not None:  # record only what the caller passed
            kwargs["full_finetuning"] = full_finetuning
        return from_pretrained(model_name, dtype, load_in_4bit, max_seq_length, **kwargs)

    def get_peft_model(model: Any, **kwargs: Any) -> Any:
        calls.append(("get_peft_model", kwargs))
        return model

    fast = types.SimpleNamespace(from_pretrained=with_full if full_finetuning else from_pretrained,
                                 get_peft_model=get_peft_model)
    monkeypatch.setitem(sys.modules, "unsloth", types.SimpleNamespace(FastLanguageModel=fast))
    return calls


def test_full_mode_skipped_without_full_finetuning(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls = fake_unsloth(monkeypatch, full_finetuning=False)
    config = types.SimpleNamespace(output_dir=str(tmp_path), max_length=32)
    with pytest.raises(sft_gpu.Skipped, match="full_finetuning"):
        sft_gpu.unsloth_model(sft_gpu.SMOKE_SHAPE, "full", CPU, None, config)
    assert calls == [] and not (tmp_path / "init").exists()


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_unsloth_builder_loads_the_saved_init(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mode: str) -> None:
    pytest.importorskip("transformers")
    calls = fake_unsloth(monkeypatch, full_finetuning=True)
    config = types.SimpleNamespace(output_dir=str(tmp_path), max_length=32)
    tok = sft_gpu.stand_in_tokenizer(2, 2)
    model, tok2 = sft_gpu.model_builder("unsloth-dad")(sft_gpu.SMOKE_SHAPE, mode, CPU, tok, config)
    load = {"model_name": str(tmp_path / "init"), "dtype": torch.bfloat16, "load_in_4bit": False,
            "max_seq_length": 32}
    if mode == "full":
        assert calls == [("from_pretrained", {**load, "full_finetuning": True})]
    else:
        assert calls == [("from_pretrained", load), ("get_peft_model", {
            "r": 16, "lora_alpha": 32, "lora_dropout": 0, "target_modules": sft_gpu.LORA_TARGETS})]
    reference = sft_gpu.build_model(sft_gpu.SMOKE_SHAPE, CPU)
    assert not model.config.tie_word_embeddings
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight.to(torch.bfloat16))
    assert torch.equal(model.model.embed_tokens.weight, reference.model.embed_tokens.weight.to(torch.bfloat16))
    assert tok2.eos_token_id == 2 and tok2.pad_token_id == 2
    assert sft_gpu.model_builder("stock") is sft_gpu.plain_model


def test_model_has_no_padding_row() -> None:
    """With ``pad_token_id`` in the config, the EOS/pad id's embedding row is zero at init; a row that starts with it
    keeps a zero hidden state through every layer, and the RMSNorm backwards (about 1/sqrt(eps) each) overflow."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**sft_gpu._COMMON_SHAPE, **sft_gpu.SMOKE_SHAPE)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    assert model.get_input_embeddings().padding_idx is None
    ids = torch.randint(3, config.vocab_size, (2, 16))
    ids[0, 0] = sft_gpu._COMMON_SHAPE["eos_token_id"]
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
