"""Step callbacks: user code that sees every logged set of metrics and may stop training.

A callback is a function ``fn(step: int, metrics: dict[str, float]) -> bool | None`` or an
object with ``on_step_end(step, metrics)`` (TRL users know ``TrainerCallback.on_log``, which
this mirrors: it runs whenever the trainer logs, every ``trainer.log_every`` training steps and
at each evaluation, with the same dict the sinks write). Returning ``True`` asks the trainer to
stop: it finishes the step already issued (the loop overlaps iterations, so at most one more
step runs), then evaluates and saves as at the end of a run.

>>> seen = []
>>> hooks = Callbacks([lambda step, metrics: seen.append((step, metrics["loss"]))])
>>> hooks(3, {"loss": 0.5}), seen
(False, [(3, 0.5)])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

__all__ = ["Callbacks", "StepCallback", "StepCallbackObject"]

StepCallback = Callable[[int, dict[str, float]], "bool | None"]


class StepCallbackObject(Protocol):
    def on_step_end(self, step: int, metrics: dict[str, float]) -> bool | None: ...


class Callbacks:
    """The run's callbacks, called in order; remembers whether one asked to stop.

    Args:
        callbacks: functions or objects with ``on_step_end``.

    Raises:
        TypeError: an entry is neither callable nor has ``on_step_end``.
    """

    def __init__(self, callbacks: Sequence[StepCallback | StepCallbackObject] = ()) -> None:
        self.hooks: list[StepCallback] = []
        for cb in callbacks:
            hook = getattr(cb, "on_step_end", None) or (cb if callable(cb) else None)
            if hook is None:
                raise TypeError(f"callback {cb!r} is neither a function (step, metrics) nor has on_step_end")
            self.hooks.append(hook)
        self.stop_requested = False

    def __call__(self, step: int, metrics: Mapping[str, Any]) -> bool:
        """Calls every callback with a copy of ``metrics``; True when one of them returned True."""
        for hook in self.hooks:
            if hook(step, dict(metrics)) is True:
                self.stop_requested = True
        return self.stop_requested


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
