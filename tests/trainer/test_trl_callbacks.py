"""Hugging Face / TRL ``TrainerCallback`` objects in ``Trainer(callbacks=[...])``: their hooks get
``TrainingArguments``-like args from the config, a real ``TrainerState`` and ``TrainerControl``, and
``control.should_training_stop`` stops a run; step callbacks (functions) keep working beside them."""

from __future__ import annotations

import pytest
from transformers import TrainerCallback, TrainerControl, TrainerState

from rlflow.trainer import Trainer, load_config
from rlflow.trainer.callbacks import Callbacks, TrainingArgs, is_hf_callback, training_args


class Recorder(TrainerCallback):
    """Records every hook call; asks to stop once ``global_step`` reaches ``stop_at``."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.events: list[tuple[str, int]] = []
        self.logs: list[dict] = []
        self.evaluations: list[dict] = []
        self.seen: list[tuple] = []
        self.stop_at = stop_at

    def _record(self, event, args, state, control):
        self.events.append((event, state.global_step))
        self.seen.append((args, state, control))

    def on_init_end(self, args, state, control, **kwargs):
        self._record("init_end", args, state, control)

    def on_train_begin(self, args, state, control, **kwargs):
        self._record("train_begin", args, state, control)

    def on_step_end(self, args, state, control, **kwargs):
        self._record("step_end", args, state, control)
        if self.stop_at is not None and state.global_step >= self.stop_at:
            control.should_training_stop = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._record("log", args, state, control)
        self.logs.append(dict(logs))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self._record("evaluate", args, state, control)
        self.evaluations.append(dict(metrics))

    def on_save(self, args, state, control, **kwargs):
        self._record("save", args, state, control)

    def on_train_end(self, args, state, control, **kwargs):
        self._record("train_end", args, state, control)


class DuckCallback:
    """Not a TrainerCallback subclass; its hook takes (args, state, control, **kwargs)."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.steps.append(state.global_step)


def test_hugging_face_callbacks_are_told_from_step_callbacks():
    class StepObject:
        def on_step_end(self, step, metrics):
            return None

    assert is_hf_callback(Recorder()) and is_hf_callback(DuckCallback()) and is_hf_callback(TrainerCallback())
    assert not is_hf_callback(StepObject()) and not is_hf_callback(lambda step, metrics: None)
    assert not is_hf_callback(lambda step, metrics, extra=None: None)


def test_training_args_carry_the_config_under_trl_names(tmp_path):
    cfg = load_config(
        None,
        [
            "seed=7",
            "trainer.total_steps=12",
            "trainer.log_every=3",
            "trainer.eval_every=4",
            "checkpoint.every_n_steps=6",
            "models.actor.lr=3e-4",
            "data.batch_size=4",
            "algorithm.n_samples=2",
            "data.max_prompt_len=16",
            "rollout.max_new_tokens=5",
        ],
    )
    args = training_args(cfg, tmp_path)
    assert (args.output_dir, args.max_steps, args.logging_steps, args.eval_steps, args.save_steps) == (
        str(tmp_path),
        12,
        3,
        4,
        6,
    )
    assert (args.seed, args.learning_rate, args.num_generations, args.per_device_train_batch_size) == (7, 3e-4, 2, 8)
    assert (args.max_prompt_length, args.max_completion_length) == (16, 5)


def test_hooks_get_args_a_real_state_and_control_and_may_stop():
    recorder, duck, plain = Recorder(stop_at=2), DuckCallback(), []
    args = TrainingArgs(max_steps=5, logging_steps=1)
    hooks = Callbacks([recorder, duck, lambda step, metrics: plain.append(step)], args, steps_per_epoch=4)
    hooks.train_begin(0)
    hooks.step_end(1)
    assert hooks(1, {"loss": 1.0}) is False
    hooks.step_end(2)
    assert hooks.stop_requested  # control.should_training_stop set in on_step_end
    hooks(2, {"loss": 0.5})
    hooks.evaluate(2, {"eval/score": 0.25})
    hooks.save(2)
    hooks.train_end(2)

    assert recorder.events == [
        ("init_end", 0),
        ("train_begin", 0),
        ("step_end", 1),
        ("log", 1),
        ("step_end", 2),
        ("log", 2),
        ("evaluate", 2),
        ("save", 2),
        ("train_end", 2),
    ]
    args_seen, state, control = recorder.seen[-1]
    assert args_seen is args and isinstance(state, TrainerState) and isinstance(control, TrainerControl)
    assert state.max_steps == 5 and state.best_metric is None and state.epoch == 0.5
    assert recorder.logs == [{"loss": 1.0, "epoch": 0.25}, {"loss": 0.5, "epoch": 0.5}]
    assert state.log_history == [{"loss": 1.0, "epoch": 0.25, "step": 1}, {"loss": 0.5, "epoch": 0.5, "step": 2}]
    assert recorder.evaluations == [{"eval/score": 0.25}]
    assert duck.steps == [1, 2] and plain == [1, 2]
    hooks.train_begin(2)  # a restart after a failure: on_train_begin once per run
    assert [e for e, _ in recorder.events].count("train_begin") == 1


SMALL_RUN = {
    "experiment_name": "trl_callbacks",
    "algorithm": {"name": "grpo", "n_samples": 2},
    "data": {"batch_size": 4, "eval_size": 4},
    "models": {"actor": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1}},
    "warmup": {"steps": 0},
    "trainer": {"total_steps": 6, "log_every": 1, "eval_every": 0, "eval_before_train": False},
    "checkpoint": {"every_n_steps": 1, "keep_last": 1},
    "placement": {"mode": "heuristic", "devices_per_node": 1, "profile": False},
    "logging": {"tensorboard": False, "console": False},
}


@pytest.mark.timeout(180)
def test_a_trainer_callback_sees_the_run_and_stops_it(tmp_path):
    recorder, logged = Recorder(stop_at=2), []
    config = {**SMALL_RUN, "logging": {**SMALL_RUN["logging"], "dir": str(tmp_path / "run")}}
    callbacks = [recorder, lambda step, metrics: logged.append(step)]
    with Trainer(config, callbacks=callbacks, progress_bars=False) as trainer:
        result = trainer.fit()

    assert 2 <= result.steps < 6  # stopped by control.should_training_stop after step 2 (one more may be in flight)
    events = [e for e, _ in recorder.events]
    assert events[:2] == ["init_end", "train_begin"] and events[-1] == "train_end"
    steps = [s for e, s in recorder.events if e == "step_end"]
    assert steps == list(range(1, result.steps + 1))
    assert ("evaluate", result.steps) in recorder.events and ("save", 1) in recorder.events
    args, state, _ = recorder.seen[-1]
    assert args.output_dir == str(tmp_path / "run") and args.max_steps == 6 and args.num_generations == 2
    assert state.global_step == result.steps and state.max_steps == 6
    trained = [h for h in state.log_history if "actor_train/loss" in h]
    assert [h["step"] for h in trained] == list(range(1, result.steps + 1))
    assert recorder.evaluations[-1]["eval/score"] == result.score_after
    assert sorted(set(logged)) == list(range(1, result.steps + 1))  # the function callback still runs
