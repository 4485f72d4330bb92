"""DAD LM head on a tiny random Llama: HF forward routing, tied embeddings, TRL SFTTrainer, PEFT LoRA."""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from torch_dad.integrations.causal_lm import replace_lm_head  # noqa: E402
from torch_dad.nn.lm_head import DADLMHead  # noqa: E402
from torch_dad.ops.linear_cross_entropy import shift_labels  # noqa: E402

VOCAB_WORDS = [f"w{i}" for i in range(90)]


def tiny_llama(tied: bool = True, seed: int = 0):
    cfg = transformers.LlamaConfig(
        vocab_size=len(VOCAB_WORDS) + 3, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied, pad_token_id=0, eos_token_id=1,
        bos_token_id=1,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(VOCAB_WORDS)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")


def batch(seed=0, b=3, t=9, v=93):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, v, (b, t), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100
    return ids, labels


def test_tied_head_needs_explicit_untie():
    model = tiny_llama(tied=True)
    with pytest.raises(ValueError, match="untie_embeddings=True"):
        replace_lm_head(model)
    assert not isinstance(model.lm_head, DADLMHead)  # nothing changed
    head = replace_lm_head(model, untie_embeddings=True)
    assert model.lm_head is head and not model.config.tie_word_embeddings
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert torch.equal(head.weight, model.model.embed_tokens.weight)  # same values, own storage


def test_unsupported_logit_transform_is_refused():
    model = tiny_llama(tied=False)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        replace_lm_head(model)


@pytest.mark.parametrize("sweep", ["auto", "vocab", "recompute"])
def test_training_forward_matches_hf_loss_and_updates_in_backward(sweep):
    ref = tiny_llama(tied=False, seed=1)
    model = tiny_llama(tied=False, seed=1)
    head = replace_lm_head(model, lr=1e-2, backprop_gradients=True, sweep=sweep)
    ids, labels = batch()
    model.train()
    ref.train()
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None  # no (tokens x vocab) logits in training
    expected = ref(input_ids=ids, labels=labels)
    assert abs(float(out.loss.detach()) - float(expected.loss.detach())) < 1e-5
    w0 = head.weight.detach().clone()
    out.loss.backward()
    expected.loss.backward()
    assert head.weight.grad is None and not torch.equal(head.weight, w0)
    assert head.last_sweep == ("tokens" if sweep == "auto" else sweep)  # auto: the vocabulary sweeps need triton
    # the head's step is AdamW's first step on HF's head gradient: lr * sign(g) where g is not tiny
    g = ref.lm_head.weight.grad
    moved = (head.weight.detach() - w0)[g.abs() > 1e-4]
    assert torch.allclose(moved, -1e-2 * torch.sign(g[g.abs() > 1e-4]), rtol=1e-3, atol=1e-5)
    # backprop_gradients=True: the backbone receives exactly backprop's gradient
    for (name, p), q in zip(model.model.named_parameters(), ref.model.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name


def test_eval_returns_logits_of_the_head():
    model = tiny_llama(tied=False)
    head = replace_lm_head(model)
    ids, labels = batch()
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
        hidden = model.model(input_ids=ids).last_hidden_state
    assert out.logits.shape == (*ids.shape, head.vocab_size)
    assert torch.allclose(out.logits, hidden @ head.weight.T, atol=1e-5)
    lp = torch.log_softmax(out.logits, -1)
    tgt = shift_labels(labels)
    mask = tgt != -100
    manual = -(lp.gather(-1, tgt.clamp(min=0)[..., None]).squeeze(-1) * mask).sum() / mask.sum()
    assert abs(float(out.loss) - float(manual)) < 1e-5


def test_all_ignored_labels_leave_head_unchanged():
    model = tiny_llama(tied=False)
    head = replace_lm_head(model)
    model.train()
    ids, _ = batch()
    before = {k: v.clone() for k, v in head.state_dict().items()}
    out = model(input_ids=ids, labels=torch.full_like(ids, -100))
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0
    for k, v in head.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_vocab_range_error_is_clear():
    model = tiny_llama(tied=False)
    replace_lm_head(model)
    model.train()
    ids, labels = batch()
    labels[1, 3] = 500
    with pytest.raises(ValueError, match="vocabulary"):
        model(input_ids=ids, labels=labels)
    with pytest.raises(ValueError, match="shape"):
        model(input_ids=ids, labels=labels[:, :-1])


def _sft(model, tmp_path, *, peft_config=None, steps=8, dad_head=None, compute_metrics=None, **config):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from torch_dad.integrations.trl import DADSFTTrainer

    texts = [" ".join(VOCAB_WORDS[(i * 7 + j * 3) % 90] for j in range(12)) for i in range(48)]
    ds = Dataset.from_dict({"text": texts})
    args = trl.SFTConfig(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=8, per_device_eval_batch_size=8,
        learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", max_length=16, use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True, **config,
    )
    return DADSFTTrainer(model=model, args=args, train_dataset=ds, eval_dataset=ds.select(range(8)),
                         processing_class=tokenizer(), peft_config=peft_config, compute_metrics=compute_metrics,
                         dad_head=dad_head)


def test_sft_trainer_trains_dad_head_and_evaluates_with_logits(tmp_path):
    model = tiny_llama(tied=True)
    embed0 = model.model.embed_tokens.weight.detach().clone()
    seen = {}

    def compute_metrics(pred):
        seen["logits"] = pred.predictions.shape
        return {"seen": 1.0}

    # backprop_gradients=False: the head alone trains, so the untied embeddings must stay as they were
    dad_head = {"lr": 2e-2, "untie_embeddings": True, "backprop_gradients": False}
    trainer = _sft(model, tmp_path, dad_head=dad_head, compute_metrics=compute_metrics)
    head = trainer.dad_head
    w0 = head.weight.detach().clone()
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.3
    assert not torch.equal(head.weight, w0) and head.weight.grad is None
    assert torch.equal(model.model.embed_tokens.weight, embed0)  # untied: embeddings not touched
    metrics = trainer.evaluate()
    assert metrics["eval_seen"] == 1.0 and seen["logits"][-1] == head.vocab_size
    assert "eval_mean_token_accuracy" in metrics and metrics["eval_loss"] > 0


def test_sft_trainer_lora_adapters_learn_through_backprop_gradients(tmp_path):
    peft = pytest.importorskip("peft")
    model = tiny_llama(tied=False)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    trainer = _sft(model, tmp_path, peft_config=config, steps=3, dad_head={"lr": 1e-2})
    head = trainer.dad_head
    assert head.backprop_gradients  # the PEFT default
    lora = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "base_layer" in n}
    w0 = head.weight.detach().clone()
    trainer.train()
    params = dict(trainer.model.named_parameters())
    assert lora and all(not torch.equal(params[n], v) for n, v in lora.items())
    assert all(torch.equal(params[n], v) for n, v in base.items())
    assert not torch.equal(head.weight, w0)


@pytest.mark.parametrize("frozen", [False, True])
def test_sft_trainer_full_fine_tune_trains_the_trunk_by_default(tmp_path, frozen):
    model = tiny_llama(tied=False)
    if frozen:  # a frozen backbone: only the head trains, and no dL/dhidden is computed
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith("lm_head"))
    trunk = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("lm_head")}
    trainer = _sft(model, tmp_path, steps=2, dad_head={"lr": 1e-2})
    assert trainer.dad_head.backprop_gradients is not frozen
    trainer.train()
    params = dict(trainer.model.named_parameters())
    changed = [n for n, v in trunk.items() if not torch.equal(params[n], v)]
    assert (changed == []) if frozen else len(changed) == len(trunk)


def test_unsloth_patch_refuses_plain_model_and_works_on_the_generic_path():
    """What is testable without Unsloth: the guard, and patch() on a plain Llama (require_unsloth=False)."""
    from torch_dad.integrations import unsloth

    model = tiny_llama(tied=False).to(torch.bfloat16)
    assert not unsloth.is_unsloth_model(model)
    with pytest.raises(ValueError, match="FastLanguageModel"):
        unsloth.patch(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.config.unsloth_version = "2026.10.9"  # what Unsloth's loaders stamp, full fine-tuning included
    assert unsloth.is_unsloth_model(model)
    del model.config.unsloth_version
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())  # the refusal changed nothing
    head = unsloth.patch(model, require_unsloth=False, lr=1e-2)
    assert head.weight.dtype == torch.float32 and head.optim_state.exp_avg_0.dtype == torch.float32
    ids, labels = batch()
    model.train()
    w0 = head.weight.detach().clone()
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    assert head.last_backend == "torch" and not torch.equal(head.weight, w0)
    # a pure-bf16 trunk without autocast (how Unsloth runs a bf16 full fine-tune): only the head is float32,
    # and dL/dhidden reaches every trunk parameter in its own dtype
    trunk = [(n, p) for n, p in model.named_parameters() if not n.startswith("lm_head")]
    assert head.backprop_gradients
    assert all(p.dtype == torch.bfloat16 and p.grad is not None and p.grad.dtype == torch.bfloat16 for _, p in trunk)
    assert all(torch.isfinite(p.grad).all() for _, p in trunk)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.dtype == torch.bfloat16 and logits.shape[-1] == head.vocab_size


def _unsloth_full_fine_tune_layout(model):
    """What Unsloth's training preparation does to a bf16 full fine-tune: norms' weights in float32 beside bf16
    projections, and the class forward wrapped in bf16 autocast (marked as unsloth_zoo marks it)."""
    model.to(torch.bfloat16)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data = p.data.float()
    cls = type(model)

    def forward(self, *args, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return cls.forward(self, *args, **kwargs)

    model.__class__ = type(cls.__name__, (cls,), {"forward": forward, "_unsloth_autocast_dtype": torch.bfloat16})
    model._unsloth_bf16_autocast_wrapped = True
    return model


def test_unsloth_patch_keeps_the_autocast_of_a_full_fine_tune():
    """Unsloth's bf16 full fine-tune: float32 norms feed bf16 projections only under its autocast, which the patched
    forward's training path must keep (without it: 'expected mat1 and mat2 to have the same dtype')."""
    from torch_dad.integrations import unsloth

    model = _unsloth_full_fine_tune_layout(tiny_llama(tied=False))
    assert unsloth.unsloth_autocast_dtype(model) == torch.bfloat16
    assert unsloth.unsloth_autocast_dtype(tiny_llama(tied=False)) is None
    ids, labels = batch()
    model.train()
    reference = model(input_ids=ids, labels=labels).loss  # Unsloth's own forward, under its autocast
    head = unsloth.patch(model, require_unsloth=False, lr=1e-2)
    w0 = head.weight.detach().clone()
    loss = model(input_ids=ids, labels=labels).loss
    torch.testing.assert_close(loss.float(), reference.float(), rtol=2e-2, atol=2e-2)
    loss.backward()
    assert not torch.equal(head.weight, w0) and head.weight.dtype == torch.float32
    trunk = [(n, p) for n, p in model.named_parameters() if not n.startswith("lm_head")]
    assert all(p.grad is not None and p.grad.dtype == p.dtype and torch.isfinite(p.grad).all() for _, p in trunk)
    assert {p.dtype for n, p in trunk if "norm" in n} == {torch.float32}
    model.eval()
    with torch.no_grad():
        assert model(input_ids=ids).logits.shape[-1] == head.vocab_size


def test_sft_trainer_gradient_accumulation_warns_for_inplace_and_follows_with_grad(tmp_path):
    """update="inplace" steps the head at every micro-batch, so gradient accumulation warns; update="grad" hands the
    head's gradient to the trainer's optimizer, which accumulates it like any other parameter's."""
    with pytest.warns(UserWarning, match=r"gradient_accumulation_steps=2.*'update': 'grad'"):
        _sft(tiny_llama(tied=False), tmp_path / "inplace", steps=2, dad_head={"lr": 1e-2}, gradient_accumulation_steps=2)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        trainer = _sft(tiny_llama(tied=False), tmp_path / "grad", steps=2, dad_head={"update": "grad"},
                       gradient_accumulation_steps=2)
    head = trainer.dad_head
    w0 = head.weight.detach().clone()
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert not torch.equal(head.weight, w0)
