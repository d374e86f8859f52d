"""``ExecutionPlan``: the chosen mesh and strategy of every MFC, with what the simulator expects of them.

The trainer builds its worker groups from :meth:`ExecutionPlan.placements`; the CLI prints
:meth:`ExecutionPlan.to_table` and saves :meth:`ExecutionPlan.to_json`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from rlflow.planner.compiled import compile_problem
from rlflow.planner.mesh import DeviceMesh
from rlflow.planner.problem import PlanProblem
from rlflow.planner.simulate import SimResult, node_table, pre_node_parts, simulate
from rlflow.strategy import ParallelStrategy

_FORMAT_VERSION = 1


@dataclass(frozen=True)
class PlannedCall:
    """One MFC's placement. ``memory_bytes``: the most any of its devices holds during the call
    (static bytes there + the call's activations + its reallocated/reloaded copy)."""

    name: str
    model: str
    mesh: DeviceMesh
    strategy: ParallelStrategy
    time_s: float
    memory_bytes: float

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "model": self.model,
            "mesh": self.mesh.to_dict(),
            "strategy": self.strategy.to_dict(),
            "time_s": self.time_s,
            "memory_bytes": self.memory_bytes,
        }

    @classmethod
    def from_dict(cls, d: dict) -> PlannedCall:
        return cls(
            d["name"], d["model"], DeviceMesh.from_dict(d["mesh"]), ParallelStrategy.from_dict(d["strategy"]),
            float(d["time_s"]), float(d["memory_bytes"]),
        )  # fmt: skip


@dataclass(frozen=True)
class PlannedTransfer:
    """A node the plan adds before a call, once per iteration.

    ``kind``: ``"realloc"`` (weights from the home layout of ``source``), ``"reload"`` (a frozen
    model from host memory), ``"ema"`` (``target``'s weights blended toward those of ``source``'s
    model, a ``ParamReallocHook``) or ``"data"`` (outputs of ``source`` moved to ``target``'s devices).
    ``devices``: first and last global device of each range it occupies.
    """

    kind: str
    target: str
    source: str | None
    time_s: float
    devices: tuple[tuple[int, int], ...]

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "target": self.target,
            "source": self.source,
            "time_s": self.time_s,
            "devices": [list(r) for r in self.devices],
        }

    @classmethod
    def from_dict(cls, d: dict) -> PlannedTransfer:
        return cls(d["kind"], d["target"], d["source"], float(d["time_s"]), tuple(tuple(r) for r in d["devices"]))


@dataclass(frozen=True)
class ExecutionPlan:
    """Per MFC a mesh and a strategy, the transfers they imply, and the simulator's estimates.

    Attributes:
        calls: one entry per MFC, in the problem's MFC order.
        transfers: reallocations, reloads and data transfers of one iteration.
        iteration_time_s: estimated steady-state time per iteration (s).
        max_memory_bytes: estimated peak bytes on the fullest device.
        fits: whether every device stays within ``device_memory_bytes``.
        choice: the option index of every MFC in the problem the plan came from.
        name: where the plan came from (``"search"``, ``"heuristic"``, ...).
    """

    calls: tuple[PlannedCall, ...]
    transfers: tuple[PlannedTransfer, ...]
    iteration_time_s: float
    max_memory_bytes: float
    fits: bool
    num_nodes: int
    devices_per_node: int
    device_memory_bytes: float
    choice: tuple[int, ...]
    name: str = "plan"

    @classmethod
    def from_choice(
        cls, problem: PlanProblem, choice, sim_result: SimResult | None = None, name: str = "plan"
    ) -> ExecutionPlan:
        """Build the plan of option indices ``choice``; simulates it unless ``sim_result`` is given."""
        cp = compile_problem(problem)
        choice = cp.check_choice(choice)
        result = sim_result if sim_result is not None else simulate(cp, choice)
        active, duration, ranges, copy = node_table(cp, choice)
        calls = []
        for i, j in enumerate(choice):
            o = problem.options[i][j]
            devices = list(o.mesh.device_ids)
            need = o.act_bytes + (o.weight_bytes if copy[i] else 0.0)
            memory = float(np.max(result.static_bytes[devices]) + need)
            model = problem.models[problem.mfc_models[i]].name
            calls.append(PlannedCall(problem.mfc_names[i], model, o.mesh, o.strategy, float(o.time_s), memory))
        transfers = []
        names, ne = problem.mfc_names, cp.num_edges
        for j in np.nonzero(active)[0]:
            j = int(j)
            if j >= ne and (j - ne) % 2 == 1:
                continue  # a call
            if j < ne:
                src, dst = problem.data_edges[j]
                rng = tuple((lo, hi - 1) for lo, hi in ranges[j])
                transfers.append(PlannedTransfer("data", names[dst], names[src], float(duration[j]), rng))
                continue
            dst = (j - ne) // 2
            for kind, src, seconds in pre_node_parts(cp, choice, dst):  # a realloc or reload, then an EMA blend
                meshes = [src, dst] if src is not None else [dst]
                rng = tuple(_device_range(problem.options[k][choice[k]].mesh) for k in meshes)
                transfers.append(PlannedTransfer(kind, names[dst], None if src is None else names[src], seconds, rng))
        return cls(
            tuple(calls), tuple(transfers), result.iteration_time_s, result.max_bytes, result.fits,
            problem.num_nodes, problem.devices_per_node, float(problem.device_memory_bytes),
            tuple(int(c) for c in choice), name,
        )  # fmt: skip

    # ------------------------------------------------------------------ lookups

    def call(self, name: str) -> PlannedCall:
        for c in self.calls:
            if c.name == name:
                return c
        raise KeyError(f"no MFC {name!r} in the plan; the MFCs are {[c.name for c in self.calls]}")

    def placements(self) -> dict[str, tuple[DeviceMesh, ParallelStrategy]]:
        """``{mfc_name: (mesh, strategy)}`` — what the trainer builds its worker groups from."""
        return {c.name: (c.mesh, c.strategy) for c in self.calls}

    def to_config(self) -> dict[str, dict]:
        """The plan as a hand-written config for :func:`rlflow.planner.baselines.manual_plan`."""
        return {c.name: {"mesh": c.mesh.to_dict(), "strategy": c.strategy.to_dict()} for c in self.calls}

    # ------------------------------------------------------------------ serialization

    def to_dict(self) -> dict:
        return {
            "format_version": _FORMAT_VERSION,
            "name": self.name,
            "cluster": {
                "num_nodes": self.num_nodes,
                "devices_per_node": self.devices_per_node,
                "device_memory_bytes": self.device_memory_bytes,
            },
            "iteration_time_s": self.iteration_time_s,
            "max_memory_bytes": self.max_memory_bytes,
            "fits": self.fits,
            "choice": list(self.choice),
            "calls": [c.to_dict() for c in self.calls],
            "transfers": [t.to_dict() for t in self.transfers],
        }

    @classmethod
    def from_dict(cls, d: dict) -> ExecutionPlan:
        if d.get("format_version") != _FORMAT_VERSION:
            raise ValueError(f"plan format_version={d.get('format_version')!r}; this rlflow reads {_FORMAT_VERSION}")
        c = d["cluster"]
        return cls(
            tuple(PlannedCall.from_dict(x) for x in d["calls"]), tuple(PlannedTransfer.from_dict(x) for x in d["transfers"]),
            float(d["iteration_time_s"]), float(d["max_memory_bytes"]), bool(d["fits"]), int(c["num_nodes"]),
            int(c["devices_per_node"]), float(c["device_memory_bytes"]), tuple(d["choice"]), d["name"],
        )  # fmt: skip

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ExecutionPlan:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> ExecutionPlan:
        with open(path) as f:
            return cls.from_json(f.read())

    # ------------------------------------------------------------------ printing

    def to_table(self) -> str:
        """The plan as a text table: MFC, model, mesh, strategy, estimated time and memory."""
        rows = [("MFC", "model", "mesh", "devices", "strategy", "est. time", "est. memory")]
        for c in self.calls:
            rows.append((c.name, c.model, f"({c.mesh.num_nodes},{c.mesh.num_devices})", _devices(c.mesh), str(c.strategy), format_seconds(c.time_s), format_bytes(c.memory_bytes)))  # fmt: skip
        widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        for t in self.transfers:
            src = f" from {t.source}" if t.source else ""
            where = ", ".join(f"{lo}..{hi}" for lo, hi in t.devices)
            lines.append(f"  + {t.kind}{src} -> {t.target}: {format_seconds(t.time_s)} on devices {where}")
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines.append(
            f"estimated time per iteration: {format_seconds(self.iteration_time_s)}; peak memory "
            f"{format_bytes(self.max_memory_bytes)} of {format_bytes(self.device_memory_bytes)} per device ({verdict})"
        )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_table()


def _device_range(mesh: DeviceMesh) -> tuple[int, int]:
    """First and last global device of ``mesh``."""
    return mesh.first_device, mesh.first_device + mesh.size - 1


def _devices(mesh: DeviceMesh) -> str:
    ids = mesh.device_ids
    return f"{ids[0]}..{ids[-1]}"


def format_seconds(t: float) -> str:
    """``0.0123`` → ``"12.3 ms"``, ``12.3`` → ``"12.30 s"``."""
    return f"{t * 1e3:.1f} ms" if t < 1.0 else f"{t:.2f} s"


def format_bytes(b: float) -> str:
    return f"{b / 2**30:.1f} GiB"
