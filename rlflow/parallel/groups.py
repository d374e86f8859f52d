"""Process groups: the pool's global group, per-call ``(pp, dp, tp)`` meshes, and rank maps.

Three kinds of rank appear in rlflow:

* **global rank** — index of a worker in the resource pool (its bundle index); the rank in
  the pool's default torch.distributed group, initialised once per worker.
* **call rank** — index of a worker inside one call's mesh: call rank ``r`` is the global
  rank ``ranks[r]`` (``ranks`` = the mesh's device ids, in order).
* **coordinates** ``(pp_rank, dp_rank, tp_rank)`` with
  ``call_rank = (pp_rank * dp + dp_rank) * tp + tp_rank`` (``rlflow.strategy``).

Protocol for the controller (why: ``torch.distributed.new_group`` — which a torch
``DeviceMesh`` calls once per sub-group of each of its dims — must be called by *every*
rank of the default group, in the same order, even by ranks outside the new group):

1. every pool worker calls :func:`init_global_group` (or the controller's own equivalent
   ``init_process_group``) once;
2. every pool worker calls :func:`build_call_groups` for the same ``(ranks, strategy)``
   pairs in the same order — simplest: :func:`build_plan_groups` with the plan's list of
   calls, at start-up. Workers outside a call's mesh get ``None``;
3. later calls of :func:`build_call_groups` with a known pair are answered from the
   per-process cache and need no collective.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

from rlflow.strategy import ParallelStrategy, RankCoords

MESH_AXES = ("pp", "dp", "tp")

_CACHE: dict[tuple[tuple[int, ...], ParallelStrategy, str], CallGroups | None] = {}


def default_backend() -> str:
    """``cpu:gloo,cuda:nccl`` when CUDA is available (host and device tensors both work), else ``gloo``."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def init_global_group(
    rank: int,
    world_size: int,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    backend: str | None = None,
    timeout_s: float = 600.0,
) -> None:
    """Initialise the pool's default process group on this worker (all pool ranks call it).

    Args:
        rank: global rank of this worker.
        world_size: workers in the pool.
        master_addr, master_port: rendezvous address (port from ``MASTER_PORT`` when None).
        backend: torch.distributed backend; :func:`default_backend` when None.
        timeout_s: collective timeout in seconds.
    """
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    port = master_port if master_port is not None else int(os.environ["MASTER_PORT"])
    dist.init_process_group(
        backend or default_backend(),
        init_method=f"tcp://{master_addr}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


# ---- pure rank maps ----


def _check_ranks(ranks: Sequence[int], strategy: ParallelStrategy) -> tuple[int, ...]:
    ranks = tuple(int(r) for r in ranks)
    if len(ranks) != strategy.world_size:
        raise ValueError(f"{len(ranks)} ranks {ranks} do not match {strategy} (world size {strategy.world_size})")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks {ranks} repeat a rank")
    return ranks


def rank_grid(ranks: Sequence[int], strategy: ParallelStrategy) -> torch.Tensor:
    """Global ranks arranged as the call's mesh: an int tensor of shape ``(pp, dp, tp)``."""
    ranks = _check_ranks(ranks, strategy)
    return torch.tensor(ranks, dtype=torch.int).reshape(strategy.pp, strategy.dp, strategy.tp)


def global_coords(ranks: Sequence[int], strategy: ParallelStrategy, global_rank: int) -> RankCoords | None:
    """The coordinates of ``global_rank`` in the call, or ``None`` when outside it."""
    ranks = _check_ranks(ranks, strategy)
    return strategy.coords(ranks.index(global_rank)) if global_rank in ranks else None


def axis_ranks(ranks: Sequence[int], strategy: ParallelStrategy, global_rank: int, axis: str) -> tuple[int, ...]:
    """Global ranks of the ``axis`` group (``"pp"``, ``"dp"`` or ``"tp"``) containing ``global_rank``.

    >>> axis_ranks([4, 5, 6, 7], ParallelStrategy(dp=2, tp=2), 6, "dp")
    (4, 6)
    """
    if axis not in MESH_AXES:
        raise ValueError(f"axis={axis!r}; expected one of {MESH_AXES}")
    coords = global_coords(ranks, strategy, global_rank)
    if coords is None:
        raise ValueError(f"global rank {global_rank} is not in the call's ranks {tuple(ranks)}")
    index = [slice(c, c + 1) for c in coords]
    index[MESH_AXES.index(axis)] = slice(None)
    return tuple(rank_grid(ranks, strategy)[tuple(index)].flatten().tolist())


# ---- collective group construction ----


@dataclass(frozen=True)
class CallGroups:
    """This worker's view of one call: the torch mesh, its axis groups and rank maps.

    Attributes:
        ranks: global ranks of the call in call-rank order.
        strategy: the call's ``(dp, tp, pp)``.
        mesh: torch ``DeviceMesh`` of shape ``(pp, dp, tp)``, ``mesh_dim_names=("pp", "dp", "tp")``.
        rank: this worker's global rank.
    """

    ranks: tuple[int, ...]
    strategy: ParallelStrategy
    mesh: TorchDeviceMesh
    rank: int

    @property
    def call_rank(self) -> int:
        return self.ranks.index(self.rank)

    @property
    def coords(self) -> RankCoords:
        """The coordinates of this worker in the call."""
        return self.strategy.coords(self.call_rank)

    def group(self, axis: str) -> dist.ProcessGroup:
        """Process group of this worker's ``axis`` (``"pp"``, ``"dp"`` or ``"tp"``)."""
        return self.mesh.get_group(axis)

    def submesh(self, axis: str) -> TorchDeviceMesh:
        """1-D torch mesh of this worker's ``axis`` (e.g. the ``tp_mesh`` for ``apply_tp``)."""
        return self.mesh[axis]

    def axis_ranks(self, axis: str) -> tuple[int, ...]:
        """Global ranks of this worker's ``axis`` group."""
        return axis_ranks(self.ranks, self.strategy, self.rank, axis)

    def global_rank(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        """Global rank at the given coordinates of the call."""
        return self.ranks[self.strategy.rank_of(pp_rank, dp_rank, tp_rank)]


def build_call_groups(
    ranks: Sequence[int], strategy: ParallelStrategy, device_type: str | None = None
) -> CallGroups | None:
    """Create (collectively) or look up the groups of a call on global ``ranks`` under ``strategy``.

    Every rank of the pool's default group must call this with the same arguments in the
    same order (see the module docstring); ranks outside ``ranks`` take part in creating the
    groups and get ``None``. Results are cached per process: a second call with the same
    ``(ranks, strategy, device_type)`` is local.

    Args:
        ranks: global ranks of the call, in call-rank order.
        strategy: ``(dp, tp, pp)`` with ``dp*tp*pp == len(ranks)``.
        device_type: ``"cuda"`` or ``"cpu"``; ``"cuda"`` when CUDA is available if None.

    Returns:
        This worker's :class:`CallGroups`, or ``None`` when it is not in ``ranks``.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_call_groups needs the pool's process group; call init_global_group first")
    ranks = _check_ranks(ranks, strategy)
    if list(ranks) != sorted(ranks):
        # new_group numbers a group's members by sorted global rank while a DeviceMesh places
        # shards by mesh coordinate; DTensor all-gathers would come back in the wrong order.
        raise ValueError(f"ranks {ranks} must be increasing (a mesh is a contiguous range of devices)")
    world = dist.get_world_size()
    if max(ranks) >= world or min(ranks) < 0:
        raise ValueError(f"ranks {ranks} fall outside the pool of world size {world}")
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    key = (ranks, strategy, device_type)
    if key not in _CACHE:
        mesh = TorchDeviceMesh(device_type, rank_grid(ranks, strategy), mesh_dim_names=MESH_AXES)
        _build_return_groups(ranks, strategy)
        rank = dist.get_rank()
        _CACHE[key] = CallGroups(ranks, strategy, mesh, rank) if rank in ranks else None
    return _CACHE[key]


# pp column (global ranks) -> its second group, on which pipelined generation sends the sampled
# tokens back to the first stage (rlflow.engine.rollout.pipelined: NCCL serialises one
# communicator's point-to-point operations); NON_GROUP_MEMBER on ranks outside the column.
_RETURN_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def _build_return_groups(ranks: tuple[int, ...], strategy: ParallelStrategy) -> None:
    """A second group per pp column of a pipelined call, created with the call's groups (every
    pool rank, same order); columns shared with an earlier call reuse its group."""
    if strategy.pp == 1:
        return
    grid = rank_grid(ranks, strategy)
    for dp_rank in range(strategy.dp):
        for tp_rank in range(strategy.tp):
            column = tuple(int(r) for r in grid[:, dp_rank, tp_rank])
            if column not in _RETURN_GROUPS:  # the same keys on every rank: the same new_group calls
                _RETURN_GROUPS[column] = dist.new_group(list(column))


def pp_return_group(column: Sequence[int]) -> dist.ProcessGroup | None:
    """The second group :func:`build_call_groups` made for the pp column ``column`` (global ranks in
    stage order), or None when no call of the pool has that column."""
    return _RETURN_GROUPS.get(tuple(int(r) for r in column))


def build_plan_groups(
    calls: Sequence[tuple[Sequence[int], ParallelStrategy]], device_type: str | None = None
) -> list[CallGroups | None]:
    """:func:`build_call_groups` for every call of a plan, in order (every pool rank calls it).

    Duplicated calls are created once. Returns this worker's groups per call (``None`` where
    the worker is outside the call).
    """
    return [build_call_groups(ranks, strategy, device_type) for ranks, strategy in calls]


def clear_group_cache() -> None:
    """Forget cached call groups (after ``destroy_process_group``)."""
    _CACHE.clear()
    _RETURN_GROUPS.clear()
