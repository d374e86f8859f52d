"""Baseline plans: the meshes and strategies each rule picks, and infeasibility reported, not patched."""

from __future__ import annotations

import pytest
from plan_cases import PPO_MFCS, ppo_problem

from rlflow.planner.baselines import (
    baseline_plans,
    colocated_plan,
    heuristic_plan,
    manual_plan,
    parse_mesh,
    parse_strategy,
    split_plan,
)
from rlflow.planner.mesh import DeviceMesh
from rlflow.planner.search import search
from rlflow.planner.simulate import Simulator
from rlflow.strategy import ParallelStrategy

WHOLE_2x8 = DeviceMesh(2, 8, devices_per_node=8)


def _placements(problem, plan):
    return {
        problem.mfc_names[i]: (problem.options[i][j].mesh, problem.options[i][j].strategy)
        for i, j in enumerate(plan.choice)
    }


def test_heuristic_puts_every_mfc_on_the_cluster_with_tp_in_host_and_pp_across_hosts():
    problem = ppo_problem(num_nodes=2)
    plan = heuristic_plan(problem)
    assert plan.feasible and plan.result.iteration_time_s > 0
    assert set(_placements(problem, plan).values()) == {(WHOLE_2x8, ParallelStrategy(dp=1, tp=8, pp=2))}
    assert not any(n.kind == "realloc" for n in plan.result.nodes)  # one layout per model: nothing to move


def test_heuristic_falls_back_to_the_largest_tp_the_mfc_has():
    problem = ppo_problem(num_nodes=2, keep=lambda mfc, mesh, s: not (mfc == "ref_inf" and s.tp == 8))
    placements = _placements(problem, heuristic_plan(problem))
    assert placements["ref_inf"] == (WHOLE_2x8, ParallelStrategy(dp=2, tp=4, pp=2))
    assert placements["actor_gen"] == (WHOLE_2x8, ParallelStrategy(dp=1, tp=8, pp=2))


def test_heuristic_without_a_pipelined_option_is_infeasible_not_changed():
    problem = ppo_problem(num_nodes=2, keep=lambda mfc, mesh, s: not (mfc == "actor_gen" and s.pp > 1))
    plan = heuristic_plan(problem)
    assert plan.choice is None and not plan.feasible and "actor_gen" in plan.reason and "pp=2" in plan.reason


def test_colocated_uses_fsdp_everywhere_and_tp_only_where_memory_needs_it():
    problem = ppo_problem(num_nodes=2)
    plan = colocated_plan(problem)
    assert set(_placements(problem, plan).values()) == {(WHOLE_2x8, ParallelStrategy(dp=16))}
    # Generation: 14 GB of weights + 20/16 GB of activations do not fit 15 GB at tp=1, tp=2 does;
    # inference (14 + 4/16 GB) fits at tp=1; training shards weights and state over dp.
    tight = ppo_problem(num_nodes=2, memory_gb=15.0)
    placements = _placements(tight, colocated_plan(tight))
    assert placements["actor_gen"] == (WHOLE_2x8, ParallelStrategy(dp=8, tp=2))
    assert placements["critic_inf"] == placements["actor_train"] == (WHOLE_2x8, ParallelStrategy(dp=16))
    # Training never falls back to tp: without its dp-only option the baseline is infeasible.
    no_fsdp = ppo_problem(num_nodes=2, keep=lambda mfc, mesh, s: not (mfc == "critic_train" and s.dp == 16))
    plan = colocated_plan(no_fsdp)
    assert plan.choice is None and "critic_train" in plan.reason


def test_split_gives_each_model_and_the_generation_its_own_block():
    problem = ppo_problem(num_nodes=2)
    plan = split_plan(problem, generate_mfcs=["actor_gen"])
    assert plan.result is not None, plan.reason
    placements = _placements(problem, plan)
    blocks = {
        "gen": placements["actor_gen"][0],
        "actor": placements["actor_train"][0],
        "critic": placements["critic_train"][0],
        "ref": placements["ref_inf"][0],
        "reward": placements["reward_inf"][0],
    }
    assert placements["critic_inf"][0] == blocks["critic"]  # a model's calls share its block
    meshes = list(blocks.values())
    assert all(not a.overlaps(b) for k, a in enumerate(meshes) for b in meshes[k + 1 :])
    assert sum(m.size for m in meshes) <= 16
    assert blocks["gen"].size >= blocks["ref"].size  # more work, more devices
    for name in ("actor_train", "critic_train"):
        assert placements[name][1] == ParallelStrategy(dp=placements[name][0].size)
    with pytest.raises(ValueError, match="not MFCs of the problem"):
        split_plan(problem, generate_mfcs=["rollout"])


def test_split_needs_a_device_per_block():
    problem = ppo_problem(num_nodes=1, dpn=4)  # 4 devices, 5 blocks
    plan = split_plan(problem, generate_mfcs=["actor_gen"])
    assert plan.choice is None and "5 device blocks" in plan.reason


def test_manual_plan_from_a_config_and_its_errors():
    problem = ppo_problem(num_nodes=1)
    config = {name: {"mesh": "0-7", "strategy": "dp=8,tp=1,pp=1"} for name in PPO_MFCS}
    config["actor_gen"] = {"mesh": {"num_nodes": 1, "num_devices": 4, "device_start": 4}, "strategy": (2, 2, 1)}
    plan = manual_plan(problem, config, name="mine")
    assert plan.name == "mine" and plan.feasible
    gen = problem.options[0][plan.choice[0]]
    assert gen.mesh.device_ids == (4, 5, 6, 7) and gen.strategy == ParallelStrategy(dp=2, tp=2, pp=1)
    # A placement that is not an option is reported, never moved to a neighbouring one.
    absent = ppo_problem(num_nodes=1, keep=lambda mfc, mesh, s: not (mfc == "ref_inf" and s.tp == 1 and mesh.size == 8))
    missing = manual_plan(absent, config)
    assert missing.choice is None and "ref_inf" in missing.reason
    with pytest.raises(ValueError, match=r"unknown MFCs \['rollout'\].*missing MFCs \['actor_gen'\]"):
        manual_plan(problem, {**{k: v for k, v in config.items() if k != "actor_gen"}, "rollout": config["ref_inf"]})
    with pytest.raises(ValueError, match="device range"):
        parse_mesh("zero to three", 8)
    with pytest.raises(ValueError, match="num_devices=3 does not divide"):
        parse_mesh("0-2", 8)
    with pytest.raises(ValueError, match="dp=2,tp=4,pp=1"):
        parse_strategy("data=2")


def test_search_seeded_with_baselines_is_never_slower_than_a_feasible_one():
    problem = ppo_problem(num_nodes=2)
    sim = Simulator(problem)
    baselines = baseline_plans(problem, generate_mfcs=["actor_gen"], sim=sim)
    assert [b.name for b in baselines] == ["heuristic", "colocated", "split"]
    seeds = [b.choice for b in baselines if b.choice is not None]
    found = search(sim, max_steps=1, num_chains=1, initial_plans=seeds, progress=False)
    assert all(found.cost <= b.result.cost for b in baselines if b.feasible)
