"""Every input is validated at load (issue 15): each row holds what the algorithm and its reward
read, and every failure names the file and line — before Ray or a worker starts.

Before: a GRPO line without ``answer`` was accepted and failed at step 1 inside the reward on a
worker, with no file or line; a non-UTF-8 byte raised a bare ``UnicodeDecodeError``; an empty
file was reported as a batch-size problem.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from recipe_helpers import TINY

from rlflow.data.datasets import DatasetFormatError, PromptDataset
from rlflow.data.files import read_records
from rlflow.data.tokenizer import build_char_tokenizer
from rlflow.trainer import Trainer, load_config
from rlflow.trainer.data import build_trainer_data, check_rows, prompts_to_proto
from rlflow.workers.reward_funcs import pack_reward_funcs

GRPO = Path(__file__).resolve().parents[2] / "recipes" / "grpo_arithmetic.yaml"
FROM_FILES = ["data.task=null", "algorithm.reward_fn=numeric_match", "data.batch_size=2", "data.eval_size=2"]
ROWS = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(1, 5)]


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def load(train: Path, eval_file: Path | None = None, *extra: str):
    files = [f"data.train_file={train}", f"data.eval_file={eval_file or train}"]
    return build_trainer_data(load_config(GRPO, [*FROM_FILES, *files, *extra]), build_char_tokenizer())


# ------------------------------------------------------------------ the reward's ground truth
def test_a_grpo_line_without_an_answer_is_refused_at_construction_naming_file_and_line(tmp_path):
    train = write(tmp_path / "train.jsonl", [*ROWS[:2], {"prompt": "3+3="}, *ROWS[3:]])
    files = [f"data.train_file={train}", f"data.eval_file={train}", f"logging.dir={tmp_path / 'run'}"]
    cfg = load_config(GRPO, [*TINY, *FROM_FILES, *files])
    message = f"{train}:3: reward 'numeric_match' needs a ground truth: give the row an 'answer' (or 'ground_truth')"
    with pytest.raises(DatasetFormatError, match=re.escape(message)):
        Trainer(cfg, progress_bars=False)  # construction only: no Ray, no worker


def test_a_ground_truth_the_rule_cannot_parse_names_file_and_line(tmp_path):
    train = write(tmp_path / "train.jsonl", [*ROWS[:3], {"prompt": "4+4=", "answer": "eight"}])
    with pytest.raises(DatasetFormatError, match=re.escape(f"{train}:4: numeric_match ground truth answer 'eight'")):
        load(train)
    countdown = write(tmp_path / "countdown.jsonl", [{"prompt": "reach 7", "ground_truth": {"numbers": [3, 4]}}] * 2)
    with pytest.raises(DatasetFormatError, match=re.escape(f"{countdown}:1: countdown ground truth")):
        load(countdown, None, "algorithm.reward_fn=countdown")


def test_a_held_out_line_is_checked_like_a_training_line(tmp_path):
    train = write(tmp_path / "train.jsonl", ROWS)
    held_out = write(tmp_path / "eval.jsonl", [ROWS[0], {"prompt": "9+9=", "answer": [18]}])
    with pytest.raises(DatasetFormatError, match=re.escape(f"{held_out}:2: numeric_match ground truth answer [18]")):
        load(train, held_out)


def test_a_rule_that_reads_no_ground_truth_and_a_reward_model_need_none(tmp_path):
    bare = write(tmp_path / "bare.jsonl", [{"prompt": r["prompt"]} for r in ROWS])
    data = load(bare, None, "algorithm.reward_fn=format", "warmup.steps=0")  # an SFT warm-up reads answers
    assert len(data.train) == 2 and len(data.eval_prompts) == 2
    # models.reward scores the rollouts: rows need no answer (no rule scores them).
    dataset = PromptDataset(str(bare), build_char_tokenizer(), max_prompt_length=16)
    check_rows(dataset, None)


def test_each_row_is_scored_against_its_own_ground_truth_else_its_answer():
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4", "ground_truth": {"answer": "4"}}]
    dataset = PromptDataset(rows, build_char_tokenizer(), max_prompt_length=16)
    proto = prompts_to_proto(dataset.collate([dataset[0], dataset[1]]))
    assert proto.non_tensor_batch["answers"].tolist() == ["2", {"answer": "4"}]


def test_a_row_without_a_column_a_reward_function_reads_names_file_and_line(tmp_path):
    def accuracy(prompts, completions, solution, **kwargs):
        return [0.0] * len(completions)

    rows = [{"prompt": "1+1=", "solution": "2"}, {"prompt": "2+2="}]
    train = write(tmp_path / "train.jsonl", rows)
    dataset = PromptDataset(str(train), build_char_tokenizer(), max_prompt_length=16)
    with pytest.raises(DatasetFormatError, match=re.escape(f"{train}:2: no column(s) ['solution'] that reward")):
        check_rows(dataset, pack_reward_funcs([accuracy]))


# ------------------------------------------------------------------ the file itself
def test_a_byte_that_is_not_utf8_names_file_line_and_column(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(DatasetFormatError, match=re.escape(f"{train}:2: not UTF-8: byte 0xe9 at column 16")):
        load(train)


@pytest.mark.parametrize(("content", "what"), [(b"", "is empty"), (b"\n  \n", "holds only blank lines")])
def test_an_empty_file_is_named_as_empty_not_as_a_batch_size_problem(tmp_path, content, what):
    train = tmp_path / "train.jsonl"
    train.write_bytes(content)
    with pytest.raises(DatasetFormatError, match=re.escape(f"{train}: the file {what}")):
        load(train)
    held_out = tmp_path / "eval.jsonl"
    held_out.write_bytes(content)
    with pytest.raises(DatasetFormatError, match=re.escape(f"{held_out}: the file {what}")):
        load(write(tmp_path / "good.jsonl", ROWS), held_out)
    with pytest.raises(DatasetFormatError, match="no records"):
        PromptDataset([], build_char_tokenizer(), max_prompt_length=16)


def test_read_records_still_skips_blank_lines_between_records(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"prompt": "x"}\n\n{"prompt": "y"}\n')
    assert [where for where, _ in read_records(path)] == [f"{path}:1", f"{path}:3"]
