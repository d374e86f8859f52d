"""Overrides that shrink the GRPO recipe to a one-step run, shared by the subprocess tests."""

# One step of warm-up and of GRPO on a 2-layer, 64-wide model: seconds of compute.
TINY = [
    "trainer.total_steps=1",
    "warmup.steps=1",
    "warmup.batch_size=8",
    "data.batch_size=4",
    "data.eval_size=8",
    "algorithm.n_samples=2",
    "models.actor.hidden_size=64",
    "models.actor.intermediate_size=128",
    "models.actor.num_layers=2",
    "placement.search_seconds=0.5",
    "logging.tensorboard=false",
]
