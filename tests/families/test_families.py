"""Model families: the registry, and every family's record against a real tiny HF model of it."""

from __future__ import annotations

import copy
import json
import pickle
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForTokenClassification, LlamaForCausalLM

from rlflow.families import LayerFeatures, ModelFamily, family_of, get_family, list_families, register_family
from rlflow.families import base as families_base

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
# Keyword sets every family's config takes; a family ignores the biases its HF model does not have.
VARIANTS = {
    "plain": {},
    "tied": dict(tie_word_embeddings=True),
    "biases": dict(attention_bias=True, mlp_bias=True),
}


def _config(family: ModelFamily, variant: str, **extra):
    return family.build_config(**TINY, **VARIANTS[variant], **extra)


def _hf_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _record_shapes(family: ModelFamily, config, head: str) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for _, item in family.item_param_shapes(config, head):
        shapes.update(item)
    return shapes


# ---- registry ----


def test_the_families_are_registered_under_their_model_types():
    assert {"llama", "qwen2", "qwen3", "mistral"} <= set(list_families())
    for name in list_families():
        family = get_family(name)
        for model_type in family.model_types:
            assert family_of({"model_type": model_type}) is family
            assert family_of(family.build_config(**TINY)) is family


def test_unknown_names_and_model_types_are_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown model family 'no_such'; expected one of \[.*'llama'"):
        get_family("no_such")
    with pytest.raises(
        ValueError, match=r"model_type='no_such' belongs to no registered model family .*qwen3 \['qwen3'\]"
    ):
        family_of({"model_type": "no_such"})
    # A causal LM transformers ships, but of another module tree than the decoder's (the generic family's).
    with pytest.raises(ValueError, match=r"model_type='gpt2': .*GPT2LMHeadModel keeps its decoder under 'transformer'"):
        family_of({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="model_type=None"):
        family_of(type("Config", (), {})())


def test_register_refuses_a_taken_name_or_model_type(monkeypatch):
    monkeypatch.setattr(families_base, "_REGISTRY", dict(families_base._REGISTRY))
    llama = get_family("llama")

    def variant(name: str, model_types: tuple[str, ...]) -> ModelFamily:
        return ModelFamily(
            name=name,
            model_types=model_types,
            causal_lm=llama.causal_lm,
            build_config=llama.build_config,
            features=llama.features,
        )

    with pytest.raises(ValueError, match="model family 'llama' is already registered"):
        register_family(variant("llama", ("llama_v2",)))
    with pytest.raises(ValueError, match=r"model_type \['llama'\] of family 'llama2' already belongs to 'llama'"):
        register_family(variant("llama2", ("llama2", "llama")))
    added = register_family(variant("llama_fork", ("llama_fork",)))
    assert get_family("llama_fork") is added and family_of({"model_type": "llama_fork"}) is added
    assert "llama_fork" in list_families()


def test_a_record_whose_tables_disagree_is_refused():
    llama = get_family("llama")
    common = dict(causal_lm=llama.causal_lm, build_config=llama.build_config, features=llama.features)
    with pytest.raises(ValueError, match="'self_attn.kv_proj' is not a module of layer_tp"):
        ModelFamily(name="x", model_types=("x",), kv_modules=("self_attn.kv_proj",), **common)
    with pytest.raises(ValueError, match="kv module 'self_attn.o_proj' must be 'colwise'"):
        ModelFamily(name="x", model_types=("x",), kv_modules=("self_attn.o_proj",), **common)
    with pytest.raises(ValueError, match="has no model_types"):
        ModelFamily(name="x", model_types=(), **common)


def test_a_family_imports_its_hf_classes_on_first_use_only():
    # In a fresh process: reading the records (what the driver's config and planner do) imports
    # none of HF's modeling code; building one family's model imports that family's module alone.
    script = f"""
import json, sys
from rlflow.families import get_family
before = "transformers.modeling_utils" in sys.modules
llama = get_family("llama")
llama.dims({{"model_type": "llama", **{TINY!r}}})
cls, config = llama.causal_lm_class, llama.build_config(**{TINY!r})
modeling = sorted(m for m in sys.modules if ".modeling_" in m and m.split(".")[:2] == ["transformers", "models"])
modeling = [m for m in modeling if not m.startswith("transformers.models.auto.")]
print(json.dumps([before, cls.__name__, type(config).__name__, modeling]))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    before, cls, config, modeling = json.loads(out.stdout.strip().splitlines()[-1])
    assert not before, "importing rlflow.families imported transformers.modeling_utils"
    assert (cls, config) == ("LlamaForCausalLM", "LlamaConfig")
    assert modeling == ["transformers.models.llama.modeling_llama"]


def test_a_family_takes_its_class_or_an_import_path():
    llama = get_family("llama")
    assert llama.causal_lm == "transformers.LlamaForCausalLM"
    assert llama.causal_lm_class is LlamaForCausalLM
    given = ModelFamily(
        name="x", model_types=("x",), causal_lm=LlamaForCausalLM, build_config=dict, features=llama.features
    )
    assert given.causal_lm_class is LlamaForCausalLM
    with pytest.raises(ValueError, match="causal_lm='LlamaForCausalLM' is not a 'module.Class' import path"):
        ModelFamily(
            name="x", model_types=("x",), causal_lm="LlamaForCausalLM", build_config=dict, features=llama.features
        )


def test_a_family_pickles_to_the_registered_record():
    family = get_family("qwen3")
    assert pickle.loads(pickle.dumps(family)) is family
    assert copy.deepcopy(family) is family


# ---- every family against its real HF model ----


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("name", list_families())
def test_parameter_names_and_shapes_equal_the_hf_model(name, variant):
    family = get_family(name)
    config = _config(family, variant)
    with torch.device("meta"):
        model = family.causal_lm_class(config)
    assert list(_record_shapes(family, config, "lm").items()) == list(_hf_shapes(model).items())
    value_config = _config(family, variant, num_labels=1)
    with torch.device("meta"):
        critic = AutoModelForTokenClassification.from_config(value_config)
    assert _record_shapes(family, value_config, "value") == _hf_shapes(critic)


@pytest.mark.parametrize("name", list_families())
def test_dims_and_features_read_the_config_object_and_its_dict(name):
    family = get_family(name)
    config = _config(family, "biases")
    dims = family.dims(config)
    assert (dims.num_layers, dims.hidden_size, dims.num_heads, dims.num_kv_heads, dims.head_dim) == (2, 64, 4, 2, 16)
    assert family.dims(config.to_dict()) == dims
    assert family.features(config.to_dict()) == family.features(config)
    with pytest.raises(ValueError, match=r"lacks \['num_hidden_layers'"):
        family.dims({"model_type": family.model_types[0], "hidden_size": 64})


@pytest.mark.parametrize("variant", ["plain", "biases"])
@pytest.mark.parametrize("name", list_families())
def test_tp_split_covers_every_parameter_and_names_real_modules(name, variant):
    family = get_family(name)
    config = _config(family, variant, num_labels=1)
    with torch.device("meta"):
        models = [family.causal_lm_class(config), AutoModelForTokenClassification.from_config(config)]
    for model in models:
        modules = dict(model.named_modules())
        for pname, _ in model.named_parameters():
            module = pname.rpartition(".")[0]
            kind = family.tp_kind(module)
            if family.is_kv_module(module):
                assert kind == "colwise", pname
        layer = f"{family.layers_module}.0"
        assert all(f"{layer}.{inner}" in modules for inner in family.layer_tp), "layer_tp names a missing module"
        for fused, parts in family.vllm_fused.items():
            assert all(f"{layer}.{p}" in modules for p in parts), fused
    with pytest.raises(
        ValueError, match=f"family '{name}' has no tensor-parallel split for module 'model.layers.0.mlp'"
    ):
        family.tp_kind("model.layers.0.mlp")


@pytest.mark.parametrize("name", list_families())
def test_layer_types_name_one_attention_kind_per_layer(name):
    family = get_family(name)
    layer_types = family.layer_types(_config(family, "plain"))
    assert len(layer_types) == TINY["num_hidden_layers"]
    assert set(layer_types) <= {"full_attention", "sliding_attention"}


def test_sliding_windows_follow_each_familys_rule():
    # Whether a stage's masks then equal HF's own forward: tests/families/test_pipeline_families.py.
    mistral, qwen2 = get_family("mistral"), get_family("qwen2")
    assert mistral.layer_types(mistral.build_config(**TINY)) == ("sliding_attention",) * 2  # HF's default window
    assert mistral.layer_types(mistral.build_config(**TINY, sliding_window=None)) == ("full_attention",) * 2
    qwen2_config = qwen2.build_config(**TINY, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert qwen2.layer_types(qwen2_config) == ("full_attention", "sliding_attention")
    assert get_family("llama").layer_types(get_family("llama").build_config(**TINY)) == ("full_attention",) * 2


def test_features_follow_the_family():
    config = dict(TINY, attention_bias=True, mlp_bias=True)
    assert get_family("llama").features(dict(config, model_type="llama")) == LayerFeatures(True, True, True, False)
    assert get_family("qwen2").features(dict(config, model_type="qwen2")) == LayerFeatures(qkv_bias=True)
    assert get_family("qwen3").features(config) == LayerFeatures(True, True, False, True)
    assert get_family("qwen3").build_config(**TINY).head_dim == 16  # not HF's default of 128
