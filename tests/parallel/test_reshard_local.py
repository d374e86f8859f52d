"""apply_reshard_plan: a checkpoint's shards cut into another layout equal the full tensors' slices exactly."""

from __future__ import annotations

import pytest
import torch
from realloc_helpers import tiny_llama_gqa, tiny_qwen2_tied

from rlflow.parallel.layout import build_layout
from rlflow.parallel.reshard import plan_reshard
from rlflow.parallel.reshard_local import apply_reshard_plan
from rlflow.strategy import ParallelStrategy as S

PAIRS = [
    (S(), S(dp=2)),  # one worker's checkpoint resumed data-parallel (FSDP shards)
    (S(dp=2), S()),
    (S(dp=2), S(tp=2)),
    (S(dp=2), S(pp=2)),
    (S(pp=2), S(dp=2, tp=2)),
    (S(dp=3), S(dp=2, pp=2)),  # uneven FSDP chunks, empty trailing shards
    (S(tp=2, pp=2), S(dp=4)),
]


def _full(layout) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {p.name: torch.randn(p.shape, generator=gen) for p in layout.params}


def _shards(layout, full) -> dict[int, dict[str, torch.Tensor]]:
    return {r: {n: full[n][s].clone() for n, s in layout.slices(r).items()} for r in layout.ranks}


@pytest.mark.parametrize("config", [tiny_llama_gqa, tiny_qwen2_tied], ids=["llama", "qwen2_tied"])
@pytest.mark.parametrize(("before", "after"), PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_resharded_shards_equal_the_new_layouts_slices(config, before, after):
    cfg = config()
    src = build_layout(cfg, before, range(before.world_size), fsdp=True)
    dst = build_layout(cfg, after, range(after.world_size), fsdp=True)
    full = _full(src)
    out = apply_reshard_plan(plan_reshard(src, dst), _shards(src, full))
    assert sorted(out) == list(dst.ranks)
    for rank in dst.ranks:
        assert sorted(out[rank]) == sorted(dst.boxes(rank))
        for name, sl in dst.slices(rank).items():
            assert torch.equal(out[rank][name], full[name][sl]), (rank, name)


def test_a_shard_of_the_wrong_shape_is_named():
    cfg = tiny_llama_gqa()
    src = build_layout(cfg, S(dp=2), [0, 1], fsdp=True)
    shards = _shards(src, _full(src))
    shards[1]["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"source rank 1: model.norm.weight has shape \(3,\)"):
        apply_reshard_plan(plan_reshard(src, build_layout(cfg, S(), [0], fsdp=True)), shards)
    del shards[1]
    with pytest.raises(ValueError, match="no shards given for source rank 1"):
        apply_reshard_plan(plan_reshard(src, build_layout(cfg, S(), [0], fsdp=True)), shards)
