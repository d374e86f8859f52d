"""ParallelStrategy's rank order and its typed coordinates."""

from __future__ import annotations

import pytest

from rlflow.strategy import ParallelStrategy, RankCoords


def test_coords_are_a_typed_record_in_rank_order_that_still_unpacks():
    s = ParallelStrategy(dp=3, tp=2, pp=2)
    coords = [s.coords(r) for r in range(s.world_size)]
    assert all(isinstance(c, RankCoords) for c in coords)
    # tp innermost, then dp, then pp: rank = (pp * dp + dp_rank) * tp + tp_rank
    assert coords[:4] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)] and coords[6] == RankCoords(pp=1, dp=0, tp=0)
    for rank, c in enumerate(coords):
        pp_rank, dp_rank, tp_rank = c
        assert (c.pp, c.dp, c.tp) == (pp_rank, dp_rank, tp_rank)
        assert s.rank_of(pp_rank=c.pp, dp_rank=c.dp, tp_rank=c.tp) == rank


@pytest.mark.parametrize("rank", [-1, 4])
def test_a_rank_outside_the_call_is_refused(rank):
    with pytest.raises(ValueError, match=f"rank={rank} outside world_size=4"):
        ParallelStrategy(dp=2, tp=2).coords(rank)


def test_degrees_must_be_positive():
    with pytest.raises(ValueError, match="tp=0 must be >= 1"):
        ParallelStrategy(tp=0)
