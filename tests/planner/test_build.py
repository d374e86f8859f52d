"""``build_problem`` on small clusters: shapes, consistency with the cost model, and the contract
the simulator reads."""

from __future__ import annotations

import numpy as np
import pytest

from rlflow.dataflow import algorithm_graph
from rlflow.planner.build import Workload, build_problem, device_graph
from rlflow.planner.cluster import cluster_preset
from rlflow.planner.compiled import compile_problem
from rlflow.planner.cost import call_cost
from rlflow.planner.model_spec import ModelSpec
from rlflow.planner.space import RuntimeCapabilities
from rlflow.planner.transfer import ema_time_table

LM = ModelSpec(num_layers=4, hidden_size=512, intermediate_size=1024, num_heads=8, num_kv_heads=8, vocab_size=1000)
MODELS = {"actor": LM, "ref": LM, "critic": LM.as_value_model(), "reward": LM.as_value_model()}
CLUSTER = cluster_preset("a100-80g", num_nodes=2, devices_per_node=4)
WORK = Workload(batch_size=32, prompt_len=64, gen_len=64, n_ppo_minibatches=2)


@pytest.fixture(scope="module")
def ppo():
    return build_problem(algorithm_graph("ppo"), MODELS, CLUSTER, WORK)


def test_ppo_problem_shapes(ppo):
    assert ppo.mfc_names == ["actor_gen", "critic_inf", "ref_inf", "reward_inf", "actor_train", "critic_train"]
    assert [m.name for m in ppo.models] == ["actor", "critic", "ref", "reward"]
    assert [(m.trainable, m.train_mfc) for m in ppo.models] == [(True, 4), (True, 5), (False, None), (False, None)]
    assert len(ppo.data_edges) == 11 and ppo.version_edges == [(4, 0), (5, 1), (2, 2), (3, 3)]
    for (i, k), table in zip(ppo.data_edges, ppo.data_time):
        assert table.shape == (len(ppo.options[i]), len(ppo.options[k])) and np.all(np.asarray(table) >= 0)
    assert sorted(ppo.realloc_time) == [(4, 0), (5, 1)] and sorted(ppo.reload_time) == [2, 3]
    assert (ppo.num_nodes, ppo.devices_per_node, ppo.device_memory_bytes) == (2, 4, CLUSTER.device_memory_bytes)
    assert any(o.strategy.pp > 1 for o in ppo.options[0])  # pipelined generation by default (the built-in sampler's)
    compile_problem(ppo)  # the simulator accepts it


def test_options_are_the_cost_models_estimates(ppo):
    graph = algorithm_graph("ppo")
    for i, name in enumerate(ppo.mfc_names):
        mfc, model = graph.nodes[name]["mfc"], MODELS[graph.nodes[name]["mfc"].model_name]
        for opt in ppo.options[i][:: max(1, len(ppo.options[i]) // 7)]:
            c = call_cost(mfc, model, opt.strategy, opt.mesh, CLUSTER, WORK)
            assert (opt.time_s, opt.act_bytes, opt.weight_bytes, opt.train_state_bytes) == (
                c.time_s, c.act_bytes, c.weight_bytes, c.train_state_bytes,
            )  # fmt: skip
            assert opt.train_state_bytes > 0 if mfc.is_train else opt.train_state_bytes == 0


def test_transfer_tables_are_zero_exactly_on_equal_layouts(ppo):
    for (h, i), table in ppo.realloc_time.items():
        same = np.array(
            [[(a.mesh, a.strategy) == (b.mesh, b.strategy) for b in ppo.options[i]] for a in ppo.options[h]]
        )
        assert same.any() and np.all(table[~same] > 0)
        if ppo.options[i][0].replicated:  # a generation gathers a dp-replicated copy even on the home's layout
            assert ppo.mfc_names[i] == "actor_gen" and np.all(table[same] > 0)
        else:  # a forward call on the home's FSDP layout runs on the home itself
            assert np.all(table[same] == 0)
    for i, times in ppo.reload_time.items():
        assert times.shape == (len(ppo.options[i]),) and np.all(times > 0)


def test_memory_filter_and_option_limit():
    tight = cluster_preset("a100-80g", num_nodes=1, devices_per_node=4)
    tight = tight.__class__(**{**tight.__dict__, "device_memory_bytes": 0.12e9})
    full = build_problem(algorithm_graph("sft"), {"actor": LM}, CLUSTER, WORK)
    small = build_problem(algorithm_graph("sft"), {"actor": LM}, tight, WORK)
    assert all(o.act_bytes + o.weight_bytes + o.train_state_bytes <= 0.12e9 for o in small.options[0])
    assert 0 < len(small.options[0]) < len(full.options[0])
    limited = build_problem(algorithm_graph("sft"), {"actor": LM}, CLUSTER, WORK, max_options_per_mfc=5)
    fastest = sorted(o.time_s for o in full.options[0])[:5]
    assert sorted(o.time_s for o in limited.options[0]) == fastest


def test_rule_based_reward_stays_off_the_devices():
    graph = algorithm_graph("grpo")
    problem = build_problem(graph, {"actor": LM, "ref": LM}, CLUSTER, Workload(8, 32, 32, n_samples_per_prompt=4))
    assert problem.mfc_names == ["actor_gen", "ref_inf", "actor_train"]
    assert sorted(problem.data_edges) == [(0, 1), (0, 2), (1, 2)]
    assert "reward_inf" not in device_graph(graph) and device_graph(graph).has_edge("actor_gen", "actor_train")
    # the group of 4 samples per prompt is what every call processes
    assert max(o.strategy.dp for o in problem.options[2]) <= 32 // 4


def test_no_pipelined_generation_when_the_runtime_cannot():
    caps = RuntimeCapabilities(pipeline_generate=False)
    problem = build_problem(algorithm_graph("ppo"), MODELS, CLUSTER, WORK, capabilities=caps, num_iterations=2)
    assert all(o.strategy.pp == 1 for o in problem.options[0]) and problem.num_iterations == 2
    assert any(o.strategy.pp > 1 for o in problem.options[2])  # inference still pipelines


def test_bad_inputs_name_what_is_wrong():
    graph = algorithm_graph("ppo")
    with pytest.raises(ValueError, match=r"no ModelSpec for model\(s\) \['critic', 'reward'\]"):
        build_problem(graph, {"actor": LM, "ref": LM}, CLUSTER, WORK)
    with pytest.raises(ValueError, match="trainable model 'ref' needs exactly one train_step"):
        build_problem(graph, MODELS, CLUSTER, WORK, trainable={"actor", "critic", "ref"})
    with pytest.raises(ValueError, match=r"\['critic'\] have train_step MFCs but are not in trainable"):
        build_problem(graph, MODELS, CLUSTER, WORK, trainable={"actor"})


def test_ppo_ema_prices_the_blend_into_the_reference():
    problem = build_problem(algorithm_graph("ppo_ema"), MODELS, CLUSTER, WORK)
    train, ref = problem.mfc_names.index("actor_train"), problem.mfc_names.index("ref_inf")
    assert list(problem.hook_time) == [(train, ref)]
    pairs = [[(o.mesh, o.strategy) for o in problem.options[k]] for k in (train, ref)]
    np.testing.assert_array_equal(problem.hook_time[(train, ref)], ema_time_table(LM, *pairs, CLUSTER))
    assert np.all(problem.hook_time[(train, ref)] > 0)
    plain = build_problem(algorithm_graph("ppo"), MODELS, CLUSTER, WORK)
    assert plain.hook_time == {}
