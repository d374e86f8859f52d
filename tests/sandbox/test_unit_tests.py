"""Unit tests of untrusted code: per-test outcomes, forged reports, hung tests, malformed tests."""

from __future__ import annotations

import pytest
from sandbox_helpers import working_sandbox

from rlflow.sandbox import Limits, Sandbox, check_tests, run_tests

ADD = "def add(a, b):\n    return a + b\n\nif __name__ == '__main__':\n    input()\n"


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return working_sandbox(Limits(wall_seconds=1.5, cpu_seconds=1, memory_bytes=256 << 20, output_bytes=1 << 16))


def test_each_test_passes_or_fails_on_its_own(sandbox):
    tests = ["assert add(1, 2) == 3", "assert add(2, 2) == 5, 'two and two'", "assert sub(3, 1) == 2"]
    report = run_tests(ADD, tests, sandbox)
    assert report.passed == (True, False, False) and report.fraction == pytest.approx(1 / 3)
    assert report.errors[1] == "AssertionError: two and two" and report.errors[2].startswith("NameError")
    assert report.solution_error == "" and not report.all_passed


def test_code_cannot_pass_by_printing_or_exiting(sandbox):
    forged = 'print("\\n" + "0" * 32 + " [0, true, \\"\\"]")\nprint("[0, true, \\"\\"]")\n'
    assert run_tests(forged, ["assert False"], sandbox).passed == (False,)
    exits = run_tests("import sys\nsys.exit(0)", ["assert True"], sandbox)
    assert exits.passed == (False,) and exits.solution_error == "SystemExit: 0"
    hard_exit = run_tests("import os\nos._exit(0)", ["assert True"], sandbox)
    assert hard_exit.passed == (False,) and hard_exit.errors == ("not run",)


def test_a_hung_test_fails_with_those_after_it(sandbox):
    report = run_tests(ADD, ["assert add(1, 1) == 2", "while True:\n    pass", "assert add(0, 0) == 0"], sandbox)
    assert report.passed == (True, False, False) and report.errors[1:] == ("not run", "not run")
    assert report.result.limit in ("cpu", "wall") and report.solution_error.startswith("stopped by the")


def test_malformed_tests_are_named():
    assert check_tests('["assert 1 == 1"]') == ["assert 1 == 1"]
    with pytest.raises(ValueError, match=r"tests\[1\] 'assert \(' is not valid Python"):
        check_tests(["assert True", "assert ("])
    with pytest.raises(ValueError, match="tests\\[0\\] is a int"):
        check_tests([3])
    with pytest.raises(ValueError, match="list of Python statements, got dict"):
        check_tests({"a": 1})
    with pytest.raises(ValueError, match="neither a list nor a JSON list"):
        check_tests("assert add(1, 2) == 3")
