"""Runs from JSONL files instead of a synthetic task: prompts with answers for RL, preference pairs
for DPO, held-out prompts with answers for the evaluation; and what a run refuses to start with.

The files are written from the arithmetic task's problems, so the reward rule (``numeric_match``)
and the tokenizer are the task's; everything else comes from the files.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from recipe_helpers import TINY

from rlflow.data.datasets import DatasetFormatError
from rlflow.trainer import ConfigError, Trainer, load_config
from rlflow.trainer.data import preference_pairs, task_records

REPO = Path(__file__).resolve().parents[2]
GRPO = REPO / "recipes" / "grpo_arithmetic.yaml"
DPO = REPO / "recipes" / "dpo_arithmetic.yaml"
EVAL_SIZE = 8
FROM_FILES = ["data.task=null", "algorithm.reward_fn=numeric_match", f"data.eval_size={EVAL_SIZE}"]
TINY_DPO = [o for o in TINY if not o.startswith("algorithm.")] + ["trainer.eval_every=0"]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "_line"}) + "\n" for r in records))
    return path


@pytest.fixture
def task_files(tmp_path) -> dict[str, Path]:
    """``train.jsonl`` (prompt, answer), ``pairs.jsonl`` (prompt, chosen, rejected), ``eval.jsonl``."""
    cfg = load_config(GRPO)
    train = task_records(cfg, "train", 64)
    return {
        "train": write_jsonl(tmp_path / "train.jsonl", train),
        "pairs": write_jsonl(tmp_path / "pairs.jsonl", preference_pairs(train, seed=0)),
        "eval": write_jsonl(tmp_path / "eval.jsonl", task_records(cfg, "test", EVAL_SIZE)),
    }


def run(recipe: Path, overrides: list[str], tmp_path: Path):
    trainer = Trainer(load_config(recipe, [*overrides, f"logging.dir={tmp_path / 'run'}"]), progress_bars=False)
    try:
        return trainer.fit()
    finally:
        trainer.close()


def assert_scored_on_the_held_out_file(result) -> None:
    assert result.score_before is not None and result.score_after is not None
    assert [step for step, _ in result.eval_history][-1] == result.steps
    assert all(abs(score * EVAL_SIZE - round(score * EVAL_SIZE)) < 1e-6 for _, score in result.eval_history)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_grpo_trains_on_prompts_from_a_file_and_scores_the_held_out_file(ray_session, tmp_path, task_files):
    files = [f"data.train_file={task_files['train']}", f"data.eval_file={task_files['eval']}"]
    result = run(GRPO, [*TINY, *FROM_FILES, *files], tmp_path)
    assert result.steps == 1
    assert_scored_on_the_held_out_file(result)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_dpo_trains_on_pairs_from_a_file_and_its_policy_is_scored_on_held_out_prompts(
    ray_session, tmp_path, task_files
):
    files = [f"data.train_file={task_files['pairs']}", f"data.eval_file={task_files['eval']}"]
    result = run(DPO, [*TINY_DPO, *FROM_FILES, *files], tmp_path)
    assert result.steps == 1 and len(result.mfc_seconds["ref_inf"]) == 1
    assert_scored_on_the_held_out_file(result)


def test_dpo_on_the_task_is_scored_on_its_held_out_problems():
    from rlflow.data.tokenizer import build_char_tokenizer
    from rlflow.trainer.data import build_trainer_data

    data = build_trainer_data(load_config(DPO, ["data.eval_size=16"]), build_char_tokenizer())
    assert data.eval_prompts is not None and len(data.eval_prompts) == 16 and data.reward_fn == "numeric_match"
    assert len(data.train.dataset) == 4096 and next(iter(data.train)).batch["input_ids"].shape[0] == 2 * 64


def test_a_training_file_without_a_held_out_file_runs_without_a_held_out_score(task_files, caplog):
    caplog.set_level(logging.INFO, logger="rlflow")
    from rlflow.data.tokenizer import build_char_tokenizer
    from rlflow.trainer.data import build_trainer_data

    files = ["algorithm.reward_fn=numeric_match", f"data.train_file={task_files['train']}"]
    cfg = load_config(None, files)  # data.task follows the train file: none
    assert cfg.data.task is None and cfg.data.eval_file is None and cfg.data.eval_size > 0
    data = build_trainer_data(cfg, build_char_tokenizer())
    assert data.eval_prompts is None
    assert caplog.text.count("no held-out evaluation") == 1
    # A warm-up that evaluates has nothing to evaluate on: refused, naming why.
    with pytest.raises(ConfigError, match="no held-out data"):
        load_config(None, [*files, "warmup.steps=2", "warmup.eval_every=1"])
    # A reward model is scored on pairs by its recipe, not on generations: no held-out prompts needed.
    rm = load_config(
        REPO / "recipes" / "rm_arithmetic.yaml", ["data.task=null", f"data.train_file={task_files['pairs']}"]
    )
    assert rm.data.eval_file is None


def test_a_held_out_line_without_an_answer_names_the_file_and_line(tmp_path, task_files):
    from rlflow.data.tokenizer import build_char_tokenizer
    from rlflow.trainer.data import build_trainer_data

    bad = tmp_path / "bad_eval.jsonl"
    bad.write_text('{"prompt": "1+2=", "answer": "3"}\n{"prompt": "2+2="}\n')
    files = [f"data.train_file={task_files['train']}", f"data.eval_file={bad}", "data.eval_size=2"]
    with pytest.raises(
        DatasetFormatError, match=rf"{bad}:2: reward 'numeric_match' needs a ground truth: give the row an 'answer'"
    ):
        build_trainer_data(load_config(GRPO, [*FROM_FILES, *files]), build_char_tokenizer())
