"""Llama: biases on q/k/v/o when ``attention_bias``, on the MLP when ``mlp_bias``."""

from __future__ import annotations

from typing import Any

from rlflow.families.base import LayerFeatures, ModelFamily, config_value, import_path, register_family

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
        causal_lm="transformers.LlamaForCausalLM",  # imported where a model is built
        build_config=import_path("transformers.LlamaConfig"),
        features=_features,
    )
)
