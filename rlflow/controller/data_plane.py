"""Data plane: rows travel worker → object store → worker; the driver keeps handles and row order.

* A DataProto held by the driver is split once (row views, no copy) and each part is ``ray.put``
  once: its tensors go into the object store as flat buffers, a row view only its own rows
  (see ``DataProto.__reduce__``), and every rank that needs a part gets the same
  :class:`ray.ObjectRef` (tp/pp replicas share it).
* A non-blocking call returns a :class:`DataFuture`: the refs of each rank's output plus the
  row order of its dp parts. Passed into the next call, its parts go to the next ranks as
  :class:`RemoteRows` handles (refs and row ranges) that the worker fetches itself, so no
  payload passes through the driver. Only row counts (small ints) may be fetched, when the
  parts must be re-split for a different dp size or a balanced order must be expanded.
* :data:`transfer_stats` counts the payload bytes the driver puts and fetches.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import ray
import torch

from rlflow.controller.driver_host import DriverRef
from rlflow.protocol import DataProto, balanced_row_groups, restore_order


@dataclass
class TransferStats:
    """Payload bytes (tensor and array bytes) that passed through this process as a driver."""

    sent_bytes: int = 0  # put into the object store by the driver
    received_bytes: int = 0  # fetched by the driver when collecting results
    num_puts: int = 0

    def reset(self) -> None:
        self.sent_bytes = self.received_bytes = self.num_puts = 0


transfer_stats = TransferStats()


def payload_nbytes(value: Any) -> int:
    """Bytes of the tensors and arrays in ``value`` (DataProto, tensor, array, or a list/tuple/dict of them)."""
    if isinstance(value, DataProto):
        tensors = sum(t.numel() * t.element_size() for _, t in value._items())
        return tensors + sum(payload_nbytes(a) for a in value.non_tensor_batch.values())
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, np.ndarray):
        return len(pickle.dumps(value)) if value.dtype == object else value.nbytes
    if isinstance(value, (list, tuple)):
        return sum(payload_nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(payload_nbytes(v) for v in value.values())
    return 0


def _is_payload(value: Any) -> bool:
    return isinstance(value, (DataProto, torch.Tensor, np.ndarray))


#: Every row of a piece.
ALL_ROWS = slice(None)


@dataclass(frozen=True)
class RemoteRows:
    """Rows that live in the object store: ``concat(ref[rows] for each piece)``, then ``[perm]``.

    ``rows`` is a slice or an array of row positions in that ref's DataProto. Built on the
    driver from a :class:`DataFuture`; fetched inside the worker by :meth:`materialize`.
    """

    pieces: tuple[tuple[ray.ObjectRef, slice | np.ndarray], ...]
    perm: np.ndarray | None = None

    def materialize(self) -> DataProto:
        """The rows; pieces this process returned itself come from :data:`local_outputs`, the
        rest from the object store."""
        # A driver-hosted worker's refs hold the very objects its calls returned.
        values = [ref.result() if isinstance(ref, DriverRef) else local_outputs.get(ref) for ref, _ in self.pieces]
        remote = [i for i, value in enumerate(values) if value is None]
        if remote:
            for i, value in zip(remote, ray.get([self.pieces[i][0] for i in remote])):
                values[i] = value
        parts = []
        for value, (_, rows) in zip(values, self.pieces):
            if not isinstance(value, DataProto):
                raise TypeError(f"a future part holds a {type(value).__name__}, expected a DataProto")
            parts.append(value if isinstance(rows, slice) and rows == ALL_ROWS else value[rows])
        data = parts[0] if len(parts) == 1 else DataProto.concat(parts)
        return data if self.perm is None else data[self.perm]


class LocalOutputs:
    """The DataProtos this worker process returned lately, by the id of the task that returned them.

    A call's output part goes to its owner (the driver) through Ray; when the next call reads
    that part on the same worker — one worker running the rollout, the reward and the training
    step, or dp ranks that keep their rows — fetching it back would be a round trip through the
    owner for rows the process still holds. :meth:`RemoteRows.materialize` takes them from here
    instead. Readers get the very object the producer returned, shared as the object store
    shares a part among tp replicas (a method that writes its inputs declares
    ``writable_inputs`` and gets a copy). Only host tensors are kept. Worker tasks create no
    objects but their return values
    (workers never ``ray.put``), so the task id of a ref names the output it refers to. The
    oldest entries go first once the kept tensors exceed ``max_bytes``; a part no longer here is
    fetched from the object store as before.
    """

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, tuple[DataProto, int]] = OrderedDict()
        self._bytes = 0
        self.hits = 0

    def put(self, task_id: str, value: Any) -> None:
        """Keeps ``value`` (a DataProto of host tensors; device memory is never held here)."""
        if not isinstance(value, DataProto) or len(value) == 0:
            return
        if any(t.device.type != "cpu" for _, t in value._items()):
            return
        nbytes = payload_nbytes(value)
        if nbytes > self.max_bytes:
            return
        self._items[task_id] = (value, nbytes)
        self._bytes += nbytes
        while self._bytes > self.max_bytes:
            _, (_, dropped) = self._items.popitem(last=False)
            self._bytes -= dropped

    def get(self, ref: ray.ObjectRef) -> DataProto | None:
        item = self._items.get(ref.task_id().hex()) if self._items else None
        if item is None:
            return None
        self.hits += 1
        return item[0]

    def clear(self) -> None:
        self._items.clear()
        self._bytes = 0


#: This process's :class:`LocalOutputs` (filled by ``WorkerHost.execute``).
local_outputs = LocalOutputs()


def materialize_args(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Replaces every top-level :class:`RemoteRows` argument with its DataProto (runs in the worker)."""

    def fetch(v: Any) -> Any:
        return v.materialize() if isinstance(v, RemoteRows) else v

    return tuple(fetch(a) for a in args), {k: fetch(v) for k, v in kwargs.items()}


@dataclass(eq=False)
class DataFuture:
    """The pending result of a non-blocking call.

    Attributes:
        refs: one ref per rank that ran the call.
        fetch: fetches refs (with errors naming the failing rank); given by the worker group.
        collect: turns the fetched outputs into the call's result.
        part_index: for DataProto modes, positions in ``refs`` of the dp parts, in dp order.
        order: for DataProto modes, the input row positions each part received (``None``: the
            parts hold consecutive rows in order).
        num_rows_refs: row count of each part's output (small objects), for re-splitting.
        weigh: ``weigh(key)`` → per-row weights of each part's output (``DataProto.row_weights``,
            computed where the part lives), for a token-balanced re-split.
    """

    refs: list[ray.ObjectRef]
    fetch: Callable[[list[ray.ObjectRef]], list] = field(repr=False)
    collect: Callable[[list], Any] = field(repr=False)
    part_index: list[int] | None = None
    order: list[np.ndarray] | None = None
    num_rows_refs: list[ray.ObjectRef] | None = field(default=None, repr=False)
    weigh: Callable[[str], list[np.ndarray]] | None = field(default=None, repr=False)
    _sizes: list[int] | None = field(default=None, repr=False)
    _weights: dict[str, list[np.ndarray]] = field(default_factory=dict, repr=False)

    @property
    def parts(self) -> list[ray.ObjectRef] | None:
        return None if self.part_index is None else [self.refs[i] for i in self.part_index]

    def get(self) -> Any:
        """Waits for every rank and returns the collected result (payload passes through the driver)."""
        outputs = self.fetch(self.refs)
        transfer_stats.received_bytes += payload_nbytes(outputs)
        return self.collect(outputs)

    def part_sizes(self) -> list[int]:
        """Rows of each dp part's output; waits for the producing call (fetches small ints only)."""
        if self._sizes is None:
            sizes = [int(n) for n in self.fetch(self.num_rows_refs)]
            if min(sizes) < 0:
                raise TypeError(f"parts {[i for i, n in enumerate(sizes) if n < 0]} of the future are not DataProtos")
            self._sizes = sizes
        return self._sizes

    def row_weights(self, key: str) -> list[np.ndarray]:
        """Per-row weights (``key`` summed over dim 1) of each dp part's output; fetches small arrays only."""
        if key not in self._weights:
            self._weights[key] = self.weigh(key)
        return self._weights[key]

    def positions(self) -> list[np.ndarray] | None:
        """Positions of each part's output rows in the collected result (``None``: consecutive)."""
        return None if self.order is None else expand_order(self.order, self.part_sizes())


def expand_order(order: Sequence[np.ndarray], out_sizes: Sequence[int]) -> list[np.ndarray]:
    """Output positions of each part, given the input positions it received.

    A part may return ``k`` rows per input row (e.g. ``k`` samples per prompt), the same ``k``
    for every part; input row ``i`` then owns output rows ``i*k .. i*k+k-1``.

    >>> expand_order([np.array([2, 0]), np.array([1])], [4, 2])
    [array([4, 5, 0, 1]), array([2, 3])]
    """
    in_sizes = [len(o) for o in order]
    if list(out_sizes) == in_sizes:
        return list(order)
    factors = {n_out // n_in for n_out, n_in in zip(out_sizes, in_sizes) if n_in}
    k = factors.pop() if len(factors) == 1 else None
    if k is None or any(n_out != k * n_in for n_out, n_in in zip(out_sizes, in_sizes)):
        raise ValueError(
            f"cannot restore the row order: parts received {in_sizes} rows but returned {list(out_sizes)}; "
            "a balanced split needs every part to return the same number of rows per input row"
        )
    return [(np.asarray(o, dtype=np.int64)[:, None] * k + np.arange(k)).reshape(-1) for o in order]


def collect_rows(outputs: Sequence[Any], order: Sequence[np.ndarray] | None) -> DataProto:
    """Concatenates dp-part outputs, restoring the original row order when the split reordered rows."""
    for i, out in enumerate(outputs):
        if not isinstance(out, DataProto):
            raise TypeError(f"part {i} returned a {type(out).__name__}; DataProto modes need DataProto outputs")
    if order is None:
        return DataProto.concat(list(outputs))
    return restore_order(outputs, expand_order(order, [len(o) for o in outputs]))


@dataclass
class RowSplit:
    """One argument split into ``n`` dp parts: DataProtos (driver-held) or :class:`RemoteRows`."""

    parts: list[Any]
    order: list[np.ndarray] | None
    sizes: Callable[[], list[int]]


def even_sizes(total: int, n: int, group_size: int = 1) -> list[int]:
    """``n`` sizes summing to ``total`` that differ by at most one group, larger ones first.

    >>> even_sizes(10, 3), even_sizes(12, 2, group_size=4)
    ([4, 3, 3], [8, 4])
    """
    if total % group_size:
        raise ValueError(f"{total} rows do not form whole groups of {group_size} rows")
    base, extra = divmod(total // group_size, n)
    return [(base + (1 if i < extra else 0)) * group_size for i in range(n)]


def split_rows(
    value: DataProto | DataFuture,
    n: int,
    like: RowSplit | None = None,
    group_size: int = 1,
    balance_by: str | None = None,
) -> RowSplit:
    """Splits one DataProto argument into ``n`` dp parts; ``like`` is the first argument's split to follow.

    Every part holds whole groups of ``group_size`` consecutive rows. With ``balance_by`` (a
    batch key, e.g. ``"attention_mask"``) the parts carry nearly equal sums of that key (tokens)
    and equal numbers of groups give or take one; otherwise consecutive rows, sizes differing by
    at most one group. A balanced split reorders rows; the collect restores the order.
    """
    if isinstance(value, DataFuture) and value.part_index is None:
        value = value.get()  # not rows: the driver must materialise it
    if isinstance(value, DataFuture):
        if balance_by is not None and n > 1:
            split = _balanced_future(value, n, group_size, balance_by)
        else:
            split = _split_future(value, n, group_size)
        if like is not None and not _same_order(split.order, like.order):
            raise ValueError("DataProto arguments of one call are split differently; pass one batch or union them")
        return split
    if not isinstance(value, DataProto):
        raise TypeError(f"DataProto dispatch modes take DataProto or DataFuture arguments, got {type(value).__name__}")
    if like is not None:
        if like.order is not None:
            return RowSplit([value[o] for o in like.order], like.order, like.sizes)
        return RowSplit(value.split(like.sizes()), None, like.sizes)
    if balance_by is not None and n > 1:
        rows = balanced_row_groups(value.row_weights(balance_by), n, group_size)
        order = [np.asarray(r, dtype=np.int64) for r in rows]
        return RowSplit([value[o] for o in order], order, lambda: [len(o) for o in order])
    sizes = even_sizes(len(value), n, group_size)
    return RowSplit(value.split(sizes), None, lambda: sizes)


def _balanced_future(fut: DataFuture, n: int, group_size: int, key: str) -> RowSplit:
    """A token-balanced split of rows that live in the object store; each rank fetches its rows itself.

    Groups are consecutive rows of the collected result (the order :meth:`DataFuture.get` gives).
    The driver fetches only the per-row weights; rank ``r`` gets, from every part holding some
    of its rows, exactly those rows.
    """
    parts, weights = fut.parts, fut.row_weights(key)
    sizes = [len(w) for w in weights]
    starts = np.cumsum([0, *sizes])
    positions = fut.positions() or [np.arange(a, b) for a, b in zip(starts[:-1], starts[1:])]
    part_of = np.repeat(np.arange(len(parts)), sizes)  # part of each row, rows in part order
    row_in_part = np.concatenate([np.arange(k) for k in sizes])
    at = np.empty(starts[-1], dtype=np.int64)  # collected position -> row in part order
    at[np.concatenate(positions)] = np.arange(starts[-1])
    collected_weights = np.concatenate(weights)[at]
    pieces, order = [], []
    for rows in balanced_row_groups(collected_weights.tolist(), n, group_size):
        flat = at[np.asarray(rows, dtype=np.int64)]
        chunk, received = [], []
        for j in np.unique(part_of[flat]):
            mine = np.sort(row_in_part[flat[part_of[flat] == j]])
            chunk.append((parts[j], mine))
            received.append(positions[j][mine])
        pieces.append(RemoteRows(tuple(chunk)) if chunk else RemoteRows(((parts[0], slice(0, 0)),)))
        order.append(np.concatenate(received) if received else np.zeros(0, dtype=np.int64))
    return RowSplit(pieces, order, lambda: [len(o) for o in order])


def _same_order(a: list[np.ndarray] | None, b: list[np.ndarray] | None) -> bool:
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def _split_future(fut: DataFuture, n: int, group_size: int = 1) -> RowSplit:
    parts = fut.parts
    if len(parts) == n:
        # Same dp size: each rank keeps the rows the previous call's rank produced.
        return RowSplit([RemoteRows(((ref, ALL_ROWS),)) for ref in parts], fut.positions(), fut.part_sizes)
    sizes, positions = fut.part_sizes(), fut.positions()
    targets = even_sizes(sum(sizes), n, group_size)
    starts = np.cumsum([0, *sizes])
    pieces, begin = [], 0
    for size in targets:
        end, chunk = begin + size, []
        for j, ref in enumerate(parts):
            lo, hi = max(begin, starts[j]), min(end, starts[j + 1])
            if lo < hi:
                chunk.append((ref, slice(int(lo - starts[j]), int(hi - starts[j]))))
        pieces.append(RemoteRows(tuple(chunk)) if chunk else RemoteRows(((parts[0], slice(0, 0)),)))
        begin = end
    order = None
    if positions is not None:
        flat, bounds = np.concatenate(positions), np.cumsum([0, *targets])
        order = [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    return RowSplit(pieces, order, lambda: targets)


def whole_rows(fut: DataFuture) -> RemoteRows | Any:
    """A future as one argument: a :class:`RemoteRows` of all its parts in order, or its driver-side value."""
    if fut.part_index is None:
        return fut.get()
    positions = fut.positions()
    perm = None
    if positions is not None:
        flat = np.concatenate(positions)
        perm = np.empty_like(flat)
        perm[flat] = np.arange(len(flat))
    return RemoteRows(tuple((ref, ALL_ROWS) for ref in fut.parts), perm)


#: Payloads smaller than this travel inside the call (Ray inlines small arguments); larger ones are
#: put into the object store once per call. Equals Ray's ``max_direct_call_object_size``.
INLINE_MAX_BYTES = 100 * 1024


class PayloadCache:
    """Puts each large payload object of one call into the object store once (replicas share the ref).

    Small payloads are passed inline, which is faster than a put; they are serialised once per
    rank that receives them and counted that way in :data:`transfer_stats`.
    """

    def __init__(self, put: bool = True) -> None:
        self.put = put  # False: every payload inline (a driver-hosted worker reads the object itself)
        # id -> (the object, kept alive so that ids stay unique; what is sent; bytes per inline send)
        self._sent: dict[int, tuple[Any, Any, int]] = {}
        self._whole: dict[int, tuple[DataFuture, Any]] = {}

    def convert(self, value: Any) -> Any:
        """A ref or inline value for a payload, :class:`RemoteRows` for a future, else ``value``."""
        if isinstance(value, DataFuture):
            if id(value) not in self._whole:
                self._whole[id(value)] = (value, whole_rows(value))
            value = self._whole[id(value)][1]
        if not _is_payload(value):
            return value
        if id(value) not in self._sent:
            self._sent[id(value)] = (value, *_put_if_large(value)) if self.put else (value, value, 0)
        _, sent, inline_bytes = self._sent[id(value)]
        transfer_stats.sent_bytes += inline_bytes
        return sent


def _put_if_large(value: Any) -> tuple[Any, int]:
    """``(ref, 0)`` after putting a large payload, or ``(value, its bytes)`` for a small one."""
    if isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() > payload_nbytes(value):
        value = value.clone()
    size = payload_nbytes(value)
    if size < INLINE_MAX_BYTES:
        return value, size
    transfer_stats.sent_bytes += size
    transfer_stats.num_puts += 1
    return ray.put(value), 0
