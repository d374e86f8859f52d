"""Dataflow graphs: the algorithms' MFCs and edges, validation errors, version edges and unrolling."""

from __future__ import annotations

import pickle

import networkx as nx
import pytest

from rlflow.dataflow import (
    Algorithm,
    MFCDef,
    ParamReallocHook,
    algorithm_graph,
    algorithm_mfcs,
    build_graph,
    get_algorithm,
    list_algorithms,
    mfcs_of,
    model_calls,
    register_algorithm,
    unroll_graph,
    version_edges,
)

ROLLOUT = ("input_ids", "attention_mask", "response_mask")


def test_ppo_graph_is_the_papers_six_calls_with_their_edges():
    g = algorithm_graph("ppo")
    mfcs = {n: g.nodes[n]["mfc"] for n in g.nodes}
    assert {n: (m.model_name, m.interface_type) for n, m in mfcs.items()} == {
        "actor_gen": ("actor", "generate"),
        "critic_inf": ("critic", "inference"),
        "ref_inf": ("ref", "inference"),
        "reward_inf": ("reward", "inference"),
        "actor_train": ("actor", "train_step"),
        "critic_train": ("critic", "train_step"),
    }
    gen_keys = ROLLOUT + ("old_logp",)
    assert dict(((u, v), k) for u, v, k in g.edges(data="keys")) == {
        ("actor_gen", "critic_inf"): ROLLOUT,
        ("actor_gen", "ref_inf"): ROLLOUT,
        ("actor_gen", "reward_inf"): ROLLOUT,
        ("actor_gen", "actor_train"): gen_keys,
        ("actor_gen", "critic_train"): gen_keys,
        ("critic_inf", "actor_train"): ("values",),
        ("critic_inf", "critic_train"): ("values",),
        ("ref_inf", "actor_train"): ("ref_logp",),
        ("ref_inf", "critic_train"): ("ref_logp",),
        ("reward_inf", "actor_train"): ("rewards",),
        ("reward_inf", "critic_train"): ("rewards",),
    }
    assert g.graph["dataset_keys"] == ("prompts", "prompt_mask")
    assert g.graph["models"] == ("actor", "critic", "ref", "reward")
    assert not any(m.runs_on_host for m in mfcs.values())
    assert mfcs["actor_train"].n_minibatches is None  # the workload's PPO mini-batches decide


def test_grpo_reward_is_a_rule_on_the_host_unless_asked_for_a_model():
    g = algorithm_graph("grpo")
    assert list(g.nodes) == ["actor_gen", "ref_inf", "reward_inf", "actor_train"]
    reward = g.nodes["reward_inf"]["mfc"]
    assert reward.runs_on_host and reward.model_name == "reward" and "answers" in reward.input_keys
    assert g.graph["dataset_keys"] == ("prompts", "prompt_mask", "answers")
    model_based = algorithm_graph("grpo", rule_based_reward=False).nodes["reward_inf"]["mfc"]
    assert not model_based.runs_on_host and "answers" not in model_based.input_keys
    no_ref = algorithm_graph("grpo", use_ref=False)
    assert "ref_inf" not in no_ref and "ref_logp" not in no_ref.nodes["actor_train"]["mfc"].input_keys


@pytest.mark.parametrize("name", ["ppo", "grpo", "rloo", "remax", "reinforce_pp"])
def test_without_a_reference_no_call_reads_one(name):
    g = algorithm_graph(name, use_ref=False)
    assert "ref_inf" not in g
    assert all("ref_logp" not in g.nodes[n]["mfc"].input_keys for n in g)
    assert "ref_inf" in algorithm_graph(name) and "ref_inf" in algorithm_graph("ppo_ema", use_ref=False)


def test_remax_has_a_greedy_rollout_scored_by_the_same_reward_model():
    g = algorithm_graph("remax", n_ppo_minibatches=2)
    greedy = g.nodes["actor_gen_greedy"]["mfc"]
    assert greedy.output_keys == tuple("greedy_" + k for k in ROLLOUT)
    assert greedy.interface_outputs()["input_ids"] == "greedy_input_ids"
    scorer = g.nodes["reward_inf_greedy"]["mfc"]
    assert scorer.model_name == "reward" and scorer.interface_inputs()["greedy_input_ids"] == "input_ids"
    assert g.edges["reward_inf_greedy", "actor_train"]["keys"] == ("greedy_rewards",)
    assert g.nodes["actor_train"]["mfc"].n_minibatches == 2
    assert model_calls(g)["actor"] == ["actor_gen", "actor_gen_greedy", "actor_train"]
    assert {("actor_train", "actor_gen"), ("actor_train", "actor_gen_greedy")} <= set(version_edges(g))


def test_ppo_ema_blends_the_reference_toward_the_actor():
    ref = algorithm_graph("ppo_ema", ref_ema_eta=0.05).nodes["ref_inf"]["mfc"]
    assert ref.pre_hooks == (ParamReallocHook(source="actor", eta=0.05),)
    assert ref.hook_sources == ("actor",)


@pytest.mark.parametrize("name", list_algorithms())
def test_every_algorithm_builds_a_dag_whose_train_calls_consume_every_output(name):
    g = algorithm_graph(name)
    assert nx.is_directed_acyclic_graph(g) and g.graph["algorithm"] == name
    produced = {k for m in mfcs_of(g) for k in m.output_keys}
    consumed = {k for m in mfcs_of(g) for k in m.input_keys}
    assert produced <= consumed  # nothing computed for nobody
    assert any(m.is_train for m in mfcs_of(g))
    # Every train call declares its objective, and the models it trains are the record's (plus a critic).
    trained = {m.model_name for m in mfcs_of(g) if m.is_train}
    assert trained - {"critic"} == set(get_algorithm(name).trains)


def test_supervised_graphs_are_small():
    assert list(algorithm_graph("sft").nodes) == ["actor_train"]
    assert list(algorithm_graph("rm").nodes) == ["reward_train"]
    dpo = algorithm_graph("dpo")
    assert list(dpo.edges(data="keys")) == [("ref_inf", "actor_train", ("ref_logp",))]
    assert dpo.nodes["actor_train"]["mfc"].n_minibatches == 1


def _mfc(name, model="actor", kind="inference", inputs=(), outputs=(), **kw):
    return MFCDef(name, model, kind, inputs, outputs, **kw)


@pytest.mark.parametrize(
    "mfcs, match",
    [
        ([], "at least one MFC"),
        ([_mfc("a"), _mfc("a")], "duplicate MFC name 'a'"),
        ([_mfc("a", outputs=("x",)), _mfc("b", outputs=("x",))], "key 'x' is produced by both 'a' and 'b'"),
        ([_mfc("a", inputs=("y",), outputs=("x",)), _mfc("b", inputs=("x",), outputs=("y",))], "cycle"),
        ([_mfc("a", pre_hooks=(ParamReallocHook("critic"),))], "hook reading model 'critic'"),
    ],
)
def test_build_graph_rejects_bad_graphs(mfcs, match):
    with pytest.raises(ValueError, match=match):
        build_graph(mfcs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(interface_type="rollout"), "interface_type='rollout'"),
        (dict(name=""), "name must be"),
        (dict(input_keys=("x", "x")), "lists a key twice"),
        (dict(input_keys=("x",), output_keys=("x",)), "reads and writes"),
        (dict(input_key_remap={"z": "x"}), "renames"),
        (dict(output_keys=("x",), output_key_remap={"a": "q"}), "targets"),
        (dict(n_seqs=0), "n_seqs=0"),
        (dict(n_minibatches=4), "only applies to train_step"),
        (dict(interface_type="train_step", runs_on_host=True, objective="rl"), "cannot run on the host"),
        (dict(interface_type="train_step"), "'m': a train_step needs objective in"),
        (dict(interface_type="train_step", objective="ppo"), "got 'ppo'"),
        (dict(objective="sft"), "only applies to train_step"),
    ],
)
def test_mfcdef_validates_its_fields(kwargs, match):
    args = dict(name="m", model_name="actor", interface_type="inference") | kwargs
    with pytest.raises(ValueError, match=match):
        MFCDef(**args)


def test_mfcdef_is_immutable_hashable_and_picklable():
    m = MFCDef("ref_inf", "ref", "inference", ROLLOUT, ("ref_logp",), output_key_remap={"logp": "ref_logp"})
    assert pickle.loads(pickle.dumps(m)) == m and hash(pickle.loads(pickle.dumps(m))) == hash(m)
    assert m.model_role == "ref" and m.interface_outputs() == {"logp": "ref_logp"}
    with pytest.raises(TypeError, match="immutable"):
        m.output_key_remap["x"] = "y"
    with pytest.raises(ValueError, match=r"eta=1.5"):
        ParamReallocHook("actor", eta=1.5)


def test_unknown_algorithms_and_options_name_the_allowed_ones():
    with pytest.raises(ValueError, match=r"unknown algorithm 'a2c'.*'grpo'.*'ppo'"):
        algorithm_mfcs("a2c")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['batch'\]"):
        algorithm_mfcs("ppo", batch=3)


def test_version_edges_link_last_to_first_call_of_every_model():
    assert version_edges(algorithm_graph("ppo")) == [
        ("actor_train", "actor_gen"),
        ("critic_train", "critic_inf"),
        ("ref_inf", "ref_inf"),
        ("reward_inf", "reward_inf"),
    ]


def test_unrolled_graph_waits_for_the_previous_weights():
    g = algorithm_graph("ppo")
    u = unroll_graph(g, 3)
    assert u.number_of_nodes() == 18 and nx.is_directed_acyclic_graph(u)
    kinds = [k for _, _, k in u.edges(data="kind")]
    assert kinds.count("data") == 3 * 11 and kinds.count("version") == 2 * 4
    assert u.edges[(0, "actor_train"), (1, "actor_gen")]["kind"] == "version"
    assert all(
        u.nodes[v]["iteration"] == u.nodes[w]["iteration"] + 1 for w, v, k in u.edges(data="kind") if k == "version"
    )
    # iteration 1 cannot start generating before iteration 0's actor update
    assert (0, "actor_train") in nx.ancestors(u, (1, "actor_gen"))
    assert (0, "critic_train") not in nx.ancestors(u, (1, "actor_gen"))
    with pytest.raises(ValueError, match="num_iterations=0"):
        unroll_graph(g, 0)


def test_the_train_calls_declare_their_objectives():
    objectives = {name: {m.name: m.objective for m in algorithm_mfcs(name) if m.is_train} for name in list_algorithms()}
    assert objectives["ppo"] == {"actor_train": "rl", "critic_train": "value"}
    assert objectives["reinforce_pp"] == objectives["grpo"] == {"actor_train": "rl"}
    assert objectives["dpo"] == {"actor_train": "dpo"} and objectives["sft"] == {"actor_train": "sft"}
    assert objectives["rm"] == {"reward_train": "rm"}


def test_the_records_hold_each_algorithms_rules():
    ppo, grpo, remax, dpo, rm = (get_algorithm(n) for n in ("ppo", "grpo", "remax", "dpo", "rm"))
    rpp = get_algorithm("reinforce_pp")
    assert (rpp.default_estimator, rpp.kl_in_reward, rpp.samples_responses) == ("reinforce_plus_plus", True, True)
    assert rpp.required_models(kl_coef=0.01, critic=False, reward_model=False) == ("actor", "ref")
    assert rpp.required_models(kl_coef=0.0, critic=False, reward_model=True) == ("actor", "reward")
    assert ppo.required_models(kl_coef=0.0, critic=True, reward_model=False) == ("actor", "critic")
    assert get_algorithm("ppo_ema").required_models(kl_coef=0.0, critic=True, reward_model=False)[:2] == (
        "actor",
        "ref",
    )
    assert dpo.required_models(kl_coef=0.0, critic=False, reward_model=True) == ("actor", "ref")  # no rollouts to score
    assert rm.required_models(kl_coef=0.5, critic=True, reward_model=True) == ("reward",)
    # Rows that share a dp rank: pairs; a prompt's samples when the estimator compares them or ReMax's baseline.
    assert [a.row_group_size(4, False) for a in (ppo, grpo, remax, dpo, rm)] == [1, 1, 4, 2, 2]
    assert grpo.row_group_size(4, True) == 4 and get_algorithm("sft").row_group_size(4, True) == 1
    assert (dpo.dataset, get_algorithm("sft").dataset, grpo.dataset) == ("pairs", "examples", "prompts")


def test_the_registry_refuses_duplicates_and_inconsistent_records():
    with pytest.raises(ValueError, match="'grpo' is already registered"):
        register_algorithm(get_algorithm("grpo"))
    with pytest.raises(ValueError, match="needs one"):
        Algorithm("pg", lambda o: [], "prompts")  # samples responses but names no estimator
    with pytest.raises(ValueError, match="dataset='rows'"):
        Algorithm("pg", lambda o: [], "rows")
