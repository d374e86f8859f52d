"""A user's algorithm in one file (``recipes/a2c_custom.py``): config, dataflow and planner read
its record, and ``Trainer(..., algorithm=A2C).fit()`` trains it on real workers.

The worked example of ``docs/architecture.md``: advantage actor-critic (A2C) — one rollout,
critic values, a rule-based reward, then actor and critic train steps on GAE advantages —
and no reference model whatever ``kl_coef`` says. Nothing in rlflow changes for it: the config
accepts ``algorithm.name=a2c`` and asks for the models the record names, ``build_dataflow``
builds its graph with the config's options, the heuristic planner places its calls, and the
workers train the actor and the critic the record's graph names.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from recipes.a2c_custom import A2C, main
from rlflow.dataflow import register_algorithm
from rlflow.planner.model_spec import model_preset
from rlflow.trainer.build import build_dataflow
from rlflow.trainer.config import ConfigError, load_config
from rlflow.trainer.placement import plan_placement
from tests.trainer.recipe_helpers import QUICK_FIT, TINY_ACTOR

COPIES = [f"models.critic.{k}" for k in ("init=copy", "init_from=actor")]
STEPS = 2
# The recipe shrunk to two steps of 4 prompts on one CPU worker: a 2-layer, 64-wide actor, no warm-up.
TINY_RUN = [
    *TINY_ACTOR,
    "algorithm.reward_fn=null",  # scored by digit_share instead
    f"trainer.total_steps={STEPS}",
    "trainer.eval_before_train=false",
    "trainer.max_wall_seconds=null",
    *QUICK_FIT,
]


def digit_share(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """The share of a completion's characters that are digits.

    An untrained actor answers no sum right, and the critic starts with a zero value head: under
    the task's exact-match rule every reward, value and advantage of a two-step run is 0 and
    nothing would move. Random completions hold some digits, so this reward is not.
    """
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


@pytest.fixture
def a2c():
    """A2C registered for one test (tests/conftest.py restores the registry after each test)."""
    return register_algorithm(A2C)


def test_config_validation_reads_the_new_record(a2c):
    cfg = load_config(None, ["algorithm.name=a2c", "algorithm.kl_coef=0.1", *COPIES])
    assert cfg.algorithm.resolved_adv_estimator == "gae"
    assert cfg.required_models() == ("actor", "critic")  # ref="never": no reference for the KL weight
    assert cfg.is_trainable("critic") and cfg.row_group_size() == 1
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


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_the_recipe_trains_the_actor_and_the_critic(ray_session, tmp_path):
    result = main([*TINY_RUN, f"logging.dir={tmp_path}"], reward_funcs=[digit_share])

    assert result.steps == STEPS
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if "actor_train/loss" in r}
    assert sorted(steps) == list(range(1, STEPS + 1))
    for record in steps.values():
        for call in ("actor_train", "critic_train"):
            assert math.isfinite(record[f"{call}/loss"]) and record[f"{call}/grad_norm"] > 0, call
        assert 0.0 <= record["reward_inf/score_mean"] <= 1.0
    # The actor the user gets back is not the one it started from.
    before = load_file(tmp_path / "models" / "actor" / "model.safetensors")
    after = load_file(tmp_path / "checkpoints" / f"step_{STEPS}" / "actor" / "hf" / "model.safetensors")
    assert sorted(before) == sorted(after) and all(torch.isfinite(t).all() for t in after.values())
    assert max(float((after[k] - before[k]).abs().max()) for k in before) > 1e-6
