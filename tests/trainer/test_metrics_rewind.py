"""After a resume no step is logged twice: the logger forgets what the interrupted run logged after
the checkpoint's step, in metrics.jsonl and in TensorBoard (issue 15: ``metrics.jsonl`` repeated
the re-run steps)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from rlflow.trainer.config import LoggingConfig
from rlflow.trainer.metrics import MetricsLogger


def jsonl_steps(run_dir) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def interrupted_then_resumed(run_dir, cfg: LoggingConfig, torn: bool = False) -> None:
    """Steps 1..5 logged by a run killed after step 5, then a run resumed from step 3's checkpoint
    that logs 4..6 (with the value 10 * step, where the first run logged step)."""
    with MetricsLogger(cfg, run_dir) as first:
        for step in range(1, 6):
            first.log(step, {"reward": float(step)})
    if torn:  # a kill in the middle of a write leaves half a line
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.write('{"step": 6, "rew')
    with MetricsLogger(cfg, run_dir) as resumed:
        resumed.rewind(3)
        for step in range(4, 7):
            resumed.log(step, {"reward": 10.0 * step})


@pytest.mark.parametrize("torn", [False, True])
def test_a_resumed_run_logs_each_step_once_in_the_jsonl(tmp_path, torn):
    interrupted_then_resumed(tmp_path, LoggingConfig(console=False, tensorboard=False), torn)

    assert jsonl_steps(tmp_path) == [1, 2, 3, 4, 5, 6]
    rewards = {r["step"]: r["reward"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    assert rewards == {1: 1.0, 2: 2.0, 3: 3.0, 4: 40.0, 5: 50.0, 6: 60.0}  # the resumed run's values


def test_a_resumed_run_logs_each_step_once_in_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    interrupted_then_resumed(tmp_path, LoggingConfig(console=False, jsonl=False, tensorboard=True))

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = events.Scalars("reward")
    assert Counter(e.step for e in scalars) == Counter({1: 1, 2: 1, 3: 1, 4: 1, 5: 1, 6: 1})
    assert [e.value for e in scalars] == [1.0, 2.0, 3.0, 40.0, 50.0, 60.0]


def test_a_restart_in_the_same_process_rewinds_the_open_logger(tmp_path):
    # Recovery from a dead worker resumes in the same driver, with the logger it already has.
    with MetricsLogger(LoggingConfig(console=False, tensorboard=False), tmp_path) as logger:
        for step in (1, 2, 3):
            logger.log(step, {"loss": 1.0})
        logger.log(3, {"eval/score": 0.5})  # two records of one step are fine: both stay
        logger.rewind(2)
        logger.log(3, {"loss": 2.0})
    assert jsonl_steps(tmp_path) == [1, 2, 3]


def test_a_restart_from_the_start_forgets_every_step(tmp_path):
    # A worker died before the first checkpoint: the run starts over and logs step 0 (evaluation,
    # warm-up) and every step after it again; rewind(-1) drops all the failed attempt logged.
    with MetricsLogger(LoggingConfig(console=False, tensorboard=False), tmp_path) as logger:
        logger.log(0, {"eval/score": 0.25})
        logger.log(1, {"loss": 1.0})
        logger.rewind(-1)
        assert (tmp_path / "metrics.jsonl").read_text() == ""
        logger.log(0, {"eval/score": 0.25})
        logger.log(1, {"loss": 2.0})
    assert jsonl_steps(tmp_path) == [0, 1]


def test_rewind_refuses_a_step_below_minus_one_and_a_closed_logger(tmp_path):
    logger = MetricsLogger(LoggingConfig(console=False, tensorboard=False), tmp_path)
    with pytest.raises(ValueError, match="step=-2"):
        logger.rewind(-2)
    logger.close()
    with pytest.raises(RuntimeError, match="after close"):
        logger.rewind(0)
