"""Typed configuration of an rlflow run: dataclasses, loading, validation and the reference doc.

A run is described by one :class:`RLFlowConfig`, normally read from a YAML recipe with
command-line overrides::

    cfg = load_config("recipes/grpo_arithmetic.yaml", ["trainer.total_steps=20", "models.actor.lr=1e-4"])

How a YAML file becomes a config:

1. ``OmegaConf.structured(RLFlowConfig)`` gives the typed defaults; the YAML is merged into it,
   then the ``key=value`` overrides. OmegaConf rejects unknown keys and values of the wrong type
   here. A ``models:`` section in the YAML *replaces* the default model set (``{actor: tiny}``),
   so a recipe lists exactly the models it uses.
2. The merged tree is turned into dataclasses bottom-up. Every class checks its own fields in
   ``__post_init__`` (allowed values and bounds come from field metadata, so the checks and the
   generated reference in ``docs/configuration.md`` cannot drift apart) and the root checks the
   combinations (e.g. PPO's GAE needs a critic). OmegaConf does not run ``__post_init__`` on
   merges, which is why validation happens in this second step and not earlier.

Every problem raises :class:`ConfigError` naming the full dotted key, the allowed values, and
where the bad value came from (the YAML file or the override).

The SFT warm-up of the main recipe is the ``warmup`` section, not a second stage file: one run,
one Ray start, one set of workers; the actor simply takes ``warmup.steps`` supervised steps on
the task's reference answers before the RL loop starts.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from rlflow.algos.params import AlgorithmParams, estimator_reads
from rlflow.dataflow.algorithms import Algorithm, GraphOptions, get_algorithm
from rlflow.engine.rollout import get_rollout_engine, list_rollout_engines
from rlflow.engine.rollout.base import PER_PROCESS
from rlflow.trainer.config_data import DataConfig, MultiTurnConfig, RolloutConfig, WarmupConfig
from rlflow.trainer.config_fields import ConfigError, _f, _reward_names, _Section, optional_section
from rlflow.trainer.config_models import MODEL_ROLES, LoraConfig, ModelConfig
from rlflow.trainer.config_placement import ManualPlacementConfig, MeshConfig, PlacementConfig, StrategyConfig
from rlflow.trainer.verl_keys import leaf_keys, verl_hint, verl_value_hint
from rlflow.workers.logs import LOG_LEVELS

__all__ = [
    "AlgorithmConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "LoopConfig",
    "LoraConfig",
    "ManualPlacementConfig",
    "MeshConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "MODEL_ROLES",
    "PlacementConfig",
    "RLFlowConfig",
    "RolloutConfig",
    "StrategyConfig",
    "WarmupConfig",
    "load_config",
    "parse_cli",
    "render_config_reference",
    "to_yaml",
]

_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]+$")
DEFAULT_RESPONSE_LEN = 8  # response tokens when neither rollout.max_new_tokens nor data.max_response_len is set
PROGRESS_MODES = ("auto", "always", "never")  # logging.progress


# --- Sections ---


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig(_Section, AlgorithmParams):
    """What is optimised: the algorithm, its advantage estimator and loss coefficients.

    The hyper-parameters are those of :class:`rlflow.algos.params.AlgorithmParams` (declared once,
    shared with the workers); the section adds where rewards come from.
    """

    reward_fn: str | None = _f(
        None, "rule-based reward; null: models.reward, else the task's reward", choices=_reward_names
    )
    reward_errors: str = _f(
        "raise",
        "a reward (rule or function) that raises on a sample: raise stops the run naming the call, sample and "
        "prompt; zero scores the sample 0; skip leaves it out like a reward function's None; zero and skip are "
        "counted (<call>/reward_error_fraction)",
        choices=("raise", "zero", "skip"),
    )
    dynamic_sampling: bool = _f(
        False,
        "DAPO dynamic sampling: drop the groups (responses to one prompt) that all score the same, which carry "
        "no gradient, and refill the batch from further prompts (needs a group estimator: grpo, rloo; policy_lag 0)",
    )
    dynamic_sampling_max_rounds: int = _f(
        4,
        "dynamic sampling: generation rounds per step at most, the first included; when they run out, dropped "
        "groups fill the rest of the batch (counted: dynamic_sampling/groups_short)",
        ge=1,
    )
    dynamic_sampling_rounds: float = _f(
        1.0,
        "dynamic sampling, planner: generation rounds a step is priced with (at most dynamic_sampling_max_rounds); "
        "a run that calibrates (placement.calibrate: run, on a new shape) plans again with the mean it measured "
        "(dynamic_sampling/rounds)",
        ge=1.0,
    )

    @property
    def record(self) -> Algorithm:
        """The registered :class:`~rlflow.dataflow.algorithms.Algorithm` of ``name``."""
        return get_algorithm(self.name)

    def _check(self) -> None:
        if self.policy_lag > 0 and self.record.dataset != "prompts":
            raise ConfigError(
                "policy_lag",
                f"{self.policy_lag} needs an algorithm that samples rollouts; {self.name!r} trains on "
                f"{self.record.dataset} (set 0)",
            )
        if self.recompute_old_logp and not self.record.samples_responses:
            raise ConfigError(
                "recompute_old_logp", f"true needs an algorithm that samples rollouts; {self.name!r} samples nothing"
            )
        if self.dynamic_sampling:
            self._check_dynamic_sampling()
        for key in ("overlong_buffer", "mask_truncated"):
            if getattr(self, key) not in (None, False) and not self.record.samples_responses:
                raise ConfigError(
                    key, f"{getattr(self, key)!r} needs an algorithm that samples rollouts; {self.name!r} does not"
                )
        conflict = self.conflict()
        if conflict is not None:
            raise ConfigError(conflict[0], f"{getattr(self, conflict[0])!r}: {conflict[1]}")

    def _check_dynamic_sampling(self) -> None:
        estimator = self.resolved_adv_estimator
        if not self.record.samples_responses or not estimator_reads(estimator, "index"):
            raise ConfigError(
                "dynamic_sampling",
                f"true needs an estimator that compares the responses to a prompt (grpo, rloo); {self.name!r} "
                f"uses {estimator!r}",
            )
        if self.n_samples < 2:
            raise ConfigError("dynamic_sampling", f"true needs groups: n_samples={self.n_samples} (at least 2)")
        if self.dynamic_sampling_rounds > self.dynamic_sampling_max_rounds:
            raise ConfigError(
                "dynamic_sampling_rounds",
                f"{self.dynamic_sampling_rounds:g} > dynamic_sampling_max_rounds={self.dynamic_sampling_max_rounds}",
            )
        if self.policy_lag:
            raise ConfigError(
                "dynamic_sampling", f"true needs on-policy rollouts (policy_lag={self.policy_lag}; set 0)"
            )

    def old_logp_mismatch(
        self, rollout: RolloutConfig, use_gpu: bool | None, actor_dtype: str = "float32"
    ) -> tuple[str, ...]:
        """Why the rollout's log-probs may differ from the trainer's: what ``recompute_old_logp: null`` reads.

        A rollout engine that generates with its own model code (any ``layout_style`` but ``"hf"``:
        vLLM's kernels), a rollout dtype other than the training compute dtype (the actor's
        ``models.actor.dtype`` given as ``actor_dtype``, ``auto`` resolved for GPU or CPU workers;
        the built-in sampler computes in it too; ``use_gpu`` null: this host's GPUs, as
        ``placement.devices_per_node`` assumes), or a filtered sampling distribution (``top_p < 1``,
        ``top_k > 0``: vLLM reports the filtered log-probs). Empty for an algorithm that samples nothing.
        """
        if not self.record.samples_responses:
            return ()
        import torch

        from rlflow.engine.parallelize import resolve_compute_dtype

        engine = get_rollout_engine(rollout.engine)
        reasons = []
        if engine.layout_style != "hf":
            reasons.append(f"rollout.engine={rollout.engine!r} generates with its own kernels")
        gpu = torch.cuda.is_available() if use_gpu is None else use_gpu
        train_dtype = resolve_compute_dtype(actor_dtype, "cuda" if gpu else "cpu")
        rollout_dtype = engine.weight_dtype or train_dtype
        if rollout_dtype != train_dtype:
            reasons.append(f"the rollout runs in {rollout_dtype}, training in {train_dtype}")
        if rollout.top_p < 1.0 or rollout.top_k > 0:
            reasons.append(f"sampling is filtered (rollout.top_p={rollout.top_p:g}, top_k={rollout.top_k})")
        return tuple(reasons)

    def recomputes_old_logp(self, rollout: RolloutConfig, use_gpu: bool | None, actor_dtype: str = "float32") -> bool:
        """``recompute_old_logp``, or when null whether :meth:`old_logp_mismatch` finds a reason."""
        if self.recompute_old_logp is not None:
            return self.recompute_old_logp
        return bool(self.old_logp_mismatch(rollout, use_gpu, actor_dtype))


@dataclass(kw_only=True)
class LoopConfig(_Section):
    """The driver loop."""

    total_steps: int = _f(100, "RL (or SFT/DPO/RM) steps; one step = one batch of prompts", ge=1)
    eval_every: int = _f(10, "evaluate every this many steps; 0: only at the end", ge=0)
    eval_before_train: bool = _f(True, "evaluate before the first step (and after the warm-up)")
    log_every: int = _f(1, "log metrics every this many steps", ge=1)
    max_wall_seconds: float | None = _f(None, "stop (after a final eval and checkpoint) past this wall time", gt=0.0)
    target_score: float | None = _f(
        None, "stop (after a final eval and checkpoint) at the first evaluation whose held-out score reaches this"
    )
    max_restarts: int = _f(0, "worker restarts after a death or failed collective, each from the last checkpoint", ge=0)
    profile_calls: list[str] = _f(
        [],
        "MFCs (e.g. actor_train, actor_gen) to run under torch.profiler at profile_steps, each writing a Chrome "
        "trace per rank to {run dir}/profiles/step{N}_{mfc}_rank{R}.json; empty: no profiling",
    )
    profile_steps: list[int] = _f([], "the training steps whose profile_calls are profiled (0: before training)")

    def _check(self) -> None:
        if self.target_score is not None and not self.eval_every:
            raise ConfigError(
                "target_score", f"{self.target_score} needs evaluations in the run: eval_every=0 must be > 0"
            )
        # Profiling is on when both name something; one of them alone is a forgotten half.
        if bool(self.profile_calls) != bool(self.profile_steps):
            given, empty = ("profile_calls", "profile_steps")[:: 1 if self.profile_calls else -1]
            raise ConfigError(empty, f"empty, but {given}={getattr(self, given)}; set both or neither")
        negative = [s for s in self.profile_steps if s < 0]
        if negative:
            raise ConfigError("profile_steps", f"{negative}; steps are >= 0")

    def check_profile_calls(self, call_names: Sequence[str]) -> None:
        """Refuses a ``profile_calls`` entry that is not one of the run's ``call_names`` (its graph's MFCs).

        Raises:
            ConfigError: on ``trainer.profile_calls``, naming the unknown calls and the known ones.
        """
        unknown = [name for name in self.profile_calls if name not in call_names]
        if unknown:
            raise ConfigError(
                "trainer.profile_calls", f"{unknown} are not calls of this run; its calls: {sorted(call_names)}"
            )


@dataclass(kw_only=True)
class LoggingConfig(_Section):
    """Where metrics go, and how rlflow's messages and progress bars show."""

    dir: str | None = _f(None, "run directory; null: runs/{experiment_name}")
    if_exists: str = _f(
        "refuse",
        "when the run directory holds an earlier run that checkpoint.resume does not resume: refuse, replace "
        "(delete its outputs), or new (write to {dir}-2, -3, ...)",
        choices=("refuse", "replace", "new"),
    )
    level: str = _f(
        "info", "level of rlflow's messages (the 'rlflow' logger), in the driver and the workers", choices=LOG_LEVELS
    )
    progress: str = _f(
        "auto",
        "progress bars (plan search, profile, warm-up, training): auto: when stderr is a terminal; always; never",
        choices=PROGRESS_MODES,
    )
    console: bool = _f(True, "print one compact line per logged step")
    jsonl: bool = _f(True, "append metrics to {run dir}/metrics.jsonl")
    tensorboard: bool = _f(True, "write TensorBoard events to {run dir}/tensorboard")
    wandb: bool = _f(False, "log to Weights & Biases (the wandb extra: pip install 'rlflow[wandb]')")
    mlflow: bool = _f(False, "log to MLflow (the mlflow extra: pip install 'rlflow[mlflow]')")
    project: str = _f("rlflow", "wandb project / mlflow experiment name")
    rollouts_every: int = _f(
        0,
        "every this many steps, write the step's rollouts (prompt, response, reward, answer, group) as JSON lines "
        "to {run dir}/rollouts/step_{N}.jsonl (TRL's log_completions, verl's rollout_data_dir); 0: none",
        ge=0,
    )


@dataclass(kw_only=True)
class CheckpointConfig(_Section):
    """Saving and resuming."""

    dir: str | None = _f(None, "checkpoint directory; null: {run dir}/checkpoints")
    every_n_steps: int = _f(0, "save every this many steps; 0: no periodic saves", ge=0)
    save_final: bool = _f(True, "save after the last step")
    resume: str = _f("none", "'none', 'auto' (latest checkpoint if any) or a checkpoint path")
    keep_last: int = _f(2, "checkpoints kept (older ones deleted); 0: keep all", ge=0)
    save_hf: bool = _f(True, "also export the trainable models as HF directories in each checkpoint")
    save_on_signal: bool = _f(True, "on SIGINT/SIGTERM during training: finish the step, save a checkpoint, then exit")
    final_dir: str | None = _f(
        None,
        "where fit() writes the trained models at its end, one HF directory (weights, tokenizer, generation "
        "config) per model, never pruned; null: {run dir}/final",
    )

    def _check(self) -> None:
        if not self.resume:
            raise ConfigError("resume", "empty; expected 'none', 'auto' or a checkpoint path")


# --- Root ---


@dataclass(kw_only=True)
class RLFlowConfig(_Section):
    """A whole run: what to train, on which data, where, and what to record."""

    experiment_name: str = _f("rlflow", "names the run directory runs/{experiment_name}")
    seed: int = _f(
        0, "seed of model init, data order, sampling and the task's train/test split (unless data.split_seed)", ge=0
    )
    algorithm: AlgorithmConfig = _f(AlgorithmConfig(), "the algorithm")
    models: dict[str, ModelConfig] = _f(
        {"actor": ModelConfig()}, "models by role (actor, ref, critic, reward, teacher)"
    )
    data: DataConfig = _f(DataConfig(), "prompts and answers")
    rollout: RolloutConfig = _f(RolloutConfig(), "sampling")
    warmup: WarmupConfig = _f(WarmupConfig(), "SFT warm-up before the RL loop")
    placement: PlacementConfig = _f(PlacementConfig(), "cluster and MFC placement")
    trainer: LoopConfig = _f(LoopConfig(), "the driver loop")
    logging: LoggingConfig = _f(LoggingConfig(), "metrics")
    checkpoint: CheckpointConfig = _f(CheckpointConfig(), "checkpoints")

    def _check(self) -> None:
        if not _NAME_PATTERN.match(self.experiment_name):
            raise ConfigError("experiment_name", f"{self.experiment_name!r} must be letters, digits, '_', '-', '.'")
        if self.data.task == "auto":  # a default that follows the data: a train_file means no synthetic task
            self.data.task = None if self.data.train_file is not None else "arithmetic"
        self._check_models()
        self._check_algorithm()
        self._check_sampling()
        if self.rollout.partial_tokens:
            self._check_partial()
        if self.algorithm.distill_student_fraction < 1:
            self._check_given_completions()
        if self.logging.rollouts_every and not self.algorithm.record.samples_responses:
            raise ConfigError(
                "logging.rollouts_every", f"algorithm {self.algorithm.name!r} samples no rollouts to write (set 0)"
            )

    @property
    def run_dir(self) -> Path:
        """``logging.dir``, or ``runs/{experiment_name}``."""
        return Path(self.logging.dir) if self.logging.dir else Path("runs") / self.experiment_name

    @property
    def checkpoint_dir(self) -> Path:
        """``checkpoint.dir``, or ``<run_dir>/checkpoints``."""
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.run_dir / "checkpoints"

    @property
    def max_new_tokens(self) -> int:
        """``rollout.max_new_tokens``, or ``data.max_response_len``."""
        return self.rollout.max_new_tokens or self.data.max_response_len

    @property
    def scores_generations(self) -> bool:
        """Whether the run's held-out evaluation generates: whenever the algorithm trains a policy
        (not ``rm``, whose reward model is scored on pairs by its recipe)."""
        return "actor" in self.algorithm.record.trains

    @property
    def reward_fn(self) -> str | None:
        """The rule-based reward of an RL run: ``algorithm.reward_fn``, else the task's own reward
        when there is no reward model; None when ``models.reward`` scores responses."""
        if self.algorithm.reward_fn is not None or "reward" in self.models:
            return self.algorithm.reward_fn
        return self.data.build_task(self.seed).reward_name if self.data.task else None

    def is_trainable(self, role: str) -> bool:
        """``models.<role>.trainable``, defaulting to: the models the algorithm trains and a critic; ref never."""
        explicit = self.models[role].trainable
        if explicit is not None:
            return explicit
        return role == "critic" or role in self.algorithm.record.trains

    def needs_critic(self) -> bool:
        """The advantage estimator reads values (GAE): a critic computes them."""
        return estimator_reads(self.algorithm.resolved_adv_estimator, "values")

    def row_group_size(self) -> int:
        """Rows that must share a dp rank (:meth:`rlflow.dataflow.algorithms.Algorithm.row_group_size`)."""
        algo = self.algorithm
        return algo.record.row_group_size(algo.n_samples, estimator_reads(algo.resolved_adv_estimator, "index"))

    def required_models(self) -> tuple[str, ...]:
        """The roles the algorithm uses, in ``MODEL_ROLES`` order; other configured models are not built.

        A LoRA actor whose KL term has no ``models.ref`` is its own reference: its base, adapters
        disabled, inside its train call (no reference model, no second copy of the weights).
        """
        algo = self.algorithm
        needed = algo.record.required_models(
            kl_coef=algo.kl_coef,
            critic=self.needs_critic(),
            reward_model="reward" in self.models and algo.reward_fn is None,
            teacher=algo.uses_teacher,
        )
        if self.lora_reference():
            needed = tuple(r for r in needed if r != "ref")
        return needed

    def lora_reference(self) -> bool:
        """Whether the reference policy is the LoRA actor's base (adapters disabled): the actor has
        ``lora``, the KL term of an RL objective reads the reference, only the actor reads it (not
        a critic's returns, under a KL in the reward), and ``models.ref`` is not set."""
        actor = self.models.get("actor")
        algo = self.algorithm
        return (
            actor is not None
            and actor.lora is not None
            and "ref" not in self.models
            and algo.record.ref == "kl"
            and algo.kl_coef > 0
            and not (self.needs_critic() and algo.resolved_kl_in_reward)
        )

    def pass_tokens(self, role: str) -> int:
        """Tokens of one training forward pass of ``role`` when one worker runs the whole step: a
        mini-batch's rows at their longest (prompt and response), at most the model's
        ``micro_batch_tokens``. With the layer's size, the work ``models.<role>.dtype: auto`` weighs
        on CPUs."""
        record, algo, mt = self.algorithm.record, self.algorithm, self.rollout.multi_turn
        if mt.enabled:
            length = mt.max_prompt_tokens + mt.max_total_tokens
        else:
            length = self.data.max_prompt_len + (self.max_new_tokens or DEFAULT_RESPONSE_LEN)
        if record.dataset == "pairs":
            rows = 2 * self.data.batch_size
        elif record.samples_responses:
            rows = max(1, self.data.batch_size * algo.n_samples // algo.n_minibatches)
        else:
            rows = self.data.batch_size
        budget = self.models[role].micro_batch_tokens if role in self.models else None
        return min(rows * length, budget) if budget else rows * length

    def model_dtype(self, role: str) -> str:
        """``models.<role>.dtype`` as set (``auto`` unresolved); ``float32`` for a model not configured."""
        return self.models[role].dtype if role in self.models else "float32"

    def _check_models(self) -> None:
        for role, model in self.models.items():
            if role not in MODEL_ROLES:
                raise ConfigError(f"models.{role}", f"unknown model role; expected one of {list(MODEL_ROLES)}")
            if model.init == "copy":
                source = self.models.get(model.init_from)
                if model.init_from == role or source is None:
                    raise ConfigError(
                        f"models.{role}.init_from", f"{model.init_from!r}; expected one of {sorted(self.models)}"
                    )
                if source.init == "copy":
                    raise ConfigError(
                        f"models.{role}.init_from", f"{model.init_from!r} is a copy itself; name its source"
                    )
        for role, model in self.models.items():
            if model.lora is not None and (role != "actor" or not self.is_trainable(role)):
                raise ConfigError(
                    f"models.{role}.lora", "LoRA trains the actor only; set it under a trained models.actor"
                )
        for frozen in ("ref", "teacher"):
            if frozen in self.models and self.models[frozen].trainable:
                raise ConfigError(f"models.{frozen}.trainable", f"the {frozen} model never trains; set false or null")
        for role in self.required_models():
            if role not in self.models:
                raise ConfigError(f"models.{role}", f"missing: algorithm {self.algorithm.name!r} needs a {role} model")
        if "actor" in self.models and "actor" not in self.required_models():
            trains = ", ".join(f"models.{m}" for m in self.algorithm.record.trains)
            raise ConfigError(
                "models.actor", f"the {self.algorithm.name} algorithm trains {trains} only; remove the actor"
            )

    def _check_algorithm(self) -> None:
        algo, record = self.algorithm, self.algorithm.record
        if record.samples_responses and algo.resolved_adv_estimator is None:
            raise ConfigError("algorithm.adv_estimator", f"algorithm {algo.name!r} needs an estimator")
        estimator = algo.resolved_adv_estimator
        # Estimators that compare the responses of one prompt need at least two of them.
        if estimator_reads(estimator, "index") and algo.n_samples < 2:
            raise ConfigError(
                "algorithm.n_samples", f"{algo.n_samples}; the {algo.resolved_adv_estimator} estimator needs >= 2"
            )
        if not record.scores_responses and estimator_reads(estimator, "token_level_rewards"):
            raise ConfigError(
                "algorithm.adv_estimator",
                f"{estimator!r} reads rewards, but algorithm {algo.name!r} scores no responses; set null "
                f"({record.default_estimator}), or mix a teacher into a reward's advantages with another algorithm "
                "and algorithm.distill_coef",
            )
        if self.needs_critic() and "critic" in self.models and not self.is_trainable("critic"):
            raise ConfigError("models.critic.trainable", f"the {estimator} estimator needs a trainable critic")
        if record.samples_responses:
            rows = self.data.batch_size * algo.n_samples
            if algo.n_minibatches > rows:
                raise ConfigError(
                    "algorithm.n_minibatches",
                    f"{algo.n_minibatches} mini-batches, but a step has {rows} rows "
                    f"(data.batch_size={self.data.batch_size} x algorithm.n_samples={algo.n_samples})",
                )
            if algo.reward_fn is not None and "reward" in self.models:
                raise ConfigError(
                    "algorithm.reward_fn", f"{algo.reward_fn!r} and models.reward both give rewards; keep one"
                )
        mismatch = algo.mismatch_options()
        if mismatch and not algo.recomputes_old_logp(self.rollout, self.placement.use_gpu, self.model_dtype("actor")):
            key, value = next(iter(mismatch.items()))
            raise ConfigError(
                f"algorithm.{key}",
                f"{value} weighs the rollout's log-probs against recomputed ones, but recompute_old_logp="
                f"{str(algo.recompute_old_logp).lower() if algo.recompute_old_logp is not None else 'null'} "
                "recomputes none here; set algorithm.recompute_old_logp=true",
            )
        if self.warmup.steps and (record.dataset == "examples" or "actor" not in record.trains):
            raise ConfigError("warmup.steps", f"{self.warmup.steps}; a warm-up precedes RL or DPO, not {algo.name!r}")
        w = self.warmup
        if w.eval_every and w.steps:
            target = w.target_score is not None
            self._check_evaluable(
                "warmup.target_score" if target else "warmup.eval_every", w.target_score if target else w.eval_every
            )
        if self.trainer.target_score is not None:
            self._check_evaluable("trainer.target_score", self.trainer.target_score)

    def _check_evaluable(self, key: str, value: Any) -> None:
        """A setting that acts on held-out scores (``key``, at ``value``) needs held-out prompts and a
        rule to score them (the trainer's evaluation)."""
        why = None
        if not self.scores_generations:
            why = f"algorithm {self.algorithm.name!r} has no held-out generation to score"
        elif self.data.eval_size == 0:
            why = "data.eval_size is 0"
        elif self.data.task is None and self.data.eval_file is None:
            why = "no held-out data (data.eval_file)"
        if why is not None:
            raise ConfigError(key, f"{value}: cannot score held-out answers: {why}")

    def _check_sampling(self) -> None:
        # Each response length follows the other when only one is given; both null: 8 tokens.
        new_tokens = self.rollout.max_new_tokens or self.data.max_response_len or DEFAULT_RESPONSE_LEN
        limit = self.data.max_response_len or new_tokens
        if new_tokens > limit:
            raise ConfigError("rollout.max_new_tokens", f"{new_tokens} > data.max_response_len={limit}")
        self.rollout.max_new_tokens, self.data.max_response_len = new_tokens, limit
        if self.rollout.min_new_tokens > new_tokens:
            raise ConfigError(
                "rollout.min_new_tokens", f"{self.rollout.min_new_tokens} > rollout.max_new_tokens={new_tokens}"
            )
        buffer = self.algorithm.overlong_buffer
        if buffer is not None and buffer > new_tokens:
            raise ConfigError(
                "algorithm.overlong_buffer", f"{buffer} > rollout.max_new_tokens={new_tokens} (the penalty's buffer)"
            )
        engine = get_rollout_engine(self.rollout.engine)
        if self.placement.use_gpu is False and not engine.supports_device("cpu"):
            on_cpu = [n for n in list_rollout_engines() if get_rollout_engine(n).supports_device("cpu")]
            raise ConfigError(
                "rollout.engine",
                f"{self.rollout.engine!r} needs GPUs but placement.use_gpu is false; use one of {on_cpu}",
            )
        if self.placement.worker_host == "driver" and not driver_can_host(self.rollout.engine):
            raise ConfigError(
                "placement.worker_host",
                f"'driver' with rollout.engine={self.rollout.engine!r}: that engine is built once per worker "
                "process and kept (its own processes and process-wide settings); run it in a Ray worker "
                "(placement.worker_host: ray or auto)",
            )

    def _check_given_completions(self) -> None:
        """GKD's mixed rows (``algorithm.distill_student_fraction`` < 1) take completions into single-turn
        rollouts the student's own samples share a call with (the rows holding them are checked with the
        data: :func:`rlflow.trainer.data.check_completions`)."""
        key, why = "algorithm.distill_student_fraction", None
        if self.rollout.multi_turn.enabled:
            why = "rollout.multi_turn is on; a completion is one response, not an episode"
        elif self.rollout.partial_tokens:
            why = f"rollout.partial_tokens={self.rollout.partial_tokens}; a given completion is not continued"
        if why is not None:
            raise ConfigError(key, f"{self.algorithm.distill_student_fraction:g}: {why}")

    def _check_partial(self) -> None:
        """Partial rollouts (``rollout.partial_tokens``) run where the driver can carry responses from
        one step to the next: the built-in sampler, single-turn, one sampling generate call, no
        whole-step lag or dynamic sampling, and the decoupled correction free to resolve."""
        rollout, algo, key = self.rollout, self.algorithm, "rollout.partial_tokens"
        why = None
        generates = []
        if algo.record.samples_responses:
            generates = [m for m in algo.record.build_mfcs(GraphOptions()) if m.interface_type == "generate"]
        if not algo.record.samples_responses:
            why = f"algorithm {algo.name!r} samples no responses"
        elif len(generates) != 1:
            why = f"algorithm {algo.name!r} has {len(generates)} generate calls (a greedy baseline); one is continued"
        elif rollout.engine != "hf":
            why = f"rollout.engine={rollout.engine!r}; carried responses continue on the built-in sampler (hf)"
        elif rollout.multi_turn.enabled:
            why = "rollout.multi_turn is on; an episode is not split across calls"
        elif algo.policy_lag:
            why = (
                f"algorithm.policy_lag={algo.policy_lag}; partial rollouts bound staleness with rollout.partial_max_lag"
            )
        elif algo.dynamic_sampling:
            why = "algorithm.dynamic_sampling is on"
        elif rollout.min_new_tokens > rollout.partial_tokens:
            why = f"rollout.min_new_tokens={rollout.min_new_tokens} is more (the first call keeps the stop tokens out)"
        elif algo.behaviour_correction == "auto" and (algo.tis_cap is not None or algo.mismatch_options()):
            option = "tis_cap" if algo.tis_cap is not None else next(iter(algo.mismatch_options()))
            why = f"algorithm.{option} is set; partial rollouts take the decoupled correction (algorithm.is_cap)"
        if why is not None:
            raise ConfigError(key, f"{rollout.partial_tokens} cannot run: {why}")


def driver_can_host(rollout_engine: str) -> bool:
    """Whether a worker in the driver process may run this rollout engine: one built per call,
    not one built once per process and kept (vLLM's, with its own processes and process-wide
    settings), which keeps its Ray worker process (``placement.worker_host``)."""
    return get_rollout_engine(rollout_engine).persistence != PER_PROCESS


# --- Loading ---


def load_config(source: str | Path | Mapping[str, Any] | None = None, overrides: Sequence[str] = ()) -> RLFlowConfig:
    """Build a validated config from a YAML file (or a dict) and ``key=value`` overrides.

    Args:
        source: a YAML path, a nested dict of settings, or None for the defaults. A ``models``
            section replaces the default model set instead of merging into it.
        overrides: dotted ``key=value`` strings (``"models.actor.lr=1e-4"``, ``"data.ops=[+,-]"``),
            applied in order after ``source``; values are parsed as YAML.

    Returns:
        The validated :class:`RLFlowConfig`.

    Raises:
        ConfigError: an unknown key, a value of the wrong type, a value outside its allowed set
            or range, or an inconsistent combination; the message names the full dotted key and
            where the value came from.
        FileNotFoundError: ``source`` is a path that does not exist.

    >>> load_config({"trainer": {"total_steps": 5}}, ["algorithm.n_samples=4"]).algorithm.n_samples
    4
    """
    raw, origin = _read_source(source)
    base = OmegaConf.structured(RLFlowConfig)
    if "models" in raw:
        base.models = {}
    given = [*leaf_keys(OmegaConf.to_container(raw)), *(o.partition("=")[0].strip() for o in overrides)]
    merged = _merge(base, raw, origin, given)
    for override in overrides:
        merged = _merge(merged, _parse_override(override), f"override {override!r}", given)
    data = OmegaConf.to_container(merged, resolve=True)
    try:
        return _build(RLFlowConfig, data, "")
    except ConfigError as err:
        verl = verl_value_hint(err.key, OmegaConf.select(merged, err.key, default=None))
        if verl is not None:  # a value that means something else in verl
            err = ConfigError(err.key, verl)
        raise err.with_source(_source_of(err.key, raw, origin, overrides)) from None


def parse_cli(argv: Sequence[str]) -> RLFlowConfig:
    """``[recipe.yaml, key=value, ...]`` → config (the form of ``rlflow train`` and the recipes)."""
    if not argv or "=" in argv[0] or argv[0].startswith("-"):
        raise ConfigError("argv", f"{list(argv)}; expected: <recipe.yaml> [key=value ...]")
    return load_config(argv[0], argv[1:])


def to_yaml(cfg: RLFlowConfig) -> str:
    """The complete config as YAML; ``load_config`` of it gives back an equal config."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _read_source(source: str | Path | Mapping[str, Any] | None) -> tuple[DictConfig, str | None]:
    if source is None:
        return OmegaConf.create({}), None
    if isinstance(source, Mapping):
        return OmegaConf.create(dict(source)), None
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    try:
        raw = OmegaConf.load(path)
    except Exception as err:  # yaml.YAMLError and OmegaConf's own parse errors
        raise ConfigError("<file>", f"cannot parse YAML: {err}", f"in {path}") from None
    if not isinstance(raw, DictConfig):
        raise ConfigError("<file>", "the top level must be a mapping of sections", f"in {path}")
    return raw, f"in {path}"


def _parse_override(override: str) -> DictConfig:
    key, sep, _ = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(override, "an override must read key=value (e.g. trainer.total_steps=10)")
    try:
        return OmegaConf.from_dotlist([override])
    except OmegaConfBaseException as err:
        raise ConfigError(key, f"cannot parse the value: {err}", f"override {override!r}") from None


def _merge(base: DictConfig, update: DictConfig, origin: str | None, given: Sequence[str] = ()) -> DictConfig:
    """``OmegaConf.merge`` with its key and type errors turned into :class:`ConfigError`; ``given``: every
    key the config sets (an unknown verl key's error lists the others)."""
    try:
        return OmegaConf.merge(base, update)
    except OmegaConfBaseException as err:
        key, parent = err.full_key or "?", err.object_type
        declared = {f.name: f.type for f in dataclasses.fields(parent)} if dataclasses.is_dataclass(parent) else {}
        if isinstance(err, ConfigKeyError):
            verl = verl_hint(key, leaf_keys(OmegaConf.to_container(update)), given)
            if verl is not None:  # a verl user's key: name rlflow's
                raise ConfigError(*verl, origin) from None
            raise ConfigError(key, f"unknown key; valid keys here: {list(declared)}", origin) from None
        expected = declared.get(key.rsplit(".", 1)[-1])
        detail = str(err).splitlines()[0]
        raise ConfigError(key, detail + (f"; expected {expected}" if expected else ""), origin) from None


def _build(cls: type, data: Mapping[str, Any], path: str) -> Any:
    """Instantiate ``cls`` from plain ``data`` bottom-up, prefixing errors with ``path``."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = _build_value(hints[f.name], data[f.name], f"{path}.{f.name}" if path else f.name)
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise err.prefixed(path) from None


def _build_value(hint: Any, value: Any, path: str) -> Any:
    section = optional_section(hint)
    if section is not None and value is not None:
        return _build(section, value, path)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, path)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is dict and args and dataclasses.is_dataclass(args[1]):
        return {key: _build(args[1], item, f"{path}.{key}") for key, item in value.items()}
    if origin is tuple and isinstance(value, list):
        return tuple(value)
    return value


def _source_of(key: str, raw: DictConfig, origin: str | None, overrides: Sequence[str]) -> str | None:
    """The override or file that set ``key`` (or a parent or child of it), for error messages."""
    for override in reversed(overrides):
        set_key = override.partition("=")[0].strip()
        if set_key == key or set_key.startswith(key + ".") or key.startswith(set_key + "."):
            return f"override {override!r}"
    return origin if origin is not None and OmegaConf.select(raw, key, default=None) is not None else None


# --- Reference documentation (docs/configuration.md) ---


def render_config_reference() -> str:
    """The whole of ``docs/configuration.md`` (see :func:`rlflow.trainer.config_docs.render_reference`).

    Regenerate the file with ``python -m rlflow.trainer.config > docs/configuration.md``.
    """
    from rlflow.trainer.config_docs import render_reference

    return render_reference(RLFlowConfig, __doc__)


if __name__ == "__main__":
    sys.stdout.write(render_config_reference())
