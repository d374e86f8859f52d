"""Reshard planning: a pure function from two layouts and the host map to a list of transfers.

:func:`plan_reshard` looks at every slice a destination rank must hold and cuts it into
*pieces*, each inside one source shard. Every piece comes from the cheapest rank holding it:

1. the destination itself (a local copy, no communication);
2. else a holder on the same host (NVLink / shared memory);
3. else a holder on another host (network).

Among equally cheap holders the one with the fewest elements assigned so far is taken, so
replicated sources share the work. Finally, pieces that go from one source to the same set
of destinations are merged into one :class:`Transfer` — one packed buffer, sent as a
broadcast (or as point-to-point sends) by :mod:`rlflow.parallel.executor`.

Every destination rank receives each element it needs exactly once, from the cheapest tier
that holds it, so the bytes per tier (:func:`transfer_bytes_summary`) are the minimum for
the two layouts; the choice among equal holders only moves load between links.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import numpy as np

from rlflow.parallel.layout import Box, Layout


class Piece(NamedTuple):
    """A box of one parameter, in full-tensor coordinates (a named tuple: plans hold thousands)."""

    name: str
    box: Box

    @property
    def numel(self) -> int:
        n = 1
        for a, b in self.box:
            n *= b - a
        return n


@dataclass(frozen=True)
class Transfer:
    """The same pieces sent from ``src`` to every rank of ``dsts`` (global ranks).

    ``dsts == (src,)`` is a local copy. The order of ``pieces`` is the packing order.
    """

    src: int
    dsts: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.pieces)


@dataclass(frozen=True)
class ReshardPlan:
    """Transfers that turn ``src`` (source layout) into ``dst`` (destination layout).

    Attributes:
        src, dst: the two layouts (global ranks may overlap or not).
        hosts: ``(global rank, host)`` of every rank of both layouts.
        copies: local copies (``dsts == (src,)``).
        transfers: payloads that cross processes, in a fixed order every rank agrees on.
    """

    src: Layout
    dst: Layout
    hosts: tuple[tuple[int, int], ...]
    copies: tuple[Transfer, ...]
    transfers: tuple[Transfer, ...] = field(repr=False)

    @cached_property
    def host_of(self) -> dict[int, int]:
        return dict(self.hosts)

    @cached_property
    def ranks(self) -> tuple[int, ...]:
        """Every global rank taking part (source or destination), sorted."""
        return tuple(sorted(set(self.src.ranks) | set(self.dst.ranks)))

    def sends(self, rank: int) -> list[Transfer]:
        """Transfers global rank ``rank`` sends, in plan order."""
        return [t for t in self.transfers if t.src == rank]

    def receives(self, rank: int) -> list[Transfer]:
        """Transfers global rank ``rank`` receives, in plan order."""
        return [t for t in self.transfers if rank in t.dsts]

    def local_copies(self, rank: int) -> list[Transfer]:
        return [t for t in self.copies if t.src == rank]


def _check_same_model(src: Layout, dst: Layout) -> None:
    a = {p.name: p.shape for p in src.params}
    b = {p.name: p.shape for p in dst.params}
    if a != b:
        diff = sorted(set(a.items()) ^ set(b.items()))[:5]
        raise ValueError(f"source and destination layouts describe different parameters, e.g. {diff}")


def _hosts(src: Layout, dst: Layout, host_of: Mapping[int, int] | None) -> dict[int, int]:
    ranks = sorted(set(src.ranks) | set(dst.ranks))
    if host_of is None:
        return {r: 0 for r in ranks}
    missing = [r for r in ranks if r not in host_of]
    if missing:
        raise ValueError(f"host_of has no host for global ranks {missing}")
    return {r: int(host_of[r]) for r in ranks}


@dataclass
class _Holders:
    """Ranks (sorted) holding one distinct box of a parameter, also grouped by host."""

    ranks: tuple[int, ...]
    by_host: dict[int, list[int]]
    _split: dict[int, tuple[bool, tuple[int, ...]]] = field(default_factory=dict)

    @cached_property
    def rank_set(self) -> set[int]:
        return set(self.ranks)

    def split(self, src: int) -> tuple[bool, tuple[int, ...]]:
        """``(src is a holder, the other holders sorted)`` — the receivers of a single-source piece."""
        if src not in self.rank_set:
            return False, self.ranks
        if src not in self._split:
            self._split[src] = (True, tuple(r for r in self.ranks if r != src))
        return self._split[src]


def _distinct_boxes(
    holders: list[tuple[Box, tuple[int, ...]]], host_of: dict[int, int]
) -> tuple[np.ndarray, list[_Holders]]:
    """A layout's holder list as an array of boxes ``(n, ndim, 2)`` and who holds each."""
    boxes, groups = [], []
    for box, ranks in holders:
        by_host: dict[int, list[int]] = defaultdict(list)
        for r in ranks:
            by_host[host_of[r]].append(r)
        boxes.append(box)
        groups.append(_Holders(ranks, dict(by_host)))
    ndim = len(boxes[0]) if boxes else 0
    return np.array(boxes, dtype=np.int64).reshape(len(boxes), ndim, 2), groups


# One piece of a parameter with its holders and receivers: (box, numel, holders, receivers).
_Match = tuple[Box, int, _Holders, _Holders]


class _Assigner:
    """Chooses a holder per (piece, destination) and merges pieces with equal routes."""

    def __init__(self) -> None:
        self.load: dict[int, int] = defaultdict(int)  # elements assigned to each source rank
        # (src, dsts) -> pieces as (param name, box); insertion order is the packing order.
        self.merged: dict[tuple[int, tuple[int, ...]], list[tuple[str, Box]]] = defaultdict(list)

    def assign(self, name: str, matches: list[_Match]) -> None:
        merged, load = self.merged, self.load
        for box, numel, holders, receivers in matches:
            if len(holders.ranks) == 1:  # the common case (FSDP sources): one holder broadcasts to all
                src = holders.ranks[0]
                local, remote = receivers.split(src)
                if local:
                    merged[(src, (src,))].append((name, box))
                if remote:
                    merged[(src, remote)].append((name, box))
                    load[src] += numel * len(remote)
            else:
                self._assign_replicated(name, box, numel, holders, receivers)

    def _assign_replicated(self, name: str, box: Box, numel: int, holders: _Holders, receivers: _Holders) -> None:
        held = holders.rank_set
        routes: dict[int, list[int]] = defaultdict(list)
        for host, dsts in receivers.by_host.items():
            candidates = holders.by_host.get(host) or holders.ranks  # same host first, else any host
            for d in dsts:
                if d in held:
                    routes[d].append(d)  # local copy
                    continue
                src = candidates[0] if len(candidates) == 1 else min(candidates, key=lambda h: (self.load[h], h))
                routes[src].append(d)
                self.load[src] += numel
        for src, dsts in routes.items():
            if src in dsts:
                self.merged[(src, (src,))].append((name, box))
            remote = tuple(sorted(d for d in dsts if d != src))
            if remote:
                self.merged[(src, remote)].append((name, box))

    def transfers(self) -> tuple[tuple[Transfer, ...], tuple[Transfer, ...]]:
        copies, sends = [], []
        for (src, dsts), pieces in sorted(self.merged.items()):
            transfer = Transfer(src, dsts, tuple(map(Piece._make, pieces)))
            (copies if dsts == (src,) else sends).append(transfer)
        return tuple(copies), tuple(sends)


def _matches(src_boxes: np.ndarray, holders: list[_Holders], dst_boxes: np.ndarray, receivers: list[_Holders]):
    """Every non-empty intersection of a destination box with a source box."""
    # (n_dst, n_src, ndim): intersection of every destination box with every source box.
    lo = np.maximum(dst_boxes[:, None, :, 0], src_boxes[None, :, :, 0])
    hi = np.minimum(dst_boxes[:, None, :, 1], src_boxes[None, :, :, 1])
    ts, ss = np.nonzero((hi > lo).all(axis=-1))
    los, his = lo[ts, ss], hi[ts, ss]
    numels = np.prod(his - los, axis=-1).tolist()
    return [
        (tuple(zip(a, b)), n, holders[s], receivers[t])
        for t, s, a, b, n in zip(ts.tolist(), ss.tolist(), los.tolist(), his.tolist(), numels)
    ]


def plan_reshard(src: Layout, dst: Layout, host_of: Mapping[int, int] | None = None) -> ReshardPlan:
    """Plan the transfers that give every rank of ``dst`` its slices, read from ``src``.

    Args:
        src: layout the weights are in now (e.g. the FSDP2 training layout).
        dst: layout to build (e.g. a generation layout); its ranks may overlap ``src``'s.
        host_of: host index of every global rank of both layouts; all on one host if None.

    Returns:
        A :class:`ReshardPlan`; every rank computes the same plan from the same inputs.

    >>> from transformers import LlamaConfig
    >>> from rlflow.parallel.layout import build_layout
    >>> from rlflow.strategy import ParallelStrategy
    >>> cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
    ...                   num_attention_heads=4, num_key_value_heads=2)
    >>> train = build_layout(cfg, ParallelStrategy(dp=2), [0, 1], fsdp=True)
    >>> gen = build_layout(cfg, ParallelStrategy(tp=2), [0, 1])
    >>> plan = plan_reshard(train, gen)
    >>> sorted({(t.src, t.dsts) for t in plan.transfers})
    [(0, (1,)), (1, (0,))]
    """
    _check_same_model(src, dst)
    hosts = _hosts(src, dst, host_of)
    assigner = _Assigner()
    # Parameters repeat per layer: layouts share holder lists between equal parameters, so
    # the intersections are computed once per pair of lists.
    boxes: dict[int, tuple[np.ndarray, list[_Holders]]] = {}
    matches: dict[tuple[int, int], list[_Match]] = {}
    for spec in dst.params:
        src_list, dst_list = src.holders(spec.name), dst.holders(spec.name)
        if not dst_list:
            continue
        if not src_list:
            raise ValueError(f"no source rank holds {spec.name}")
        key = (id(src_list), id(dst_list))
        if key not in matches:
            for lst in (src_list, dst_list):
                if id(lst) not in boxes:
                    boxes[id(lst)] = _distinct_boxes(lst, hosts)
            matches[key] = _matches(*boxes[id(src_list)], *boxes[id(dst_list)])
        assigner.assign(spec.name, matches[key])
    copies, transfers = assigner.transfers()
    return ReshardPlan(src, dst, tuple(sorted(hosts.items())), copies, transfers)


def transfer_bytes_summary(plan: ReshardPlan, itemsize: int = 2) -> dict:
    """Bytes the plan moves, by kind, link, host and rank (point-to-point accounting).

    A transfer to ``k`` destinations counts its payload ``k`` times (each destination
    receives it once). The tier totals depend only on the two layouts and the host map.

    Args:
        plan: a :class:`ReshardPlan`.
        itemsize: bytes per element on the wire (2 for bf16, 4 for fp32).

    Returns:
        ``{"local_bytes", "intra_host_bytes", "inter_host_bytes", "moved_bytes"
        (intra + inter), "num_transfers", "per_link": {(src, dst): bytes},
        "per_host": {host: {"sent_bytes", "received_bytes"}} (inter-host traffic only),
        "per_rank": {rank: {"sent_bytes", "received_bytes"}}}``.
    """
    host_of = plan.host_of
    per_link: dict[tuple[int, int], int] = defaultdict(int)
    per_host = {h: {"sent_bytes": 0, "received_bytes": 0} for h in sorted(set(host_of.values()))}
    per_rank = {r: {"sent_bytes": 0, "received_bytes": 0} for r in plan.ranks}
    intra = inter = 0
    for t in plan.transfers:
        nbytes = t.numel * itemsize
        for d in t.dsts:
            per_link[(t.src, d)] += nbytes
            per_rank[t.src]["sent_bytes"] += nbytes
            per_rank[d]["received_bytes"] += nbytes
            if host_of[t.src] == host_of[d]:
                intra += nbytes
            else:
                inter += nbytes
                per_host[host_of[t.src]]["sent_bytes"] += nbytes
                per_host[host_of[d]]["received_bytes"] += nbytes
    return {
        "local_bytes": sum(t.numel for t in plan.copies) * itemsize,
        "intra_host_bytes": intra,
        "inter_host_bytes": inter,
        "moved_bytes": intra + inter,
        "num_transfers": len(plan.transfers),
        "per_link": dict(per_link),
        "per_host": per_host,
        "per_rank": per_rank,
    }


def minimum_moved_numel(src: Layout, dst: Layout) -> int:
    """Lower bound on elements that must cross processes to build ``dst`` from ``src``.

    Every destination rank must receive each element of its slices that it does not already
    hold in ``src``: ``sum over dst ranks and params of |dst box| - |dst box ∩ own src box|``.
    A plan from :func:`plan_reshard` moves exactly this many (its ``moved_bytes / itemsize``).
    """
    total = 0
    for r in dst.ranks:
        own = src.boxes(r) if r in src.ranks else {}
        for name, box in dst.boxes(r).items():
            need = 1
            for a, b in box:
                need *= b - a
            held = own.get(name)
            if held is not None:
                overlap = 1
                for (a, b), (c, d) in zip(box, held):
                    overlap *= max(0, min(b, d) - max(a, c))
                need -= overlap
            total += need
    return total
