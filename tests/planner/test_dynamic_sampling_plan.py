"""Dynamic sampling in the planner: a step repeats the calls of a generation round
(``rlflow.dataflow.rollout_calls``) ``algorithm.dynamic_sampling_rounds`` times, and the plan's
iteration prices them so (the calibration's part: tests/trainer/test_run_calibration.py)."""

from __future__ import annotations

import pytest

from rlflow.dataflow import rollout_calls
from rlflow.planner.model_spec import model_preset
from rlflow.trainer.build import build_dataflow
from rlflow.trainer.config import ConfigError, load_config
from rlflow.trainer.placement import plan_placement

DYNAMIC = ["algorithm.name=grpo", "algorithm.dynamic_sampling=true", "models.reward.init=tiny",
           "models.ref.init=tiny", "algorithm.kl_coef=0.1", "placement.mode=heuristic"]  # fmt: skip
SPECS = {role: model_preset("llama2-7b") for role in ("actor", "reward", "ref")}


def _plan(*overrides: str):
    cfg = load_config(None, [*DYNAMIC, *overrides])
    cfg.placement.devices_per_node = 8
    graph = build_dataflow(cfg, rule_reward=False)
    return cfg, graph, plan_placement(cfg, graph, SPECS, use_gpu=True, progress=False)


def test_a_step_is_priced_with_its_generation_rounds():
    _, graph, once = _plan()
    _, _, rounds = _plan("algorithm.dynamic_sampling_rounds=2.5")
    repeated = rollout_calls(graph)
    assert repeated == ["actor_gen", "ref_inf", "reward_inf"]  # the frozen models score each round
    assert rounds.rounds == dict.fromkeys(repeated, 2.5)
    # one call is priced alike; the iteration holds the round's calls 2.5 times, the train step once
    assert rounds.estimated_call_seconds() == pytest.approx(once.estimated_call_seconds())
    per_call = once.estimated_call_seconds()
    added = 1.5 * sum(per_call[n] for n in repeated)
    assert rounds.plan.iteration_time_s == pytest.approx(once.plan.iteration_time_s + added, rel=1e-6)
    _, _, off = _plan("algorithm.dynamic_sampling=false", "algorithm.dynamic_sampling_rounds=2.5")
    assert off.rounds == {} and off.plan.iteration_time_s == pytest.approx(once.plan.iteration_time_s)


def test_more_rounds_than_a_step_may_take_are_refused():
    with pytest.raises(ConfigError, match="dynamic_sampling_rounds: 5 > dynamic_sampling_max_rounds=4"):
        load_config(None, [*DYNAMIC, "algorithm.dynamic_sampling_rounds=5"])
