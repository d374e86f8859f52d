"""Views with a (dp, tp, pp) shape under MESH_PROTO, and futures chained without the driver."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_batch

from rlflow.controller import DataFuture, transfer_stats
from rlflow.strategy import ParallelStrategy


def test_mesh_proto_dp2_tp2_splits_along_dp_and_collects_tp0(actor):
    view = actor.view([0, 1, 2, 3], ParallelStrategy(dp=2, tp=2, pp=1))
    out = view.mesh_tag(make_batch(6))
    seen = [s[0] if s else None for s in actor.take_seen()]
    # rank = dp_rank*tp + tp_rank: ranks 0,1 are dp 0 (rows 0-2), ranks 2,3 are dp 1 (rows 3-5).
    assert seen == [[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]]
    assert out.batch["id"].tolist() == list(range(6))
    assert out.batch["rank"].tolist() == [0, 0, 0, 2, 2, 2]  # tp-rank-0 outputs only


def test_mesh_proto_dp1_tp2_pp2_collects_last_stage_tp0(actor):
    view = actor.view([0, 1, 2, 3], ParallelStrategy(dp=1, tp=2, pp=2))
    out = view.mesh_tag(make_batch(5))
    assert [s[0] for s in actor.take_seen()] == [list(range(5))] * 4  # replicated over tp and pp
    assert out.batch["rank"].tolist() == [2] * 5  # pp_rank 1, tp_rank 0 -> view rank 2


def test_view_over_reordered_subset_maps_view_ranks_to_actors(actor):
    view = actor.view([3, 2, 1, 0], ParallelStrategy(dp=1, tp=2, pp=2))
    assert view.ranks == [3, 2, 1, 0] and view.world_size == 4
    out = view.mesh_tag(make_batch(3))
    actor.take_seen()
    assert out.batch["rank"].tolist() == [1] * 3  # view rank 2 is global rank 1
    pair = actor.view([1, 3], ParallelStrategy(dp=2))
    assert pair.mesh_tag(make_batch(4)).batch["rank"].tolist() == [1, 1, 3, 3]
    actor.take_seen()


def test_view_rejects_bad_ranks_and_shapes(actor):
    with pytest.raises(ValueError, match="distinct positions in \\[0, 4\\)"):
        actor.view([0, 0])
    with pytest.raises(ValueError, match="has 4 ranks but the view has 2"):
        actor.view([0, 1], ParallelStrategy(dp=2, tp=2))


def test_chained_futures_skip_the_driver(actor):
    data = make_batch(10)
    transfer_stats.reset()
    first = actor.async_tag(data)
    payload = data.batch["id"].nbytes + data.batch["attention_mask"].nbytes
    assert isinstance(first, DataFuture) and transfer_stats.sent_bytes == payload
    transfer_stats.reset()
    second = actor.async_tag(first)  # same dp size: each rank keeps its rows
    third = actor.view([0, 2], ParallelStrategy(dp=2)).async_tag(second)  # re-split 4 -> 2 parts in the workers
    assert (transfer_stats.sent_bytes, transfer_stats.received_bytes) == (0, 0)
    out = third.get()
    assert out.batch["id"].tolist() == list(range(10))
    assert torch.equal(out.batch["y"], data.batch["id"] * 3)
    assert out.batch["rank"].tolist() == [0] * 5 + [2] * 5
    seen = actor.take_seen()
    assert seen[1] == [[3, 4, 5], [3, 4, 5]]  # rank 1 got its own part back from the object store
    assert seen[2][-1] == [5, 6, 7, 8, 9]  # view rank 1 = global rank 2 fetched rows from ranks 1, 2 and 3


def test_future_from_balanced_split_keeps_order_through_a_chain(actor):
    data = make_batch(8, [9, 1, 8, 2, 7, 3, 6, 4], seq_len=10)
    sampled = actor.view(range(4), balance_by="attention_mask").async_sample(
        data, n=2
    )  # 2 rows per input, in balanced (permuted) parts
    retagged = actor.view([1, 0], ParallelStrategy(dp=2)).async_tag(sampled)
    actor.async_tag(sampled)  # a future may feed several calls
    out = retagged.get()
    actor.take_seen()
    assert out.batch["id"].tolist() == np.repeat(np.arange(8), 2).tolist()
    assert torch.equal(out.batch["attention_mask"], data.batch["attention_mask"].repeat_interleave(2, dim=0))


def test_future_as_whole_argument_and_unmaterialized_handles(actor):
    fut = actor.async_tag(make_batch(6))
    assert actor.num_rows(fut) == [list(range(6))] * 4  # ONE_TO_ALL: every rank fetches all parts
    types = actor.arg_type(fut).get().non_tensor_batch["type"].tolist()
    assert types == ["RemoteRows"] * 4  # materialize_futures=False hands the method the handle
    actor.take_seen()


def test_non_blocking_call_on_fused_group_and_spawned_groups_share_actors(fused):
    groups = fused.spawn()
    assert set(groups) == {"actor", "critic"}
    actor_pids = [i["pid"] for i in fused.actor_whoami()]
    critic = fused.critic_whoami()
    assert [i["pid"] for i in critic] == actor_pids  # one process per device hosts both roles
    assert [i["role"] for i in critic] == ["critic"] * 4
    assert [i["pid"] for i in groups["critic"].whoami()] == actor_pids
    values = groups["critic"].values(groups["actor"].async_tag(make_batch(4)))
    groups["actor"].take_seen()
    assert values.batch["value"].tolist() == [0.0, 0.5, 1.0, 1.5]
    with pytest.raises(AttributeError, match="registered methods: \\['init_process_group', 'values', 'whoami'\\]"):
        groups["critic"].tag(None)
