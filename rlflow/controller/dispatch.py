"""Built-in dispatch and collect functions, one pair per :class:`~rlflow.controller.decorator.Dispatch` mode.

A dispatch turns the driver-side arguments into one ``(args, kwargs)`` per rank of the group
(or view); a collect turns the per-rank outputs into the call's result. The group only needs
``world_size`` and ``strategy`` (a :class:`~rlflow.strategy.ParallelStrategy` whose
product is ``world_size``; rank order ``rank = (pp_rank*dp + dp_rank)*tp + tp_rank``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from rlflow.controller.data_plane import DataFuture, RowSplit, collect_rows, split_rows
from rlflow.controller.decorator import Dispatch, Execute, MethodSpec
from rlflow.protocol import DataProto
from rlflow.strategy import ParallelStrategy


class GroupShape(Protocol):
    world_size: int
    strategy: ParallelStrategy
    row_group_size: int
    balance_by: str | None


@dataclass
class Dispatched:
    """Per-rank arguments of one call, and what its collect needs.

    Attributes:
        args: positional arguments for each rank (index = rank in the group).
        kwargs: keyword arguments for each rank.
        part_index: DataProto modes: the ranks whose outputs are the dp parts, in dp order.
        order: DataProto modes: input row positions of each dp part (``None``: consecutive rows).
    """

    args: list[tuple]
    kwargs: list[dict]
    part_index: list[int] | None = None
    order: list[np.ndarray] | None = None


_PROTO_MODES = (Dispatch.DP_COMPUTE_PROTO, Dispatch.DP_COMPUTE_PROTO_WITH_FUNC, Dispatch.MESH_PROTO)


def dispatch(group: GroupShape, spec: MethodSpec, args: tuple, kwargs: dict) -> Dispatched:
    """Arguments for every rank of ``group`` under ``spec``'s dispatch mode."""
    mode, world = spec.dispatch_mode, group.world_size
    if mode is None:
        per_args, per_kwargs = spec.dispatch_fn(group, *args, **kwargs)
        return Dispatched(*_transpose(per_args, per_kwargs, world, "dispatch_fn output"))
    if mode in (Dispatch.RANK_ZERO, Dispatch.ONE_TO_ALL):
        return Dispatched([tuple(args)] * world, [dict(kwargs)] * world)
    if mode in (Dispatch.ALL_TO_ALL, Dispatch.DP_COMPUTE):
        return Dispatched(*_transpose(args, kwargs, world, f"{mode.name} argument"))
    if mode is Dispatch.MESH_PROTO:
        strategy = group.strategy
        dp_of_rank = [strategy.coords(r).dp for r in range(world)]
        last_stage = [strategy.rank_of(strategy.pp - 1, d, 0) for d in range(strategy.dp)]
        return _dispatch_rows(args, kwargs, strategy.dp, dp_of_rank, last_stage, *_row_split(group))
    if mode is Dispatch.DP_COMPUTE_PROTO_WITH_FUNC:
        if not args or not callable(args[0]):
            raise TypeError("DP_COMPUTE_PROTO_WITH_FUNC needs a function as the first argument")
        call = _dispatch_rows(args[1:], kwargs, world, list(range(world)), list(range(world)), *_row_split(group))
        call.args = [(args[0], *a) for a in call.args]
        return call
    # DP_COMPUTE_PROTO and DP_COMPUTE_METRIC: every rank is a dp rank.
    return _dispatch_rows(args, kwargs, world, list(range(world)), list(range(world)), *_row_split(group))


def _row_split(group: GroupShape) -> tuple[int, str | None]:
    """How the group splits rows over dp: ``(row_group_size, balance_by)``."""
    return getattr(group, "row_group_size", 1), getattr(group, "balance_by", None)


def collect(group: GroupShape, spec: MethodSpec, call: Dispatched, outputs: list) -> Any:
    """The result of a call from the outputs of every rank that ran it."""
    if spec.execute_mode is Execute.RANK_ZERO:
        return outputs[0]
    mode = spec.dispatch_mode
    if mode is None:
        return spec.collect_fn(group, outputs)
    if mode in _PROTO_MODES:
        return collect_rows([outputs[i] for i in call.part_index], call.order)
    if mode is Dispatch.DP_COMPUTE_METRIC:
        return [outputs[i] for i in call.part_index]
    return list(outputs)


def returns_rows(spec: MethodSpec) -> bool:
    """True when the call's dp-part outputs are DataProto rows that a later call may consume in place."""
    return spec.execute_mode is Execute.ALL and spec.dispatch_mode in _PROTO_MODES


def _is_rows(value: Any) -> bool:
    return isinstance(value, (DataProto, DataFuture))


def _dispatch_rows(
    args: Sequence,
    kwargs: dict,
    num_parts: int,
    part_of_rank: list[int],
    part_index: list[int],
    group_size: int = 1,
    balance_by: str | None = None,
) -> Dispatched:
    """Splits DataProto/DataFuture arguments into ``num_parts`` parts; rank ``r`` gets part ``part_of_rank[r]``.

    Other arguments go to every rank unchanged. The first DataProto argument decides the split
    (even, or balanced by the sums of the batch key ``balance_by``); the others follow it row
    for row. With ``group_size > 1`` parts hold whole groups of that many consecutive rows.
    """
    lead: RowSplit | None = None
    split_args: list[Any] = []
    for value in [*args, *kwargs.values()]:
        if _is_rows(value):
            split = split_rows(value, num_parts, like=lead, group_size=group_size, balance_by=balance_by)
            lead = lead or split
            split_args.append(split.parts)
        else:
            split_args.append(None)
    if lead is None:
        raise TypeError("DataProto dispatch modes need at least one DataProto or DataFuture argument")
    keys, num_pos = list(kwargs), len(args)
    per_args, per_kwargs = [], []
    for part in part_of_rank:
        values = [v if s is None else s[part] for v, s in zip([*args, *kwargs.values()], split_args)]
        per_args.append(tuple(values[:num_pos]))
        per_kwargs.append(dict(zip(keys, values[num_pos:])))
    return Dispatched(per_args, per_kwargs, part_index, lead.order)


def _transpose(args: Sequence, kwargs: dict, world: int, what: str) -> tuple[list[tuple], list[dict]]:
    """Per-argument lists of ``world`` items → per-rank argument tuples."""
    for name, value in [*((f"#{i}", a) for i, a in enumerate(args)), *kwargs.items()]:
        if not isinstance(value, (list, tuple)) or len(value) != world:
            got = f"length {len(value)}" if isinstance(value, (list, tuple)) else type(value).__name__
            raise ValueError(f"{what} {name} must be a list with one item per rank ({world}), got {got}")
    per_args = [tuple(a[r] for a in args) for r in range(world)]
    per_kwargs = [{k: v[r] for k, v in kwargs.items()} for r in range(world)]
    return per_args, per_kwargs
