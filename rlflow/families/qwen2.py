"""Qwen2: q/k/v biases always (HF hard-codes them), no o or MLP bias."""

from __future__ import annotations

from typing import Any

from rlflow.families.base import LayerFeatures, ModelFamily, import_path, register_family

__all__ = ["QWEN2"]


def _features(config: Any) -> LayerFeatures:
    return LayerFeatures(qkv_bias=True)


QWEN2 = register_family(
    ModelFamily(
        name="qwen2",
        model_types=("qwen2",),
        causal_lm="transformers.Qwen2ForCausalLM",  # imported where a model is built
        build_config=import_path("transformers.Qwen2Config"),
        features=_features,
    )
)
