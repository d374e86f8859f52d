"""Tiny causal LMs of every registered model family (:mod:`rlflow.families`), for tests and CPU recipes.

The models are real ``transformers`` classes with random weights, so every engine path
(HF loading, FSDP2, tensor parallel, pipelining, generation) runs on them unchanged.
A 4-layer, 128-wide Llama over the char tokenizer's 100-token vocabulary has about 0.6M parameters.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from rlflow.data.tokenizer import DEFAULT_ALPHABET, build_char_tokenizer
from rlflow.families import get_family

if TYPE_CHECKING:  # HF's modeling code is imported where a model is built (the family's class), not here
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["build_tiny_config", "build_tiny_model", "save_tiny_model_and_tokenizer"]


def build_tiny_config(
    family: str = "llama",
    vocab_size: int = 128,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 512,
    pad_token_id: int | None = 0,
    bos_token_id: int | None = 1,
    eos_token_id: int | None = 2,
    attn_implementation: str = "sdpa",
) -> PretrainedConfig:
    """The HF config of a tiny model; see :func:`build_tiny_model` for the arguments."""
    build_config = get_family(family).build_config
    if hidden_size % num_heads != 0:
        raise ValueError(f"num_heads={num_heads} does not divide hidden_size={hidden_size}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_kv_heads={num_kv_heads} does not divide num_heads={num_heads}")
    config = build_config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=2 * hidden_size if intermediate_size is None else intermediate_size,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )
    config._attn_implementation = attn_implementation  # "sdpa" and "eager" both run on CPU
    return config


def build_tiny_model(
    family: str = "llama",
    vocab_size: int = 128,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 512,
    seed: int = 0,
    pad_token_id: int | None = 0,
    bos_token_id: int | None = 1,
    eos_token_id: int | None = 2,
    attn_implementation: str = "sdpa",
    dtype: torch.dtype = torch.float32,
    config_fields: Mapping[str, Any] | None = None,
) -> PreTrainedModel:
    """A randomly initialised causal LM of a registered model family (``LlamaForCausalLM`` …).

    Args:
        family: a name of :func:`rlflow.families.list_families` (``"llama"``, ``"qwen2"`` …).
        vocab_size: embedding rows; ``len(tokenizer)`` for the char tokenizer.
        hidden_size: model width.
        num_layers: decoder layers.
        num_heads: attention heads.
        num_kv_heads: key/value heads (grouped-query attention when < ``num_heads``).
        intermediate_size: MLP width; default ``2 * hidden_size``.
        tie_word_embeddings: share the embedding and LM-head weights.
        max_position_embeddings: longest sequence.
        seed: initialisation seed; the global torch RNG is left untouched.
        pad_token_id: written into the config (the char tokenizer's ids are the defaults).
        bos_token_id: as above.
        eos_token_id: as above.
        attn_implementation: ``"sdpa"`` or ``"eager"``.
        dtype: parameter dtype.
        config_fields: further fields set on the HF config (a mixture-of-experts model's
            ``num_experts``, ``moe_intermediate_size`` …).

    Returns:
        The model, in train mode, on CPU.

    >>> model = build_tiny_model(vocab_size=100)
    >>> type(model).__name__, sum(p.numel() for p in model.parameters())
    ('LlamaForCausalLM', 616576)
    """
    config = build_tiny_config(
        family, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
        tie_word_embeddings, max_position_embeddings, pad_token_id, bos_token_id, eos_token_id,
        attn_implementation,
    )  # fmt: skip
    for key, value in (config_fields or {}).items():
        setattr(config, key, value)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_family(family).causal_lm_class(config)
    return model.to(dtype)


def save_tiny_model_and_tokenizer(
    path: str | os.PathLike,
    family: str = "llama",
    alphabet: str = DEFAULT_ALPHABET,
    tokenizer: PreTrainedTokenizerBase | None = None,
    **model_kwargs,
) -> str:
    """Write a tiny model and its tokenizer to ``path`` (safetensors + tokenizer.json).

    The directory loads with ``AutoModelForCausalLM.from_pretrained(path)`` and
    ``AutoTokenizer.from_pretrained(path)``, like a model from the hub.

    Args:
        path: output directory (created).
        family: a registered model family's name.
        alphabet: characters of the char tokenizer built when ``tokenizer`` is None.
        tokenizer: use this tokenizer instead; its special-token ids go into the config.
        **model_kwargs: passed to :func:`build_tiny_model` (``vocab_size`` is taken from
            the tokenizer).

    Returns:
        ``path`` as a string.
    """
    if "vocab_size" in model_kwargs:
        raise ValueError("vocab_size comes from the tokenizer; do not pass it")
    tokenizer = build_char_tokenizer(alphabet) if tokenizer is None else tokenizer
    model = build_tiny_model(
        family,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **model_kwargs,
    )
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return str(path)
