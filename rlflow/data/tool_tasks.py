"""A tool for the arithmetic task, and the traces that teach a policy to call it.

``recipes/grpo_tools_arithmetic.yaml`` names them by import path: the policy may call
:func:`multiply` (``rollout.multi_turn.tools``), and its SFT warm-up writes the turns of
:func:`multiply_traces` (``warmup.tool_traces``) — a call in the plain tag format, then the answer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["multiply", "multiply_traces"]

_PRODUCT = re.compile(r"^\s*(-?\d+)\s*\*\s*(-?\d+)\s*=\s*$")


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


def multiply_traces(row: Mapping[str, Any]) -> list[str]:
    """The turns a policy with :func:`multiply` should write for a product prompt ``"a*b="``: the call,
    then the row's answer.

    >>> multiply_traces({"prompt": "12*34=", "answer": "408"})
    ['<call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</call>', '408']

    Raises:
        ValueError: the prompt is not ``a*b=``.
    """
    match = _PRODUCT.match(str(row["prompt"]))
    if match is None:
        raise ValueError(f"multiply_traces: prompt {row['prompt']!r} is not of the form 'a*b='")
    call = {"name": "multiply", "arguments": {"a": int(match.group(1)), "b": int(match.group(2))}}
    return [f"<call>{json.dumps(call)}</call>", str(row["answer"])]
