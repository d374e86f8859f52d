"""Llama: biases on q/k/v/o when ``attention_bias``, on the MLP when ``mlp_bias``."""

from __future__ import annotations

from typing import Any

from transformers import LlamaConfig, LlamaForCausalLM

from rlflow.families.base import LayerFeatures, ModelFamily, config_value, register_family

__all__ = ["LLAMA"]


def _features(config: Any) -> LayerFeatures:
    attention_bias = bool(config_value(config, "attention_bias", False))
    return LayerFeatures(
        qkv_bias=attention_bias, o_bias=attention_bias, mlp_bias=bool(config_value(config, "mlp_bias", False))
    )


LLAMA = register_family(
    ModelFamily(
        name="llama",
        model_types=("llama",),
        causal_lm_class=LlamaForCausalLM,
        build_config=LlamaConfig,
        features=_features,
    )
)
