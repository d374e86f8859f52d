"""The planner chooses how many of a host's workers a plan uses, and its shape, by cost: a plan may
leave devices idle, and the trainer need start only the ones it uses (``Placement.used_ranks``)."""

from __future__ import annotations

import pytest

from rlflow.dataflow.algorithms import algorithm_graph
from rlflow.planner.build import build_problem
from rlflow.planner.cluster import cluster_preset, local_devices_per_node
from rlflow.planner.cost import Workload
from rlflow.planner.model_spec import ModelSpec
from rlflow.planner.plan import ExecutionPlan
from rlflow.planner.profile import HardwareProfile
from rlflow.planner.search import plan_search
from rlflow.planner.simulate import simulate
from rlflow.trainer.placement import _used_ranks

# A CPU host of 2 single-threaded workers: 20 GFLOP/s each, gloo collectives of 2 ms.
HOST = HardwareProfile(2e10, 1e10, 1e9, 2e-5, 16e9, collective_latency_s=2e-3)
TINY = ModelSpec(num_layers=2, hidden_size=64, intermediate_size=256, num_heads=4, num_kv_heads=4, vocab_size=100)
WIDE = ModelSpec(num_layers=8, hidden_size=512, intermediate_size=2048, num_heads=8, num_kv_heads=8, vocab_size=1000)


def _plan(model: ModelSpec, workload: Workload, policy_lag: int = 0) -> tuple[ExecutionPlan, object]:
    graph = algorithm_graph("grpo", use_ref=False)
    problem = build_problem(graph, {"actor": model}, cluster_preset("cpu", 1, 2, profile=HOST), workload,
                            policy_lag=policy_lag)  # fmt: skip
    result = plan_search(problem, max_seconds=2, progress=False)
    return ExecutionPlan.from_choice(problem, result.choice, result.result, name="search"), problem


def _costs(problem) -> dict[str, float]:
    """Time per iteration of the three shapes on a 2-worker host."""
    shapes = {"one worker": ((1, 0), (1, 0)), "dp=2": ((2, 0), (2, 0)), "disjoint": ((1, 0), (1, 1))}
    out = {}
    for name, ((gen_size, gen_at), (train_size, train_at)) in shapes.items():
        choice = []
        for i, (size, at) in enumerate(((gen_size, gen_at), (train_size, train_at))):
            match = [j for j, o in enumerate(problem.options[i])
                     if o.mesh.size == size and o.mesh.first_device == at and o.strategy.tp == 1 and o.strategy.pp == 1]  # fmt: skip
            choice.append(match[0])
        out[name] = simulate(problem, choice).iteration_time_s
    return out


def test_a_tiny_model_trains_on_one_worker():
    # 16 rows of 24 tokens through 2 small layers: the gloo collectives of FSDP over two workers
    # cost more than the halved compute saves, so training stays on one worker (the rollout may
    # still split its rows: replicated copies need no collective per step).
    plan, problem = _plan(TINY, Workload(2, 8, 16, n_samples_per_prompt=8))
    costs = _costs(problem)
    assert costs["one worker"] < costs["dp=2"]
    assert plan.iteration_time_s <= min(costs.values()) * (1 + 1e-9)
    train = next(c for c in plan.calls if c.name == "actor_train")
    assert train.mesh.size == 1
    assert _used_ranks(plan, 2) == tuple(sorted({d for c in plan.calls for d in c.mesh.device_ids}))


def test_a_wider_model_splits_its_rows_over_both_workers():
    plan, problem = _plan(WIDE, Workload(16, 32, 32, n_samples_per_prompt=8))
    costs = _costs(problem)
    assert costs["dp=2"] < costs["one worker"]
    assert plan.iteration_time_s == pytest.approx(min(costs.values()))
    assert _used_ranks(plan, 2) == (0, 1)


def test_with_lag_the_planner_weighs_overlap_against_data_parallelism():
    # The chosen plan is never priced above any of the three shapes, with or without lag, and lag
    # never prices a shape slower.
    for model, workload in ((TINY, Workload(2, 8, 16, n_samples_per_prompt=8)), (WIDE, Workload(16, 32, 32, 8))):
        fresh, lagged = _costs(_plan(model, workload)[1]), _costs(_plan(model, workload, policy_lag=1)[1])
        for name in fresh:
            assert lagged[name] <= fresh[name] * (1 + 1e-9)
        plan, _ = _plan(model, workload, policy_lag=1)
        assert plan.iteration_time_s <= min(lagged.values()) * (1 + 1e-9)


def test_auto_devices_are_the_cores_this_process_may_use(monkeypatch):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5})
    assert local_devices_per_node(use_gpu=False) == 3
    from rlflow.trainer.config import PlacementConfig

    assert PlacementConfig(use_gpu=False).devices_per_node == 3  # null resolves at validation
    assert PlacementConfig(devices_per_node=1).devices_per_node == 1


def test_among_equally_cheap_plans_the_one_on_the_fewest_and_lowest_devices_is_kept():
    import dataclasses

    from plan_cases import frozen_problem, opt

    from rlflow.trainer.placement import fewest_devices

    options = [[opt(1, 1, 1.0, dpn=2), opt(0, 2, 1.0, dpn=2), opt(0, 1, 1.0, dpn=2)]]
    problem = dataclasses.replace(frozen_problem(options), devices_per_node=2)
    result = plan_search(problem, max_seconds=1, progress=False)
    assert len(result.top) == 3  # all three cost the same
    assert fewest_devices(problem, result) == (2,)  # one device, device 0
