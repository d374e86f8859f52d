"""Tiny HF models and a reference greedy decoder shared by the rollout tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rlflow.engine.packing import position_ids_from_mask

VOCAB = 100
PAD = 0


def tiny_config(arch: str = "llama"):
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=PAD,
        tie_word_embeddings=False,
    )
    return LlamaConfig(**kwargs) if arch == "llama" else Qwen2Config(**kwargs)


def tiny_model(arch: str = "llama", seed: int = 0) -> torch.nn.Module:
    """A randomly initialised 4-layer causal LM; the same seed gives the same weights."""
    torch.manual_seed(seed)
    cls = LlamaForCausalLM if arch == "llama" else Qwen2ForCausalLM
    model = cls(tiny_config(arch)).eval()
    # HF's default init (std 0.02) makes near-uniform logits; larger weights give decisive argmaxes.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    return model


def left_padded_prompts(lengths: list[int], seed: int = 0, width: int | None = None):
    """``(input_ids, attention_mask)`` of random prompts with the given lengths, left-padded."""
    gen = torch.Generator().manual_seed(seed)
    width = width or max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(1, VOCAB, (n,), generator=gen)
        mask[row, width - n :] = 1
    return ids, mask


@torch.no_grad()
def naive_greedy(model, input_ids, attention_mask, max_new_tokens: int, stop_token_ids=()) -> torch.Tensor:
    """Greedy decoding by recomputing the full forward every step (no KV cache).

    Returns ``(B, max_new_tokens)`` responses, padded with PAD after a row's stop token.
    """
    ids, mask = input_ids.clone(), attention_mask.clone()
    out = torch.full((ids.shape[0], max_new_tokens), PAD, dtype=torch.long)
    done = torch.zeros(ids.shape[0], dtype=torch.bool)
    for step in range(max_new_tokens):
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=False
        ).logits[:, -1]
        token = logits.argmax(-1)
        out[:, step] = torch.where(done, PAD, token)
        done |= torch.isin(token, torch.tensor(list(stop_token_ids), dtype=torch.long))
        if done.all():
            break
        ids = torch.cat([ids, token[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return out
