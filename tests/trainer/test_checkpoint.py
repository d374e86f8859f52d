"""CheckpointManager: atomic saves, pruning, resume; RNG and trainer state through JSON."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from rlflow.trainer.checkpoint import (
    CheckpointManager,
    capture_rng_state,
    read_trainer_state,
    restore_rng_state,
    write_trainer_state,
)
from rlflow.trainer.config import CheckpointConfig


def _writer(text: str):
    def write(directory: Path) -> None:
        (directory / "model").mkdir()
        (directory / "model" / "weights.txt").write_text(text)

    return write


def test_save_renames_a_complete_directory_with_meta(tmp_path):
    manager = CheckpointManager(CheckpointConfig(), tmp_path)
    path = manager.save(5, _writer("w5"), extra_meta={"score": 0.5})
    assert path == tmp_path / "checkpoints" / "step_5"
    assert (path / "model" / "weights.txt").read_text() == "w5"
    meta = manager.read_meta(path)
    assert (meta["step"], meta["files"], meta["score"]) == (5, ["model/weights.txt"], 0.5)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_5"]  # no temporary left


def test_failed_write_leaves_no_checkpoint_and_no_temporary(tmp_path):
    manager = CheckpointManager(CheckpointConfig(dir=str(tmp_path / "ck")), tmp_path / "unused")

    def crash(directory: Path) -> None:
        (directory / "half.bin").write_bytes(b"x")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        manager.save(1, crash)
    assert list((tmp_path / "ck").iterdir()) == [] and manager.latest() is None
    with pytest.raises(ValueError, match="meta.json"):
        manager.save(2, lambda d: (d / "meta.json").write_text("{}"))
    assert list((tmp_path / "ck").iterdir()) == []


def test_prune_keeps_the_newest_and_resave_replaces(tmp_path):
    manager = CheckpointManager(CheckpointConfig(keep_last=2), tmp_path)
    for step in (1, 2, 3):
        manager.save(step, _writer(f"w{step}"))
    assert [p.name for p in manager.checkpoints()] == ["step_2", "step_3"]
    manager.save(3, _writer("again"))
    assert (manager.latest() / "model" / "weights.txt").read_text() == "again"
    manager.save(1, _writer("resumed"))  # a resumed run saving below newer steps keeps its own save
    assert [p.name for p in manager.checkpoints()] == ["step_1", "step_3"]
    keep_all = CheckpointManager(CheckpointConfig(keep_last=0), tmp_path / "all")
    for step in range(4):
        keep_all.save(step, _writer(""))
    assert len(keep_all.checkpoints()) == 4


def test_latest_orders_by_step_and_ignores_incomplete_directories(tmp_path):
    manager = CheckpointManager(CheckpointConfig(keep_last=0), tmp_path)
    for step in (9, 10):
        manager.save(step, _writer(""))
    (manager.directory / "step_11").mkdir()  # no meta.json: never finished
    (manager.directory / ".tmp_step_12_abcd").mkdir()  # an interrupted save
    assert manager.latest().name == "step_10"  # numeric, not lexical, order
    CheckpointManager(CheckpointConfig(keep_last=0), tmp_path)  # a new manager clears temporaries
    assert not (manager.directory / ".tmp_step_12_abcd").exists()


def test_resolve_resume(tmp_path):
    manager = CheckpointManager(CheckpointConfig(), tmp_path)
    assert manager.resolve_resume("auto") is None and manager.resolve_resume("none") is None
    path = manager.save(4, _writer(""))
    assert manager.resolve_resume("auto") == path and manager.resolve_resume(str(path)) == path
    assert manager.resolve_resume("none") is None
    with pytest.raises(FileNotFoundError, match="nowhere/step_3"):
        manager.resolve_resume(str(tmp_path / "nowhere" / "step_3"))
    (tmp_path / "half").mkdir()
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        manager.resolve_resume(str(tmp_path / "half"))
    resuming = CheckpointManager(CheckpointConfig(resume="auto"), tmp_path)
    assert resuming.resolve_resume() == path


def _draws(generator: torch.Generator) -> tuple:
    return (random.random(), np.random.rand(), torch.rand(1).item(), torch.rand(1, generator=generator).item())


def test_rng_state_survives_a_json_round_trip(tmp_path):
    sampler = torch.Generator().manual_seed(7)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.randn()  # leave a cached Gaussian in numpy's state
    state = capture_rng_state({"sampler": sampler})
    (tmp_path / "rng.json").write_text(json.dumps(state))
    expected = _draws(sampler)
    _draws(sampler)  # move every RNG on
    restore_rng_state(json.loads((tmp_path / "rng.json").read_text()), {"sampler": sampler})
    assert _draws(sampler) == expected
    with pytest.raises(KeyError, match="'other'"):
        restore_rng_state(state, {"other": torch.Generator()})


def test_trainer_state_is_plain_json(tmp_path):
    manager = CheckpointManager(CheckpointConfig(), tmp_path)
    data_state = {"epoch": 2, "index": 96, "seed": 0}

    def write(directory: Path) -> None:
        write_trainer_state(directory, step=12, data_state=data_state, extra={"kl_coef": 0.05})

    path = manager.save(12, write)
    raw = json.loads((path / "trainer_state.json").read_text())  # JSON, nothing pickled
    assert raw["step"] == 12 and raw["data"] == data_state and raw["extra"] == {"kl_coef": 0.05}
    expected = (random.random(), torch.rand(3))  # what the run drew right after saving
    restore_rng_state(read_trainer_state(path)["rng"])
    again = (random.random(), torch.rand(3))
    assert again[0] == expected[0] and torch.equal(again[1], expected[1])
    with pytest.raises(FileNotFoundError, match="rlflow checkpoint"):
        read_trainer_state(tmp_path)
