"""Memory formulas against hand-computed numbers."""

from __future__ import annotations

import pytest

from rlflow.planner import memory
from rlflow.planner.mesh import ParallelStrategy
from rlflow.planner.model_spec import ModelSpec, model_preset

S = ParallelStrategy
P7B = 6_738_415_616


def test_llama2_7b_training_state_under_fsdp_over_8():
    m = model_preset("llama2-7b")
    assert memory.weight_bytes(m, S()) == 2 * P7B == 13_476_831_232  # bf16: 13.5 GB
    # bf16 weights and grads + fp32 master, m, v: 16 bytes per parameter, / 8 ranks
    weights = memory.weight_bytes(m, S(dp=8), fsdp=True)
    state = memory.train_state_bytes(m, S(dp=8))
    assert weights == 2 * P7B / 8 == 1_684_603_904
    assert state == 14 * P7B / 8 == 11_792_227_328
    assert weights + state == 16 * P7B / 8 == 13_476_831_232
    # tp splits the same way; inference copies are not sharded over dp
    assert memory.train_state_bytes(m, S(dp=2, tp=4)) == state
    assert memory.weight_bytes(m, S(dp=8)) == 2 * P7B


def test_pipeline_stages_hold_their_share():
    m = model_preset("llama2-70b")
    largest = int(m.stage_params(2).max())
    assert largest < m.num_params * 0.51
    assert memory.weight_bytes(m, S(tp=8, pp=2)) == largest * 2 / 8


def test_kv_cache_by_hand():
    m = model_preset("llama2-7b")
    # K and V: 2 * seqs * tokens * layers * hidden * 2 bytes
    assert memory.kv_cache_bytes(m, S(), 64, 256) == 2 * 64 * 256 * 32 * 4096 * 2 == 8_589_934_592
    assert memory.kv_cache_bytes(m, S(tp=4, pp=2), 64, 256) == 8_589_934_592 / 8
    gqa = model_preset("llama2-70b")  # 8 kv heads of 128: kv_size 1024
    assert memory.kv_cache_bytes(gqa, S(), 1, 100) == 2 * 100 * 80 * 1024 * 2


TINY = ModelSpec(
    num_layers=4, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=2, vocab_size=10, value_head=True
)


def test_activation_formulas_by_hand():
    # saved per token and layer: 2 bytes * (4h + (q + 2kv + q + 3I)/tp) = 2 * (32 + (8+16+8+48)) = 224
    assert memory.saved_bytes_per_token(TINY, 1) == 224
    tokens = 3 * 5
    # value head: 1 output, fp32 logits + grads
    assert memory.logits_bytes(TINY, 1, tokens) == 2 * tokens * 1 * 4
    no_ckpt = memory.train_act_bytes(TINY, S(), 3, 5, n_mbs=1, checkpointing=False)
    assert no_ckpt == 4 * tokens * 224 + 2 * tokens * 4
    ckpt = memory.train_act_bytes(TINY, S(), 3, 5, n_mbs=1, checkpointing=True)
    assert ckpt == 4 * tokens * 8 * 2 + tokens * 224 + 2 * tokens * 4
    assert ckpt < no_ckpt
    # FSDP adds two unsharded layers and a layer of gradients
    assert memory.train_act_bytes(TINY, S(dp=2), 3, 5, 1, True) - ckpt == 3 * TINY.layer_params * 2
    # 1F1B: the first of 2 stages keeps 2 micro-batches in flight over its 2 layers
    assert memory.train_act_bytes(TINY, S(pp=2), 3, 5, 4, False) == 2 * 2 * tokens * 224 + 2 * tokens * 4


def test_generation_holds_the_kv_cache():
    m = model_preset("llama2-7b")
    act = memory.generate_act_bytes(m, S(dp=8), 64, 128, 128)
    assert act == pytest.approx(8_589_934_592 + 64 * 128 * memory.saved_bytes_per_token(m, 1))
