"""The worker side: :class:`Worker` (base of every role class) and :class:`WorkerHost` (one Ray actor per device).

A ``WorkerHost`` is the process on one device. It builds the worker object of every role
colocated on that device (actor, critic, ref, reward, ...) and runs their methods. Rank 0's
host chooses the torch.distributed rendezvous address and a free port; every host learns it
before the role objects are built, so ``Worker.__init__`` may already use it.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import numpy as np
import ray
import torch

from rlflow.controller.data_plane import local_outputs, materialize_args
from rlflow.controller.decorator import Dispatch, method_spec, register
from rlflow.controller.driver_host import DRIVER_NODE_ID
from rlflow.controller.errors import TaskError, WorkerError
from rlflow.protocol import DataProto
from rlflow.rendezvous import free_port


@dataclass(frozen=True)
class WorkerInfo:
    """Where one worker sits; identical for all roles colocated in one process.

    Attributes:
        rank: global rank, the index of the worker's bundle in the resource pool.
        world_size: number of workers in the pool.
        local_rank: index among the workers of its node.
        local_world_size: workers on its node.
        node_rank: index of its node among the pool's nodes.
        node_id: Ray node id (hex), ``None`` outside Ray.
        master_addr: rendezvous host chosen by rank 0.
        master_port: rendezvous port chosen by rank 0.
        use_gpu: the worker owns one GPU (else a share of CPU).
        threads: torch threads of a CPU worker (1, or every core of a host a plan gives one worker).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    node_id: str | None = None
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    use_gpu: bool = False
    threads: int = 1


_building: tuple[WorkerInfo, str] | None = None  # set by WorkerHost while it constructs a role object


@contextlib.contextmanager
def _worker_context(info: WorkerInfo, role: str) -> Iterator[None]:
    global _building
    previous, _building = _building, (info, role)
    try:
        yield
    finally:
        _building = previous


class Worker:
    """Base class of every role class run by a worker group.

    Rank and placement are available from ``__init__`` on (set in ``__new__``, so a subclass
    need not call ``super().__init__()`` first). Built outside a group, a worker is rank 0 of 1.

    >>> w = Worker()
    >>> w.rank, w.world_size, w.role
    (0, 1, 'worker')
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Worker:
        self = super().__new__(cls)
        info, role = _building or (WorkerInfo(), "worker")
        self._worker_info, self._worker_role = info, role
        return self

    @property
    def info(self) -> WorkerInfo:
        return self._worker_info

    @property
    def role(self) -> str:
        return self._worker_role

    @property
    def rank(self) -> int:
        return self._worker_info.rank

    @property
    def world_size(self) -> int:
        return self._worker_info.world_size

    @property
    def local_rank(self) -> int:
        return self._worker_info.local_rank

    @property
    def node_id(self) -> str | None:
        return self._worker_info.node_id

    @property
    def device(self) -> torch.device:
        """``cuda:0`` on a GPU worker (Ray exposes only its own GPU), else ``cpu``."""
        return torch.device("cuda", 0) if self._worker_info.use_gpu else torch.device("cpu")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_process_group(self, timeout_s: float = 600.0, backend: str | None = None) -> None:
        """Joins the default torch.distributed group of all ``world_size`` workers (all ranks).

        Args:
            timeout_s: seconds after which a collective that cannot complete raises (instead of
                hanging, e.g. when a peer died).
            backend: ``"gloo"`` on CPU and ``"nccl"`` on GPU unless given.

        Colocated roles share the process, so a second call in the same process is a no-op.
        """
        import torch.distributed as dist

        if dist.is_initialized():
            if (dist.get_rank(), dist.get_world_size()) != (self.rank, self.world_size):
                raise RuntimeError(
                    f"torch.distributed is initialised as rank {dist.get_rank()}/{dist.get_world_size()}, "
                    f"expected {self.rank}/{self.world_size}"
                )
            return
        backend = backend or ("nccl" if self._worker_info.use_gpu else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(0)
        dist.init_process_group(
            backend,
            init_method=f"tcp://{self._worker_info.master_addr}:{self._worker_info.master_port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )


def _private(value: Any) -> Any:
    """A DataProto whose tensors the method may write in place: views of the object store are copied.

    The tensors of a DataProto fetched from Ray share the object's memory with every reader on
    the node (tp/pp replicas of one part), and torch cannot make them read-only. Numeric
    non-tensor arrays stay as they are: numpy refuses writes into a read-only array.
    """
    if not isinstance(value, DataProto) or value.batch is None:
        return value
    tensors = {k: t.clone() for k, t in value._items()}
    return value._with(tensors, dict(value.non_tensor_batch), len(value), dict(value.meta_info))


def _rows_of(output: Any) -> int:
    return len(output) if isinstance(output, DataProto) else -1


class WorkerHost:
    """Body of the Ray actor on one device: hosts the role objects and runs their methods.

    Args:
        info: placement of this worker, without the rendezvous address (set by :meth:`build`).
        in_driver: the host runs in the driver process (``rlflow.controller.driver_host``), not
            in a Ray actor: no Ray node, and :meth:`close` undoes what it set up in the process.
    """

    def __init__(self, info: WorkerInfo, in_driver: bool = False) -> None:
        # What close() gives back to a driver that hosted the worker.
        self._driver_threads = (torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")) if in_driver else None
        if not info.use_gpu:
            # CPU workers share few cores; one thread each keeps gloo collectives from crawling
            # (and runs as the machine profile measured a worker); a plan of one worker on a host
            # may give it every core (``info.threads``, priced by the profile's host timings).
            torch.set_num_threads(info.threads)
            os.environ["OMP_NUM_THREADS"] = str(info.threads)
        self._in_driver = in_driver
        node_id = DRIVER_NODE_ID if in_driver else ray.get_runtime_context().get_node_id()
        self._info = replace(info, node_id=node_id)
        self._workers: dict[str, Worker] = {}

    def rendezvous(self) -> tuple[str, int, str]:
        """``(address, free port, node id)``; rank 0's answer becomes every worker's master address."""
        address = "127.0.0.1" if self._in_driver else ray.util.get_node_ip_address()
        return address, free_port(address if self._in_driver else ""), self._info.node_id

    def build(self, master_addr: str, master_port: int, roles: dict[str, Any]) -> str:
        """Constructs one object per role (``role -> RayClassWithInitArgs``); returns this node's id."""
        self._info = replace(self._info, master_addr=master_addr, master_port=master_port)
        # No LOCAL_RANK: Ray shows a GPU worker only its own GPU (cuda:0), and torch's DeviceMesh
        # would pick cuda:LOCAL_RANK from the environment.
        os.environ.update(
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            RANK=str(self._info.rank),
            WORLD_SIZE=str(self._info.world_size),
        )
        for role, spec in roles.items():
            try:
                with _worker_context(self._info, role):
                    self._workers[role] = spec.cls(*spec.args, **spec.kwargs)
            except Exception:
                raise WorkerError(
                    role, self._info.rank, self._info.node_id, "__init__", traceback.format_exc()
                ) from None
        return self._info.node_id

    def row_weights(self, data: Any, key: str) -> np.ndarray:
        """``data.row_weights(key)`` of a call's output part (the driver balances the next dp split by it)."""
        if not isinstance(data, DataProto):
            raise TypeError(f"a future part holds a {type(data).__name__}, expected a DataProto")
        return np.asarray(data.row_weights(key), dtype=np.float64)

    def execute(self, role: str, method: str, with_num_rows: bool, /, *args: Any, **kwargs: Any) -> Any:
        """Runs ``role.method(*args, **kwargs)``; with ``with_num_rows`` also returns the output's row count.

        Arguments are top-level so that Ray fetches the object refs among them before the call.
        """
        try:
            fn = getattr(self._workers[role], method)
            spec = method_spec(fn)
            if spec is None or spec.materialize_futures:
                args, kwargs = materialize_args(args, kwargs)
            if spec is None or spec.writable_inputs:
                args, kwargs = tuple(_private(a) for a in args), {k: _private(v) for k, v in kwargs.items()}
            output = fn(*args, **kwargs)
        except Exception as exc:
            task = str(exc) if isinstance(exc, TaskError) else None
            raise WorkerError(role, self._info.rank, self._info.node_id, method, traceback.format_exc(), task) from None
        if isinstance(output, DataProto) and not self._in_driver and ray.is_initialized():
            local_outputs.put(ray.get_runtime_context().get_task_id(), output)  # a later call here reads it locally
        return (output, _rows_of(output)) if with_num_rows else output

    def close(self) -> None:
        """Ends a driver-hosted worker: each role's ``close()`` (when it has one), then the
        ``torch.distributed`` default group, and gives the driver its torch thread count back,
        so that the driver can go on or host another run (a Ray actor's process takes all of it
        with it instead)."""
        import torch.distributed as dist

        for worker in reversed(list(self._workers.values())):
            closer = getattr(worker, "close", None)
            if callable(closer):
                closer()
        self._workers.clear()
        if not self._in_driver:
            return
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        if self._driver_threads is not None:
            threads, omp = self._driver_threads
            torch.set_num_threads(threads)
            if omp is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = omp
            self._driver_threads = None
