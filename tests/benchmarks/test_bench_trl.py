"""The pure parts of the rlflow-vs-TRL benchmark: both sides' settings, the reward, the figures.

TRL itself is not installed here (the benchmark makes a venv of its own); these tests check
what decides whether the comparison is fair and its figures right.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from benchmarks import bench_trl
from benchmarks.grpo_tasks import TASKS, percentile, rlflow_config, smooth, summarize
from benchmarks.trl_grpo import grpo_config_kwargs, numeric_match, reward_numeric_match
from rlflow.data.tasks import ArithmeticTask
from rlflow.trainer.config import load_config
from rlflow.workers.rewards import numeric_match_reward

# ----------------------------------------------------------------------------- the reward

_EDGE_CASES = [
    "64",
    " 64",
    "64 ",
    "6 4",
    "640",
    "-64",
    "+64",
    "64.0",
    "64.5",
    "46",
    "",
    "abc",
    "=",
    "12+34=64",
    "answer: 64 and 12",
    "ANSWER:64",
    "#### 64",
    "<answer>64</answer> 5",
    "<answer>x</answer> 64",
    "\\boxed{64} 7",
    "1,234",
    "4,321",
    "64\n",
    "0064",
    "..64..",
]


@pytest.mark.parametrize("reverse", [True, False])
@pytest.mark.parametrize("answer", ["46", "-46", "0", "4321", "100"])
def test_numeric_match_agrees_with_rlflow_on_edge_cases(answer, reverse):
    truth = {"answer": answer, "reverse_digits": reverse}
    for response in _EDGE_CASES + [answer, answer[::-1], f" {answer[::-1]}"]:
        assert numeric_match(response, truth) == numeric_match_reward("", response, truth), response


def test_numeric_match_agrees_with_rlflow_on_random_responses():
    """Strings of the characters a tiny model writes on this task, against the task's own ground truths."""
    rng = random.Random(0)
    alphabet = "0123456789+-=., ab<>/#:\n"
    examples = ArithmeticTask(2, ("+",), reverse_answer=True).sample("train", 50, seed=1)
    matches = 0
    for example in examples:
        responses = [example.answer, example.answer + "7", " " + example.answer]
        responses += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))) for _ in range(40)]
        for response in responses:
            ours = numeric_match(response, example.ground_truth)
            assert ours == numeric_match_reward(example.prompt, response, example.ground_truth), response
            matches += ours == 1.0
    assert matches >= len(examples)  # the right answers scored 1, so the test saw both outcomes


def test_trl_reward_function_reads_json_ground_truths():
    truths = [json.dumps({"answer": "46", "reverse_digits": True})] * 3
    assert reward_numeric_match(["12+34="] * 3, ["64", "46", "x"], ground_truth=truths, trainer_state=None) == [
        1.0,
        0.0,
        0.0,
    ]


# ----------------------------------------------------------------------------- the settings


@pytest.mark.parametrize("task", sorted(TASKS))
def test_both_sides_get_the_same_settings(task, tmp_path):
    spec = {**TASKS[task], "name": task, "model_dir": str(tmp_path / "model"), "steps": 7}
    trl = grpo_config_kwargs(spec, str(tmp_path / "trl"))
    cfg = load_config(rlflow_config(spec, str(tmp_path / "run")))
    assert trl["per_device_train_batch_size"] == cfg.data.batch_size * cfg.algorithm.n_samples
    assert trl["num_generations"] == cfg.algorithm.n_samples == spec["n_samples"]
    assert trl["max_completion_length"] == cfg.rollout.max_new_tokens == cfg.data.max_response_len
    assert trl["temperature"] == cfg.rollout.temperature == 1.0
    assert trl["top_k"] == cfg.rollout.top_k == 0 and trl["top_p"] == cfg.rollout.top_p == 1.0
    assert trl["learning_rate"] == cfg.models["actor"].lr == spec["lr"]
    assert trl["lr_scheduler_type"] == cfg.models["actor"].lr_schedule == "constant"
    assert trl["weight_decay"] == cfg.models["actor"].weight_decay == 0.0
    assert trl["max_grad_norm"] == cfg.models["actor"].grad_clip
    assert (trl["epsilon"], trl["epsilon_high"]) == (cfg.algorithm.clip_ratio_low, cfg.algorithm.clip_ratio_high)
    assert trl["beta"] == cfg.algorithm.kl_coef == 0.0
    # one update per generated batch: TRL's iterations/steps per generation, rlflow's epochs/minibatches
    assert trl["num_iterations"] == cfg.algorithm.ppo_epochs == 1
    assert trl["steps_per_generation"] == trl["gradient_accumulation_steps"] == cfg.algorithm.n_minibatches == 1
    # DAPO's token-level mean over the batch and std-scaled group advantages are rlflow's token-mean GRPO
    assert (trl["loss_type"], cfg.algorithm.loss_agg_mode) == ("dapo", "token-mean")
    assert trl["scale_rewards"] == "group" and cfg.algorithm.norm_adv_by_std
    assert trl["max_steps"] == cfg.trainer.total_steps == 7
    assert trl["seed"] == cfg.seed
    assert not (trl["bf16"] or trl["fp16"] or trl["use_vllm"]) and trl["use_cpu"]
    assert trl["save_strategy"] == "no" and trl["report_to"] == "none"
    # both sides keep the EOS out of the same number of first tokens (the compute task: all of them)
    assert (trl["generation_kwargs"] or {}).get("min_new_tokens", 0) == cfg.rollout.min_new_tokens
    assert cfg.rollout.min_new_tokens == spec.get("min_new_tokens", 0)
    assert grpo_config_kwargs({**spec, "precision": "bf16"}, str(tmp_path / "trl"))["bf16"]


def test_rlflow_side_reads_the_shared_model_and_task(tmp_path):
    spec = {**TASKS["main"], "name": "main", "model_dir": str(tmp_path / "model")}
    cfg = load_config(rlflow_config(spec, str(tmp_path / "run")))
    actor = cfg.models["actor"]
    assert (actor.init, actor.path, cfg.data.tokenizer) == ("path", str(tmp_path / "model"), str(tmp_path / "model"))
    assert list(cfg.models) == ["actor"]
    assert (cfg.data.task, cfg.data.num_digits, cfg.data.ops, cfg.data.reverse_answer) == ("arithmetic", 2, ["+"], True)
    assert cfg.algorithm.reward_fn == "numeric_match"
    assert cfg.warmup.steps == 0 and cfg.data.eval_size == 0 and not cfg.trainer.eval_before_train
    assert cfg.placement.devices_per_node == 2
    assert cfg.placement.mode == load_config({}).placement.mode  # the default placement otherwise


def test_main_task_matches_the_main_jobs_grpo_part():
    recipe = load_config("recipes/grpo_arithmetic.yaml")
    main, actor = TASKS["main"], recipe.models["actor"]
    assert (main["hidden_size"], main["num_layers"], main["num_heads"], main["num_kv_heads"]) == (
        actor.hidden_size,
        actor.num_layers,
        actor.num_heads,
        actor.num_kv_heads,
    )
    assert (main["intermediate_size"], main["tie_word_embeddings"]) == (
        actor.intermediate_size,
        actor.tie_word_embeddings,
    )
    assert (main["num_prompts"], main["n_samples"], main["max_new_tokens"]) == (
        recipe.data.batch_size,
        recipe.algorithm.n_samples,
        recipe.data.max_response_len,
    )
    assert (main["lr"], main["clip_low"], main["clip_high"]) == (
        actor.lr,
        recipe.algorithm.clip_ratio_low,
        recipe.algorithm.clip_ratio_high,
    )


def test_policy_lag_refusal_names_the_configs_error(monkeypatch):
    monkeypatch.setattr(bench_trl, "rlflow_config", lambda spec, run_dir, policy_lag: {"algorithm": {"lag_x": 1}})
    refusal = bench_trl.policy_lag_refusal({})
    assert refusal is not None and "lag_x" in refusal
    variants, notes = bench_trl._variants({}, [1, 2])
    assert [(label, threads, extra) for label, _, threads, extra in variants] == [
        ("trl_1thread", 1, {"precision": "fp32"}),
        ("rlflow", 1, {}),
        ("trl_2threads", 2, {"precision": "fp32"}),
        ("trl_1thread_bf16", 1, {"precision": "bf16"}),
        ("trl_2threads_bf16", 2, {"precision": "bf16"}),
        ("rlflow_again", 1, {}),
    ]
    assert len(notes) == 1 and "rlflow_lag1 skipped" in notes[0] and "lag_x" in notes[0]
    variants, notes = bench_trl._variants({}, [1], ["bf16"])
    assert [label for label, *_ in variants] == ["trl_1thread_bf16", "rlflow", "rlflow_again"]
    assert "not with 1 and 2" in notes[0] and "not in fp32 and bf16" in notes[1]


def test_env_settings_are_checked(monkeypatch):
    monkeypatch.setenv("RLFLOW_BENCH_TRL_TASKS", "tiny,nope")
    with pytest.raises(ValueError, match="RLFLOW_BENCH_TRL_TASKS"):
        bench_trl._env_tasks()
    monkeypatch.setenv("RLFLOW_BENCH_TRL_TINY_STEPS", "1")
    with pytest.raises(ValueError, match="RLFLOW_BENCH_TRL_TINY_STEPS=1 must be >= 2"):
        bench_trl._env_int("RLFLOW_BENCH_TRL_TINY_STEPS", 150, minimum=2)
    monkeypatch.setenv("RLFLOW_BENCH_TRL_THREADS", "1,x")
    with pytest.raises(ValueError, match="RLFLOW_BENCH_TRL_THREADS='1,x'"):
        bench_trl._env_trl_threads()
    monkeypatch.setenv("RLFLOW_BENCH_TRL_PRECISIONS", "fp32,fp16")
    with pytest.raises(ValueError, match="RLFLOW_BENCH_TRL_PRECISIONS='fp32,fp16'"):
        bench_trl._env_trl_precisions()
    monkeypatch.setenv("RLFLOW_BENCH_TRL_WARM_START_STEPS", "-1")
    with pytest.raises(ValueError, match="RLFLOW_BENCH_TRL_WARM_START_STEPS=-1 must be >= 0"):
        bench_trl._env_int("RLFLOW_BENCH_TRL_WARM_START_STEPS", 0, minimum=0)
    monkeypatch.setenv("RLFLOW_BENCH_TRL_REPEATS", "two")
    with pytest.raises(ValueError, match="RLFLOW_BENCH_TRL_REPEATS='two'"):
        bench_trl._env_int("RLFLOW_BENCH_TRL_REPEATS", 1)


# ----------------------------------------------------------------------------- the figures


def _events(ends: list[float], rewards: list[float] | None = None, completions: int = 16) -> list[dict]:
    rewards = rewards or [0.0] * len(ends)
    steps = [
        {"event": "step", "step": i + 1, "t_end": t, "reward": r, "completions": completions}
        for i, (t, r) in enumerate(zip(ends, rewards))
    ]
    return [{"event": "versions"}, {"event": "train_begin", "t": ends[0] - 1.0}, *steps, {"event": "done"}]


def test_summarize_excludes_the_first_step_and_times_from_spawn():
    ends = [105.0, 105.5, 106.5, 107.0, 107.5]  # step 1 took long (warm-up); then 0.5, 1.0, 0.5, 0.5 s
    figures = summarize(_events(ends, [0.0, 0.5, 0.5, 1.0, 1.0]), spawned_at=100.0)
    assert figures["steps"] == 5
    assert figures["completions_per_s"] == pytest.approx(4 * 16 / 2.5)
    assert figures["step_s_median"] == 0.5
    assert figures["step_s_p90"] == pytest.approx(np.percentile([0.5, 1.0, 0.5, 0.5], 90))
    assert figures["startup_first_step_done_s"] == 5.0
    assert figures["startup_first_step_start_s"] == 4.0
    assert figures["samples"] == [16, 32, 48, 64, 80]
    assert figures["rewards"] == [0.0, 0.5, 0.5, 1.0, 1.0]


def test_summarize_refuses_too_few_or_disordered_steps():
    with pytest.raises(ValueError, match="at least 2"):
        summarize(_events([1.0]), spawned_at=0.0)
    events = _events([1.0, 2.0, 3.0])
    events[2]["step"], events[3]["step"] = 2, 1
    with pytest.raises(ValueError, match="out of order"):
        summarize(events, spawned_at=0.0)


def test_percentile_is_numpys_linear_percentile():
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 37):
        values = rng.random(n).tolist()
        for q in (0, 10, 50, 90, 100):
            assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    with pytest.raises(ValueError, match="q=101"):
        percentile([1.0], 101)


def test_smooth_is_a_trailing_mean():
    values = np.random.default_rng(1).random(30).tolist()
    for window in (1, 4, 30, 50):
        expected = [np.mean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]
        assert smooth(values, window) == pytest.approx(expected)
    with pytest.raises(ValueError, match="window=0"):
        smooth(values, 0)


def _run(cps: float, first: float, rewards: list[float]) -> dict:
    return {
        "completions_per_s": cps,
        "startup_first_step_done_s": first,
        "rewards": rewards,
        "samples": [16 * (i + 1) for i in range(len(rewards))],
        "versions": {},
        "load_average_1m_before": 1.0,
        "load_average_1m_after": 1.5,
    }


def test_task_record_compares_rlflow_with_trls_faster_thread_count(tmp_path):
    runs = {
        "trl_1thread": [_run(80.0, 11.0, [0.0] * 8), _run(90.0, 12.0, [0.0] * 8)],
        "trl_2threads": [_run(100.0, 10.0, [0.0] * 8), _run(96.0, 10.0, [0.0] * 8)],
        "rlflow": [_run(196.0, 20.0, [0.0] * 6 + [1.0, 1.0]), _run(200.0, 22.0, [0.0] * 8)],
    }
    record = bench_trl.task_record("tiny", {**TASKS["tiny"]}, runs, ["a note"], str(tmp_path / "p.png"))
    assert record["trl_best"] == "trl_2threads"
    assert record["ratio_rlflow"] == pytest.approx(198.0 / 98.0, abs=1e-3)
    assert record["startup_gap_s_rlflow"] == 11.0
    assert record["reward_last_quarter"]["rlflow"] == 0.5  # median of 1.0 and 0.0
    assert record["load_average_1m"] == [1.0, 1.5] and record["notes"] == ["a note"]
    bench_trl.plot_rewards("tiny", runs, tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_warm_start_learns_the_answers_and_is_reproducible():
    from rlflow.data.tiny_models import build_tiny_model
    from rlflow.data.tokenizer import build_char_tokenizer

    tokenizer, task = build_char_tokenizer(), ArithmeticTask(2, ("+",), reverse_answer=True)

    def trained() -> tuple[list[float], dict]:
        model = build_tiny_model(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2)
        losses = bench_trl.warm_start(model, tokenizer, task, steps=25, seed=0, batch_size=16)
        return losses, model.state_dict()

    (losses, weights), (again, weights_again) = trained(), trained()
    assert len(losses) == 25 and losses[-1] < 0.8 * losses[0]  # 4.6 (about ln(vocab)) -> 3.5 when written
    assert losses == again and all(np.array_equal(weights[k], weights_again[k]) for k in weights)


def test_limits_record_prices_the_calls_of_a_fixed_length_task(tmp_path):
    config = {
        "hidden_size": 8, "num_hidden_layers": 2, "intermediate_size": 16, "vocab_size": 10,
        "num_attention_heads": 2, "num_key_value_heads": 1, "tie_word_embeddings": True,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = {**TASKS["compute"], "model_dir": str(tmp_path), "num_prompts": 1, "n_samples": 2, "max_prompt_len": 4}
    spec.update(max_new_tokens=6, min_new_tokens=6)
    figures = {
        "call_s_median": {"actor_gen": 0.5, "actor_train": 2.0, "reward_inf": 0.1},
        "plan": {"calls": {"actor_gen": "(dp=2,tp=1,pp=1)"}},
        "precision": {"actor": "bfloat16"},
    }
    peaks = {
        "matmul_flops_fp32": 1e9, "matmul_flops_bf16": 4e9, "copy_bytes_per_s_1thread": 1e9,
        "copy_bytes_per_s_2threads": 2e9,
    }  # fmt: skip
    record = bench_trl.limits_record("compute", spec, figures, peaks)
    n = 2 * (2 * 8 * 8 + 2 * 8 * 4 + 3 * 8 * 16) + 10 * 8  # layers' projections (kv width 4) + LM head
    tokens = 2 * (4 + 6)
    train = record["calls"]["actor_train"]
    assert train["gflop"] == round(6 * n * tokens / 1e9, 1)
    assert train["share_of_matmul_peak_2threads"] == round(6 * n * tokens / 2.0 / 4e9, 3)  # the bf16 peak
    gen = record["calls"]["actor_gen"]
    weights, cache = n * 2 * 2, 2 * 2 * 4 * 2 * 2 * (4 + 3)  # two dp workers' bf16 weights; K and V at context 7
    assert gen["decode_bytes_per_step"] == weights + cache and gen["decode_step_ms"] == round(0.5 / 6 * 1e3, 3)
    per_s = (weights + cache) / (0.5 / 6)
    assert gen["share_of_copy_bandwidth_1thread"] == round(per_s / 1e9, 3)
    assert gen["share_of_copy_bandwidth_2threads"] == round(per_s / 2e9, 3)
    assert record["peaks"]["copy_gb_per_s_2threads"] == 2.0
    assert "reward_inf" not in record["calls"] and record["peaks"]["matmul_gflop_per_s_2threads"]["bf16"] == 4.0
    # at the limits: training's matmuls and the prefill at the bf16 peak, each decode step the longer of
    # its matmuls at the peak and one copy of the weights and the cache at two threads' bandwidth
    decode_step = max(2 * n * 2 / 4e9, (n * 2 + cache) / 2e9)
    limit = 6 * n * tokens / 4e9 + 2 * n * 2 * 4 / 4e9 + 6 * decode_step
    assert record["at_limits"] == {"step_s": round(limit, 3)}  # the figures give no completions/s
    record = bench_trl.limits_record(
        "compute", spec, {**figures, "completions_per_s": 0.8}, peaks, trl_completions_per_s=0.5
    )
    assert record["at_limits"] == {
        "step_s": round(limit, 3), "rlflow_step_s": 2.5, "share_of_rlflow_step": round(limit / 2.5, 3),
        "trl_step_s": 4.0, "max_ratio_to_trl": round(4.0 / limit, 2),
    }  # fmt: skip
    # limits ten thousand times lower: a step of seconds, priced to the millisecond
    slow = {key: value / 1e4 for key, value in peaks.items()}
    assert round(limit * 1e4, 3) > 0.1
    assert bench_trl.limits_record("compute", spec, figures, slow)["at_limits"] == {"step_s": round(limit * 1e4, 3)}
    # lengths that vary (an EOS may end a response early) are not priced
    assert bench_trl.limits_record("compute", {**spec, "min_new_tokens": 0}, figures, peaks) is None
