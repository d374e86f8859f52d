"""Search over plans: Metropolis–Hastings chains in C++ (ReaLHF §5), the greedy start, exhaustive search.

A plan is one option index per MFC. The chains start from the greedy plan (each MFC on its
individually fastest option that fits memory alone) and from any plans the caller adds (the
baselines, so the result is never worse than them). A step changes one MFC's option: with
probability ``local_prob`` a *local move* (a factor moved between two parallel degrees on the
same mesh, the same strategy on a shifted mesh, or the mesh halved/doubled with dp), else a
jump to a uniformly random option. The new plan is accepted with probability

    min(1, exp(-(new_cost - old_cost) / old_cost / temperature))

— on the *relative* cost difference, so the temperature means the same on a 1 s and a 100 s
iteration (a plan 5% slower is accepted with probability 1/e at ``temperature=0.05``). As the
aim is the best plan, not samples of the distribution, proposals get no Hastings correction.
Every chain keeps its cheapest distinct plans; the best of all chains is returned.

Reproducibility: with ``max_steps`` and no ``seconds``, a fixed ``seed`` gives the same result
on every run (chains have their own RNG streams; the slicing into progress updates does not
change them). A time budget makes the step count, hence the result, depend on the machine.

The budget fits the problem (:func:`plan_search`, what ``placement.mode: auto`` runs): a problem
of at most :data:`EXHAUSTIVE_MAX_PLANS` plans is enumerated; a larger one is searched until it
converges — no better plan in the last :func:`patience_steps` proposals per chain (200k, or 100 per
option on large problems), nor in as many proposals as it took to find the best one — or its time
budget is spent. Both stopping
rules depend on steps only, so a converged search is as reproducible as one of ``max_steps``.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm

from rlflow.planner.problem import PlanProblem
from rlflow.planner.simulate import DEFAULT_PENALTY, SimResult, Simulator, load_extension

DEFAULT_TEMPERATURE = 0.05
DEFAULT_LOCAL_PROB = 0.7
DEFAULT_PAIR_PROB = 0.2
# Problems with at most this many plans are enumerated rather than sampled: the simulator prices
# a plan in microseconds, so this is a small fraction of a second, and the optimum is certain.
EXHAUSTIVE_MAX_PLANS = 50_000
# A search stops as converged when its best plan has not improved over this many proposals per
# chain, nor over as many as it took to find that plan. Large, so that a search still improving
# keeps its budget: on the 16-device PPO problem of the tests (10^12 plans) chains still found
# better plans after 200k proposals each.
PATIENCE_STEPS = 200_000
# ... and at least this many per option of the problem: a random jump lands on a given option of a
# given MFC once in about (number of MFCs x its options) proposals, so a problem of thousands of
# options per MFC (16 hosts: 16k options in all) needs millions of proposals before a stall means
# anything. 100 per option keeps the 8-device problems at PATIENCE_STEPS.
PATIENCE_PER_OPTION = 100


@dataclass(frozen=True)
class RankedPlan:
    cost: float  # time per iteration (s), times the penalty when the plan does not fit
    choice: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class SearchResult:
    """The outcome of a search.

    Attributes:
        choice: the best plan found.
        cost: its cost (see :class:`RankedPlan`).
        result: its detailed simulation.
        top: the cheapest distinct plans found, cheapest first (``top[0]`` is the best).
        steps: proposals evaluated over all chains (plans enumerated, for exhaustive search).
        accepted: proposals accepted over all chains.
        seconds: wall-clock time of the search.
        method: ``"mcmc"`` or ``"exhaustive"``.
        stop: why it stopped: ``"enumerated"`` (exhaustive), ``"converged"`` (no improvement
            within the patience), ``"max_steps"``, ``"budget"`` (the time ran out) or
            ``"single plan"`` (no MFC has a choice).
        best_step: proposals per chain made when the best plan was last improved on (seen
            between slices of the run, so up to one slice late); 0: a start plan is the best,
            or an exhaustive search.
        filled_devices: idle devices of the chains' best plan that :func:`fill_idle_devices`
            put to work (MCMC only; 0 when no move onto them was faster).
    """

    choice: tuple[int, ...]
    cost: float
    result: SimResult
    top: tuple[RankedPlan, ...]
    steps: int
    accepted: int
    seconds: float
    method: str
    stop: str
    best_step: int
    filled_devices: int = 0

    def summary(self) -> str:
        """One line on how the search went, e.g. ``plan search: mcmc, 24000 proposals, best at
        proposal 1000 per chain, converged, 0.03 s``."""
        if self.method == "exhaustive":
            return f"plan search: every one of {self.steps} plans evaluated, {self.seconds:.2f} s"
        filled = f", {self.filled_devices} idle devices put to work" if self.filled_devices else ""
        return (
            f"plan search: {self.method}, {self.steps} proposals, best at proposal {self.best_step} per chain, "
            f"{self.stop}, {self.seconds:.2f} s{filled}"
        )


def acceptance_probability(old_cost: float, new_cost: float, temperature: float) -> float:
    """``min(1, exp(-(new - old) / old / temperature))``; 0 for a worse plan at temperature 0.

    >>> round(acceptance_probability(10.0, 10.5, 0.05), 4)   # 5% worse at T=0.05: 1/e
    0.3679
    """
    if new_cost <= old_cost:
        return 1.0
    if temperature <= 0 or old_cost <= 0:
        return 0.0
    return math.exp(-(new_cost - old_cost) / old_cost / temperature)


def greedy_choice(problem: PlanProblem) -> list[int]:
    """Each MFC on its fastest option that fits device memory alone (weights + state + activations);
    the option needing least memory when none fits."""
    choice = []
    for opts in problem.options:
        alone = [o.weight_bytes + o.train_state_bytes + o.act_bytes for o in opts]
        fitting = [j for j, need in enumerate(alone) if need <= problem.device_memory_bytes]
        if fitting:
            choice.append(min(fitting, key=lambda j: (opts[j].time_s, j)))
        else:
            choice.append(min(range(len(opts)), key=lambda j: (alone[j], j)))
    return choice


def patience_steps(problem: PlanProblem) -> int:
    """Proposals per chain without improvement after which a search counts as converged:
    :data:`PATIENCE_STEPS`, or :data:`PATIENCE_PER_OPTION` per option when that is more."""
    return max(PATIENCE_STEPS, PATIENCE_PER_OPTION * sum(len(o) for o in problem.options))


def num_plans(problem: PlanProblem) -> int:
    """Number of distinct plans: the product of the MFCs' option counts."""
    return math.prod(len(o) for o in problem.options)


def plan_search(
    problem: PlanProblem | Simulator,
    *,
    max_seconds: float,
    seed: int = 0,
    initial_plans=(),
    progress: bool | None = None,
    exhaustive_max_plans: int = EXHAUSTIVE_MAX_PLANS,
    patience: int | None = None,
    num_chains: int | None = None,
) -> SearchResult:
    """The cheapest plan, at a cost that fits the problem: every plan evaluated when there are at
    most ``exhaustive_max_plans``, else :func:`search` until it converges (``patience`` proposals
    per chain without improvement; default :func:`patience_steps`) or ``max_seconds`` are spent
    (see the module docstring).

    >>> plan_search(problem, max_seconds=10.0).summary()  # doctest: +SKIP
    'plan search: every one of 12 plans evaluated, 0.00 s'
    """
    plain = problem.problem if isinstance(problem, Simulator) else problem
    if num_plans(plain) <= exhaustive_max_plans:
        return exhaustive_search(problem, max_plans=exhaustive_max_plans)
    return search(
        problem,
        seconds=max_seconds,
        patience=patience or patience_steps(plain),
        num_chains=num_chains,
        seed=seed,
        initial_plans=initial_plans,
        progress=progress,
    )


def search(
    problem: PlanProblem | Simulator,
    *,
    seconds: float | None = None,
    max_steps: int | None = None,
    patience: int | None = None,
    num_chains: int | None = None,
    seed: int = 0,
    temperature: float = DEFAULT_TEMPERATURE,
    local_prob: float = DEFAULT_LOCAL_PROB,
    pair_prob: float = DEFAULT_PAIR_PROB,
    top_k: int = 5,
    penalty: float = DEFAULT_PENALTY,
    initial_plans=(),
    progress: bool | None = None,
    slice_seconds: float = 0.5,
) -> SearchResult:
    """Metropolis–Hastings search for the cheapest plan (see the module docstring).

    Args:
        problem: the problem, or a :class:`Simulator` of it (its penalty is used).
        seconds: wall-clock budget (s).
        max_steps: proposals per chain. At least one of ``seconds`` and ``max_steps`` is needed;
            with both, the search stops at whichever comes first.
        patience: stop as converged once the best plan has not improved over this many
            proposals per chain, nor over as many as it took to find it; ``None``: never.
        num_chains: chains, each on its own thread (default: ``min(4, os.cpu_count())``).
        seed: seed of the chains' random streams.
        temperature: of the acceptance rule, on relative cost differences (0: only improvements).
        local_prob: probability that a proposal is a local move rather than a random jump.
        pair_prob: probability that a proposal changes a second MFC as well.
        top_k: distinct plans to keep.
        penalty: cost multiplier of plans that do not fit memory.
        initial_plans: extra start plans (e.g. baselines); chain ``c`` starts from
            ``([greedy] + initial_plans)[c % n]``, and every one of them competes for the result.
        progress: show a progress bar with the best cost so far; ``None``: when stderr is a terminal (a
            log file gets no carriage returns).
        slice_seconds: how often the progress bar is updated.
    """
    if seconds is None and max_steps is None:
        raise ValueError("give seconds and/or max_steps to bound the search")
    if any(v is not None and v <= 0 for v in (seconds, max_steps, patience)):
        raise ValueError(f"seconds={seconds}, max_steps={max_steps} and patience={patience} must be positive")
    for name, value in (("local_prob", local_prob), ("pair_prob", pair_prob)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}={value} must be in [0, 1]")
    sim = problem if isinstance(problem, Simulator) else Simulator(problem, penalty)
    num_chains = num_chains or min(4, os.cpu_count() or 1)
    starts = [greedy_choice(sim.problem)] + [list(sim.compiled.check_choice(p)) for p in initial_plans]
    ext = load_extension()
    native = ext.Search(sim.native, starts, num_chains, seed, temperature, local_prob, pair_prob, top_k)
    t0 = time.perf_counter()
    stop, best_step = "single plan", 0
    if any(len(opts) > 1 for opts in sim.problem.options):  # else every plan is the start plan
        stop, best_step = _drive(native, seconds, max_steps, patience, slice_seconds, progress)
    seconds_taken = time.perf_counter() - t0
    return _result(sim, native.top(), native.steps, native.accepted, seconds_taken, "mcmc", stop, best_step)


def _drive(
    native,
    seconds: float | None,
    max_steps: int | None,
    patience: int | None,
    slice_seconds: float,
    progress: bool | None,
) -> tuple[str, int]:
    """Run the chains in slices until the budget is spent or the search converged, updating a
    progress bar between slices; returns why it stopped and the proposals per chain made when
    the best plan was last improved on."""
    t0 = time.perf_counter()
    # Step-bounded slices (chunks do not change the result) where a step rule may stop the search.
    bounded = max_steps is not None or patience is not None
    chunk = max(1000, (max_steps or 0) // 20, (patience or 0) // 10)
    total = seconds if seconds is not None else max_steps
    best, best_step = native.top()[0][0], 0
    disable = None if progress is None else not progress  # tqdm: None hides the bar when stderr is no terminal
    with tqdm(total=total, disable=disable, desc="plan search", leave=False) as bar:
        while True:
            steps = native.min_steps
            left_s = None if seconds is None else seconds - (time.perf_counter() - t0)
            if max_steps is not None and steps >= max_steps:
                return "max_steps", best_step
            if patience is not None and steps - best_step >= max(patience, best_step):
                return "converged", best_step
            if left_s is not None and left_s <= 0:
                return "budget", best_step
            until = min(max_steps or steps + chunk, steps + chunk) if bounded else 0
            native.run(until, 0.0 if left_s is None else min(slice_seconds, left_s))
            cost = native.top()[0][0]
            if cost < best:
                best, best_step = cost, native.min_steps
            bar.n = min(seconds, round(time.perf_counter() - t0, 1)) if seconds is not None else native.min_steps
            bar.set_postfix_str(f"best {best:.4g} s/iter", refresh=True)


def exhaustive_search(
    problem: PlanProblem | Simulator, *, max_plans: int = 2_000_000, top_k: int = 5, penalty: float = DEFAULT_PENALTY
) -> SearchResult:
    """Evaluate every plan (for small problems, tests and checking the MCMC search).

    Raises:
        ValueError: when the problem has more than ``max_plans`` plans.
    """
    sim = problem if isinstance(problem, Simulator) else Simulator(problem, penalty)
    count = num_plans(sim.problem)
    if count > max_plans:
        raise ValueError(f"{count} plans exceed max_plans={max_plans}; use search() instead")
    t0 = time.perf_counter()
    top, n = load_extension().exhaustive(sim.native, max_plans, top_k)
    return _result(sim, top, n, 0, time.perf_counter() - t0, "exhaustive", "enumerated", 0)


def _result(
    sim: Simulator, top, steps: int, accepted: int, seconds: float, method: str, stop: str, best_step: int
) -> SearchResult:
    ranked = tuple(RankedPlan(float(c), tuple(int(x) for x in np.asarray(p))) for c, p in top)
    filled = 0
    if method == "mcmc":
        choice, cost = fill_idle_devices(sim, ranked[0].choice)
        if cost < ranked[0].cost:
            filled = len(_used_devices(sim.problem, choice)) - len(_used_devices(sim.problem, ranked[0].choice))
            ranked = (RankedPlan(cost, choice), *ranked)
    best = ranked[0]
    return SearchResult(
        choice=best.choice,
        cost=best.cost,
        result=sim.evaluate(best.choice),
        top=ranked,
        steps=int(steps),
        accepted=int(accepted),
        seconds=seconds,
        method=method,
        stop=stop,
        best_step=best_step,
        filled_devices=filled,
    )


def _used_devices(problem: PlanProblem, choice) -> set[int]:
    return {d for i, j in enumerate(choice) for d in problem.options[i][j].mesh.device_ids}


def fill_idle_devices(sim: Simulator, choice) -> tuple[tuple[int, ...], float]:
    """The plan with its idle devices put to work wherever that is faster: while some devices run
    no call, move the one call whose move to a larger mesh — containing its own and reaching an
    idle device — lowers the cost most (first such option on ties); stop when no move helps.

    A time-budgeted search of a large problem (16 hosts: thousands of options per call) may end
    on a plan that leaves a host idle only because it did not run long enough to move a call
    there; this deterministic pass (a few hundred evaluations per round) takes that step.

    Returns:
        The plan and its cost.
    """
    problem = sim.problem
    choice, cost = tuple(int(c) for c in choice), sim.cost(choice)
    while True:
        idle = set(range(problem.num_devices)) - _used_devices(problem, choice)
        if not idle:
            return choice, cost
        best = None
        for i, j_now in enumerate(choice):
            now = problem.options[i][j_now].mesh
            lo, hi = now.first_device, now.first_device + now.size
            for j, o in enumerate(problem.options[i]):
                first, last = o.mesh.first_device, o.mesh.first_device + o.mesh.size
                if first <= lo and hi <= last and idle.intersection(range(first, last)):
                    trial = choice[:i] + (j,) + choice[i + 1 :]
                    c = sim.cost(trial)
                    if c < cost and (best is None or c < best[1]):
                        best = (trial, c)
        if best is None:
            return choice, cost
        choice, cost = best
