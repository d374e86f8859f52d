"""Shared fixtures. Ray is started once per test session, with more logical CPUs than the
machine has cores so that several fractional-CPU workers fit on a 2-core machine."""

from __future__ import annotations

import os

import pytest

# Every process the tests start (Ray workers, torch.multiprocessing children) uses one torch
# thread: two cores are few, and oversubscription makes gloo collectives crawl.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

RAY_NUM_CPUS = 16


@pytest.fixture(autouse=True)
def algorithm_registry(monkeypatch):
    """Every test sees the shipped algorithms only: whatever one registers (``Trainer(algorithm=record)``
    registers its record) is gone after it, so tests that read the registry do not depend on order."""
    from rlflow.dataflow import algorithms

    monkeypatch.setattr(algorithms, "_ALGORITHMS", dict(algorithms._ALGORITHMS))


@pytest.fixture(scope="session", autouse=True)
def rlflow_cache_dir(tmp_path_factory):
    """rlflow's cache (machine profiles) in the session's temporary directory: tests neither write
    to the user's home nor read a profile an earlier session or another checkout left there."""
    path = tmp_path_factory.mktemp("rlflow-cache")
    old = os.environ.get("RLFLOW_CACHE_DIR")
    os.environ["RLFLOW_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("RLFLOW_CACHE_DIR", None)
    else:
        os.environ["RLFLOW_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray cluster shared by every test of the session."""
    import ray

    from rlflow.trainer.local_ray import WORKER_ENV, scoped_environ

    if not ray.is_initialized():
        # The worker env inherited rather than a job runtime_env, as a run's own Ray does: actors
        # then start in the workers Ray prestarted (build.ensure_ray).
        with scoped_environ(WORKER_ENV):
            ray.init(num_cpus=RAY_NUM_CPUS, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
