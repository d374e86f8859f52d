"""Python functions as tools, in TRL's convention, and the calls a model writes to them.

A tool is a typed function with a Google-style docstring; ``transformers.utils.get_json_schema``
turns its signature and docstring into the JSON schema that ``apply_chat_template(tools=...)``
shows the model::

    def multiply(a: int, b: int) -> int:
        \"\"\"Multiplies two integers.

        Args:
            a: the first factor.
            b: the second factor.
        \"\"\"
        return a * b

A model calls tools in one of two formats, several calls a turn, each a JSON object
``{"name": ..., "arguments": {...}}``:

* ``hermes``: ``<tool_call>{...}</tool_call>``, what Qwen's and the Hermes chat templates teach;
* ``tag``: ``<call>{...}</call>``, for tokenizers whose template knows no tools (the prompt
  describes the tools and this format: :func:`rlflow.workers.tool_render.tag_tools_prompt`).

A call that cannot run (bad JSON, an unknown tool, wrong arguments) is not an exception: it is a
:class:`ToolCall` whose ``error`` says what went wrong, which :class:`~rlflow.workers.tool_runner.ToolRunner`
turns into an observation for the model and counts.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers.utils import get_json_schema
from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

__all__ = ["CALL_FORMATS", "Tool", "ToolCall", "build_tools", "check_arguments", "parse_tool_calls"]

# Opening and closing tag of a call, per format.
CALL_FORMATS = {"hermes": ("<tool_call>", "</tool_call>"), "tag": ("<call>", "</call>")}
# JSON-schema types and the Python values that satisfy them (bool is an int in Python, not in JSON).
_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


@dataclass(frozen=True)
class Tool:
    """A function the model may call, with the JSON schema its chat template shows.

    Attributes:
        fn: the function.
        schema: ``{"type": "function", "function": {"name", "description", "parameters"}}``.
    """

    fn: Callable[..., Any]
    schema: dict[str, Any] = field(repr=False)

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    @classmethod
    def from_function(cls, fn: Callable[..., Any]) -> Tool:
        """The tool of ``fn``, its schema from its type hints and docstring (as TRL builds it).

        Raises:
            TypeError: ``fn`` is not callable, or lacks a type hint or a docstring (or a
                docstring line for an argument); the message names the function.
        """
        name = getattr(fn, "__name__", type(fn).__name__)
        if not callable(fn):
            raise TypeError(f"tool {fn!r} is not callable")
        try:
            schema = get_json_schema(fn)
        except (DocstringParsingException, TypeHintParsingException) as err:
            raise TypeError(
                f"tool {name!r} cannot be described to the model: {err} (a tool needs a type hint on every "
                "argument and a Google-style docstring with an Args: line for each)"
            ) from err
        return cls(fn, schema)


def build_tools(fns: Sequence[Callable[..., Any] | Tool]) -> dict[str, Tool]:
    """``name -> Tool`` of ``fns`` (functions or tools), in their order.

    Raises:
        ValueError: no tool, or two tools of one name (the model could not tell them apart).
        TypeError: a function without type hints or docstring (:meth:`Tool.from_function`).
    """
    tools = [fn if isinstance(fn, Tool) else Tool.from_function(fn) for fn in fns]
    if not tools:
        raise ValueError("tools is empty; give at least one function")
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"tool names {names} repeat; each tool needs its own name")
    return {t.name: t for t in tools}


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote.

    Attributes:
        name: the tool named ("" when the call could not be read far enough to name one).
        arguments: the arguments, checked against the tool's signature (empty when ``error``).
        error: why the call cannot run (bad JSON, unknown tool, wrong arguments); None: it can.
    """

    name: str
    arguments: dict[str, Any]
    error: str | None = None


def parse_tool_calls(
    text: str, tools: Mapping[str, Tool], formats: Sequence[str] = ("hermes", "tag")
) -> list[ToolCall]:
    """Every call in ``text``, in order, each in one of ``formats`` (keys of :data:`CALL_FORMATS`).

    A call opened but never closed (the turn ran out of tokens) is malformed too.

    >>> def add(a: int, b: int) -> int:
    ...     '''Adds.
    ...
    ...     Args:
    ...         a: a number.
    ...         b: another.
    ...     '''
    ...     return a + b
    >>> tools = build_tools([add])
    >>> parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>', tools)
    [ToolCall(name='add', arguments={'a': 1, 'b': 2}, error=None)]
    >>> parse_tool_calls('<call>{"name": "add", "arguments": {"a": "1"}}</call>', tools)[0].error
    "argument 'a' of tool 'add' is '1', not integer; missing argument(s) ['b']"
    """
    unknown = [f for f in formats if f not in CALL_FORMATS]
    if unknown:
        raise ValueError(f"tool-call formats {unknown} are not among {sorted(CALL_FORMATS)}")
    found = []
    for fmt in formats:
        open_, close = (re.escape(t) for t in CALL_FORMATS[fmt])
        for m in re.finditer(rf"{open_}(.*?)(?:{close}|$)", text, flags=re.DOTALL):
            closed = m.group(0).endswith(CALL_FORMATS[fmt][1])
            found.append((m.start(), _read_call(m.group(1), tools, closed, CALL_FORMATS[fmt])))
    return [call for _, call in sorted(found, key=lambda x: x[0])]


def _read_call(body: str, tools: Mapping[str, Tool], closed: bool, tags: tuple[str, str]) -> ToolCall:
    if not closed:
        return ToolCall("", {}, f"{tags[0]} is never closed by {tags[1]}")
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as err:
        return ToolCall("", {}, f"the call is not valid JSON ({err.msg} at character {err.pos}): {body.strip()[:200]}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", {}, 'a call is a JSON object {"name": <tool name>, "arguments": {...}}')
    name, arguments = obj["name"], obj.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI's convention: the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCall(name, {}, f"the arguments of tool {name!r} are not valid JSON")
    if name not in tools:
        return ToolCall(name, {}, f"there is no tool {name!r}; the tools are {sorted(tools)}")
    if not isinstance(arguments, dict):
        return ToolCall(name, {}, f"the arguments of tool {name!r} must be a JSON object, not {arguments!r}")
    error = check_arguments(tools[name], arguments)
    return ToolCall(name, {} if error else arguments, error)


def check_arguments(tool: Tool, arguments: Mapping[str, Any]) -> str | None:
    """What is wrong with ``arguments`` for ``tool`` (types by its schema, names by its signature); None: nothing."""
    params = tool.schema["function"].get("parameters", {})
    properties, problems = params.get("properties", {}), []
    for key, value in arguments.items():
        spec = properties.get(key)
        if spec is None:
            continue  # the signature decides below (a **kwargs tool takes it)
        expected = spec.get("type")
        types = [expected] if isinstance(expected, str) else list(expected or [])
        if spec.get("nullable"):
            types.append("null")
        if types and not any(_JSON_TYPES.get(t, lambda v: True)(value) for t in types):
            problems.append(f"argument {key!r} of tool {tool.name!r} is {value!r}, not {' or '.join(types)}")
    missing = [k for k in params.get("required", []) if k not in arguments]
    if missing:
        problems.append(f"missing argument(s) {missing}")
    if not problems:
        try:
            inspect.signature(tool.fn).bind(**arguments)
        except TypeError as err:
            problems.append(f"tool {tool.name!r} cannot take these arguments: {err}")
    return "; ".join(problems) or None
