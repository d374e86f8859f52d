"""Tests of process groups: pure rank maps and per-call torch meshes on a subset of a gloo pool."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from realloc_helpers import run_world

from rlflow.parallel.groups import (
    axis_ranks,
    build_call_groups,
    build_plan_groups,
    global_coords,
    pp_return_group,
    rank_grid,
)
from rlflow.planner.mesh import DeviceMesh
from rlflow.strategy import ParallelStrategy


def test_rank_maps_follow_the_planner_rank_order():
    mesh = DeviceMesh(1, 8, devices_per_node=8)
    strategy = ParallelStrategy(dp=2, tp=2, pp=2)
    grid = rank_grid(mesh.device_ids, strategy)
    for r in mesh.device_ids:
        pp_rank, dp_rank, tp_rank = global_coords(mesh.device_ids, strategy, r)
        assert strategy.rank_of(pp_rank, dp_rank, tp_rank) == r and int(grid[pp_rank, dp_rank, tp_rank]) == r
    ranks = [8, 9, 10, 11]  # a call on the second host
    assert axis_ranks(ranks, ParallelStrategy(dp=2, tp=2), 10, "tp") == (10, 11)
    assert axis_ranks(ranks, ParallelStrategy(dp=2, tp=2), 10, "dp") == (8, 10)
    assert axis_ranks(ranks, ParallelStrategy(tp=2, pp=2), 9, "pp") == (9, 11)
    assert global_coords(ranks, ParallelStrategy(dp=4), 3) is None
    with pytest.raises(ValueError, match="do not match"):
        rank_grid([0, 1, 2], ParallelStrategy(dp=2))
    with pytest.raises(ValueError, match="axis='ep'"):
        axis_ranks(ranks, ParallelStrategy(dp=4), 8, "ep")


def groups_body(rank, world_size):
    calls = [
        ([0, 1, 2, 3], ParallelStrategy(dp=2, tp=2)),
        ([2, 3], ParallelStrategy(tp=2)),  # a subset: ranks 0 and 1 help create it and get None
        ([0, 1], ParallelStrategy(pp=2)),
        ([0, 1, 2, 3], ParallelStrategy(dp=2, tp=2)),  # repeated: served from the cache
        ([0, 1, 2, 3], ParallelStrategy(tp=2, pp=2)),  # pp columns (0, 2) and (1, 3)
    ]
    groups = build_plan_groups(calls, device_type="cpu")
    assert groups[3] is groups[0]
    g = groups[0]
    assert g.mesh.mesh_dim_names == ("pp", "dp", "tp") and tuple(g.mesh.shape) == (1, 2, 2)
    assert tuple(g.mesh.get_coordinate()) == g.coords == ParallelStrategy(dp=2, tp=2).coords(rank)
    # Each axis group reduces over exactly the ranks the pure map names.
    for axis in ("dp", "tp"):
        value = torch.tensor([2.0**rank])
        dist.all_reduce(value, group=g.group(axis))
        assert value.item() == sum(2.0**r for r in g.axis_ranks(axis)), axis
    sub = groups[1]
    assert (sub is None) == (rank in (0, 1))
    if sub is not None:
        value = torch.tensor([float(rank)])
        dist.all_reduce(value, group=sub.group("tp"))
        assert value.item() == 5.0 and sub.global_rank(0, 0, 1) == 3
    assert (groups[2] is None) == (rank in (2, 3))
    # A pipelined call's columns get a second group each (pipelined generation's tokens travel back on it)
    column = groups[4].axis_ranks("pp")
    assert column == (rank % 2, rank % 2 + 2) and pp_return_group((0, 1)) is not None
    assert pp_return_group((0, 3)) is None and pp_return_group(column) is not groups[4].group("pp")
    value = torch.tensor([2.0**rank])
    dist.all_reduce(value, group=pp_return_group(column))
    assert value.item() == sum(2.0**r for r in column)
    with pytest.raises(ValueError, match="must be increasing"):
        build_call_groups([3, 2], ParallelStrategy(tp=2))
    with pytest.raises(ValueError, match="outside the pool"):
        build_call_groups([4, 5], ParallelStrategy(tp=2))


@pytest.mark.distributed
def test_call_groups_on_subsets_of_the_pool():
    run_world(groups_body, 4)
