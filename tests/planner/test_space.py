"""The search space against hand counts."""

from __future__ import annotations

import pytest

from rlflow.dataflow import MFCDef, algorithm_mfcs
from rlflow.planner.mesh import DeviceMesh
from rlflow.planner.model_spec import ModelSpec, model_preset
from rlflow.planner.space import (
    RuntimeCapabilities,
    enumerate_meshes,
    enumerate_options,
    enumerate_strategies,
    num_microbatches,
)
from rlflow.strategy import ParallelStrategy

S = ParallelStrategy
GEN, _, REF, _, TRAIN, _ = algorithm_mfcs("ppo")
LLAMA7B = model_preset("llama2-7b")


@pytest.mark.parametrize(
    "nodes, per_node, count",
    [
        (1, 8, 8 + 4 + 2 + 1),
        (2, 8, 2 * 14 + 2 + 1),
        (3, 8, 3 * 14 + 3 + 2 + 1),
        (1, 4, 4 + 2 + 1),
        (2, 6, 2 * (6 + 3 + 2) + 3),
    ],
)
def test_mesh_counts(nodes, per_node, count):
    meshes = enumerate_meshes(nodes, per_node)
    assert len(meshes) == count == len(set(meshes))
    assert all(m.first_device + m.size <= nodes * per_node for m in meshes)


def test_meshes_are_the_papers_shapes_at_every_position():
    meshes = enumerate_meshes(2, 8)
    assert {m.shape for m in meshes} == {(1, 1), (1, 2), (1, 4), (1, 8), (2, 8)}
    assert [m.first_device for m in meshes if m.shape == (1, 2)] == [0, 2, 4, 6, 8, 10, 12, 14]
    assert [m.first_device for m in meshes if m.shape == (1, 8)] == [0, 8]


def test_strategies_on_one_host_by_hand():
    mesh = DeviceMesh(1, 8)
    # tp in {1,2,4,8} (32 heads), pp | 8/tp: 4 + 3 + 2 + 1
    assert len(enumerate_strategies(mesh, LLAMA7B, REF, n_seqs=512)) == 10
    # pipelined generation by default (the built-in sampler's); an engine that cannot gets pp == 1 only
    assert len(enumerate_strategies(mesh, LLAMA7B, GEN, n_seqs=512)) == 10
    no_pp = RuntimeCapabilities(pipeline_generate=False)
    assert enumerate_strategies(mesh, LLAMA7B, GEN, 512, capabilities=no_pp) == [
        S(8, 1, 1),
        S(4, 2, 1),
        S(2, 4, 1),
        S(1, 8, 1),
    ]
    assert all(
        s.tp <= 2 for s in enumerate_strategies(mesh, LLAMA7B, REF, 512, capabilities=RuntimeCapabilities(max_tp=2))
    )


def test_a_lora_model_trains_data_parallel_only():
    mesh = DeviceMesh(1, 8)
    lora = RuntimeCapabilities(data_parallel_train_models=frozenset({TRAIN.model_name}))
    assert enumerate_strategies(mesh, LLAMA7B, TRAIN, 512, capabilities=lora) == [S(8, 1, 1)]
    assert len(enumerate_strategies(mesh, LLAMA7B, GEN, 512, capabilities=lora)) == 10  # its rollout: any strategy


def test_tp_divides_heads_and_kv_heads_and_stays_in_a_host():
    two_kv = ModelSpec(
        num_layers=4, hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=2, vocab_size=100
    )
    assert {s.tp for s in enumerate_strategies(DeviceMesh(1, 8), two_kv, REF, 512)} == {1, 2}
    whole = enumerate_strategies(DeviceMesh(2, 8), LLAMA7B, REF, 512)
    assert max(s.tp for s in whole) == 8 and all(s.world_size == 16 for s in whole)
    # pp <= layers: a 4-layer model never gets 8 stages
    assert max(s.pp for s in enumerate_strategies(DeviceMesh(1, 8), two_kv, REF, 512)) == 4


def test_every_dp_rank_needs_enough_sequences():
    # 4 sequences on 8 devices: dp <= 4 and floor(4/dp) >= pp
    # dp=1: (1,8,1) (1,4,2) (1,2,4); dp=2: (2,4,1) (2,2,2); dp=4: (4,2,1)
    found = enumerate_strategies(DeviceMesh(1, 8), LLAMA7B, REF, n_seqs=4)
    assert sorted(found, key=lambda s: (s.dp, -s.tp)) == [
        S(1, 8, 1),
        S(1, 4, 2),
        S(1, 2, 4),
        S(2, 4, 1),
        S(2, 2, 2),
        S(4, 2, 1),
    ]
    # a train call counts per mini-batch: 8 sequences in 2 mini-batches behave like 4
    assert sorted(enumerate_strategies(DeviceMesh(1, 8), LLAMA7B, TRAIN, 8, n_minibatches=2), key=str) == sorted(
        found, key=str
    )
    picky = MFCDef("r", "ref", "inference", min_n_seqs_per_dp=3)
    assert {s.dp for s in enumerate_strategies(DeviceMesh(1, 8), LLAMA7B, picky, n_seqs=8)} == {1, 2}


def test_options_cover_every_mesh():
    opts = enumerate_options(GEN, LLAMA7B, 1, 8, n_seqs=64)
    # per mesh of size k on one host: one strategy per (tp, pp) with tp * pp | k
    assert len(opts) == 8 * 1 + 4 * 3 + 2 * 6 + 1 * 10
    assert len({(m, s) for m, s in opts}) == len(opts)
    # an engine that cannot pipeline: pp == 1, one strategy per tp | k
    no_pp = RuntimeCapabilities(pipeline_generate=False)
    assert len(enumerate_options(GEN, LLAMA7B, 1, 8, n_seqs=64, capabilities=no_pp)) == 8 * 1 + 4 * 2 + 2 * 3 + 1 * 4


def test_microbatches():
    assert num_microbatches(GEN, S(8, 1, 1), 512, 256) == 1
    assert num_microbatches(REF, S(1, 1, 4), 512, 256) == 8  # 2 per stage
    assert num_microbatches(REF, S(256, 1, 2), 512, 256) == 2  # capped by 2 sequences per rank
    assert num_microbatches(REF, S(1, 1, 1), 64, 1024, max_tokens_per_mb=16384) == 4  # token budget
    assert num_microbatches(MFCDef("t", "a", "train_step", n_mbs=3, objective="sft"), S(1, 1, 4), 64, 8) == 3
