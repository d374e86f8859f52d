"""Parallel strategies and rank coordinates: how the ranks of one model function call are arranged.

A *parallel strategy* ``(dp, tp, pp)`` arranges the devices of a call's mesh. Ranks inside a
call are ordered with tp innermost, then dp, then pp::

    rank = (pp_rank * dp + dp_rank) * tp + tp_rank

so tensor-parallel peers are neighbours (and stay inside a host), and the order equals a
``torch.distributed.device_mesh.DeviceMesh`` of shape ``(pp, dp, tp)`` built over
``arange(world_size)`` with ``mesh_dim_names=("pp", "dp", "tp")``.

This module sits at the bottom of rlflow, beside :mod:`rlflow.protocol`: the controller
dispatches by these coordinates, the process groups and layouts are built from them, and the
planner searches over strategies; it imports nothing from rlflow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class RankCoords(NamedTuple):
    """``(pp, dp, tp)``: the pipeline stage, data-parallel rank and tensor-parallel rank of one
    rank of a call. A tuple, so ``pp_rank, dp_rank, tp_rank = strategy.coords(r)`` unpacks it."""

    pp: int
    dp: int
    tp: int


@dataclass(frozen=True)
class ParallelStrategy:
    """``(dp, tp, pp)``: data-, tensor- and pipeline-parallel degrees of one call.

    >>> s = ParallelStrategy(dp=2, tp=2, pp=2)
    >>> s.rank_of(pp_rank=1, dp_rank=0, tp_rank=1), s.coords(5)
    (5, RankCoords(pp=1, dp=0, tp=1))
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        """Rank inside the call of the given coordinates (tp innermost, pp outermost)."""
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    def coords(self, rank: int) -> RankCoords:
        """The coordinates of a rank inside the call.

        Raises:
            ValueError: ``rank`` outside ``[0, world_size)``.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} outside world_size={self.world_size} of {self}")
        return RankCoords(pp=rank // (self.tp * self.dp), dp=(rank // self.tp) % self.dp, tp=rank % self.tp)

    def __str__(self) -> str:
        return f"(dp={self.dp},tp={self.tp},pp={self.pp})"

    def to_dict(self) -> dict:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp}

    @classmethod
    def from_dict(cls, d: dict) -> ParallelStrategy:
        return cls(**d)
