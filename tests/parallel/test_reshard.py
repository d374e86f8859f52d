"""Tests of the pure reshard planner: minimal bytes, cost tiers, load spreading, broadcasts, speed."""

from __future__ import annotations

import time

import numpy as np
import pytest
from realloc_helpers import tiny_llama_gqa, tiny_qwen2_tied
from transformers import LlamaConfig

from rlflow.parallel.layout import build_layout
from rlflow.parallel.reshard import minimum_moved_numel, plan_reshard, transfer_bytes_summary
from rlflow.strategy import ParallelStrategy as S


def _mask(shape, box) -> np.ndarray:
    m = np.zeros(shape, dtype=bool)
    m[tuple(slice(a, b) for a, b in box)] = True
    return m


def brute_force_tiers(src, dst, host_of) -> dict[str, int]:
    """Elements each destination rank gets locally / from its host / from another host, by element masks."""
    out = {"local": 0, "intra": 0, "inter": 0}
    for spec in dst.params:
        held = {r: _mask(spec.shape, b[spec.name]) for r in src.ranks if spec.name in (b := src.boxes(r))}
        for r in dst.ranks:
            if spec.name not in dst.boxes(r):
                continue
            need = _mask(spec.shape, dst.boxes(r)[spec.name])
            local = need & held.get(r, False)
            same = np.zeros(spec.shape, dtype=bool)
            for s, m in held.items():
                if host_of[s] == host_of[r] and s != r:
                    same |= m
            intra = need & ~local & same
            out["local"] += int(local.sum())
            out["intra"] += int(intra.sum())
            out["inter"] += int((need & ~local & ~intra).sum())
    return out


PAIRS = [
    ((S(dp=2), [0, 1], True), (S(tp=2), [0, 1], False)),
    ((S(dp=4), [0, 1, 2, 3], True), (S(dp=2, tp=2), [0, 1, 2, 3], False)),
    ((S(dp=2, tp=2), [0, 1, 2, 3], True), (S(tp=2, pp=2), [0, 1, 2, 3], False)),
    ((S(dp=4), [0, 1, 2, 3], True), (S(tp=4), [0, 1, 2, 3], False)),
    ((S(dp=2, pp=2), [0, 1, 2, 3], False), (S(dp=3), [1, 2, 3], True)),
    ((S(tp=2), [2, 3], False), (S(dp=2), [0, 1], True)),
]


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0][0]}->{p[1][0]}")
@pytest.mark.parametrize("config", [tiny_llama_gqa(), tiny_qwen2_tied()], ids=["llama_gqa", "qwen2_tied"])
def test_bytes_per_tier_equal_an_element_count(config, pair):
    hosts = {0: 0, 1: 0, 2: 1, 3: 1}
    src, dst = build_layout(config, *pair[0]), build_layout(config, *pair[1])
    summary = transfer_bytes_summary(plan_reshard(src, dst, hosts), itemsize=2)
    expected = brute_force_tiers(src, dst, hosts)
    assert summary["local_bytes"] == 2 * expected["local"]
    assert summary["intra_host_bytes"] == 2 * expected["intra"]
    assert summary["inter_host_bytes"] == 2 * expected["inter"]
    assert summary["moved_bytes"] == 2 * minimum_moved_numel(src, dst)


def test_fsdp_to_tp_on_the_same_ranks_moves_a_hand_counted_amount():
    config = tiny_llama_gqa()  # hidden 64, intermediate 112, 4 heads of 16, 2 kv heads, vocab 96, 4 layers
    plan = plan_reshard(build_layout(config, S(dp=2), [0, 1], fsdp=True), build_layout(config, S(tp=2), [0, 1]))
    moved = {}
    for t in plan.transfers:
        for p in t.pieces:
            moved[p.name] = moved.get(p.name, 0) + p.numel * len(t.dsts)
    layer = "model.layers.0."
    # Column-parallel: the tp shard of rank r is exactly its FSDP shard (rows of r's half): nothing moves.
    assert layer + "self_attn.q_proj.weight" not in moved and "lm_head.weight" not in moved
    # Row-parallel o_proj (64x64): rank r needs columns of its half, all rows; it has half the rows.
    assert moved[layer + "self_attn.o_proj.weight"] == 2 * (32 * 32)
    # down_proj (64x112): columns split 56/56, rows 32/32: each rank misses 32x56.
    assert moved[layer + "mlp.down_proj.weight"] == 2 * (32 * 56)
    # Norms (64,) are replicated under tp: each rank misses the other's 32 elements.
    assert moved[layer + "input_layernorm.weight"] == 2 * 32
    per_layer = 2 * (32 * 32 + 32 * 56 + 32 + 32)
    assert transfer_bytes_summary(plan, itemsize=1)["moved_bytes"] == 4 * per_layer + 2 * 32  # + final norm


def test_identical_layouts_copy_locally():
    layout = build_layout(tiny_qwen2_tied(), S(dp=2, tp=2), [0, 1, 2, 3], fsdp=True)
    plan = plan_reshard(layout, layout)
    assert plan.transfers == ()
    assert transfer_bytes_summary(plan, itemsize=1)["local_bytes"] == sum(layout.local_numel(r) for r in layout.ranks)


def test_replicated_sources_share_the_load():
    config = tiny_llama_gqa()
    plan = plan_reshard(build_layout(config, S(dp=2), [0, 1]), build_layout(config, S(), [2]))
    per_link = transfer_bytes_summary(plan, itemsize=1)["per_link"]
    largest_piece = max(p.numel for t in plan.transfers for p in t.pieces)
    assert abs(per_link[(0, 2)] - per_link[(1, 2)]) <= largest_piece


def test_one_holder_broadcasts_to_all_replicas():
    config = tiny_llama_gqa()
    plan = plan_reshard(build_layout(config, S(dp=2), [0, 1], fsdp=True), build_layout(config, S(dp=2), [2, 3]))
    assert {(t.src, t.dsts) for t in plan.transfers} == {(0, (2, 3)), (1, (2, 3))}


def test_same_host_holder_is_preferred():
    config = tiny_llama_gqa()
    hosts = {0: 0, 1: 1, 2: 0, 3: 1}
    plan = plan_reshard(build_layout(config, S(dp=2), [0, 1]), build_layout(config, S(dp=2), [2, 3]), hosts)
    summary = transfer_bytes_summary(plan)
    assert summary["inter_host_bytes"] == 0 and {(t.src, t.dsts) for t in plan.transfers} == {(0, (2,)), (1, (3,))}


def test_mismatched_inputs_are_rejected():
    a = build_layout(tiny_llama_gqa(), S(dp=2), [0, 1])
    with pytest.raises(ValueError, match="different parameters"):
        plan_reshard(a, build_layout(tiny_qwen2_tied(), S(dp=2), [0, 1]))
    with pytest.raises(ValueError, match="no host for global ranks \\[1\\]"):
        plan_reshard(a, a, {0: 0})


def test_a_7b_plan_takes_well_under_a_second():
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
    )
    ranks = list(range(64))
    src = build_layout(config, S(dp=64), ranks, fsdp=True)  # 291 parameters x 64 ranks
    dst = build_layout(config, S(dp=2, tp=8, pp=4), ranks)
    start = time.process_time()
    plan = plan_reshard(src, dst, {r: r // 8 for r in ranks})
    elapsed = time.process_time() - start
    assert elapsed < 2.0, f"planning took {elapsed:.2f} s of CPU"  # ~0.3 s on an idle core
    total = sum(s.numel for s in dst.params)
    summary = transfer_bytes_summary(plan, itemsize=1)
    # Every destination rank receives its whole shard exactly once (local copies included).
    assert summary["local_bytes"] + summary["moved_bytes"] == sum(dst.local_numel(r) for r in ranks)
    assert total == 6_738_415_616
