"""Text the model reads around tool calls: the prompt that offers the tools, and tool results.

Two formats (:data:`rlflow.workers.tools.CALL_FORMATS`), chosen by :func:`call_format`:

* ``hermes``, for a chat template that takes ``tools=`` and teaches ``<tool_call>`` (Qwen 2.5 /
  Qwen 3, Hermes): the template itself lists the tools and renders each result in its ``tool``
  role (Qwen's: ``<tool_response>...</tool_response>`` inside a user turn).
* ``tag``, for any other tokenizer, with or without a chat template. A system message (prefixed
  to the prompt's own system message, or before the prompt text without a template) says::

      You can call these tools. Each is described by a JSON schema:
      {"type": "function", "function": {"name": "multiply", ...}}
      To call a tool, write <call>{"name": "<tool name>", "arguments": {<argument>: <value>}}</call>;
      you may make several calls in one turn. Each result comes back as <result name="<tool name>">...</result>.

  Results are rendered in the template's ``tool`` role where it has one, else as a user turn
  holding the ``<result>`` elements, else (no template) as the ``<result>`` lines themselves.
  The listing (:data:`TOOL_LISTINGS`) may be shorter: one signature line per tool, or nothing at
  all when SFT traces teach the calls (a character-level tokenizer pays one token per character).

Observations are the text the template puts *after* the model's turn: when a turn ended on the
template's end-of-turn token (``<|im_end|>``), pass its text as ``stop_text`` so that it is not
written twice.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from rlflow.workers.tool_runner import ToolResult

__all__ = [
    "TOOL_LISTINGS",
    "call_format",
    "render_observation",
    "render_prompt",
    "stop_sequences",
    "tag_tools_prompt",
    "tool_messages",
    "tool_signature",
]

Messages = list[dict[str, Any]]
_SENTINEL = "\x00rlflow-sentinel\x00"
# What a chat template does with tools never changes: each is rendered once per process.
_FORMAT: dict[str, str] = {}  # chat template -> its call format
_TOOL_ROLE: dict[str, bool] = {}  # chat template -> whether it renders the tool role
# What a tool call's JSON ends on before its closing tag (the arguments' last value, then one or two
# braces), or a space or newline: a BPE tokenizer may merge such a run of punctuation with the tag's start.
_BEFORE_TAG = ("", "}", "}}", "}}}", '"}}', "]}}", "\n", "}\n", " ")
# How the tag format lists the tools in the prompt: each tool's JSON schema, its one-line signature, or nothing.
TOOL_LISTINGS = ("schema", "signature", "none")
# JSON-schema types as a Python signature writes them.
_PY_TYPES = {"integer": "int", "number": "float", "string": "str", "boolean": "bool", "array": "list", "object": "dict"}
_PROBE_TOOL = {"type": "function", "function": {"name": "rlflow_probe_tool", "description": "probe", "parameters": {}}}


def call_format(tokenizer: PreTrainedTokenizerBase) -> str:
    """``"hermes"`` when the tokenizer's chat template lists ``tools=`` and teaches ``<tool_call>``, else ``"tag"``."""
    template = tokenizer.chat_template
    if not isinstance(template, str) or "<tool_call>" not in template:
        return "tag"
    if template not in _FORMAT:  # rendered once per template
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}], tools=[_PROBE_TOOL], add_generation_prompt=True, tokenize=False
            )
            _FORMAT[template] = "hermes" if "rlflow_probe_tool" in text else "tag"
        except Exception:  # a template that refuses tools= cannot offer them
            _FORMAT[template] = "tag"
    return _FORMAT[template]


def tag_tools_prompt(schemas: Sequence[Mapping[str, Any]], listing: str = "schema") -> str:
    """The system text that offers ``schemas`` in the ``tag`` format (see the module docstring).

    Args:
        schemas: the tools' JSON schemas.
        listing: ``"schema"`` (each schema as JSON, the call and result syntax), ``"signature"``
            (each tool's :func:`tool_signature`, the call syntax) or ``"none"`` (empty text).

    Raises:
        ValueError: ``listing`` is not one of :data:`TOOL_LISTINGS`.
    """
    if listing == "none":
        return ""
    if listing == "signature":
        lines = "\n".join(tool_signature(s) for s in schemas)
        return f'You can call these tools:\n{lines}\nTo call one, write <call>{{"name": ..., "arguments": {{...}}}}</call>.'
    if listing != "schema":
        raise ValueError(f"tag_tools_prompt: listing={listing!r}; expected one of {list(TOOL_LISTINGS)}")
    lines = "\n".join(json.dumps(s) for s in schemas)
    return (
        "You can call these tools. Each is described by a JSON schema:\n"
        f"{lines}\n"
        'To call a tool, write <call>{"name": "<tool name>", "arguments": {<argument>: <value>}}</call>; '
        'you may make several calls in one turn. Each result comes back as <result name="<tool name>">...</result>.'
    )


def tool_signature(schema: Mapping[str, Any]) -> str:
    """One line for a tool's JSON schema: its name, typed arguments, return type and description.

    >>> ints = {"a": {"type": "integer"}, "b": {"type": "integer"}}
    >>> fn = {"name": "multiply", "description": "Multiplies two integers.", "parameters": {"properties": ints}}
    >>> tool_signature({"type": "function", "function": {**fn, "return": {"type": "integer"}}})
    'multiply(a: int, b: int) -> int: Multiplies two integers.'
    """
    fn = schema["function"]
    params = fn.get("parameters", {}).get("properties", {})
    args = ", ".join(f"{name}: {_py_type(p)}" for name, p in params.items())
    returns = f" -> {_py_type(fn['return'])}" if "return" in fn else ""
    description = f": {fn['description']}" if fn.get("description") else ""
    return f"{fn['name']}({args}){returns}{description}"


def _py_type(prop: Mapping[str, Any]) -> str:
    kind = prop.get("type", "any")
    kinds = kind if isinstance(kind, list) else [kind]
    return " | ".join(_PY_TYPES.get(k, "None" if k == "null" else k) for k in kinds)


def render_prompt(
    tokenizer: PreTrainedTokenizerBase,
    prompt: str | Messages,
    schemas: Sequence[Mapping[str, Any]],
    fmt: str,
    listing: str = "schema",
) -> str:
    """The first turn's text: ``prompt`` (text or chat messages) offering the tools ``schemas`` in ``fmt``.

    ``listing`` (:data:`TOOL_LISTINGS`) is how the ``tag`` format lists them; a ``hermes`` template
    lists them itself.
    """
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if fmt == "hermes":
        return tokenizer.apply_chat_template(messages, tools=list(schemas), add_generation_prompt=True, tokenize=False)
    offer = tag_tools_prompt(schemas, listing)  # empty with listing "none": the prompt as it is
    if offer and messages and messages[0]["role"] == "system":
        messages[0]["content"] = f"{offer}\n\n{messages[0]['content']}"
    elif offer:
        messages.insert(0, {"role": "system", "content": offer})
    if tokenizer.chat_template is None:
        return "\n\n".join(m["content"] for m in messages) + "\n"
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def tool_messages(results: Sequence[ToolResult]) -> Messages:
    """The results as chat messages of the ``tool`` role, as TRL and the chat templates take them."""
    return [{"role": "tool", "name": r.name, "content": r.content} for r in results]


def render_observation(tokenizer: PreTrainedTokenizerBase, messages: Messages, stop_text: str = "") -> str:
    """The text after a model's turn that shows it ``messages`` and opens its next turn.

    ``tool`` messages (:func:`tool_messages`) take the template's ``tool`` role where it has one,
    else they become one user turn of ``<result>`` elements; other messages keep their role.

    Args:
        tokenizer: the policy's tokenizer.
        messages: what the environment answers, e.g. the turn's tool results in the order of the calls.
        stop_text: the text the turn ended on, when it is the start of what the template writes
            after a turn (its end-of-turn token): left out of the observation.
    """
    if tokenizer.chat_template is None:
        return "\n" + "".join(f"{_plain(m)}\n" for m in messages)
    if not _has_tool_role(tokenizer):
        messages = _results_as_user_turns(messages)
    text = _after_turn(tokenizer, list(messages))
    return text[len(stop_text) :] if stop_text and text.startswith(stop_text) else text


def _plain(message: Mapping[str, Any]) -> str:
    if message["role"] != "tool":
        return message["content"]
    return f'<result name="{message.get("name", "")}">{message["content"]}</result>'


def _results_as_user_turns(messages: Messages) -> Messages:
    """Runs of ``tool`` messages merged into one user message of ``<result>`` elements each."""
    out: Messages = []
    for i, m in enumerate(messages):
        if m["role"] == "tool" and i and messages[i - 1]["role"] == "tool":
            out[-1]["content"] += "\n" + _plain(m)
        else:
            out.append({"role": "user", "content": _plain(m)} if m["role"] == "tool" else dict(m))
    return out


def _has_tool_role(tokenizer: PreTrainedTokenizerBase) -> bool:
    template = tokenizer.chat_template
    if template not in _TOOL_ROLE:
        try:
            _TOOL_ROLE[template] = _SENTINEL in _after_turn(
                tokenizer, [{"role": "tool", "name": "t", "content": _SENTINEL}]
            )
        except Exception:  # a template that raises on an unknown role has none
            _TOOL_ROLE[template] = False
    return _TOOL_ROLE[template]


def _after_turn(tokenizer: PreTrainedTokenizerBase, messages: Messages) -> str:
    """What the template writes after an assistant turn's content when ``messages`` follow it."""
    turn = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL}]
    text = tokenizer.apply_chat_template(turn + messages, add_generation_prompt=True, tokenize=False)
    start = text.index(_SENTINEL) + len(_SENTINEL)
    return text[start:]


def stop_sequences(tokenizer: PreTrainedTokenizerBase, strings: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The token-id sequences a sampled turn that ends on one of ``strings`` (closing tags) ends with.

    For each string: its tokenization, and its tokenization after what a call's JSON may end on
    (``}``, ``}}``, ``"}}``, ``]}}``..., a newline, a space), cut to the shortest run of last tokens
    whose text holds the whole string (a tokenizer that merges ``}}</`` into one token gives a
    sequence starting with it). The sampler matches these ids, not text: the same tag written with
    other token boundaries is not seen, and the turn goes on to its end-of-turn token or its token
    limit.

    >>> from rlflow.data.tokenizer import build_char_tokenizer
    >>> stop_sequences(build_char_tokenizer("</cal>"), ["</call>"])
    ((4, 5, 6, 7, 8, 8, 9),)
    """
    out: dict[tuple[int, ...], None] = {}
    for string in strings:
        if not string:
            raise ValueError("stop_sequences: an empty stop string would end every turn at once")
        for before in _BEFORE_TAG:
            ids = tokenizer(before + string, add_special_tokens=False).input_ids
            start = len(ids) - 1
            while start > 0 and string not in tokenizer.decode(ids[start:]):
                start -= 1
            if string in tokenizer.decode(ids[start:]):
                out[tuple(ids[start:])] = None
    return tuple(out)
