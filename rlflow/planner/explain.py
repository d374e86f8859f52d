"""Why one plan beats another: per call, what its time is made of; per iteration, what overlaps.

The ReaLHF paper explains its searched plans against the heuristic by the calls that got faster
— split into computation and communication (its Figures 9 and 10) — and by the calls that run
side by side on disjoint devices. :func:`explain_plan` does the same with the cost model and the
simulator:

* **per call**: the seconds of the call under both plans, and its communication — the call's
  time minus its time on a cluster whose links are free (infinite bandwidth, no latency): tp
  collectives, pipeline sends, exposed FSDP gathers and reduce-scatters, the sampler's token
  broadcast. The rest is computation (and fixed overheads);
* **per iteration**: the seconds spent in reallocations, reloads and data transfers, and the time
  calls overlap other calls in the steady state (between the ends of the iterations the period is
  measured over), with the share of device time the plan keeps busy.

Units: seconds per iteration unless said otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from rlflow.planner.cluster import ClusterSpec
from rlflow.planner.problem import CallOption, PlanProblem
from rlflow.planner.simulate import SimResult

# Seconds of one call under an option on a cluster: ``price(mfc_index, option, cluster)``.
PriceFn = Callable[[int, CallOption, ClusterSpec], float]


def free_links(cluster: ClusterSpec) -> ClusterSpec:
    """``cluster`` with links that cost nothing: infinite bandwidths inside and across hosts, no latency."""
    return replace(
        cluster,
        intra_host_bandwidth=math.inf,
        inter_host_bandwidth=math.inf,
        collective_latency_s=0.0,
        intra_host_latency_s=0.0,
        inter_host_latency_s=0.0,
        decode_tp_step_s=0.0,  # the tp ranks' wait at a decode step's all-reduces
    )


@dataclass(frozen=True)
class CallChange:
    """One MFC under the reference and the searched plan (seconds of the call itself)."""

    mfc: str
    reference: str  # "(mesh) (dp,tp,pp)"
    searched: str
    reference_s: float
    searched_s: float
    reference_comm_s: float
    searched_comm_s: float

    @property
    def reference_compute_s(self) -> float:
        return self.reference_s - self.reference_comm_s

    @property
    def searched_compute_s(self) -> float:
        return self.searched_s - self.searched_comm_s


@dataclass(frozen=True)
class Overlap:
    """Two MFCs running at the same time on disjoint devices, seconds per iteration."""

    mfc_a: str
    mfc_b: str
    seconds: float


@dataclass(frozen=True)
class PlanExplanation:
    """What :func:`explain_plan` found; :meth:`to_text` is what ``rlflow plan`` prints."""

    reference_name: str
    reference_time_s: float
    searched_time_s: float
    calls: tuple[CallChange, ...]
    reference_transfers_s: dict[str, float]  # kind ("realloc", "reload", "ema", "data") -> seconds per iteration
    searched_transfers_s: dict[str, float]
    overlaps: tuple[Overlap, ...]  # of the searched plan, longest first
    reference_busy: float  # share of device time busy in the steady state
    searched_busy: float
    devices_used: int
    num_devices: int

    def to_text(self) -> str:
        gain = self.reference_time_s / self.searched_time_s - 1
        lines = [
            f"why the searched plan is {gain:+.1%} faster than {self.reference_name} "
            f"({_s(self.searched_time_s)} vs {_s(self.reference_time_s)} per iteration):",
            f"  {'MFC':<14}{self.reference_name + ' (comm)':>24}{'search (comm)':>24}  change",
        ]
        for c in self.calls:
            ref = f"{_s(c.reference_s)} ({_s(c.reference_comm_s)})"
            new = f"{_s(c.searched_s)} ({_s(c.searched_comm_s)})"
            lines.append(f"  {c.mfc:<14}{ref:>24}{new:>24}  {_change(c)}")
        for name, moved in ((self.reference_name, self.reference_transfers_s), ("search", self.searched_transfers_s)):
            parts = ", ".join(f"{k} {_s(v)}" for k, v in moved.items() if v > 0) or "none"
            lines.append(f"  transfers per iteration, {name}: {parts}")
        busy = (
            f"  devices busy {self.searched_busy:.0%} of the period (search) vs {self.reference_busy:.0%} "
            f"({self.reference_name}); the search uses {self.devices_used} of {self.num_devices} devices"
        )
        lines.append(busy)
        if self.overlaps:
            pairs = "; ".join(f"{o.mfc_a} with {o.mfc_b} {_s(o.seconds)}" for o in self.overlaps[:5])
            lines.append(f"  overlapping calls per iteration (search): {pairs}")
        else:
            lines.append("  no calls overlap in the searched plan: every call waits for the one before")
        return "\n".join(lines)


def _s(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 0.9995 else f"{seconds * 1e3:.1f} ms"


def _change(c: CallChange) -> str:
    if c.reference_s == c.searched_s:
        return "same"
    comm = c.reference_comm_s - c.searched_comm_s
    compute = c.reference_compute_s - c.searched_compute_s
    verb = "faster" if c.searched_s < c.reference_s else "slower"
    return f"{_s(abs(c.reference_s - c.searched_s))} {verb} (compute {_signed(compute)}, comm {_signed(comm)})"


def _signed(saved: float) -> str:
    return f"-{_s(saved)}" if saved >= 0 else f"+{_s(-saved)}"


def _label(option: CallOption) -> str:
    s = option.strategy
    return f"{option.mesh.shape} ({s.dp},{s.tp},{s.pp})"


def _steady_window(result: SimResult, period_from: int, period_to: int) -> tuple[float, float, int]:
    ends = result.iteration_end_s
    if len(ends) > 1 and period_to > period_from:
        return ends[period_from], ends[period_to], period_to - period_from
    return 0.0, ends[0], 1


def transfer_seconds(result: SimResult, window: tuple[float, float, int]) -> dict[str, float]:
    """Seconds per iteration of the non-call nodes ending inside the steady-state window, by kind."""
    lo, hi, n = window
    out = {"realloc": 0.0, "reload": 0.0, "ema": 0.0, "data": 0.0}
    for node in result.nodes:
        if node.kind != "call" and lo < node.end_s <= hi:
            out[node.kind] += (node.end_s - node.start_s) / n
    return out


def overlaps(result: SimResult, names: Sequence[str], window: tuple[float, float, int]) -> tuple[Overlap, ...]:
    """Seconds per iteration during which two calls of different MFCs run at once, inside the window."""
    lo, hi, n = window
    calls = [c for c in result.nodes if c.kind == "call" and c.end_s > lo and c.start_s < hi]
    total: dict[tuple[int, int], float] = {}
    for x, a in enumerate(calls):
        for b in calls[x + 1 :]:
            if a.mfc == b.mfc:
                continue
            both = min(a.end_s, b.end_s, hi) - max(a.start_s, b.start_s, lo)
            if both > 0:
                key = (min(a.mfc, b.mfc), max(a.mfc, b.mfc))
                total[key] = total.get(key, 0.0) + both / n
    found = [Overlap(names[i], names[k], s) for (i, k), s in total.items()]
    return tuple(sorted(found, key=lambda o: -o.seconds))


def busy_share(result: SimResult, num_devices: int, window: tuple[float, float, int]) -> float:
    """Share of device time inside the window that some node occupies."""
    lo, hi, _ = window
    busy = sum(
        (min(node.end_s, hi) - max(node.start_s, lo)) * len(node.devices)
        for node in result.nodes
        if node.end_s > lo and node.start_s < hi
    )
    return busy / ((hi - lo) * num_devices) if hi > lo else 0.0


def explain_plan(
    problem: PlanProblem,
    searched: tuple[Sequence[int], SimResult],
    reference: tuple[str, Sequence[int], SimResult],
    price: PriceFn,
    cluster: ClusterSpec,
    period: tuple[int, int],
) -> PlanExplanation:
    """Compare the searched plan with a reference plan (the heuristic, or another baseline).

    Args:
        problem: the planning problem both plans choose options of.
        searched: the searched plan's choice and its detailed simulation.
        reference: the reference's name, choice and detailed simulation.
        price: seconds of one call under an option on a cluster (the cost model ``build_problem``
            used); called on ``cluster`` and on :func:`free_links` of it to split off communication.
        cluster: the cluster the problem was priced for.
        period: the iterations whose ends bound the steady state (``CompiledProblem.period_from``
            and ``period_to``).
    """
    free = free_links(cluster)
    (choice, result), (ref_name, ref_choice, ref_result) = searched, reference

    def change(i: int) -> CallChange:
        a, b = problem.options[i][ref_choice[i]], problem.options[i][choice[i]]
        return CallChange(
            problem.mfc_names[i],
            _label(a),
            _label(b),
            a.time_s,
            b.time_s,
            max(0.0, a.time_s - price(i, a, free)),
            max(0.0, b.time_s - price(i, b, free)),
        )

    window, ref_window = _steady_window(result, *period), _steady_window(ref_result, *period)
    used = {d for i, j in enumerate(choice) for d in problem.options[i][j].mesh.device_ids}
    return PlanExplanation(
        reference_name=ref_name,
        reference_time_s=ref_result.iteration_time_s,
        searched_time_s=result.iteration_time_s,
        calls=tuple(change(i) for i in range(problem.num_mfcs)),
        reference_transfers_s=transfer_seconds(ref_result, ref_window),
        searched_transfers_s=transfer_seconds(result, window),
        overlaps=overlaps(result, problem.mfc_names, window),
        reference_busy=busy_share(ref_result, problem.num_devices, ref_window),
        searched_busy=busy_share(result, problem.num_devices, window),
        devices_used=len(used),
        num_devices=problem.num_devices,
    )
