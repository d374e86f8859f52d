"""A user's algorithm in one file: its record and graph, then config, dataflow and planner read it.

The worked example of ``docs/architecture.md``: advantage actor-critic (A2C) — one rollout,
critic values, a rule-based reward, then actor and critic train steps on GAE advantages —
and no reference model whatever ``kl_coef`` says. Nothing in rlflow changes for it: the config
accepts ``algorithm.name=a2c`` and asks for the models the record names, ``build_dataflow``
builds its graph with the config's options, and the heuristic planner places its calls.
"""

from __future__ import annotations

import pytest

from rlflow.dataflow import Algorithm, GraphOptions, MFCDef, algorithms, register_algorithm
from rlflow.planner.model_spec import model_preset
from rlflow.trainer.build import build_dataflow, row_group_size
from rlflow.trainer.config import ConfigError, load_config
from rlflow.trainer.placement import plan_placement

ROLLOUT = ("input_ids", "attention_mask", "response_mask")


def a2c_mfcs(o: GraphOptions) -> list[MFCDef]:
    """Rollout, critic values and a reward, then one actor and one critic step per batch."""
    train_keys = ROLLOUT + ("old_logp", "values", "rewards")
    rule = bool(o.rule_based_reward)
    reward_keys = ROLLOUT + (("answers",) if rule else ())
    return [
        MFCDef("actor_gen", "actor", "generate", ("prompts", "prompt_mask"), ROLLOUT + ("old_logp",)),
        MFCDef("critic_inf", "critic", "inference", ROLLOUT, ("values",)),
        MFCDef("reward_inf", "reward", "inference", reward_keys, ("rewards",), runs_on_host=rule),
        MFCDef("actor_train", "actor", "train_step", train_keys, (), n_minibatches=1, objective="rl"),
        MFCDef("critic_train", "critic", "train_step", train_keys, (), n_minibatches=1, objective="value"),
    ]


A2C = Algorithm(
    "a2c", a2c_mfcs, "prompts", default_estimator="gae", ref="never", reward_by_rule=True, description="A2C"
)
COPIES = [f"models.critic.{k}" for k in ("init=copy", "init_from=actor")]


@pytest.fixture
def a2c(monkeypatch):
    """A2C registered for one test (the registry is restored afterwards)."""
    monkeypatch.setattr(algorithms, "_ALGORITHMS", dict(algorithms._ALGORITHMS))
    return register_algorithm(A2C)


def test_config_validation_reads_the_new_record(a2c):
    cfg = load_config(None, ["algorithm.name=a2c", "algorithm.kl_coef=0.1", *COPIES])
    assert cfg.algorithm.resolved_adv_estimator == "gae"
    assert cfg.required_models() == ("actor", "critic")  # ref="never": no reference for the KL weight
    assert cfg.is_trainable("critic") and row_group_size(cfg) == 1
    with pytest.raises(ConfigError, match="missing: algorithm 'a2c' needs a critic model"):
        load_config(None, ["algorithm.name=a2c"])


def test_an_unregistered_name_is_refused_naming_the_registered_ones():
    with pytest.raises(ConfigError, match=r"algorithm.name: 'a2c' is not allowed; expected one of \[.*'grpo'"):
        load_config(None, ["algorithm.name=a2c"])


def test_build_dataflow_and_the_heuristic_planner_place_its_calls(a2c):
    cfg = load_config(None, ["algorithm.name=a2c", "placement.mode=heuristic", "placement.devices_per_node=8", *COPIES])
    graph = build_dataflow(cfg, rule_reward=True)
    assert graph.graph["algorithm"] == "a2c"
    assert list(graph) == ["actor_gen", "critic_inf", "reward_inf", "actor_train", "critic_train"]
    assert graph.nodes["reward_inf"]["mfc"].runs_on_host
    specs = {"actor": model_preset("llama2-7b"), "critic": model_preset("llama2-7b", value_head=True)}
    placement = plan_placement(cfg, graph, specs, use_gpu=True, progress=False)
    placed = {c.name for c in placement.plan.calls}
    assert placed == {"actor_gen", "critic_inf", "actor_train", "critic_train"}  # the rule runs on the host
    assert placement.plan.fits and placement.plan.iteration_time_s > 0
