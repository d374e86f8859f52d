"""Data a verl or TRL user brings, as the trainer reads it: verl's gsm8k parquet (a messages prompt,
the ground truth under ``reward_model``, ``data_source`` / ``extra_info`` for reward functions)
trains unchanged; TRL's SFT and preference formats reach the batches through ``Trainer``; a file
of an unknown format is a ``ConfigError`` naming its key.
"""

from __future__ import annotations

import pickle
import re

import datasets
import numpy as np
import pytest
from recipe_helpers import QUICK_FIT, TINY_ACTOR

from rlflow.data.datasets import DatasetFormatError
from rlflow.data.tokenizer import build_char_tokenizer
from rlflow.trainer import ConfigError, Trainer, build, load_config
from rlflow.trainer.data import build_trainer_data

# A chat template in the char tokenizer's alphabet: "<u>" / "<a>" open a turn, a newline closes it.
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<a>{% endif %}"
)
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'  # verl's gsm8k suffix


def verl_gsm8k_rows(split: str, n: int) -> list[dict]:
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them."""
    rows = []
    for i in range(n):
        a, b = i % 5 + 1, i // 5 + 2
        question = f"Tom has {a} apples and buys {b} more. How many?"
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {
                    "split": split,
                    "index": i,
                    "answer": f"{a}+{b}={a + b}\n#### {a + b}",
                    "question": question,
                },
            }
        )
    return rows


@pytest.fixture
def chat_tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.fixture
def verl_files(tmp_path, chat_tokenizer) -> dict[str, str]:
    """``train.parquet`` / ``test.parquet`` of verl's gsm8k schema and a tokenizer directory with a chat template."""
    files = {"tokenizer": str(tmp_path / "tokenizer")}
    chat_tokenizer.save_pretrained(files["tokenizer"])
    for split, n in (("train", 8), ("test", 4)):
        files[split] = str(tmp_path / f"{split}.parquet")
        datasets.Dataset.from_list(verl_gsm8k_rows(split, n)).to_parquet(files[split])
    return files


def verl_config(files: dict[str, str], *extra: str):
    data = [
        f"data.train_file={files['train']}",
        f"data.eval_file={files['test']}",
        f"data.tokenizer={files['tokenizer']}",
    ]
    return load_config(None, ["data.max_prompt_len=128", "data.batch_size=2", "data.eval_size=4", *data, *extra])


def test_verl_rows_give_the_rule_its_nested_ground_truth_and_keep_every_column(verl_files, chat_tokenizer):
    data = build_trainer_data(verl_config(verl_files, "algorithm.reward_fn=numeric_match"), chat_tokenizer)
    assert data.columns == ("prompt", "data_source", "ability", "reward_model", "extra_info")
    rows = verl_gsm8k_rows("test", 4)
    held_out = data.eval_prompts
    assert held_out.non_tensor_batch["answers"].tolist() == [r["reward_model"]["ground_truth"] for r in rows]
    assert list(held_out.non_tensor_batch["columns"]) == [
        {"prompt": r["prompt"], **{k: v for k, v in r.items() if k != "prompt"}} for r in rows
    ]  # the messages themselves under prompt, nested dicts as dicts
    text = chat_tokenizer.decode(held_out.batch["prompts"][0], skip_special_tokens=True)
    assert text == f"<u>{rows[0]['prompt'][0]['content']}\n<a>"  # rendered with the generation prompt
    # As Ray moves a batch to a worker (pickle protocol 5): nested columns arrive whole.
    moved = pickle.loads(pickle.dumps(held_out, protocol=5))
    assert list(moved.non_tensor_batch["columns"]) == list(held_out.non_tensor_batch["columns"])
    assert isinstance(moved.non_tensor_batch["columns"][0]["extra_info"]["index"], (int, np.integer))


def test_a_verl_ground_truth_the_rule_cannot_parse_names_the_file_and_row(tmp_path, verl_files, chat_tokenizer):
    rows = verl_gsm8k_rows("train", 4)
    rows[2]["reward_model"]["ground_truth"] = "seven"
    bad = str(tmp_path / "bad.parquet")
    datasets.Dataset.from_list(rows).to_parquet(bad)
    cfg = verl_config({**verl_files, "train": bad}, "algorithm.reward_fn=numeric_match")
    with pytest.raises(DatasetFormatError, match=re.escape(f"{bad} row 2: numeric_match ground truth answer 'seven'")):
        build_trainer_data(cfg, chat_tokenizer)


def test_verl_messages_without_a_chat_template_name_the_file_and_column(verl_files):
    cfg = verl_config(verl_files, "algorithm.reward_fn=numeric_match")
    with pytest.raises(DatasetFormatError, match=r"train\.parquet row 0: column 'prompt' holds messages, but the tok"):
        build_trainer_data(cfg, build_char_tokenizer())


def test_an_unknown_extension_is_a_config_error_naming_the_key(tmp_path, verl_files, chat_tokenizer):
    text = tmp_path / "train.txt"
    text.write_text("1+1=\t2\n")
    with pytest.raises(ConfigError, match=r"^data\.train_file: .*'\.txt'; data files are \.parquet, \.jsonl"):
        build_trainer_data(verl_config({**verl_files, "train": str(text)}), chat_tokenizer)
    with pytest.raises(ConfigError, match=r"^data\.eval_file: .*'\.txt'"):
        build_trainer_data(verl_config({**verl_files, "test": str(text)}), chat_tokenizer)


# ------------------------------------------------------------------ TRL's formats through Trainer
@pytest.fixture
def no_ray(monkeypatch):
    def refuse(cfg):
        raise AssertionError("Trainer.__init__ started Ray")

    monkeypatch.setattr(build, "ensure_ray", refuse)


USER = [{"role": "user", "content": "1+1="}]
ANSWER, WRONG = [{"role": "assistant", "content": "2"}], [{"role": "assistant", "content": "3"}]


def construct(tmp_path, algorithm: str, rows: list[dict], tokenizer) -> Trainer:
    models = {"actor": {"init": "tiny"}, "ref": {"init": "copy", "init_from": "actor"}} if algorithm == "dpo" else {}
    config = {
        "algorithm": {"name": algorithm},
        **({"models": models} if models else {}),
        "data": {"batch_size": 2, "eval_size": 0},
        "logging": {"dir": str(tmp_path / "run"), "tensorboard": False},
    }
    return Trainer(config, tokenizer=tokenizer, train_dataset=datasets.Dataset.from_list(rows), progress_bars=False)


def masked(tokenizer, batch, row: int, keep: int) -> str:
    ids, mask = batch.batch["input_ids"][row], batch.batch["loss_mask"][row]
    return tokenizer.decode([int(t) for t, m in zip(ids, mask) if int(m) == keep])


def test_trainer_sft_on_conversational_prompt_completion_trains_on_the_completion(tmp_path, no_ray, chat_tokenizer):
    rows = [{"prompt": USER, "completion": ANSWER}] * 2
    trainer = construct(tmp_path, "sft", rows, chat_tokenizer)
    batch = next(iter(trainer.data.train))
    assert masked(chat_tokenizer, batch, 0, keep=1) == "2\n"
    assert masked(chat_tokenizer, batch, 0, keep=0).startswith("<u>1+1=\n<a>")  # then right padding
    trainer.close()


def test_trainer_dpo_on_implicit_conversational_pairs(tmp_path, no_ray, chat_tokenizer):
    rows = [{"chosen": USER + ANSWER, "rejected": USER + WRONG}] * 2
    trainer = construct(tmp_path, "dpo", rows, chat_tokenizer)
    batch = next(iter(trainer.data.train))  # rows 2i chosen, 2i+1 rejected
    assert [masked(chat_tokenizer, batch, i, keep=1) for i in range(2)] == ["2\n", "3\n"]
    trainer.close()


# ------------------------------------------------------------------ a verl parquet file trains
def gsm8k_reward(prompts, completions, data_source, reward_model, extra_info, **kwargs):
    """0.5 for every completion whose row's verl columns arrived whole and aligned with it, else -1."""
    scores = []
    for source, truth, info in zip(data_source, reward_model, extra_info):
        whole = source == "openai/gsm8k" and isinstance(info, dict) and isinstance(truth, dict)
        scores.append(0.5 if whole and info["answer"].endswith(f"#### {truth['ground_truth']}") else -1.0)
    return scores


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_verl_gsm8k_parquet_file_trains_with_a_reward_reading_its_columns(ray_session, tmp_path, verl_files):
    cfg = verl_config(
        verl_files,
        "algorithm.name=grpo",
        "algorithm.n_samples=2",
        "rollout.max_new_tokens=4",
        "trainer.total_steps=2",
        *QUICK_FIT,
        *TINY_ACTOR,
        f"logging.dir={tmp_path / 'run'}",
    )
    with Trainer(cfg, reward_funcs=[gsm8k_reward], progress_bars=False) as trainer:
        result = trainer.fit()
    assert result.steps == 2
    assert result.score_after == 0.5  # held-out rows scored by the same function, every column aligned
