"""The sandbox's launcher: a script run as ``python -I -S _launcher.py SPEC`` that isolates, then runs the code.

Standard library only (it runs in a bare interpreter). It reads the run's spec (a JSON file written by
:class:`rlflow.sandbox.Sandbox`), enters new network, mount and pid namespaces (and a user namespace
when it is not root), and forks the first process of the new pid namespace, which mounts a read-only
view of the machine with a private work directory on a size-capped tmpfs, writes the run's files,
sets the resource limits, drops to the run's own uid and execs the interpreter on ``main.py``. The
launcher writes ``status.json`` beside the spec: a line saying what was isolated, then, once the program
has ended, a line with its wait status and CPU seconds; a failure before the exec is a ``setup_error`` line.
"""

import ctypes
import json
import os
import resource
import signal
import sys

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 4096, 16384, 1 << 18
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID, AT_RECURSIVE = 0x1, 0x2, 0x8000
SYS_MOUNT_SETATTR = 442  # the same number in x86_64's and the generic (arm64) syscall tables
PR_SET_PDEATHSIG = 1
SETUP_FAILED = 125  # the exit status of a launcher or child that could not set the run up

libc = ctypes.CDLL(None, use_errno=True)


class MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64)]
    _fields_ += [("userns_fd", ctypes.c_uint64)]


def check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    check(libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {target}")


def write_file(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def enter_namespaces(spec: dict) -> list[str]:
    """Unshares what the kernel allows; returns the isolated parts, or raises when ``network`` is ``deny``."""
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID | (0 if uid == 0 else CLONE_NEWUSER)
    if libc.unshare(flags) != 0:
        err = ctypes.get_errno()
        if spec["network"] == "deny":
            raise OSError(err, f"unshare(network, mount, pid namespaces) refused: {os.strerror(err)}")
        return []
    if uid != 0:  # one mapped id: this user is root of its own namespace and nothing more
        write_file("/proc/self/setgroups", "deny")
        write_file("/proc/self/uid_map", f"0 {uid} 1")
        write_file("/proc/self/gid_map", f"0 {gid} 1")
    return ["network", "filesystem", "processes"]


def build_filesystem(spec: dict) -> None:
    """Mounts, in the run's own mount namespace: the hidden directories as empty tmpfs (with the
    interpreter bound back where it lies under one), the whole tree read-only and nosuid, a fresh
    /proc of the pid namespace, and the work directory as a size-capped tmpfs owned by the run's uid."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here reaches the machine's namespace
    prefix = spec["python_prefix"]
    prefix_fd = os.open(prefix, os.O_PATH)  # held open: the tmpfs below may cover its path
    for hidden in spec["hidden"]:
        mount("tmpfs", hidden, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
        if prefix.startswith(hidden.rstrip("/") + "/"):
            os.makedirs(prefix, exist_ok=True)
            mount(f"/proc/self/fd/{prefix_fd}", prefix, None, MS_BIND | MS_REC)
    os.close(prefix_fd)
    attr = MountAttr(MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0)
    ret = libc.syscall(SYS_MOUNT_SETATTR, -100, b"/", AT_RECURSIVE, ctypes.byref(attr), ctypes.sizeof(attr))
    check(ret, "mount_setattr(/, read-only, recursive)")
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    size, owner = spec["limits"]["disk_bytes"], spec["run_uid"]
    mount("tmpfs", spec["workdir"], "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=700,uid={owner},gid={owner}")


def place_files(spec: dict) -> None:
    for name, text in spec["files"].items():
        path = os.path.join(spec["workdir"], name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_file(path, text)
    for root, dirs, files in os.walk(spec["workdir"]):
        for name in dirs + files:
            os.chown(os.path.join(root, name), spec["run_uid"], spec["run_uid"])


def set_limits(limits: dict) -> None:
    # Soft = hard: SIGKILL at the limit. The program is the first process of its pid namespace, which the
    # kernel spares every signal it does not handle (SIGXCPU included) but SIGKILL.
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_seconds"],) * 2)
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["processes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_child(spec: dict, isolated: list[str], status_fd: int) -> None:
    """The first process of the pid namespace: builds the view, drops privileges, execs the interpreter."""
    try:
        if "filesystem" in isolated:
            build_filesystem(spec)
        place_files(spec)
        set_limits(spec["limits"])
        if os.getuid() == 0 and spec["run_uid"] != 0:  # root: become the run's own unprivileged uid
            os.setgroups([])
            os.setgid(spec["run_uid"])
            os.setuid(spec["run_uid"])
        check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
        if os.getppid() != spec["launcher_pid"] and "processes" not in isolated:
            os._exit(SETUP_FAILED)  # the launcher died before the death signal was armed
        os.chdir(spec["workdir"])
        python = spec["python"]
        os.execve(python, [python, "-E", "-s", "-B", "main.py"], spec["env"])
    except BaseException as err:  # anything before the exec: the run did not start
        os.write(status_fd, json.dumps({"setup_error": str(err)}).encode() + b"\n")
        os._exit(SETUP_FAILED)


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    # Opened before the run's mounts make this directory read-only (the launcher shares its mount namespace).
    status_fd = os.open(os.path.join(os.path.dirname(spec_path), "status.json"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        isolated = enter_namespaces(spec)
    except OSError as err:
        os.write(status_fd, json.dumps({"setup_error": str(err)}).encode() + b"\n")
        sys.exit(SETUP_FAILED)
    os.write(status_fd, json.dumps({"isolated": isolated}).encode() + b"\n")
    spec["launcher_pid"] = os.getpid()
    if spec["run_uid"] == -1:  # not root: 0 of its own user namespace (or itself without one), no uid to drop to
        spec["run_uid"] = os.getuid()
    # The caller stops a run with SIGTERM to the launcher, which kills the program: its pid stays valid
    # (unreaped) until wait4, and its end tears the pid namespace down, so wait4 returns once every process
    # of the run is gone. SIGTERM is blocked across the fork so that one sent early waits for the handler.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    child = os.fork()
    if child == 0:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # the mask would outlive the exec
        run_child(spec, isolated, status_fd)
    signal.signal(signal.SIGTERM, lambda *_: os.kill(child, signal.SIGKILL))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    _, status, usage = os.wait4(child, 0)
    cpu = usage.ru_utime + usage.ru_stime
    os.write(status_fd, json.dumps({"wait_status": status, "cpu_seconds": cpu}).encode() + b"\n")


if __name__ == "__main__":
    main(sys.argv[1])
