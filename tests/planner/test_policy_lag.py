"""Bounded staleness (``algorithm.policy_lag``): version edges into generations span 1 + lag
iterations, so a rollout on its own devices is priced as overlapping the training before it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from plan_cases import actor_problem, opt, random_choice, random_problem
from test_simulate import _assert_same

from rlflow.dataflow.algorithms import algorithm_graph
from rlflow.dataflow.graph import unroll_graph, version_edges, version_spans
from rlflow.planner.build import build_problem
from rlflow.planner.cluster import cluster_preset
from rlflow.planner.compiled import compile_problem
from rlflow.planner.cost import Workload
from rlflow.planner.model_spec import ModelSpec
from rlflow.planner.profile import HardwareProfile
from rlflow.planner.search import plan_search
from rlflow.planner.simulate import Simulator, simulate, simulate_py

BACKENDS = ["python", "cpp"]


def test_lagged_version_edges_reach_back_one_plus_lag_iterations_into_generations_only():
    g = algorithm_graph("ppo")
    spans = dict(zip(version_edges(g), version_spans(g, policy_lag=2)))
    assert spans[("actor_train", "actor_gen")] == 3
    assert spans[("critic_train", "critic_inf")] == 1  # other models read the newest weights
    u = unroll_graph(g, 5, policy_lag=2)
    into_gen = sorted(a for a, b, kind in u.edges(data="kind") if kind == "version" and b[1] == "actor_gen")
    assert into_gen == [(0, "actor_train"), (1, "actor_train")]  # into iterations 3 and 4
    assert u.has_edge((3, "critic_train"), (4, "critic_inf"))
    # The rollouts of iterations 0..2 sample the initial weights; each follows the one before.
    assert {(a, kind) for a, _, kind in u.in_edges((2, "actor_gen"), data="kind")} == {((1, "actor_gen"), "order")}
    unlagged = unroll_graph(g, 5)
    assert unlagged.has_edge((3, "actor_train"), (4, "actor_gen"))
    with pytest.raises(ValueError, match="policy_lag=-1"):
        version_spans(g, policy_lag=-1)


def _two_devices(**kw):
    """An actor on a 2-device host: generation and training each alone on a device (1 s each), or
    both over the two devices (0.6 s each); a 0.05 s reallocation and a 0.02 s transfer."""
    gen = [opt(0, 1, 1.0, dpn=2), opt(0, 2, 0.6, dpn=2)]
    train = [opt(1, 1, 1.0, dpn=2), opt(0, 2, 0.6, dpn=2)]
    problem = actor_problem(gen, train, realloc=np.full((2, 2), 0.05), data=np.full((2, 2), 0.02), **kw)
    return dataclasses.replace(problem, devices_per_node=2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_with_lag_one_disjoint_generation_overlaps_training_and_is_chosen(backend):
    disjoint, colocated = [0, 0], [1, 1]
    fresh = _two_devices(num_iterations=6)
    assert simulate(fresh, disjoint, backend=backend).iteration_time_s == pytest.approx(0.05 + 1 + 0.02 + 1)
    # (One layout: no reallocation.)
    assert simulate(fresh, colocated, backend=backend).iteration_time_s == pytest.approx(0.6 + 0.02 + 0.6)
    assert plan_search(fresh, max_seconds=1).choice == tuple(colocated)
    lagged = dataclasses.replace(fresh, version_spans=[2])
    # The rollout of t runs on device 0 while device 1 trains on t-1: the period is the slower
    # call plus what occupies both devices (the reallocation).
    assert simulate(lagged, disjoint, backend=backend).iteration_time_s == pytest.approx(1.0 + 0.05 + 0.02, abs=0.03)
    assert simulate(lagged, colocated, backend=backend).iteration_time_s == pytest.approx(1.22)  # no overlap to win
    assert plan_search(lagged, max_seconds=1).choice == tuple(disjoint)


def test_bad_spans_are_rejected_naming_the_field():
    with pytest.raises(ValueError, match="version_spans"):
        _two_devices(version_spans=[2, 1])
    with pytest.raises(ValueError, match="version_spans"):
        _two_devices(version_spans=[0])


def test_build_problem_threads_the_lag_and_unrolls_enough_iterations():
    spec = ModelSpec(num_layers=2, hidden_size=64, intermediate_size=256, num_heads=4, num_kv_heads=4, vocab_size=100)
    cluster = cluster_preset("cpu", 1, 2, profile=HardwareProfile(1.0e11, 5e9, 1e9, 1e-5, 8e9))
    args = (
        algorithm_graph("grpo", use_ref=False),
        {"actor": spec},
        cluster,
        Workload(4, 8, 16, n_samples_per_prompt=4),
    )
    fresh, lagged = build_problem(*args), build_problem(*args, policy_lag=1)
    gen = fresh.mfc_names.index("actor_gen")
    assert dict(zip(lagged.version_edges, lagged.spans))[(fresh.mfc_names.index("actor_train"), gen)] == 2
    assert fresh.spans == [1] * len(fresh.version_edges)
    assert lagged.num_iterations == fresh.num_iterations + 2
    # Lag never makes a plan slower: it only removes waits.
    rng = np.random.default_rng(0)
    for _ in range(10):
        plan = random_choice(rng, fresh)
        assert simulate(lagged, plan).iteration_time_s <= simulate(fresh, plan).iteration_time_s * (1 + 1e-9)


def test_cpp_matches_python_with_lagged_edges():
    rng = np.random.default_rng(3)
    for _ in range(30):
        problem = random_problem(rng)
        spans = [int(s) for s in rng.integers(1, 4, size=len(problem.version_edges))]
        problem = dataclasses.replace(problem, version_spans=spans, num_iterations=5)
        cp = compile_problem(problem)
        sim = Simulator(cp)
        for _ in range(4):
            plan = random_choice(rng, problem)
            _assert_same(sim.evaluate(plan), simulate_py(cp, plan))
