"""Model shapes: published parameter counts, HF configs, pipeline stages."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from rlflow.parallel.layout import assign_pipeline_stages, pipeline_items
from rlflow.planner.model_spec import ModelSpec, balanced_stages, model_preset


@pytest.mark.parametrize(
    "name, params",
    [
        ("llama2-7b", 6_738_415_616),  # Llama-2-7b-hf: 6.74B
        ("llama2-13b", 13_015_864_320),  # 13.02B
        ("llama2-34b", 33_743_970_304),  # CodeLlama-34b: 33.74B
        ("llama2-70b", 68_976_648_192),  # 68.98B
    ],
)
def test_presets_have_the_published_parameter_counts(name, params):
    m = model_preset(name)
    assert m.num_params == params
    assert m.item_params.sum() == params  # untied: every item counted once
    assert model_preset(name, value_head=True).head_params == m.hidden_size


TINY = dict(
    num_hidden_layers=3,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
)


@pytest.mark.parametrize(
    "config",
    [
        LlamaConfig(**TINY),
        LlamaConfig(**TINY, tie_word_embeddings=True),
        LlamaConfig(**TINY, attention_bias=True, mlp_bias=True),
        Qwen2Config(**TINY),
        Qwen3Config(**TINY, head_dim=32),
        Qwen3Config(**TINY, head_dim=16, attention_bias=True, tie_word_embeddings=True),
        MistralConfig(**TINY),
    ],
    ids=["llama", "llama-tied", "llama-bias", "qwen2", "qwen3", "qwen3-bias-tied", "mistral"],
)
def test_hf_configs_match_the_layout_items(config):
    spec = ModelSpec.from_hf_config(config)
    assert spec.item_params.tolist() == [n for _, n in pipeline_items(config)]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize(
    "cls, config_cls, extra",
    [
        (LlamaForCausalLM, LlamaConfig, dict(attention_bias=True, mlp_bias=True)),
        (Qwen2ForCausalLM, Qwen2Config, {}),
        (Qwen3ForCausalLM, Qwen3Config, dict(head_dim=24, attention_bias=True)),
        (MistralForCausalLM, MistralConfig, {}),
    ],
    ids=["llama-bias", "qwen2", "qwen3", "mistral"],
)
def test_parameter_count_equals_a_real_hf_model(cls, config_cls, extra, tied):
    config = config_cls(**TINY, **extra, tie_word_embeddings=tied)
    with torch.device("meta"):
        model = cls(config)
    distinct = {id(p): p.numel() for p in model.parameters()}
    assert ModelSpec.from_hf_config(config).num_params == sum(distinct.values())
    assert ModelSpec.from_hf_config(config.to_dict()).num_params == sum(distinct.values())
    layer = {id(p): p.numel() for p in model.model.layers[0].parameters()}
    assert ModelSpec.from_hf_config(config).layer_params == sum(layer.values())


def test_llama2_7b_two_stages_split_after_item_17_of_34():
    m = model_preset("llama2-7b")
    first, second = m.stages(2)
    assert (first, second) == (range(0, 17), range(17, 35))
    assert m.stage_layers(2).tolist() == [16, 16]
    assert m.stage_params(2).sum() == m.num_params
    assert m.stage_layers(4).sum() == 32 and m.stage_layers(1).tolist() == [32]


def test_balanced_stages_agree_with_the_engines_split():
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.choice([0, 1, 2, 3, 5, 8]) for _ in range(rng.randint(1, 14))]
        pp = rng.randint(1, len(sizes))
        assert balanced_stages(sizes, pp) == assign_pipeline_stages(sizes, pp), (sizes, pp)
    big = model_preset("llama2-70b").item_params.tolist()
    for pp in (3, 5, 7, 16, 40, 80):
        assert balanced_stages(big, pp) == assign_pipeline_stages(big, pp)
    # sizes whose squares overflow int64 take the exact Python path
    huge = [2**40 + 1, 2**40 + 3, 2**41 + 1, 7]
    assert balanced_stages(huge, 2) == assign_pipeline_stages(huge, 2)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="num_kv_heads=3 does not divide num_heads=8"):
        ModelSpec(2, 64, 128, 8, 3, 100)
    with pytest.raises(ValueError, match="unknown model preset 'gpt2'"):
        model_preset("gpt2")
    with pytest.raises(ValueError, match=r"pp=5 must be in \[1, 4\]"):
        balanced_stages([1, 1, 1, 1], 5)
    with pytest.raises(ValueError, match="lacks"):
        ModelSpec.from_hf_config({"model_type": "llama", "hidden_size": 64})
    with pytest.raises(ValueError, match="model_type='gpt2': .*keeps its decoder under 'transformer'"):
        ModelSpec.from_hf_config({"model_type": "gpt2", **TINY})
