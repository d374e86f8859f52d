"""ResourcePool: Ray placement-group bundles, one per device, ordered by node.

``process_on_nodes=[4, 4]`` asks for two nodes with four devices each; bundle (global rank)
``0..3`` lie on the first node and ``4..7`` on the second. Each node's bundles form one
placement group pinned to a chosen node, so distinct entries always land on distinct nodes.
On CPU a "device" is a fraction of a CPU (``cpus_per_worker``), so that several workers fit
on a small machine. A request the cluster cannot hold fails at once with what was asked and
what exists; a request that fits but cannot be placed (resources held by others) fails after
``ready_timeout_s``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlflow.controller.errors import ResourceError

#: CPU share of one CPU worker by default: eight workers fit on a two-core machine.
DEFAULT_CPUS_PER_CPU_WORKER = 0.25


@dataclass(frozen=True)
class Bundle:
    """One device of a pool: its placement-group bundle and position."""

    placement_group: PlacementGroup
    bundle_index: int  # index inside its node's placement group
    rank: int  # global rank = index in the pool
    node_rank: int
    local_rank: int
    local_world_size: int
    node_id: str


class ResourcePool:
    """Reserves one bundle per device on Ray placement groups, ordered by node.

    Args:
        process_on_nodes: devices (workers) per node, one entry per node.
        use_gpu: one GPU per bundle; otherwise CPU only.
        max_colocate_count: actors that may share one bundle (separate worker groups on the
            same devices); each gets ``1/max_colocate_count`` GPU and ``cpus_per_worker`` CPUs.
        cpus_per_worker: CPUs reserved per actor; default 1 on GPU pools and
            :data:`DEFAULT_CPUS_PER_CPU_WORKER` on CPU pools.
        ready_timeout_s: seconds to wait for the placement groups before raising.
        name: prefix of the placement-group names (``<name>_<node index>``); names must be
            unique in the Ray namespace, so the default leaves the groups unnamed.

    Raises:
        ValueError: a bad argument.
        ResourceError: the cluster cannot hold the request (at once) or it was not placed in time.
    """

    def __init__(
        self,
        process_on_nodes: Sequence[int],
        use_gpu: bool = False,
        max_colocate_count: int = 1,
        cpus_per_worker: float | None = None,
        ready_timeout_s: float = 120.0,
        name: str | None = None,
        threads_per_worker: int = 1,
    ) -> None:
        counts = list(process_on_nodes)
        if not counts or any(not isinstance(n, int) or n < 1 for n in counts):
            raise ValueError(f"process_on_nodes={counts!r} must be a non-empty list of positive ints")
        if not isinstance(max_colocate_count, int) or max_colocate_count < 1:
            raise ValueError(f"max_colocate_count={max_colocate_count!r} must be a positive int")
        cpus = (1.0 if use_gpu else DEFAULT_CPUS_PER_CPU_WORKER) if cpus_per_worker is None else cpus_per_worker
        if not cpus > 0:
            raise ValueError(f"cpus_per_worker={cpus_per_worker!r} must be > 0")
        self.process_on_nodes, self.use_gpu = counts, bool(use_gpu)
        self.max_colocate_count, self.cpus_per_worker = max_colocate_count, float(cpus)
        if not isinstance(threads_per_worker, int) or threads_per_worker < 1:
            raise ValueError(f"threads_per_worker={threads_per_worker!r} must be a positive int")
        self.threads_per_worker = threads_per_worker
        self._bundle = bundle_resources(self.use_gpu, self.cpus_per_worker, max_colocate_count)
        node_ids = self._choose_nodes()
        self._groups = [
            self._create_group(n, node, f"{name}_{i}" if name else "")
            for i, (n, node) in enumerate(zip(counts, node_ids))
        ]
        self._node_ids, self._num_groups = node_ids, 0
        self._wait_ready(ready_timeout_s)

    # ----------------------------------------------------------------- placement
    def _choose_nodes(self) -> list[str]:
        nodes = alive_nodes()
        assignment = _assign(self.process_on_nodes, bundles_per_node(self._bundle, nodes))
        if assignment is None:
            raise ResourceError(f"{self._asked()}, but {describe_nodes(nodes)}")
        try:  # prefer nodes with free room now; Ray's view of free resources may lag slightly
            free = ray._private.state.available_resources_per_node()
            room = [_fits(self._bundle, free.get(n["NodeID"], {})) for n in nodes]
            assignment = _assign(self.process_on_nodes, room) or assignment
        except Exception:  # private API: fall back to the capacity-based choice
            pass
        return [nodes[j]["NodeID"] for j in assignment]

    def _create_group(self, count: int, node_id: str, name: str) -> PlacementGroup:
        bundles = [dict(self._bundle) for _ in range(count)]
        try:
            selector = [{"ray.io/node-id": node_id}] * count
            return placement_group(bundles, strategy="STRICT_PACK", name=name, bundle_label_selector=selector)
        except TypeError:  # Ray without label selectors: a soft hint is the best available
            return placement_group(bundles, strategy="STRICT_PACK", name=name, _soft_target_node_id=node_id)

    def _wait_ready(self, timeout_s: float) -> None:
        try:
            ray.get([pg.ready() for pg in self._groups], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.release()
            raise ResourceError(
                f"{self._asked()}; it fits the cluster but was not placed within {timeout_s:.0f} s "
                f"(resources held by other pools?); free now: {ray.available_resources()}"
            ) from None

    def _asked(self) -> str:
        per_node = " + ".join(f"{n} x {self._bundle}" for n in self.process_on_nodes)
        return f"ResourcePool(process_on_nodes={self.process_on_nodes}) asks for {per_node} on distinct nodes"

    # ----------------------------------------------------------------- public
    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    @property
    def node_ids(self) -> list[str]:
        """Ray node id of each pool node, in node order."""
        return list(self._node_ids)

    def bundles(self) -> list[Bundle]:
        """Every bundle in global rank order (node by node)."""
        out = []
        for node_rank, (pg, count, node) in enumerate(zip(self._groups, self.process_on_nodes, self._node_ids)):
            for i in range(count):
                out.append(Bundle(pg, i, len(out), node_rank, i, count, node))
        return out

    def actor_options(self, bundle: Bundle) -> dict:
        """Ray actor options that place one actor in ``bundle``."""
        options = {
            "num_cpus": self.cpus_per_worker,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(bundle.placement_group, bundle.bundle_index),
        }
        if self.use_gpu:
            options["num_gpus"] = 1.0 / self.max_colocate_count
        return options

    def claim(self) -> None:
        """Registers one more worker group on the bundles; at most ``max_colocate_count`` fit.

        Raises:
            ResourceError: the bundles are full (the new actors would never be scheduled).
        """
        if self._num_groups >= self.max_colocate_count:
            raise ResourceError(
                f"the pool's bundles already hold {self._num_groups} worker group(s) "
                f"(max_colocate_count={self.max_colocate_count}); colocate roles in one group instead"
            )
        self._num_groups += 1

    def release(self) -> None:
        """Removes the placement groups (Ray kills the actors in them). Idempotent."""
        for pg in self._groups:
            try:
                remove_placement_group(pg)
            except Exception:  # already removed, or Ray shut down
                pass
        self._groups = []

    def __enter__(self) -> ResourcePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def bundle_resources(use_gpu: bool, cpus_per_worker: float, max_colocate_count: int = 1) -> dict[str, float]:
    """The Ray resources of one bundle (one device) of a pool.

    >>> bundle_resources(use_gpu=True, cpus_per_worker=1.0)
    {'CPU': 1.0, 'GPU': 1.0}
    """
    return {"CPU": cpus_per_worker * max_colocate_count, **({"GPU": 1.0} if use_gpu else {})}


def alive_nodes() -> list[dict]:
    """The alive nodes of the Ray cluster (``ray.nodes()`` entries), in node-id order."""
    return sorted((n for n in ray.nodes() if n["Alive"]), key=lambda n: n["NodeID"])


def bundles_per_node(bundle: dict[str, float], nodes: Sequence[dict]) -> list[int]:
    """How many ``bundle`` each of ``nodes`` holds in all (its total resources, not what is free now)."""
    return [_fits(bundle, n["Resources"]) for n in nodes]


def _fits(bundle: dict[str, float], resources: dict) -> int:
    return min(math.floor(resources.get(k, 0.0) / v + 1e-9) for k, v in bundle.items())


def _assign(counts: Sequence[int], capacities: Sequence[int]) -> list[int] | None:
    """A distinct node per entry with ``capacity >= count`` (largest entry to roomiest node), or None."""
    if len(counts) > len(capacities):
        return None
    entries = sorted(range(len(counts)), key=lambda i: -counts[i])
    nodes = sorted(range(len(capacities)), key=lambda j: (-capacities[j], j))
    assignment = [0] * len(counts)
    for i, j in zip(entries, nodes):
        if counts[i] > capacities[j]:
            return None
        assignment[i] = j
    return assignment


def describe_nodes(nodes: Sequence[dict]) -> str:
    """What the cluster has, node by node: ``the Ray cluster has 1 alive node(s): node 0 (ab12cd34): 2 CPU, 0 GPU``."""
    if not nodes:
        return "the Ray cluster has no alive node"
    parts = []
    for i, n in enumerate(nodes):
        res = n["Resources"]
        parts.append(f"node {i} ({n['NodeID'][:8]}): {res.get('CPU', 0):g} CPU, {res.get('GPU', 0):g} GPU")
    return f"the Ray cluster has {len(nodes)} alive node(s): " + "; ".join(parts)
