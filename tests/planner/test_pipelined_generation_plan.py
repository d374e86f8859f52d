"""Pipelined generation as the planner sees it: declared by the built-in engine, priced per decode
step (a bubble and the sends), and the option that makes the Megatron-style heuristic feasible at
every node count."""

from __future__ import annotations

import numpy as np
import pytest

import rlflow.planner.build as build
from rlflow.cli import main
from rlflow.dataflow import algorithm_graph, algorithm_mfcs, model_calls
from rlflow.engine.rollout import get_rollout_engine
from rlflow.planner.baselines import heuristic_plan
from rlflow.planner.build import Workload, build_problem, pricing_rates
from rlflow.planner.cluster import cluster_preset
from rlflow.planner.cost import _pipelined_decode_step_s, call_cost
from rlflow.planner.mesh import DeviceMesh
from rlflow.planner.model_spec import model_preset
from rlflow.planner.space import RuntimeCapabilities, enumerate_strategies
from rlflow.strategy import ParallelStrategy

# The ReaLHF paper's setting (LLaMA-2-7B PPO, A100-80GB hosts of 8, prompt 128, gen 896, 4 mini-batches)
WORKLOAD = Workload(512, 128, 896, n_ppo_minibatches=4)
GEN = algorithm_mfcs("ppo")[0]


def _models(graph) -> dict:
    return {n: model_preset("llama2-7b", value_head=n in ("critic", "reward")) for n in model_calls(graph)}


def test_the_built_in_engine_declares_pipelined_generation_and_the_planner_offers_it():
    assert get_rollout_engine("hf").capabilities.pp and not get_rollout_engine("vllm").capabilities.pp
    whole = DeviceMesh(2, 8, devices_per_node=8)
    llama = model_preset("llama2-7b")
    assert ParallelStrategy(dp=1, tp=8, pp=2) in enumerate_strategies(whole, llama, GEN, 512)
    no_pp = enumerate_strategies(whole, llama, GEN, 512, capabilities=RuntimeCapabilities(pipeline_generate=False))
    assert no_pp and all(s.pp == 1 for s in no_pp)


def test_a_pipelined_decode_step_is_a_round_trip_or_the_stage_passes():
    stage, hidden, token = np.array([1.0, 2.0]), 0.1, 0.05
    # fewer micro-batches than stages: a micro-batch's round trip (2 passes, 1 hidden send, 1 token send)
    np.testing.assert_allclose(_pipelined_decode_step_s(stage, hidden, token, 1, 2), [2.15, 4.15])
    # as many as stages: still the round trip, the sends not hidden by a second micro-batch's work
    np.testing.assert_allclose(_pipelined_decode_step_s(stage, hidden, token, 2, 2), [2.15, 4.15])
    # more micro-batches than stages: every stage busy, the sends overlap compute
    np.testing.assert_allclose(_pipelined_decode_step_s(stage, hidden, token, 4, 2), [4.0, 8.0])


def test_pipelined_generation_is_priced_by_the_bubble_and_the_sends():
    """Across hosts, the same pp=2 generation costs more decode time than within one (the sends);
    with fewer prompts than stages it runs fewer micro-batches (the sampler's are of whole prompts)."""
    two_hosts = cluster_preset("a100-80g", 2, 8)
    one_host = cluster_preset("a100-80g", 1, 16)
    model = model_preset("llama2-7b")

    def decode_s(strategy, mesh, cluster, workload=WORKLOAD) -> float:
        cost = call_cost(GEN, model, strategy, mesh, cluster, workload, pricing_rates(cluster, None))
        return cost.breakdown["decode_s"]

    s = ParallelStrategy(dp=1, tp=8, pp=2)
    across = decode_s(s, DeviceMesh(2, 8, devices_per_node=8), two_hosts)
    assert across > decode_s(s, DeviceMesh(1, 16, devices_per_node=16), one_host) > 0
    few = Workload(1, 128, 896, n_ppo_minibatches=1)  # one prompt: one micro-batch, all bubble
    pp4 = decode_s(ParallelStrategy(dp=1, tp=4, pp=4), DeviceMesh(2, 8), two_hosts, few)
    assert pp4 > decode_s(ParallelStrategy(dp=1, tp=4, pp=1), DeviceMesh(1, 4), two_hosts, few)  # no gain


def _price_whole_cluster_only(monkeypatch) -> None:
    """Price only whole-cluster placements: the heuristic takes nothing else, and pricing every mesh of
    16 hosts takes ~15 s (``test_whole_cluster_problem_gives_the_heuristic_the_full_problems_plan``
    shows the heuristic's plan is the same)."""
    enumerate_all = build.enumerate_options

    def whole_only(mfc, model, num_nodes, devices_per_node, *args):
        options = enumerate_all(mfc, model, num_nodes, devices_per_node, *args)
        return [(m, s) for m, s in options if m.size == num_nodes * devices_per_node]

    monkeypatch.setattr(build, "enumerate_options", whole_only)


@pytest.fixture
def whole_cluster_options(monkeypatch):
    _price_whole_cluster_only(monkeypatch)


def _heuristic(num_nodes: int, capabilities: RuntimeCapabilities | None = None):
    graph = algorithm_graph("ppo")
    cluster = cluster_preset("a100-80g", num_nodes, 8)
    problem = build_problem(graph, _models(graph), cluster, WORKLOAD, capabilities=capabilities)
    return problem, heuristic_plan(problem)


def test_whole_cluster_problem_gives_the_heuristic_the_full_problems_plan():
    full_problem, full = _heuristic(2)
    with pytest.MonkeyPatch.context() as monkeypatch:
        _price_whole_cluster_only(monkeypatch)
        problem, whole = _heuristic(2)
    assert whole.iteration_time_s == pytest.approx(full.iteration_time_s, rel=1e-12)
    strategies = {full_problem.options[i][j].strategy for i, j in enumerate(full.choice)}
    assert strategies == {problem.options[i][j].strategy for i, j in enumerate(whole.choice)}


@pytest.mark.parametrize("num_nodes", range(1, 17))
def test_heuristic_is_feasible_by_default_from_1_to_16_nodes(whole_cluster_options, num_nodes):
    """Megatron-style: tp inside a host, pp across hosts, every call (generation included) on the cluster."""
    problem, plan = _heuristic(num_nodes)
    assert plan.feasible, plan.reason
    for i, j in enumerate(plan.choice):
        assert problem.options[i][j].strategy.pp == num_nodes
    if num_nodes > 1:  # an engine that cannot pipeline leaves the heuristic nothing for generation
        _, no_pp = _heuristic(num_nodes, RuntimeCapabilities(pipeline_generate=False))
        assert not no_pp.feasible and "'actor_gen' has no option on the whole cluster" in no_pp.reason


def test_cli_plans_pipelined_generation_by_default(capsys):
    argv = "plan --actor llama2-7b --nodes 2 --batch 64 --gen-len 32 --search-steps 50 --chains 1 --no-progress"
    assert main(argv.split()) == 0
    heuristic = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("heuristic"))
    assert "infeasible" not in heuristic
    assert main([*argv.split(), "--no-pipeline-generate"]) == 0
    heuristic = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("heuristic"))
    assert "infeasible" in heuristic
