"""ExecutionPlan: what it says about a plan, its JSON round trip and its table."""

from __future__ import annotations

import json

import numpy as np
import pytest
from plan_cases import GB, actor_problem, opt, ppo_problem

from rlflow.planner.baselines import manual_plan
from rlflow.planner.plan import ExecutionPlan
from rlflow.planner.search import search
from rlflow.strategy import ParallelStrategy


def _actor_plan() -> tuple:
    tp4 = ParallelStrategy(dp=1, tp=4)
    gen = [
        opt(0, 4, 1.0, tp4, act=2 * GB, weight=4 * GB),
        opt(0, 8, 0.5, ParallelStrategy(dp=2, tp=4), act=3 * GB, weight=4 * GB),
    ]
    train = [opt(0, 4, 2.0, tp4, act=5 * GB, weight=4 * GB, state=16 * GB)]
    problem = actor_problem(gen, train, realloc=[[0.0, 0.25]], data=[[0.0], [0.1]])
    return problem, ExecutionPlan.from_choice(problem, [1, 0], name="hand")


def test_plan_records_placements_estimates_and_transfers():
    problem, plan = _actor_plan()
    gen, train = plan.call("actor_gen"), plan.call("actor_train")
    assert (gen.mesh.size, gen.strategy, gen.time_s) == (8, ParallelStrategy(dp=2, tp=4), 0.5)
    # gen on devices 0-3 holds the actor's home (4 + 16 GB) plus its activations and reallocated copy.
    assert gen.memory_bytes == pytest.approx((20 + 3 + 4) * GB) and train.memory_bytes == pytest.approx(25 * GB)
    assert plan.iteration_time_s == pytest.approx(0.25 + 0.5 + 0.1 + 2.0)
    assert plan.max_memory_bytes == pytest.approx(27 * GB) and plan.fits and plan.choice == (1, 0)
    assert [(t.kind, t.source, t.target, t.time_s, t.devices) for t in plan.transfers] == [
        ("data", "actor_gen", "actor_train", 0.1, ((0, 7), (0, 3))),
        ("realloc", "actor_train", "actor_gen", 0.25, ((0, 3), (0, 7))),
    ]
    assert plan.placements() == {"actor_gen": (gen.mesh, gen.strategy), "actor_train": (train.mesh, train.strategy)}
    with pytest.raises(KeyError, match="actor_gen"):
        plan.call("critic_train")


def test_json_round_trip_through_a_file(tmp_path):
    _, plan = _actor_plan()
    assert ExecutionPlan.from_json(plan.to_json()) == plan
    path = tmp_path / "plan.json"
    plan.save(path)
    assert ExecutionPlan.load(path) == plan
    data = json.loads(path.read_text())
    assert data["calls"][0]["mesh"]["num_devices"] == 8 and data["calls"][0]["strategy"] == {"dp": 2, "tp": 4, "pp": 1}
    with pytest.raises(ValueError, match="format_version"):
        ExecutionPlan.from_dict({**data, "format_version": 99})


def test_table_lists_every_mfc_with_its_estimates():
    _, plan = _actor_plan()
    table = str(plan)
    lines = table.splitlines()
    assert lines[0].split() == ["MFC", "model", "mesh", "devices", "strategy", "est.", "time", "est.", "memory"]
    assert lines[2].split()[:5] == ["actor_gen", "actor", "(1,8)", "0..7", "(dp=2,tp=4,pp=1)"]
    assert "500.0 ms" in lines[2] and "25.1 GiB" in lines[2]
    assert "realloc from actor_train -> actor_gen: 250.0 ms" in table
    assert "estimated time per iteration: 2.85 s" in table and "(fits)" in table


def test_searched_plan_round_trips_into_a_manual_plan():
    problem = ppo_problem(num_nodes=1)
    found = search(problem, max_steps=500, num_chains=1, progress=False)
    plan = ExecutionPlan.from_choice(problem, found.choice, found.result, name="search")
    again = manual_plan(problem, plan.to_config())
    assert again.choice == found.choice
    assert again.result.iteration_time_s == pytest.approx(plan.iteration_time_s)
    assert np.isclose(plan.max_memory_bytes, found.result.max_bytes)
