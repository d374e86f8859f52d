"""Baseline plans, simulated like any searched plan so that every plan can be compared.

* ``heuristic`` (ReaLHF-Heuristic, Megatron style): every MFC on the whole cluster, tp inside a
  host (``devices_per_node``, or the largest smaller tp the MFC has an option for), pp across
  hosts, dp for what is left.
* ``colocated`` (verl style): every MFC on all devices with FSDP, ``dp = all devices``,
  ``tp = pp = 1``. Calls that do not train take the smallest tp whose option fits device
  memory alone when dp alone does not: verl's vLLM rollout uses tp, and its FSDP inference
  shards weights, which the option model (weights replicated across dp outside training)
  can only express as tp. Train calls must take dp only.
* ``split`` (OpenRLHF style): disjoint blocks of devices, one per model for its training and
  inference calls and one per generating model for generation (vLLM engines). Block sizes are
  divisors or multiples of ``devices_per_node``, grown from 1 device in proportion to each
  block's work (the device-seconds of its calls' cheapest options); devices left over stay
  idle. Train calls take ``dp = block size`` (ZeRO-3), the other calls the smallest tp that
  fits alone (vLLM engines for generation; sharded inference for the rest, as above).
* ``manual``: a hand-written ``{mfc_name: {"mesh": ..., "strategy": ...}}``.

A baseline whose placement is not among an MFC's options (the strategy is invalid for the
model, or the cost model ruled it out) is reported as infeasible with the reason; it is never
moved to a neighbouring option.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from rlflow.planner.mesh import DeviceMesh
from rlflow.planner.problem import PlanProblem
from rlflow.planner.simulate import SimResult, Simulator
from rlflow.strategy import ParallelStrategy

Placements = dict[int, tuple[DeviceMesh, ParallelStrategy]]


@dataclass(frozen=True, eq=False)
class BaselinePlan:
    """A named plan and its simulation; ``choice`` is None when the placement is not an option."""

    name: str
    choice: tuple[int, ...] | None
    result: SimResult | None
    reason: str = ""  # why the plan is infeasible

    @property
    def feasible(self) -> bool:
        """The plan exists among the options and fits device memory."""
        return self.result is not None and self.result.fits

    @property
    def iteration_time_s(self) -> float | None:
        return None if self.result is None else self.result.iteration_time_s


def baseline_plans(
    problem: PlanProblem, generate_mfcs: Collection[str] = (), sim: Simulator | None = None
) -> list[BaselinePlan]:
    """The heuristic, colocated and split baselines of ``problem``."""
    sim = sim or Simulator(problem)
    return [
        heuristic_plan(problem, sim),
        colocated_plan(problem, sim),
        split_plan(problem, generate_mfcs, sim),
    ]


def heuristic_plan(problem: PlanProblem, sim: Simulator | None = None) -> BaselinePlan:
    """Every MFC on the whole cluster: tp inside a host, pp across hosts (ReaLHF-Heuristic)."""
    whole = _whole_cluster(problem)
    placements: Placements = {}
    for i in range(problem.num_mfcs):
        for tp in sorted(_divisors(problem.devices_per_node), reverse=True):
            s = ParallelStrategy(dp=problem.devices_per_node // tp, tp=tp, pp=problem.num_nodes)
            if _has(problem, i, whole, s):
                placements[i] = (whole, s)
                break
        else:
            return _infeasible(
                "heuristic", f"{problem.mfc_names[i]!r} has no option on the whole cluster with pp={problem.num_nodes}"
            )
    return evaluate_placements(problem, "heuristic", placements, sim)


def colocated_plan(problem: PlanProblem, sim: Simulator | None = None) -> BaselinePlan:
    """Every MFC on all devices, FSDP (dp = all); calls that do not train with the smallest tp that fits (verl)."""
    whole = _whole_cluster(problem)
    placements: Placements = {}
    for i in range(problem.num_mfcs):
        s = ParallelStrategy(dp=whole.size) if _trains(problem, i) else _smallest_fitting_tp(problem, i, whole)
        if s is None:
            return _infeasible("colocated", f"{problem.mfc_names[i]!r} fits on no tp of the whole cluster")
        placements[i] = (whole, s)
    return evaluate_placements(problem, "colocated", placements, sim)


def split_plan(problem: PlanProblem, generate_mfcs: Collection[str] = (), sim: Simulator | None = None) -> BaselinePlan:
    """Disjoint device blocks per model and per generating model (OpenRLHF)."""
    generate = _mfc_ids(problem, generate_mfcs)
    groups: dict[tuple[int, bool], list[int]] = {}
    for i, model in enumerate(problem.mfc_models):
        groups.setdefault((model, i in generate), []).append(i)
    members = list(groups.values())
    work = [sum(min(o.time_s * o.mesh.size for o in problem.options[i]) for i in g) for g in members]
    sizes = _block_sizes(work, problem.num_devices, problem.devices_per_node)
    if sizes is None:
        return _infeasible("split", f"{len(members)} device blocks do not fit in {problem.num_devices} devices")
    placements: Placements = {}
    offset = 0
    for g in sorted(range(len(members)), key=lambda g: -sizes[g]):
        try:
            block = _mesh_at(offset, sizes[g], problem.devices_per_node)
        except ValueError as exc:
            return _infeasible("split", f"block of {sizes[g]} devices at device {offset}: {exc}")
        offset += sizes[g]
        for i in members[g]:
            s = ParallelStrategy(dp=block.size) if _trains(problem, i) else _smallest_fitting_tp(problem, i, block)
            if s is None:
                return _infeasible("split", f"{problem.mfc_names[i]!r} fits on no tp of {block}")
            placements[i] = (block, s)
    return evaluate_placements(problem, "split", placements, sim)


def manual_plan(
    problem: PlanProblem, config: Mapping[str, Mapping], name: str = "manual", sim: Simulator | None = None
) -> BaselinePlan:
    """A hand-written plan: ``{mfc_name: {"mesh": mesh, "strategy": strategy}}`` for every MFC.

    ``mesh`` is a :class:`DeviceMesh`, its ``to_dict()``, or an inclusive device range such as
    ``"0-3"``; ``strategy`` a :class:`ParallelStrategy`, a dict, ``"dp=2,tp=4,pp=1"`` or
    ``(dp, tp, pp)``.

    Raises:
        ValueError: unknown or missing MFC names, or a malformed mesh/strategy.
    """
    names = problem.mfc_names
    unknown, missing = sorted(set(config) - set(names)), [n for n in names if n not in config]
    if unknown or missing:
        raise ValueError(f"plan config: unknown MFCs {unknown}, missing MFCs {missing}; the MFCs are {names}")
    placements: Placements = {}
    for i, n in enumerate(names):
        entry = config[n]
        if set(entry) != {"mesh", "strategy"}:
            raise ValueError(
                f"plan config for {n!r} must have exactly the keys 'mesh' and 'strategy', got {sorted(entry)}"
            )
        placements[i] = (parse_mesh(entry["mesh"], problem.devices_per_node), parse_strategy(entry["strategy"]))
    return evaluate_placements(problem, name, placements, sim)


def evaluate_placements(
    problem: PlanProblem, name: str, placements: Placements, sim: Simulator | None = None
) -> BaselinePlan:
    """Map placements to option indices and simulate; infeasible when one is not an option."""
    choice = []
    for i in range(problem.num_mfcs):
        mesh, strategy = placements[i]
        try:
            choice.append(problem.option_index(i, mesh, strategy))
        except KeyError:
            return _infeasible(name, f"{problem.mfc_names[i]!r} has no option with mesh {mesh} and strategy {strategy}")
    sim = sim or Simulator(problem)
    result = sim.evaluate(choice)
    reason = (
        ""
        if result.fits
        else f"needs {result.max_bytes / 2**30:.1f} GiB on a device of {problem.device_memory_bytes / 2**30:.1f} GiB"
    )
    return BaselinePlan(name, tuple(choice), result, reason)


# ----------------------------------------------------------------------------- parsing and helpers


def parse_mesh(spec, devices_per_node: int) -> DeviceMesh:
    """A mesh from a :class:`DeviceMesh`, a dict, or an inclusive device range ``"lo-hi"``."""
    if isinstance(spec, DeviceMesh):
        return spec
    if isinstance(spec, Mapping):
        return DeviceMesh(**{"devices_per_node": devices_per_node, **spec})
    match = re.fullmatch(r"\s*(\d+)\s*(?:-|\.\.)\s*(\d+)\s*", str(spec))
    if not match or int(match[2]) < int(match[1]):
        raise ValueError(f"mesh {spec!r}: expected a DeviceMesh, a dict or a device range like '0-3'")
    lo, hi = int(match[1]), int(match[2])
    return _mesh_at(lo, hi - lo + 1, devices_per_node)


def parse_strategy(spec) -> ParallelStrategy:
    """A strategy from a :class:`ParallelStrategy`, a dict, ``"dp=2,tp=4,pp=1"`` or ``(dp, tp, pp)``."""
    if isinstance(spec, ParallelStrategy):
        return spec
    if isinstance(spec, Mapping):
        return ParallelStrategy(**spec)
    if isinstance(spec, str):
        parts = dict(p.split("=", 1) for p in spec.replace(" ", "").split(",") if "=" in p)
        if not parts or set(parts) - {"dp", "tp", "pp"}:
            raise ValueError(f"strategy {spec!r}: expected something like 'dp=2,tp=4,pp=1'")
        return ParallelStrategy(**{k: int(v) for k, v in parts.items()})
    if isinstance(spec, (list, tuple)) and len(spec) == 3:
        return ParallelStrategy(dp=int(spec[0]), tp=int(spec[1]), pp=int(spec[2]))
    raise ValueError(f"strategy {spec!r}: expected a ParallelStrategy, a dict, 'dp=..,tp=..,pp=..' or (dp, tp, pp)")


def _mesh_at(lo: int, size: int, dpn: int) -> DeviceMesh:
    if size >= dpn:
        if size % dpn or lo % dpn:
            raise ValueError(f"a mesh of {size} devices at device {lo} is not a run of whole hosts of {dpn} devices")
        return DeviceMesh(size // dpn, dpn, node_start=lo // dpn, devices_per_node=dpn)
    return DeviceMesh(1, size, node_start=lo // dpn, device_start=lo % dpn, devices_per_node=dpn)


def _block_sizes(work: list[float], num_devices: int, dpn: int) -> list[int] | None:
    """Valid mesh sizes, one per block, summing to at most ``num_devices``: start at 1 device each and
    repeatedly grow (to the next valid size) the block with the most work per device that still fits."""
    valid = sorted(set(_divisors(dpn)) | {k * dpn for k in range(1, num_devices // dpn + 1)})
    sizes = [1] * len(work)
    if sum(sizes) > num_devices:
        return None
    while True:
        grow = [
            (w / s, -g)
            for g, (w, s) in enumerate(zip(work, sizes))
            if _next(valid, s) and sum(sizes) - s + _next(valid, s) <= num_devices
        ]
        if not grow:
            return sizes
        g = -max(grow)[1]
        sizes[g] = _next(valid, sizes[g])


def _next(valid: list[int], size: int) -> int | None:
    bigger = [v for v in valid if v > size]
    return bigger[0] if bigger else None


def _smallest_fitting_tp(problem: PlanProblem, i: int, mesh: DeviceMesh) -> ParallelStrategy | None:
    for tp in sorted(_divisors(min(mesh.size, problem.devices_per_node))):
        if mesh.size % tp:
            continue
        s = ParallelStrategy(dp=mesh.size // tp, tp=tp)
        for o in problem.options[i]:
            if (
                o.mesh == mesh
                and o.strategy == s
                and o.weight_bytes + o.act_bytes + o.train_state_bytes <= problem.device_memory_bytes
            ):
                return s
    return None


def _trains(problem: PlanProblem, i: int) -> bool:
    """MFC ``i`` is the train call (home) of its model."""
    return problem.models[problem.mfc_models[i]].train_mfc == i


def _has(problem: PlanProblem, i: int, mesh: DeviceMesh, strategy: ParallelStrategy) -> bool:
    return any(o.mesh == mesh and o.strategy == strategy for o in problem.options[i])


def _whole_cluster(problem: PlanProblem) -> DeviceMesh:
    return DeviceMesh(problem.num_nodes, problem.devices_per_node, devices_per_node=problem.devices_per_node)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _mfc_ids(problem: PlanProblem, names: Collection[str]) -> set[int]:
    unknown = sorted(set(names) - set(problem.mfc_names))
    if unknown:
        raise ValueError(f"generate_mfcs {unknown} are not MFCs of the problem; the MFCs are {problem.mfc_names}")
    return {problem.mfc_names.index(n) for n in names}


def _infeasible(name: str, reason: str) -> BaselinePlan:
    return BaselinePlan(name, None, None, reason)
