"""Single controller: declare how worker methods dispatch and collect, place workers, call them from the driver.

Knows nothing about models or algorithms; see ``docs/architecture.md`` ("Control plane and data plane").
"""

from __future__ import annotations

from rlflow.controller.data_plane import DataFuture, RemoteRows, TransferStats, transfer_stats
from rlflow.controller.decorator import Dispatch, Execute, MethodSpec, method_spec, register, registered_methods
from rlflow.controller.errors import ResourceError, TaskError, WorkerDiedError, WorkerError
from rlflow.controller.resource_pool import ResourcePool
from rlflow.controller.worker import Worker, WorkerInfo
from rlflow.controller.worker_group import RayClassWithInitArgs, RayWorkerGroup

__all__ = [
    "DataFuture",
    "Dispatch",
    "Execute",
    "MethodSpec",
    "RayClassWithInitArgs",
    "RayWorkerGroup",
    "RemoteRows",
    "ResourceError",
    "ResourcePool",
    "TaskError",
    "TransferStats",
    "Worker",
    "WorkerDiedError",
    "WorkerError",
    "WorkerInfo",
    "method_spec",
    "register",
    "registered_methods",
    "transfer_stats",
]
