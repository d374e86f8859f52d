"""Rule-based rewards: functions ``(prompt, response, ground_truth) -> float`` in a registry.

Built in:

- ``"numeric_match"``: 1.0 when the response's answer equals the ground-truth number.
- ``"countdown"``: 1.0 when the response is an arithmetic expression over the given numbers
  (each at most once, or exactly once) whose exact value is the target.
- ``"format"``: 1.0 when the response puts its answer inside ``<answer>...</answer>``.
- ``"code_tests"``: the fraction of the ground truth's unit tests (Python asserts) that the response's
  code passes, run in the sandbox (:mod:`rlflow.workers.code_reward`).
- ``"math_verify"``: 1.0 when the response's final answer is mathematically equal to the
  ground truth (LaTeX, fractions, ``\\boxed{}``, equivalent forms), checked by ``math-verify``
  (the ``math`` extra).

Ground truths are JSON values so that they travel in JSONL datasets (see
``rlflow.data.tasks``). Responses are model output: a malformed one scores 0.0, while a
malformed *ground truth* is a data error: each rule registers what it reads of a ground truth
(``needs_ground_truth``, ``parse_ground_truth``), and :func:`check_ground_truth` refuses a
missing or malformed one when the dataset is loaded, not at step 1 on a worker.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Any

import torch

from rlflow.sandbox import check_tests
from rlflow.workers.code_reward import code_tests_reward
from rlflow.workers.reward_errors import RewardErrors

__all__ = [
    "RewardFn",
    "RuleReward",
    "check_ground_truth",
    "compute_rule_rewards",
    "countdown_reward",
    "evaluate_expression",
    "extract_answer",
    "format_reward",
    "get_reward",
    "get_rule",
    "list_rewards",
    "make_format_reward",
    "math_verify_reward",
    "nan_mean",
    "numeric_match_reward",
    "register_reward",
]

RewardFn = Callable[[str, str, Any], float]


@dataclass(frozen=True)
class RuleReward:
    """A registered rule and what it reads of a row's ground truth.

    Attributes:
        fn: ``(prompt, response, ground_truth) -> float``.
        needs_ground_truth: every row must carry one (``ground_truth``, else ``answer``).
        parse_ground_truth: reads a ground truth, raising ``ValueError`` (or ``TypeError``) for
            a malformed one; ``None``: any value is accepted.
    """

    fn: RewardFn
    needs_ground_truth: bool = True
    parse_ground_truth: Callable[[Any], Any] | None = None


_REWARDS: dict[str, RuleReward] = {}


def register_reward(
    name: str, *, needs_ground_truth: bool = True, parse_ground_truth: Callable[[Any], Any] | None = None
) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering a reward function under ``name``; refuses duplicate names.

    Args:
        name: the name configs give (``algorithm.reward_fn``).
        needs_ground_truth: rows must carry a ground truth; False for a rule that reads none (a format check).
        parse_ground_truth: checks one ground truth at load time (raises ``ValueError`` for a malformed one).
    """

    def decorator(fn: RewardFn) -> RewardFn:
        if name in _REWARDS:
            raise ValueError(
                f"reward {name!r} is already registered ({getattr(_REWARDS[name].fn, '__qualname__', '?')})"
            )
        _REWARDS[name] = RuleReward(fn, needs_ground_truth, parse_ground_truth)
        return fn

    return decorator


def get_rule(name: str) -> RuleReward:
    """The :class:`RuleReward` registered under ``name``; ``KeyError`` lists the registered names."""
    if name not in _REWARDS:
        raise KeyError(f"unknown reward {name!r}; registered rewards: {sorted(_REWARDS)}")
    return _REWARDS[name]


def get_reward(name: str) -> RewardFn:
    """The reward function registered under ``name``; ``KeyError`` lists the registered names."""
    return get_rule(name).fn


def list_rewards() -> list[str]:
    return sorted(_REWARDS)


def check_ground_truth(name: str, ground_truth: Any) -> None:
    """Checks that rule ``name`` can score against ``ground_truth`` (a row's, at load time).

    Raises:
        ValueError: the rule needs a ground truth and there is none (``None``), or the rule's
            parser refuses it; the message says which.

    >>> check_ground_truth("numeric_match", "46")
    >>> check_ground_truth("numeric_match", "forty-six")
    Traceback (most recent call last):
    ...
    ValueError: numeric_match ground truth answer 'forty-six' is not a number
    """
    rule = get_rule(name)
    if not rule.needs_ground_truth:
        return
    if ground_truth is None:
        raise ValueError(f"reward {name!r} needs a ground truth: give the row an 'answer' (or 'ground_truth')")
    if rule.parse_ground_truth is not None:
        try:
            rule.parse_ground_truth(ground_truth)
        except (TypeError, ValueError) as err:
            raise ValueError(str(err)) from None


def compute_rule_rewards(
    name: str,
    prompts: Sequence[str],
    responses: Sequence[str],
    ground_truths: Sequence[Any],
    errors: RewardErrors | None = None,
    uids: Sequence[Any] | None = None,
) -> torch.Tensor:
    """Score a batch with the reward registered under ``name``.

    Args:
        name: a registered reward.
        prompts: ``B`` prompt strings.
        responses: ``B`` decoded responses (without special tokens).
        ground_truths: ``B`` ground truths in the reward's format.
        errors: what a sample whose reward raises scores (default: the error propagates,
            naming the sample and its prompt).
        uids: ``B`` prompt ids named in errors.

    Returns:
        ``(B,)`` float32 rewards; NaN where ``errors`` skipped a sample.

    >>> compute_rule_rewards("numeric_match", ["1+1=", "2+2="], ["2", "5"], ["2", "4"])
    tensor([1., 0.])
    """
    if not len(prompts) == len(responses) == len(ground_truths):
        raise ValueError(
            f"batch sizes differ: {len(prompts)} prompts, {len(responses)} responses, "
            f"{len(ground_truths)} ground truths"
        )
    fn, errors = get_reward(name), errors or RewardErrors("raise")
    scores = []
    for i, (p, r, g) in enumerate(zip(prompts, responses, ground_truths)):
        try:
            scores.append(float(fn(p, r, g)))
        except Exception as err:  # any failure of user code on one sample: the policy decides
            scores.append(errors.value(name, i, p, err, None if uids is None else uids[i]))
    return torch.tensor(scores, dtype=torch.float32)


def nan_mean(scores: torch.Tensor) -> float:
    """The mean of the scores that are not NaN (skipped samples); 0.0 when every one is.

    >>> nan_mean(torch.tensor([1.0, float("nan"), 0.0]))
    0.5
    """
    kept = scores[~torch.isnan(scores)]
    return float(kept.mean()) if len(kept) else 0.0


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


@register_reward("numeric_match", parse_ground_truth=_numeric_ground_truth)
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


def _countdown_ground_truth(ground_truth: Any) -> tuple[list[int], Fraction, bool]:
    if not isinstance(ground_truth, dict) or not {"numbers", "target"} <= set(ground_truth):
        raise ValueError(f"countdown ground truth {ground_truth!r}: expected a dict with 'numbers' and 'target'")
    numbers = ground_truth["numbers"]
    if not isinstance(numbers, list) or not all(isinstance(n, int) and n >= 0 for n in numbers):
        raise ValueError(f"countdown ground truth numbers {numbers!r}: expected a list of non-negative integers")
    return numbers, Fraction(ground_truth["target"]), bool(ground_truth.get("use_all", True))


@register_reward("countdown", parse_ground_truth=_countdown_ground_truth)
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


format_reward = register_reward("format", needs_ground_truth=False)(make_format_reward())
format_reward.__doc__ = """1.0 when the response holds exactly one non-empty ``<answer>...</answer>`` block.

>>> format_reward("", "<think>...</think> <answer>42</answer>", None)
1.0
"""

register_reward("code_tests", parse_ground_truth=check_tests)(code_tests_reward)


@register_reward("environment", needs_ground_truth=False)
def environment_reward(prompt: str, response: str, ground_truth: Any = None) -> float:
    """0.0 for every response: with multi-turn rollouts (``rollout.multi_turn``) a row's score is
    then its episode's environment reward alone (the reward call adds ``env_rewards`` to the rule's).

    >>> environment_reward("", "anything")
    0.0
    """
    return 0.0


# ----------------------------------------------------------------------------- math

# math-verify bounds each parse and comparison with signal.alarm, which only the main thread may
# set: off it (the driver-hosted worker's thread) the rule passes None, which turns the alarm off.
_MATH_TIMEOUT_SECONDS = 5


def _math_verify() -> Any:
    # Imported on first use: math-verify (and sympy under it) is an optional extra.
    try:
        import math_verify
    except ImportError:
        raise ImportError(
            "reward 'math_verify' needs the math-verify package: pip install 'rlflow[math]' (or 'math-verify>=0.9.0')"
        ) from None
    return math_verify


def _math_timeout() -> int | None:
    return _MATH_TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None


def _math_ground_truth(ground_truth: Any) -> str:
    options: dict[str, Any] = ground_truth if isinstance(ground_truth, dict) else {"answer": ground_truth}
    if set(options) != {"answer"}:
        raise ValueError(f"math_verify ground truth {ground_truth!r}: expected an answer or a dict with 'answer' only")
    value = options["answer"]
    if isinstance(value, bool) or not isinstance(value, (int, float, str)) or not str(value).strip():
        raise ValueError(f"math_verify ground truth answer {value!r} is not a number or a LaTeX/plain expression")
    _math_verify()  # a missing package is named when the dataset is checked, not at step 1
    return repr(value) if isinstance(value, float) else str(value).strip()


@lru_cache(maxsize=4096)  # a group's samples share their prompt's ground truth
def _parse_gold(gold: str, timeout: int | None) -> list[Any]:
    # A bare answer ("\frac{1}{2}", "2\sqrt{2}") is read as LaTeX math; without the $...$ the
    # extractor would take its first number only.
    text = gold if "$" in gold or "\\boxed" in gold else f"${gold}$"
    parsed = _math_verify().parse(text, parsing_timeout=timeout)
    if not parsed:
        raise ValueError(f"math_verify ground truth {gold!r} does not parse as math")
    return parsed


@register_reward("math_verify", parse_ground_truth=_math_ground_truth)
def math_verify_reward(prompt: str, response: str, ground_truth: Any) -> float:
    r"""1.0 when the response's final answer equals the ground truth mathematically (``math-verify``).

    The response's answer is what ``math_verify.parse`` extracts (a ``\boxed{}``, a LaTeX
    ``$...$`` span, "the answer is ...", else a plain expression); ``math_verify.verify`` compares it
    with the ground truth symbolically and numerically (to 6 decimals): ``\frac{1}{2}`` equals
    ``0.5`` and ``1/2``, ``x+1`` equals ``1+x``; ``0.33`` is not ``1/3``. On the main thread each
    parse and comparison is bounded by a 5 s alarm (a timeout scores 0.0); on other threads
    math-verify cannot set the alarm, so none bounds it.

    Args:
        prompt: unused.
        response: model output.
        ground_truth: the answer as LaTeX (``"\frac{1}{2}"``, ``"$x+1$"``, ``"\boxed{3}"``), plain
            text (``"1/2"``) or a number, or ``{"answer": ...}``.

    >>> math_verify_reward("", "so the answer is $\\boxed{\\frac{1}{2}}$", "0.5")
    1.0
    """
    timeout, gold = _math_timeout(), _math_ground_truth(ground_truth)
    mv = _math_verify()
    answer = mv.parse(response, parsing_timeout=timeout)
    if not answer:
        return 0.0
    return 1.0 if mv.verify(_parse_gold(gold, timeout), answer, timeout_seconds=timeout) else 0.0
