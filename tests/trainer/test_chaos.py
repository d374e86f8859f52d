"""Chaos: workers SIGKILLed at random steps, the driver SIGKILLed while it saves, resumed each time —
and the run ends with the weights of an uninterrupted one, bit for bit.

The driver (tests/trainer/chaos_driver.py) runs in a process of its own against this session's
Ray cluster, with a checkpoint every step, ``checkpoint.resume=auto`` and ``trainer.max_restarts``.
Two rounds each kill the worker as a random step is logged (the driver restarts it and resumes the
last checkpoint) and then SIGKILL the driver inside the save of a random later step (the next
round resumes the step before: no partial checkpoint is ever taken for a complete one). A last
round kills the worker once more and finishes. The seed is printed; ``RLFLOW_CHAOS_SEED`` replays one.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import torch
from chaos_driver import GRPO, overrides
from safetensors.torch import load_file

from rlflow.trainer import Trainer, load_config
from rlflow.trainer.checkpoint import read_trainer_state

DRIVER = Path(__file__).with_name("chaos_driver.py")
STEPS = 6

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(400)]


def drive(run_dir: Path, address: str, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(DRIVER), str(run_dir), address, str(STEPS), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=DRIVER.parents[2])


def latest_step(run_dir: Path) -> int:
    steps = [int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*")]
    return max(steps, default=0)


def final_state(run_dir: Path) -> tuple[dict, dict]:
    step = run_dir / "checkpoints" / f"step_{STEPS}"
    assert read_trainer_state(step)["step"] == STEPS
    engine = torch.load(step / "actor" / "engine" / "rank00000.pt", weights_only=True)
    return load_file(step / "actor" / "hf" / "model.safetensors"), engine


def test_killed_workers_and_a_killed_driver_end_with_the_uninterrupted_weights(ray_session, tmp_path):
    seed = int(os.environ.get("RLFLOW_CHAOS_SEED", random.randrange(10**6)))
    print(f"chaos seed {seed}")
    rng = random.Random(seed)
    reference = tmp_path / "reference"
    trainer = Trainer(load_config(GRPO, overrides(reference, STEPS)), progress_bars=False)
    with trainer:
        assert trainer.fit().steps == STEPS

    chaos, address = tmp_path / "chaos", ray.get_runtime_context().gcs_address
    reached = 0
    for _ in range(2):
        kill = rng.randint(reached + 1, reached + 2)
        die = rng.randint(kill, kill + 1)
        done = drive(chaos, address, "--kill-worker-at", str(kill), "--die-saving", str(die))
        log = f"seed {seed}, kill {kill}, die {die}:\n{done.stdout}\n{done.stderr[-4000:]}"
        assert done.returncode == -signal.SIGKILL, log
        assert "restart 1/3" in done.stdout, log
        assert latest_step(chaos) == die - 1, log  # the save it died in left no step_<die>
        assert list((chaos / "checkpoints").glob(".tmp_*")), log  # ... only its temporary directory
        reached = die - 1
    kill = rng.randint(reached + 1, STEPS)
    done = drive(chaos, address, "--kill-worker-at", str(kill))
    log = f"seed {seed}, last kill {kill}:\n{done.stdout}\n{done.stderr[-4000:]}"
    assert done.returncode == 0 and f"finished at step {STEPS}" in done.stdout, log
    assert not list((chaos / "checkpoints").glob(".tmp_*")), log

    (want_hf, want_engine), (got_hf, got_engine) = final_state(reference), final_state(chaos)
    assert sorted(got_hf) == sorted(want_hf)
    assert all(torch.equal(got_hf[k], want_hf[k]) for k in want_hf), f"seed {seed}"
    for name, value in want_engine["params"].items():
        assert torch.equal(got_engine["params"][name], value), f"seed {seed}: {name}"
    for index, entry in want_engine["optim"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(got_engine["optim"]["state"][index][key], value), f"seed {seed}: {index} {key}"
