"""HF causal LMs without a hand-written record, through the generic family: parameters read from the HF
model, a decoder stage's forward equal to HF's, the built-in sampler's greedy output equal to HF
``generate``, and what cannot be run (or split) refused with the reason."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from rlflow.engine.loading import build_meta_model, init_buffers
from rlflow.engine.pipeline import build_stage, stage_forward_mismatch
from rlflow.engine.rollout import HFRolloutEngine, SamplingParams
from rlflow.families import family_of, get_family, list_families
from rlflow.families.generic import GenericFamily
from rlflow.parallel.layout import model_param_specs, pipeline_stages
from rlflow.planner.model_spec import ModelSpec

VOCAB, PAD = 96, 0
# Model types transformers ships whose forward a decoder stage computes (a sliding window shorter
# than the rows where the type has one, so a wrong mask would change the logits).
RUN = ["gemma", "phi3", "olmo2", "glm4", "smollm3", "qwen3_moe", "mixtral", "stablelm", "starcoder2", "exaone4"]
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
    sliding_window=3,
)  # fmt: skip


def tiny(model_type: str, seed: int = 0, **extra):
    family = family_of({"model_type": model_type})
    config = family.build_config(**{**SHAPE, **extra})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return family.causal_lm_class(config).eval()


def left_padded(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen, width = torch.Generator().manual_seed(seed), max(lengths)
    ids, mask = torch.full((len(lengths), width), PAD), torch.zeros((len(lengths), width), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(3, VOCAB, (n,), generator=gen)
        mask[row, width - n :] = 1
    return ids, mask


@pytest.mark.parametrize("model_type", RUN)
def test_the_generic_familys_parameters_are_the_hf_models(model_type):
    model = tiny(model_type)
    family = family_of(model.config)
    assert isinstance(family, GenericFamily) and family.name == model_type and model_type not in list_families()
    assert get_family(model_type) is family  # a worker finds the record by name (pickling)
    items = family.item_param_shapes(model.config)
    assert [i for i, _ in items] == ["embed", "layer.0", "layer.1", "norm", "head"]
    flat = {name: shape for _, shapes in items for name, shape in shapes.items()}
    assert flat == {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert family.item_param_shapes(model.config.to_dict()) == items  # a config.json dict reads the same


@pytest.mark.parametrize("model_type", RUN)
def test_a_stage_computes_the_hf_forward_and_the_sampler_hf_generate(model_type):
    model = tiny(model_type, seed=1)
    ids, mask = left_padded([5, 3, 6], seed=1)
    positions = ((mask.cumsum(1) - 1) * mask).clamp(min=0)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        got = build_stage(model, 1, 0)(ids, attention_mask=mask, position_ids=positions)
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=1e-5)
    assert stage_forward_mismatch(model.config, type(model)) is None

    out = HFRolloutEngine(model).generate((ids, mask), SamplingParams(greedy=True, max_new_tokens=6, n=1))
    generated = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=6, eos_token_id=None, pad_token_id=PAD
    )
    assert torch.equal(out["responses"], generated[:, ids.shape[1] :])


@pytest.mark.parametrize(
    ("model_type", "extra", "reason"),
    [
        ("gemma2", {}, "computes other logits"),  # soft-capped logits
        ("cohere", {}, "computes other logits"),  # logit_scale
        ("granite", {"logits_scaling": 8.0, "embedding_multiplier": 12.0}, "computes other logits"),
        ("gemma3_text", {}, "cannot run it .*layer_type"),  # a rotary table per attention kind
    ],
)
def test_a_model_whose_forward_a_stage_does_not_compute_is_named(model_type, extra, reason):
    config = family_of({"model_type": model_type}).build_config(**{**SHAPE, **extra})
    assert re.search(reason, stage_forward_mismatch(config, family_of(config).causal_lm_class) or "")
    granite_defaults = family_of({"model_type": "granite"}).build_config(**SHAPE)  # multipliers of 1: a plain decoder
    assert stage_forward_mismatch(granite_defaults, family_of(granite_defaults).causal_lm_class) is None


def test_a_model_type_of_another_module_tree_or_none_is_refused():
    with pytest.raises(ValueError, match="'phi': its base_model_pp_plan holds .*final_layernorm"):
        family_of({"model_type": "phi"})
    with pytest.raises(ValueError, match="'no_such_type' belongs to no registered model family"):
        family_of({"model_type": "no_such_type"})


def test_the_generic_family_splits_where_the_configs_plans_allow():
    config = tiny("olmo2").config
    with pytest.raises(ValueError, match="tp=2: model_type='olmo2' .*'colwise_gather_output'.* use tp=1"):
        model_param_specs(config, tp=2)  # its plan gathers q/k/v outputs for the q/k norms over whole projections
    gemma = {s.name: s.tp_dim for s in model_param_specs(tiny("gemma").config, tp=2)}
    assert gemma["model.layers.0.self_attn.k_proj.weight"] == 0 and gemma["model.layers.0.mlp.down_proj.weight"] == 1
    assert gemma["model.layers.0.input_layernorm.weight"] is None  # a norm outside the plan: replicated
    assert len(model_param_specs(config)) == sum(1 for _ in tiny("olmo2").parameters())
    assert pipeline_stages(config, 2) == [["embed", "layer.0"], ["layer.1", "norm", "head"]]
    stablelm = tiny("stablelm").config  # it declares no base_model_pp_plan
    with pytest.raises(ValueError, match="pp=2: model_type='stablelm' declares no base_model_pp_plan"):
        pipeline_stages(stablelm, 2)
    spec, plain = ModelSpec.from_hf_config(config), ModelSpec.from_hf_config(get_family("llama").build_config(**SHAPE))
    assert "use tp=1" in spec.tp_blocker and spec.pp_blocker is None
    assert ModelSpec.from_hf_config(tiny("starcoder2").config).tp_blocker is None  # Megatron's plan
    assert "use pp=1" in ModelSpec.from_hf_config(stablelm).pp_blocker
    assert plain.tp_blocker is None and plain.pp_blocker is None


@pytest.mark.parametrize("model_type", ["qwen3_moe", "phi3", *list_families()])
def test_the_planner_counts_the_parameters_the_model_holds(model_type):
    model = tiny(model_type)
    spec = ModelSpec.from_hf_config(model.config)
    assert spec.num_params == sum(p.numel() for p in model.parameters())  # experts and fused projections too
    assert spec.item_tensors[1] == sum(1 for n, _ in model.named_parameters() if n.startswith("model.layers.0."))
    if model_type in list_families():  # a hand-written record: the count its dimensions give, unchanged
        formula = dataclasses.replace(spec, layer_param_count=None, layer_tensor_count=None)
        assert (formula.layer_params, list(formula.item_tensors)) == (spec.layer_params, list(spec.item_tensors))


def test_a_meta_built_generic_model_recomputes_its_scaled_embedding_buffer():
    # A worker builds its shard on the meta device and loads the weights; Gemma's embedding keeps
    # its scale (sqrt(hidden_size)) as a non-persistent buffer, which loading must refill.
    config = tiny("gemma").config
    model = build_meta_model(config, "lm").to_empty(device="cpu")
    init_buffers(model)
    assert model.model.embed_tokens.embed_scale.item() == pytest.approx(SHAPE["hidden_size"] ** 0.5)
    fresh = tiny("gemma")
    assert torch.equal(model.model.rotary_emb.inv_freq, fresh.model.rotary_emb.inv_freq)
