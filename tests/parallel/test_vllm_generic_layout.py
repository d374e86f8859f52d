"""vLLM's layout of generic-family models (no hand-written record), read from vLLM's packed modules.

No vLLM here: :func:`~rlflow.parallel.vllm_layout.vllm_packed_modules` is replaced by the
``packed_modules_mapping`` of vLLM 0.32's model classes, copied below, and a stand-in holds plain
tensors cut and fused as vLLM's loaders cut and fuse a full HF state dict (q, k, v of the rank
stacked; gate then up; o/down columns; the vocabulary padded to 64 rows; HF's own packed tensors
kept whole). ``tests/vllm_rollouts/test_generic_families.py`` checks the same on real vLLM.
"""

from __future__ import annotations

import pytest
import torch

from rlflow.families import family_of
from rlflow.parallel import vllm_layout
from rlflow.parallel.layout import build_layout
from rlflow.parallel.vllm_layout import vllm_fusion, vllm_fusion_from_packed, vllm_param_specs, vllm_param_views
from rlflow.strategy import ParallelStrategy

QKV_GATE_UP = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# vllm/model_executor/models/{gemma2,phi3,glm4,qwen3_moe}.py of vLLM 0.32.
PACKED = {
    "Gemma2ForCausalLM": QKV_GATE_UP,
    "Glm4ForCausalLM": QKV_GATE_UP,
    "Phi3ForCausalLM": {"qkv_proj": ("qkv_proj",), "gate_up_proj": ("gate_up_proj",)},
    "Qwen3MoeForCausalLM": {"qkv_proj": ("q_proj", "k_proj", "v_proj")},
}
SHAPE = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


@pytest.fixture(autouse=True)
def vllm_registry(monkeypatch):
    monkeypatch.setattr(vllm_layout, "vllm_packed_modules", lambda architecture: PACKED[architecture])


def tiny(model_type: str, **extra):
    family = family_of({"model_type": model_type})
    torch.manual_seed(0)
    return family.causal_lm_class(family.build_config(**{**SHAPE, **extra})).eval()


def vllm_rank(model, tp: int, r: int) -> dict[str, torch.Tensor]:
    """vLLM's tensors of tp rank ``r`` by vLLM name, cut from the full HF tensors (kv heads divide tp)."""
    out = {}
    for name, full in model.state_dict().items():
        module, leaf = name.rpartition(".")[0], name.rpartition(".")[2]
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            shard = torch.zeros(-(-full.shape[0] // 64) * 64 // tp, full.shape[1])
            rows = full[r * shard.shape[0] : (r + 1) * shard.shape[0]]
            out[name] = shard.index_copy(0, torch.arange(rows.shape[0]), rows)
        elif module.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            fused = module.rpartition(".")[0] + (".qkv_proj." if "_attn" in module else ".gate_up_proj.") + leaf
            out[fused] = torch.cat([out.get(fused, full[:0]), full.chunk(tp)[r]])  # q, k, v (gate, up) in order
        elif module.endswith(("o_proj", "down_proj")) and leaf == "weight":
            out[name] = full.chunk(tp, dim=1)[r]
        else:
            out[name] = full  # norms; HF's own packed tensors at tp = 1
    return out


@pytest.mark.parametrize(
    "model_type,fused,prepacked",
    [
        (
            "gemma2",
            {
                "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
            },
            (),
        ),  # fmt: skip
        ("phi3", {}, ("self_attn.qkv_proj", "mlp.gate_up_proj")),  # HF packs them as vLLM does
        (
            "glm4",
            {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")},
            ("mlp.gate_up_proj",),
        ),  # fmt: skip
    ],
)
def test_the_fusion_is_read_from_vllms_model_class(model_type, fused, prepacked):
    fusion = vllm_fusion(tiny(model_type).config)
    assert dict(fusion.fused) == fused and fusion.prepacked == prepacked
    assert vllm_fusion(tiny("llama").config).fused == family_of({"model_type": "llama"}).vllm_fused  # a record's own


@pytest.mark.parametrize("model_type,tp", [("gemma2", 1), ("gemma2", 2), ("phi3", 1), ("glm4", 1)])
def test_views_hold_the_layout_slices_of_vllms_tensors(model_type, tp):
    model = tiny(model_type)
    full = model.state_dict()
    layout = build_layout(model.config, ParallelStrategy(tp=tp), range(tp), style="vllm")
    for r in range(tp):
        tensors = vllm_rank(model, tp, r)
        views = vllm_param_views(model.config, tp, r, tensors)
        slices = layout.slices(layout.ranks[r])
        assert set(views) == set(slices) == {n for n, _ in model.named_parameters()}
        for name, ts in views.items():
            assert len(ts) == 1 and torch.equal(ts[0], full[name][slices[name]]), name
    fused = vllm_fusion(model.config).fused
    if "self_attn.qkv_proj" in fused:  # views into the fused tensor, not copies
        qkv = tensors["model.layers.1.self_attn.qkv_proj.weight"]
        assert views["model.layers.1.self_attn.k_proj.weight"][0].data_ptr() > qkv.data_ptr()
        assert views["model.layers.1.self_attn.q_proj.weight"][0].data_ptr() == qkv.data_ptr()


def test_a_layout_rlflow_does_not_map_is_refused_naming_the_model_type(monkeypatch):
    moe = tiny("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16).config
    with pytest.raises(ValueError, match=r"model_type='qwen3_moe'.*3-D tensors \['mlp.experts.down_proj'.*w13_weight"):
        vllm_param_specs(moe, 1)
    gemma = tiny("gemma2").config
    with pytest.raises(ValueError, match=r"model_type='gemma2'.*packs \['gate_proj', 'up_proj', 'w3'\] into gate_up"):
        vllm_fusion_from_packed(gemma, {"gate_up_proj": ("gate_proj", "up_proj", "w3")})
    with pytest.raises(ValueError, match="tp=2: model_type='phi3' .*base_model_tp_plan.*use tp=1"):
        vllm_param_specs(tiny("phi3").config, 2)  # its tp_blocker
    monkeypatch.setitem(PACKED, "Gemma2ForCausalLM", {**QKV_GATE_UP, "o_proj": ("o_proj",)})
    with pytest.raises(ValueError, match=r"tp=2: model_type='gemma2' holds \['self_attn.o_proj'\] packed in one"):
        vllm_param_specs(gemma, 2)
    assert len(vllm_param_specs(gemma, 1)) == sum(1 for _ in tiny("gemma2").parameters())

    def no_class(architecture):
        raise ValueError(f"vLLM has no model class for {architecture}")

    monkeypatch.setattr(vllm_layout, "vllm_packed_modules", no_class)
    with pytest.raises(ValueError, match="vLLM cannot run model_type='glm4' .*no model class for Glm4ForCausalLM"):
        vllm_fusion(tiny("glm4").config)


def test_views_name_the_model_type_where_vllms_parameters_differ():
    model = tiny("glm4")
    tensors = vllm_rank(model, 1, 0)
    renamed = {
        n.replace("post_mlp_layernorm", "post_ffn_norm"): t for n, t in tensors.items()
    }  # a norm named otherwise
    with pytest.raises(ValueError, match="vLLM's model of model_type='glm4' has no parameter .*post_mlp_layernorm"):
        vllm_param_views(model.config, 1, 0, renamed)
    biased = {**tensors, "model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}
    with pytest.raises(ValueError, match="model_type='glm4' that no HF parameter maps to .*o_proj.bias"):
        vllm_param_views(model.config, 1, 0, biased)
