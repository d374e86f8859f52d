"""The ``placement`` section of an rlflow config: the cluster, the planner's mode, and a manual
placement's meshes and strategies (re-exported by :mod:`rlflow.trainer.config`)."""

from __future__ import annotations

from dataclasses import dataclass

from rlflow.planner.cluster import local_devices_per_node
from rlflow.planner.mesh import DeviceMesh
from rlflow.strategy import ParallelStrategy
from rlflow.trainer.config_fields import ConfigError, _f, _Section

__all__ = ["ManualPlacementConfig", "MeshConfig", "PlacementConfig", "StrategyConfig"]


@dataclass(kw_only=True)
class MeshConfig(_Section):
    """A device mesh of a manual placement (see rlflow.planner.mesh.DeviceMesh)."""

    node_start: int = _f(0, "first node", ge=0)
    device_start: int = _f(0, "first device on node_start; a multiple of num_devices", ge=0)
    num_nodes: int = _f(1, "nodes spanned", ge=1)
    num_devices: int = _f(1, "devices used on each node", ge=1)

    def to_device_mesh(self, devices_per_node: int) -> DeviceMesh:
        """The planner's mesh (raises ``ValueError`` for a mesh that is not node-aligned)."""
        return DeviceMesh(self.num_nodes, self.num_devices, self.node_start, self.device_start, devices_per_node)


@dataclass(kw_only=True)
class StrategyConfig(_Section):
    """A parallel strategy; dp * tp * pp must equal the mesh size."""

    dp: int = _f(1, "data-parallel degree", ge=1)
    tp: int = _f(1, "tensor-parallel degree (inside one node)", ge=1)
    pp: int = _f(1, "pipeline-parallel degree", ge=1)

    def to_strategy(self) -> ParallelStrategy:
        return ParallelStrategy(self.dp, self.tp, self.pp)


@dataclass(kw_only=True)
class ManualPlacementConfig(_Section):
    """Where and how one MFC runs under ``placement.mode: manual``."""

    mesh: MeshConfig = _f(MeshConfig(), "devices of the call")
    strategy: StrategyConfig = _f(StrategyConfig(), "parallel strategy of the call")

    def _check(self) -> None:
        size = self.mesh.num_nodes * self.mesh.num_devices
        s = self.strategy
        if s.dp * s.tp * s.pp != size:
            raise ConfigError("strategy", f"dp*tp*pp = {s.dp}*{s.tp}*{s.pp} does not equal the mesh size {size}")
        if self.mesh.num_devices % s.tp:  # ranks are tp-innermost: a tp group must not cross nodes
            raise ConfigError("strategy.tp", f"{s.tp} does not divide the devices per node {self.mesh.num_devices}")


@dataclass(kw_only=True)
class PlacementConfig(_Section):
    """The cluster and how MFCs are placed on it."""

    mode: str = _f(
        "auto",
        "auto: MCMC search; heuristic: rule of thumb; colocated: every call on all devices; manual",
        choices=("auto", "heuristic", "colocated", "manual"),
    )
    num_nodes: int = _f(1, "nodes used", ge=1)
    devices_per_node: int | None = _f(
        None,
        "workers per node: GPUs, or CPU worker processes without GPUs; null: the node's GPUs, else the CPU cores "
        "this process may use (the plan then uses as many of them as is fastest)",
        ge=1,
    )
    cpus_per_worker: float = _f(1.0, "Ray CPUs reserved per worker", gt=0.0)
    oversubscribe: bool = _f(
        False,
        "a local Ray may reserve more CPUs (workers x cpus_per_worker) than this machine has cores: the workers "
        "then share the cores and every step slows; false: such a config is refused before Ray starts",
    )
    use_gpu: bool | None = _f(None, "null: use GPUs when Ray sees them")
    keep_copies: bool | None = _f(
        None,
        "keep each model's rollout and off-home copies between calls, resharded only after its weights change; "
        "null: for the models whose copies fit device memory by the planner's memory model",
    )
    ray_address: str | None = _f(None, "null: start Ray in this process; 'auto' or 'ray://host:port': join a cluster")
    worker_host: str = _f(
        "auto",
        "where the workers run. ray: one Ray actor per device; driver: one worker (devices_per_node becomes 1), on "
        "a thread of this process, without Ray (a single-process trainer's start-up; a crash of the worker is "
        "the driver's); auto: driver "
        "when the plan uses one CPU worker, Ray is not running in this process, no cluster is named "
        "(ray_address, RAY_ADDRESS) and the rollout engine is built per call (not vLLM), else ray",
        choices=("auto", "ray", "driver"),
    )
    search_seconds: float = _f(
        10.0, "most seconds of the auto search; it stops sooner once it has every plan or stops improving", ge=0.0
    )
    profile: bool = _f(
        True,
        "CPU workers: calibrate the cost model by a profile of this machine at the run's shapes (whole calls "
        "timed; cached per host and shape, so measured once per shape); false: priced from hardware rates alone",
    )
    calibrate: str = _f(
        "run",
        "CPU workers, a model shape new to this host: 'run' starts at once from this host's machine profile "
        "(whole calls of a reference model, measured once per host) and calibrates the cost model by the run's own "
        "calls after step 1 (calibrate_steps of them; on a plan of one worker as many more on the other thread count), "
        "caches that for the shape and re-plans (a faster plan is taken at that step: its thread count at once, another "
        "layout by a checkpoint, the workers restarted on it, resumed); a later run of the shape calibrates the same way "
        "where its plan runs a call type in a regime (one worker alone, or several busy) no run of the shape measured; "
        "'profile' times whole calls of the run's model before step 1 (cached per host and shape)",
        choices=("run", "profile"),
    )
    calibrate_steps: int = _f(
        1,
        "calibrate=run: steps a calibration phase measures (their median; a plan of one worker measures two phases, "
        "on its thread count and on the other)",
        ge=1,
    )
    profile_cache: bool = _f(
        True, "reuse this host's profile at the run's shapes from $RLFLOW_CACHE_DIR; false: measure again"
    )
    ray_dashboard: bool = _f(False, "start Ray's dashboard with a local Ray (slows the start)")
    manual: dict[str, ManualPlacementConfig] = _f({}, "mode manual: MFC name → mesh and strategy")

    def _check(self) -> None:
        if self.worker_host == "driver":  # one device, whatever devices_per_node says; no cluster
            if self.ray_address is not None or self.num_nodes > 1:
                given = (
                    f"ray_address={self.ray_address!r}"
                    if self.ray_address is not None
                    else f"num_nodes={self.num_nodes}"
                )
                raise ConfigError(
                    "worker_host", f"'driver' runs one worker in this process, but {given} asks for a cluster"
                )
            self.devices_per_node = 1
        if self.devices_per_node is None:  # auto: resolved once, so every reader sees the count
            self.devices_per_node = local_devices_per_node(self.use_gpu)
        if self.mode == "manual" and not self.manual:
            raise ConfigError("manual", "mode 'manual' needs a mesh and strategy for every MFC")
        if self.mode != "manual" and self.manual:
            raise ConfigError("manual", f"is only read in mode 'manual', got mode={self.mode!r}")
        for name, m in self.manual.items():
            self._check_mesh(name, m.mesh)

    def _check_mesh(self, name: str, mesh: MeshConfig) -> None:
        key = f"manual.{name}.mesh"
        try:
            device_mesh = mesh.to_device_mesh(self.devices_per_node)
        except ValueError as err:
            raise ConfigError(key, str(err)) from None
        if (
            device_mesh.node_start + device_mesh.num_nodes > self.num_nodes
            or mesh.device_start >= self.devices_per_node
        ):
            raise ConfigError(
                key, f"{device_mesh} lies outside {self.num_nodes} node(s) x {self.devices_per_node} devices"
            )
