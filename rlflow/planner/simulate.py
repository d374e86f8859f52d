"""Time and memory of one plan: list scheduling of the unrolled augmented graph (ReaLHF Algorithm 1).

Two implementations read the same :class:`~rlflow.planner.compiled.CompiledProblem`: the C++
:class:`Simulator` (``rlflow._C_planner``, what the search calls millions of times) and the
pure-Python twin :func:`simulate_py` that the tests compare it with.

Scheduling. Nodes become *ready* when all their parents have ended (ready time = latest parent
end). A priority queue pops the ready node with the smallest ``(ready time, node id)``; it
starts at ``max(ready time, latest end of any node already placed on one of its devices)``
and occupies its devices until ``start + duration``. So calls whose device sets overlap run
one after another, disjoint ones overlap. A call is placed right after its pre-node (its
reallocation or reload), which occupies a superset of the call's devices, so the two run back
to back and the reallocated copy exists only while the call runs. Inactive nodes (no
reallocation needed, zero-size transfer) end at their ready time and touch no device.

Time. ``iteration_end_s[t]`` is the latest end of a node of iteration ``t``. The plan's time per
iteration is the steady-state period ``(iteration_end_s[G] - iteration_end_s[F]) / (G - F)``
(``iteration_end_s[0]`` when ``T == 1``), ``F, G`` = ``CompiledProblem.period_from, period_to``:
``0, T - 1`` leave out the pipeline fill of the first iteration, whose calls cannot overlap a
previous one. Under a lagged version edge of span ``s`` they are ``s - 1, T - s``: the ``s - 1``
iterations after the first read the initial weights and wait for nothing, and the last ``s - 1``
end early, as no later rollout runs before their training. ``total_time_s`` is the largest end.

Memory (bytes per device). ``static_bytes``: ``train_state_bytes + weight_bytes`` of each
trainable model's home option on its mesh, plus ``weight_bytes`` of each frozen model that
stays resident (all its calls on one layout). Dynamic, per call on its devices: ``act_bytes``,
plus ``weight_bytes`` when the call runs on a reallocated copy or a reloaded model. Calls on a
device never overlap in time, so ``peak_bytes = static_bytes + max`` of the dynamic bytes of
the calls on that device. The plan fits when ``max(peak_bytes) <= device_memory_bytes``;
its cost is its time per iteration, times ``penalty`` when it does not fit.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from rlflow.planner.compiled import PRE_REALLOC, PRE_RELOAD, CompiledProblem, compile_problem, data_seconds
from rlflow.planner.problem import PlanProblem
from rlflow.planner.timeline import Interval

DEFAULT_PENALTY = 1e3  # cost multiplier of a plan that does not fit in device memory

_BUILD_HINT = "build it with `.venv/bin/python setup.py build_ext --inplace -q` or `pip install -e .`"


@dataclass(frozen=True)
class ScheduledNode:
    """One active node of the schedule.

    ``kind`` is ``"call"``, ``"realloc"`` (weights from the home layout), ``"reload"`` (a frozen
    model from host memory), ``"ema"`` (a pre-node that only runs a weight hook) or ``"data"``
    (a transfer along a data edge); a pre-node is named by its first part
    (:func:`pre_node_parts`). ``mfc`` is the call the node runs or prepares; ``source_mfc`` the
    home MFC (realloc, ema) or producer (data).
    """

    kind: str
    mfc: int
    iteration: int
    start_s: float
    end_s: float
    devices: tuple[int, ...]
    source_mfc: int | None = None


@dataclass(frozen=True, eq=False)
class SimResult:
    """What the simulator says about one plan (see the module docstring for the definitions)."""

    iteration_time_s: float
    total_time_s: float
    iteration_end_s: tuple[float, ...]
    peak_bytes: np.ndarray  # (num_devices,) static + peak dynamic bytes
    static_bytes: np.ndarray  # (num_devices,)
    max_bytes: float
    fits: bool
    cost: float
    nodes: tuple[ScheduledNode, ...] = ()  # active nodes; empty unless simulated in detail

    def intervals(self, names: list[str]) -> list[Interval]:
        """Per-device busy intervals of the schedule, labelled with MFC ``names``, for the timeline."""
        return [
            Interval(device=d, start=n.start_s, end=n.end_s, label=names[n.mfc], kind=n.kind, iteration=n.iteration)
            for n in self.nodes
            for d in n.devices
        ]


# ----------------------------------------------------------------------------- plan-dependent node table


def node_table(cp: CompiledProblem, choice: np.ndarray) -> tuple[np.ndarray, np.ndarray, list, np.ndarray]:
    """Per node of one iteration: active flag, duration (s), device ranges; per MFC: runs on a copy.

    Returns:
        ``active`` (K,) bool, ``duration`` (K,) float, ``ranges``: K lists of ``(lo, hi)``
        device ranges, ``copy`` (M,) bool — the call holds an extra reallocated/reloaded copy.
    """
    m, k, ne = cp.num_mfcs, cp.nodes_per_iteration, cp.num_edges
    flat = cp.opt_offset[:-1] + choice
    active, duration = np.zeros(k, dtype=bool), np.zeros(k)
    copy = np.zeros(m, dtype=bool)
    rng = [(int(cp.opt_lo[f]), int(cp.opt_lo[f] + cp.opt_size[f])) for f in flat]
    ranges: list[list[tuple[int, int]]] = [[] for _ in range(k)]
    for i in range(m):
        pre, call = ne + 2 * i, ne + 2 * i + 1
        active[call], duration[call], ranges[call] = True, cp.opt_time[flat[i]], [rng[i]]
        for kind, src, seconds in pre_node_parts(cp, choice, i):
            duration[pre] += seconds
            active[pre] = True
            copy[i] |= kind != "ema"
            ranges[pre] += [rng[src], rng[i]] if src is not None else [rng[i]]
    for e in range(ne):
        src, dst = int(cp.edge_src[e]), int(cp.edge_dst[e])
        t = data_seconds(cp, e, int(choice[src]), int(choice[dst]))
        if t > 0:
            active[e], duration[e], ranges[e] = True, t, [rng[src], rng[dst]]
    return active, duration, ranges, copy


def pre_node_parts(cp: CompiledProblem, choice: np.ndarray, i: int) -> list[tuple[str, int | None, float]]:
    """What the pre-node of MFC ``i`` runs, in order: ``(kind, source MFC, seconds)`` with kind
    ``"realloc"`` (from the home of ``source``), ``"reload"`` (no source) or ``"ema"`` (a weight
    hook blending from the home of ``source``); empty when the pre-node is inactive."""
    parts: list[tuple[str, int | None, float]] = []
    n_i = int(cp.opt_offset[i + 1] - cp.opt_offset[i])
    if cp.pre_kind[i] == PRE_REALLOC:
        h = int(cp.home[i])
        if cp.opt_layout[cp.opt_offset[h] + choice[h]] != cp.opt_layout[cp.opt_offset[i] + choice[i]]:
            parts.append(("realloc", h, float(cp.realloc_table[cp.realloc_offset[i] + choice[h] * n_i + choice[i]])))
    elif cp.pre_kind[i] == PRE_RELOAD and not _resident(cp, choice, int(cp.mfc_model[i])):
        parts.append(("reload", None, float(cp.reload_table[cp.reload_offset[i] + choice[i]])))
    src = int(cp.hook_src[i])
    if src >= 0:
        parts.append(("ema", src, float(cp.hook_table[cp.hook_offset[i] + choice[src] * n_i + choice[i]])))
    return parts


def _resident(cp: CompiledProblem, choice: np.ndarray, model: int) -> bool:
    calls = cp.model_calls[cp.model_calls_offset[model] : cp.model_calls_offset[model + 1]]
    layouts = {int(cp.opt_layout[cp.opt_offset[c] + choice[c]]) for c in calls}
    return len(layouts) == 1


# ----------------------------------------------------------------------------- the Python twin


def _schedule(cp: CompiledProblem, active, duration, ranges) -> tuple[np.ndarray, np.ndarray]:
    k, n, ne = cp.nodes_per_iteration, cp.nodes_per_iteration * cp.num_iterations, cp.num_edges
    start, end, ready = np.zeros(n), np.zeros(n), np.zeros(n)
    pending = cp.indegree.copy()
    free = [0.0] * cp.num_devices
    heap = [(0.0, v) for v in range(n) if pending[v] == 0]
    heapq.heapify(heap)
    while heap:
        r, v = heapq.heappop(heap)
        while v >= 0:
            j, s = v % k, r
            pre = j >= ne and (j - ne) % 2 == 0
            if active[j]:
                for lo, hi in ranges[j]:
                    s = max(s, max(free[lo:hi]))
                e = s + duration[j]
                for lo, hi in ranges[j]:
                    free[lo:hi] = [e] * (hi - lo)
            else:
                e = s
            start[v], end[v] = s, e
            for c in cp.child[cp.child_offset[v] : cp.child_offset[v + 1]]:
                ready[c] = max(ready[c], e)
                pending[c] -= 1
                if pending[c] == 0 and not pre:
                    heapq.heappush(heap, (ready[c], int(c)))
            # A pre-node's only child, its call, is placed at once: nothing runs between them.
            v, r = (v + 1, e) if pre else (-1, 0.0)
    return start, end


def _memory(cp: CompiledProblem, choice: np.ndarray, copy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    static, dynamic = np.zeros(cp.num_devices), np.zeros(cp.num_devices)
    flat = cp.opt_offset[:-1] + choice
    for model in range(len(cp.model_trainable)):
        if cp.model_trainable[model]:
            f = flat[cp.model_home[model]]
            static[cp.opt_lo[f] : cp.opt_lo[f] + cp.opt_size[f]] += cp.opt_state[f] + cp.opt_weight[f]
        else:
            calls = cp.model_calls[cp.model_calls_offset[model] : cp.model_calls_offset[model + 1]]
            if len(calls) and _resident(cp, choice, model):
                f = flat[calls[0]]
                weight = max(cp.opt_weight[flat[c]] for c in calls)
                static[cp.opt_lo[f] : cp.opt_lo[f] + cp.opt_size[f]] += weight
    for i in range(cp.num_mfcs):
        f = flat[i]
        need = cp.opt_act[f] + (cp.opt_weight[f] if copy[i] else 0.0)
        lo, hi = cp.opt_lo[f], cp.opt_lo[f] + cp.opt_size[f]
        dynamic[lo:hi] = np.maximum(dynamic[lo:hi], need)
    return static, dynamic


def simulate_py(
    problem: PlanProblem | CompiledProblem, choice, *, penalty: float = DEFAULT_PENALTY, detailed: bool = True
) -> SimResult:
    """Simulate one plan in pure Python (the reference the C++ simulator is tested against).

    Args:
        problem: the problem, compiled or not.
        choice: one option index per MFC.
        penalty: cost multiplier when the plan does not fit in device memory.
        detailed: also return the scheduled nodes (for the timeline).
    """
    cp = problem if isinstance(problem, CompiledProblem) else compile_problem(problem)
    choice = cp.check_choice(choice)
    active, duration, ranges, copy = node_table(cp, choice)
    start, end = _schedule(cp, active, duration, ranges)
    static, dynamic = _memory(cp, choice, copy)
    full_active = np.tile(active, cp.num_iterations)
    return _result(cp, choice, start, end, full_active, static, static + dynamic, penalty, detailed)


def _result(cp, choice, start, end, full_active, static, peak, penalty, detailed) -> SimResult:
    k, t_count = cp.nodes_per_iteration, cp.num_iterations
    iter_end = tuple(float(end[t * k : (t + 1) * k].max()) for t in range(t_count))
    a, b = cp.period_from, cp.period_to
    period = (iter_end[b] - iter_end[a]) / (b - a) if t_count > 1 else iter_end[0]
    max_bytes = float(peak.max()) if peak.size else 0.0
    fits = max_bytes <= cp.device_memory_bytes
    nodes = _scheduled_nodes(cp, choice, start, end, full_active) if detailed else ()
    return SimResult(
        iteration_time_s=float(period),
        total_time_s=float(end.max()),
        iteration_end_s=iter_end,
        peak_bytes=peak,
        static_bytes=static,
        max_bytes=max_bytes,
        fits=bool(fits),
        cost=float(period if fits else period * penalty),
        nodes=nodes,
    )


def _scheduled_nodes(cp, choice, start, end, full_active) -> tuple[ScheduledNode, ...]:
    _, _, ranges, _ = node_table(cp, choice)
    k, ne = cp.nodes_per_iteration, cp.num_edges
    out = []
    for v in np.nonzero(full_active)[0]:
        t, j = divmod(int(v), k)
        devices = tuple(sorted({d for lo, hi in ranges[j] for d in range(lo, hi)}))
        if j < ne:
            kind, mfc, src = "data", int(cp.edge_dst[j]), int(cp.edge_src[j])
        elif (j - ne) % 2 == 1:
            kind, mfc, src = "call", (j - ne) // 2, None
        else:
            mfc = (j - ne) // 2
            kind, src, _ = pre_node_parts(cp, choice, mfc)[0]
        out.append(ScheduledNode(kind, mfc, t, float(start[v]), float(end[v]), devices, src))
    return tuple(sorted(out, key=lambda n: (n.start_s, n.end_s, n.mfc)))


# ----------------------------------------------------------------------------- the C++ simulator


def load_extension():
    """The ``rlflow._C_planner`` module; ``ImportError`` with the build command when it is missing."""
    try:
        from rlflow import _C_planner
    except ImportError as exc:  # the extension is built by setup.py, not importable from a bare checkout
        raise ImportError(f"rlflow._C_planner is not built; {_BUILD_HINT}") from exc
    return _C_planner


def cpp_problem(cp: CompiledProblem, penalty: float = DEFAULT_PENALTY):
    """The C++ ``Problem`` object built from the compiled arrays (constructed once, evaluated many times)."""
    ext = load_extension()
    arrays = {name: getattr(cp, name) for name in ext.Problem.ARRAY_FIELDS}
    return ext.Problem(
        cp.num_devices,
        cp.num_mfcs,
        cp.num_iterations,
        cp.nodes_per_iteration,
        cp.device_memory_bytes,
        penalty,
        arrays,
        cp.period_from,
        cp.period_to,
    )


class Simulator:
    """Evaluates plans of one problem with the C++ simulator.

    >>> sim = Simulator(problem)                    # doctest: +SKIP
    >>> sim.cost([0, 3, 1]), sim.evaluate([0, 3, 1]).iteration_time_s  # doctest: +SKIP
    """

    def __init__(self, problem: PlanProblem | CompiledProblem, penalty: float = DEFAULT_PENALTY):
        self.compiled = problem if isinstance(problem, CompiledProblem) else compile_problem(problem)
        self.penalty = penalty
        self.native = cpp_problem(self.compiled, penalty)

    @property
    def problem(self) -> PlanProblem:
        return self.compiled.problem

    def cost(self, choice) -> float:
        """Time per iteration in seconds, times the penalty when the plan does not fit."""
        return self.native.cost(self.compiled.check_choice(choice))

    def evaluate(self, choice, detailed: bool = True) -> SimResult:
        """Full result of one plan; ``detailed`` adds the scheduled nodes."""
        cp, choice = self.compiled, self.compiled.check_choice(choice)
        start, end, active, static, peak = self.native.evaluate(choice)
        return _result(cp, choice, start, end, active.astype(bool), static, peak, self.penalty, detailed)


def simulate(
    problem: PlanProblem | CompiledProblem, choice, *, penalty: float = DEFAULT_PENALTY, backend: str = "cpp"
) -> SimResult:
    """Simulate one plan in detail with the C++ (``backend="cpp"``) or Python (``"python"``) simulator."""
    if backend == "cpp":
        return Simulator(problem, penalty).evaluate(choice)
    if backend == "python":
        return simulate_py(problem, choice, penalty=penalty)
    raise ValueError(f"backend={backend!r}; expected 'cpp' or 'python'")
