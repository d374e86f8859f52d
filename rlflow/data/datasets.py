"""JSONL datasets (prompts, prompt + answer, paired preferences) and their collates.

Every dataset reads and tokenises its whole file when built, so a bad line (invalid JSON,
bytes that are not UTF-8, a missing field) or an over-long example fails at start-up with
``<file>:<line>`` in the message, not hours into a run; an empty file is named as empty. Over-long examples raise unless truncation is configured; truncation is counted
(``num_truncated``) and reported with a warning, never silent.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

__all__ = [
    "DatasetFormatError",
    "PreferenceDataset",
    "PromptDataset",
    "SFTDataset",
    "collate_preferences",
    "collate_prompts",
    "collate_sft",
    "pad_sequences",
    "read_jsonl",
]


class DatasetFormatError(ValueError):
    """A dataset line is malformed or too long; the message starts with ``file:line``."""


def read_jsonl(path: str | os.PathLike, fields: Mapping[str, type | tuple[type, ...]]) -> list[dict[str, Any]]:
    """Read a JSONL file of objects, checking that each has ``fields`` with the given types.

    Blank lines are skipped; other fields are kept as they are.

    Args:
        path: the file.
        fields: required field name → accepted type(s).

    Returns:
        One dict per non-blank line, each with ``"_line"`` (its 1-based line number) added.

    Raises:
        DatasetFormatError: bytes that are not UTF-8, invalid JSON, not an object, missing field
            or wrong type (the message names the file and line), or a file without a single
            JSON line (named as empty).
    """
    records = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            where = f"{path}:{line_no}"
            line = _decoded(raw, where)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetFormatError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            _check_record(record, fields, where)
            records.append({**record, "_line": line_no})
    if not records:
        what = "is empty" if os.path.getsize(path) == 0 else "holds only blank lines"
        raise DatasetFormatError(f"{path}: the file {what}; a dataset needs one JSON object per line")
    return records


def _decoded(raw: bytes, where: str) -> str:
    """One line as text; bytes that are not UTF-8 are named with their column (1-based, in bytes)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        byte = raw[e.start : e.start + 1].hex()
        raise DatasetFormatError(
            f"{where}: not UTF-8: byte 0x{byte} at column {e.start + 1} ({e.reason}); save the file as UTF-8"
        ) from None


def _check_record(record: Any, fields: Mapping[str, type | tuple[type, ...]], where: str) -> None:
    if not isinstance(record, dict):
        raise DatasetFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for name, kind in fields.items():
        if name not in record:
            raise DatasetFormatError(f"{where}: missing field {name!r} (has {sorted(record)})")
        if not isinstance(record[name], kind):
            raise DatasetFormatError(
                f"{where}: field {name!r} should be {_type_name(kind)}, got {type(record[name]).__name__}"
            )


def _type_name(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in kind) if isinstance(kind, tuple) else kind.__name__


_ITEM_KEYS = ("index", "input_ids", "loss_mask")  # what a dataset adds to a record's fields


class _JsonlDataset:
    """Shared plumbing: load records, tokenise them, count truncations, index items."""

    fields: dict[str, type | tuple[type, ...]] = {}
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
        if isinstance(source, (str, os.PathLike)):
            records = read_jsonl(source, self.fields)
        else:
            records = []
            for i, record in enumerate(source):
                _check_record(record, self.fields, f"{self.source}:{i + 1}")
                records.append({**record, "_line": i + 1})
            if not records:
                raise DatasetFormatError(f"{self.source}: no records; a dataset needs at least one")
        self.lines = [r["_line"] for r in records]  # of each item, for errors that name file:line
        self.items = [self._build_item(i, r) for i, r in enumerate(records)]
        if self.num_truncated:
            warnings.warn(
                f"{self.source}: truncated {self.num_truncated} of {len(self.items)} examples ({truncation})",
                stacklevel=2,
            )

    def _build_item(self, index: int, record: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def _where(self, record: Mapping[str, Any]) -> str:
        return f"{self.source}:{record['_line']}"

    def where(self, index: int) -> str:
        """``file:line`` of item ``index`` (``<records>:<n>`` for records given in memory)."""
        return f"{self.source}:{self.lines[index]}"

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def __len__(self) -> int:
        return len(self.items)

    @property
    def columns(self) -> tuple[str, ...]:
        """The fields of the records (``_line`` and the tokenised fields left out), in first-seen order."""
        return tuple(dict.fromkeys(k for item in self.items for k in item if k not in _ITEM_KEYS))

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.items[index]


class PromptDataset(_JsonlDataset):
    """Prompts for rollouts: lines ``{"prompt": str | list[message], ...}``; every other field
    (``ground_truth``, ``answer``, any column a reward function reads) travels with the item.

    A conversational prompt (TRL's format: a list of ``{"role": ..., "content": ...}``
    messages) is rendered with the tokenizer's chat template, ending with the generation
    prompt; a tokenizer without a chat template refuses it.

    Args:
        source: a JSONL path, or records (dicts) already in memory.
        tokenizer: encodes the prompt with its special tokens (BOS).
        max_prompt_length: longest prompt in tokens.
        truncation: ``"error"``, ``"left"`` (drop the beginning after BOS, keep the end next
            to the answer) or ``"right"``.

    Items: ``{"index": int, "input_ids": list[int], "prompt": str | list, **other fields}``.
    """

    fields = {"prompt": (str, list)}
    truncation_modes = ("error", "left", "right")

    def __init__(self, source, tokenizer, max_prompt_length: int, truncation: str = "error") -> None:
        self.max_prompt_length = max_prompt_length
        super().__init__(source, tokenizer, truncation)

    def _prompt_ids(self, record: dict[str, Any]) -> list[int]:
        prompt = record["prompt"]
        if isinstance(prompt, str):
            return self._encode(prompt, add_special_tokens=True)
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise DatasetFormatError(
                f"{self._where(record)}: the prompt is a list of messages, but the tokenizer has no chat "
                "template to render it; give plain-string prompts or a tokenizer with a chat template"
            )
        text = self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        return self._encode(text, add_special_tokens=False)  # the template writes its own special tokens

    def _build_item(self, index: int, record: dict[str, Any]) -> dict[str, Any]:
        ids = self._prompt_ids(record)
        if len(ids) > self.max_prompt_length:
            if self.truncation == "error":
                raise DatasetFormatError(
                    f"{self._where(record)}: prompt has {len(ids)} tokens > max_prompt_length={self.max_prompt_length} "
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
        reserved = {"index", "input_ids"} & set(record)
        if reserved:
            raise DatasetFormatError(f"{self._where(record)}: field(s) {sorted(reserved)} are reserved for rlflow")
        extra = {k: v for k, v in record.items() if k not in ("prompt", "_line")}
        return {"index": index, "input_ids": ids, "prompt": record["prompt"], **extra}

    def collate(self, items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return collate_prompts(items, self.tokenizer.pad_token_id)


class SFTDataset(_JsonlDataset):
    """Supervised pairs: lines ``{"prompt": str, "answer": str}``; the loss covers the answer
    and the EOS token, not the prompt.

    Args:
        source: a JSONL path, or records in memory.
        tokenizer: encodes ``prompt`` with special tokens and ``answer`` without; EOS follows.
        max_length: longest prompt + answer + EOS in tokens.
        truncation: ``"error"`` or ``"right"`` (cut the end of the answer); a prompt that
            leaves no answer token raises either way.
        answer_field: the field holding the answer (``"chosen"``: SFT on the chosen answers of
            a preference file, as before DPO).

    Items: ``{"index", "input_ids": list[int], "loss_mask": list[int]}``.
    """

    fields = {"prompt": str, "answer": str}
    truncation_modes = ("error", "right")

    def __init__(
        self, source, tokenizer, max_length: int, truncation: str = "error", answer_field: str = "answer"
    ) -> None:
        self.max_length, self.answer_field = max_length, answer_field
        self.fields = {"prompt": str, answer_field: str}
        super().__init__(source, tokenizer, truncation)

    def _build_item(self, index: int, record: dict[str, Any]) -> dict[str, Any]:
        field = self.answer_field
        ids, mask = _prompt_and_response(self, record, record[field], self.max_length, field)
        return {"index": index, "input_ids": ids, "loss_mask": mask}

    def collate(self, items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return collate_sft(items, self.tokenizer.pad_token_id)


class PreferenceDataset(_JsonlDataset):
    """Paired preferences: lines ``{"prompt": str, "chosen": str, "rejected": str}``.

    Args: as :class:`SFTDataset`; ``max_length`` bounds each of prompt + chosen and
    prompt + rejected.

    Items: ``{"index", "chosen_input_ids", "chosen_loss_mask", "rejected_input_ids",
    "rejected_loss_mask"}``.
    """

    fields = {"prompt": str, "chosen": str, "rejected": str}
    truncation_modes = ("error", "right")

    def __init__(self, source, tokenizer, max_length: int, truncation: str = "error") -> None:
        self.max_length = max_length
        super().__init__(source, tokenizer, truncation)

    def _build_item(self, index: int, record: dict[str, Any]) -> dict[str, Any]:
        item: dict[str, Any] = {"index": index}
        for side in ("chosen", "rejected"):
            ids, mask = _prompt_and_response(self, record, record[side], self.max_length, side)
            item[f"{side}_input_ids"], item[f"{side}_loss_mask"] = ids, mask
        return item

    def collate(self, items: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        return collate_preferences(items, self.tokenizer.pad_token_id)


def _prompt_and_response(
    dataset: _JsonlDataset, record: Mapping[str, Any], response: str, max_length: int, field: str
) -> tuple[list[int], list[int]]:
    """Token ids of prompt + response + EOS, and the loss mask (1 on response and EOS)."""
    prompt_ids = dataset._encode(record["prompt"], add_special_tokens=True)
    eos = dataset.tokenizer.eos_token_id
    response_ids = dataset._encode(response, add_special_tokens=False) + ([] if eos is None else [eos])
    ids = prompt_ids + response_ids
    if len(ids) > max_length:
        where = f"{dataset._where(record)}: prompt + {field} has {len(ids)} tokens > max_length={max_length}"
        if dataset.truncation == "error":
            raise DatasetFormatError(where)
        if len(prompt_ids) >= max_length:
            raise DatasetFormatError(f"{where}, and the prompt alone ({len(prompt_ids)}) leaves no {field} token")
        dataset.num_truncated += 1
        ids = ids[:max_length]
    return ids, [0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids))


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
