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
    """

    choice: tuple[int, ...]
    cost: float
    result: SimResult
    top: tuple[RankedPlan, ...]
    steps: int
    accepted: int
    seconds: float
    method: str


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


def num_plans(problem: PlanProblem) -> int:
    """Number of distinct plans: the product of the MFCs' option counts."""
    return math.prod(len(o) for o in problem.options)


def search(
    problem: PlanProblem | Simulator,
    *,
    seconds: float | None = None,
    max_steps: int | None = None,
    num_chains: int | None = None,
    seed: int = 0,
    temperature: float = DEFAULT_TEMPERATURE,
    local_prob: float = DEFAULT_LOCAL_PROB,
    pair_prob: float = DEFAULT_PAIR_PROB,
    top_k: int = 5,
    penalty: float = DEFAULT_PENALTY,
    initial_plans=(),
    progress: bool = True,
    slice_seconds: float = 0.5,
) -> SearchResult:
    """Metropolis–Hastings search for the cheapest plan (see the module docstring).

    Args:
        problem: the problem, or a :class:`Simulator` of it (its penalty is used).
        seconds: wall-clock budget (s).
        max_steps: proposals per chain. At least one of ``seconds`` and ``max_steps`` is needed;
            with both, the search stops at whichever comes first.
        num_chains: chains, each on its own thread (default: ``min(4, os.cpu_count())``).
        seed: seed of the chains' random streams.
        temperature: of the acceptance rule, on relative cost differences (0: only improvements).
        local_prob: probability that a proposal is a local move rather than a random jump.
        pair_prob: probability that a proposal changes a second MFC as well.
        top_k: distinct plans to keep.
        penalty: cost multiplier of plans that do not fit memory.
        initial_plans: extra start plans (e.g. baselines); chain ``c`` starts from
            ``([greedy] + initial_plans)[c % n]``, and every one of them competes for the result.
        progress: show a progress bar with the best cost so far.
        slice_seconds: how often the progress bar is updated.
    """
    if seconds is None and max_steps is None:
        raise ValueError("give seconds and/or max_steps to bound the search")
    if (seconds is not None and seconds <= 0) or (max_steps is not None and max_steps <= 0):
        raise ValueError(f"seconds={seconds} and max_steps={max_steps} must be positive")
    for name, value in (("local_prob", local_prob), ("pair_prob", pair_prob)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}={value} must be in [0, 1]")
    sim = problem if isinstance(problem, Simulator) else Simulator(problem, penalty)
    num_chains = num_chains or min(4, os.cpu_count() or 1)
    starts = [greedy_choice(sim.problem)] + [list(sim.compiled.check_choice(p)) for p in initial_plans]
    ext = load_extension()
    native = ext.Search(sim.native, starts, num_chains, seed, temperature, local_prob, pair_prob, top_k)
    t0 = time.perf_counter()
    if any(len(opts) > 1 for opts in sim.problem.options):  # else every plan is the start plan
        _drive(native, seconds, max_steps, slice_seconds, progress)
    return _result(sim, native.top(), native.steps, native.accepted, time.perf_counter() - t0, "mcmc")


def _drive(native, seconds: float | None, max_steps: int | None, slice_seconds: float, progress: bool) -> None:
    """Run the chains in slices until the budget is spent, updating a progress bar between slices."""
    t0 = time.perf_counter()
    chunk = max(1000, (max_steps or 0) // 20)
    total = seconds if seconds is not None else max_steps
    with tqdm(total=total, disable=not progress, desc="plan search", leave=False) as bar:
        while True:
            left_s = None if seconds is None else seconds - (time.perf_counter() - t0)
            if (left_s is not None and left_s <= 0) or (max_steps is not None and native.min_steps >= max_steps):
                return
            if max_steps is None:
                until = 0  # no step limit
            elif seconds is None:
                until = min(max_steps, native.min_steps + chunk)  # chunks do not change the result
            else:
                until = max_steps
            native.run(until, 0.0 if left_s is None else min(slice_seconds, left_s))
            bar.n = min(seconds, round(time.perf_counter() - t0, 1)) if seconds is not None else native.min_steps
            bar.set_postfix_str(f"best {native.top()[0][0]:.4g} s/iter", refresh=True)


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
    return _result(sim, top, n, 0, time.perf_counter() - t0, "exhaustive")


def _result(sim: Simulator, top, steps: int, accepted: int, seconds: float, method: str) -> SearchResult:
    ranked = tuple(RankedPlan(float(c), tuple(int(x) for x in np.asarray(p))) for c, p in top)
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
    )
