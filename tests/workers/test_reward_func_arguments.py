"""What reward functions receive besides prompts and completions, as TRL's GRPOTrainer hands it:
``completion_ids``, ``trainer_state``, and conversational rows as message lists."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers import TrainerState

from rlflow.data.formats import is_messages
from rlflow.data.tokenizer import build_char_tokenizer
from rlflow.dataflow import MFCDef
from rlflow.dataflow.algorithms import ROLLOUT_KEYS
from rlflow.protocol import DataProto
from rlflow.workers.context import CallContext
from rlflow.workers.interfaces.reward import RuleRewardInterface
from rlflow.workers.reward_errors import RewardErrors
from rlflow.workers.reward_funcs import (
    check_reward_signature,
    pack_reward_funcs,
    required_columns,
    score_completions,
)
from rlflow.workers.setup import ModelSetup

# The functions travel pickled by value (as to a worker): they check what they receive themselves,
# and a failed check raises out of the call (reward_errors "raise").
IDS = [[5, 6, 2], [7]]


def everything(prompts, completions, **kwargs):
    assert kwargs["completion_ids"] == IDS and kwargs["label"] == ["a", "b"]  # the trainer's ids, not the column
    state = kwargs["trainer_state"]
    assert isinstance(state, TrainerState) and (state.global_step, state.max_steps) == (4, 9)
    return [float(len(ids)) for ids in kwargs["completion_ids"]]


def by_name(prompts, completions, trainer_state, completion_ids):
    assert completion_ids == IDS
    return [float(trainer_state.global_step)] * len(completions)


def columns_only(prompts, completions, label):
    assert label == ["a", "b"]  # names neither: gets neither (a TypeError otherwise)
    return [0.0] * len(completions)


def test_score_completions_passes_completion_ids_and_the_trainer_state():
    funcs = pack_reward_funcs([everything, by_name, columns_only], max_steps=9)
    columns = {"label": ["a", "b"], "trainer_state": ["column", "column"], "completion_ids": [[0], [0]]}
    total, means = score_completions(funcs, ["p", "q"], ["xy", "z"], columns, completion_ids=IDS, step=4)
    assert means == {"rewards/everything": 2.0, "rewards/by_name": 4.0, "rewards/columns_only": 0.0}
    assert total.tolist() == [3.0 + 4.0, 1.0 + 4.0]


def test_a_function_that_raises_gets_each_samples_ids_and_the_same_state():
    def strict(prompts, completions, completion_ids, trainer_state, **kwargs):
        if "boom" in completions:
            raise RuntimeError("boom")
        assert trainer_state.global_step == 2
        return [float(sum(ids)) for ids in completion_ids]

    total, _ = score_completions(
        pack_reward_funcs([strict]),
        ["p", "q", "r"],
        ["ok", "boom", "ok"],
        {},
        RewardErrors("zero"),
        completion_ids=[[1], [2, 3], [4, 5]],
        step=2,
    )
    assert total.tolist() == [1.0, 0.0, 9.0]  # sample by sample: each its own ids


def test_the_trainer_keywords_are_not_dataset_columns():
    def reward(prompts, completions, completion_ids, trainer_state, label):
        return []

    check_reward_signature(reward, {"label"})  # no column named completion_ids or trainer_state needed
    assert required_columns(reward) == ("label",)


def _objects(values: list) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


CHAT = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+1="}]
PREFILLED = [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "It is "}]


def rollout(prompts: list[str], responses: list[str], rows: list[dict]) -> DataProto:
    """Rows of token ids as a rollout lays them out (prompt, response, right padding), with ``columns``."""
    tokenizer = build_char_tokenizer()
    ids = [tokenizer(p + r, add_special_tokens=False).input_ids for p, r in zip(prompts, responses)]
    width = max(map(len, ids))
    masks = [[0] * len(tokenizer(p, add_special_tokens=False).input_ids) for p in prompts]
    masks = [m + [1] * (len(i) - len(m)) + [0] * (width - len(i)) for m, i in zip(masks, ids)]
    ids = [i + [0] * (width - len(i)) for i in ids]
    tensors = {
        "input_ids": torch.tensor(ids),
        "attention_mask": (torch.tensor(ids) != 0).long(),
        "response_mask": torch.tensor(masks),
    }
    return DataProto.from_dict(tensors, {"answers": _objects([None] * len(rows)), "columns": _objects(rows)})


def judge(prompts, completions, completion_ids, trainer_state, **kwargs):
    tokenizer = build_char_tokenizer()
    assert prompts == [CHAT, PREFILLED[:1], "3+3="]
    assert completions == [
        [{"role": "assistant", "content": "2"}],
        [{"role": "assistant", "content": "It is 4"}],
        "6",
    ]
    assert completion_ids == [tokenizer(t, add_special_tokens=False).input_ids for t in ("2", "4", "6")]
    assert (trainer_state.global_step, trainer_state.max_steps, kwargs["level"]) == (7, 20, [1, 2, 3])
    return [1.0, 2.0, 3.0]


def test_the_reward_call_hands_conversations_ids_and_its_step(tmp_path):
    build_char_tokenizer().save_pretrained(tmp_path)
    funcs = pack_reward_funcs([judge], max_steps=20)
    interface = RuleRewardInterface(
        ModelSetup("reward", "reward", None, reward_fn=funcs), SimpleNamespace(tokenizer_path=str(tmp_path))
    )
    rows = [{"prompt": CHAT, "level": 1}, {"prompt": PREFILLED, "level": 2}, {"prompt": "3+3=", "level": 3}]
    # The token ids stand for the chat-rendered prompts (any text does: the reward sees the rows' prompts).
    data = rollout(["<s>1+1=", "2+2=It is ", "3+3="], ["2", "4", "6"], rows)
    ctx = CallContext(MFCDef("reward_inf", "reward", "inference", (*ROLLOUT_KEYS, "answers"), ("rewards",)), step=7)
    out = interface.inference(None, data, ctx)
    assert out.batch["rewards"].tolist() == [1.0, 2.0, 3.0]
    assert rows[1]["prompt"] == PREFILLED  # the row's own messages are left as they were


@pytest.mark.parametrize("prompt", [[], [{"role": "user"}], ["1+1="], "1+1="])
def test_only_lists_of_role_and_content_messages_are_conversations(prompt):
    assert not is_messages(prompt)
