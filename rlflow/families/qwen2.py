"""Qwen2: q/k/v biases always (HF hard-codes them), no o or MLP bias."""

from __future__ import annotations

from typing import Any

from transformers import Qwen2Config, Qwen2ForCausalLM

from rlflow.families.base import LayerFeatures, ModelFamily, register_family

__all__ = ["QWEN2"]


def _features(config: Any) -> LayerFeatures:
    return LayerFeatures(qkv_bias=True)


QWEN2 = register_family(
    ModelFamily(
        name="qwen2",
        model_types=("qwen2",),
        causal_lm_class=Qwen2ForCausalLM,
        build_config=Qwen2Config,
        features=_features,
    )
)
