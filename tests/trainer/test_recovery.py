"""Recovery without a person: a killed worker is restarted from the last checkpoint; SIGTERM saves first.

A GRPO run trains its actor data-parallel on two workers and checkpoints every step. A callback
SIGKILLs worker 1 as step 2 is logged; with ``trainer.max_restarts=1`` the driver stops the
workers, starts them again, resumes the last checkpoint (step 1's: step 2's save found the worker
dead) and finishes the run. A SIGTERM during training
ends the run after the step in flight with a checkpoint of that step.
"""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest
import ray
from recipe_helpers import QUICK_FIT, TINY_ACTOR

from rlflow.controller import WorkerDiedError, WorkerError
from rlflow.trainer import Trainer, load_config
from rlflow.trainer.checkpoint import read_trainer_state
from rlflow.trainer.trainer import is_recoverable

GRPO = Path(__file__).resolve().parents[2] / "recipes" / "grpo_arithmetic.yaml"
M = "placement.manual"
COMMON = [
    *QUICK_FIT,
    *TINY_ACTOR,
    "algorithm.n_samples=2",
    "algorithm.entropy_coef=0.1",
    "trainer.eval_before_train=false",
]
DP2 = ["placement.mode=manual", "placement.devices_per_node=2"]
DP2 += [f"{M}.{call}.mesh.num_devices=2" for call in ("actor_train", "actor_gen")]
DP2 += [f"{M}.{call}.strategy.dp=2" for call in ("actor_train", "actor_gen")]


def kill_worker(trainer: Trainer, rank: int) -> None:
    """SIGKILL the process of worker ``rank``, as the OOM killer would (the group's actor handles
    are private: a test reaches into them to find the process)."""
    host = trainer.workers._actors.hosts[rank]
    pid = ray.get(host.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGKILL)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("save_every", [1, 0], ids=["checkpointed", "no_checkpoint"])
def test_a_killed_worker_is_restarted_and_the_run_finishes(ray_session, tmp_path, caplog, save_every):
    killed: list[int] = []
    holder: dict[str, Trainer] = {}

    def kill_once(step: int, metrics: dict) -> None:
        if step == 2 and "actor_train/loss" in metrics and not killed:
            killed.append(step)
            kill_worker(holder["trainer"], 1)

    overrides = [*COMMON, *DP2, "trainer.total_steps=4", f"checkpoint.every_n_steps={save_every}",
                 "trainer.max_restarts=1"]  # fmt: skip
    trainer = Trainer(
        load_config(GRPO, [*overrides, f"logging.dir={tmp_path}"]), callbacks=[kill_once], progress_bars=False
    )
    holder["trainer"] = trainer
    try:
        result = trainer.fit()
    finally:
        trainer.close()

    out = caplog.text
    assert killed == [2] and result.steps == 4
    assert "restart 1/1 at step" in out and "starting the workers again and resuming from" in out
    if save_every:
        # The callback runs as step 2 is logged, before its checkpoint: the save fails, step 1's resumes.
        assert f"resumed from {tmp_path / 'checkpoints' / 'step_1'} at step 1" in out
    else:  # no checkpoint yet: the run starts over from its first launch's state
        assert "resumed from" not in out
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("trainer/restarts") == 1 for r in records)
    # Every step once, whatever the failed attempt logged before the restart.
    losses = [(r["step"], r["actor_train/loss"]) for r in records if "actor_train/loss" in r]
    assert sorted(s for s, _ in losses) == [1, 2, 3, 4] and all(math.isfinite(v) for _, v in losses)
    assert read_trainer_state(tmp_path / "checkpoints" / "step_4")["step"] == 4


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_sigterm_saves_the_step_in_flight_then_exits(ray_session, tmp_path, caplog):
    def terminate(step: int, metrics: dict) -> None:
        if step == 2 and "actor_train/loss" in metrics:
            os.kill(os.getpid(), signal.SIGTERM)

    overrides = [*COMMON, "trainer.total_steps=6", "checkpoint.save_final=false", f"logging.dir={tmp_path}"]
    before = signal.getsignal(signal.SIGTERM)
    trainer = Trainer(load_config(GRPO, overrides), callbacks=[terminate], progress_bars=False)
    try:
        with pytest.raises(SystemExit) as exit_info:
            trainer.fit()
    finally:
        trainer.close()
    assert exit_info.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is the caller's again
    # Step 3 was issued before step 2's metrics came back (overlap): the run ends after it.
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert saved == ["step_3"] and read_trainer_state(tmp_path / "checkpoints" / "step_3")["step"] == 3
    assert "SIGTERM: stopped at step 3" in caplog.text


def test_only_a_dead_worker_or_a_failed_collective_is_worth_a_restart():
    died = WorkerDiedError(("model",), 1, None, "The actor died unexpectedly")
    peer = WorkerError(
        "model", 0, None, "execute", "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer"
    )
    hung = WorkerError(
        "model", 0, None, "execute", "RuntimeError: [gloo] Timed out waiting 600000ms for recv operation"
    )
    bug = WorkerError("model", 0, None, "execute", "ValueError: reward function returned 3 values for 4 samples")
    assert is_recoverable(died) and is_recoverable(peer) and is_recoverable(hung)
    assert not is_recoverable(bug) and not is_recoverable(ValueError("Timed out"))


@pytest.mark.parametrize("save_on_signal", [True, False])
def test_signal_handlers_are_rlflows_only_while_it_trains_and_only_when_asked(tmp_path, save_on_signal):
    overrides = [*COMMON, f"checkpoint.save_on_signal={str(save_on_signal).lower()}", f"logging.dir={tmp_path}"]
    trainer = Trainer(load_config(GRPO, overrides), progress_bars=False)  # built, not launched: no workers
    signals = (signal.SIGINT, signal.SIGTERM)
    before = [signal.getsignal(s) for s in signals]
    with trainer._signals_stop_training():
        inside = [signal.getsignal(s) for s in signals]
    assert (inside != before) is save_on_signal
    assert [signal.getsignal(s) for s in signals] == before
