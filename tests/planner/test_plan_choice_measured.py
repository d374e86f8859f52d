"""The plan the planner chooses is, measured on real CPU workers, never slower than the other shapes
it priced by more than its estimate error.

A tiny GRPO run on a 2-worker host: the planner's choice (``placement.mode: auto``, calibrated by
the profile of this host at the run's shapes) against the three shapes a 2-worker host offers —
one worker, both calls data-parallel over two, the rollout on one worker and training on the
other — each forced by ``placement.mode: manual``. Runs are interleaved (chosen, the others,
chosen again) so that load from elsewhere falls on all of them; each is timed by the median wall
time between its steps' results, the first two (warm-up) and the last left out.

    .venv/bin/python -m pytest -s -m slow tests/planner/test_plan_choice_measured.py
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from rlflow.trainer import Trainer, load_config

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "grpo_arithmetic.yaml"
STEPS = 8
RUN = [
    f"trainer.total_steps={STEPS}",
    "trainer.eval_every=0",
    "trainer.eval_before_train=false",
    "warmup.steps=0",
    "data.batch_size=2",
    "data.max_response_len=16",
    "data.eval_size=4",
    "algorithm.n_samples=8",
    *(f"models.actor.{k}" for k in ("hidden_size=64", "intermediate_size=256", "num_layers=2", "lr=1e-3")),
    "placement.devices_per_node=2",
    "placement.search_seconds=0.5",
    "placement.profile=true",
    "logging.console=false",
    "logging.tensorboard=false",
    "checkpoint.save_final=false",
]
# name -> (actor_gen (devices, first device), actor_train (devices, first device))
SHAPES = {"one worker": ((1, 0), (1, 0)), "dp=2": ((2, 0), (2, 0)), "disjoint": ((1, 0), (1, 1))}


def _manual(shape: tuple[tuple[int, int], tuple[int, int]]) -> list[str]:
    out = ["placement.mode=manual"]
    for mfc, (size, start) in zip(("actor_gen", "actor_train"), shape):
        key = f"placement.manual.{mfc}"
        out += [f"{key}.mesh.num_devices={size}", f"{key}.mesh.device_start={start}", f"{key}.strategy.dp={size}"]
    return out


def _run(overrides: list[str], run_dir: Path) -> tuple[float, float, tuple]:
    """``(measured s/step, estimated s/iteration, the plan's shape)`` of one run."""
    trainer = Trainer(load_config(RECIPE, [*RUN, *overrides, f"logging.dir={run_dir}"]), progress_bars=False)
    try:
        trainer.fit()
        plan = trainer.placement.plan
    finally:
        trainer.close()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["time"] for r in records if "time/actor_train" in r]
    assert len(times) == STEPS
    # Step t+1 is issued before t is waited for: the last step's records arrive right after the
    # one before, so the first two (warm-up) and the last interval are left out.
    steps = [b - a for a, b in zip(times, times[1:])][2:-1]
    calls = {c.name: c for c in plan.calls}
    shape = tuple((calls[m].mesh.size, calls[m].mesh.first_device) for m in ("actor_gen", "actor_train"))
    strategies = {calls[m].strategy.tp * calls[m].strategy.pp for m in ("actor_gen", "actor_train")}
    return statistics.median(steps), plan.iteration_time_s, shape if strategies == {1} else None


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_the_chosen_plan_is_not_slower_than_the_others_beyond_the_estimate_error(ray_session, tmp_path):
    chosen_s, chosen_est, chosen_shape = _run([], tmp_path / "auto")
    others = {name: shape for name, shape in SHAPES.items() if shape != chosen_shape}
    measured, errors = {}, [abs(chosen_est - chosen_s) / chosen_s]
    for name, shape in others.items():
        seconds, estimate, _ = _run(_manual(shape), tmp_path / name.replace(" ", "_").replace("=", ""))
        measured[name] = seconds
        errors.append(abs(estimate - seconds) / seconds)
    again_s, again_est, again_shape = _run([], tmp_path / "auto_again")  # the profile is cached: same plan
    assert again_shape == chosen_shape
    errors.append(abs(again_est - again_s) / again_s)
    chosen = min(chosen_s, again_s)
    # The planner may pick a worse plan only by as much as its estimates miss: their largest
    # relative error over these runs, at least 25% (timing noise of a shared 2-core host), at most
    # 100% (a bound any wider would admit any choice).
    bound = min(1.0, max(0.25, max(errors)))
    report = f"chosen {chosen_shape}: {chosen:.3f} s/step; others {measured}; estimate errors {errors}"
    print(report)  # pytest -s shows the figures
    for name, seconds in measured.items():
        assert chosen <= seconds * (1 + bound), f"slower than {name}: {report}"
