"""Issue 15 end to end on one CPU worker: a reward that raises on some samples no longer ends the
run under ``algorithm.reward_errors=zero``, and a run resumed from an earlier checkpoint than its
last logged step logs every step once in ``metrics.jsonl``."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from recipe_helpers import QUICK_FIT, TINY_ACTOR

from rlflow.trainer import Trainer, load_config

GRPO = Path(__file__).resolve().parents[2] / "recipes" / "grpo_arithmetic.yaml"
RUN = [*QUICK_FIT, *TINY_ACTOR, "algorithm.n_samples=2", "data.eval_size=2", "checkpoint.keep_last=0"]
pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def fit(run_dir: Path, *overrides: str, **inputs):
    trainer = Trainer(load_config(GRPO, [*RUN, f"logging.dir={run_dir}", *overrides]), progress_bars=False, **inputs)
    try:
        return trainer.fit()
    finally:
        trainer.close()


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def fails_on_odd_prompts(prompts, completions, **kwargs):
    """A reward function with a bug: it raises on a prompt of odd length (``3+45=``, not ``12+34=``)."""
    if any(len(p) % 2 for p in prompts):
        raise ValueError("cannot score a prompt of odd length")
    return [1.0] * len(completions)


def test_a_reward_error_under_zero_is_scored_and_counted_not_fatal(ray_session, tmp_path):
    result = fit(
        tmp_path,
        "trainer.total_steps=2",
        "algorithm.reward_fn=null",
        "algorithm.reward_errors=zero",
        reward_funcs=[fails_on_odd_prompts],
    )
    assert result.steps == 2
    steps = [r for r in records(tmp_path) if "reward_inf/reward_error_fraction" in r]
    assert [r["step"] for r in steps] == [1, 2]
    fractions = [r["reward_inf/reward_error_fraction"] for r in steps]
    assert max(fractions) > 0.0 and all(f < 1.0 for f in fractions), fractions  # some failed, others were scored
    scores = [r["reward_inf/score_mean"] for r in steps]
    assert scores == pytest.approx([1.0 - f for f in fractions])  # a failed sample scores 0, the others 1


def test_a_resumed_run_logs_each_step_once(ray_session, tmp_path):
    # The first run checkpoints at step 2 and logs step 3 before it ends without a final save, as
    # a run killed after step 3 would; the second resumes at step 2 and runs step 3 again.
    fit(tmp_path, "trainer.total_steps=3", "checkpoint.every_n_steps=2", "checkpoint.save_final=false")
    fit(tmp_path, "trainer.total_steps=3", "checkpoint.resume=auto")

    train_steps = Counter(r["step"] for r in records(tmp_path) if "actor_train/loss" in r)
    assert train_steps == Counter({1: 1, 2: 1, 3: 1})
