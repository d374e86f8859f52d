"""Tiny HF models: real classes of every family, seeded, saved and loaded like hub models, trainable."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

from rlflow.algos import sft_loss
from rlflow.data import (
    ArithmeticTask,
    SFTDataset,
    StatefulDataLoader,
    build_char_tokenizer,
    build_tiny_model,
    save_tiny_model_and_tokenizer,
)
from rlflow.families import get_family, list_families

FAMILY_CLASSES = [
    ("llama", LlamaForCausalLM),
    ("qwen2", Qwen2ForCausalLM),
    ("qwen3", Qwen3ForCausalLM),
    ("mistral", MistralForCausalLM),
]


def test_every_registered_family_has_a_tiny_model():
    assert {name for name, _ in FAMILY_CLASSES} <= set(list_families())
    for name in list_families():
        model = build_tiny_model(name, vocab_size=64, hidden_size=64, num_layers=2, num_heads=4)
        assert type(model) is get_family(name).causal_lm_class
        assert get_family(name).dims(model.config).head_dim == 16  # hidden / heads, whatever the family's default


@pytest.mark.parametrize("family, cls", FAMILY_CLASSES)
def test_build_tiny_model_families(family, cls):
    tied = family != "llama"
    model = build_tiny_model(family, vocab_size=104, num_kv_heads=2, tie_word_embeddings=tied)
    assert type(model) is cls
    assert model.config.num_key_value_heads == 2 and model.config.intermediate_size == 256
    assert model.config.tie_word_embeddings == tied
    assert sum(p.numel() for p in model.parameters()) < 1_000_000
    logits = model(torch.randint(0, 104, (2, 7))).logits
    assert logits.shape == (2, 7, 104)


def test_seed_fixes_weights_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_tiny_model(vocab_size=32, num_layers=1, seed=7)
    assert torch.equal(torch.rand(1), before)  # global RNG not advanced by the build
    b = build_tiny_model(vocab_size=32, num_layers=1, seed=7)
    c = build_tiny_model(vocab_size=32, num_layers=1, seed=8)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="model_type='gpt2': .*rlflow's decoder cannot run it"):
        build_tiny_model("gpt2")
    with pytest.raises(ValueError, match="num_kv_heads=3 does not divide num_heads=4"):
        build_tiny_model(num_kv_heads=3)


def test_saved_directory_loads_with_auto_classes_and_generates(tmp_path):
    path = save_tiny_model_and_tokenizer(tmp_path / "tiny", family="qwen2", num_layers=2, seed=3)
    assert (tmp_path / "tiny" / "model.safetensors").exists()
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    reference = build_tiny_model("qwen2", vocab_size=len(tok), num_layers=2, seed=3).eval()
    batch = tok(["1+1=", "12+34="], padding=True, return_tensors="pt")
    with torch.no_grad():
        torch.testing.assert_close(
            model(**batch).logits, reference(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        )
        out = model.generate(**batch, max_new_tokens=4, do_sample=False)
    assert out.shape == (2, batch.input_ids.shape[1] + 4)


def test_sft_on_arithmetic_lowers_the_loss():
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    records = [e.to_dict() for e in ArithmeticTask(reverse_answer=True).sample("train", 256, seed=0)]
    loader = StatefulDataLoader(SFTDataset(records, tok, max_length=16), batch_size=32, seed=0)
    model = build_tiny_model(vocab_size=len(tok), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(3):
        for batch in loader:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            loss = sft_loss(logits[:, :-1], batch["input_ids"][:, 1:], batch["loss_mask"][:, 1:])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    # ~log(100) = 4.6 at start; 24 steps learn at least the answer format (digits, then EOS).
    assert losses[0] > 4.0 and sum(losses[-4:]) / 4 < 2.5
