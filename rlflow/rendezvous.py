"""Rendezvous ports for ``torch.distributed``: what the controller hands its workers, and what
tests and the profiler use to form a gloo group of spawned processes.

Sits at the bottom of rlflow (it imports nothing from it), so that the controller and the
process groups (:mod:`rlflow.parallel.groups`) share one helper.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now, for a rendezvous (``""``: on every interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
