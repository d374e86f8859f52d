"""RayWorkerGroup: the driver's handle on one Ray actor per device, with methods built from ``@register``.

Every ``@register``-ed method of the worker class becomes a driver-side method of the group
that dispatches the arguments, calls the ranks and collects the outputs. Several role classes
can share one actor per device (colocation): the fused group exposes ``<role>_<method>`` and
:meth:`RayWorkerGroup.spawn` returns one plain group per role over the same actors. A
:meth:`RayWorkerGroup.view` is a group over a subset of the actors arranged as ``(dp, tp, pp)``.
:meth:`RayWorkerGroup.in_driver` is a group of one worker run by this process instead of a Ray
actor (:mod:`rlflow.controller.driver_host`), with the same methods, futures and errors.

>>> pool = ResourcePool([4])                                            # doctest: +SKIP
>>> group = RayWorkerGroup(pool, RayClassWithInitArgs(MyWorker, lr=1e-3))  # doctest: +SKIP
>>> out = group.compute_log_prob(batch)                  # DataProto split over 4 ranks  # doctest: +SKIP
"""

from __future__ import annotations

import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import ray
from ray.exceptions import RayActorError, RayTaskError

from rlflow.controller.data_plane import DataFuture, PayloadCache, payload_nbytes, transfer_stats
from rlflow.controller.decorator import Execute, MethodSpec, registered_methods
from rlflow.controller.dispatch import Dispatched, collect, dispatch, returns_rows
from rlflow.controller.driver_host import DRIVER_NODE_ID, DriverHost
from rlflow.controller.errors import WorkerDiedError, WorkerError
from rlflow.controller.resource_pool import ResourcePool
from rlflow.controller.worker import WorkerHost, WorkerInfo
from rlflow.strategy import ParallelStrategy


class RayClassWithInitArgs:
    """A worker class and the arguments to construct it with on every rank.

    >>> spec = RayClassWithInitArgs(dict, a=1)
    >>> spec.cls, spec.kwargs
    (<class 'dict'>, {'a': 1})
    """

    def __init__(self, cls: type, *args: Any, **kwargs: Any) -> None:
        self.cls, self.args, self.kwargs = cls, args, kwargs


@dataclass
class _Actors:
    """What a group, its views and its spawned groups share: the actors and the role classes."""

    hosts: list[Any]  # one WorkerHost actor handle per global rank (a DriverHost for a driver-hosted one)
    node_ids: list[str]
    roles: dict[str, type]
    in_driver: bool = False


class RayWorkerGroup:
    """Worker processes on a resource pool, called from the driver.

    Args:
        resource_pool: where to place one actor per bundle.
        workers: one worker class, or ``{role: class}`` to colocate several roles in each actor.
        role: role name of a single class (default: the class name).

    Attributes:
        world_size: actors in this group (or view).
        strategy: ``(dp, tp, pp)`` arrangement of the ranks; ``(world_size, 1, 1)`` unless a view says otherwise.
    """

    def __init__(
        self,
        resource_pool: ResourcePool,
        workers: RayClassWithInitArgs | Mapping[str, RayClassWithInitArgs],
        role: str | None = None,
    ) -> None:
        specs, bound = _specs(workers, role)
        actors = _spawn(resource_pool, specs)
        self._setup(actors, list(range(resource_pool.world_size)), None, bound)

    @classmethod
    def in_driver(
        cls,
        workers: RayClassWithInitArgs | Mapping[str, RayClassWithInitArgs],
        role: str | None = None,
        use_gpu: bool = False,
        threads: int = 1,
    ) -> RayWorkerGroup:
        """A group of one worker hosted by this process (:mod:`rlflow.controller.driver_host`), no Ray.

        Its methods, views, futures and errors are those of a Ray group of one rank; rows pass
        between calls as objects, never serialised. ``threads``: its torch threads on CPU.
        """
        specs, bound = _specs(workers, role)
        group = cls.__new__(cls)
        group._setup(_spawn_in_driver(specs, use_gpu, threads), [0], None, bound)
        return group

    @classmethod
    def _over(
        cls,
        actors: _Actors,
        ranks: list[int],
        strategy: ParallelStrategy | None,
        role: str | None,
        row_group_size: int = 1,
        balance_by: str | None = None,
    ):
        group = cls.__new__(cls)
        group._setup(actors, ranks, strategy, role, row_group_size, balance_by)
        return group

    def _setup(
        self,
        actors: _Actors,
        ranks: list[int],
        strategy: ParallelStrategy | None,
        role: str | None,
        row_group_size: int = 1,
        balance_by: str | None = None,
    ) -> None:
        if row_group_size < 1:
            raise ValueError(f"row_group_size={row_group_size} must be >= 1")
        if balance_by is not None and (not isinstance(balance_by, str) or not balance_by):
            raise ValueError(f"balance_by={balance_by!r} must name a batch key (e.g. 'attention_mask') or be None")
        self._actors, self._ranks, self._role = actors, ranks, role
        self.row_group_size, self.balance_by = row_group_size, balance_by
        self.strategy = strategy or ParallelStrategy(dp=len(ranks))
        if self.strategy.world_size != len(ranks):
            raise ValueError(
                f"strategy {self.strategy} has {self.strategy.world_size} ranks but the view has {len(ranks)}"
            )
        self._methods: dict[str, tuple[str, str, MethodSpec]] = {}
        for r in [role] if role else list(actors.roles):
            for name, spec in registered_methods(actors.roles[r]).items():
                attr = name if role else f"{r}_{name}"
                if hasattr(type(self), attr):
                    raise ValueError(f"worker method {r}.{name} would hide RayWorkerGroup.{attr}; rename it")
                self._methods[attr] = (r, name, spec)
                setattr(self, attr, partial(self._call, r, name, spec))

    # ----------------------------------------------------------------- shape
    @property
    def world_size(self) -> int:
        return len(self._ranks)

    @property
    def ranks(self) -> list[int]:
        """Global rank (pool bundle index) of each rank of this group."""
        return list(self._ranks)

    @property
    def roles(self) -> list[str]:
        return [self._role] if self._role else list(self._actors.roles)

    @property
    def driver_hosted(self) -> bool:
        """The worker runs in this process (:meth:`in_driver`), not in a Ray actor."""
        return self._actors.in_driver

    @property
    def node_ids(self) -> list[str]:
        """Ray node id of each rank's actor."""
        return [self._actors.node_ids[r] for r in self._ranks]

    @property
    def method_names(self) -> list[str]:
        """Driver-side methods built from ``@register``."""
        return sorted(self._methods)

    def view(
        self,
        ranks: Sequence[int],
        strategy: ParallelStrategy | None = None,
        row_group_size: int = 1,
        balance_by: str | None = None,
    ) -> RayWorkerGroup:
        """A group over some of this group's ranks (positions in this group), arranged as ``strategy``.

        Rank ``i`` of the view is ``ranks[i]``; with ``strategy`` its coordinates follow
        ``rank = (pp_rank*dp + dp_rank)*tp + tp_rank`` (see ``rlflow/strategy.py``).
        ``row_group_size`` keeps that many consecutive rows on one dp rank when DataProto
        arguments are split (the samples of one prompt, for group-relative advantages).
        ``balance_by`` names a batch key (``"attention_mask"``) whose per-row sums (tokens) the
        dp split balances, keeping groups whole and the ranks' group counts equal give or take
        one; results come back in the original row order. ``None`` splits consecutive rows.
        """
        ranks = list(ranks)
        if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < self.world_size for r in ranks):
            raise ValueError(f"view ranks {ranks} must be distinct positions in [0, {self.world_size})")
        return self._over(
            self._actors, [self._ranks[r] for r in ranks], strategy, self._role, row_group_size, balance_by
        )

    def spawn(self) -> dict[str, RayWorkerGroup]:
        """One plain group per role of a colocated group, sharing its actors (and shape)."""
        return {
            r: self._over(self._actors, self._ranks, self.strategy, r, self.row_group_size, self.balance_by)
            for r in self.roles
        }

    # ----------------------------------------------------------------- calls
    def _call(self, role: str, method: str, spec: MethodSpec, *args: Any, **kwargs: Any) -> Any:
        call = dispatch(self, spec, args, kwargs)
        ranks = [0] if spec.execute_mode is Execute.RANK_ZERO else list(range(self.world_size))
        with_rows = not spec.blocking and returns_rows(spec)
        outs, origin = self._submit(role, method, ranks, call.args, call.kwargs, with_rows)
        refs = [o[0] for o in outs] if with_rows else outs
        if spec.blocking:
            outputs = _fetch(self._actors, origin, refs)
            transfer_stats.received_bytes += payload_nbytes(outputs)
            return collect(self, spec, call, outputs)
        return DataFuture(
            refs,
            fetch=partial(_fetch, self._actors, origin),
            # Keep only the row order: the driver-side parts must not live as long as the future.
            collect=partial(collect, self, spec, Dispatched([], [], call.part_index, call.order)),
            part_index=call.part_index if with_rows else None,
            order=call.order,
            num_rows_refs=[outs[i][1] for i in call.part_index] if with_rows else None,
            weigh=partial(self._row_weights, [(i, outs[i][0]) for i in call.part_index]) if with_rows else None,
        )

    def _row_weights(self, parts: list[tuple[int, ray.ObjectRef]], key: str) -> list[np.ndarray]:
        """Per-row weights of each ``(rank, part)`` (``DataProto.row_weights(key)``), computed by that rank."""
        refs = [self._actors.hosts[self._ranks[r]].row_weights.remote(part, key) for r, part in parts]
        origin = {ref: (self._ranks[r], "host.row_weights") for (r, _), ref in zip(parts, refs)}
        return _fetch(self._actors, origin, refs)

    def _submit(
        self, role: str, method: str, ranks: list[int], args: list, kwargs: list, with_rows: bool
    ) -> tuple[list, dict]:
        """Calls ``role.method`` on ``ranks``; returns the refs and, for each ref, ``(global rank, what)``."""
        cache, refs, origin = PayloadCache(put=not self._actors.in_driver), [], {}
        for r in ranks:
            a = [cache.convert(v) for v in args[r]]
            kw = {k: cache.convert(v) for k, v in kwargs[r].items()}
            execute = self._actors.hosts[self._ranks[r]].execute
            if with_rows:
                execute = execute.options(num_returns=2)
            out = execute.remote(role, method, with_rows, *a, **kw)
            refs.append(out)
            origin.update({ref: (self._ranks[r], f"{role}.{method}") for ref in (out if with_rows else [out])})
        return refs, origin

    def _resolve(self, name: str) -> tuple[str, str]:
        if self._role:
            return self._role, name
        for role in sorted(self._actors.roles, key=len, reverse=True):
            if name.startswith(role + "_"):
                return role, name[len(role) + 1 :]
        raise AttributeError(f"{name!r} does not start with a role of this colocated group: {list(self._actors.roles)}")

    def _execute(self, method: str, ranks: list[int], args: tuple, kwargs: dict) -> tuple[list, dict]:
        role, name = self._resolve(method)
        return self._submit(role, name, ranks, [args] * self.world_size, [kwargs] * self.world_size, False)

    def async_execute_all(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Calls ``method`` (any worker method) with the same arguments on every rank; one ref per rank."""
        return self._execute(method, list(range(self.world_size)), args, kwargs)[0]

    def async_execute_rank_zero(self, method: str, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        """Calls ``method`` on rank 0 only; returns its ref."""
        return self._execute(method, [0], args, kwargs)[0][0]

    def get(self, refs: Sequence[ray.ObjectRef]) -> list:
        """Waits for the refs of :meth:`async_execute_all` (one per rank, in rank order).

        Worker failures become :class:`WorkerError` / :class:`WorkerDiedError` naming role, rank and node.
        """
        origin = {ref: (self._ranks[i], "async call") for i, ref in enumerate(refs)}
        return _fetch(self._actors, origin, list(refs))

    def execute_all(self, method: str, *args: Any, **kwargs: Any) -> list:
        """Blocking :meth:`async_execute_all`: the outputs of every rank, in rank order."""
        refs, origin = self._execute(method, list(range(self.world_size)), args, kwargs)
        return _fetch(self._actors, origin, refs)

    def execute_rank_zero(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Blocking :meth:`async_execute_rank_zero`."""
        refs, origin = self._execute(method, [0], args, kwargs)
        return _fetch(self._actors, origin, refs)[0]

    def shutdown(self) -> None:
        """Kills the actors of this group (shared with its views and spawned groups)."""
        for r in self._ranks:
            if self._actors.in_driver:
                self._actors.hosts[r].kill()
            else:
                ray.kill(self._actors.hosts[r], no_restart=True)

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: an unknown or unregistered method.
        if name.startswith("_"):
            raise AttributeError(name)
        methods = sorted(self.__dict__.get("_methods", {}))
        raise AttributeError(
            f"RayWorkerGroup over roles {self.roles} has no method {name!r}; registered methods: {methods} "
            "(decorate a worker method with @register to call it from the driver)"
        )

    def __repr__(self) -> str:
        return f"RayWorkerGroup(roles={self.roles}, ranks={self._ranks}, strategy={self.strategy})"


def _fetch(actors: _Actors, origin: dict, refs: list) -> list:
    """``ray.get`` that turns worker failures into errors naming role, rank and node.

    Args:
        origin: for each ref, ``(global rank, "role.method")`` of the call that produces it.
    """
    if actors.in_driver:
        return _fetch_in_driver(actors, origin, refs)
    try:
        return ray.get(refs)
    except RayTaskError as err:
        if isinstance(err.cause, WorkerError):  # raised by WorkerHost.execute: already complete
            raise err.cause from None
        rank, what = _first_failed(origin, refs, RayTaskError)
        role, _, method = what.partition(".")
        node = actors.node_ids[rank] if rank >= 0 else None
        raise WorkerError(role, rank, node, method, str(err)) from None
    except RayActorError as err:
        rank, _ = _first_failed(origin, refs, RayActorError)
        if rank < 0:  # could not tell which ref; name the actor Ray reported
            actor_id = getattr(err, "actor_id", None)
            rank = next((r for r, h in enumerate(actors.hosts) if h._actor_id.hex() == actor_id), -1)
        node = actors.node_ids[rank] if rank >= 0 else None
        raise WorkerDiedError(tuple(actors.roles), rank, node, str(err)) from None


def _fetch_in_driver(actors: _Actors, origin: dict, refs: list) -> list:
    """:func:`_fetch` of a driver-hosted worker's refs: its errors already name role and rank,
    anything else raised by the host (its construction, a rendezvous) is named here."""
    values = []
    for ref in refs:
        try:
            values.append(ref.result())
        except WorkerError:
            raise
        except Exception:
            rank, what = origin.get(ref, (0, "host.?"))
            role, _, method = what.partition(".")
            raise WorkerError(role, rank, actors.node_ids[rank], method, traceback.format_exc()) from None
    return values


def _specs(
    workers: RayClassWithInitArgs | Mapping[str, RayClassWithInitArgs], role: str | None
) -> tuple[dict[str, RayClassWithInitArgs], str | None]:
    """``({role: spec}, the bound role or None for a colocated group)``."""
    if isinstance(workers, RayClassWithInitArgs):
        specs, bound = {role or workers.cls.__name__: workers}, role or workers.cls.__name__
    elif role is not None:
        raise ValueError(f"role={role!r} names a single class; a colocated group takes {{role: class}}")
    else:
        specs, bound = dict(workers), None
    if not specs or not all(isinstance(s, RayClassWithInitArgs) for s in specs.values()):
        raise TypeError(f"workers must be RayClassWithInitArgs or a non-empty dict of them, got {workers!r}")
    return specs, bound


def _first_failed(origin: dict, refs: list, error: type[Exception]) -> tuple[int, str]:
    """Origin of the first finished ref whose result is an ``error``; ``(-1, "?.?")`` if none."""
    for ref in refs:
        if ray.wait([ref], timeout=0)[0]:
            try:
                ray.get(ref)
            except error:
                return origin[ref]
            except Exception:
                pass
    return -1, "?.?"


def _spawn(pool: ResourcePool, specs: dict[str, RayClassWithInitArgs]) -> _Actors:
    """Starts one WorkerHost per bundle, shares rank 0's rendezvous address, builds the roles."""
    pool.claim()
    host_cls = ray.remote(WorkerHost)
    hosts = []
    for b in pool.bundles():
        info = WorkerInfo(
            b.rank, pool.world_size, b.local_rank, b.local_world_size, b.node_rank, use_gpu=pool.use_gpu,
            threads=pool.threads_per_worker,
        )  # fmt: skip
        hosts.append(host_cls.options(**pool.actor_options(b)).remote(info))
    actors = _Actors(hosts, [b.node_id for b in pool.bundles()], {r: s.cls for r, s in specs.items()})
    first = hosts[0].rendezvous.remote()
    addr, port, _ = _fetch(actors, {first: (0, "host.rendezvous")}, [first])[0]
    refs = [h.build.remote(addr, port, specs) for h in hosts]
    actors.node_ids = _fetch(actors, {ref: (r, "host.build") for r, ref in enumerate(refs)}, refs)
    return actors


def _spawn_in_driver(specs: dict[str, RayClassWithInitArgs], use_gpu: bool, threads: int = 1) -> _Actors:
    """One WorkerHost in this process, rank 0 of 1, its roles built (:func:`_spawn`'s counterpart)."""
    info = WorkerInfo(0, 1, 0, 1, 0, use_gpu=use_gpu, threads=threads)
    host = DriverHost(partial(WorkerHost, info, in_driver=True))
    actors = _Actors([host], [DRIVER_NODE_ID], {r: s.cls for r, s in specs.items()}, in_driver=True)
    try:
        first = host.rendezvous.remote()
        addr, port, _ = _fetch(actors, {first: (0, "host.rendezvous")}, [first])[0]
        built = host.build.remote(addr, port, specs)
        _fetch(actors, {built: (0, "host.build")}, [built])
    except BaseException:
        host.kill()
        raise
    return actors
