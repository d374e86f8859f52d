"""Partial rollouts in the driver (``rollout.partial_tokens``): which groups a step trains on, which
stale ones are dropped, what a checkpoint keeps; and real runs — a run whose responses fit in one
call trains exactly as without partial rollouts, and a run carrying responses over steps learns."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rlflow.engine.rollout import SamplingParams
from rlflow.engine.rollout.partial import TOKEN_VERSION, append_tokens
from rlflow.protocol import DataProto
from rlflow.trainer import ConfigError, Trainer, load_config
from rlflow.trainer.partial_rollouts import PartialRollouts
from rlflow.trainer.runner import Submitted
from rlflow.workers.interfaces.actor import POLICY_VERSION, row_versions

# --- The driver's buffers, against a scripted generate call ---

GEN, REWARD = "actor_gen", "reward_inf"
WIDTH, LIMIT, SAMPLES, GROUPS = 2, 3, 2, 2  # prompt width, max_new_tokens, n, data.batch_size


class ScriptedRunner:
    """Stands in for the runner: a generate call adds one token to every row (a response ends after
    LIMIT tokens), sampled by the weights ``version``; the other calls record the rows they get."""

    def __init__(self) -> None:
        self.version = 0
        self.trained: dict[int, list[str]] = {}
        generate, reward = SimpleNamespace(interface_type="generate"), SimpleNamespace(interface_type="inference")
        self.placements = {GEN: SimpleNamespace(mfc=generate), REWARD: SimpleNamespace(mfc=reward)}

    def submit(self, rows, mfcs, call_kwargs=None, *, step, upstream=None):
        if mfcs == [GEN]:
            return self._generate(rows, **call_kwargs[GEN])
        self.trained[step] = list(dict.fromkeys(rows.non_tensor_batch["uid"].tolist()))
        return Submitted(dict(upstream.outputs))

    def wait(self, submitted, fetch=()):
        return {GEN: submitted}

    def _generate(self, rows: DataProto, partial_tokens: int, resume: bool) -> DataProto:
        if resume:
            out = {k: rows.batch[k].clone() for k in ("input_ids", "attention_mask", "response_mask", "old_logp")}
            out[TOKEN_VERSION] = rows.batch[TOKEN_VERSION].clone()
        else:
            rows = rows.repeat(SAMPLES)
            num = len(rows)
            zeros = torch.zeros(num, LIMIT, dtype=torch.long)
            out = {
                "input_ids": torch.cat([rows.batch["prompts"], zeros], dim=1),
                "attention_mask": torch.cat([rows.batch["prompt_mask"], zeros], dim=1),
                "response_mask": torch.zeros(num, WIDTH + LIMIT, dtype=torch.long),
                "old_logp": torch.zeros(num, WIDTH + LIMIT),
                TOKEN_VERSION: torch.zeros(num, WIDTH + LIMIT, dtype=torch.long),
            }
        ones = torch.ones(len(rows), partial_tokens, dtype=torch.long)
        append_tokens(out, WIDTH, 5 * ones, ones, -0.5 * ones.float(), self.version)
        data = DataProto.from_dict(out, {"uid": rows.non_tensor_batch["uid"]})
        data.non_tensor_batch[POLICY_VERSION] = row_versions(data, self.version)
        return data


def prompt_batches():
    index = 0
    while True:
        prompts = torch.full((GROUPS, WIDTH), 7)
        uids = np.arange(index, index + GROUPS)
        index += GROUPS
        yield DataProto.from_dict({"prompts": prompts, "prompt_mask": torch.ones_like(prompts)}, {"uid": uids})


def partial(runner: ScriptedRunner, max_tokens: int = 1) -> PartialRollouts:
    sampling = SamplingParams(n=SAMPLES, max_new_tokens=LIMIT, stop_token_ids=(2,))
    return PartialRollouts(runner, [GEN, REWARD], GROUPS, sampling, max_tokens=max_tokens, max_lag=1)


def run_step(sampler: PartialRollouts, runner: ScriptedRunner, step: int, batches) -> list[str]:
    runner.version = step - 1  # the weights after step - 1 train steps
    batch, submitted = sampler.sample(step, batches)
    assert submitted.outputs[GEN] is batch and len(batch) == GROUPS * SAMPLES
    uids = batch.non_tensor_batch["uid"].tolist()
    assert uids == [u for u in runner.trained[step] for _ in range(SAMPLES)]  # each group's rows together
    return runner.trained[step]


def test_steps_train_on_finished_groups_oldest_first_and_drop_the_stale_ones(tmp_path):
    """Responses of 3 tokens, one token per call, 2 groups a step, groups at most 1 version stale.
    Step 1 (v0) runs 3 rounds, taking in 2 fresh groups each: the first two finish. Step 2 (v1)
    finishes the second pair (tokens v0, v0, v1). Step 3 (v2): the third pair would train on
    v0 tokens, 2 versions behind: dropped; the fourth (v1, v2, v2) finishes in a second round."""
    runner, batches = ScriptedRunner(), prompt_batches()
    sampler = partial(runner)
    assert run_step(sampler, runner, 1, batches) == ["0@0", "1@1"]
    assert sampler.metrics[1] == {
        "partial/rounds": 3.0, "partial/groups_dropped": 0.0, "partial/carried_responses": 8.0,
        "partial/waiting_groups": 0.0,
    }  # fmt: skip
    assert run_step(sampler, runner, 2, batches) == ["2@2", "3@3"]
    # A checkpoint here: a sampler built afresh and given the saved buffers goes on the same way.
    state = sampler.save(tmp_path / "partial")
    resumed = partial(runner)
    resumed.load(tmp_path / "partial", json.loads(json.dumps(state)))
    resumed_batches = prompt_batches()
    for _ in range(4):  # the dataset batches the interrupted run drew (the loader's state does this)
        next(resumed_batches)
    for name, (sampler_, batches_) in {"whole": (sampler, batches), "resumed": (resumed, resumed_batches)}.items():
        assert run_step(sampler_, runner, 3, batches_) == ["6@6", "7@7"], name
        assert sampler_.metrics[3]["partial/groups_dropped"] == 2.0 and sampler_.metrics[3]["partial/rounds"] == 2.0


def test_finished_groups_that_waited_too_long_are_dropped_even_without_a_round():
    """Whole responses in one call; two extra finished groups sampled at step 1 wait. Step 2 needs
    no round (nothing carried, enough groups finished) and trains on them (lag 1); had they waited
    to step 3 (lag 2), they would be dropped before training and fresh groups sampled instead."""
    for train_at, expected, dropped in ((2, ["2@2", "3@3"], 0.0), (3, ["4@4", "5@5"], 2.0)):
        runner, batches = ScriptedRunner(), prompt_batches()
        sampler = partial(runner, max_tokens=LIMIT)
        assert run_step(sampler, runner, 1, batches) == ["0@0", "1@1"]
        extra, _ = sampler.sample(1, batches)  # two more groups, finished at version 0, put back to wait
        sampler.done = extra
        assert run_step(sampler, runner, train_at, batches) == expected
        assert sampler.metrics[train_at]["partial/groups_dropped"] == dropped
        assert sampler.metrics[train_at]["partial/rounds"] == (0.0 if train_at == 2 else 1.0)


# --- Where partial rollouts cannot run ---


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        (["rollout.engine=vllm"], "built-in sampler"),
        (["algorithm.name=remax"], "2 generate calls"),
        (["algorithm.name=dpo", "models.ref.init=copy", "models.ref.init_from=actor"], "samples no responses"),
        (["algorithm.policy_lag=1"], "policy_lag=1"),
        (["algorithm.dynamic_sampling=true"], "dynamic_sampling"),
        (["rollout.min_new_tokens=3"], "min_new_tokens=3"),
        (["algorithm.recompute_old_logp=true", "algorithm.tis_cap=2.0"], "tis_cap"),
        (["rollout.multi_turn.tools=[calculator]"], "multi_turn"),
    ],
)
def test_settings_partial_rollouts_cannot_run_are_refused_naming_the_field(overrides, problem):
    with pytest.raises(ConfigError, match=problem) as err:
        load_config(None, ["rollout.partial_tokens=2", *overrides])
    assert err.value.key == "rollout.partial_tokens"


# --- Real runs (one worker in the driver) ---

RUN = {
    "experiment_name": "partial",
    "algorithm": {"name": "grpo", "n_samples": 4, "entropy_coef": 0.0},
    "data": {"batch_size": 4, "max_prompt_len": 8, "eval_size": 8},
    "rollout": {"max_new_tokens": 6},
    "models": {"actor": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "lr": 1e-2}},
    "warmup": {"steps": 0},
    "trainer": {"total_steps": 2, "log_every": 1, "eval_before_train": False, "eval_every": 0},
    "placement": {"worker_host": "driver", "mode": "heuristic", "profile": False},
    "logging": {"tensorboard": False, "console": False},
    "checkpoint": {"save_final": True},
}


def digit_share(completions, **kwargs):
    """The share of a response's characters that are digits (the task's answers are digits)."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def fit(run_dir: Path, **sections) -> dict[int, dict]:
    config = {**RUN, **{k: {**RUN[k], **v} for k, v in sections.items()}, "logging": {**RUN["logging"]}}
    config["logging"]["dir"] = str(run_dir)
    with Trainer(config, reward_funcs=[digit_share], progress_bars=False) as trainer:
        trainer.fit()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "actor_train/loss" in r}


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "final" / "actor" / "model.safetensors")


def test_responses_that_fit_in_one_call_train_as_without_partial_rollouts(tmp_path):
    """partial_tokens >= max_new_tokens: every response ends in its first call, so each step samples
    what the synchronous run samples and trains on the same rows (the loss kept plain PPO to compare)."""
    plain = fit(tmp_path / "plain", rollout={"partial_tokens": 0})  # off: the synchronous run
    partial_run = fit(tmp_path / "partial", rollout={"partial_tokens": 6}, algorithm={"behaviour_correction": "none"})
    want, got = final_weights(tmp_path / "plain"), final_weights(tmp_path / "partial")
    assert all(torch.equal(want[k], got[k]) for k in want)
    for step in (1, 2):
        assert partial_run[step]["actor_train/loss"] == plain[step]["actor_train/loss"]
        assert partial_run[step]["partial/rounds"] == 1 and partial_run[step]["actor_train/token_lag_max"] == 0
        assert not any(k.startswith("partial/") or "token_lag" in k for k in plain[step])


def test_grpo_with_responses_carried_over_steps_learns_on_the_tasks_prompts(tmp_path):
    """The arithmetic task's prompts, 6-token responses sampled 2 tokens a call (3 calls each, so
    most responses span steps), groups at most 1 version stale, the reward the share of digits in a
    response: the untrained policy writes few digits (about 0.1); twelve steps lift that near 1.
    A run resumed from the checkpoint at step 6 continues the responses it carried and ends where
    the whole run does."""
    learning = {
        "rollout": {"partial_tokens": 2, "partial_max_lag": 1},
        "trainer": {"total_steps": 12},
        "models": {"actor": {**RUN["models"]["actor"], "lr": 3e-2}},
    }
    steps = fit(tmp_path / "whole", **learning, checkpoint={"every_n_steps": 6, "keep_last": 0})
    checkpoint = tmp_path / "whole" / "checkpoints" / "step_6"
    assert (checkpoint / "partial_rollouts" / "carried.safetensors").is_file()
    resumed = fit(tmp_path / "resumed", **learning, checkpoint={"resume": str(checkpoint)})
    assert sorted(resumed) == list(range(7, 13))
    for step in resumed:
        for key in ("actor_train/score_mean", "actor_train/loss", "partial/groups_dropped"):
            assert resumed[step][key] == pytest.approx(steps[step][key], rel=1e-6, abs=1e-9), (step, key)
    want, got = final_weights(tmp_path / "whole"), final_weights(tmp_path / "resumed")
    assert max(float((want[k] - got[k]).abs().max()) for k in want) <= 1e-6
    score = [steps[s]["actor_train/score_mean"] for s in range(1, 13)]
    assert np.mean(score[:3]) < 0.25 and np.mean(score[-3:]) > 0.8, score
    for step in range(2, 13):
        record = steps[step]
        # Trained tokens come from this step's and the previous step's weights, never older; the
        # groups that would have trained on older ones were dropped and counted.
        assert record["actor_train/token_lag_max"] == 1 and record["actor_train/policy_lag_max"] == 1
        assert 0 < record["actor_train/stale_token_fraction"] < 1
        assert "actor_train/is_weight_mean" in record  # the decoupled correction, per token
    assert sum(steps[s]["partial/groups_dropped"] for s in steps) > 0


def test_a_run_without_partial_rollouts_resuming_one_that_had_them_says_it_drops_their_rows(tmp_path, caplog):
    carried = {
        "rollout": {"partial_tokens": 2, "partial_max_lag": 1},
        "checkpoint": {"every_n_steps": 1, "keep_last": 0},
    }
    fit(tmp_path / "partial", **carried)
    checkpoint = tmp_path / "partial" / "checkpoints" / "step_1"
    assert any((checkpoint / "partial_rollouts").glob("*.safetensors"))
    caplog.set_level(logging.WARNING, logger="rlflow")
    steps = fit(tmp_path / "plain", rollout={"partial_tokens": 0}, checkpoint={"resume": str(checkpoint)})
    assert sorted(steps) == [2]
    assert "holds the rows of partial rollouts" in caplog.text and "rollout.partial_tokens=0" in caplog.text
