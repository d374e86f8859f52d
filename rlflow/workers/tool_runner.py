"""Running a turn's tool calls concurrently, each with a time limit, and counting what happened.

Nothing a tool does stops an episode: a tool that raises, returns a value that is neither a string
nor JSON, or runs past its time limit, and a call the model wrote badly, each become a
:class:`ToolResult` whose content tells the model what went wrong, counted in :class:`ToolStats`.

Tools run on a thread pool, so a slow tool does not hold up the others of the turn. A thread
cannot be stopped: a tool past its limit is reported as timed out and left to finish in the
background, still holding its thread (:class:`ToolRunner` moves later calls to a new pool); code
that must be stopped for real runs in a sandboxed process, not in a thread of the worker.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, fields
from typing import Any

from rlflow.workers.tools import Tool, ToolCall

__all__ = ["ToolResult", "ToolRunner", "ToolStats", "tool_output"]

_STATUSES = ("ok", "malformed", "error", "timeout")


@dataclass(frozen=True)
class ToolResult:
    """What one call returned, as the text the model reads.

    Attributes:
        name: the tool called ("" for a call too malformed to name one).
        content: the tool's output, or what went wrong.
        status: ``ok``, ``malformed`` (the model's call), ``error`` (the tool raised or returned
            a value that is not text or JSON) or ``timeout``.
        seconds: wall time of the call (0 for a malformed call; the limit for a time-out).
    """

    name: str
    content: str
    status: str = "ok"
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.status not in _STATUSES:
            raise ValueError(f"ToolResult status={self.status!r}; expected one of {_STATUSES}")


@dataclass
class ToolStats:
    """Counts of one episode's tool calls (a bad call counts once, in its own kind).

    Attributes:
        calls: calls the model wrote, malformed ones included.
        malformed: calls that could not run (bad JSON, unknown tool, wrong arguments).
        errors: calls whose tool raised or returned a value that is not text or JSON.
        timeouts: calls past the time limit.
        seconds: wall seconds spent in tools, summed over calls (concurrent calls overlap).
    """

    calls: int = 0
    malformed: int = 0
    errors: int = 0
    timeouts: int = 0
    seconds: float = 0.0

    def add(self, results: Sequence[ToolResult]) -> None:
        for r in results:
            self.calls += 1
            self.malformed += r.status == "malformed"
            self.errors += r.status == "error"
            self.timeouts += r.status == "timeout"
            self.seconds += r.seconds

    def metrics(self, prefix: str = "tools/") -> dict[str, float]:
        """``{"tools/calls": ..., "tools/malformed": ..., ...}`` as floats."""
        return {f"{prefix}{f.name}": float(getattr(self, f.name)) for f in fields(self)}


def tool_output(value: Any) -> tuple[str, str | None]:
    """``(text, error)`` of a tool's return value: a string as it is, ``None`` as ``""``, any other
    JSON value as JSON; anything else is an error saying so.

    >>> tool_output(12), tool_output({"a": [1, 2]}), tool_output("x")
    (('12', None), ('{"a": [1, 2]}', None), ('x', None))
    >>> tool_output({1, 2})[1]
    'the tool returned a set, which is neither a string nor a JSON value'
    """
    if isinstance(value, str):
        return value, None
    if value is None:
        return "", None
    try:
        return json.dumps(value), None
    except (TypeError, ValueError):
        return "", f"the tool returned a {type(value).__name__}, which is neither a string nor a JSON value"


class ToolRunner:
    """Runs tool calls on a thread pool, each with ``timeout_s`` seconds; safe to call from several threads.

    The pool is made on the first call and is not pickled: a runner sent to a worker makes its
    own there. A pool whose thread still runs a call past its limit is retired: later calls go
    to a new pool, so tools that hang never starve the calls after them (their threads end when
    they return, if ever).

    Args:
        tools: ``name -> Tool`` (:func:`~rlflow.workers.tools.build_tools`).
        timeout_s: seconds a call may take, counted from when it is handed to the pool.
        max_workers: threads of a pool; more calls at once wait for a thread.
    """

    def __init__(self, tools: Mapping[str, Tool], timeout_s: float = 30.0, max_workers: int = 8) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s}; a tool needs a positive time limit")
        if max_workers < 1:
            raise ValueError(f"max_workers={max_workers}; need >= 1")
        self.tools, self.timeout_s, self.max_workers = dict(tools), float(timeout_s), int(max_workers)
        self.num_retired_pools = 0
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_pool", "_lock")}  # threads do not pickle

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _pool=None, _lock=threading.Lock())

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """One result per call, in the calls' order; the well-formed calls run concurrently."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_workers, thread_name_prefix="rlflow-tool")
            pool = self._pool
            futures: dict[int, Future] = {
                i: pool.submit(_timed, self.tools[c.name].fn, c.arguments) for i, c in enumerate(calls) if not c.error
            }
        wait_futures(futures.values(), timeout=self.timeout_s)
        results, hung = [], False
        for i, call in enumerate(calls):
            if call.error:
                results.append(ToolResult(call.name, f"Error: {call.error}", "malformed"))
            elif not futures[i].done():
                hung |= not futures[i].cancel()  # a queued call never starts; a running one holds its thread
                text = f"Error: tool {call.name!r} did not finish within {self.timeout_s:g} seconds"
                results.append(ToolResult(call.name, text, "timeout", self.timeout_s))
            else:
                results.append(_result(call.name, *futures[i].result()))
        if hung:
            self._retire(pool)
        return results

    def _retire(self, pool: ThreadPoolExecutor) -> None:
        with self._lock:
            if self._pool is pool:  # not already retired by another episode's time-out
                pool.shutdown(wait=False)  # its other calls still run and answer their episodes
                self._pool, self.num_retired_pools = None, self.num_retired_pools + 1

    def close(self) -> None:
        """Lets the pool's threads end once their calls return (a tool past its limit may still run)."""
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None


def _timed(fn: Any, arguments: Mapping[str, Any]) -> tuple[Any, BaseException | None, float]:
    start = time.perf_counter()
    try:
        return fn(**arguments), None, time.perf_counter() - start
    except Exception as err:  # the model reads it; the episode goes on
        return None, err, time.perf_counter() - start


def _result(name: str, value: Any, err: BaseException | None, seconds: float) -> ToolResult:
    if err is not None:
        return ToolResult(name, f"Error: tool {name!r} raised {type(err).__name__}: {err}", "error", seconds)
    text, problem = tool_output(value)
    if problem:
        return ToolResult(name, f"Error: {problem}", "error", seconds)
    return ToolResult(name, text, "ok", seconds)
