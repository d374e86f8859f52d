"""The math_verify rule: equal and unequal answer pairs, ground-truth checks, threads, a missing package."""

from __future__ import annotations

import sys
import threading

import pytest

from rlflow.workers import rewards
from rlflow.workers.rewards import check_ground_truth, compute_rule_rewards, math_verify_reward


@pytest.mark.parametrize(
    "response, ground_truth",
    [
        (r"The answer is $\frac{1}{2}$", "0.5"),
        ("so 0.5", r"\frac{1}{2}"),
        (r"so $\boxed{3}$", "3"),
        (r"\boxed{3}", 3),
        ("it is 1/2", r"\frac{1}{2}"),
        (r"$\sqrt{8}$", r"2\sqrt{2}"),
        ("$1+x$", "x+1"),
        (r"The final answer is $\boxed{\dfrac{3}{4}}$.", {"answer": "0.75"}),
        ("The answer is 12.", 12.0),
    ],
)
def test_equal_answers_score_one(response, ground_truth):
    assert math_verify_reward("", response, ground_truth) == 1.0


@pytest.mark.parametrize(
    "response, ground_truth",
    [
        ("0.33", "1/3"),
        (r"$\boxed{5}$", "4"),
        ("$x-1$", "x+1"),
        (r"$\frac{1}{3}$", "0.5"),
        ("no answer here", "7"),
        ("", "7"),
    ],
)
def test_unequal_answers_score_zero(response, ground_truth):
    assert math_verify_reward("", response, ground_truth) == 0.0


def test_ground_truth_is_checked_at_load_time():
    check_ground_truth("math_verify", r"\frac{1}{2}")
    check_ground_truth("math_verify", {"answer": 3})
    for bad, message in [
        (None, "reward 'math_verify' needs a ground truth"),
        ("  ", "is not a number or a LaTeX/plain expression"),
        (True, "is not a number or a LaTeX/plain expression"),
        ({"answer": "1", "marker": "#"}, "expected an answer or a dict with 'answer' only"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_ground_truth("math_verify", bad)


def test_scores_off_the_main_thread():
    # math-verify's alarm-based timeouts refuse other threads; the rule turns them off there.
    scores = []
    worker = threading.Thread(target=lambda: scores.append(math_verify_reward("", r"$\frac{2}{4}$", "0.5")))
    worker.start()
    worker.join()
    assert scores == [1.0]
    assert rewards._math_timeout() == rewards._MATH_TIMEOUT_SECONDS


def test_batch_helper_names_an_unparsable_ground_truth():
    scores = compute_rule_rewards("math_verify", ["p", "q"], [r"\boxed{2}", "7"], ["2", "8"])
    assert scores.tolist() == [1.0, 0.0]
    with pytest.raises(Exception, match="'math_verify' raised on sample 0.*does not parse as math"):
        compute_rule_rewards("math_verify", ["p"], ["7"], ["$$"])


def test_missing_package_names_the_reward(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # what an absent package imports as
    with pytest.raises(ImportError, match="reward 'math_verify' needs the math-verify package"):
        check_ground_truth("math_verify", "1")
    with pytest.raises(ImportError, match="reward 'math_verify' needs the math-verify package"):
        math_verify_reward("", "1", "1")
