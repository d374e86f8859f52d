"""Rendezvous for ``torch.distributed`` and spawned processes: the ports the controller hands its
workers, and the guard under which rlflow spawns the processes of a gloo group (the profiler).

Sits at the bottom of rlflow (it imports nothing from it), so that the controller and the
process groups (:mod:`rlflow.parallel.groups`) share one helper.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import types
from collections.abc import Iterator

_MAIN_SWAP = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now, for a rendezvous (``""``: on every interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """Processes started by the ``spawn`` method inside this block do not run the parent's script.

    A spawned child re-imports the parent's ``__main__`` (``multiprocessing.spawn`` records its
    file) before it unpickles its target. A script without an ``if __name__ == "__main__":``
    guard — TRL's quickstart style — would then run again in the child, start a Trainer there, and
    fail in multiprocessing's bootstrapping check. rlflow's spawned targets are functions of
    rlflow's own modules, so the child needs nothing of ``__main__``: a bare stand-in module is
    put in its place while the children are started.
    """
    with _MAIN_SWAP:
        main = sys.modules.get("__main__")
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            yield
        finally:
            if main is None:
                del sys.modules["__main__"]
            else:
                sys.modules["__main__"] = main
