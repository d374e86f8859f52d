"""Atomic file writes: a reader sees the old file or the new one, never half of one; rlflow's cache.

Used wherever a file may be read while it is written or survive a crash mid-write: a saved
``DataProto`` (:meth:`rlflow.protocol.DataProto.save`), a machine profile or a host's measured
matmul speeds shared through the cache by concurrent runs (:mod:`rlflow.planner.profile`,
:func:`rlflow.engine.parallelize.cpu_bf16_speedup`). It sits at the bottom of the layers.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["cache_dir", "write_atomic"]


def cache_dir() -> Path:
    """rlflow's per-user cache: ``$RLFLOW_CACHE_DIR``, else ``~/.cache/rlflow``."""
    return Path(os.environ.get("RLFLOW_CACHE_DIR") or Path.home() / ".cache" / "rlflow")


def write_atomic(path: str | os.PathLike, data: bytes | str, *, fsync: bool = False) -> Path:
    """Write ``data`` to ``path`` through a temporary file beside it, renamed onto it.

    Args:
        path: the file; its directory is created when missing.
        data: the bytes, or text written as UTF-8.
        fsync: flush the file to disk before the rename (the data must survive a power loss, not
            only a killed process).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
