"""Code-execution reward: a completion's Python, run in the sandbox against its row's unit tests.

The code is the last fenced block of the completion marked ``python`` or ``py`` (else the last
unmarked fenced block, else the whole completion). A row's tests are a list of Python statements,
usually asserts, as MBPP and HumanEval write them (``["assert add(1, 2) == 3", ...]``; a JSON string of
that list also reads), run by :func:`rlflow.sandbox.run_tests` after the code, each in the code's
namespace. The score is the fraction of tests that pass, or with ``all_pass`` 1.0 when every test
passes and 0.0 otherwise. Code that hangs, forks, allocates, prints or escapes without end is stopped by
the sandbox's limits (:data:`CODE_LIMITS` unless given) and fails the tests it did not reach.

Two ways in:

- ``algorithm.reward_fn: code_tests`` (registered in :mod:`rlflow.workers.rewards`): the row's ground
  truth (its ``ground_truth`` or ``answer``) is its tests, checked when the dataset loads; rows are
  scored one after another, fraction of tests passed.
- :func:`make_code_reward`, a reward function in TRL's convention reading a ``tests`` column, which runs
  a batch's completions concurrently (``reward_funcs=[make_code_reward()]``).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlflow.sandbox import Limits, Sandbox, check_tests, run_tests

__all__ = ["CODE_LIMITS", "code_tests_reward", "extract_code", "make_code_reward", "score_code"]

# A test program's budget: generous for a correct solution of a contest-sized task, short enough that a
# batch of hung completions costs seconds.
CODE_LIMITS = Limits(wall_seconds=10.0, cpu_seconds=5, memory_bytes=512 << 20, processes=16, output_bytes=64 << 10)

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The program of a completion: its last ```` ```python ```` (or ```` ```py ````) block, else its last
    unmarked fenced block, else the whole text.

    >>> extract_code("Here:\\n```python\\ndef f():\\n    return 1\\n```\\nDone.")
    'def f():\\n    return 1\\n'
    >>> extract_code("def f(): return 2")
    'def f(): return 2'
    """
    blocks = _FENCE.findall(text)
    for wanted in (("python", "py", "python3"), ("",)):
        chosen = [body for language, body in blocks if language.lower() in wanted]
        if chosen:
            return chosen[-1]
    return text


def score_code(completion: str, tests: Any, sandbox: Sandbox, all_pass: bool = False) -> float:
    """Runs a completion's code against ``tests`` in ``sandbox``: the fraction of tests passed, or with
    ``all_pass`` 1.0 when all pass, else 0.0.

    Raises:
        ValueError: ``tests`` is malformed (a data error, named by :func:`rlflow.sandbox.check_tests`).
    """
    report = run_tests(extract_code(completion), check_tests(tests), sandbox)
    if all_pass:
        return 1.0 if report.all_passed else 0.0
    return report.fraction


_default_sandbox: Sandbox | None = None
_default_lock = threading.Lock()


def _shared_sandbox() -> Sandbox:
    # Built on first use in the process that scores (a worker), where its interpreter and uids are.
    global _default_sandbox
    with _default_lock:
        if _default_sandbox is None:
            _default_sandbox = Sandbox(CODE_LIMITS)
        return _default_sandbox


def code_tests_reward(prompt: str, response: str, ground_truth: Any) -> float:
    """The ``code_tests`` rule: the fraction of the row's tests (its ground truth) the response's code passes.

    >>> code_tests_reward("", "```python\\ndef add(a, b):\\n    return a + b\\n```", ["assert add(1, 2) == 3"])
    ... # doctest: +SKIP
    1.0
    """
    return score_code(response, ground_truth, _shared_sandbox())


def make_code_reward(
    limits: Limits | None = None, *, all_pass: bool = False, max_workers: int = 4, network: str = "deny"
) -> Callable[..., list[float]]:
    """A reward function in TRL's convention, ``code_tests(prompts, completions, tests, **kwargs)``.

    Args:
        limits: each run's limits (default :data:`CODE_LIMITS`).
        all_pass: score 1.0 only when every test passes (else the fraction passed).
        max_workers: completions run at once.
        network: the sandbox's policy where the kernel gives no namespaces (see :class:`rlflow.sandbox.Sandbox`).

    Returns:
        The function; it builds its sandbox on its first call, in the process that scores.
    """
    if max_workers < 1:
        raise ValueError(f"make_code_reward(max_workers={max_workers}): must be >= 1")
    Sandbox(limits or CODE_LIMITS, network=network)  # refuses a bad policy here, not on a worker at step 1
    state: dict[str, Sandbox] = {}

    def code_tests(prompts: Sequence[Any], completions: Sequence[Any], tests: Sequence[Any], **kwargs) -> list[float]:
        if "sandbox" not in state:
            state["sandbox"] = Sandbox(limits or CODE_LIMITS, network=network)
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]  # conversational: a message
        with ThreadPoolExecutor(min(max_workers, max(1, len(texts)))) as pool:
            return list(pool.map(lambda t, row: score_code(t, row, state["sandbox"], all_pass), texts, tests))

    return code_tests
