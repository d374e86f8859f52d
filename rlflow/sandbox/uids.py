"""One unprivileged uid per concurrent run, leased through lock files so that threads and processes agree.

A run executes as its own uid when the caller is root: RLIMIT_NPROC (the process-count limit) counts
the processes of a uid, and the kernel does not apply it to root, so each run needs a uid of its own
for the limit to hold and for one run never to reach another's processes or files.
"""

from __future__ import annotations

import fcntl
import os
import random
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["lease_uid"]


def _lock_dir() -> str:
    path = os.path.join(tempfile.gettempdir(), f"rlflow-sandbox-uids-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


@contextmanager
def lease_uid(base: int, count: int) -> Iterator[int]:
    """Holds one uid of ``[base, base + count)`` that no other run holds, for the ``with`` block.

    Raises:
        RuntimeError: every uid of the range is leased (more concurrent runs than ``count``).
    """
    lock_dir, start = _lock_dir(), random.randrange(count)
    for i in range(count):
        uid = base + (start + i) % count
        fd = os.open(os.path.join(lock_dir, str(uid)), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield uid
        finally:
            os.close(fd)  # closing the descriptor releases the lock
        return
    raise RuntimeError(f"all {count} sandbox uids from {base} are in use; raise Sandbox(num_uids=...)")
