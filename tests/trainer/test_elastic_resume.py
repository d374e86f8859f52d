"""Elastic checkpoints: a checkpoint resumes under another plan, its shards resharded into the new layouts.

One GRPO run on one worker (dp=1) saves step 2. A second run resumes it on two workers with the
actor trained data-parallel (FSDP, dp=2) and saves again at once: its HF export and its engine
files — weights and AdamW moments, resharded back to dp=1 — equal the first run's bit for bit,
so the live dp=2 engines held exactly the saved state. A third run resumes that dp=2 checkpoint
with the actor trained tensor-parallel (tp=2) and trains a step; a fourth resumes under
``placement.mode=auto``, whatever plan the search picks, and trains one more.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from recipe_helpers import QUICK_FIT, TINY_ACTOR
from safetensors.torch import load_file

from rlflow.strategy import ParallelStrategy
from rlflow.trainer import Trainer, load_config
from rlflow.trainer.checkpoint_layouts import ModelLayout, read_layouts, reshard_engine_dir

GRPO = Path(__file__).resolve().parents[2] / "recipes" / "grpo_arithmetic.yaml"
M = "placement.manual"
COMMON = [
    *QUICK_FIT,
    *TINY_ACTOR,
    "algorithm.n_samples=2",
    "algorithm.entropy_coef=0.1",  # rewards are 0 this early; the entropy bonus moves the weights
    "trainer.eval_before_train=false",
    "checkpoint.keep_last=0",
]
TWO_WORKERS = ["placement.mode=manual", "placement.devices_per_node=2"]
DP2 = [*TWO_WORKERS, f"{M}.actor_train.mesh.num_devices=2", f"{M}.actor_train.strategy.dp=2"]
DP2 += [f"{M}.actor_gen.mesh.num_devices=2", f"{M}.actor_gen.strategy.dp=2"]
TP2 = [*TWO_WORKERS, f"{M}.actor_train.mesh.num_devices=2", f"{M}.actor_train.strategy.tp=2"]
TP2 += [f"{M}.actor_gen.mesh.num_devices=2", f"{M}.actor_gen.strategy.dp=2"]

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(600)]


def run(run_dir: Path, *overrides: str):
    cfg = load_config(GRPO, [*COMMON, f"logging.dir={run_dir}", *overrides])
    trainer = Trainer(cfg, progress_bars=False)
    try:
        return trainer.fit()
    finally:
        trainer.close()


def engine_state(directory: Path) -> dict:
    return torch.load(directory / "rank00000.pt", weights_only=True)


def assert_same_training_state(a: dict, b: dict) -> None:
    assert list(a["params"]) == list(b["params"])
    for name in a["params"]:
        assert torch.equal(a["params"][name], b["params"][name]), name
    sa, sb = a["optim"]["state"], b["optim"]["state"]
    assert sorted(sa) == sorted(sb) == list(range(len(a["params"])))
    for index in sa:
        assert sorted(sa[index]) == sorted(sb[index]) == ["exp_avg", "exp_avg_sq", "step"]
        for key in sa[index]:
            assert torch.equal(sa[index][key], sb[index][key]), (index, key)
    assert a["scheduler"] == b["scheduler"] and a["global_step"] == b["global_step"]


def train_losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["actor_train/loss"] for r in records if "actor_train/loss" in r}


def test_a_checkpoint_resumes_under_other_plans(ray_session, tmp_path, caplog):
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    first = run(run_dir, "trainer.total_steps=2")
    assert first.steps == 2
    saved = read_layouts(checkpoints / "step_2")
    assert saved is not None and saved.models["actor"] == ModelLayout(ParallelStrategy(), (0,))
    assert saved.worker_ranks == (0,) and (checkpoints / "step_2" / "plan.json").is_file()
    original = tmp_path / "step_2_dp1"
    shutil.copytree(checkpoints / "step_2", original)
    caplog.clear()

    # Resume on two workers, actor trained with dp=2; no step left: the final save is the loaded state.
    second = run(run_dir, "trainer.total_steps=2", "checkpoint.resume=auto", *DP2)
    out = caplog.text
    caplog.clear()
    assert second.steps == 2
    assert "actor: resharding the checkpoint from (dp=1, tp=1, pp=1) on ranks [0] to (dp=2, tp=1, pp=1)" in out
    resaved = checkpoints / "step_2"
    assert read_layouts(resaved).models["actor"].strategy == ParallelStrategy(dp=2)
    assert sorted(p.name for p in (resaved / "actor" / "engine").glob("rank*.pt")) == ["rank00000.pt", "rank00001.pt"]
    a, b = (
        load_file(original / "actor" / "hf" / "model.safetensors"),
        load_file(resaved / "actor" / "hf" / "model.safetensors"),
    )
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    back = tmp_path / "back_to_dp1"
    config = first_config(run_dir)
    reshard_engine_dir(resaved / "actor" / "engine", back, config, "lm", ParallelStrategy(dp=2), ParallelStrategy())
    assert_same_training_state(engine_state(original / "actor" / "engine"), engine_state(back))
    assert not list(checkpoints.glob(".tmp_*"))  # the resharded scratch directory is gone

    # Resume the dp=2 checkpoint with the actor trained tensor-parallel, and train on.
    third = run(run_dir, "trainer.total_steps=3", "checkpoint.resume=auto", *TP2)
    out = caplog.text
    caplog.clear()
    assert third.steps == 3
    assert "actor: resharding the checkpoint from (dp=2, tp=1, pp=1) on ranks [0, 1] to (dp=1, tp=2, pp=1)" in out

    # Resume under the planner's own choice (the failure: a re-planned layout).
    fourth = run(
        run_dir,
        "trainer.total_steps=4",
        "checkpoint.resume=auto",
        "placement.mode=auto",
        "placement.devices_per_node=2",
    )
    out = caplog.text
    assert fourth.steps == 4 and f"resumed from {checkpoints / 'step_3'} at step 3" in out
    chosen = read_layouts(checkpoints / "step_4").models["actor"].strategy
    print(f"placement.mode=auto trained the actor with {chosen}")
    assert chosen == ParallelStrategy(tp=2) or "actor: resharding the checkpoint from (dp=1, tp=2, pp=1)" in out
    losses = train_losses(run_dir)
    assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses.values())


def first_config(run_dir: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(run_dir / "models" / "actor")
