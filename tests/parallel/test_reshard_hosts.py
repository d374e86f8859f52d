"""Reshards across hosts: which source sends each piece, and the planner's bytes per link.

A destination takes each piece from a holder on its own host when there is one, else from
another host, the same whatever order the host map was built in; and the bytes the reshard
plan moves within and between hosts are what the planner's transfer model prices
(``realloc_bytes``) wherever the model's spread of the weights is the layouts' own.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from realloc_helpers import tiny_llama_gqa
from transformers import LlamaConfig

from rlflow.parallel.layout import build_layout
from rlflow.parallel.reshard import plan_reshard, transfer_bytes_summary
from rlflow.planner.cluster import CPU_PRECISION, cluster_preset
from rlflow.planner.model_spec import ModelSpec
from rlflow.planner.space import enumerate_meshes
from rlflow.planner.transfer import realloc_bytes
from rlflow.strategy import ParallelStrategy as S


def routes(plan) -> dict[int, set[int]]:
    """Destination rank -> the source ranks it receives from."""
    out: dict[int, set[int]] = {}
    for t in plan.transfers:
        for d in t.dsts:
            out.setdefault(d, set()).add(t.src)
    return out


def test_each_destination_reads_its_own_hosts_replica_and_crosses_hosts_only_for_what_it_lacks():
    config = tiny_llama_gqa()
    # Hosts: {0, 1, 4}, {2, 3, 5}. The source is replicated on both hosts (dp=2 over ranks 0 and 2,
    # each replica tp=2 within its host); destinations 4 and 5 want the whole model.
    hosts = {0: 0, 1: 0, 2: 1, 3: 1, 4: 0, 5: 1}
    src = build_layout(config, S(dp=2, tp=2), [0, 1, 2, 3])
    dst = build_layout(config, S(dp=2), [4, 5])
    plan = plan_reshard(src, dst, hosts)
    assert routes(plan) == {4: {0, 1}, 5: {2, 3}}
    assert transfer_bytes_summary(plan)["inter_host_bytes"] == 0
    # Only the second host holds the source: the first host's destination reads across hosts.
    remote = plan_reshard(build_layout(config, S(tp=2), [2, 3]), dst, hosts)
    assert routes(remote) == {4: {2, 3}, 5: {2, 3}}
    summary = transfer_bytes_summary(remote)
    assert summary["inter_host_bytes"] == summary["intra_host_bytes"] > 0
    # The same plan whatever order the host map lists the ranks in.
    shuffled = dict(sorted(hosts.items(), reverse=True))
    again = plan_reshard(src, dst, shuffled)
    assert (again.copies, again.transfers) == (plan.copies, plan.transfers)


# A Llama whose every first dimension (vocabulary 96, widths 64, 128, 32) divides by 8: FSDP
# shards of up to 8 ranks are equal, as the planner's transfer model assumes.
DIVISIBLE = LlamaConfig(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)


def test_bytes_per_link_of_fsdp_homes_to_data_parallel_copies_equal_the_planners():
    """Every (home mesh, generation mesh) pair of a 2 x 4 cluster, data-parallel on both sides."""
    cluster = replace(cluster_preset("a100-80g", num_nodes=2, devices_per_node=4), precision=CPU_PRECISION)
    model = ModelSpec.from_hf_config(DIVISIBLE)
    hosts = {d: d // 4 for d in range(8)}
    itemsize = cluster.precision.param_bytes
    meshes = enumerate_meshes(2, 4)
    crossing = 0
    for home_mesh, gen_mesh in itertools.product(meshes, meshes):
        home = build_layout(DIVISIBLE, S(dp=home_mesh.size), home_mesh.device_ids, fsdp=True)
        gen = build_layout(DIVISIBLE, S(dp=gen_mesh.size), gen_mesh.device_ids)
        moved = transfer_bytes_summary(plan_reshard(home, gen, hosts), itemsize=itemsize)
        planned = realloc_bytes(model, (home_mesh, S(dp=home_mesh.size)), (gen_mesh, S(dp=gen_mesh.size)), cluster)
        pair = (home_mesh, gen_mesh)
        assert planned["local_bytes"] == pytest.approx(moved["local_bytes"], rel=1e-12), pair
        assert planned["intra_host_bytes"] == pytest.approx(moved["intra_host_bytes"], rel=1e-12, abs=1e-6), pair
        assert planned["inter_host_bytes"] == pytest.approx(moved["inter_host_bytes"], rel=1e-12, abs=1e-6), pair
        crossing += moved["inter_host_bytes"] > 0
    assert crossing > len(meshes)  # many pairs cross hosts, not only a few


def test_equal_fsdp_layouts_move_nothing():
    cluster = cluster_preset("a100-80g", num_nodes=2, devices_per_node=4)
    model = ModelSpec.from_hf_config(DIVISIBLE)
    home = (enumerate_meshes(2, 4)[-1], S(dp=8))
    assert set(realloc_bytes(model, home, home, cluster, replicated=False).values()) == {0.0}
    # As a generation (replicated) on the same devices, every device gathers the other 7 shards.
    gathered = realloc_bytes(model, home, home, cluster)
    full = model.num_params * cluster.precision.param_bytes
    assert gathered["intra_host_bytes"] == pytest.approx(8 * full * 3 / 8)
    assert gathered["inter_host_bytes"] == pytest.approx(8 * full * 4 / 8)
