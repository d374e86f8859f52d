"""Rule-based rewards: answer extraction, numeric match, countdown parser, format, registry."""

from __future__ import annotations

import doctest
from fractions import Fraction

import pytest
import torch

from rlflow.workers import rewards
from rlflow.workers.rewards import (
    compute_rule_rewards,
    countdown_reward,
    evaluate_expression,
    extract_answer,
    format_reward,
    get_reward,
    list_rewards,
    make_format_reward,
    numeric_match_reward,
    register_reward,
)


@pytest.mark.parametrize(
    "response, marker, expected",
    [
        ("46", None, "46"),
        ("  \n 46 \n", None, "46"),
        ("I think 12 + 34 is 46.", None, "46"),
        ("#### -1,234 then rambling 7", None, "-1234"),
        ("The ANSWER: 12 and 13", None, "12"),
        ("steps 1 2 <answer> 3.5 </answer> 9", None, "3.5"),
        ("so \\boxed{17} not 18", None, "17"),
        ("x = 5; result => 8", "=>", "8"),
        ("no digits here", None, None),
    ],
)
def test_extract_answer(response, marker, expected):
    assert extract_answer(response, marker) == expected


def test_numeric_match_formats():
    assert numeric_match_reward("1+1=", " 2 ", 2) == 1.0
    assert numeric_match_reward("", "0.50", "0.5") == 1.0
    assert numeric_match_reward("", "0.1", 0.1) == 1.0
    assert numeric_match_reward("", "3", "4") == 0.0
    assert numeric_match_reward("", "nothing", "4") == 0.0
    # Reversed digits: 40 is written "04"; "4" read backwards is 4, not 40.
    reversed_gt = {"answer": "40", "reverse_digits": True}
    assert numeric_match_reward("10+30=", "04", reversed_gt) == 1.0
    assert numeric_match_reward("10+30=", "4", reversed_gt) == 0.0
    assert numeric_match_reward("10+30=", "40", reversed_gt) == 0.0
    assert numeric_match_reward("3-15=", "-21", {"answer": -12, "reverse_digits": True}) == 1.0
    assert numeric_match_reward("", "a: 1 b: 2", {"answer": 1, "marker": "a:"}) == 1.0


def test_numeric_match_rejects_bad_ground_truth():
    with pytest.raises(ValueError, match="unknown keys: \\['reversed'\\]"):
        numeric_match_reward("", "1", {"answer": 1, "reversed": True})
    with pytest.raises(ValueError, match="'forty' is not a number"):
        numeric_match_reward("", "1", "forty")


def test_expression_parser_by_hand():
    assert evaluate_expression("1 + 2 * 3") == (Fraction(7), [1, 2, 3])  # precedence
    assert evaluate_expression("(1 + 2) * 3") == (Fraction(9), [1, 2, 3])
    assert evaluate_expression("8 - 3 - 2") == (Fraction(3), [8, 3, 2])  # left-associative
    assert evaluate_expression("8 / 4 / 2") == (Fraction(1), [8, 4, 2])
    assert evaluate_expression("7 ÷ 2 × 4") == (Fraction(14), [7, 2, 4])
    assert evaluate_expression("1 / 3 + 1 / 6") == (Fraction(1, 2), [1, 3, 1, 6])  # exact, no float error
    for bad, message in [
        ("2 ** 3", "unexpected '\\*'"),
        ("(1 + 2", "ends too early"),
        ("1 + 2)", "unexpected '\\)'"),
        ("-1 + 2", "unexpected '-'"),
        ("__import__('os')", "unexpected character '_'"),
        ("4 / (2 - 2)", "division by zero"),
    ]:
        with pytest.raises(ValueError, match=message):
            evaluate_expression(bad)


def test_countdown_reward_rules():
    gt = {"numbers": [3, 5, 7], "target": 22, "use_all": True}
    assert countdown_reward("", "3 * 5 + 7", gt) == 1.0
    assert countdown_reward("", "thinking...\n(7 * 5 - 3) / 1\n3*5+7 = 22", gt) == 1.0  # last line counts
    assert countdown_reward("", "<answer>7 + 5 * 3</answer>", gt) == 1.0
    assert countdown_reward("", "3 * 5 + 7 = 23", gt) == 1.0  # the claimed result is ignored, the value is exact
    assert countdown_reward("", "3 * 5 + 8", gt) == 0.0  # 8 is not given
    assert countdown_reward("", "3 * 5 + 7 + 3 - 3", gt) == 0.0  # 3 used three times
    assert countdown_reward("", "3 * 7 + 1", gt) == 0.0
    assert countdown_reward("", "3 * 5 + 7 +", gt) == 0.0  # syntax error scores 0
    subset = {"numbers": [3, 5, 7], "target": 15, "use_all": False}
    assert countdown_reward("", "3 * 5", subset) == 1.0
    assert countdown_reward("", "3 * 5", {**subset, "use_all": True}) == 0.0
    with pytest.raises(ValueError, match="'numbers' and 'target'"):
        countdown_reward("", "1", {"target": 1})


def test_format_reward():
    assert format_reward("", "<think>a</think><answer>42</answer>", None) == 1.0
    assert format_reward("", "42", None) == 0.0
    assert format_reward("", "<answer> </answer>", None) == 0.0
    assert format_reward("", "<answer>1</answer><answer>2</answer>", None) == 0.0
    assert format_reward("", "</answer>1<answer>", None) == 0.0
    brackets = make_format_reward("[[", "]]")
    assert brackets("", "so [[7]]", None) == 1.0


def test_registry_and_batch_helper(monkeypatch):
    monkeypatch.setattr(rewards, "_REWARDS", dict(rewards._REWARDS))
    assert {"numeric_match", "countdown", "format"} <= set(list_rewards())
    with pytest.raises(ValueError, match="'countdown' is already registered"):
        register_reward("countdown")(countdown_reward)
    with pytest.raises(
        KeyError,
        match="registered rewards: \\['code_tests', 'countdown', 'environment', 'format', 'math_verify', 'numeric_match'\\]",
    ):
        get_reward("exact")

    @register_reward("length")
    def length_reward(prompt, response, ground_truth):
        return len(response) / ground_truth

    scores = compute_rule_rewards("length", ["p", "q"], ["ab", "abcd"], [4, 4])
    assert scores.dtype == torch.float32 and torch.equal(scores, torch.tensor([0.5, 1.0]))
    gts = [{"answer": "46", "reverse_digits": True}, {"answer": "46", "reverse_digits": True}]
    assert torch.equal(
        compute_rule_rewards("numeric_match", ["12+34="] * 2, ["64", "46"], gts), torch.tensor([1.0, 0.0])
    )
    with pytest.raises(ValueError, match="2 prompts, 1 responses, 2 ground truths"):
        compute_rule_rewards("numeric_match", ["a", "b"], ["1"], [1, 2])


def test_docstring_examples_run():
    result = doctest.testmod(rewards, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
