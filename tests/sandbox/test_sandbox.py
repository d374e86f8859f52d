"""The sandbox runs ordinary programs, and stops every escape attempt while the caller goes on.

Each test runs real processes under short limits (1–2 s); they skip, saying why, where the kernel gives
no namespaces (``network="deny"`` refuses to run without them).
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sandbox_helpers import working_sandbox

import rlflow
from rlflow.sandbox import Limits, Sandbox
from rlflow.sandbox.uids import lease_uid

LIMITS = Limits(
    wall_seconds=1.5,
    cpu_seconds=1,
    memory_bytes=256 << 20,
    processes=16,
    file_bytes=1 << 20,
    disk_bytes=4 << 20,
    output_bytes=1 << 16,
)
UID_BASE = 1_500_000_000  # these tests' own uids, so that a scan for leftover processes sees only theirs


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return working_sandbox(LIMITS, uid_base=UID_BASE, num_uids=64)


def test_program_output_exit_code_and_isolation(sandbox):
    result = sandbox.run("import sys\nprint('hello', 6 * 7)\nprint('oops', file=sys.stderr)\nsys.exit(3)")
    assert (result.exit_code, result.signal, result.limit) == (3, None, None)
    assert result.stdout == "hello 42\n" and result.stderr == "oops\n"
    assert not result.ok and result.describe() == "exit code 3"
    assert set(result.isolated) == {"network", "filesystem", "processes"}
    assert sandbox.run("print('fine')").ok


def test_stdin_and_files_in_the_work_directory(sandbox):
    code = "import helper\nfrom pathlib import Path\nprint(helper.shout(input()), Path('data/n.txt').read_text())"
    files = {"helper.py": "def shout(s):\n    return s.upper()\n", "data/n.txt": "17"}
    result = sandbox.run(code, stdin="quiet words\n", files=files)
    assert result.ok, result.stderr
    assert result.stdout == "QUIET WORDS 17\n"


def test_files_outside_the_work_directory_are_refused(sandbox):
    for name in ("/etc/passwd", "../up.py", "main.py"):
        with pytest.raises(ValueError, match="relative path inside the work directory"):
            sandbox.run("pass", files={name: "x"})


def test_no_network_even_to_the_host(sandbox):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.05)
    port = listener.getsockname()[1]
    code = f"""
import socket
for address in [("127.0.0.1", {port}), ("1.1.1.1", 53)]:
    try:
        socket.create_connection(address, timeout=1).close()
        print("connected", address)
    except OSError as err:
        print("refused", err.errno)
"""
    result = sandbox.run(code)
    assert result.ok, result.stderr
    assert "connected" not in result.stdout and result.stdout.count("refused") == 2
    with pytest.raises(TimeoutError):  # nothing reached the host's listener
        listener.accept()
    listener.close()


def test_fork_bomb_is_stopped(sandbox):
    result = sandbox.run("import os\nwhile True:\n    os.fork()")
    assert result.limit in ("processes", "wall", "cpu"), result.describe()
    counted = sandbox.run(
        "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(30)\n"
        "        n += 1\nexcept BlockingIOError:\n    print(n)"
    )
    assert counted.ok, counted.stderr
    assert 0 < int(counted.stdout) < LIMITS.processes  # the first fork past the limit is refused
    assert sandbox.run("print(1)").stdout == "1\n"  # the caller goes on


def test_memory_limit(sandbox):
    result = sandbox.run("block = bytearray(10 * 1024**3)\nprint('allocated')")
    assert result.limit == "memory" and "allocated" not in result.stdout
    assert result.stderr.rstrip().endswith("MemoryError")


def test_endless_loop_and_sleep_are_killed(sandbox):
    spin = sandbox.run("while True:\n    pass")
    assert spin.limit in ("cpu", "wall") and spin.signal is not None
    # A process that leaves the group and sleeps dies with the run: nothing of any test uid is left.
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\ntime.sleep(60)"
    sleeper = sandbox.run(code)
    assert sleeper.limit == "wall" and sleeper.describe() == "killed by SIGKILL (wall limit)"
    assert sleeper.wall_seconds < LIMITS.wall_seconds + 5
    assert _processes_of_uids(range(UID_BASE, UID_BASE + 64)) == []


def _processes_of_uids(uids: range) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            status = (entry / "status").read_text() if entry.name.isdigit() else ""
        except OSError:  # it exited meanwhile
            continue
        uid_line = next((line for line in status.splitlines() if line.startswith("Uid:")), None)
        if uid_line is not None and int(uid_line.split()[1]) in uids:
            found.append(int(entry.name))
    return found


def test_writes_outside_the_work_directory_fail(sandbox):
    tag = uuid.uuid4().hex
    targets = [
        f"/tmp/rlflow-escape-{tag}",
        str(Path(rlflow.__file__).parent / f"escape-{tag}.py"),
        os.path.join(os.path.expanduser("~"), f"escape-{tag}"),
        f"/dev/shm/escape-{tag}",
    ]
    code = f"""
import json
results = {{}}
for path in {targets!r}:
    try:
        open(path, "w").write("x")
        results[path] = "written"
    except OSError as err:
        results[path] = err.strerror
open("inside.txt", "w").write("mine")
print(json.dumps(results))
"""
    result = sandbox.run(code)
    assert result.ok, result.stderr
    assert "written" not in json.loads(result.stdout).values()
    assert not [path for path in targets if os.path.exists(path)]


def test_file_size_and_disk_limits(sandbox):
    result = sandbox.run("open('big', 'wb').write(bytes(2 << 20))")
    assert result.limit == "file_size", result.stderr
    code = "for i in range(8):\n    open(f'part{i}', 'wb').write(bytes(1 << 20))"
    result = sandbox.run(code)  # each file within file_bytes, together past disk_bytes
    assert result.limit == "disk", result.stderr


def test_parent_environment_is_not_visible(sandbox, monkeypatch):
    secret = f"hf_fake_{uuid.uuid4().hex}"
    monkeypatch.setenv("HF_TOKEN", secret)
    code = f"""
import os
seen = [repr(dict(os.environ))]
for pid in [p for p in os.listdir("/proc") if p.isdigit()] + ["{os.getpid()}"]:
    try:
        seen.append(open(f"/proc/{{pid}}/environ").read())
    except OSError as err:
        seen.append(err.strerror)
print("\\n".join(seen))
"""
    result = sandbox.run(code)
    assert result.ok, result.stderr
    assert secret not in result.stdout and "HF_TOKEN" not in result.stdout
    assert "PATH=" in result.stdout  # it did read its own environment


def test_huge_output_is_truncated(sandbox):
    result = sandbox.run("import sys\nsys.stdout.write('x' * 100_000_000)")
    assert result.limit == "output" and result.stdout_truncated and not result.stderr_truncated
    assert result.stdout == "x" * LIMITS.output_bytes


def test_concurrent_runs(sandbox):
    code = "import time, sys\nn = int(input())\ntime.sleep(0.3)\nprint(n * n)"
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda n: sandbox.run(code, stdin=f"{n}\n"), range(6)))
    assert [r.stdout for r in results] == [f"{n * n}\n" for n in range(6)]


def test_uid_leases_are_exclusive():
    with lease_uid(UID_BASE + 100, 2) as first, lease_uid(UID_BASE + 100, 2) as second:
        assert {first, second} == {UID_BASE + 100, UID_BASE + 101}
        with pytest.raises(RuntimeError, match="all 2 sandbox uids"), lease_uid(UID_BASE + 100, 2):
            pass


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="Limits.wall_seconds"):
        Limits(wall_seconds=0)
    with pytest.raises(ValueError, match="network='open'"):
        Sandbox(network="open")
