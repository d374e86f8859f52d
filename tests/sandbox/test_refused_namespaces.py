"""Where the kernel refuses namespaces: ``network="deny"`` raises, ``"best_effort"`` warns once and runs.

A kernel that refuses them is made here: a child process enters a user namespace of its own, sets its
``max_user_namespaces`` to 0 and becomes an unprivileged uid, so that neither a privileged ``unshare`` nor
a new user namespace is allowed; it then runs the sandbox with an interpreter that uid can reach.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Runs the sandbox twice under each policy, printing what it saw; its last line is the warnings' count.
PROGRAM = """
import warnings
from rlflow.sandbox import Sandbox, SandboxUnavailable
try:
    Sandbox().run("print(1)")
except SandboxUnavailable as err:
    print("deny:", err)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    box = Sandbox(network="best_effort")
    runs = [box.run("import os; print(os.getuid())"), box.run("print(2)")]
print([(r.exit_code, r.stdout, r.isolated) for r in runs])
print(len(caught), caught[0].filename if caught else "")
"""

# Forks a child into a new user namespace, maps root and uid 1000 from outside, then the child drops to
# uid 1000 with user namespaces forbidden and runs PROGRAM.
WRAPPER = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
ready_r, ready_w = os.pipe()
pid = os.fork()
if pid == 0:
    assert libc.unshare(0x10000000) == 0, os.strerror(ctypes.get_errno())
    os.read(ready_r, 1)
    with open("/proc/sys/user/max_user_namespaces", "w") as f:
        f.write("0")
    os.setgroups([]); os.setgid(1000); os.setuid(1000)
    env = {"PYTHONPATH": sys.argv[2], "PATH": "/usr/bin:/bin"}
    os.execve(sys.argv[1], [sys.argv[1], "-c", sys.argv[3]], env)
for name in ("uid_map", "gid_map"):
    while True:
        try:
            with open(f"/proc/{pid}/{name}", "w") as f:
                f.write("0 0 65536")
            break
        except PermissionError:  # the child has not entered its namespace yet
            pass
os.write(ready_w, b"x")
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def _world_reachable_python() -> str | None:
    """A python3 that uid 1000 can run: every directory on its path searchable by others."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        path = Path(os.path.realpath(candidate))
        if path.exists() and all(p.stat().st_mode & 0o001 for p in path.parents) and path.stat().st_mode & 0o001:
            return str(path)
    return None


def test_deny_raises_and_best_effort_warns_once():
    python = _world_reachable_python()
    if os.getuid() != 0 or python is None or not Path("/proc/self/ns/user").exists():
        pytest.skip("needs root, user namespaces and a python3 outside private directories")
    if not all(os.stat(p).st_mode & 0o005 == 0o005 for p in (ROOT, ROOT / "rlflow", ROOT / "rlflow" / "sandbox")):
        pytest.skip(f"{ROOT} is not readable by other users")
    proc = subprocess.run(
        [sys.executable, "-c", WRAPPER, python, str(ROOT), PROGRAM], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    deny, runs, warned = proc.stdout.splitlines()
    assert deny.startswith("deny: ") and "unshare(network, mount, pid namespaces) refused" in deny
    assert "Sandbox(network='best_effort')" in deny
    assert runs == "[(0, '1000\\n', ()), (0, '2\\n', ())]"  # ran as the caller, isolated nothing
    assert warned == "1 <string>"  # once, pointing at the caller's line
