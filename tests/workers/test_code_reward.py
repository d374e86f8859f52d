"""The code-execution reward: code extraction, the ``code_tests`` rule and the TRL-style function."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from rlflow.sandbox import Sandbox, SandboxUnavailable
from rlflow.workers.code_reward import CODE_LIMITS, extract_code, make_code_reward
from rlflow.workers.rewards import check_ground_truth, compute_rule_rewards

GOOD = "Sure:\n```python\ndef add(a, b):\n    return a + b\n```\n"
HALF = "```py\ndef add(a, b):\n    return a + b if a else 0\n```"
TESTS = ["assert add(1, 2) == 3", "assert add(0, 5) == 5"]


@pytest.fixture(scope="module")
def namespaces() -> None:
    if not hasattr(os, "fork") or not Path("/proc/self/ns/net").exists():
        pytest.skip("the sandbox needs Linux namespaces")
    try:
        Sandbox(CODE_LIMITS).run("pass")
    except SandboxUnavailable as err:
        pytest.skip(f"this kernel refuses the sandbox's namespaces: {err}")


@pytest.mark.parametrize(
    "text, code",
    [
        ("```\nx = 1\n```\n```python\nx = 2\n```\n```python\nx = 3\n```", "x = 3\n"),
        ("```text\nnot code\n```\n```\nx = 4\n```", "x = 4\n"),
        ("```Python3 title\nx = 5\n```", "x = 5\n"),
        ("x = 6", "x = 6"),
    ],
)
def test_extract_code(text, code):
    assert extract_code(text) == code


def test_code_tests_rule(namespaces):
    scores = compute_rule_rewards("code_tests", ["p"] * 3, [GOOD, HALF, "raise ValueError"], [TESTS, TESTS, TESTS])
    assert torch.equal(scores, torch.tensor([1.0, 0.5, 0.0]))
    with pytest.raises(ValueError, match=r"tests\[0\] is a int"):
        check_ground_truth("code_tests", [1])
    with pytest.raises(ValueError, match="needs a ground truth"):
        check_ground_truth("code_tests", None)


def test_reward_function_scores_a_batch_concurrently(namespaces):
    reward = make_code_reward(all_pass=True, max_workers=3)
    completions = [
        GOOD,
        [{"role": "assistant", "content": HALF}],
        "import socket\nsocket.create_connection(('1.1.1.1', 80))",
    ]
    tests = [json.dumps(TESTS), TESTS, ["assert True"]]
    assert reward(["p"] * 3, completions, tests) == [1.0, 0.0, 0.0]
    fraction = make_code_reward()
    assert fraction(["p"], [HALF], [TESTS]) == [0.5]
    with pytest.raises(ValueError, match="max_workers=0"):
        make_code_reward(max_workers=0)
