"""The driver as its own only worker: a :class:`WorkerHost` in this process, called as a Ray actor is.

A plan of one CPU worker gains nothing from a second process: the worker would import torch,
tensordict, HF's modeling code and the engines again, and a local Ray costs its own processes
(GCS, raylet, agents) several CPU-seconds to start — on a two-core machine most of the gap
to a single-process trainer's start. :class:`DriverHost` runs the host in the driver instead,
behind the handle the worker group already speaks: ``host.method.remote(*args)`` queues the
call on one thread of its own (a Ray actor's calls run one at a time, in order) and returns a
:class:`DriverRef`, which the worker group's fetch and :func:`wait` take where they take Ray's object refs. Nothing
is serialised: a call's output is the object the next call reads (a method that writes its
inputs still gets a copy, ``WorkerHost.execute``).

What changes for the worker: it shares the driver's process — its torch thread count, its RNG
state, its ``torch.distributed`` default group (destroyed again by :meth:`DriverHost.kill`), its
OpenMP runtime — and a crash of the worker is the driver's. The worker group chooses this only
when asked (``placement.worker_host``).

The OpenMP runtime is shared per process: GNU OpenMP keeps a pool of threads for every thread that
ran a parallel region, and once a process holds more of them than it has cores, every team
stops spinning between regions and sleeps instead — a two-thread matmul of a decode step then
pays a wake-up per call and runs little faster than on one thread. A driver that ran its own
parallel torch work (building a model, measuring the machine) would leave its pool behind and
slow every call of its worker so, for the whole run; queuing a call therefore first releases the
queuing thread's pool (:func:`release_openmp_threads`), which the runtime builds again should
that thread work in parallel later. docs/benchmarks.md shows the effect on a run.

>>> import operator
>>> class Adder:
...     def add(self, a, b):
...         return operator.add(a, b)
>>> host = DriverHost(Adder)
>>> two = host.add.remote(1, 1)
>>> host.add.remote(two, 1).result()  # a ref among the arguments is resolved first, as Ray does
3
>>> host.kill()
"""

from __future__ import annotations

import ctypes
import queue
import re
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

#: The node id every driver-hosted worker reports (there is no Ray node).
DRIVER_NODE_ID = "driver"

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep what the runtime can rebuild
_OPENMP_PAUSE: list[Callable[[int], int] | None] = []  # what the look-up found, once torch was loaded


def _openmp_pause() -> Callable[[int], int] | None:
    """``omp_pause_resource_all`` (OpenMP 5.0) of GNU OpenMP as torch loaded it, found among this
    process's mapped libraries (torch's wheels load their own copy privately); None before torch is
    imported and where torch runs on another runtime. GNU OpenMP's pause ends the calling thread's
    pool only; the standard lets a runtime release the whole process's threads, which would stop
    the worker's team mid-call (LLVM's and Intel's runtimes are left alone)."""
    if not _OPENMP_PAUSE:
        if "torch" not in sys.modules:
            return None
        _OPENMP_PAUSE.append(_find_openmp_pause())
    return _OPENMP_PAUSE[0]


def _find_openmp_pause() -> Callable[[int], int] | None:
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if re.search(r"/libgomp[^/]*\.so", line)})
    except OSError:  # not Linux
        return None
    for path in paths:
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        return pause
    return None


def release_openmp_threads() -> bool:
    """Ends the OpenMP threads this thread's parallel regions keep waiting (its thread pool), so
    that they count no more against the process's cores; the runtime starts them again at this
    thread's next parallel region. True when a runtime released them."""
    pause = _openmp_pause()
    return pause is not None and pause(_OMP_PAUSE_SOFT) == 0


class DriverRef:
    """The pending result of a call queued on a :class:`DriverHost` (a Ray ``ObjectRef``'s counterpart).

    ``item`` picks one element of a tuple result (``options(num_returns=k)``).
    """

    __slots__ = ("_done", "_error", "_item", "_parent", "_value")

    def __init__(self, parent: DriverRef | None = None, item: int | None = None) -> None:
        self._done = threading.Event() if parent is None else parent._done
        self._value: Any = None
        self._error: BaseException | None = None
        self._parent, self._item = parent, item

    def _set(self, value: Any, error: BaseException | None) -> None:
        self._value, self._error = value, error
        self._done.set()

    def result(self, timeout: float | None = None) -> Any:
        """The value; raises what the call raised; ``TimeoutError`` after ``timeout`` seconds."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"a driver-hosted call did not finish within {timeout} s")
        if self._parent is not None:
            value = self._parent.result()
            return value[self._item]
        if self._error is not None:
            raise self._error
        return self._value


def _resolve(value: Any) -> Any:
    # Ray fetches the object refs among a call's top-level arguments before the call runs.
    return value.result() if isinstance(value, DriverRef) else value


class _Method:
    def __init__(self, host: DriverHost, name: str, num_returns: int = 1) -> None:
        self._host, self._name, self._num_returns = host, name, num_returns

    def options(self, num_returns: int = 1) -> _Method:
        return _Method(self._host, self._name, num_returns)

    def remote(self, *args: Any, **kwargs: Any) -> DriverRef | list[DriverRef]:
        host, name = self._host, self._name
        ref = host._submit(lambda *a, **kw: getattr(host.obj, name)(*a, **kw), args, kwargs)
        if self._num_returns == 1:
            return ref
        return [DriverRef(ref, i) for i in range(self._num_returns)]


class DriverHost:
    """An object whose methods run one at a time, in call order, on a thread of this process.

    Args:
        build: makes the object to call (a ``WorkerHost``), on that thread: what it sets per
            thread (torch's intra-op thread count) holds for its calls and leaves the caller's
            thread alone. The object's ``close()``, when it has one, runs on :meth:`kill`.
    """

    def __init__(self, build: Callable[[], Any]) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], DriverRef] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="rlflow-driver-worker", daemon=True)
        self._thread.start()
        self._built = self._submit(build, (), {})

    @property
    def obj(self) -> Any:
        """The object (waits for it to be built; raises what building it raised)."""
        return self._built.result()

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        if not callable(getattr(self.obj, name, None)):
            raise AttributeError(f"{type(self.obj).__name__} has no method {name!r}")
        return _Method(self, name)

    def _submit(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> DriverRef:
        if not self._thread.is_alive():
            raise RuntimeError(f"the driver-hosted {type(self.obj).__name__} was shut down")
        if threading.current_thread() is not self._thread:
            release_openmp_threads()  # the module's docstring says why
        ref = DriverRef()

        def call() -> Any:
            return fn(*(_resolve(a) for a in args), **{k: _resolve(v) for k, v in kwargs.items()})

        self._calls.put((call, ref))
        return ref

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            call, ref = item
            try:
                ref._set(call(), None)
            except BaseException as err:  # handed to whoever waits on the ref, as Ray does
                ref._set(None, err)

    def kill(self) -> None:
        """Runs the queued calls, then the object's ``close()``, and ends the thread."""
        if not self._thread.is_alive():
            return

        def close() -> None:  # runs after the build, the first call queued
            if self._built._error is None:
                getattr(self.obj, "close", lambda: None)()

        closing = self._submit(close, (), {})
        self._calls.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()
        closing.result()


def wait(refs: Sequence[Any]) -> None:
    """Blocks until every ref is ready (``ray.wait`` for all of them), without fetching Ray's values.

    The refs are one group's: all :class:`DriverRef` s, or all Ray object refs.
    """
    if refs and isinstance(refs[0], DriverRef):
        for ref in refs:
            ref._done.wait()
    elif refs:
        import ray

        ray.wait(list(refs), num_returns=len(refs))


__all__ = ["DRIVER_NODE_ID", "DriverHost", "DriverRef", "release_openmp_threads", "wait"]
