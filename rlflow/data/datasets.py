"""Datasets of prompts (RL), supervised examples (SFT) and preference pairs (DPO, reward models),
in TRL's standard and conversational formats, and their collates.

A dataset reads a data file through :mod:`rlflow.data.files` (parquet, JSON lines, CSV, Arrow, a
``save_to_disk`` directory) or takes rows in memory, and tokenises every row when built, so a
malformed row (a missing or ill-typed column, a format it cannot tell) or an over-long example
fails at start-up naming the file and its line or row, not hours into a run. Over-long examples
raise unless truncation is configured; truncation is counted (``num_truncated``) and reported
with a warning, never silent. The rows each dataset reads (:mod:`rlflow.data.formats`):

* :class:`PromptDataset`: ``prompt`` (a string or messages) and any other column;
* :class:`SFTDataset`: ``prompt`` + ``completion`` (or ``answer``), ``messages`` or ``text``;
* :class:`PreferenceDataset`: ``prompt`` + ``chosen`` + ``rejected``, or ``chosen`` + ``rejected``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from rlflow.data.files import DatasetFormatError, read_records
from rlflow.data.formats import (
    Text,
    check_text,
    is_messages,
    preference_parts,
    render_conversation,
    render_prompt,
    split_completion,
)

__all__ = [
    "DatasetFormatError",
    "PreferenceDataset",
    "PromptDataset",
    "SFTDataset",
    "collate_preferences",
    "collate_prompts",
    "collate_sft",
    "pad_sequences",
]

_ITEM_KEYS = ("index", "input_ids", "loss_mask")  # what a dataset adds to a record's fields


class _RowDataset:
    """Shared plumbing: read rows, tokenise them, count truncations, index items."""

    truncation_modes: tuple[str, ...] = ("error",)

    def __init__(
        self,
        source: str | os.PathLike | Sequence[Mapping[str, Any]],
        tokenizer: PreTrainedTokenizerBase,
        truncation: str,
    ) -> None:
        if truncation not in self.truncation_modes:
            raise ValueError(f"truncation={truncation!r}; {type(self).__name__} accepts {self.truncation_modes}")
        self.tokenizer, self.truncation, self.num_truncated = tokenizer, truncation, 0
        self.source = str(source) if isinstance(source, (str, os.PathLike)) else "<records>"
        rows = read_records(source) if isinstance(source, (str, os.PathLike)) else _in_memory(source)
        self.places = [where for where, _ in rows]  # of each item, for errors that name file:line
        self.items = [self._build_item(i, where, row) for i, (where, row) in enumerate(rows)]
        if self.num_truncated:
            warnings.warn(
                f"{self.source}: truncated {self.num_truncated} of {len(self.items)} examples ({truncation})",
                stacklevel=2,
            )

    def _build_item(self, index: int, where: str, row: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def where(self, index: int) -> str:
        """Where item ``index`` is: ``file:line``, ``file row i``, or ``<records>:n`` for rows given in memory."""
        return self.places[index]

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def _segments(self, where: str, prompt: Text, completion: Text, column: str) -> tuple[list[int], list[int]]:
        """Token ids of a prompt and of its completion.

        Strings: the prompt with special tokens (BOS), the completion without, then EOS. Messages:
        both as the chat template renders them, the completion closed by the template's own end
        of turn.
        """
        if isinstance(prompt, str) and isinstance(completion, str):
            eos = self.tokenizer.eos_token_id
            return self._encode(prompt, True), self._encode(completion, False) + ([] if eos is None else [eos])
        if is_messages(prompt) and is_messages(completion):
            prompt_text, completion_text = split_completion(self.tokenizer, prompt, completion, where, column)
            return self._encode(prompt_text, False), self._encode(completion_text, False)
        raise DatasetFormatError(
            f"{where}: 'prompt' and {column!r} mix a string and messages; give both as one or the other"
        )

    def _fit(
        self, where: str, context: list[int], target: list[int], what: str, field: str, max_length: int
    ) -> tuple[list[int], list[int]]:
        """``context + target`` within ``max_length`` and its loss mask (1 on ``target``)."""
        ids = context + target
        if len(ids) > max_length:
            message = f"{where}: {what} has {len(ids)} tokens > max_length={max_length}"
            if self.truncation == "error":
                raise DatasetFormatError(message)
            if len(context) >= max_length:
                raise DatasetFormatError(f"{message}, and the prompt alone ({len(context)}) leaves no {field} token")
            self.num_truncated += 1
            ids = ids[:max_length]
        return ids, [0] * len(context) + [1] * (len(ids) - len(context))

    def __len__(self) -> int:
        return len(self.items)

    @property
    def columns(self) -> tuple[str, ...]:
        """The fields of the records (the tokenised fields left out), in first-seen order."""
        return tuple(dict.fromkeys(k for item in self.items for k in item if k not in _ITEM_KEYS))

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.items[index]


def _in_memory(source: Sequence[Mapping[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    rows = []
    for i, record in enumerate(source):
        where = f"<records>:{i + 1}"
        if not isinstance(record, Mapping):
            raise DatasetFormatError(f"{where}: expected a dict of columns, got {type(record).__name__}")
        rows.append((where, dict(record)))
    if not rows:
        raise DatasetFormatError("<records>: no records; a dataset needs at least one")
    return rows


class PromptDataset(_RowDataset):
    """Prompts for rollouts: rows ``{"prompt": str | list[message], ...}``; every other column
    (``ground_truth``, ``answer``, verl's ``reward_model`` / ``extra_info``, any column a reward
    function reads) travels with the item.

    A conversational prompt (a list of ``{"role": ..., "content": ...}`` messages) is rendered
    with the tokenizer's chat template, ending with the generation prompt; a tokenizer without a
    chat template refuses it. The item keeps the messages themselves under ``prompt``.

    Args:
        source: a data file (:func:`~rlflow.data.files.read_records`), or rows (dicts) in memory.
        tokenizer: encodes the prompt with its special tokens (BOS).
        max_prompt_length: longest prompt in tokens.
        truncation: ``"error"``, ``"left"`` (drop the beginning after BOS, keep the end next
            to the answer) or ``"right"``.

    Items: ``{"index": int, "input_ids": list[int], "prompt": str | list, **other fields}``.
    """

    truncation_modes = ("error", "left", "right")

    def __init__(self, source, tokenizer, max_prompt_length: int, truncation: str = "error") -> None:
        self.max_prompt_length = max_prompt_length
        super().__init__(source, tokenizer, truncation)

    def _prompt_ids(self, where: str, prompt: Text) -> list[int]:
        if isinstance(prompt, str):
            return self._encode(prompt, add_special_tokens=True)
        text = render_prompt(self.tokenizer, prompt, where, "prompt")
        return self._encode(text, add_special_tokens=False)  # the template writes its own special tokens

    def _build_item(self, index: int, where: str, row: dict[str, Any]) -> dict[str, Any]:
        check_text(row, "prompt", where, "; a prompt row holds 'prompt': a string or a list of messages")
        reserved = {"index", "input_ids"} & set(row)
        if reserved:
            raise DatasetFormatError(f"{where}: field(s) {sorted(reserved)} are reserved for rlflow")
        ids = self._prompt_ids(where, row["prompt"])
        if len(ids) > self.max_prompt_length:
            if self.truncation == "error":
                raise DatasetFormatError(
                    f"{where}: prompt has {len(ids)} tokens > max_prompt_length={self.max_prompt_length} "
                    "(raise the limit, or truncate from the left: data.truncation=left)"
                )
            self.num_truncated += 1
            if self.truncation == "right":
                ids = ids[: self.max_prompt_length]
            else:  # keep a leading BOS: models are trained to see it first
                bos = self.tokenizer.bos_token_id
                keep_bos = bos is not None and ids[0] == bos and self.max_prompt_length > 1
                tail = ids[len(ids) - self.max_prompt_length + keep_bos :]
                ids = [bos, *tail] if keep_bos else tail
        return {"index": index, "input_ids": ids, "prompt": row["prompt"], **row}

    def collate(self, items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return collate_prompts(items, self.tokenizer.pad_token_id)


class SFTDataset(_RowDataset):
    """Supervised examples in TRL's SFT formats; the loss covers what the model should write.

    ==============================  ====================================================
    row                             loss on
    ==============================  ====================================================
    ``prompt`` + ``completion``     the completion (and EOS after a string one)
    ``prompt`` + ``answer``         the answer and EOS (rlflow's own files)
    ``messages``                    every token of the rendered conversation after the first
    ``text``                        every token after the first, and EOS
    ==============================  ====================================================

    ``prompt`` and ``completion`` are both strings or both messages; checked in that order, so
    a row holding ``prompt`` + ``completion`` beside ``text`` trains on the completion.

    Args:
        source: a data file, or rows in memory.
        tokenizer: encodes strings (prompt with special tokens, completion without) and renders
            messages with its chat template.
        max_length: longest example in tokens.
        truncation: ``"error"`` or ``"right"`` (cut the end of the answer); a prompt that
            leaves no answer token raises either way.
        answer_field: ``"answer"``, or ``"chosen"``: rows are preference rows and the example is
            the prompt (explicit or implicit) and its chosen answer, as an SFT warm-up before DPO.

    Items: ``{"index", "input_ids": list[int], "loss_mask": list[int]}``.
    """

    truncation_modes = ("error", "right")

    def __init__(
        self, source, tokenizer, max_length: int, truncation: str = "error", answer_field: str = "answer"
    ) -> None:
        if answer_field not in ("answer", "chosen"):
            raise ValueError(f"answer_field={answer_field!r}; expected 'answer' or 'chosen'")
        self.max_length, self.answer_field = max_length, answer_field
        super().__init__(source, tokenizer, truncation)

    def _build_item(self, index: int, where: str, row: dict[str, Any]) -> dict[str, Any]:
        if self.answer_field == "chosen":
            prompt, chosen, _ = preference_parts(row, where)
            context, target = self._segments(where, prompt, chosen, "chosen")
            what, field = "prompt + chosen", "chosen"
        elif "prompt" in row and ("completion" in row or "answer" in row):
            field = "completion" if "completion" in row else "answer"
            check_text(row, "prompt", where)
            check_text(row, field, where)
            context, target = self._segments(where, row["prompt"], row[field], field)
            what = f"prompt + {field}"
        elif "messages" in row or "text" in row:
            field = "messages" if "messages" in row else "text"
            context, target = self._language_modelling(where, row, field)
            what = field
        else:
            raise DatasetFormatError(
                f"{where}: no SFT format in the columns {sorted(row)}; expected 'prompt' + 'completion' "
                "(or 'answer'), 'messages' or 'text'"
            )
        ids, mask = self._fit(where, context, target, what, field, self.max_length)
        return {"index": index, "input_ids": ids, "loss_mask": mask}

    def _language_modelling(self, where: str, row: Mapping[str, Any], field: str) -> tuple[list[int], list[int]]:
        """The first token as context (nothing predicts it), every later one as target."""
        value = row[field]
        if field == "messages" and is_messages(value):
            ids = self._encode(render_conversation(self.tokenizer, value, where, field), False)
        elif field == "text" and isinstance(value, str):
            eos = self.tokenizer.eos_token_id
            ids = self._encode(value, True) + ([] if eos is None else [eos])
        else:
            kind = "a list of messages" if field == "messages" else "str"
            raise DatasetFormatError(f"{where}: field {field!r} should be {kind}, got {type(value).__name__}")
        return ids[:1], ids[1:]

    def collate(self, items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return collate_sft(items, self.tokenizer.pad_token_id)


class PreferenceDataset(_RowDataset):
    """Paired preferences: rows ``{"prompt", "chosen", "rejected"}`` of strings or of messages, or
    ``{"chosen", "rejected"}`` whose shared beginning is the prompt (TRL's implicit prompt).

    Args: as :class:`SFTDataset`; ``max_length`` bounds each of prompt + chosen and
    prompt + rejected.

    Items: ``{"index", "chosen_input_ids", "chosen_loss_mask", "rejected_input_ids",
    "rejected_loss_mask"}``.
    """

    truncation_modes = ("error", "right")

    def __init__(self, source, tokenizer, max_length: int, truncation: str = "error") -> None:
        self.max_length = max_length
        super().__init__(source, tokenizer, truncation)

    def _build_item(self, index: int, where: str, row: dict[str, Any]) -> dict[str, Any]:
        prompt, chosen, rejected = preference_parts(row, where)
        item: dict[str, Any] = {"index": index}
        for side, completion in (("chosen", chosen), ("rejected", rejected)):
            context, target = self._segments(where, prompt, completion, side)
            ids, mask = self._fit(where, context, target, f"prompt + {side}", side, self.max_length)
            item[f"{side}_input_ids"], item[f"{side}_loss_mask"] = ids, mask
        return item

    def collate(self, items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return collate_preferences(items, self.tokenizer.pad_token_id)


def pad_sequences(sequences: Sequence[Sequence[int]], pad_value: int, side: str, length: int | None = None):
    """Stack variable-length lists into a ``(B, T)`` long tensor padded on ``side``.

    >>> pad_sequences([[1, 2], [3]], pad_value=0, side="left")
    tensor([[1, 2],
            [0, 3]])
    """
    if side not in ("left", "right"):
        raise ValueError(f"side={side!r}; expected 'left' or 'right'")
    width = max((len(s) for s in sequences), default=0) if length is None else length
    out = torch.full((len(sequences), width), pad_value, dtype=torch.long)
    for row, seq in enumerate(sequences):
        if len(seq) > width:
            raise ValueError(f"sequence {row} has {len(seq)} tokens > length={width}")
        if len(seq):
            values = torch.as_tensor(list(seq), dtype=torch.long)
            if side == "left":
                out[row, width - len(values) :] = values
            else:
                out[row, : len(values)] = values
    return out


def _non_tensor_fields(items: Sequence[Mapping[str, Any]], tensor_keys: set[str]) -> dict[str, list[Any]]:
    keys = list(dict.fromkeys(k for item in items for k in item if k not in tensor_keys))
    return {k: [item.get(k) for item in items] for k in keys}


def collate_prompts(items: Sequence[Mapping[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """Left-pad prompts for generation (the last prompt token of every row is at ``T - 1``).

    Returns:
        ``input_ids`` ``(B, T)``, ``attention_mask`` ``(B, T)``, ``position_ids`` ``(B, T)``
        (0 at each row's first real token), and every other item field as a list of ``B``.
    """
    ids = [item["input_ids"] for item in items]
    attention = pad_sequences([[1] * len(s) for s in ids], 0, "left")
    return {
        "input_ids": pad_sequences(ids, pad_token_id, "left"),  # (B, T)
        "attention_mask": attention,  # (B, T) 1 on real tokens
        "position_ids": (attention.cumsum(-1) - 1).clamp_min(0),  # (B, T)
        **_non_tensor_fields(items, {"input_ids"}),
    }


def collate_sft(items: Sequence[Mapping[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """Right-pad prompt + answer sequences for training.

    Returns:
        ``input_ids``, ``attention_mask`` and ``loss_mask`` (1 on answer tokens and EOS),
        each ``(B, T)``, and ``index`` as a list.
    """
    ids = [item["input_ids"] for item in items]
    return {
        "input_ids": pad_sequences(ids, pad_token_id, "right"),  # (B, T)
        "attention_mask": pad_sequences([[1] * len(s) for s in ids], 0, "right"),  # (B, T)
        "loss_mask": pad_sequences([item["loss_mask"] for item in items], 0, "right"),  # (B, T)
        **_non_tensor_fields(items, {"input_ids", "loss_mask"}),
    }


def collate_preferences(items: Sequence[Mapping[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """Right-pad chosen and rejected sequences to one common length ``T`` so that a DPO step
    can concatenate them along the batch dim.

    Returns:
        ``{chosen,rejected}_{input_ids,attention_mask,loss_mask}``, each ``(B, T)``.
    """
    length = max(len(item[f"{side}_input_ids"]) for item in items for side in ("chosen", "rejected"))
    batch: dict[str, Any] = {}
    for side in ("chosen", "rejected"):
        ids = [item[f"{side}_input_ids"] for item in items]
        batch[f"{side}_input_ids"] = pad_sequences(ids, pad_token_id, "right", length)
        batch[f"{side}_attention_mask"] = pad_sequences([[1] * len(s) for s in ids], 0, "right", length)
        batch[f"{side}_loss_mask"] = pad_sequences([item[f"{side}_loss_mask"] for item in items], 0, "right", length)
    tensor_keys = {f"{side}_{k}" for side in ("chosen", "rejected") for k in ("input_ids", "loss_mask")}
    return {**batch, **_non_tensor_fields(items, tensor_keys)}
