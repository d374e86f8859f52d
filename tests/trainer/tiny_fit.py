"""The overrides of a tiny GRPO ``fit()`` in a test: the main recipe, a small batch, no warm-up or
evaluation, one worker in the driver on the heuristic plan without a machine profile, no console
or TensorBoard output. Tests add what they check (steps, model shape, algorithm options).
Not a test module."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GRPO = REPO / "recipes" / "grpo_arithmetic.yaml"
# A one-layer actor of width 32.
TINY_ACTOR = [
    *(f"models.actor.{o}" for o in ("hidden_size=32", "intermediate_size=64", "num_layers=1", "num_heads=2")),
    "models.actor.num_kv_heads=2",
]
DRIVER_FIT = [
    "data.batch_size=2", "algorithm.n_samples=2", "data.eval_size=2", "warmup.steps=0",
    "trainer.eval_before_train=false", "trainer.eval_every=0", "placement.worker_host=driver",
    "placement.mode=heuristic", "placement.profile=false", "logging.console=false", "logging.tensorboard=false",
]  # fmt: skip
