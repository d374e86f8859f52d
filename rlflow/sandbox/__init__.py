"""A local sandbox for untrusted Python: fresh processes without network, writes outside their work
directory, inherited environment or unbounded resources (:class:`Sandbox`, :class:`Limits`)."""

from rlflow.sandbox.sandbox import Limits, RunResult, Sandbox, SandboxUnavailable

__all__ = ["Limits", "RunResult", "Sandbox", "SandboxUnavailable"]
