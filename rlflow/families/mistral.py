"""Mistral: Llama's layers without biases, every layer attending within ``sliding_window`` tokens
(when the config sets one; HF's default is 4096)."""

from __future__ import annotations

from typing import Any

from rlflow.families.base import LayerFeatures, ModelFamily, config_value, import_path, register_family

__all__ = ["MISTRAL"]


def _features(config: Any) -> LayerFeatures:
    return LayerFeatures()  # HF's Mistral has no bias on any projection


def _layer_types(config: Any) -> tuple[str, ...]:
    # MistralModel picks one mask for all layers: sliding when the config has a window.
    kind = "full_attention" if config_value(config, "sliding_window") is None else "sliding_attention"
    return (kind,) * config_value(config, "num_hidden_layers")


MISTRAL = register_family(
    ModelFamily(
        name="mistral",
        model_types=("mistral",),
        causal_lm="transformers.MistralForCausalLM",  # imported where a model is built
        build_config=import_path("transformers.MistralConfig"),
        features=_features,
        layer_types=_layer_types,
    )
)
