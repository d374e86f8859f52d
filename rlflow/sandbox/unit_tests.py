"""Unit tests of untrusted code, run in the sandbox: :func:`run_tests`.

Tests are Python statements, each usually an ``assert`` (MBPP's and HumanEval's ``test_list``):
``["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]``. One run executes the code as module
``solution`` (so its ``if __name__ == "__main__":`` block does not run), then each test in the code's
namespace, and reports each one on stdout after a random token the harness reads from stdin before
the code starts. A test passes when it runs without raising; a test never reported (the run was
killed by a limit, or the code exited) fails.

The token keeps the program's ordinary output from passing for a report; it is not a defence against
code that inspects the harness's own frames to forge reports. The sandbox contains such code, the
report may still be forged.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from rlflow.sandbox.sandbox import RunResult, Sandbox

__all__ = ["TestReport", "check_tests", "run_tests"]

_HARNESS = r"""
import json as _json, os as _os, sys as _sys


def _rlflow_harness():
    token = _sys.stdin.readline().strip()

    def report(index, ok, message):
        _sys.stdout.flush()
        line = "\n" + token + " " + _json.dumps([index, ok, message]) + "\n"
        _os.write(1, line.encode())

    with open("tests.json") as f:
        tests = _json.load(f)
    with open("solution.py") as f:
        source = f.read()
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(compile(source, "solution.py", "exec"), namespace)
    except BaseException as err:
        report(-1, False, type(err).__name__ + ": " + str(err)[:200])
        return
    for index, test in enumerate(tests):
        try:
            exec(compile(test, "test_%d" % index, "exec"), namespace)
        except BaseException as err:
            report(index, False, type(err).__name__ + ": " + str(err)[:200])
        else:
            report(index, True, "")


_rlflow_harness()
"""


@dataclass(frozen=True)
class TestReport:
    """The outcome of :func:`run_tests`.

    Attributes:
        passed: one flag per test, in order.
        errors: per test, what it raised (``AssertionError: ...``); ``""`` for a pass, ``"not run"`` for a
            test the run never reached.
        solution_error: what running the code itself raised (then no test ran), else ``""``.
        result: the sandbox run (its limit, stderr, times).
    """

    __test__ = False  # not a pytest class

    passed: tuple[bool, ...]
    errors: tuple[str, ...]
    solution_error: str
    result: RunResult

    @property
    def fraction(self) -> float:
        """Passed tests over all tests (1.0 for no test)."""
        return sum(self.passed) / len(self.passed) if self.passed else 1.0

    @property
    def all_passed(self) -> bool:
        return all(self.passed)


def check_tests(tests: object) -> list[str]:
    """Reads a row's tests: a sequence of Python statements, or a JSON string of one.

    Raises:
        ValueError: not a list of strings, or a test that is not valid Python (naming its index).

    >>> check_tests('["assert f(1) == 2"]')
    ['assert f(1) == 2']
    """
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as err:
            raise ValueError(f"tests {tests[:80]!r} is neither a list nor a JSON list: {err}") from None
    if isinstance(tests, (str, bytes)) or not isinstance(tests, Sequence) and not hasattr(tests, "tolist"):
        raise ValueError(f"tests must be a list of Python statements, got {type(tests).__name__}")
    tests = list(tests.tolist() if hasattr(tests, "tolist") else tests)  # a numpy column from parquet
    for i, test in enumerate(tests):
        if not isinstance(test, str):
            raise ValueError(f"tests[{i}] is a {type(test).__name__}, expected a string of Python")
        try:
            compile(test, f"tests[{i}]", "exec")
        except SyntaxError as err:
            raise ValueError(f"tests[{i}] {test[:80]!r} is not valid Python: {err.msg}") from None
    return tests


def run_tests(code: str, tests: Sequence[str], sandbox: Sandbox) -> TestReport:
    """Runs ``code``, then each of ``tests`` in its namespace, in one sandboxed process.

    Args:
        code: the program under test (Python source).
        tests: statements checked by :func:`check_tests`.
        sandbox: where it runs, under that sandbox's limits.

    Returns:
        A :class:`TestReport`; code that fails, hangs or escapes is a report of failed tests, not an error.
    """
    tests = check_tests(list(tests))
    token = secrets.token_hex(16)
    files = {"solution.py": code, "tests.json": json.dumps(tests)}
    result = sandbox.run(_HARNESS, stdin=token + "\n", files=files)
    errors = ["not run"] * len(tests)
    solution_error = "" if result.limit is None else f"stopped by the {result.limit} limit"
    for line in result.stdout.splitlines():
        head, _, body = line.partition(" ")
        if head != token:
            continue
        index, ok, message = json.loads(body)
        if index == -1:
            solution_error = message
        elif 0 <= index < len(tests):
            errors[index] = "" if ok else message
    passed = tuple(error == "" for error in errors)
    return TestReport(passed, tuple(errors), solution_error, result)
