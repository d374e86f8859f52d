"""A local sandbox for untrusted Python: fresh processes without network, writes outside their work
directory, inherited environment or unbounded resources (:class:`Sandbox`, :class:`Limits`), and unit
tests of untrusted code run in it (:func:`run_tests`)."""

from rlflow.sandbox.sandbox import Limits, RunResult, Sandbox, SandboxUnavailable
from rlflow.sandbox.unit_tests import TestReport, check_tests, run_tests

__all__ = ["Limits", "RunResult", "Sandbox", "SandboxUnavailable", "TestReport", "check_tests", "run_tests"]
