"""Rule-based rewards: functions ``(prompt, response, ground_truth) -> float`` in a registry.

Built in:

- ``"numeric_match"``: 1.0 when the response's answer equals the ground-truth number.
- ``"countdown"``: 1.0 when the response is an arithmetic expression over the given numbers
  (each at most once, or exactly once) whose exact value is the target.
- ``"format"``: 1.0 when the response puts its answer inside ``<answer>...</answer>``.

Ground truths are JSON values so that they travel in JSONL datasets (see
``rlflow.data.tasks``). Responses are model output: a malformed one scores 0.0, while a
malformed *ground truth* is a configuration error and raises.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import torch

__all__ = [
    "RewardFn",
    "compute_rule_rewards",
    "countdown_reward",
    "evaluate_expression",
    "extract_answer",
    "format_reward",
    "get_reward",
    "list_rewards",
    "make_format_reward",
    "numeric_match_reward",
    "register_reward",
]

RewardFn = Callable[[str, str, Any], float]
_REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a reward function under ``name``; refuses duplicate names."""

    def decorator(fn: RewardFn) -> RewardFn:
        if name in _REWARDS:
            raise ValueError(f"reward {name!r} is already registered ({getattr(_REWARDS[name], '__qualname__', '?')})")
        _REWARDS[name] = fn
        return fn

    return decorator


def get_reward(name: str) -> RewardFn:
    """The reward registered under ``name``; ``KeyError`` lists the registered names."""
    if name not in _REWARDS:
        raise KeyError(f"unknown reward {name!r}; registered rewards: {sorted(_REWARDS)}")
    return _REWARDS[name]


def list_rewards() -> list[str]:
    return sorted(_REWARDS)


def compute_rule_rewards(
    name: str, prompts: Sequence[str], responses: Sequence[str], ground_truths: Sequence[Any]
) -> torch.Tensor:
    """Score a batch with the reward registered under ``name``.

    Args:
        name: a registered reward.
        prompts: ``B`` prompt strings.
        responses: ``B`` decoded responses (without special tokens).
        ground_truths: ``B`` ground truths in the reward's format.

    Returns:
        ``(B,)`` float32 rewards.

    >>> compute_rule_rewards("numeric_match", ["1+1=", "2+2="], ["2", "5"], ["2", "4"])
    tensor([1., 0.])
    """
    if not len(prompts) == len(responses) == len(ground_truths):
        raise ValueError(
            f"batch sizes differ: {len(prompts)} prompts, {len(responses)} responses, "
            f"{len(ground_truths)} ground truths"
        )
    fn = get_reward(name)
    scores = [float(fn(p, r, g)) for p, r, g in zip(prompts, responses, ground_truths)]
    return torch.tensor(scores, dtype=torch.float32)


# ----------------------------------------------------------------------------- answers

_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_DEFAULT_MARKERS = ("####", "answer:")


def extract_answer(response: str, marker: str | None = None) -> str | None:
    """The answer number of a response, as written (sign kept, thousands commas removed).

    Looks, in order, inside the last ``<answer>...</answer>`` block, the last ``\\boxed{}``,
    after the last ``marker`` (default markers ``####`` and ``answer:``, case-insensitive);
    the first number found there is the answer. Without any of these, the last number of
    the response is.

    Returns:
        The number's text, or ``None`` when there is none.

    >>> extract_answer("so 3 + 4 = 7. Answer:  12 ")
    '12'
    >>> extract_answer("first 3, then 4")
    '4'
    """
    for pattern in (_ANSWER_TAG, _BOXED):
        blocks = pattern.findall(response)
        if blocks:
            return _first_number(blocks[-1])
    lowered = response.lower()
    for candidate in (marker,) if marker is not None else _DEFAULT_MARKERS:
        position = lowered.rfind(candidate.lower())
        if position >= 0:
            return _first_number(response[position + len(candidate) :])
    numbers = _NUMBER.findall(response)
    return numbers[-1].replace(",", "") if numbers else None


def _first_number(text: str) -> str | None:
    match = _NUMBER.search(text)
    return match.group(0).replace(",", "") if match else None


@register_reward("numeric_match")
def numeric_match_reward(prompt: str, response: str, ground_truth: Any) -> float:
    """1.0 when the response's answer (see :func:`extract_answer`) equals the ground truth.

    Numbers compare exactly as decimals (``"46" == "46.0"``), whitespace around them is
    ignored.

    Args:
        prompt: unused.
        response: model output.
        ground_truth: a number or numeric string, or a dict ``{"answer": number or str,
            "reverse_digits": bool, "marker": str}``: ``reverse_digits`` means the response
            writes the answer's digits in reverse order (``46`` written ``64``; a sign stays
            in front), ``marker`` the text the answer follows.

    >>> numeric_match_reward("12+34=", " 64", {"answer": "46", "reverse_digits": True})
    1.0
    """
    answer, reverse_digits, marker = _numeric_ground_truth(ground_truth)
    found = extract_answer(response, marker)
    if found is None:
        return 0.0
    if reverse_digits:
        sign = found[0] if found[0] in "+-" else ""
        found = sign + found[len(sign) :][::-1]
    try:
        return 1.0 if Fraction(found) == answer else 0.0
    except (ValueError, ZeroDivisionError):
        return 0.0


def _numeric_ground_truth(ground_truth: Any) -> tuple[Fraction, bool, str | None]:
    options: dict[str, Any] = ground_truth if isinstance(ground_truth, dict) else {"answer": ground_truth}
    unknown = set(options) - {"answer", "reverse_digits", "marker"}
    if unknown or "answer" not in options:
        raise ValueError(
            f"numeric_match ground truth {ground_truth!r}: expected a number or a dict with 'answer' "
            f"and optional 'reverse_digits', 'marker' (unknown keys: {sorted(unknown)})"
        )
    value = options["answer"]
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"numeric_match ground truth answer {value!r} is not a number")
    try:
        answer = Fraction(repr(value) if isinstance(value, float) else str(value).strip().replace(",", ""))
    except ValueError:
        raise ValueError(f"numeric_match ground truth answer {value!r} is not a number") from None
    return answer, bool(options.get("reverse_digits", False)), options.get("marker")


# ----------------------------------------------------------------------------- countdown

_TOKEN = re.compile(r"\s*(?:(\d+)|(.))")
_OPERATORS = {"×": "*", "x": "*", "÷": "/", "−": "-"}


def evaluate_expression(text: str) -> tuple[Fraction, list[int]]:
    """Evaluate an arithmetic expression exactly, without ``eval``.

    Grammar: ``expr := term (('+'|'-') term)*``, ``term := factor (('*'|'/') factor)*``,
    ``factor := integer | '(' expr ')'``; ``×``/``x`` and ``÷`` are read as ``*`` and ``/``.
    No unary minus, no decimals: countdown builds on the given positive integers.

    Returns:
        ``(value, numbers)``: the exact value and the integer literals in order of use.

    Raises:
        ValueError: unknown character, bad syntax, or division by zero.

    >>> evaluate_expression("(3 + 5) × 7 / 4")
    (Fraction(14, 1), [3, 5, 7, 4])
    """
    tokens: list[str | int] = []
    for number, symbol in _TOKEN.findall(text.strip()):
        if number:
            tokens.append(int(number))
        elif not symbol.isspace():
            symbol = _OPERATORS.get(symbol, symbol)
            if symbol not in "+-*/()":
                raise ValueError(f"unexpected character {symbol!r} in {text!r}")
            tokens.append(symbol)
    parser = _Parser(tokens, text)
    value = parser.expr()
    if parser.position != len(tokens):
        raise ValueError(f"unexpected {tokens[parser.position]!r} in {text!r}")
    return value, parser.numbers


class _Parser:
    """Recursive-descent parser over the token list; one method per grammar rule."""

    def __init__(self, tokens: list[str | int], text: str) -> None:
        self.tokens, self.text, self.position, self.numbers = tokens, text, 0, []

    def peek(self) -> str | int | None:
        return self.tokens[self.position] if self.position < len(self.tokens) else None

    def take(self) -> str | int:
        token = self.peek()
        if token is None:
            raise ValueError(f"expression {self.text!r} ends too early")
        self.position += 1
        return token

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = value + self.term() if self.take() == "+" else value - self.term()
        return value

    def term(self) -> Fraction:
        value = self.factor()
        while self.peek() in ("*", "/"):
            if self.take() == "*":
                value *= self.factor()
                continue
            divisor = self.factor()
            if divisor == 0:
                raise ValueError(f"division by zero in {self.text!r}")
            value /= divisor
        return value

    def factor(self) -> Fraction:
        token = self.take()
        if isinstance(token, int):
            self.numbers.append(token)
            return Fraction(token)
        if token == "(":
            value = self.expr()
            if self.take() != ")":
                raise ValueError(f"unbalanced parentheses in {self.text!r}")
            return value
        raise ValueError(f"unexpected {token!r} in {self.text!r}")


@register_reward("countdown")
def countdown_reward(prompt: str, response: str, ground_truth: Any) -> float:
    """1.0 when the response's equation reaches the target with the allowed numbers.

    The equation is the last ``<answer>...</answer>`` block if any, else the last non-empty
    line; a trailing ``= result`` is ignored (the value is computed, not trusted).

    Args:
        prompt: unused.
        response: model output.
        ground_truth: dict ``{"numbers": [int, ...], "target": int, "use_all": bool}``;
            with ``use_all`` (default True) every number is used exactly once, otherwise each
            at most once.

    >>> countdown_reward("", "<answer>(7 - 3) * 5</answer>", {"numbers": [3, 5, 7], "target": 20})
    1.0
    """
    numbers, target, use_all = _countdown_ground_truth(ground_truth)
    blocks = _ANSWER_TAG.findall(response)
    lines = [line for line in response.splitlines() if line.strip()]
    equation = blocks[-1] if blocks else (lines[-1] if lines else "")
    try:
        value, used = evaluate_expression(equation.split("=")[0])
    except ValueError:
        return 0.0
    available, used_counts = Counter(numbers), Counter(used)
    if any(used_counts[n] > available[n] for n in used_counts) or (use_all and used_counts != available):
        return 0.0
    return 1.0 if value == target else 0.0


def _countdown_ground_truth(ground_truth: Any) -> tuple[list[int], Fraction, bool]:
    if not isinstance(ground_truth, dict) or not {"numbers", "target"} <= set(ground_truth):
        raise ValueError(f"countdown ground truth {ground_truth!r}: expected a dict with 'numbers' and 'target'")
    numbers = ground_truth["numbers"]
    if not isinstance(numbers, list) or not all(isinstance(n, int) and n >= 0 for n in numbers):
        raise ValueError(f"countdown ground truth numbers {numbers!r}: expected a list of non-negative integers")
    return numbers, Fraction(ground_truth["target"]), bool(ground_truth.get("use_all", True))


# ----------------------------------------------------------------------------- format


def make_format_reward(open_tag: str = "<answer>", close_tag: str = "</answer>") -> RewardFn:
    """Build a reward that is 1.0 when the response holds exactly one non-empty
    ``open_tag ... close_tag`` block, else 0.0. Register variants with
    ``register_reward("my_format")(make_format_reward("[", "]"))``.
    """

    def reward(prompt: str, response: str, ground_truth: Any = None) -> float:
        if response.count(open_tag) != 1 or response.count(close_tag) != 1:
            return 0.0
        start = response.index(open_tag) + len(open_tag)
        end = response.index(close_tag)
        return 1.0 if end > start and response[start:end].strip() else 0.0

    reward.__qualname__ = f"format_reward[{open_tag}...{close_tag}]"
    return reward


format_reward = register_reward("format")(make_format_reward())
format_reward.__doc__ = """1.0 when the response holds exactly one non-empty ``<answer>...</answer>`` block.

>>> format_reward("", "<think>...</think> <answer>42</answer>", None)
1.0
"""
