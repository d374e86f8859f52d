"""Memory formulas against hand-computed numbers, in the dtypes rlflow's engines use."""

from __future__ import annotations

import dataclasses

import pytest

from rlflow.planner import memory
from rlflow.planner.cluster import CPU_PRECISION, GPU_PRECISION, Precision
from rlflow.planner.model_spec import ModelSpec, model_preset
from rlflow.strategy import ParallelStrategy

S = ParallelStrategy
P7B = 6_738_415_616


def test_llama2_7b_training_state_under_fsdp_over_8():
    m = model_preset("llama2-7b")
    # fp32 master shards, fp32 gradient shards, two fp32 Adam moments: 16 bytes per parameter / 8 ranks
    weights = memory.weight_bytes(m, S(dp=8), GPU_PRECISION)
    state = memory.train_state_bytes(m, S(dp=8), GPU_PRECISION)
    assert weights == 4 * P7B / 8 == 3_369_207_808
    assert state == 12 * P7B / 8 == 10_107_623_424
    assert weights + state == 16 * P7B / 8
    # tp splits the same way; a forward call's FSDP copy holds master shards too
    assert memory.train_state_bytes(m, S(dp=2, tp=4), GPU_PRECISION) == state
    assert memory.weight_bytes(m, S(dp=2, tp=4), GPU_PRECISION) == weights


def test_fp32_cpu_workers_hold_four_bytes_times_one_plus_grads_plus_two_moments():
    tiny = ModelSpec(num_layers=4, hidden_size=128, intermediate_size=512, num_heads=4, num_kv_heads=4, vocab_size=100)
    p = tiny.num_params  # 4 * (4*128^2 + 3*128*512 + 2*128) + 100*128 + 128 + 100*128 (untied head)
    assert p == 4 * 262_400 + 12_800 + 128 + 12_800
    total = memory.weight_bytes(tiny, S(dp=2), CPU_PRECISION) + memory.train_state_bytes(tiny, S(dp=2), CPU_PRECISION)
    assert total == 4 * p * (1 + 1 + 2) / 2
    # the rollout copy (HF sampler) is the fp32 copy, replicated over dp and split by tp
    assert memory.weight_bytes(tiny, S(dp=2, tp=2), CPU_PRECISION, generate=True) == 4 * p / 2
    # GPU presets price vLLM's bf16 generation; the HF sampler runs the fp32 copy (the default of Precision)
    assert memory.weight_bytes(tiny, S(), GPU_PRECISION, generate=True) == 2 * p
    assert memory.weight_bytes(tiny, S(), Precision(compute_bytes=2), generate=True) == 4 * p


def test_pipeline_stages_hold_their_share():
    m = model_preset("llama2-70b")
    largest = int(m.stage_params(2).max())
    assert largest < m.num_params * 0.51
    assert memory.weight_bytes(m, S(tp=8, pp=2), GPU_PRECISION, generate=True) == largest * 2 / 8


def test_kv_cache_by_hand():
    m = model_preset("llama2-7b")
    # K and V: 2 * seqs * tokens * layers * hidden * bytes
    assert memory.kv_cache_bytes(m, S(), 64, 256, 2) == 2 * 64 * 256 * 32 * 4096 * 2 == 8_589_934_592
    assert memory.kv_cache_bytes(m, S(tp=4, pp=2), 64, 256, 4) == 2 * 8_589_934_592 / 8
    gqa = model_preset("llama2-70b")  # 8 kv heads of 128: kv_size 1024
    assert memory.kv_cache_bytes(gqa, S(), 1, 100, 2) == 2 * 100 * 80 * 1024 * 2


TINY = ModelSpec(
    num_layers=4, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=2, vocab_size=10, value_head=True
)


def test_activation_formulas_by_hand():
    # saved per token and layer: 4 bytes * (4h + (q + 2kv + q + 3I)/tp) = 4 * (32 + (8+16+8+48)) = 448
    assert memory.saved_bytes_per_token(TINY, 1, 4) == 448
    tokens = 3 * 5
    # value head: 1 output in the compute dtype, plus the fp32 working tensors
    logits = memory.logits_bytes(TINY, 1, tokens, CPU_PRECISION, 4)
    assert logits == tokens * 1 * (4 + 2 * 4)
    no_ckpt = memory.train_act_bytes(TINY, S(), CPU_PRECISION, 3, 5, n_mbs=1, checkpointing=False)
    assert no_ckpt == 4 * tokens * 448 + 2 * logits  # the logits and their gradient
    ckpt = memory.train_act_bytes(TINY, S(), CPU_PRECISION, 3, 5, n_mbs=1, checkpointing=True)
    assert ckpt == 4 * tokens * 8 * 4 + tokens * 448 + 2 * logits
    assert ckpt < no_ckpt
    # FSDP gathers two layers and the root group (embedding, norm, head) and one layer's gradients
    root = TINY.embedding_params + TINY.final_norm_params + TINY.head_params
    gathered = memory.train_act_bytes(TINY, S(dp=2), CPU_PRECISION, 3, 5, 1, True) - ckpt
    assert gathered == (3 * TINY.layer_params + root) * 4
    # 1F1B: the first of 2 stages keeps 2 micro-batches in flight over its 2 layers
    assert memory.train_act_bytes(TINY, S(pp=2), CPU_PRECISION, 3, 5, 4, False) == 2 * 2 * tokens * 448 + 2 * logits


def test_logits_are_gathered_over_tp():
    lm = ModelSpec(num_layers=1, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=2, vocab_size=1000)
    # 64 tokens, tp=2, bf16 compute: the local half shard, the full gathered logits, two fp32 tensors
    assert memory.logits_bytes(lm, 2, 64, GPU_PRECISION, 2) == 64 * 500 * 2 + 64 * 1000 * (2 + 8)
    # no vocabulary sharding of what the log-softmax reads: tp only adds the local shard
    assert memory.logits_bytes(lm, 4, 64, GPU_PRECISION, 2) > memory.logits_bytes(lm, 1, 64, GPU_PRECISION, 2)


def test_generation_holds_the_kv_cache():
    m = model_preset("llama2-7b")
    kv = 2 * 64 * 256 * 32 * 4096 * 4  # fp32 cache of the HF sampler on 64 rows of 128 + 128 tokens
    act = memory.generate_act_bytes(m, S(dp=8), CPU_PRECISION, 8, 64, 128, 128)
    # one layer's cache more while DynamicCache concatenates; the prefill runs on the 8 prompts
    assert act == pytest.approx(kv * (1 + 1 / 32) + 8 * 128 * memory.saved_bytes_per_token(m, 1, 4))
    assert memory.generate_act_bytes(m, S(dp=8), GPU_PRECISION, 8, 64, 128, 128) == pytest.approx(act / 2)


# ---------------------------------------------------------------- mixture of experts, LoRA (tiny HF models)


def _tiny_hf(model_type: str, **extra):
    from rlflow.families import family_of

    family = family_of({"model_type": model_type})
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    return family.causal_lm_class(family.build_config(**shape, **extra))


def test_a_moe_models_flops_count_its_active_experts_and_its_memory_all_of_them():
    from rlflow.planner.passes import layer_work

    hf = _tiny_hf("qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    spec = ModelSpec.from_hf_config(hf.config)
    total = sum(p.numel() for p in hf.parameters())
    layer = dict(hf.model.layers[0].named_parameters())
    experts = sum(p.numel() for n, p in layer.items() if ".experts." in n)
    matrices = sum(p.numel() for n, p in layer.items() if p.dim() == 2)  # attention and router
    assert spec.num_params == total and spec.num_active_params == total - 2 * experts * 6 // 8
    # FLOPs: 2 per multiplying parameter a token runs through (attention, router, 2 of 8 experts) ...
    flops, _, _ = layer_work(spec, 1, seqs=1, new_tokens=1, pairs=0, nbytes=4)
    assert flops == 2 * (matrices + experts * 2 // 8)
    # ... memory: every expert's weights, gradients and moments.
    assert memory.weight_bytes(spec, S(), CPU_PRECISION) == total * CPU_PRECISION.param_bytes
    per_param = CPU_PRECISION.grad_bytes + CPU_PRECISION.optimizer_bytes
    assert memory.train_state_bytes(spec, S(dp=2), CPU_PRECISION) == total * per_param / 2


def test_a_lora_actor_holds_its_base_and_trains_state_for_the_adapters_only():
    peft = pytest.importorskip("peft")
    from rlflow.planner.model_spec import lora_param_count

    targets = ("q_proj", "v_proj", "down_proj")
    hf = _tiny_hf("llama")
    total = sum(p.numel() for p in hf.parameters())
    config = hf.config
    adapted = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets)))
    trainable, _ = adapted.get_nb_trainable_parameters()
    assert lora_param_count(config, 4, targets) == trainable

    full = ModelSpec.from_hf_config(config)
    lora = dataclasses.replace(full, trainable_params=trainable)
    p, s = CPU_PRECISION, S(dp=2)
    assert memory.weight_bytes(lora, s, p) == memory.weight_bytes(full, s, p) == total * p.param_bytes / 2
    # Gradients and AdamW moments of the adapters, and the adapters' own fp32 weights; not the base's.
    assert memory.train_state_bytes(full, s, p) == total * (p.grad_bytes + p.optimizer_bytes) / 2
    assert memory.train_state_bytes(lora, s, p) == trainable * (p.param_bytes + p.grad_bytes + p.optimizer_bytes) / 2
    assert trainable < total / 10


def test_a_moe_layer_saves_for_backward_what_its_active_experts_compute():
    """Qwen3-MoE's dense intermediate_size is not its experts' (moe_intermediate_size); Mixtral's is
    one expert's, and a token runs through two."""
    qwen = ModelSpec.from_hf_config(
        _tiny_hf("qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16).config
    )
    mixtral = ModelSpec.from_hf_config(_tiny_hf("mixtral", num_local_experts=4, num_experts_per_tok=2).config)
    assert (qwen.intermediate_size, qwen.active_intermediate_size) == (64, 2 * 16)
    assert (mixtral.intermediate_size, mixtral.active_intermediate_size) == (64, 2 * 64)
    dense = ModelSpec.from_hf_config(_tiny_hf("qwen3").config)
    assert dense.active_intermediate_size == dense.intermediate_size == 64
    for spec in (qwen, mixtral):
        h, e = spec.hidden_size, spec.num_experts
        attention = spec.q_size + 2 * spec.kv_size + spec.q_size
        per_token = 4 * h + 2 * h + 2 * e + attention + 3 * spec.active_intermediate_size
        assert memory.saved_bytes_per_token(spec, 1, 4) == 4 * per_token


def test_a_rollout_copy_that_merges_adapters_holds_the_base_of_the_adapted_weights_too():
    model = model_preset("llama2-7b")
    adapted = 32 * 4 * 4096 * 4096  # q, k, v, o of every layer
    lora = dataclasses.replace(model, trainable_params=1, push_params=1, push_tensors=2, push_base_params=adapted)
    prec = Precision()
    for strategy in (ParallelStrategy(tp=2), ParallelStrategy(tp=1, pp=2)):
        merged, adapters = (memory.weight_bytes(m, strategy, prec, generate=True) for m in (model, lora))
        share = int(model.stage_layers(strategy.pp).max()) / 32
        assert adapters - merged == pytest.approx(adapted * share * prec.param_bytes / strategy.tp)
    assert memory.weight_bytes(lora, ParallelStrategy(dp=2), prec) == memory.weight_bytes(
        model, ParallelStrategy(dp=2), prec
    )
