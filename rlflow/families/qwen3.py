"""Qwen3: per-head RMSNorm on q and k, biases on q/k/v/o only when ``attention_bias``, and an
explicit ``head_dim`` (128 by default in HF, whatever the width)."""

from __future__ import annotations

from typing import Any

from rlflow.families.base import DECODER_LAYER_TP, LayerFeatures, ModelFamily, config_value, register_family

__all__ = ["QWEN3"]


def _features(config: Any) -> LayerFeatures:
    attention_bias = bool(config_value(config, "attention_bias", False))
    return LayerFeatures(qkv_bias=attention_bias, o_bias=attention_bias, qk_norm=True)


def _build_config(**kwargs: Any) -> Any:
    """A Qwen3 config whose ``head_dim`` is ``hidden_size // num_attention_heads`` unless given
    (HF's default of 128 would make a tiny model's attention wider than the model)."""
    from transformers import Qwen3Config  # here, not at import: see import_path

    kwargs.setdefault("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
    return Qwen3Config(**kwargs)


QWEN3 = register_family(
    ModelFamily(
        name="qwen3",
        model_types=("qwen3",),
        causal_lm="transformers.Qwen3ForCausalLM",  # imported where a model is built
        build_config=_build_config,
        features=_features,
        # q_norm/k_norm act on one head at a time: every tp rank keeps the full (head_dim,) weight.
        layer_tp={**DECODER_LAYER_TP, "self_attn.q_norm": "replicate", "self_attn.k_norm": "replicate"},
        vllm_o_bias=False,  # vllm/model_executor/models/qwen3.py: o_proj has no bias
    )
)
