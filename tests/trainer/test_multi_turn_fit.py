"""Multi-turn GRPO through the public Trainer: tools or an environment, and what is refused."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from tiny_fit import DRIVER_FIT, GRPO, REPO, TINY_ACTOR

from rlflow.data.files import DatasetFormatError
from rlflow.data.tokenizer import build_char_tokenizer
from rlflow.trainer import ConfigError, Trainer
from rlflow.trainer.data import TraceDataset
from rlflow.workers.environments import Step

TINY = [
    *TINY_ACTOR, *DRIVER_FIT, "trainer.total_steps=2", "rollout.max_new_tokens=4",
    "rollout.multi_turn.max_prompt_tokens=16", "rollout.multi_turn.max_total_tokens=24",
]  # fmt: skip


def calculator(expression: str) -> str:
    """Evaluates an integer sum such as ``12+34``.

    Args:
        expression: digits and plus signs.
    """
    return str(sum(int(term) for term in expression.split("+")))


class Calculator:
    """Every turn is handed to the calculator; its result (or its error) is the observation. Two turns,
    each rewarded 0.5."""

    def reset(self, row):
        self.turns = 0
        return row["prompt"]

    def step(self, text):
        self.turns += 1
        try:
            observation = "=" + calculator(text.strip())
        except ValueError as err:  # what the model wrote is no sum: the error is what it reads
            observation = f"!{type(err).__name__}"
        return Step(observation[:6], 0.5, self.turns >= 2)

    def metrics(self):
        return {"calculator/turns": float(self.turns)}


def _steps(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if any(k.startswith("actor_train/") for k in r)]


def test_grpo_fits_two_steps_over_episodes_of_an_environment_with_old_logp_recomputed_and_a_policy_lag(tmp_path):
    overrides = [*TINY, f"logging.dir={tmp_path}", "algorithm.recompute_old_logp=true", "algorithm.policy_lag=1"]
    with Trainer(GRPO, overrides=overrides, environment=Calculator) as trainer:
        trainer.fit()
    steps = _steps(tmp_path)
    assert len(steps) == 2
    for metrics in steps:
        assert metrics["actor_gen/multi_turn/turns"] == 2.0
        assert metrics["actor_gen/calculator/turns"] == 2.0
        assert 0.0 < metrics["actor_gen/multi_turn/observation_share"] < 1.0
        assert metrics["actor_gen/multi_turn/env_reward"] == 1.0
        # The score is the environment's reward plus the rule's (numeric_match: 0 or 1 a row).
        assert 1.0 <= metrics["reward_inf/score_mean"] <= 2.0
        assert math.isfinite(metrics["actor_train/pg_loss"])
        # The recompute's log-probs of the sampled tokens match the sampler's: the contexts are the same.
        assert metrics["actor_inf/logp_mismatch_max"] < 1e-3
    assert steps[1]["actor_train/policy_lag"] == 1.0


def test_grpo_fits_with_tools_and_logs_their_counts(tmp_path):
    overrides = [*TINY, f"logging.dir={tmp_path}", "trainer.total_steps=1", "rollout.multi_turn.max_prompt_tokens=640"]
    with Trainer(GRPO, overrides=overrides, tools=[calculator]) as t:  # the tools are listed in the prompt
        t.fit()
    (metrics,) = _steps(tmp_path)
    assert metrics["actor_gen/multi_turn/turns"] >= 1.0
    for key in ("tools/calls", "tools/errors", "tools/timeouts", "tools/seconds"):
        assert f"actor_gen/{key}" in metrics


class NoStep:
    def reset(self, row):
        return row["prompt"]


def test_a_bad_environment_or_two_sources_of_episodes_are_refused_at_construction(tmp_path):
    with pytest.raises(TypeError, match="environment class 'NoStep' has no method 'step'"):
        Trainer(GRPO, overrides=[*TINY, f"logging.dir={tmp_path / 'a'}"], environment=NoStep)
    with pytest.raises(ConfigError, match="tools and environment both"):
        Trainer(GRPO, overrides=[*TINY, f"logging.dir={tmp_path / 'b'}"], environment=Calculator, tools=[calculator])
    traces = ["warmup.steps=1", "warmup.tool_traces=rlflow.data.tool_tasks:multiply_traces"]
    with pytest.raises(ConfigError, match="warmup.tool_traces: needs tools or an environment"):
        Trainer(GRPO, overrides=[*TINY, f"logging.dir={tmp_path / 'd'}", *traces])
    with pytest.raises(DatasetFormatError, match=r"multiply_traces: prompt '\d+\+\d+=' is not of the form"):
        Trainer(GRPO, overrides=[*TINY, f"logging.dir={tmp_path / 'e'}", *traces], tools=[calculator])
    with pytest.raises(ConfigError, match=r"rollout.multi_turn.environment: .*'no_such_module:Env'"):
        Trainer(
            GRPO,
            overrides=[*TINY, f"logging.dir={tmp_path / 'c'}", "rollout.multi_turn.environment=no_such_module:Env"],
        )


def test_a_plan_generating_tensor_or_pipeline_parallel_is_refused_for_multi_turn():
    from rlflow.dataflow import MFCDef
    from rlflow.strategy import ParallelStrategy
    from rlflow.trainer.build import check_multi_turn_calls
    from rlflow.trainer.runner import CallPlacement

    gen = MFCDef("actor_gen", "actor", "generate", ("prompts", "prompt_mask"), ("input_ids",))
    check_multi_turn_calls({"actor_gen": CallPlacement(gen, (0, 1), ParallelStrategy(dp=2))})
    for strategy in (ParallelStrategy(tp=2), ParallelStrategy(pp=2)):
        with pytest.raises(ConfigError, match="multi-turn rollouts need one process per dp rank"):
            check_multi_turn_calls({"actor_gen": CallPlacement(gen, (0, 1), strategy)})


def test_the_planner_places_multi_turn_generation_without_tensor_or_pipeline_parallelism():
    from rlflow.planner.model_spec import model_preset
    from rlflow.trainer import load_config
    from rlflow.trainer.build import build_dataflow
    from rlflow.trainer.placement import plan_placement, planning_workload

    lengths = ["rollout.multi_turn.max_prompt_tokens=24", "rollout.multi_turn.max_total_tokens=40"]
    cfg = load_config(None, ["placement.mode=heuristic", "placement.devices_per_node=8", *lengths])
    graph = build_dataflow(cfg, rule_reward=True)
    for multi_turn in (False, True):
        placement = plan_placement(
            cfg, graph, {"actor": model_preset("llama2-7b")}, use_gpu=True, progress=False, multi_turn=multi_turn
        )
        strategy = placement.calls["actor_gen"].strategy
        assert (strategy.tp == strategy.pp == 1) == multi_turn
    workload = planning_workload(cfg, multi_turn=True)  # priced at the rows' lengths
    assert (workload.prompt_len, workload.gen_len) == (24, 40)
    turns = ["rollout.max_new_tokens=8", "rollout.multi_turn.max_turns=3", "rollout.multi_turn.tool_seconds=0.5"]
    workload = planning_workload(load_config(None, [*lengths, *turns]), multi_turn=True)
    # 3 turns of 8 sampled tokens, the 16 tokens left as 2 observations of 8; each step 0.5 s
    assert (workload.turns, workload.turn_len, workload.observation_len, workload.tool_s) == (3, 8, 8, 0.5)
    assert workload.tool_threads == 8 and planning_workload(cfg).turns == 1


def test_the_tool_recipe_warms_up_on_tool_traces_then_rolls_out_tool_episodes(tmp_path):
    recipe = REPO / "recipes" / "grpo_tools_arithmetic.yaml"
    overrides = [
        *(o for o in TINY if not o.startswith(("rollout.multi_turn.", "rollout.max_new_tokens"))),
        "warmup.steps=2", "warmup.batch_size=4", "warmup.eval_every=2", "warmup.target_score=null", "trainer.total_steps=1",
        "trainer.eval_every=1", "trainer.max_wall_seconds=null", "checkpoint.every_n_steps=0",
        "checkpoint.save_final=false", "checkpoint.save_hf=false", "rollout.max_new_tokens=8", f"logging.dir={tmp_path}",
    ]  # fmt: skip
    with Trainer(recipe, overrides=overrides) as trainer:
        traces = trainer.data.warmup.dataset
        assert isinstance(traces, TraceDataset) and len(traces) > 0
        result = trainer.fit()
    # Each trace: the prompt and the tool's result out of the loss, the call and the answer in it.
    tok = build_char_tokenizer()
    item = traces[0]
    written = tok.decode([i for i, m in zip(item["input_ids"], item["loss_mask"]) if m], skip_special_tokens=True)
    assert written.startswith('<call>{"name": "multiply", "arguments": {"a": ') and "<result" not in written
    # The recipe lists no tool in the prompt (rollout.multi_turn.tool_listing: none): the traces teach the call.
    prompt = tok.decode(item["input_ids"][: item["loss_mask"].index(1)], skip_special_tokens=True)
    assert re.fullmatch(r"\d+\*\d+=\n", prompt)
    (metrics,) = _steps(tmp_path)
    assert "actor_gen/tools/calls" in metrics and metrics["actor_gen/multi_turn/turns"] >= 1.0
    # The held-out score with the tool: after the warm-up, and after GRPO.
    assert [step for step, _ in result.warmup_history] == [2] and result.score_after is not None


def test_the_tool_recipe_without_tools_is_the_control_warmed_up_on_the_answers(tmp_path):
    recipe = REPO / "recipes" / "grpo_tools_arithmetic.yaml"
    control = ["rollout.multi_turn.tools=[]", "warmup.tool_traces=null"]  # as docs/benchmarks.md runs it
    overrides = [*TINY_ACTOR, *DRIVER_FIT, "warmup.steps=1", "warmup.batch_size=4", f"logging.dir={tmp_path}"]
    with Trainer(recipe, overrides=[*overrides, *control]) as trainer:
        assert trainer.multi_turn is None and not isinstance(trainer.data.warmup.dataset, TraceDataset)


def test_episodes_scored_by_their_environment_alone(tmp_path):
    overrides = [*TINY, f"logging.dir={tmp_path}", "trainer.total_steps=1", "algorithm.reward_fn=environment"]
    rows = [{"prompt": f"{a}+{a}="} for a in range(10, 14)]  # no answers: nothing but the environment scores
    with Trainer(GRPO, overrides=overrides, environment=Calculator, train_dataset=rows) as trainer:
        trainer.fit()
    (metrics,) = _steps(tmp_path)
    assert metrics["reward_inf/score_mean"] == 1.0  # two steps of 0.5


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


def correct(prompts, completions, answer, **kwargs):
    """1.0 when a completion ends with its row's ``answer`` (TRL's reward-function signature)."""
    return [float(c.strip().endswith(a)) for c, a in zip(completions, answer)]


def test_the_trl_tool_calling_port_of_the_quickstart_runs(tmp_path):
    """docs/quickstart.md's port of a TRL tool-calling program: a model and tokenizer as objects, a
    dataset of dicts with an ``answer`` column, a reward function reading it, a typed tool."""
    from rlflow.data.tiny_models import build_tiny_model

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    rows = [{"prompt": f"What is {a}*{b}?", "answer": str(a * b)} for a in range(2, 6) for b in (3, 7)]
    config = {
        "algorithm": {"name": "grpo", "n_samples": 2},
        "data": {"batch_size": 2, "max_prompt_len": 16, "eval_size": 0},
        "rollout": {"max_new_tokens": 8, "multi_turn": {"max_turns": 2, "max_prompt_tokens": 640,
                                                        "max_total_tokens": 32}},
        "trainer": {"total_steps": 2, "eval_before_train": False, "eval_every": 0, "log_every": 1},
        "placement": {"devices_per_node": 1, "worker_host": "driver"},
        "logging": {"dir": str(tmp_path), "tensorboard": False, "console": False},
        "checkpoint": {"save_final": False},
    }  # fmt: skip
    with Trainer(config, model=model, tokenizer=tokenizer, reward_funcs=correct, train_dataset=rows,
                 tools=[multiply], progress_bars=False) as trainer:  # fmt: skip
        result = trainer.fit()
    assert result.steps == 2
    steps = _steps(tmp_path)
    assert len(steps) == 2
    for metrics in steps:
        assert metrics["actor_gen/multi_turn/turns"] >= 1.0 and "actor_gen/tools/calls" in metrics
        assert metrics["reward_inf/rewards/correct"] in (0.0, 0.25, 0.5, 0.75, 1.0)
