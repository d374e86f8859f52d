"""A ``python`` tool for the model: its code runs in the sandbox (:mod:`rlflow.sandbox`), never in the worker.

The model calls ``python(code)``; the code runs as a fresh sandboxed program under :class:`Limits`
(no network, a private work directory, CPU / wall / memory / process / output limits, a clean
environment). A program that exits with status 0 answers with what it printed; one that fails or
is stopped by a limit — an exception, a socket it may not open, an endless loop — raises
:class:`PythonToolError`, which the tool runner reports to the model as a tool error (and counts in
``tools/errors``) while the episode goes on.

From YAML: ``rollout.multi_turn.tools: ["rlflow.workers.python_tool:python"]`` (the default limits);
from Python: ``Trainer(tools=[make_python_tool(Limits(wall_seconds=2))])``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from rlflow.sandbox import Limits, RunResult, Sandbox

__all__ = ["PYTHON_TOOL_LIMITS", "PythonToolError", "make_python_tool", "python"]

# One call's budget: enough for a calculation or a short script, short enough that a hung call costs
# seconds of its episode (the tool runner's rollout.multi_turn.tool_timeout_s should be longer).
PYTHON_TOOL_LIMITS = Limits(
    wall_seconds=5.0, cpu_seconds=3, memory_bytes=256 << 20, processes=16, output_bytes=16 << 10
)
# What the model reads of a failed run's output: the end of its traceback is what says why.
_ERROR_TAIL_CHARS = 2_000


class PythonToolError(RuntimeError):
    """The model's program failed or was stopped by a limit; the message is what the model reads."""


def make_python_tool(
    limits: Limits | None = None, *, network: str = "deny", sandbox: Sandbox | None = None
) -> Callable[[str], str]:
    """A tool ``python(code: str) -> str`` running the model's code in a sandbox.

    Args:
        limits: what each call's program may use (default :data:`PYTHON_TOOL_LIMITS`).
        network: the sandbox's policy where the kernel cannot isolate the network
            (:class:`~rlflow.sandbox.Sandbox`): ``"deny"`` answers every call with that error,
            ``"best_effort"`` runs with the resource limits only.
        sandbox: the sandbox to run in; by default one per process is made on the first call, in the
            process that runs the tools (a worker), with ``limits`` and ``network``.

    Returns:
        The tool, a typed and documented function named ``python`` (its schema is the chat
        template's), which pickles by value to the workers with its limits.

    >>> tool = make_python_tool(Limits(wall_seconds=2, cpu_seconds=1))
    >>> tool.__name__
    'python'
    >>> tool("print(6 * 7)")  # doctest: +SKIP
    '42\\n'
    """
    if network not in ("deny", "best_effort"):
        raise ValueError(f"make_python_tool(network={network!r}): expected 'deny' or 'best_effort'")
    box = sandbox or _SandboxOnFirstUse(limits or PYTHON_TOOL_LIMITS, network)

    def python(code: str) -> str:
        """Runs a Python program in a sandbox (no network, no files outside its own directory, limited time and memory) and returns what it printed.

        Args:
            code: the program's source; print the values you want to see.
        """
        result = box.run(code)
        output = result.stdout + (f"\n[stderr]\n{result.stderr}" if result.stderr else "")
        if not result.ok:
            tail = f"; its output ends:\n{output[-_ERROR_TAIL_CHARS:]}" if output else ""
            raise PythonToolError(f"the program failed ({result.describe()}){tail}")
        return output

    return python


class _SandboxOnFirstUse:
    """A :class:`Sandbox` made on the first run in the process that runs the tool (a worker, where
    its interpreter and uids are); it pickles as its settings, without the sandbox or the lock."""

    def __init__(self, limits: Limits, network: str) -> None:
        self.limits, self.network = limits, network
        self._box: Sandbox | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"limits": self.limits, "network": self.network}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def run(self, code: str) -> RunResult:
        with self._lock:
            if self._box is None:
                self._box = Sandbox(self.limits, network=self.network)
        return self._box.run(code)


python = make_python_tool()
