"""Device meshes: where a model function call runs (its strategy is :mod:`rlflow.strategy`).

A *device mesh* is a rectangle of devices at a position in the cluster: whole hosts, or a
consecutive run of one host whose size divides the host's device count. Devices are
numbered globally in node order (device ``d`` lives on node ``d // devices_per_node``), the
same order as the bundles of a resource pool, so a mesh is always a contiguous range of
global device indices.

A mesh's devices are arranged by a :class:`rlflow.strategy.ParallelStrategy` of the same size.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceMesh:
    """A contiguous block of devices: ``num_nodes`` hosts × ``num_devices`` per host.

    Args:
        num_nodes: hosts spanned by the mesh (>= 1).
        num_devices: devices used on each spanned host; equals ``devices_per_node`` when
            ``num_nodes > 1``.
        node_start: first host of the mesh.
        device_start: first device index inside ``node_start``; a multiple of ``num_devices``.
        devices_per_node: devices of every host in the cluster.

    >>> m = DeviceMesh(1, 2, node_start=0, device_start=2, devices_per_node=8)
    >>> m.device_ids
    (2, 3)
    """

    num_nodes: int
    num_devices: int
    node_start: int = 0
    device_start: int = 0
    devices_per_node: int = 8

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.num_devices < 1:
            raise ValueError(f"mesh shape ({self.num_nodes}, {self.num_devices}) must be positive")
        if self.devices_per_node % self.num_devices != 0:
            raise ValueError(f"num_devices={self.num_devices} does not divide devices_per_node={self.devices_per_node}")
        if self.num_nodes > 1 and self.num_devices != self.devices_per_node:
            raise ValueError(
                f"a mesh over {self.num_nodes} nodes must use whole hosts "
                f"(num_devices={self.num_devices}, devices_per_node={self.devices_per_node})"
            )
        if self.device_start % self.num_devices != 0:
            raise ValueError(f"device_start={self.device_start} is not a multiple of num_devices={self.num_devices}")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_nodes, self.num_devices)

    @property
    def size(self) -> int:
        return self.num_nodes * self.num_devices

    @property
    def first_device(self) -> int:
        """Global index of the mesh's first device."""
        return self.node_start * self.devices_per_node + self.device_start

    @property
    def device_ids(self) -> tuple[int, ...]:
        """Global device indices of the mesh, in rank order."""
        return tuple(range(self.first_device, self.first_device + self.size))

    @property
    def node_ids(self) -> tuple[int, ...]:
        return tuple(range(self.node_start, self.node_start + self.num_nodes))

    def overlaps(self, other: DeviceMesh) -> bool:
        """True when the two meshes share at least one device."""
        a0, b0 = self.first_device, other.first_device
        return a0 < b0 + other.size and b0 < a0 + self.size

    def node_of(self, device_id: int) -> int:
        return device_id // self.devices_per_node

    def __str__(self) -> str:
        last = self.first_device + self.size - 1
        return f"({self.num_nodes},{self.num_devices})@[{self.first_device}..{last}]"

    def to_dict(self) -> dict:
        return {
            "num_nodes": self.num_nodes,
            "num_devices": self.num_devices,
            "node_start": self.node_start,
            "device_start": self.device_start,
            "devices_per_node": self.devices_per_node,
        }

    @classmethod
    def from_dict(cls, d: dict) -> DeviceMesh:
        return cls(**d)
