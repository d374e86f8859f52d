"""verl's config keys and the rlflow keys that mean the same: :data:`VERL_KEYS`.

rlflow accepts none of verl's keys: a verl key in a YAML file or an override is an unknown key,
and the error names the rlflow key (:func:`verl_hint`). The same table is rendered into
``docs/configuration.md`` (:func:`render_verl_table`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rlflow.algos.losses import AMBIGUOUS_POLICY_LOSSES

__all__ = ["VERL_KEYS", "VERL_VALUES", "VerlKey", "leaf_keys", "render_verl_table", "verl_hint", "verl_value_hint"]


@dataclass(frozen=True)
class VerlKey:
    """One verl key, the rlflow key (or keys) to use instead, and how to convert when the meanings differ."""

    verl: str
    rlflow: str
    note: str = ""


_A = "actor_rollout_ref.actor"
_R = "actor_rollout_ref.rollout"

VERL_KEYS: tuple[VerlKey, ...] = (
    # --- data
    VerlKey("data.train_batch_size", "data.batch_size"),
    VerlKey("data.max_prompt_length", "data.max_prompt_len"),
    VerlKey("data.max_response_length", "data.max_response_len"),
    VerlKey("data.train_files", "data.train_file", "one file"),
    VerlKey("data.val_files", "data.eval_file", "one file"),
    # --- actor, rollout, model
    VerlKey(f"{_R}.n", "algorithm.n_samples"),
    VerlKey(f"{_R}.name", "rollout.engine", "hf (built-in sampler) or vllm"),
    VerlKey(f"{_R}.temperature", "rollout.temperature"),
    VerlKey(f"{_R}.top_p", "rollout.top_p"),
    VerlKey(f"{_R}.top_k", "rollout.top_k", "off is 0 in rlflow, -1 in verl"),
    VerlKey(f"{_R}.response_length", "rollout.max_new_tokens"),
    VerlKey(f"{_R}.gpu_memory_utilization", "rollout.gpu_memory_utilization"),
    VerlKey(
        f"{_R}.tensor_model_parallel_size",
        "placement.mode",
        "the planner chooses each call's parallelism; placement.mode: manual with placement.manual.<mfc>.strategy.tp "
        "fixes it",
    ),
    VerlKey(f"{_R}.val_kwargs.do_sample", "rollout.eval_greedy", "the opposite: do_sample false is eval_greedy true"),
    VerlKey(f"{_A}.optim.lr", "models.actor.lr"),
    VerlKey(f"{_A}.optim.weight_decay", "models.actor.weight_decay", "verl's default 0.01, rlflow's 0"),
    VerlKey(f"{_A}.optim.lr_warmup_steps", "models.actor.warmup_steps"),
    VerlKey(f"{_A}.optim.warmup_style", "models.actor.lr_schedule", "constant or cosine"),
    VerlKey(f"{_A}.optim.min_lr_ratio", "models.actor.min_lr_ratio"),
    VerlKey(f"{_A}.grad_clip", "models.actor.grad_clip"),
    VerlKey(
        f"{_A}.ppo_mini_batch_size",
        "algorithm.n_minibatches",
        "verl counts prompts per mini-batch, rlflow counts mini-batches: "
        "n_minibatches = data.batch_size / ppo_mini_batch_size",
    ),
    VerlKey(
        f"{_A}.ppo_micro_batch_size_per_gpu",
        "models.actor.micro_batch_tokens",
        "rlflow counts tokens: about samples x (max_prompt_len + max_response_len)",
    ),
    VerlKey(f"{_A}.ppo_epochs", "algorithm.ppo_epochs"),
    VerlKey(f"{_A}.clip_ratio", "algorithm.clip_ratio_low", "and algorithm.clip_ratio_high (set both)"),
    VerlKey(f"{_A}.clip_ratio_low", "algorithm.clip_ratio_low"),
    VerlKey(f"{_A}.clip_ratio_high", "algorithm.clip_ratio_high"),
    VerlKey(f"{_A}.clip_ratio_c", "algorithm.dual_clip_c", "verl's default 3, rlflow's null (off)"),
    VerlKey(
        f"{_A}.policy_loss.loss_mode",
        "algorithm.policy_loss",
        "verl's vanilla is rlflow's ppo (with algorithm.dual_clip_c=3 for verl's default dual clip)",
    ),
    VerlKey(f"{_A}.loss_agg_mode", "algorithm.loss_agg_mode"),
    VerlKey(f"{_A}.entropy_coeff", "algorithm.entropy_coef"),
    VerlKey(
        f"{_A}.use_kl_loss",
        "algorithm.kl_in_reward",
        "the opposite: use_kl_loss true is kl_in_reward false (with algorithm.kl_coef > 0)",
    ),
    VerlKey(f"{_A}.kl_loss_coef", "algorithm.kl_coef", "with algorithm.kl_in_reward false"),
    VerlKey(
        f"{_A}.kl_loss_type", "algorithm.kl_estimator", "kl is k1, mse is k2, low_var_kl is k3, low_var_kl+ is k3+"
    ),
    VerlKey("actor_rollout_ref.model.path", "models.actor.path", "with models.actor.init: path (a local HF directory)"),
    VerlKey("actor_rollout_ref.model.enable_gradient_checkpointing", "models.actor.gradient_checkpointing"),
    VerlKey("actor_rollout_ref.model.lora_rank", "models.actor.lora.r", "lora_rank 0 (no LoRA) is lora: null"),
    VerlKey("actor_rollout_ref.model.lora_alpha", "models.actor.lora.alpha"),
    VerlKey(
        "actor_rollout_ref.model.target_modules",
        "models.actor.lora.target_modules",
        "a list of module names; all-linear is every linear module of the decoder layers, listed",
    ),
    # --- critic and reward model
    VerlKey("critic.optim.lr", "models.critic.lr"),
    VerlKey("critic.model.path", "models.critic.path", "with models.critic.init: path"),
    VerlKey("critic.cliprange_value", "algorithm.value_clip"),
    VerlKey(
        "reward_model.enable",
        "models.reward",
        "true: a models.reward section (a reward model); false: algorithm.reward_fn or Trainer(reward_funcs=...)",
    ),
    VerlKey("reward_model.model.path", "models.reward.path", "with models.reward.init: path"),
    VerlKey(
        "custom_reward_function.path",
        "algorithm.reward_fn",
        "a registered rule (rlflow.workers.rewards.register_reward), or Trainer(reward_funcs=...)",
    ),
    # --- algorithm
    VerlKey("algorithm.kl_ctrl.kl_coef", "algorithm.kl_coef", "with algorithm.kl_in_reward true"),
    VerlKey("algorithm.kl_ctrl.target_kl", "algorithm.kl_target", "an adaptive controller when set"),
    VerlKey("algorithm.kl_ctrl.horizon", "algorithm.kl_horizon"),
    VerlKey("algorithm.kl_ctrl.type", "algorithm.kl_target", "fixed: kl_target null; adaptive: kl_target set"),
    VerlKey("algorithm.use_kl_in_reward", "algorithm.kl_in_reward"),
    VerlKey(
        "algorithm.kl_penalty", "algorithm.kl_estimator", "kl is k1, mse is k2, low_var_kl is k3, low_var_kl+ is k3+"
    ),
    VerlKey("algorithm.norm_adv_by_std_in_grpo", "algorithm.norm_adv_by_std"),
    VerlKey("reward_model.overlong_buffer.enable", "algorithm.overlong_buffer", "on when set (null: off)"),
    VerlKey("reward_model.overlong_buffer.len", "algorithm.overlong_buffer"),
    VerlKey("reward_model.overlong_buffer.penalty_factor", "algorithm.overlong_penalty"),
    VerlKey("algorithm.filter_groups.enable", "algorithm.dynamic_sampling", "groups compared on their rewards"),
    VerlKey(
        "algorithm.filter_groups.max_num_gen_batches",
        "algorithm.dynamic_sampling_max_rounds",
        "verl stops the run when they run out (0: unbounded), rlflow fills the batch with dropped groups",
    ),
    # --- trainer
    VerlKey("trainer.total_training_steps", "trainer.total_steps"),
    VerlKey(
        "trainer.total_epochs",
        "trainer.total_steps",
        "rlflow counts steps: total_steps = epochs x training rows / data.batch_size",
    ),
    VerlKey("trainer.save_freq", "checkpoint.every_n_steps", "never is 0 in rlflow, -1 in verl"),
    VerlKey("trainer.test_freq", "trainer.eval_every", "only at the end is 0 in rlflow, -1 in verl"),
    VerlKey("trainer.val_before_train", "trainer.eval_before_train"),
    VerlKey("trainer.n_gpus_per_node", "placement.devices_per_node"),
    VerlKey("trainer.nnodes", "placement.num_nodes"),
    VerlKey("trainer.project_name", "logging.project"),
    VerlKey(
        "trainer.rollout_data_dir",
        "logging.rollouts_every",
        "rlflow writes every N-th step's rollouts to {run dir}/rollouts/step_{N}.jsonl",
    ),
    VerlKey("trainer.experiment_name", "experiment_name", "a top-level key"),
    VerlKey("trainer.default_local_dir", "checkpoint.dir"),
    VerlKey(
        "trainer.logger",
        "logging.console",
        "one switch per sink: logging.console, logging.tensorboard, logging.wandb, logging.mlflow",
    ),
    VerlKey("trainer.resume_mode", "checkpoint.resume", "auto is auto, disable is none"),
    VerlKey("trainer.resume_from_path", "checkpoint.resume", "the checkpoint path"),
    VerlKey("trainer.max_actor_ckpt_to_keep", "checkpoint.keep_last"),
)

# Values of keys both libraries have that mean something else in each: (rlflow key, value) -> what to use.
VERL_VALUES: dict[tuple[str, str], str] = {
    ("algorithm.policy_loss", name): text for name, text in AMBIGUOUS_POLICY_LOSSES.items()
}

_BY_KEY = {k.verl: k for k in VERL_KEYS}


def leaf_keys(tree: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys of the leaves of a nested mapping (a list is a leaf).

    >>> leaf_keys({"data": {"train_batch_size": 8}, "seed": 1})
    ['data.train_batch_size', 'seed']
    """
    keys = []
    for name, value in tree.items():
        key = f"{prefix}{name}"
        keys += leaf_keys(value, f"{key}.") if isinstance(value, Mapping) and value else [key]
    return keys


# verl's top-level sections rlflow has none of (its data, algorithm and trainer sections rlflow has too).
VERL_SECTIONS = (
    "actor_rollout_ref",
    "critic",
    "reward_model",
    "custom_reward_function",
    "ray_kwargs",
    "global_profiler",
)


def verl_hint(unknown: str, keys: Iterable[str], given: Iterable[str] = ()) -> tuple[str, str] | None:
    """``(key, problem)`` for an unknown key that is verl's: the first of ``keys`` that is a known
    verl key at or under ``unknown`` and the rlflow key to use, else ``unknown`` itself when it is a
    verl section; None for other keys. The problem also names the rlflow keys of the other verl
    keys among ``given``, so that a verl config is converted in one go.

    ``keys`` are the dotted keys set by one YAML file or override: OmegaConf names only the first
    key it does not know (``actor_rollout_ref`` for ``actor_rollout_ref.rollout.n``); ``given``
    are those of the whole config (the file and every override).

    >>> verl_hint("actor_rollout_ref", ["seed", "actor_rollout_ref.rollout.n"])
    ('actor_rollout_ref.rollout.n', "a verl key; rlflow's is algorithm.n_samples")
    >>> _, problem = verl_hint("trainer.nnodes", ["trainer.nnodes"], ["trainer.nnodes", "data.train_batch_size"])
    >>> problem
    "a verl key; rlflow's is placement.num_nodes; other verl keys given: data.train_batch_size (rlflow: data.batch_size)"
    """
    found = next((k for k in keys if k in _BY_KEY and (k == unknown or k.startswith(unknown + "."))), None)
    if found is not None:
        entry = _BY_KEY[found]
        problem = f"a verl key; rlflow's is {entry.rlflow}" + (f" ({entry.note})" if entry.note else "")
    elif unknown in VERL_SECTIONS:
        found, problem = (
            unknown,
            "a verl section; rlflow's keys for verl's are in docs/configuration.md (Coming from verl)",
        )
    else:
        return None
    others = [k for k in dict.fromkeys(given) if k in _BY_KEY and k != found]
    if others:
        problem += "; other verl keys given: " + ", ".join(f"{k} (rlflow: {_BY_KEY[k].rlflow})" for k in others)
    return found, problem


def verl_value_hint(key: str, value: Any) -> str | None:
    """What to use instead of ``value`` of ``key`` when it means something else in verl, or None.

    >>> verl_value_hint("algorithm.policy_loss", "vanilla").startswith("'vanilla' names two losses")
    True
    """
    return VERL_VALUES.get((key, value)) if isinstance(value, str) else None


def render_verl_table() -> list[str]:
    """The ``docs/configuration.md`` section of :data:`VERL_KEYS` and :data:`VERL_VALUES`, as lines."""
    lines = [
        "## Coming from verl",
        "",
        "rlflow accepts none of verl's keys: each of these is an unknown key, and the error names the rlflow key.",
        "",
        "| verl key | rlflow key | note |",
        "| --- | --- | --- |",
    ]
    for k in VERL_KEYS:
        lines.append(f"| `{k.verl}` | `{k.rlflow}` | {k.note} |")
    lines += ["", "Values that mean something else in verl are refused:", ""]
    lines += [f"- `{key}: {value}`: {text}." for (key, value), text in VERL_VALUES.items()]
    return [*lines, ""]
