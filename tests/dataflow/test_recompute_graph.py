"""The old-log-prob recompute call in the graphs of the sampling algorithms: its keys and edges,
its version edge, where the lagged issuer puts it, and the graphs that refuse it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlflow.dataflow import MFCDef, algorithm_graph, get_algorithm, list_algorithms, mfcs_of, version_edges
from rlflow.dataflow.algorithms import with_old_logp_recompute
from rlflow.dataflow.graph import unroll_graph, version_spans
from rlflow.trainer.runner import DataflowRunner

ROLLOUT = ("input_ids", "attention_mask", "response_mask")
SAMPLING = [n for n in list_algorithms() if get_algorithm(n).samples_responses]


def test_every_shipped_sampling_algorithm_is_covered():
    assert set(SAMPLING) == {"ppo", "ppo_ema", "grpo", "rloo", "remax", "reinforce_pp", "distill"}


@pytest.mark.parametrize("name", SAMPLING)
def test_the_recompute_call_writes_old_logp_from_the_rollout_and_the_train_call_reads_both(name):
    plain, graph = algorithm_graph(name), algorithm_graph(name, recompute_old_logp=True)
    assert set(graph) == set(plain) | {"actor_inf"}
    inf = graph.nodes["actor_inf"]["mfc"]
    assert (inf.model_name, inf.interface_type) == ("actor", "inference")
    assert inf.input_keys == ROLLOUT + ("rollout_logp",) and inf.output_keys == ("old_logp",)
    assert inf.interface_outputs() == {"logp": "old_logp"}
    gen = graph.nodes["actor_gen"]["mfc"]
    assert gen.output_keys == ROLLOUT + ("rollout_logp",)
    assert gen.interface_outputs()["old_logp"] == "rollout_logp"  # what the engine returns, stored apart
    assert graph.edges["actor_gen", "actor_inf"]["keys"] == ROLLOUT + ("rollout_logp",)
    # Every call that read the rollout's old_logp reads the recomputed one now.
    readers = [u for u in plain if "old_logp" in plain.nodes[u]["mfc"].input_keys]
    assert readers and all(graph.edges["actor_inf", r]["keys"] == ("old_logp",) for r in readers)
    train = graph.nodes["actor_train"]["mfc"]
    assert "rollout_logp" in train.input_keys and "old_logp" in train.input_keys
    if "critic_train" in graph:  # the critic needs no rollout log-probs
        assert "rollout_logp" not in graph.nodes["critic_train"]["mfc"].input_keys
    # The other calls are untouched, and it follows the rollout in issue order.
    assert all(graph.nodes[n]["mfc"] == plain.nodes[n]["mfc"] for n in plain if n not in ("actor_gen", "actor_train"))
    order = [m.name for m in mfcs_of(graph)]
    assert order.index("actor_inf") == order.index("actor_gen") + 1


def test_the_graph_without_the_option_is_todays():
    for name in list_algorithms():
        assert "actor_inf" not in algorithm_graph(name)
        assert "rollout_logp" not in {k for _, _, keys in algorithm_graph(name).edges(data="keys") for k in keys}


def test_it_reads_the_newest_weights_even_when_the_rollout_lags():
    graph = algorithm_graph("grpo", recompute_old_logp=True)
    edges = dict(zip(version_edges(graph), version_spans(graph, policy_lag=2)))
    # The rollout samples with weights 3 steps old; the recompute waits for the previous train step.
    assert edges[("actor_train", "actor_gen")] == 3 and edges[("actor_train", "actor_inf")] == 1
    unrolled = unroll_graph(graph, 3, policy_lag=2)
    assert unrolled.has_edge((1, "actor_train"), (2, "actor_inf"))
    assert not unrolled.has_edge((1, "actor_train"), (2, "actor_gen"))


def test_the_lagged_issuer_keeps_it_with_the_train_steps():
    """It runs on the weights that train: issued with step t's train calls (after step t-1 trained),
    never ahead with the rollout: under a lag its log-probs are the proximal policy's."""
    runner = DataflowRunner.__new__(DataflowRunner)
    runner.graph = algorithm_graph("grpo", recompute_old_logp=True, use_ref=True, rule_based_reward=True)
    runner.order = [m.name for m in mfcs_of(runner.graph)]
    runner.placements = {m.name: SimpleNamespace(mfc=m) for m in mfcs_of(runner.graph)}
    assert runner.rollout_calls() == ["actor_gen", "ref_inf", "reward_inf"]


@pytest.mark.parametrize("name", ["dpo", "sft", "rm"])
def test_algorithms_that_sample_nothing_refuse_it(name):
    with pytest.raises(ValueError, match=f"algorithm '{name}' samples nothing"):
        algorithm_graph(name, recompute_old_logp=True)


def test_graphs_it_cannot_rewrite_are_refused_by_name():
    gen = MFCDef("gen", "actor", "generate", ("prompts",), ROLLOUT + ("old_logp",))
    train = MFCDef("actor_train", "actor", "train_step", ROLLOUT + ("old_logp",), objective="rl")
    with pytest.raises(ValueError, match="already has a call named 'actor_inf'"):
        with_old_logp_recompute([gen, MFCDef("actor_inf", "actor", "inference", ROLLOUT, ("x",)), train])
    with pytest.raises(ValueError, match=r"needs one generate call writing it; got \[\]"):
        with_old_logp_recompute([train])
    partial = MFCDef("gen", "actor", "generate", ("prompts",), ("input_ids", "old_logp"))
    with pytest.raises(ValueError, match="'gen' must write"):
        with_old_logp_recompute([partial])
