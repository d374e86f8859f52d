"""The driver the chaos test runs in a process of its own: GRPO on one worker, a checkpoint every
step, ``checkpoint.resume=auto`` and restarts allowed; on request it SIGKILLs its worker as a step
is logged and itself while a checkpoint is being written.

    python chaos_driver.py RUN_DIR RAY_ADDRESS TOTAL_STEPS [--kill-worker-at STEP] [--die-saving STEP]

Not a test module: tests/trainer/test_chaos.py runs it, and imports :func:`overrides` for its
uninterrupted reference run.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import ray

from rlflow.trainer import Trainer, load_config

GRPO = Path(__file__).resolve().parents[2] / "recipes" / "grpo_arithmetic.yaml"
TINY = ["hidden_size=64", "intermediate_size=128", "num_layers=2", "num_heads=4", "num_kv_heads=2", "lr=1e-3"]


def overrides(run_dir: Path, total_steps: int) -> list[str]:
    """One worker (the heuristic plan of one device), no warm-up or evaluation, a checkpoint every step."""
    return [
        *(f"models.actor.{o}" for o in TINY),
        "algorithm.n_samples=2",
        "algorithm.entropy_coef=0.1",  # rewards are 0 this early; the entropy bonus moves the weights
        "data.batch_size=4",
        "data.eval_size=4",
        "warmup.steps=0",
        "trainer.eval_every=0",
        "trainer.eval_before_train=false",
        f"trainer.total_steps={total_steps}",
        "trainer.max_restarts=3",
        "checkpoint.every_n_steps=1",
        "checkpoint.keep_last=2",
        "checkpoint.resume=auto",
        "placement.mode=heuristic",
        "placement.devices_per_node=1",
        "placement.profile=false",
        "logging.console=false",
        "logging.tensorboard=false",
        f"logging.dir={run_dir}",
    ]


def _kill_worker_at(step_to_kill: int, trainer_ref: dict[str, Trainer]):
    killed = []

    def callback(step: int, metrics: dict) -> None:
        if step == step_to_kill and "actor_train/loss" in metrics and not killed:
            killed.append(step)
            host = trainer_ref["trainer"].workers._actors.hosts[0]  # private: a test finds the process
            os.kill(ray.get(host.__ray_call__.remote(lambda self: os.getpid())), signal.SIGKILL)

    return callback


def _die_while_saving(step_to_die: int) -> None:
    """SIGKILL this process inside the save of ``step_to_die``: the workers' shards are written,
    the trainer state is not, and the temporary directory is not renamed yet."""
    import rlflow.trainer.checkpoint as checkpoint_module  # the trainer calls it through this module

    write = checkpoint_module.write_trainer_state

    def dying(directory, *, step, **kwargs):
        if step == step_to_die:
            os.kill(os.getpid(), signal.SIGKILL)
        return write(directory, step=step, **kwargs)

    checkpoint_module.write_trainer_state = dying


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("ray_address")
    parser.add_argument("total_steps", type=int)
    parser.add_argument("--kill-worker-at", type=int, default=None)
    parser.add_argument("--die-saving", type=int, default=None)
    args = parser.parse_args()
    if args.die_saving is not None:
        _die_while_saving(args.die_saving)
    holder: dict[str, Trainer] = {}
    callbacks = [_kill_worker_at(args.kill_worker_at, holder)] if args.kill_worker_at is not None else []
    cfg = load_config(GRPO, [*overrides(args.run_dir, args.total_steps), f"placement.ray_address={args.ray_address}"])
    trainer = Trainer(cfg, callbacks=callbacks, progress_bars=False)
    holder["trainer"] = trainer
    with trainer:
        result = trainer.fit()
    print(f"finished at step {result.steps}")


if __name__ == "__main__":
    main()
