"""A run that calibrates the cost model by its own calls (``placement.calibrate: run``).

A model shape new to this host starts without timing its calls first: the planner prices it
from the host's machine profile (layer timings and whole calls of a reference model, measured
once per host). A later run of the shape plans with the calibrated profile, and calibrates it
again where its plan runs a call type in a regime (one device alone, or several busy) that no run
of the shape measured (:func:`uncalibrated_kinds`): a plan priced there is the reference model's
extrapolation, off by several times for a model of other proportions. The run measures itself,
``placement.calibrate_steps`` steps at a time, after its first step (a warm-up: its calls pay
first-call costs):

1. the calls on the plan as it was priced: each call type's measured seconds against the plan's
   estimates give the type's correction in the regime the calls ran in
   (``MachineProfile.alone_corrections`` where they ran on one device of a host,
   ``MachineProfile.corrections`` where they kept more busy);
2. on a plan of one worker of a host with several cores, the same calls on the other thread count
   (every core, or one): how much faster every core runs each call type at the run's own shapes
   (``MachineProfile.host_speedups``, which replace the reference model's).

A multi-turn run also measures its tools: the seconds an episode's step takes (its logged
``multi_turn/step_s`` over ``multi_turn/turns``) replace ``rollout.multi_turn.tool_seconds`` in the
plan made next, and the generate calls' corrections leave out the waits for the steps (priced by
:meth:`~rlflow.planner.cost.Workload.tool_wait_s` at the seconds measured, and at the configured
ones in the running plan's estimates), so a slow tool does not read as slow decoding. A run under
dynamic sampling measures its generation rounds a step: their mean replaces
``algorithm.dynamic_sampling_rounds`` in the plan made next.

:class:`RunCalibration` then writes the corrected profile to the cache file of the run's shapes
(the next run of the shape plans with it from step 1) and plans again. A plan of the same calls
on the same workers is taken at once (its thread count set on the worker); another layout is taken
(a checkpoint, the workers restarted on it, the run resumed) when it is estimated faster than the
running plan by more than :data:`REPLAN_MARGIN` and the seconds it saves over the remaining steps
exceed what a restart costs (this run's start-up).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import median

import networkx as nx

from rlflow.dataflow import mfcs_of, rollout_calls
from rlflow.planner.cost import busy_devices
from rlflow.planner.model_spec import ModelSpec
from rlflow.planner.profile import MachineProfile, save_profile
from rlflow.trainer.config import RLFlowConfig
from rlflow.trainer.placement import PROFILED_CALL, Placement, plan_placement, planning_workload

# A plan on other workers is taken when it is this share faster than the running plan at the
# same prices: within it, the prices' own error could decide.
REPLAN_MARGIN = 0.1
_CLIP = (1 / 16, 16.0)


def _layout(placement: Placement) -> tuple:
    """The calls' ranks and strategies: two placements of one layout differ at most in threads."""
    return tuple(sorted((n, c.ranks, str(c.strategy)) for n, c in placement.calls.items()))


def _alone_kinds(placement: Placement, kinds: Mapping[str, str], profile: MachineProfile) -> set[str]:
    """The call types whose every call in ``placement`` ran on one device of a host whose
    ``profile`` timed calls alone: those the planner priced by the alone fit
    (:func:`rlflow.planner.cost.busy_devices` of their mesh: 1)."""
    if placement.plan is None or profile.calls is None or not profile.calls.timed_alone:
        return set()
    busy: dict[str, set[int]] = {}
    for call in placement.plan.calls:
        if call.name in kinds:
            busy.setdefault(kinds[call.name], set()).add(busy_devices(call.mesh))
    return {kind for kind, devices in busy.items() if devices == {1}}


def uncalibrated_kinds(placement: Placement, kinds: Mapping[str, str], profile: MachineProfile) -> list[str]:
    """The call types ``placement`` runs in a regime — on one device of a host alone, or keeping more
    busy — for which ``profile`` holds no correction by a run's own calls
    (``MachineProfile.alone_corrections``, ``MachineProfile.corrections``): their prices extrapolate
    the machine profile's reference model, which no run of these shapes has checked."""
    if placement.plan is None or profile.calls is None:
        return []
    alone = _alone_kinds(placement, kinds, profile)
    planned = {kinds[c.name] for c in placement.plan.calls if c.name in kinds}
    checked = {True: profile.alone_corrections or {}, False: profile.corrections or {}}
    return sorted(k for k in planned if k not in checked[k in alone])


def _per_kind(kinds: Mapping[str, str], seconds: Mapping[str, float]) -> dict[str, float]:
    """Seconds summed by interface type."""
    out: dict[str, float] = {}
    for name, s in seconds.items():
        out[kinds[name]] = out.get(kinds[name], 0.0) + s
    return out


@dataclass
class Decision:
    """What a calibration found.

    Attributes:
        profile: the machine profile with the run's corrections (also cached for the shape).
        placement: the placement to go on with: the running one with new ``threads``, or another
            layout (``restart``), or None when the running placement stays as it is.
        restart: whether taking ``placement`` needs the workers restarted (another layout).
        message: one line for the log.
        metrics: ``planner/*`` values logged at the calibration step.
    """

    profile: MachineProfile
    placement: Placement | None
    restart: bool
    message: str
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class RunCalibration:
    """Calibrates a run started from the machine profile ``profile`` (see the module docstring).

    Attributes:
        profile: the machine profile the run was planned with.
        paths: where the calibrated profile goes: the cache file of the run's shapes, and the run
            directory's ``profile.json`` (the profile the run plans with).
        specs: the planner's model specs, to plan again.
        multi_turn: whether generate calls are multi-turn rollouts (planned tp = pp = 1).
    """

    profile: MachineProfile
    paths: tuple[Path, ...]
    specs: Mapping[str, ModelSpec]
    multi_turn: bool = False
    steps: int = 2
    cores: int = 1
    start: int = 0  # the step the run (re)started after
    threads: tuple[int, ...] = ()  # the thread count of each phase: (as priced,) or (as priced, other)

    def begin(self, step: int, placement: Placement, steps: int, cores: int) -> None:
        """Measures from the step after ``step`` on: ``steps`` steps a phase, a second phase on the
        other thread count when ``placement`` runs every call on one worker of ``cores``."""
        self.start, self.steps, self.cores = step, steps, cores
        one_worker = len(placement.used_ranks) == 1 and placement.plan is not None
        other = 1 if placement.threads > 1 else cores
        self.threads = (placement.threads, other) if one_worker and cores > 1 else (placement.threads,)

    def due(self, step: int) -> bool:
        """Whether a phase ends at ``step`` (the trainer then calls :meth:`at`; nothing is issued past it)."""
        return any(step == self._phase_end(i) for i in range(len(self.threads)))

    def _phase_end(self, phase: int) -> int:
        return self.start + 1 + self.steps * (phase + 1)

    def _phase(self, measured: Sequence[float], phase: int) -> float:
        """The median seconds of one call in ``phase`` (the first step since the start left out)."""
        first = 1 + self.steps * phase
        return median(measured[first : first + self.steps])

    def at(
        self,
        step: int,
        cfg: RLFlowConfig,
        graph: nx.DiGraph,
        placement: Placement,
        measured: Mapping[str, Sequence[float]],
        restart_s: float,
        tool_seconds: Mapping[str, Sequence[float]] | None = None,
        rounds: Sequence[float] = (),
    ) -> int | Decision:
        """At the end of a phase: the thread count of the next phase, or the :class:`Decision`.

        Args:
            step: the step just logged.
            cfg: the run's config.
            graph: its dataflow graph.
            placement: the running placement.
            measured: each call's seconds at every step since the run (re)started.
            restart_s: what taking another layout costs (the run's start-up seconds).
            tool_seconds: a multi-turn generate call's seconds per episode step, at every step
                since the run (re)started.
            rounds: dynamic sampling's generation rounds at every step since the run (re)started.
        """
        if step == self._phase_end(0) and len(self.threads) > 1:
            return self.threads[1]
        kinds = {m.name: m.interface_type for m in mfcs_of(graph)}
        estimated = placement.estimated_call_seconds()
        names = [n for n in estimated if n in kinds and len(measured.get(n, ())) > self.steps * len(self.threads)]
        calls = [{n: self._phase(measured[n], i) for n in names} for i in range(len(self.threads))]
        cfg, waits, priced_waits = self._tools(cfg, graph, placement, tool_seconds or {})
        cfg, repeats = self._rounds(cfg, graph, rounds)
        # A step's seconds by call type; the calls' own work (one call each; the waits for tools
        # neither scale with the machine nor with threads).
        phases = [_per_kind(kinds, {n: s * repeats.get(n, 1.0) for n, s in c.items()}) for c in calls]
        work = [{k: max(v - waits.get(k, 0.0), 0.0) for k, v in _per_kind(kinds, c).items()} for c in calls]
        estimated = {n: estimated[n] - priced_waits.get(n, 0.0) for n in estimated}
        priced = dict(self.profile.host_speedups or {})
        if self.profile.calls is not None:
            priced = {c: priced.get(c) or self.profile.calls.host_speedup(c) for c in PROFILED_CALL.values()}
        # The plan's estimates on one thread: a plan priced on every core divided them by the speedups.
        undo = (lambda n: priced.get(PROFILED_CALL[kinds[n]]) or 1.0) if placement.threads > 1 else (lambda n: 1.0)
        one_thread = {n: estimated[n] * undo(n) for n in names}
        by_threads = dict(zip(self.threads, work))
        base = by_threads.get(1, work[0])
        est = _per_kind(kinds, one_thread if 1 in by_threads else {n: estimated[n] for n in names})
        alone = _alone_kinds(placement, kinds, self.profile)
        factors = {False: dict(self.profile.corrections or {}), True: dict(self.profile.alone_corrections or {})}
        for kind, real in base.items():
            if est.get(kind, 0.0) > 0:
                regime = factors[kind in alone]
                regime[kind] = float(min(max(regime.get(kind, 1.0) * real / est[kind], _CLIP[0]), _CLIP[1]))
        speedups = dict(self.profile.host_speedups or {})
        if len(by_threads) > 1:
            every = by_threads[self.cores]
            speedups |= {PROFILED_CALL[k]: by_threads[1][k] / every[k] for k in every if every[k] > 0}
        profile = replace(
            self.profile,
            corrections=factors[False] or None,
            alone_corrections=factors[True] or None,
            host_speedups=speedups or None,
        )
        for path in self.paths:
            save_profile(profile, path)
        decision = self._decide(cfg, graph, placement, profile, phases, restart_s, step)
        if self.multi_turn and waits:
            seconds = cfg.rollout.multi_turn.tool_seconds
            decision.metrics["planner/tool_seconds"] = seconds
            decision.message += f"; tools measured {seconds:.3f} s an episode step"
        if repeats:
            decision.metrics["planner/dynamic_sampling_rounds"] = cfg.algorithm.dynamic_sampling_rounds
            decision.message += f"; {cfg.algorithm.dynamic_sampling_rounds:.2f} generation rounds a step"
        return decision

    def _window(self, values: Sequence[float]) -> Sequence[float]:
        """The values of the calibration's steps among a run's per-step ``values`` (the warm-up step left out)."""
        return values[1 : 1 + self.steps * len(self.threads)]

    def _rounds(self, cfg: RLFlowConfig, graph: nx.DiGraph, rounds: Sequence[float]) -> tuple[RLFlowConfig, dict]:
        """``cfg`` with the mean of the measured generation ``rounds``, and the calls of a round with
        that mean (each runs it many times a step); unchanged and empty without dynamic sampling."""
        measured = self._window(rounds)
        if not measured:
            return cfg, {}
        mean = sum(measured) / len(measured)
        cfg = replace(cfg, algorithm=replace(cfg.algorithm, dynamic_sampling_rounds=mean))
        return cfg, dict.fromkeys(rollout_calls(graph), mean)

    def _tools(
        self, cfg: RLFlowConfig, graph: nx.DiGraph, placement: Placement, tool_seconds: Mapping[str, Sequence[float]]
    ) -> tuple[RLFlowConfig, dict[str, float], dict[str, float]]:
        """``cfg`` with the measured ``tool_seconds`` (their median over the calibration's steps, over
        the generate calls), and by call type the waits for tools at those seconds, and by call name
        the waits the running plan priced; unchanged and empty when no tool time was measured."""
        seen = [s for values in tool_seconds.values() for s in self._window(values)]
        if not self.multi_turn or not seen or placement.plan is None:
            return cfg, {}, {}
        mt = cfg.rollout.multi_turn
        measured = replace(cfg, rollout=replace(cfg.rollout, multi_turn=replace(mt, tool_seconds=median(seen))))
        before, after = planning_workload(cfg, True), planning_workload(measured, True)
        mfcs = {m.name: m for m in mfcs_of(graph)}
        waits: dict[str, float] = {}
        priced: dict[str, float] = {}
        for call in placement.plan.calls:
            mfc = mfcs.get(call.name)
            if mfc is None or mfc.interface_type != "generate":
                continue
            rows = -(-before.n_seqs(mfc) // call.strategy.dp)
            priced[call.name] = before.tool_wait_s(rows)
            waits["generate"] = waits.get("generate", 0.0) + after.tool_wait_s(rows)
        return measured, waits, priced

    def _decide(self, cfg, graph, placement, profile, phases, restart_s: float, step: int) -> Decision:
        shown = ", ".join(f"{k} ×{v:.2f}" for k, v in sorted((profile.corrections or {}).items()))
        if profile.alone_corrections:
            alone = ", ".join(f"{k} ×{v:.2f}" for k, v in sorted(profile.alone_corrections.items()))
            shown = f"{shown}; one worker alone {alone}" if shown else f"one worker alone {alone}"
        if profile.host_speedups:
            shown += "; every core " + ", ".join(f"{k} ×{v:.2f}" for k, v in sorted(profile.host_speedups.items()))
        metrics = {f"planner/correction_{k}": v for k, v in (profile.corrections or {}).items()}
        metrics |= {f"planner/alone_correction_{k}": v for k, v in (profile.alone_corrections or {}).items()}
        metrics |= {f"planner/host_speedup_{k}": v for k, v in (profile.host_speedups or {}).items()}
        # The running layout at its better measured thread count: its calls one after another
        # (one worker), else its estimate scaled as its calls measured against theirs.
        current = min(sum(p.values()) for p in phases)
        if len(placement.used_ranks) > 1:
            est = sum(c.time_s for c in placement.plan.calls)  # an iteration's calls, every round of them
            current = placement.plan.iteration_time_s * (sum(phases[0].values()) / est if est > 0 else 1.0)
        new = plan_placement(cfg, graph, self.specs, use_gpu=False, profile=profile, progress=False,
                             multi_turn=self.multi_turn)  # fmt: skip
        proposed = new.plan.iteration_time_s
        metrics |= {"planner/replanned": 0.0, "planner/calibrated_s": current, "planner/threads": float(new.threads)}
        head = f"calibrated by the run's calls ({shown}): the running plan measured {current:.3f} s/iteration"
        remaining = cfg.trainer.total_steps - step
        if _layout(new) == _layout(placement):
            what = f"the planner keeps it, on {new.threads} thread{'s' * (new.threads > 1)} a worker"
            return Decision(profile, new, False, f"{head}; {what}", metrics)
        saved = (current - proposed) * remaining
        name = f"{new.plan.name!r} at est. {proposed:.3f} s/iteration"
        if proposed > current * (1 - REPLAN_MARGIN) or saved <= restart_s:
            why = f"saves {saved:.1f} s over {remaining} steps, a restart costs {restart_s:.1f} s"
            # the running layout stays, on its faster thread count
            threads = self.threads[min(range(len(phases)), key=lambda i: sum(phases[i].values()))]
            kept = replace(placement, threads=threads)
            return Decision(profile, kept, False, f"{head}; {name} is not worth a restart ({why})", metrics)
        metrics |= {"planner/replanned": 1.0, "planner/replanned_estimate_s": proposed}
        return Decision(profile, new, True, f"{head}; taking {name} (saves est. {saved:.1f} s)", metrics)
