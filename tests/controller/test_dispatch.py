"""Every dispatch and execute mode on four real Ray workers, against a single-process reference."""

from __future__ import annotations

import numpy as np
import pytest
import ray
import torch
from conftest import make_batch

from rlflow.controller import Dispatch, WorkerError, register, transfer_stats
from rlflow.controller.data_plane import expand_order, payload_nbytes


def test_one_to_all_reaches_every_rank_with_its_placement(actor):
    infos = actor.whoami()
    assert [i["rank"] for i in infos] == [0, 1, 2, 3]
    assert [i["local_rank"] for i in infos] == [0, 1, 2, 3]
    assert {i["world_size"] for i in infos} == {4}
    assert {i["role"] for i in infos} == {"actor"}
    assert {i["threads"] for i in infos} == {1}  # CPU workers run one torch thread
    assert len({i["pid"] for i in infos}) == 4
    assert [i["node_id"] for i in infos] == actor.node_ids


def test_all_to_all_and_dp_compute_give_rank_i_item_i(actor):
    assert actor.add([1, 2, 3, 4], y=[10, 20, 30, 40]) == [11, 22, 33, 44]
    assert actor.shard_sum([[1], [2, 3], [], [4, 5, 6]]) == [(0, 1), (1, 5), (2, 0), (3, 15)]
    with pytest.raises(ValueError, match=r"one item per rank \(4\), got length 3"):
        actor.add([1, 2, 3], y=[1, 2, 3, 4])


def test_rank_zero_modes_run_only_on_rank_zero(actor):
    assert actor.on_rank_zero(7) == (0, 7)
    assert actor.broadcast_run_zero(8) == (0, 8)
    assert actor.view([2, 3]).on_rank_zero(9) == (2, 9)  # view rank 0 is global rank 2
    assert actor.view([2, 3]).whoami()[0]["rank"] == 2


def test_execute_all_and_rank_zero_reach_any_worker_method(actor, fused):
    assert actor.execute_all("double", 4) == [(r, 8) for r in range(4)]
    assert actor.execute_rank_zero("double", 5) == (0, 10)
    assert ray.get(actor.async_execute_all("double", 1)) == [(r, 2) for r in range(4)]
    assert ray.get(actor.async_execute_rank_zero("double", 2)) == (0, 4)
    assert fused.view([3]).execute_rank_zero("actor_double", 3) == (3, 6)
    with pytest.raises(WorkerError, match="critic.double failed on worker rank 0"):
        fused.execute_rank_zero("critic_double", 1)  # the critic has no such method
    with pytest.raises(AttributeError, match="does not start with a role"):
        fused.execute_all("double", 1)


def test_user_defined_dispatch_and_collect_pair(actor):
    # rank r computes (5 + r) * 10; the collect sums them.
    assert actor.custom(5) == sum((5 + r) * 10 for r in range(4))


def test_dp_compute_proto_splits_unevenly_and_keeps_row_order(actor):
    data = make_batch(10)
    out = actor.tag(data, offset=1)
    seen = actor.take_seen()
    assert [len(s[0]) for s in seen] == [3, 3, 2, 2]  # sizes differ by at most one
    assert sum((s[0] for s in seen), []) == list(range(10))
    assert out.batch["id"].tolist() == list(range(10))
    assert torch.equal(out.batch["y"], data.batch["id"] * 3 + 1)  # single-process reference
    assert out.batch["rank"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]


def test_fewer_rows_than_ranks_gives_empty_parts(actor):
    out = actor.tag(make_batch(2))
    assert [len(s[0]) for s in actor.take_seen()] == [1, 1, 0, 0]
    assert out.batch["id"].tolist() == [0, 1]


def test_token_balanced_split_restores_original_order(actor):
    lengths = [60, 3, 3, 3, 50, 2, 40, 4, 30, 5, 6, 7]  # long rows first would pile up on one rank
    data = make_batch(12, lengths, seq_len=64)
    balanced = actor.view(range(4), balance_by="attention_mask")
    metrics = balanced.metric(data)
    tokens = [m["tokens"] for m in metrics]
    assert sum(tokens) == sum(lengths)
    assert max(tokens) - min(tokens) <= max(lengths)
    even = [sum(lengths[i : i + 3]) for i in range(0, 12, 3)]  # what an even split would give
    assert max(tokens) < max(even)
    assert sorted(m["rows"] for m in metrics) == [3, 3, 3, 3]
    actor.take_seen()

    out = balanced.tag(data)
    seen = [s[0] for s in actor.take_seen()]
    assert sorted(sum(seen, [])) == list(range(12)) and seen != [list(range(i, i + 3)) for i in range(0, 12, 3)]
    assert out.batch["id"].tolist() == list(range(12))
    assert torch.equal(out.batch["attention_mask"], data.batch["attention_mask"])
    rank_of_row = {row: r for r, rows in enumerate(seen) for row in rows}
    assert out.batch["rank"].tolist() == [rank_of_row[i] for i in range(12)]


def test_balanced_split_with_several_rows_per_input(actor):
    data = make_batch(6, [9, 1, 8, 2, 7, 3], seq_len=10)
    out = actor.view(range(4), balance_by="attention_mask").sample(data, n=3)
    actor.take_seen()
    assert out.batch["id"].tolist() == np.repeat(np.arange(6), 3).tolist()


def test_with_func_and_metric_modes(actor):
    data = make_batch(8)
    out = actor.apply(lambda d: d.select(batch_keys=["id", "rank"]), data)
    assert out.batch_keys == ["id", "rank"] and out.batch["id"].tolist() == list(range(8))
    metrics = actor.metric(data)
    assert [m["rank"] for m in metrics] == [0, 1, 2, 3] and [m["rows"] for m in metrics] == [2, 2, 2, 2]
    actor.take_seen()
    with pytest.raises(TypeError, match="function as the first argument"):
        actor.apply(data)


def test_driver_puts_each_large_part_once_and_inlines_small_ones(actor):
    data = make_batch(4000, seq_len=64)  # 2 MB: every dp part is above the inline limit
    payload = data.batch["id"].nbytes + data.batch["attention_mask"].nbytes
    transfer_stats.reset()
    actor.tag(data)
    actor.take_seen()
    # A part is put as its own rows only (not its parent batch): the four parts weigh the batch, not 4x it.
    assert (transfer_stats.sent_bytes, transfer_stats.num_puts) == (payload, 4)
    transfer_stats.reset()
    actor.num_rows(data)  # ONE_TO_ALL: one put shared by all ranks
    assert (transfer_stats.sent_bytes, transfer_stats.num_puts) == (payload, 1)
    small = make_batch(8)
    transfer_stats.reset()
    actor.num_rows(small)  # small: inline, serialised once per rank
    assert (transfer_stats.sent_bytes, transfer_stats.num_puts) == (4 * payload_nbytes(small), 0)


def test_unknown_method_lists_registered_ones(actor, fused):
    with pytest.raises(AttributeError, match=r"no method 'train'.*'add'.*'tag'"):
        actor.train()
    with pytest.raises(AttributeError, match=r"actor_whoami.*critic_values"):
        fused.whoami()


def test_register_rejects_bad_modes():
    with pytest.raises(TypeError, match="dispatch_mode must be a Dispatch"):
        register(dispatch_mode="one_to_all")
    with pytest.raises(TypeError, match="execute_mode must be an Execute"):
        register(dispatch_mode=Dispatch.ONE_TO_ALL, execute_mode="all")
    with pytest.raises(TypeError, match="pair must be"):
        register(dispatch_mode=(print,))


def test_expand_order_maps_k_rows_per_input_and_rejects_ragged_outputs():
    assert [p.tolist() for p in expand_order([np.array([1]), np.array([0])], [2, 2])] == [[2, 3], [0, 1]]
    with pytest.raises(ValueError, match="received \\[1, 1\\] rows but returned \\[2, 3\\]"):
        expand_order([np.array([1]), np.array([0])], [2, 3])
