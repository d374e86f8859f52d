"""Tiny models on disk, prompt batches and setups shared by the model-worker tests (not a test module)."""

from __future__ import annotations

import os

import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from rlflow.data.tiny_models import build_tiny_model
from rlflow.data.tokenizer import build_char_tokenizer, load_tokenizer
from rlflow.engine.models import build_value_model
from rlflow.protocol import DataProto

PROMPTS = ["12+3=", "4+5=", "7*8=", "99-1="]
ANSWERS = ["15", "9", "56", "98"]


def _decisive(model: torch.nn.Module, std: float = 0.2) -> torch.nn.Module:
    """Larger weights than HF's init: decisive argmaxes, so greedy decoding has no near-ties."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, std)
    return model


def save_models(root: str) -> dict[str, str]:
    """A tiny Llama actor (with the char tokenizer) and a value-head reward model; returns their dirs."""
    tokenizer = build_char_tokenizer()
    actor_dir, reward_dir = os.path.join(root, "actor"), os.path.join(root, "reward")
    torch.manual_seed(0)
    kwargs = dict(vocab_size=len(tokenizer), hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=2)
    actor = _decisive(build_tiny_model("llama", seed=0, **kwargs))
    actor.save_pretrained(actor_dir)
    tokenizer.save_pretrained(actor_dir)
    reward = build_value_model(actor.config)
    torch.manual_seed(1)
    _decisive(reward, std=0.5).save_pretrained(reward_dir)
    return {"actor": actor_dir, "reward": reward_dir, "tokenizer": actor_dir}


def prompt_batch(tokenizer_dir: str, prompts=PROMPTS, answers=ANSWERS) -> DataProto:
    """Left-padded ``prompts`` / ``prompt_mask`` ``(B, P)`` and the ``answers`` column."""
    tokenizer = load_tokenizer(tokenizer_dir, padding_side="left")
    enc = tokenizer(list(prompts), padding=True, return_tensors="pt")
    return DataProto.from_dict(
        {"prompts": enc.input_ids, "prompt_mask": enc.attention_mask}, {"answers": list(answers)}
    )


def eos_id(tokenizer_dir: str) -> int:
    return load_tokenizer(tokenizer_dir).eos_token_id


def save_sequence_classifier(path, tokenizer) -> None:
    """A tiny one-label LlamaForSequenceClassification (TRL's reward-model kind) with a head far from
    zero (scores far from zero), and ``tokenizer``, saved in ``path``."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
