"""Reallocation, data-transfer and reload costs; the vectorised reallocation table against a
per-device, per-block reference."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from rlflow.planner.cluster import cluster_preset
from rlflow.planner.mesh import DeviceMesh
from rlflow.planner.model_spec import ModelSpec, model_preset
from rlflow.planner.space import enumerate_meshes
from rlflow.planner.transfer import (
    adapter_push_bytes,
    adapter_push_time_table,
    data_time_table,
    ema_time_table,
    key_bytes,
    realloc_time,
    realloc_time_table,
    reload_time,
)
from rlflow.strategy import ParallelStrategy

S = ParallelStrategy
A100 = cluster_preset("a100-80g", num_nodes=2)
LLAMA7B = model_preset("llama2-7b")


def M(nodes, devices, node=0, start=0):
    return DeviceMesh(nodes, devices, node, start, 8)


def test_identical_fsdp_layouts_are_free_and_others_are_not():
    home = (M(1, 8), S(dp=8))
    assert realloc_time(LLAMA7B, home, home, A100, replicated=False) == 0
    for dst in [(M(1, 8), S(tp=8)), (M(1, 8), S(dp=2, tp=4)), (M(1, 4), S(dp=4)), (M(2, 8), S(dp=16))]:
        fsdp = realloc_time(LLAMA7B, home, dst, A100, replicated=False)
        replicated = realloc_time(LLAMA7B, home, dst, A100)
        # an FSDP destination needs 1/dp of what a replicated one needs
        assert fsdp > 0 and (replicated > fsdp if dst[1].dp > 1 else replicated == fsdp)


def test_a_generation_on_the_home_layout_gathers_the_fsdp_shards():
    # every device holds 1/8 of the fp32 master weights and needs all of them: 7/8 from its host
    home = (M(1, 8), S(dp=8))
    gather = realloc_time(LLAMA7B, home, home, A100)
    latency = int(LLAMA7B.item_tensors.sum()) * A100.collective_latency_s
    assert gather == pytest.approx(LLAMA7B.num_params * 4 * 7 / 8 / A100.intra_host_bandwidth + latency, rel=1e-9)


def test_same_host_is_cheaper_than_another_host():
    home = (M(1, 8), S(dp=8))
    near = realloc_time(LLAMA7B, home, (M(1, 4, 0, 4), S(tp=4)), A100)
    far = realloc_time(LLAMA7B, home, (M(1, 4, 1, 4), S(tp=4)), A100)
    assert 0 < near < far
    # everything comes over one 25 GB/s NIC: a quarter of the fp32 master weights per device
    assert far == pytest.approx(LLAMA7B.num_params * 4 / 4 / A100.inter_host_bandwidth, rel=0.02)


def _reference(model, src, dst, cluster, replicated):
    """Slowest destination over all (device, item, tp-block) pieces, straight from the definitions:
    a replicated destination needs its whole tp block, an FSDP one its 1/dp of it; one broadcast
    per tensor, except for a destination that holds all it needs (a copy in memory)."""
    (hm, hs), (tm, ts) = src, dst
    if (hm, hs) == (tm, ts) and not replicated:
        return 0.0
    b, dpn = 4, cluster.devices_per_node  # fp32 master weights on the wire
    share = 1.0 if replicated else 1.0 / ts.dp
    home_stage = {i: k for k, r in enumerate(model.stages(hs.pp)) for i in r}
    worst = 0.0
    for rank, d in enumerate(tm.device_ids):
        pp_rank, _, r = ts.coords(rank)
        need = model.stages(ts.pp)[pp_rank]
        seconds = sum(model.item_tensors[i] for i in need) * cluster.collective_latency_s
        received, held = 0.0, 0.0
        for item in need:
            for g_rank, g in enumerate(hm.device_ids):
                g_stage, _, q = hs.coords(g_rank)
                if g_stage != home_stage[item]:
                    continue
                lo, hi = max(q / hs.tp, r / ts.tp), min((q + 1) / hs.tp, (r + 1) / ts.tp)
                piece = max(0.0, hi - lo) * model.item_params[item] * b / hs.dp * share
                if g == d:
                    held += piece
                    continue
                bw = cluster.intra_host_bandwidth if g // dpn == d // dpn else cluster.inter_host_bandwidth
                seconds += piece / bw
                received += piece
        if received <= 1e-9 * (received + held):
            seconds = held / cluster.intra_host_bandwidth
        worst = max(worst, seconds)
    return worst


def test_vectorised_table_matches_the_reference():
    model = ModelSpec(num_layers=5, hidden_size=64, intermediate_size=128, num_heads=8, num_kv_heads=4, vocab_size=300)
    cluster = cluster_preset("a100-80g", num_nodes=2)
    options = [
        (m, S(dp, tp, pp))
        for m in enumerate_meshes(2, 8)
        for tp in (1, 2, 4)
        for pp in (1, 2, 4)
        if m.num_devices % tp == 0 and m.size % (tp * pp) == 0
        for dp in [m.size // (tp * pp)]
    ]
    rng = np.random.default_rng(0)
    homes = [options[i] for i in rng.choice(len(options), 12, replace=False)]
    targets = [options[i] for i in rng.choice(len(options), 25, replace=False)] + homes[:3]
    for replicated in (True, False):
        table = realloc_time_table(model, homes, targets, cluster, chunk=97, replicated=replicated)
        for (h, src), (t, dst) in itertools.product(enumerate(homes), enumerate(targets)):
            expected = _reference(model, src, dst, cluster, replicated)
            assert table[h, t] == pytest.approx(expected, rel=1e-9, abs=1e-15), (src, dst, replicated)


def test_data_transfers():
    gen, train = [(M(1, 8), S(dp=8)), (M(1, 4), S(dp=4))], [(M(1, 8), S(dp=8)), (M(1, 4, 1, 0), S(dp=2, tp=2))]
    t = data_time_table(1e6, gen, train, A100)
    assert t.shape == (2, 2) and t[0, 0] == 0 and (t[0, 1] > 0) and t[1, 0] > 0
    assert t[1, 1] > t[1, 0]  # other host and fewer receiving ranks
    assert not data_time_table(0, gen, train, A100).any()
    assert key_bytes("input_ids", 4, 10, 3) == 320 and key_bytes("prompts", 4, 10, 3) == 96
    assert key_bytes("response_mask", 4, 10, 3) == 40 and key_bytes("rewards", 4, 10, 3) == 16
    # The distillation teacher's whole distributions: one fp32 per token and vocabulary entry.
    assert key_bytes("teacher_vocab_logp", 4, 10, 3, vocab_size=100) == 4 * 4 * 10 * 100


def test_reload_hides_under_the_first_forward_pass():
    load = 16e9 / A100.host_device_bandwidth
    t = reload_time(np.array([16e9, 16e9, 16e9]), np.array([0.0, load / 2, 10 * load]), 32, A100)
    assert t.tolist() == pytest.approx([load, load / 2, load / 32])


def test_ema_blend_is_the_reshard_onto_the_target_home_plus_the_blend_by_hand():
    cluster = cluster_preset("a100-80g", num_nodes=1, devices_per_node=4)
    m = ModelSpec(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=4, vocab_size=100)
    actor, ref = (DeviceMesh(1, 2, 0, 0, 4), S(dp=2)), (DeviceMesh(1, 2, 0, 2, 4), S(dp=2))
    shard = m.num_params * 4 / 2  # fp32 master weights, FSDP over 2
    blend = 4 * shard / cluster.bandwidth  # write the scratch; lerp_ reads shard and scratch, writes the shard
    latency = int(m.item_tensors.sum()) * cluster.collective_latency_s
    table = ema_time_table(m, [actor, ref], [ref], cluster)
    # another pair of devices on the host: each reference device receives its whole shard over NVLink
    assert table[0, 0] == pytest.approx(shard / cluster.intra_host_bandwidth + latency + blend, rel=1e-12)
    assert table[1, 0] == pytest.approx(blend, rel=1e-12)  # identical homes: nothing moves


def test_one_worker_copies_its_weights_in_memory_without_broadcasts():
    """Training and generation on the same single device: the rollout copy is filled from the
    training weights in memory, so no per-tensor broadcast latency is priced (it was, 35 ms for
    issue 12's tiny model against 1.5 ms measured); one more device in the home makes it a
    collective again."""
    model = ModelSpec(num_layers=2, hidden_size=64, intermediate_size=256, num_heads=4, num_kv_heads=4, vocab_size=100)
    cluster = cluster_preset("a100-80g", num_nodes=1)
    one = (M(1, 1), S())
    copy = realloc_time_table(model, [one], [one], cluster)[0, 0]
    assert copy == pytest.approx(model.num_params * 4 / cluster.intra_host_bandwidth, rel=1e-9)
    assert copy == pytest.approx(_reference(model, one, one, cluster, True), rel=1e-9)
    fsdp = realloc_time_table(model, [(M(1, 2), S(dp=2))], [one], cluster)[0, 0]
    assert fsdp >= int(model.item_tensors.sum()) * cluster.collective_latency_s > copy


def test_an_adapter_push_moves_the_whole_adapters_to_every_destination_device():
    """A LoRA model whose kept copies merge the adapters: each destination device takes all of them
    (r * (in + out) per adapted weight), from its own home shard, its host, or another host."""
    adapters = 16 * 32 * (4096 + 4096) * 4  # r=16 on q, k, v, o of 32 layers
    lora = dataclasses.replace(LLAMA7B, trainable_params=adapters, push_params=adapters, push_tensors=2 * 4 * 32)
    home = (M(1, 8), S(dp=8))
    targets = [(M(1, 8), S(tp=8)), (M(1, 4, 1, 4), S(tp=4)), (M(1, 8), S(dp=8)), (M(1, 8), S(dp=2, tp=2, pp=2))]
    table = adapter_push_time_table(lora, [home], targets, A100)
    full = realloc_time_table(LLAMA7B, [home], targets, A100)
    assert (table > 0).all() and (table < full).all()  # adapters, not the weights
    b, latency = 4 * adapters, lora.push_tensors * A100.collective_latency_s
    # On the home's host: 7/8 from the other home devices, 1/8 its own shard.
    assert table[0, 0] == pytest.approx(b * 7 / 8 / A100.intra_host_bandwidth + latency, rel=1e-9)
    assert table[0, 1] == pytest.approx(b / A100.inter_host_bandwidth + latency, rel=1e-9)  # all from host 0
    moved = adapter_push_bytes(lora, home, targets[1], A100)
    assert moved == {"local_bytes": 0.0, "intra_host_bytes": 0.0, "inter_host_bytes": 4 * b}
    moved = adapter_push_bytes(lora, home, targets[0], A100)
    assert moved == pytest.approx({"local_bytes": b, "intra_host_bytes": 7 * b, "inter_host_bytes": 0.0})
    # A pipeline stage takes its layers' adapters only.
    assert table[0, 3] < table[0, 0]
    # An FSDP copy on the home's own layout is the home: nothing moves.
    assert adapter_push_time_table(lora, [home], [home], A100, replicated=False)[0, 0] == 0.0
    with pytest.raises(ValueError, match="no push_params"):
        adapter_push_time_table(LLAMA7B, [home], targets, A100)
