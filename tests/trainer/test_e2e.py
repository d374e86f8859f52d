"""End to end: ``Trainer(cfg).fit()`` of GRPO and PPO on two CPU workers, manual and searched plans.

The manual plans put each call on its own layout so that every iteration moves weights: the
actor trains with FSDP over both workers (dp=2) and generates on a tensor-parallel copy (tp=2)
resharded from it before each rollout; PPO also runs the critic's inference as a two-stage
pipeline and the reference model data-parallel. The runs are a few steps of a tiny model, so
they test wiring and consistency — the rollout policy is the trained policy, the reference is
the initial policy, weights move — not learning.

Ray starts once per session (``ray_session``); each run costs its two worker processes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from recipe_helpers import PPO_FROM_GRPO
from safetensors.torch import load_file

from rlflow.planner.plan import ExecutionPlan
from rlflow.trainer import ConfigError, FitResult, Trainer, load_config
from rlflow.workers.model_worker import FROZEN_WEIGHTS

REPO = Path(__file__).resolve().parents[2]
GRPO = REPO / "recipes" / "grpo_arithmetic.yaml"
STEPS = 3

# A 2-layer, 64-wide model (4 heads, 2 key/value heads), 4 prompts per step, 16 held-out
# prompts, no warm-up, metrics to metrics.jsonl only; evaluation before training and after the
# last step.
TINY = [
    f"trainer.total_steps={STEPS}",
    "trainer.eval_every=0",
    "warmup.steps=0",
    "data.batch_size=4",
    "data.eval_size=16",
    "placement.devices_per_node=2",
    "placement.profile=false",
    "models.actor.hidden_size=64",
    "models.actor.intermediate_size=128",
    "models.actor.num_layers=2",
    "models.actor.num_heads=4",
    "models.actor.num_kv_heads=2",
    "logging.console=false",
    "logging.tensorboard=false",
]
# GRPO's rewards are all 0 for an untrained model, so its advantages are too; an entropy bonus
# and a large learning rate make every step move the weights all the same.
GRPO_TINY = TINY + ["algorithm.n_samples=4", "algorithm.entropy_coef=0.1", "models.actor.lr=1e-2"]
PPO_TINY = TINY + PPO_FROM_GRPO + ["data.batch_size=8", "models.actor.lr=1e-3"]


def manual(mfc: str, devices: int = 2, **strategy: int) -> list[str]:
    """Overrides placing ``mfc`` on the first ``devices`` workers with ``strategy`` (dp/tp/pp)."""
    key = f"placement.manual.{mfc}"
    return [f"{key}.mesh.num_devices={devices}"] + [f"{key}.strategy.{k}={v}" for k, v in strategy.items()]


PPO_MANUAL = [
    "placement.mode=manual",
    *manual("actor_train", dp=2),
    *manual("actor_gen", tp=2),
    *manual("ref_inf", dp=2),
    *manual("critic_inf", pp=2),
    *manual("critic_train", dp=2),
]


def fit(recipe: Path, overrides: list[str], run_dir: Path) -> tuple[Trainer, FitResult]:
    trainer = Trainer(load_config(recipe, [*overrides, f"logging.dir={run_dir}"]), progress_bars=False)
    try:
        result = trainer.fit()
    finally:
        trainer.close()
    return trainer, result


def step_metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    """metrics.jsonl as step -> the record of that training step (evaluation lines left out)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if any(k.startswith("time/") for k in r)}


def eval_scores(run_dir: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["eval/score"]) for r in records if "eval/score" in r]


def weight_change(initial_dir: Path, exported_dir: Path) -> float:
    """Largest absolute difference between two HF checkpoints of the same model (same tensor names)."""
    before, after = load_file(initial_dir / "model.safetensors"), load_file(exported_dir / "model.safetensors")
    assert sorted(before) == sorted(after)
    assert all(torch.isfinite(t).all() for t in after.values())
    return max(float((after[k] - before[k]).abs().max()) for k in before)


def check_run(result: FitResult, run_dir: Path, device_mfcs: list[str]) -> dict[int, dict]:
    """What every finished run leaves behind; returns the per-step metrics."""
    assert result.steps == STEPS and Path(result.run_dir) == run_dir
    metrics = step_metrics(run_dir)
    assert sorted(metrics) == list(range(1, STEPS + 1))
    for record in metrics.values():
        for name in [*device_mfcs, "reward_inf"]:
            assert record[f"time/{name}"] > 0, name
        assert {"actor_train/loss", "actor_train/grad_norm", "reward_inf/score_mean"} <= set(record)
        assert all(v == v for v in record.values()), "NaN in the metrics"
    # Evaluation before training and after the last step, both logged and returned.
    assert [s for s, _ in result.eval_history] == [0, STEPS] == [s for s, _ in eval_scores(run_dir)]
    assert all(0.0 <= score <= 1.0 for _, score in result.eval_history)
    assert result.score_after == result.eval_history[-1][1]
    # The plan that ran, the measured timeline and the measured-vs-estimated table.
    plan = ExecutionPlan.load(run_dir / "plan.json")
    assert [c.name for c in plan.calls] == device_mfcs
    assert (run_dir / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    timings = (run_dir / "timings.txt").read_text()
    for name in device_mfcs:
        assert len(result.mfc_seconds[name]) == STEPS and name in timings
        assert result.estimated_seconds[name] > 0
    return metrics


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("gen", [{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def test_grpo_on_a_manual_plan_that_reshards_fsdp_weights_to_parallel_rollouts(ray_session, tmp_path, gen):
    """Tensor-parallel rollouts, and pipelined ones (two stages passing activations every decode step)."""
    placement = ["placement.mode=manual", *manual("actor_train", dp=2), *manual("actor_gen", **gen)]
    _, result = fit(GRPO, GRPO_TINY + placement, tmp_path)
    metrics = check_run(result, tmp_path, ["actor_gen", "actor_train"])
    plan = ExecutionPlan.load(tmp_path / "plan.json")
    assert plan.name == "manual"
    strategy = plan.call("actor_gen").strategy
    expected = (2, gen.get("tp", 1), gen.get("pp", 1))
    assert (plan.call("actor_train").strategy.dp, strategy.tp, strategy.pp) == expected
    for record in metrics.values():
        # Every rollout runs on a copy resharded from the FSDP home first ...
        assert record["time/actor_gen/pre_call"] > 0
        # ... and that copy is the policy being trained: log-probs of the tp=2 / pp=2 rollout equal
        # the FSDP engine's up to rounding (one stale step would make them differ by far more).
        assert record["actor_train/approx_kl"] < 1e-5
        assert record["actor_train/grad_norm"] > 0
    change = weight_change(tmp_path / "models" / "actor", tmp_path / "checkpoints" / f"step_{STEPS}" / "actor" / "hf")
    assert change > 1e-3


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_ppo_on_a_manual_plan_with_a_pipelined_critic_and_a_data_parallel_reference(ray_session, tmp_path):
    _, result = fit(GRPO, PPO_TINY + PPO_MANUAL, tmp_path)
    mfcs = ["actor_gen", "critic_inf", "ref_inf", "actor_train", "critic_train"]
    metrics = check_run(result, tmp_path, mfcs)
    plan = ExecutionPlan.load(tmp_path / "plan.json")
    assert plan.call("critic_inf").strategy.pp == 2 and plan.call("ref_inf").strategy.dp == 2
    # Before the first update the tp=2 rollout policy and the dp=2 reference are the same
    # weights on different layouts: their KL is rounding. Afterwards the actor has moved.
    assert abs(metrics[1]["actor_train/kl"]) < 1e-5
    assert max(metrics[s]["actor_train/kl"] for s in range(2, STEPS + 1)) > 1e-5
    assert all(metrics[s]["critic_train/grad_norm"] > 0 for s in range(2, STEPS + 1))
    final = tmp_path / "checkpoints" / f"step_{STEPS}"
    assert weight_change(tmp_path / "models" / "actor", final / "actor" / "hf") > 1e-4
    assert weight_change(tmp_path / "models" / "critic", final / "critic" / "hf") > 1e-4
    # The reference's checkpoint is its copy of the actor taken when RL started: without a
    # warm-up, the initial actor.
    ref, initial = (
        load_file(final / "ref" / FROZEN_WEIGHTS),
        load_file(tmp_path / "models" / "actor" / "model.safetensors"),
    )
    assert sorted(ref) == sorted(initial) and all(torch.equal(ref[k], initial[k]) for k in initial)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_ppo_on_the_searched_plan(ray_session, tmp_path):
    # a profile of the actor's own calls before step 1 (calibrate=profile), not the machine profile a
    # run calibrates by its calls (tests/trainer/test_run_calibration.py)
    searched = [
        "placement.mode=auto",
        "placement.search_seconds=1",
        "placement.profile=true",
        "placement.calibrate=profile",
    ]
    trainer, result = fit(GRPO, PPO_TINY + searched, tmp_path)
    mfcs = ["actor_gen", "critic_inf", "ref_inf", "actor_train", "critic_train"]
    check_run(result, tmp_path, mfcs)
    plan = ExecutionPlan.load(tmp_path / "plan.json")
    # the searched plan, or one worker on every core where the profile prices that faster
    assert (plan.name == "search" or plan.name.startswith("one worker, ")) and plan.fits
    profile = json.loads((tmp_path / "profile.json").read_text())  # measured at the actor's shape
    assert profile["layer"]["hidden_size"] == 64 and profile["hardware"]["collective_latency_s"] > 0
    # The search starts from the baselines, so its plan is estimated no slower than any of them.
    feasible = [b.iteration_time_s for b in trainer.placement.baselines if b.feasible]
    assert feasible and plan.iteration_time_s <= min(feasible) * (1 + 1e-9)
    final = tmp_path / "checkpoints" / f"step_{STEPS}"
    assert weight_change(tmp_path / "models" / "actor", final / "actor" / "hf") > 1e-4


@pytest.mark.parametrize(
    ("override", "key", "expected"),
    [
        ("trainer.total_stepz=3", "trainer.total_stepz", "valid keys here: ['total_steps'"),
        ("placement.mode=magic", "placement.mode", "expected one of ['auto', 'heuristic', 'colocated', 'manual']"),
        ("algorithm.n_samples=1", "algorithm.n_samples", "the grpo estimator needs >= 2"),
    ],
)
def test_config_errors_name_the_dotted_key_the_allowed_values_and_the_override(override, key, expected):
    with pytest.raises(ConfigError) as info:
        load_config(GRPO, [*TINY, override])
    assert info.value.key == key
    assert expected in str(info.value) and f"override {override!r}" in str(info.value)


def test_manual_strategy_that_does_not_fill_its_mesh_names_the_mfc():
    bad = ["placement.mode=manual", *manual("actor_train", dp=2), *manual("actor_gen", tp=1)]
    with pytest.raises(ConfigError, match=r"placement\.manual\.actor_gen\.strategy: dp\*tp\*pp = 1\*1\*1"):
        load_config(GRPO, TINY + bad)


@pytest.mark.parametrize(
    ("placement", "message"),
    [
        (manual("actor_train", dp=2), r"placement\.manual has no entry for MFC\(s\) \['actor_gen'\]"),
        # two pipeline stages of a one-layer model (pipelined generation itself runs: the hf engine declares pp)
        (
            ["models.actor.num_layers=1", *manual("actor_train", dp=2), *manual("actor_gen", pp=2)],
            r"placement\.manual\.actor_gen\.strategy\.pp: 2 stages for model 'actor''s 1 layers",
        ),
    ],
)
def test_manual_plans_the_runtime_cannot_run_are_refused_when_planning(ray_session, tmp_path, placement, message):
    cfg = load_config(GRPO, [*TINY, "placement.mode=manual", *placement, f"logging.dir={tmp_path}"])
    trainer = Trainer(cfg, progress_bars=False)  # builds; planning waits for launch()
    with pytest.raises(ValueError, match=message):
        trainer.launch()
    trainer.close()
