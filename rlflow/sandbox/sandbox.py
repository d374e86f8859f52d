"""Runs untrusted Python in a fresh, isolated, resource-limited process: :class:`Sandbox`.

Each run is a new process tree (never ``exec`` in this interpreter): the launcher script
(``_launcher.py``) enters new network, mount and pid namespaces, mounts the machine read-only with a
private work directory on a size-capped tmpfs, hides the home directories, sets the resource limits,
drops to a uid of the run's own when the caller is root, and runs the code with a clean environment.
The caller reads stdout and stderr up to a cap and kills the whole process group at the wall-time
limit. Runs are independent and may execute concurrently from several threads.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from rlflow.sandbox.uids import lease_uid

__all__ = ["Limits", "RunResult", "Sandbox", "SandboxUnavailable"]

_LAUNCHER = Path(__file__).with_name("_launcher.py")
_NETWORK_POLICIES = ("deny", "best_effort")
_CPU_SLACK_SECONDS = 0.1
_STOP_SECONDS = 5.0  # how long a stopped run's launcher may take to reap the run before it is killed too
_MIB = 1 << 20


class SandboxUnavailable(RuntimeError):
    """The kernel refused the isolation that ``network="deny"`` requires (no namespaces here)."""


@dataclass(frozen=True)
class Limits:
    """What one run may use. Sizes are bytes, times seconds.

    Attributes:
        wall_seconds: real time before the whole process group is killed.
        cpu_seconds: CPU time of each process (RLIMIT_CPU, soft = hard: SIGKILL at the limit).
        memory_bytes: address space of each process (RLIMIT_AS: an allocation past it fails).
        processes: processes and threads of the run's uid at once (RLIMIT_NPROC; a fork past it fails).
        file_bytes: largest file it may write (RLIMIT_FSIZE: SIGXFSZ).
        disk_bytes: size of the work directory (a tmpfs) when the filesystem is isolated.
        output_bytes: stdout and stderr each kept up to this; past it the run is killed and the stream truncated.
    """

    wall_seconds: float = 10.0
    cpu_seconds: int = 5
    memory_bytes: int = 512 * _MIB
    processes: int = 32
    file_bytes: int = 16 * _MIB
    disk_bytes: int = 64 * _MIB
    output_bytes: int = 1 * _MIB

    def __post_init__(self) -> None:
        for name in ("wall_seconds", "cpu_seconds", "memory_bytes", "processes", "file_bytes", "disk_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Limits.{name}={getattr(self, name)!r}: must be > 0")
        if self.output_bytes < 0:
            raise ValueError(f"Limits.output_bytes={self.output_bytes!r}: must be >= 0")


@dataclass(frozen=True)
class RunResult:
    """What one run did.

    Attributes:
        exit_code: the program's exit status; None when a signal ended it.
        signal: the signal that ended it (``signal.SIGKILL`` at the wall limit), else None.
        stdout / stderr: what it wrote, decoded as UTF-8 (undecodable bytes replaced), up to the output cap.
        stdout_truncated / stderr_truncated: the stream went past ``Limits.output_bytes``.
        limit: the limit that stopped it: ``"wall"``, ``"cpu"``, ``"memory"``, ``"processes"``,
            ``"file_size"``, ``"disk"``, ``"output"``; None when it ended by itself. ``memory``,
            ``processes``, ``file_size`` and ``disk`` are read from the uncaught exception that ended the
            program (``MemoryError``, a refused fork, ``EFBIG``, ``ENOSPC``): a program that catches it
            ends by itself.
        wall_seconds: real time of the run, setup included.
        cpu_seconds: user + system CPU time of the program and the processes it waited for.
        isolated: what the kernel let the launcher isolate: ``"network"``, ``"filesystem"``, ``"processes"``.
    """

    exit_code: int | None
    signal: int | None
    stdout: str
    stderr: str
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    limit: str | None = None
    wall_seconds: float = 0.0
    cpu_seconds: float = 0.0
    isolated: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        """It exited with status 0 within every limit."""
        return self.exit_code == 0 and self.limit is None

    def describe(self) -> str:
        """One line for a log or a tool observation: how it ended and which limit stopped it."""
        end = f"exit code {self.exit_code}" if self.signal is None else f"killed by {signal.Signals(self.signal).name}"
        return end + ("" if self.limit is None else f" ({self.limit} limit)")


class _Capture:
    """A stream read up to ``cap`` bytes; the rest is counted, not kept."""

    def __init__(self, cap: int) -> None:
        self.cap, self.parts, self.size = cap, [], 0

    def add(self, data: bytes) -> None:
        keep = max(0, self.cap - self.size)
        if keep:
            self.parts.append(data[:keep])
        self.size += len(data)

    @property
    def truncated(self) -> bool:
        return self.size > self.cap

    def text(self) -> str:
        return b"".join(self.parts).decode("utf-8", errors="replace")


class Sandbox:
    """Runs Python code in fresh isolated processes under :class:`Limits`; safe to call from many threads.

    Args:
        limits: what each run may use.
        network: ``"deny"`` raises :class:`SandboxUnavailable` where the kernel cannot give a run its own
            network namespace (with it: mount and pid namespaces); ``"best_effort"`` then warns once and runs
            with the resource limits, the clean environment and (as root) the run's own uid only.
        python: the interpreter of the runs (default: this one's base interpreter, outside any venv: the
            standard library only).
        uid_base, num_uids: the uids runs take when the caller is root, one per concurrent run.
        hidden: directories replaced by an empty one in a run (default: ``/root`` and ``$HOME``, where
            credentials live).

    >>> Sandbox(Limits(wall_seconds=5)).run("print(6 * 7)").stdout  # doctest: +SKIP
    '42\\n'
    """

    _warned = False
    _warn_lock = threading.Lock()

    def __init__(
        self,
        limits: Limits | None = None,
        *,
        network: str = "deny",
        python: str | None = None,
        uid_base: int = 1_000_000_000,
        num_uids: int = 4096,
        hidden: tuple[str, ...] | None = None,
    ) -> None:
        if network not in _NETWORK_POLICIES:
            raise ValueError(f"Sandbox(network={network!r}): expected one of {_NETWORK_POLICIES}")
        if num_uids < 1 or uid_base < 1:
            raise ValueError(f"Sandbox(uid_base={uid_base}, num_uids={num_uids}): both must be >= 1")
        self.limits, self.network = limits or Limits(), network
        base_python = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
        self.python = os.path.realpath(python or (base_python if base_python.exists() else sys.executable))
        if not os.access(self.python, os.X_OK):
            raise ValueError(f"Sandbox(python={self.python!r}): not an executable")
        self.uid_base, self.num_uids = uid_base, num_uids
        home_dirs = ("/root", os.path.expanduser("~"))
        hidden = [os.path.realpath(d) for d in (hidden or home_dirs) if os.path.isdir(d)]
        self.hidden = tuple(dict.fromkeys(d for d in hidden if d != "/"))  # a service user's HOME may be /

    def run(self, code: str, stdin: str | bytes | None = None, files: dict[str, str] | None = None) -> RunResult:
        """Runs ``code`` as ``main.py`` in a fresh work directory, with ``files`` beside it.

        Args:
            code: Python source.
            stdin: the program's standard input (default: empty).
            files: relative path → text, written into the work directory before the run.

        Returns:
            A :class:`RunResult`; a program that fails or is stopped by a limit is a result, not an error.

        Raises:
            SandboxUnavailable: ``network="deny"`` and the kernel refuses the namespaces.
            ValueError: a file path that is absolute or leaves the work directory.
        """
        files = dict(files or {})
        for name in files:
            path = PurePosixPath(name)
            if path.is_absolute() or ".." in path.parts or name in ("", "main.py"):
                raise ValueError(f"Sandbox.run files: {name!r} must be a relative path inside the work directory")
        files["main.py"] = code
        if os.getuid() != 0:
            return self._run_in(stdin, files, run_uid=-1)
        with lease_uid(self.uid_base, self.num_uids) as uid:
            return self._run_in(stdin, files, run_uid=uid)

    def _run_in(self, stdin: str | bytes | None, files: dict[str, str], run_uid: int) -> RunResult:
        run_dir = tempfile.mkdtemp(prefix="rlflow-sandbox-")
        try:
            os.chmod(run_dir, 0o711)  # the run's uid passes through to its work directory, reads nothing here
            workdir = os.path.join(run_dir, "work")
            os.mkdir(workdir, 0o700)
            if run_uid > 0:
                os.chown(workdir, run_uid, run_uid)
            spec = self._spec(workdir, files, run_uid)
            spec_path = os.path.join(run_dir, "spec.json")
            with open(os.open(spec_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
                json.dump(spec, f)
            return self._execute(spec_path, stdin)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)

    def _spec(self, workdir: str, files: dict[str, str], run_uid: int) -> dict:
        prefix = os.path.dirname(os.path.dirname(self.python))
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        return {
            "network": self.network,
            "limits": self.limits.__dict__,
            "files": files,
            "workdir": workdir,
            "run_uid": run_uid,
            "python": self.python,
            "python_prefix": prefix,
            "hidden": [d for d in self.hidden if not workdir.startswith(d + "/")],
            "env": env,
        }

    def _execute(self, spec_path: str, stdin: str | bytes | None) -> RunResult:
        start = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", str(_LAUNCHER), spec_path],
            stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={"PATH": "/usr/bin:/bin"},
            start_new_session=True,  # its own process group: the wall limit kills every process of it
        )
        if stdin is not None:
            data = stdin.encode() if isinstance(stdin, str) else stdin
            threading.Thread(target=_feed, args=(proc.stdin, data), daemon=True).start()
        out, err = _Capture(self.limits.output_bytes), _Capture(self.limits.output_bytes)
        stopped_by = _pump(proc, out, err, start + self.limits.wall_seconds)
        _end(proc, stop=stopped_by is not None)
        wall = time.monotonic() - start
        status = _read_status(os.path.join(os.path.dirname(spec_path), "status.json"))
        if "setup_error" in status:
            message = status["setup_error"]
            if self.network == "deny" and "unshare" in message:
                raise SandboxUnavailable(f"{message}; Sandbox(network='best_effort') runs without namespaces")
            raise RuntimeError(f"sandbox could not start the run: {message}")
        isolated = tuple(status.get("isolated", ()))
        self._warn_if_unisolated(isolated)
        return _result(status, out, err, stopped_by, wall, isolated, self.limits)

    def _warn_if_unisolated(self, isolated: tuple[str, ...]) -> None:
        if "network" in isolated or self.network == "deny":
            return
        with Sandbox._warn_lock:
            if not Sandbox._warned:
                Sandbox._warned = True
                warnings.warn(
                    "sandbox: the kernel refused new namespaces; runs have network access and see the "
                    "machine's filesystem (the resource limits and the clean environment still apply)",
                    RuntimeWarning,
                    stacklevel=5,  # the caller of Sandbox.run
                )


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.close()
    except OSError:  # the program exited or closed its stdin before reading it all
        pass


def _pump(proc: subprocess.Popen, out: _Capture, err: _Capture, deadline: float) -> str | None:
    """Reads both streams until they close; returns ``"wall"`` or ``"output"`` when a limit cuts the run short."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, out)
    sel.register(proc.stderr, selectors.EVENT_READ, err)
    try:
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "wall"
            for key, _ in sel.select(remaining):
                data = os.read(key.fd, 1 << 16)
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                key.data.add(data)
                if key.data.truncated:
                    return "output"
        return None
    finally:
        sel.close()
        proc.stdout.close()
        proc.stderr.close()


def _end(proc: subprocess.Popen, stop: bool) -> None:
    """Waits for the launcher, first asking it to end the run when ``stop``, then reaps it.

    SIGTERM makes the launcher SIGKILL the program, whose end kills the rest of its pid namespace; a
    launcher that has not exited after ``_STOP_SECONDS`` is killed with its group. The launcher is reaped
    last: until then its pid, the group's id, cannot be reused, so killing the group never hits another run.
    """
    if stop:
        os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + _STOP_SECONDS
        while _running(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
    if stop and _running(proc.pid):
        os.killpg(proc.pid, signal.SIGKILL)  # the program dies with the launcher (PR_SET_PDEATHSIG)
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    with contextlib.suppress(ProcessLookupError):  # without a pid namespace, what the program started may outlive it
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _running(pid: int) -> bool:
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None


def _read_status(path: str) -> dict:
    """The launcher's lines merged: ``isolated`` once the namespaces are entered, ``wait_status`` and
    ``cpu_seconds`` once the program ended (absent when a limit killed the launcher first), ``setup_error``
    when the run could not start."""
    status = {}
    with contextlib.suppress(FileNotFoundError), open(path) as f:
        for line in f:
            status.update(json.loads(line))
    return status


def _result(
    status: dict,
    out: _Capture,
    err: _Capture,
    stopped_by: str | None,
    wall: float,
    isolated: tuple[str, ...],
    limits: Limits,
) -> RunResult:
    exit_code, sig, cpu = None, signal.SIGKILL, 0.0
    if "wait_status" in status:
        raw, cpu = status["wait_status"], status["cpu_seconds"]
        exit_code = os.WEXITSTATUS(raw) if os.WIFEXITED(raw) else None
        sig = os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else None
    limit = stopped_by or _limit_from_exit(sig, cpu, err.text(), limits)
    return RunResult(exit_code, sig, out.text(), err.text(), out.truncated, err.truncated, limit, wall, cpu, isolated)


def _limit_from_exit(sig: int | None, cpu: float, stderr: str, limits: Limits) -> str | None:
    # The kernel's tick accounting fires RLIMIT_CPU slightly before rusage adds up to the limit.
    if sig in (signal.SIGXCPU, signal.SIGKILL) and cpu >= limits.cpu_seconds - _CPU_SLACK_SECONDS:
        return "cpu"
    last = stderr.rstrip().rpartition("\n")[2]
    if sig == signal.SIGXFSZ or last.startswith("OSError: [Errno 27]"):  # Python ignores SIGXFSZ: EFBIG
        return "file_size"
    if last.startswith("OSError: [Errno 28]"):  # ENOSPC: the work directory's tmpfs is full
        return "disk"
    if last.startswith("MemoryError"):
        return "memory"
    if last.startswith("BlockingIOError: [Errno 11]"):  # fork/clone refused: RLIMIT_NPROC
        return "processes"
    return None
