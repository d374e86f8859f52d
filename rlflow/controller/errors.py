"""Errors that reach the driver: a failing worker method, a dead worker, a pool that cannot fit."""

from __future__ import annotations


class TaskError(RuntimeError):
    """Raised inside a worker method, chained ``from`` the cause, to name the task that failed.

    The worker class knows what it was doing (a call and its model, say); the driver's
    :class:`WorkerError` then leads with this message instead of ``role.method failed``.
    """


class WorkerError(RuntimeError):
    """An exception raised inside a worker method, re-raised on the driver.

    Attributes:
        role: role of the worker whose method failed (``"actor"``, ``"critic"``, ...).
        rank: global rank of the worker (its bundle index in the resource pool).
        node_id: Ray node id (hex) of the worker's node.
        method: name of the method that raised.
        remote_traceback: the formatted traceback from the worker process.
        task: the message of the :class:`TaskError` the method raised, which leads the message.
    """

    def __init__(
        self, role: str, rank: int, node_id: str | None, method: str, remote_traceback: str, task: str | None = None
    ) -> None:
        self.role, self.rank, self.node_id = role, rank, node_id
        self.method, self.remote_traceback, self.task = method, remote_traceback, task
        where = f"{role}.{method} failed on worker rank {rank} (node {node_id})"
        if task is not None:
            where = f"{task}\n({role}.{method} on worker rank {rank}, node {node_id})"
        super().__init__(f"{where}; remote traceback:\n{remote_traceback}")

    def __reduce__(self):
        # Ray pickles the exception to ship it to the driver; keep every field.
        return (type(self), (self.role, self.rank, self.node_id, self.method, self.remote_traceback, self.task))


class WorkerDiedError(RuntimeError):
    """A worker process (Ray actor) died; names the roles it hosted and its rank.

    Attributes:
        roles: roles hosted by the dead actor.
        rank: global rank of the dead worker.
        node_id: Ray node id (hex) where it ran, when known.
    """

    def __init__(self, roles: tuple[str, ...], rank: int, node_id: str | None, reason: str) -> None:
        self.roles, self.rank, self.node_id = tuple(roles), rank, node_id
        super().__init__(f"worker rank {rank} (roles {', '.join(roles)}; node {node_id}) died: {reason}")


class ResourceError(RuntimeError):
    """A resource pool asks for more than the Ray cluster has, or could not be placed in time."""
