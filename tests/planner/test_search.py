"""MCMC search: acceptance rule, reproducibility, optimality on problems small enough to enumerate."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from plan_cases import GB, frozen_problem, opt, ppo_problem, random_problem

from rlflow.planner.compiled import compile_problem
from rlflow.planner.search import (
    acceptance_probability,
    exhaustive_search,
    greedy_choice,
    num_plans,
    plan_search,
    search,
)
from rlflow.planner.simulate import Simulator, load_extension, simulate_py


@pytest.mark.parametrize("accept", [acceptance_probability, load_extension().acceptance_probability])
def test_acceptance_uses_the_relative_cost_difference(accept):
    # 5% worse at T=0.05 -> 1/e, whatever the scale of the costs (an integer division of the
    # absolute difference, as in public ReaLHF, would give 1 for any increase under its divisor).
    assert accept(10.0, 10.5, 0.05) == pytest.approx(math.exp(-1))
    assert accept(1000.0, 1050.0, 0.05) == pytest.approx(math.exp(-1))
    assert accept(10.0, 20.0, 0.05) == pytest.approx(math.exp(-20))
    assert accept(10.0, 9.0, 0.05) == 1.0 and accept(10.0, 10.0, 0.0) == 1.0
    assert accept(10.0, 10.001, 0.0) == 0.0  # temperature 0: only improvements


def test_greedy_takes_the_fastest_option_that_fits_alone():
    problem = frozen_problem(
        [[opt(0, 8, 1.0, act=90 * GB), opt(0, 4, 2.0, act=10 * GB), opt(4, 4, 3.0)]], device_memory_bytes=80 * GB
    )
    assert greedy_choice(problem) == [1]


def _split_beats_greedy():
    # Each call is fastest on all 8 devices, but two calls on disjoint halves overlap: 1.6 < 1 + 1.
    return frozen_problem([[opt(0, 8, 1.0), opt(0, 4, 1.6), opt(4, 4, 1.6)]] * 2)


def test_search_finds_the_exhaustive_optimum():
    problem = _split_beats_greedy()
    best = exhaustive_search(problem)
    assert best.cost == pytest.approx(1.6) and best.steps == num_plans(problem) == 9
    assert Simulator(problem).cost(greedy_choice(problem)) == pytest.approx(2.0)
    found = search(problem, max_steps=200, num_chains=2, seed=0, progress=False)
    assert found.cost == pytest.approx(1.6) and found.result.iteration_time_s == pytest.approx(1.6)
    assert {found.choice, found.top[1].choice} == {(1, 2), (2, 1)}  # the two mirror-image optima


def test_exhaustive_search_agrees_with_the_python_twin():
    problem = random_problem(np.random.default_rng(7))
    cp = compile_problem(problem)
    costs = {
        c: simulate_py(cp, c, detailed=False).cost for c in itertools.product(*(range(len(o)) for o in problem.options))
    }
    result = exhaustive_search(problem, top_k=3)
    assert result.cost == pytest.approx(min(costs.values()), rel=1e-9)
    assert [r.cost for r in result.top] == pytest.approx(sorted(costs.values())[:3], rel=1e-9)
    with pytest.raises(ValueError, match="exceed max_plans"):
        exhaustive_search(problem, max_plans=1)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_search_matches_exhaustive_on_random_problems(seed):
    rng = np.random.default_rng(seed)
    problem = random_problem(rng)
    while num_plans(problem) > 50_000 or num_plans(problem) < 50:
        problem = random_problem(rng)
    exact = exhaustive_search(problem)
    found = search(problem, max_steps=4000, num_chains=2, seed=seed, progress=False)
    assert found.cost == pytest.approx(exact.cost, rel=1e-9)


def test_fixed_seed_and_step_count_reproduce_the_result():
    problem = ppo_problem(num_nodes=2)
    runs = [search(problem, max_steps=3000, num_chains=3, seed=11, progress=False) for _ in range(2)]
    assert runs[0].top == runs[1].top and runs[0].steps == runs[1].steps == 9000
    assert runs[0].accepted == runs[1].accepted
    # The search improves on where it starts, and never returns a worse plan than a start plan.
    sim = Simulator(problem)
    assert runs[0].cost < sim.cost(greedy_choice(problem))
    seeded = search(problem, max_steps=1, num_chains=1, seed=0, initial_plans=[runs[0].choice], progress=False)
    assert seeded.cost <= runs[0].cost


def test_search_acceptance_rate_follows_the_temperature():
    problem = ppo_problem(num_nodes=1)
    cold = search(problem, max_steps=2000, num_chains=1, seed=0, temperature=0.0, progress=False)
    hot = search(problem, max_steps=2000, num_chains=1, seed=0, temperature=10.0, progress=False)
    assert cold.accepted < hot.accepted


def test_time_budget_and_argument_errors():
    problem = ppo_problem(num_nodes=1)
    timed = search(problem, seconds=0.3, num_chains=2, seed=0, progress=False)
    assert timed.steps > 0 and timed.seconds < 5.0 and timed.result.fits
    with pytest.raises(ValueError, match="seconds and/or max_steps"):
        search(problem)
    with pytest.raises(ValueError, match="outside"):
        search(problem, max_steps=10, initial_plans=[[999] * 6], progress=False)


def test_a_search_stops_once_it_converges_and_reproduces_its_result():
    problem = ppo_problem(num_nodes=1)
    runs = [search(problem, seconds=60.0, patience=2000, num_chains=2, seed=3, progress=False) for _ in range(2)]
    found = runs[0]
    per_chain = found.steps // 2
    assert found.stop == "converged" and per_chain - found.best_step >= max(2000, found.best_step)
    assert per_chain < found.best_step + max(2000, found.best_step) + 1000  # within one slice of the rule
    assert runs[1].top == found.top and runs[1].steps == found.steps  # step rules only: reproducible
    assert "converged" in found.summary() and f"best at proposal {found.best_step}" in found.summary()
    capped = search(problem, max_steps=500, patience=2000, num_chains=2, seed=3, progress=False)
    assert capped.stop == "max_steps" and capped.steps == 1000
    with pytest.raises(ValueError, match="patience=0 must be positive"):
        search(problem, max_steps=10, patience=0)


def test_plan_search_enumerates_small_problems_and_samples_large_ones():
    small = _split_beats_greedy()
    enumerated = plan_search(small, max_seconds=10.0, progress=False)
    assert enumerated.method == "exhaustive" and enumerated.stop == "enumerated"
    assert enumerated.steps == num_plans(small) == 9 and enumerated.cost == pytest.approx(1.6)
    assert "every one of 9 plans" in enumerated.summary()
    sampled = plan_search(small, max_seconds=10.0, exhaustive_max_plans=8, patience=1000, progress=False)
    assert sampled.method == "mcmc" and sampled.stop == "converged" and sampled.cost == pytest.approx(1.6)
    one = frozen_problem([[opt(0, 8, 1.0)]])
    assert search(one, max_steps=10, progress=False).stop == "single plan"
