"""A local Ray started on a thread while the driver prepares the run.

A local Ray takes seconds to start (its GCS, API server, raylet and agents, and a Python worker
per CPU: docs/benchmarks.md, section "rlflow against TRL's `GRPOTrainer`"), and the driver's
imports of tensordict, torch's distributed stack and the engines, its construction and the
imports of a launch take about as long; they ran one after the other. ``Trainer(...)`` now
calls :func:`begin_local_ray` before any of them, and
:func:`rlflow.trainer.build.ensure_ray` takes the instance over at launch when the validated
config asks for that Ray (a local one of this machine's cores, with the dashboard as asked), else
shuts it down and starts the one it asks for. A construction that fails stops it
(:meth:`LocalRayStart.stop`), so bad input leaves no Ray behind.

Nothing heavy is imported here: Ray itself is imported on the thread.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from rlflow.planner.cluster import local_devices_per_node

# The environment of every Ray process a run starts: one torch thread per worker (few cores are
# shared; oversubscription makes gloo collectives crawl), no tokenizer thread pools.
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

# How often the thread that started a local Ray looks whether it has been shut down.
KEEP_ALIVE_POLL_S = 0.5

# One ``ray.init`` at a time in this process: a thread's and ``ensure_ray``'s (two trainers).
RAY_INIT_LOCK = threading.Lock()


@contextlib.contextmanager
def scoped_environ(env: Mapping[str, str]) -> Iterator[None]:
    """``env`` set in ``os.environ`` for the block (for the processes it starts), then restored."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def init_local_ray(num_cpus: int, include_dashboard: bool) -> None:
    """``ray.init`` of a local instance whose processes inherit :data:`WORKER_ENV`.

    Not as a job ``runtime_env``: Ray prestarts a Python worker per CPU for the first driver,
    without runtime env, and an actor starts in one of them only when its runtime env matches;
    with env_vars every worker would be a new process and the prestarted ones idle. The raylet,
    and every worker it starts, inherit the driver's environment.
    """
    import ray

    with scoped_environ(WORKER_ENV):
        ray.init(num_cpus=num_cpus, include_dashboard=include_dashboard)


class LocalRayStart:
    """:func:`init_local_ray` on a thread (none when this process already has Ray by then).

    The thread lives as long as the Ray it started: Ray starts its processes with
    ``PR_SET_PDEATHSIG``, and Linux sends that signal when the *thread* that started a process
    exits, so a thread that returned after ``ray.init`` would take the GCS and the raylet with it.
    """

    def __init__(self, num_cpus: int, include_dashboard: bool) -> None:
        self.num_cpus, self.include_dashboard = num_cpus, include_dashboard
        self._started = False
        self._error: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlflow-local-ray", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            import ray

            with RAY_INIT_LOCK:
                if not ray.is_initialized():
                    init_local_ray(self.num_cpus, self.include_dashboard)
                    self._started = True
        except BaseException as err:  # handed to the driver by wait()
            self._error = err
        finally:
            self._ready.set()
        while self._started and ray.is_initialized():  # until someone shuts it down
            time.sleep(KEEP_ALIVE_POLL_S)

    def wait(self) -> bool:
        """Waits for the start; whether it started a Ray (False: this process had one already).

        Raises:
            Exception: what ``ray.init`` raised on the thread.
        """
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self._started

    def stop(self) -> None:
        """Waits for the start, then shuts down the Ray it started (a trainer that never launched)."""
        self._ready.wait()
        if self._started:
            import ray

            ray.shutdown()
            self._thread.join()


def begin_local_ray(config: Any, overrides: Sequence[str] = ()) -> LocalRayStart | None:
    """Begins a local Ray on a thread when the run will start one; None when it will not.

    It will when this process has no Ray yet (no notebook's or test session's ``ray.init``), no
    ``RAY_ADDRESS`` names a cluster, and the settings as given (``config`` in any form
    ``Trainer`` takes, then ``overrides``) name no ``placement.ray_address`` and no
    ``placement.oversubscribe`` (a Ray of more CPUs than cores) and ask for Ray workers
    (``placement.worker_host: ray``: with ``auto`` a one-worker plan runs its worker in the
    driver, known only once planned, and a Ray begun for nothing would take the cores the
    driver's imports need; :meth:`rlflow.trainer.Trainer.launch` starts Ray after the plan
    then). What it starts is what
    :func:`rlflow.trainer.build.ensure_ray` would: this machine's cores, the dashboard only when
    ``placement.ray_dashboard`` asks. Settings that cannot be read here start nothing: the
    config's own validation reports them.
    """
    ray = sys.modules.get("ray")  # not imported here when the process has not imported it
    if (ray is not None and ray.is_initialized()) or os.environ.get("RAY_ADDRESS"):
        return None
    placement = _given_placement(config, overrides)
    if (
        placement is None
        or placement.get("ray_address") is not None
        or placement.get("oversubscribe")
        or placement.get("worker_host", "auto") != "ray"
    ):
        return None
    # torch fixes its thread count from OMP_NUM_THREADS as it loads: load it before the thread
    # sets WORKER_ENV in this process's environment for Ray's processes to inherit.
    import torch  # noqa: F401

    return LocalRayStart(local_devices_per_node(use_gpu=False), bool(placement.get("ray_dashboard") or False))


def _given_placement(config: Any, overrides: Sequence[str]) -> dict[str, Any] | None:
    """The ``placement`` settings of a YAML path, a dict, an ``RLFlowConfig`` or None, with the
    ``placement.*`` overrides applied; None when they cannot be read."""
    from omegaconf import OmegaConf

    try:
        if config is None:
            section: Any = {}
        elif isinstance(config, (str, os.PathLike)):
            section = OmegaConf.to_container(OmegaConf.load(config)).get("placement") or {}
        elif isinstance(config, Mapping):
            section = config.get("placement") or {}
        else:  # an RLFlowConfig
            p = config.placement
            section = {
                "ray_address": p.ray_address,
                "oversubscribe": p.oversubscribe,
                "ray_dashboard": p.ray_dashboard,
                "worker_host": p.worker_host,
            }
        given = [o for o in overrides if o.startswith("placement.")]
        if given:
            section = {**section, **OmegaConf.to_container(OmegaConf.from_dotlist(given))["placement"]}
        return dict(section)
    except Exception:  # unreadable here: the config's validation names the problem
        return None
