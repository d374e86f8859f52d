"""``@register``: declare how a worker method's arguments are split over ranks and its results gathered.

A worker method body holds only the computation. The decorator attaches a :class:`MethodSpec`
to the function; a worker group reads it and builds a driver-side method that dispatches the
arguments, calls the ranks and collects the outputs (see ``rlflow/controller/dispatch.py``).
This module knows nothing about data containers or Ray.

>>> class Echo:
...     @register(dispatch_mode=Dispatch.ONE_TO_ALL)
...     def ping(self, x):
...         return x
>>> method_spec(Echo.ping).dispatch_mode
<Dispatch.ONE_TO_ALL: 'one_to_all'>
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

_SPEC_ATTR = "__rlflow_method_spec__"


class Dispatch(Enum):
    """How a driver-side call's arguments reach the ranks and how outputs come back.

    Ranks are positions in the worker group (or view), ``0..world_size-1``.
    """

    #: Arguments go to rank 0 only; only rank 0 runs; its output is returned.
    RANK_ZERO = "rank_zero"
    #: Every rank gets the same arguments; a list of all outputs is returned.
    ONE_TO_ALL = "one_to_all"
    #: Every argument is a per-rank sequence of length ``world_size``; rank ``i`` gets item ``i``.
    ALL_TO_ALL = "all_to_all"
    #: Like ALL_TO_ALL, for arguments already sharded by the caller (one shard per dp rank).
    DP_COMPUTE = "dp_compute"
    #: DataProto arguments are split over all ranks (uneven sizes differ by at most one row, or
    #: balanced by tokens on a group or view made with ``balance_by``); outputs are
    #: concatenated back in the original row order.
    DP_COMPUTE_PROTO = "dp_compute_proto"
    #: The first argument is a function sent to every rank; the rest as DP_COMPUTE_PROTO.
    DP_COMPUTE_PROTO_WITH_FUNC = "dp_compute_proto_with_func"
    #: DataProto arguments split as DP_COMPUTE_PROTO; the per-rank outputs (metrics) come back as a list.
    DP_COMPUTE_METRIC = "dp_compute_metric"
    #: Mesh-aware DataProto call: split along dp of the group's ``(dp, tp, pp)``, replicated along
    #: tp and pp; outputs are collected from the tp-rank-0 ranks of the last pipeline stage.
    MESH_PROTO = "mesh_proto"


class Execute(Enum):
    """Which ranks run the method."""

    ALL = "all"
    RANK_ZERO = "rank_zero"


DispatchFn = Callable[..., tuple[tuple[list, ...], dict[str, list]]]
CollectFn = Callable[[Any, list], Any]


@dataclass(frozen=True)
class MethodSpec:
    """What ``@register`` declared for one worker method.

    Attributes:
        dispatch_mode: a built-in :class:`Dispatch`, or ``None`` for a user-defined pair.
        dispatch_fn: user-defined ``dispatch_fn(group, *args, **kwargs) -> (args, kwargs)`` whose
            every positional and keyword value is a list with one item per rank; ``None`` for built-ins.
        collect_fn: user-defined ``collect_fn(group, outputs: list) -> result``; ``None`` for built-ins.
        execute_mode: which ranks run the method.
        blocking: the driver-side call waits and returns the collected result; otherwise it
            returns a :class:`~rlflow.controller.data_plane.DataFuture` at once.
        materialize_futures: rows that arrive as object-store handles (from a previous
            non-blocking call) are fetched inside the worker before the method runs; when
            ``False`` the method receives the :class:`~rlflow.controller.data_plane.RemoteRows` handles.
        writable_inputs: DataProto arguments arrive as private copies the method may write in
            place. ``False``: their tensors are views of the object store's shared memory (no
            copy), which the method must only read (see the transport contract in
            ``rlflow/protocol.py``).
    """

    dispatch_mode: Dispatch | None
    execute_mode: Execute
    blocking: bool
    materialize_futures: bool
    dispatch_fn: DispatchFn | None = None
    collect_fn: CollectFn | None = None
    writable_inputs: bool = True


def register(
    dispatch_mode: Dispatch | tuple[DispatchFn, CollectFn] = Dispatch.ALL_TO_ALL,
    execute_mode: Execute = Execute.ALL,
    blocking: bool = True,
    materialize_futures: bool = True,
    writable_inputs: bool = True,
) -> Callable[[Callable], Callable]:
    """Marks a worker method as callable from the driver through a worker group.

    Args:
        dispatch_mode: a :class:`Dispatch`, or a ``(dispatch_fn, collect_fn)`` pair (see :class:`MethodSpec`).
        execute_mode: :attr:`Execute.ALL` or :attr:`Execute.RANK_ZERO`.
        blocking: wait for the result (True) or return a future (False).
        materialize_futures: fetch future rows inside the worker before the call.
        writable_inputs: copy DataProto arguments out of the object store's shared memory
            (``False`` for a method that only reads them: zero-copy).

    Returns:
        A decorator that returns the function unchanged, with its spec attached.

    Raises:
        TypeError: a mode is not one of the accepted types.
    """
    dispatch_fn = collect_fn = None
    if isinstance(dispatch_mode, tuple):
        if len(dispatch_mode) != 2 or not all(callable(f) for f in dispatch_mode):
            raise TypeError(f"dispatch_mode pair must be (dispatch_fn, collect_fn) callables, got {dispatch_mode!r}")
        dispatch_fn, collect_fn = dispatch_mode
        dispatch_mode = None
    elif not isinstance(dispatch_mode, Dispatch):
        raise TypeError(f"dispatch_mode must be a Dispatch or a (dispatch_fn, collect_fn) pair, got {dispatch_mode!r}")
    if not isinstance(execute_mode, Execute):
        raise TypeError(f"execute_mode must be an Execute, got {execute_mode!r}")
    if dispatch_mode is Dispatch.RANK_ZERO:
        execute_mode = Execute.RANK_ZERO  # arguments only ever reach rank 0
    spec = MethodSpec(
        dispatch_mode,
        execute_mode,
        bool(blocking),
        bool(materialize_futures),
        dispatch_fn,
        collect_fn,
        bool(writable_inputs),
    )

    def decorate(func: Callable) -> Callable:
        if not callable(func):
            raise TypeError(f"@register decorates functions, got {func!r}")
        setattr(func, _SPEC_ATTR, spec)
        return func

    return decorate


def method_spec(func: Any) -> MethodSpec | None:
    """The spec ``@register`` attached to ``func`` (a function or bound method), or ``None``."""
    return getattr(func, _SPEC_ATTR, None)


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """Every ``@register``-ed method of a worker class (inherited ones included), by name."""
    methods = {}
    for name in dir(cls):
        if name.startswith("__"):
            continue
        spec = method_spec(getattr(cls, name, None))
        if spec is not None:
            methods[name] = spec
    return methods
