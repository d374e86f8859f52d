"""What the sandbox tests share (not a test module)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rlflow.sandbox import Limits, Sandbox, SandboxUnavailable


def working_sandbox(limits: Limits, **kwargs) -> Sandbox:
    """A sandbox that has run a program here, or the test is skipped: a kernel without Linux
    namespaces, or one that refuses them, cannot isolate a run (``network="deny"``)."""
    if not hasattr(os, "fork") or not Path("/proc/self/ns/net").exists():
        pytest.skip("the sandbox needs Linux namespaces")
    box = Sandbox(limits, **kwargs)
    try:
        box.run("pass")
    except SandboxUnavailable as err:
        pytest.skip(f"this kernel refuses the sandbox's namespaces: {err}")
    return box
