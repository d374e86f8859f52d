"""A user's algorithm in one file: advantage actor-critic (A2C) on 2-digit addition.

Everything rlflow needs to know about A2C is here: its :class:`~rlflow.dataflow.Algorithm`
record and the graph builder the record points at. ``Trainer(config, algorithm=A2C)``
registers the record and trains it; nothing in rlflow changes for it. One iteration: the
actor samples one response per prompt, the critic values every token, the task's rule scores
the response, then the actor takes one policy-gradient step on GAE advantages and the critic
one value step — on-policy (a single optimizer step per batch), and no reference model
whatever ``kl_coef`` says.

The run is the main recipe's task, model and SFT warm-up (``grpo_arithmetic.yaml``) with a
critic copied from the actor when RL starts (as in ``ppo_arithmetic.yaml``) and one sample per
prompt: the critic, not a group of samples, is the baseline.

python recipes/a2c_custom.py [recipes/other.yaml] [key=value ...]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlflow.dataflow import Algorithm, GraphOptions, MFCDef
from rlflow.trainer import FitResult, Trainer
from rlflow.trainer.recipe import recipe_args

# --- The algorithm ---

ROLLOUT = ("input_ids", "attention_mask", "response_mask")


def a2c_mfcs(o: GraphOptions) -> list[MFCDef]:
    """Rollout, critic values and a reward, then one actor and one critic step per batch.

    Args:
        o: the graph's options; A2C reads only ``rule_based_reward`` (a rule on the host, or a
            reward model's inference when the config names one).

    Returns:
        The model function calls of one iteration; the train steps declare the objectives the
        actor (``rl``) and critic (``value``) interfaces already serve.
    """
    train_keys = ROLLOUT + ("old_logp", "values", "rewards")
    rule = bool(o.rule_based_reward)
    reward_keys = ROLLOUT + (("answers",) if rule else ())
    return [
        MFCDef("actor_gen", "actor", "generate", ("prompts", "prompt_mask"), ROLLOUT + ("old_logp",)),
        MFCDef("critic_inf", "critic", "inference", ROLLOUT, ("values",)),
        MFCDef("reward_inf", "reward", "inference", reward_keys, ("rewards",), runs_on_host=rule),
        MFCDef("actor_train", "actor", "train_step", train_keys, (), n_minibatches=1, objective="rl"),
        MFCDef("critic_train", "critic", "train_step", train_keys, (), n_minibatches=1, objective="value"),
    ]


A2C = Algorithm(
    "a2c",
    a2c_mfcs,
    "prompts",
    default_estimator="gae",
    ref="never",
    reward_by_rule=True,
    description="advantage actor-critic: one on-policy step on GAE advantages",
)

# --- The run ---

BASE = Path(__file__).with_name("grpo_arithmetic.yaml")
# What A2C changes in the main recipe: one response per prompt, GAE with the PPO recipe's lambda,
# and a critic that starts as a copy of the warmed-up actor with a fresh value head.
A2C_SETTINGS = [
    "experiment_name=a2c_custom",
    "algorithm.n_samples=1",
    "algorithm.lam=0.95",
    "data.batch_size=128",  # prompts per step, one response each (the PPO recipe's batch)
    "models.critic.init=copy",
    "models.critic.init_from=actor",
    "models.critic.lr=1e-3",
]


def main(argv: Sequence[str] | None = None, **inputs: Any) -> FitResult:
    """Trains A2C; prints the held-out score before and after.

    Args:
        argv: the command line (default ``sys.argv[1:]``): an optional YAML replacing the main
            recipe's, then ``key=value`` overrides applied after :data:`A2C_SETTINGS`.
        **inputs: other :class:`~rlflow.trainer.Trainer` inputs, such as ``reward_funcs``
            (then set ``algorithm.reward_fn=null``: one source of rewards) or ``callbacks``.

    Returns:
        The fit result (steps, held-out scores, per-call seconds, run directory).
    """
    source, overrides = recipe_args(BASE, sys.argv[1:] if argv is None else argv)
    with Trainer(source, overrides=[*A2C_SETTINGS, *overrides], algorithm=A2C, **inputs) as trainer:
        result = trainer.fit()
    if result.score_before is not None and result.score_after is not None:
        print(
            f"held-out score of {trainer.cfg.experiment_name}: before {result.score_before:.1%} -> "
            f"after {result.score_after:.1%} ({result.steps} steps; run directory {result.run_dir})"
        )
    return result


if __name__ == "__main__":
    main()
