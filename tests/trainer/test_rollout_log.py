"""The rollouts a run writes (``logging.rollouts_every``): one JSON line a row, the prompt before the
first sampled token, the response with a multi-turn row's observations, and what is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rlflow.data.tokenizer import build_char_tokenizer
from rlflow.protocol import DataProto
from rlflow.trainer import ConfigError, load_config
from rlflow.trainer.rollout_log import rollout_records, write_rollouts


def _rows(tokenizer, texts: list[tuple[str, str, str]]) -> DataProto:
    """Left-padded rows of (prompt, sampled text, observation), the sampled text masked as sampled."""
    ids, sampled = [], []
    for prompt, turn, observation in texts:
        p, t, o = (tokenizer.encode(s, add_special_tokens=False) for s in (prompt, turn, observation))
        ids.append(p + t + o)
        sampled.append([0] * len(p) + [1] * len(t) + [0] * len(o))
    width = max(map(len, ids))
    pad = [width - len(row) for row in ids]
    return DataProto.from_dict(
        {
            "input_ids": torch.tensor([[0] * n + row for n, row in zip(pad, ids)]),
            "attention_mask": torch.tensor([[0] * n + [1] * len(row) for n, row in zip(pad, ids)]),
            "response_mask": torch.tensor([[0] * n + row for n, row in zip(pad, sampled)]),
        },
        {"answers": np.array(["3", "5"], dtype=object), "uid": np.array([7, 7], dtype=object)},
    )


def test_a_row_is_its_prompt_its_response_with_observations_and_its_reward(tmp_path):
    tokenizer = build_char_tokenizer()
    rows = _rows(tokenizer, [("1+2=", "<call>", "=3"), ("2+3=", "5", "")])
    scored = DataProto.from_dict({"rewards": torch.tensor([0.0, 1.0])})
    records = rollout_records(tokenizer, rows, scored)
    assert records == [
        {"prompt": "1+2=", "response": "<call>=3", "response_tokens": 6, "reward": 0.0, "answer": "3", "group": 7},
        {"prompt": "2+3=", "response": "5", "response_tokens": 1, "reward": 1.0, "answer": "5", "group": 7},
    ]
    path = write_rollouts(tmp_path, 4, records)
    assert path == tmp_path / "rollouts" / "step_4.jsonl"
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"step": 4, **r} for r in records]
    with pytest.raises(ValueError, match="3 rewards for 2 rollouts"):
        rollout_records(tokenizer, rows, DataProto.from_dict({"rewards": torch.zeros(3)}))


def test_an_algorithm_that_samples_nothing_has_no_rollouts_to_write():
    with pytest.raises(ConfigError, match="logging.rollouts_every: algorithm 'sft' samples no rollouts"):
        load_config(None, ["algorithm.name=sft", "logging.rollouts_every=1"])
