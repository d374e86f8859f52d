"""Group-aware dp splits: the samples of one prompt stay on one dp rank (no Ray needed)."""

from __future__ import annotations

import pytest
import torch

from rlflow.controller.data_plane import even_sizes, split_rows
from rlflow.controller.decorator import Dispatch, Execute, MethodSpec
from rlflow.controller.dispatch import dispatch
from rlflow.protocol import DataProto
from rlflow.strategy import ParallelStrategy


class _Shape:
    def __init__(self, strategy: ParallelStrategy, row_group_size: int) -> None:
        self.strategy, self.world_size, self.row_group_size = strategy, strategy.world_size, row_group_size


def test_even_sizes_in_whole_groups():
    assert even_sizes(24, 2, group_size=4) == [12, 12]
    assert even_sizes(20, 3, group_size=4) == [8, 8, 4]
    assert even_sizes(7, 2) == [4, 3]
    with pytest.raises(ValueError, match="whole groups of 4"):
        even_sizes(10, 2, group_size=4)


def test_split_rows_keeps_groups_together():
    uid = torch.arange(5).repeat_interleave(4)  # 5 prompts x 4 samples
    parts = split_rows(DataProto.from_dict({"uid": uid}), 2, group_size=4).parts
    assert [len(p) for p in parts] == [12, 8]
    for part in parts:
        counts = torch.bincount(part.batch["uid"], minlength=5)
        assert set(counts.tolist()) <= {0, 4}, "a prompt's samples were split across dp ranks"


def test_mesh_dispatch_uses_the_view_group_size():
    data = DataProto.from_dict({"uid": torch.arange(6).repeat_interleave(2)})
    spec = MethodSpec(Dispatch.MESH_PROTO, Execute.ALL, blocking=False, materialize_futures=True)
    call = dispatch(_Shape(ParallelStrategy(dp=4, tp=1, pp=1), row_group_size=2), spec, (data,), {})
    sizes = [len(a[0]) for a in call.args]
    assert sizes == [4, 4, 2, 2]
    assert all((a[0].batch["uid"][0::2] == a[0].batch["uid"][1::2]).all() for a in call.args)
