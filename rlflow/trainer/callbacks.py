"""Callbacks: user code that sees every logged set of metrics and may stop training.

Two kinds are accepted, in any mix:

* **step callbacks** — a function ``fn(step: int, metrics: dict[str, float]) -> bool | None`` or
  an object with ``on_step_end(step, metrics)``. It runs whenever the trainer logs, every
  ``trainer.log_every`` training steps and at each evaluation, with the same dict the sinks
  write. Returning ``True`` asks the trainer to stop.
* **Hugging Face / TRL callbacks** — a ``transformers.TrainerCallback``, or any object whose hooks
  take ``(args, state, control, **kwargs)``. The trainer calls their ``on_init_end``,
  ``on_train_begin``, ``on_step_end`` (every training step), ``on_log`` (``logs=`` the logged
  dict), ``on_evaluate`` (``metrics=``), ``on_save`` and ``on_train_end`` with
  :class:`TrainingArgs` (rlflow's settings under ``TrainingArguments``' names), a real
  ``transformers.TrainerState`` and a real ``transformers.TrainerControl``. Setting
  ``control.should_training_stop = True`` asks the trainer to stop.

A stop request finishes the step already issued (the loop overlaps iterations, so at most one
more step runs), then evaluates and saves as at the end of a run.

>>> seen = []
>>> hooks = Callbacks([lambda step, metrics: seen.append((step, metrics["loss"]))])
>>> hooks(3, {"loss": 0.5}), seen
(False, [(3, 0.5)])
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rlflow.trainer.config import RLFlowConfig

__all__ = ["Callbacks", "StepCallback", "StepCallbackObject", "TrainingArgs", "training_args"]

StepCallback = Callable[[int, dict[str, float]], "bool | None"]

# The hooks of transformers' TrainerCallback that rlflow calls.
HF_EVENTS = ("on_init_end", "on_train_begin", "on_step_end", "on_log", "on_evaluate", "on_save", "on_train_end")


class StepCallbackObject(Protocol):
    def on_step_end(self, step: int, metrics: dict[str, float]) -> bool | None: ...


@dataclass(frozen=True)
class TrainingArgs:
    """What a Hugging Face callback reads of ``TrainingArguments`` / TRL's ``GRPOConfig``, from rlflow's config.

    Counts are per training step of the whole run (rlflow's driver feeds every worker):
    ``per_device_train_batch_size`` is the completions of one step (prompts × ``num_generations``).
    """

    output_dir: str = "."
    logging_dir: str = "."
    run_name: str = "rlflow"
    max_steps: int = -1
    num_train_epochs: float = 1.0
    logging_steps: int = 1
    eval_steps: int | None = None
    save_steps: int | None = None
    seed: int = 0
    learning_rate: float = 0.0
    per_device_train_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    num_generations: int = 1
    max_prompt_length: int | None = None
    max_completion_length: int | None = None
    temperature: float = 1.0
    beta: float = 0.0
    report_to: list[str] = field(default_factory=list)
    process_index: int = 0
    local_process_index: int = 0
    world_size: int = 1
    should_log: bool = True
    should_save: bool = True


def training_args(cfg: RLFlowConfig, run_dir: str | Path) -> TrainingArgs:
    """The :class:`TrainingArgs` of a run: each field from its rlflow counterpart."""
    algo = cfg.algorithm
    actor = cfg.models.get("actor")
    return TrainingArgs(
        output_dir=str(run_dir),
        logging_dir=str(run_dir),
        run_name=cfg.experiment_name,
        max_steps=cfg.trainer.total_steps,
        logging_steps=cfg.trainer.log_every,
        eval_steps=cfg.trainer.eval_every or None,
        save_steps=cfg.checkpoint.every_n_steps or None,
        seed=cfg.seed,
        learning_rate=actor.lr if actor is not None else 0.0,
        per_device_train_batch_size=cfg.data.batch_size * algo.n_samples,
        num_generations=algo.n_samples,
        max_prompt_length=cfg.data.max_prompt_len,
        max_completion_length=cfg.data.max_response_len,
        temperature=cfg.rollout.temperature,
        beta=algo.kl_coef,
        report_to=["tensorboard"] if cfg.logging.tensorboard else [],
    )


def _hf_trainer() -> Any:
    """transformers' callback module, imported on first use: it imports HF's trainer utilities,
    and with peft installed HF's modeling code (seconds), which a run without HF callbacks skips."""
    import transformers.trainer_callback

    return transformers.trainer_callback


def is_hf_callback(cb: Any) -> bool:
    """A ``TrainerCallback``, or an object of which some hook of :data:`HF_EVENTS` takes ``(args, state, control)``."""
    hf = sys.modules.get("transformers.trainer_callback")  # a TrainerCallback's maker imported it
    if hf is not None and isinstance(cb, hf.TrainerCallback):
        return True
    return any(_takes_three(getattr(cb, event, None)) for event in HF_EVENTS)


def _takes_three(hook: Any) -> bool:
    if not callable(hook):
        return False
    try:
        inspect.signature(hook).bind(None, None, None)
    except (TypeError, ValueError):
        return False
    try:  # a step hook (step, metrics) with an optional third parameter is not a TRL hook
        inspect.signature(hook).bind(None, None)
    except TypeError:
        return True
    return False


class Callbacks:
    """The run's callbacks, called in order; remembers whether one asked to stop.

    Args:
        callbacks: step callbacks and Hugging Face callbacks (see the module docstring).
        args: the run's :class:`TrainingArgs` (:func:`training_args`); default: the dataclass's defaults.
        steps_per_epoch: training batches of one pass over the data (``state.epoch``); None: unknown.

    Raises:
        TypeError: an entry is neither callable, nor has ``on_step_end``, nor is a Hugging Face callback.
    """

    def __init__(
        self,
        callbacks: Sequence[StepCallback | StepCallbackObject | Any] = (),
        args: TrainingArgs | None = None,
        steps_per_epoch: int | None = None,
    ) -> None:
        self.hooks: list[StepCallback] = []
        self.hf: list[Any] = []
        for cb in callbacks:
            if is_hf_callback(cb):
                self.hf.append(cb)
                continue
            hook = getattr(cb, "on_step_end", None) or (cb if callable(cb) else None)
            if hook is None:
                raise TypeError(
                    f"callback {cb!r} is neither a function (step, metrics), nor has on_step_end, "
                    "nor is a transformers.TrainerCallback"
                )
            self.hooks.append(hook)
        self.args = args or TrainingArgs()
        self.steps_per_epoch = steps_per_epoch
        self.state = self.control = None  # HF's TrainerState and TrainerControl, with HF callbacks only
        if self.hf:
            hf = _hf_trainer()
            self.state = hf.TrainerState(
                max_steps=self.args.max_steps,
                logging_steps=self.args.logging_steps,
                eval_steps=self.args.eval_steps or 500,
                save_steps=self.args.save_steps or 500,
                train_batch_size=self.args.per_device_train_batch_size,
            )
            self.control = hf.TrainerControl()
        self.stop_requested = False
        self._began = False
        self._event("on_init_end")

    def __call__(self, step: int, metrics: Mapping[str, Any]) -> bool:
        """Calls every step callback with a copy of ``metrics`` and every HF callback's ``on_log``;
        True once one of them asked to stop."""
        for hook in self.hooks:
            if hook(step, dict(metrics)) is True:
                self.stop_requested = True
        if self.hf:
            self._at(step)
            logs = dict(metrics)
            if self.state.epoch is not None:
                logs["epoch"] = self.state.epoch
            self.state.log_history.append({**logs, "step": step})
            self._event("on_log", logs=logs)
        return self.stop_requested

    def train_begin(self, step: int) -> None:
        """``on_train_begin``, once per run (a restart after a failure does not repeat it)."""
        if not self._began:
            self._began = True
            self._at(step)
            self._event("on_train_begin")

    def step_end(self, step: int) -> None:
        """``on_step_end`` after training step ``step``."""
        self._at(step)
        self._event("on_step_end")

    def evaluate(self, step: int, metrics: Mapping[str, Any]) -> None:
        """``on_evaluate`` with the held-out ``metrics``."""
        self._at(step)
        self._event("on_evaluate", metrics=dict(metrics))

    def save(self, step: int) -> None:
        """``on_save`` after a checkpoint of ``step`` was written."""
        self._at(step)
        self._event("on_save")

    def train_end(self, step: int) -> None:
        self._at(step)
        self._event("on_train_end")

    def _at(self, step: int) -> None:
        if self.state is None:
            return
        self.state.global_step = step
        if self.steps_per_epoch:
            self.state.epoch = step / self.steps_per_epoch

    def _event(self, event: str, **kwargs: Any) -> None:
        if not self.hf:
            return
        for cb in self.hf:
            hook = getattr(cb, event, None)
            if hook is None:
                continue
            result = hook(self.args, self.state, self.control, **kwargs)
            # transformers' handler takes a returned control in place of the one it holds.
            if isinstance(result, _hf_trainer().TrainerControl):
                self.control = result
        if self.control.should_training_stop:
            self.stop_requested = True


class NotifyingLogger:
    """A metrics logger that also hands every logged record to the callbacks."""

    def __init__(self, logger: Any, callbacks: Callbacks) -> None:
        self.logger, self.callbacks = logger, callbacks

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.logger.log(step, metrics)
        self.callbacks(step, metrics)

    def rewind(self, step: int) -> None:
        self.logger.rewind(step)

    def close(self) -> None:
        self.logger.close()
