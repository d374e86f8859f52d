"""rlflow's messages go through the ``rlflow`` logger at ``logging.level``: printed by a plain handler
when the application configured no logging, through the application's handlers when it did, and
the workers set the run's level too."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from rlflow.algos.params import AlgorithmParams
from rlflow.engine.rollout import SamplingParams
from rlflow.trainer.config import ConfigError, load_config
from rlflow.workers.logs import configure_logging
from rlflow.workers.model_worker import ModelWorker
from rlflow.workers.setup import WorkerSetup


@pytest.fixture
def unconfigured(monkeypatch):
    """A process whose logging nobody configured: pytest's capture handlers off the root logger while
    the test runs (they are added as each phase begins); the ``rlflow`` logger restored afterwards."""
    rlflow = logging.getLogger("rlflow")
    monkeypatch.setattr(rlflow, "handlers", [])
    monkeypatch.setattr(rlflow, "level", rlflow.level)

    @contextmanager
    def without_root_handlers() -> Iterator[logging.Logger]:
        saved = logging.root.handlers[:]
        logging.root.handlers.clear()
        try:
            yield rlflow
        finally:
            logging.root.handlers[:] = saved

    return without_root_handlers


def test_without_logging_configured_messages_print_to_stdout_at_the_level(unconfigured, capsys):
    module = logging.getLogger("rlflow.trainer.trainer")
    with unconfigured() as rlflow:
        configure_logging("info")
        module.info("resumed from step 2")
        module.debug("a detail")
        configure_logging("warning")
        module.info("not shown at warning")
        module.warning("SIGTERM: stopped at step 3")
        assert len(rlflow.handlers) == 1  # configured twice, one handler
    assert capsys.readouterr().out == "resumed from step 2\nSIGTERM: stopped at step 3\n"


def test_an_applications_logging_configuration_wins(unconfigured, capsys):
    class Collect(logging.Handler):
        def __init__(self) -> None:
            super().__init__()
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    application = Collect()
    with unconfigured() as rlflow:
        configure_logging("info")  # an earlier run, before the application set up logging
        logging.root.addHandler(application)
        configure_logging("info")
        logging.getLogger("rlflow.trainer.data").info("no held-out evaluation")
        assert rlflow.handlers == []
    assert application.messages == ["no held-out evaluation"]
    assert capsys.readouterr().out == ""  # not printed a second time by rlflow's own handler


def test_the_level_is_a_config_field():
    assert load_config(None).logging.level == "info"
    assert load_config(None, ["logging.level=debug"]).logging.level == "debug"
    with pytest.raises(ConfigError, match=r"logging.level: 'verbose' is not allowed; expected one of \['debug'"):
        load_config(None, ["logging.level=verbose"])
    with pytest.raises(ValueError, match="log level 'verbose'"):
        configure_logging("verbose")


def test_a_worker_sets_the_runs_level(unconfigured):
    setup = WorkerSetup({}, {}, {}, AlgorithmParams(), SamplingParams(), SamplingParams(greedy=True), "")
    assert setup.log_level == "info"
    with unconfigured() as rlflow:
        ModelWorker(WorkerSetup(**{**vars(setup), "log_level": "debug"}))
        assert rlflow.level == logging.DEBUG and len(rlflow.handlers) == 1


# A Ray worker process of its own (the test session's Ray does not forward worker output).
RAY_WORKER = textwrap.dedent(
    """
    import logging, ray
    from rlflow.workers.logs import configure_logging

    @ray.remote(num_cpus=1)
    class Worker:
        def run(self):
            configure_logging("info")  # what ModelWorker does with the run's logging.level
            logging.getLogger("rlflow.workers.reward_errors").info("reward_inf: 1 reward error(s)")
            logging.getLogger("rlflow.workers.reward_errors").debug("below the level")

    ray.init(num_cpus=1, include_dashboard=False)
    ray.get(Worker.remote().run.remote())
    ray.shutdown()  # flushes the forwarded output
    """
)


@pytest.mark.timeout(120)
def test_a_ray_workers_messages_reach_the_drivers_output():
    env = dict(os.environ, RAY_DEDUP_LOGS="0")
    proc = subprocess.run([sys.executable, "-c", RAY_WORKER], env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr  # Ray prefixes the worker's lines with "(Worker pid=...)"
    assert "reward_inf: 1 reward error(s)" in out and "below the level" not in out
