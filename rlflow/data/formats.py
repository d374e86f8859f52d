"""TRL's dataset formats: the columns a row holds, and its text once a chat template renders it.

A value is *standard* (a string) or *conversational* (a list of ``{"role", "content"}`` messages).
Conversational text follows TRL: a prompt is rendered up to where the model answers (the
generation prompt after a user turn; a final assistant turn is continued), and a completion is
what the template writes after that prompt when it renders prompt + completion, so the loss
falls on the completion's own tokens and the template's end of turn. A preference row without
``prompt`` has an implicit one: the shared beginning of ``chosen`` and ``rejected``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from transformers import PreTrainedTokenizerBase

from rlflow.data.files import DatasetFormatError

__all__ = [
    "PREFERENCE_COLUMNS",
    "check_text",
    "is_messages",
    "preference_parts",
    "render_conversation",
    "render_prompt",
    "split_completion",
]

Text = str | list[dict[str, Any]]  # standard or conversational
PREFERENCE_COLUMNS = "; a preference row holds 'chosen' and 'rejected', and 'prompt' unless they share it"


def is_messages(value: Any) -> bool:
    """A non-empty list (or tuple) of ``{"role", "content"}`` dicts: a conversation, as TRL tells them.

    >>> is_messages([{"role": "user", "content": "2+2?"}]), is_messages("2+2?")
    (True, False)
    """
    return (
        isinstance(value, (list, tuple))
        and bool(value)
        and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in value)
    )


def check_text(row: Mapping[str, Any], column: str, where: str, expected: str = "") -> None:
    """``row[column]`` is a string or a list of messages.

    Raises:
        DatasetFormatError: the column is missing (the message ends with ``expected``, the columns
            such a row holds) or holds something else; names ``where`` and the column.
    """
    if column not in row:
        raise DatasetFormatError(f"{where}: missing field {column!r} (has {sorted(row)}){expected}")
    value = row[column]
    if not (isinstance(value, str) or is_messages(value)):
        got = "a list that is not {'role', 'content'} messages" if isinstance(value, list) else type(value).__name__
        raise DatasetFormatError(f"{where}: field {column!r} should be str or a list of messages, got {got}")


def _template(tokenizer: PreTrainedTokenizerBase, where: str, column: str) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise DatasetFormatError(
            f"{where}: column {column!r} holds messages, but the tokenizer has no chat template to render them; "
            "give plain strings, or a tokenizer with a chat template (its chat_template)"
        )


def render_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], where: str, column: str) -> str:
    """Messages rendered up to where the model answers: with the generation prompt, or continuing
    a final assistant message (TRL's rule)."""
    _template(tokenizer, where, column)
    final_assistant = messages[-1]["role"] == "assistant"
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=not final_assistant, continue_final_message=final_assistant
    )


def render_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]], where: str, column: str
) -> str:
    """A whole conversation rendered by the chat template (language modelling on ``messages``)."""
    _template(tokenizer, where, column)
    return tokenizer.apply_chat_template(messages, tokenize=False)


def split_completion(
    tokenizer: PreTrainedTokenizerBase,
    prompt: list[dict[str, Any]],
    completion: list[dict[str, Any]],
    where: str,
    column: str,
) -> tuple[str, str]:
    """The rendered prompt, and what the template adds after it when it renders prompt + completion.

    Raises:
        DatasetFormatError: the template renders prompt + completion with another beginning than
            the prompt alone, so no completion can be cut from it.
    """
    prompt_text = render_prompt(tokenizer, prompt, where, column)
    full = render_conversation(tokenizer, prompt + completion, where, column)
    if not full.startswith(prompt_text):
        raise DatasetFormatError(
            f"{where}: the chat template renders prompt + {column} into a text that does not start with the "
            f"prompt rendered alone, so no {column} can be cut from it"
        )
    return prompt_text, full[len(prompt_text) :]


def preference_parts(row: Mapping[str, Any], where: str) -> tuple[Text, Text, Text]:
    """``(prompt, chosen, rejected)`` of a preference row, the prompt explicit or implicit.

    Without ``prompt``, the prompt is the shared beginning of ``chosen`` and ``rejected``: their
    common messages, or their common characters up to a space, the space kept in the answers (TRL's
    rule).

    >>> preference_parts({"chosen": "The sky is blue.", "rejected": "The sky is green."}, "<records>:1")
    ('The sky is', ' blue.', ' green.')

    Raises:
        DatasetFormatError: ``chosen`` or ``rejected`` missing or malformed, strings beside messages,
            or conversations without a common first message.
    """
    columns = ("prompt", "chosen", "rejected") if "prompt" in row else ("chosen", "rejected")
    for column in columns:
        check_text(row, column, where, PREFERENCE_COLUMNS)
    values = [row[c] for c in columns]
    if len({isinstance(v, str) for v in values}) > 1:
        raise DatasetFormatError(f"{where}: {list(columns)} mix strings and messages; give all as one or the other")
    if "prompt" in row:
        return row["prompt"], row["chosen"], row["rejected"]
    chosen, rejected = row["chosen"], row["rejected"]
    if isinstance(chosen, str):
        cut = len(os.path.commonprefix([chosen, rejected]))
        if cut > 0 and chosen[cut - 1] == " ":
            cut -= 1
        return chosen[:cut], chosen[cut:], rejected[cut:]
    cut = 0
    while cut < min(len(chosen), len(rejected)) and chosen[cut] == rejected[cut]:
        cut += 1
    if cut == 0 or cut == min(len(chosen), len(rejected)):
        what = "no first message" if cut == 0 else "every message of the shorter one"
        raise DatasetFormatError(
            f"{where}: without a 'prompt' column the prompt is what 'chosen' and 'rejected' share, and they share {what}"
        )
    return chosen[:cut], chosen[cut:], rejected[cut:]
