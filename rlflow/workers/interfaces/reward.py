"""Rewards: a reward model (scalar head) or a rule scored against reference answers.

* :class:`RewardModelInterface` — ``rewards`` ``(N,)`` is the model's value at each row's
  last real token; its train step (algorithm ``rm``) is the Bradley–Terry loss over
  (chosen, rejected) pairs, rows ``2i`` and ``2i+1``. A TRL reward model (loaded from a
  ``*ForSequenceClassification`` checkpoint) is scored as TRL's ``GRPOTrainer`` scores it: on
  the text — the row's prompt and the decoded completion, through the reward tokenizer's chat
  template for a conversational row — tokenized again by its own tokenizer (:func:`reward_texts`).
* :class:`RuleRewardInterface` — decodes each row's prompt (real tokens outside the
  response) and response (``response_mask``) with the run's tokenizer and scores them with
  the registered rule (``rlflow.workers.rewards``) against the ``answers`` column, or with
  Python reward functions (``rlflow.workers.reward_funcs``) given the dataset's ``columns``, the
  completions' token ids and the call's step, in TRL's conventions (conversational rows included).
  It holds no weights and runs on CPU. A sample whose reward raises fails the call or is scored by
  the model's ``reward_errors`` policy (``rlflow.workers.reward_errors``).

Rows of a multi-turn rollout score their episode's environment reward (the ``env_rewards`` column,
the sum of its step rewards) plus the reward's own score. The text a rule or a reward function
reads as the completion is the policy's sampled turns only (observation tokens are outside the
``response_mask``), for a TRL reward model too; a reward model scoring the token ids reads the
whole sequence, observations included.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoConfig

from rlflow.data.formats import is_messages
from rlflow.data.tokenizer import load_tokenizer
from rlflow.engine.models import is_sequence_classification
from rlflow.engine.rollout.multi_turn import ENV_REWARDS
from rlflow.protocol import DataProto
from rlflow.workers.context import CallContext, tensors_of
from rlflow.workers.interfaces.actor import pair_columns
from rlflow.workers.interfaces.base import ModelInterface, train_epochs
from rlflow.workers.losses import reward_model_loss_fn
from rlflow.workers.reward_errors import RewardErrors
from rlflow.workers.reward_funcs import RewardFuncs, as_conversation, score_completions
from rlflow.workers.rewards import compute_rule_rewards, nan_mean

if TYPE_CHECKING:
    from rlflow.engine.train_engine import TrainEngine

__all__ = ["RewardModelInterface", "RuleRewardInterface", "decode_rollout", "reward_texts"]


def _with_score_mean(rewards: torch.Tensor, data: DataProto, errors: RewardErrors | None = None) -> DataProto:
    """``rewards`` (N,) plus the rows' environment rewards (a multi-turn rollout's ``env_rewards``
    column), with NaN (skipped samples) scored 0, and their mean over the samples not skipped; with
    ``errors`` (policy ``zero`` or ``skip``), the fraction of samples whose reward raised."""
    rewards = rewards.float()
    if ENV_REWARDS in data.non_tensor_keys:
        rewards = rewards + torch.as_tensor(data.non_tensor_batch[ENV_REWARDS].astype("float64")).to(rewards)
    out = DataProto.from_dict({"rewards": torch.nan_to_num(rewards, nan=0.0)})
    out.meta_info["score_mean"] = nan_mean(rewards)
    if errors is not None and errors.policy != "raise":
        out.meta_info.update(errors.metrics(len(rewards)))
    return out


class RewardModelInterface(ModelInterface):
    """A scalar-head reward model; see the module docstring."""

    role = "reward"
    objectives = ("rm",)

    @cached_property
    def scores_text(self) -> bool:
        """Whether the model is a TRL reward model, scored on its own tokenization of the text."""
        return is_sequence_classification(AutoConfig.from_pretrained(self.model.path, local_files_only=True))

    @cached_property
    def tokenizer(self):
        """The run's tokenizer (it decodes the rollout)."""
        return load_tokenizer(self.setup.tokenizer_path)

    @cached_property
    def reward_tokenizer(self):
        """The reward model's own tokenizer; the run's when its directory holds none."""
        own = any((Path(self.model.path) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
        return load_tokenizer(self.model.path) if own else self.tokenizer

    def inference(self, engine: TrainEngine, data: DataProto, ctx: CallContext) -> DataProto | None:
        batch = self._text_batch(data) if self.scores_text else tensors_of(data, ("input_ids", "attention_mask"))
        out = engine.forward(batch)
        return None if out is None else _with_score_mean(out["rewards"], data)

    def _text_batch(self, data: DataProto) -> dict[str, torch.Tensor]:
        """The rows' text tokenized by the reward tokenizer: right padding, no special tokens added (as TRL)."""
        prompts, completions = decode_rollout(
            self.tokenizer, **tensors_of(data, ("input_ids", "attention_mask", "response_mask"))
        )
        rows = data.non_tensor_batch.get("columns")
        if rows is not None:  # the dataset's prompts, as TRL reads them (message lists included)
            prompts = [row["prompt"] for row in rows]
        texts = reward_texts(self.reward_tokenizer, prompts, completions)
        encoded = self.reward_tokenizer(
            texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False
        )
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}

    def train_step(self, engine: TrainEngine, data: DataProto, ctx: CallContext) -> dict[str, float]:
        batch = tensors_of(data, ("input_ids", "attention_mask"))
        batch.update(pair_columns(len(data)))
        return train_epochs(engine, batch, reward_model_loss_fn(), epochs=1, num_mini_batches=1, loss_mask_key=None)


def decode_rollout(tokenizer, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor):
    """``(prompts, responses)``: the text of every row's prompt and response tokens (special tokens dropped).

    The prompt is the real tokens before the first response token: a multi-turn row's observations
    are neither (they follow the first sampled token and are outside ``response_mask``).
    """
    real, response = attention_mask.bool(), response_mask.bool()
    before_response = response.long().cumsum(dim=1) == 0
    prompts = [
        tokenizer.decode(ids[m].tolist(), skip_special_tokens=True) for ids, m in zip(input_ids, real & before_response)
    ]
    responses = [tokenizer.decode(ids[m].tolist(), skip_special_tokens=True) for ids, m in zip(input_ids, response)]
    return prompts, responses


def reward_texts(tokenizer, prompts: list[Any], completions: list[str]) -> list[str]:
    """What TRL's ``GRPOTrainer`` hands a reward model: ``prompt + completion`` for a text prompt;
    for a message list, the conversation with the completion as the assistant's turn, rendered by
    ``tokenizer``'s chat template.

    >>> reward_texts(None, ["1+1="], ["2"])
    ['1+1=2']
    """
    texts = []
    for prompt, completion in zip(prompts, completions):
        if is_messages(prompt):
            messages, reply = as_conversation(prompt, completion)
            texts.append(tokenizer.apply_chat_template(messages + reply, tokenize=False))
        else:
            texts.append(prompt + completion)
    return texts


class RuleRewardInterface(ModelInterface):
    """A rule-based reward; see the module docstring."""

    role = "reward"

    @cached_property
    def tokenizer(self):
        return load_tokenizer(self.setup.tokenizer_path)

    def inference(self, engine: None, data: DataProto, ctx: CallContext) -> DataProto:
        tensors = tensors_of(data, ("input_ids", "attention_mask", "response_mask"))
        if "answers" not in data.non_tensor_keys:
            raise KeyError(
                f"rule-based reward {self.model.reward_fn!r} needs an 'answers' column; rows hold {data.keys}"
            )
        prompts, responses = decode_rollout(self.tokenizer, **tensors)
        errors = RewardErrors(self.model.reward_errors)
        uids = data.non_tensor_batch["uid"].tolist() if "uid" in data.non_tensor_keys else None
        if isinstance(self.model.reward_fn, RewardFuncs):
            ids = [row[m].tolist() for row, m in zip(tensors["input_ids"], tensors["response_mask"].bool())]
            out = _score_with_funcs(self.model.reward_fn, data, responses, ids, errors, uids, ctx.step)
        else:
            answers = data.non_tensor_batch["answers"].tolist()
            rewards = compute_rule_rewards(self.model.reward_fn, prompts, responses, answers, errors, uids)
            out = _with_score_mean(rewards, data, errors)
        errors.report(ctx.mfc.name)
        return out


def _score_with_funcs(
    funcs: RewardFuncs,
    data: DataProto,
    texts: list[str],
    completion_ids: list[list[int]],
    errors: RewardErrors,
    uids: list | None,
    step: int,
) -> DataProto:
    """TRL-style reward functions: the dataset's prompts (message lists for conversational rows,
    whose completions become assistant messages), every other column by keyword, the completions'
    token ids and the trainer state at ``step``."""
    rows = data.non_tensor_batch.get("columns")
    if rows is None:
        raise KeyError(f"reward functions {list(funcs.names)} need the dataset's 'columns'; rows hold {data.keys}")
    names = list(dict.fromkeys(k for row in rows for k in row))
    columns = {k: [row.get(k) for row in rows] for k in names if k != "prompt"}
    pairs = [
        as_conversation(row["prompt"], text) if is_messages(row["prompt"]) else (row["prompt"], text)
        for row, text in zip(rows, texts)
    ]
    prompts, completions = [p for p, _ in pairs], [c for _, c in pairs]
    rewards, means = score_completions(
        funcs, prompts, completions, columns, errors, uids, completion_ids=completion_ids, step=step
    )
    out = _with_score_mean(rewards, data, errors)
    out.meta_info.update(means)
    return out
