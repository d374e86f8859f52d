"""What happens when a reward raises on one sample: ``algorithm.reward_errors``.

* ``raise`` (default): the call fails with a :class:`RewardCallError` naming the reward, the
  sample's index among the call's rows on this rank, its prompt id and its prompt; the worker
  puts the call, its model and the rank in front (``reward_inf (model reward) on rank 1: ...``).
* ``zero``: the sample scores 0.0 and counts in the means like any other score.
* ``skip``: the sample's score is left out, as a reward function's ``None`` in TRL: out of the
  means and of the weighted sum (a sample every reward skipped gets 0).

``zero`` and ``skip`` count the failures: the call logs ``reward_error_fraction`` (failed
samples over rows; ``reward_inf/reward_error_fraction`` in the metrics) and the worker logs the
first failure of each call, so that a reward that fails on every sample is seen at once.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["REWARD_ERROR_POLICIES", "RewardCallError", "RewardErrors"]

logger = logging.getLogger(__name__)

REWARD_ERROR_POLICIES = ("raise", "zero", "skip")
_PROMPT_CHARS = 200  # of a prompt quoted in an error


class RewardCallError(RuntimeError):
    """A reward raised on one sample under ``reward_errors: raise``."""


@dataclass
class RewardErrors:
    """The failures of one reward call under a policy.

    Attributes:
        policy: one of :data:`REWARD_ERROR_POLICIES`.
        count: samples whose reward raised (each counted once, whichever reward raised).
        first: the message of the first failure, for the log.

    >>> errors = RewardErrors("zero")
    >>> errors.value("numeric_match", 3, "1+1=", ValueError("bad"))
    0.0
    >>> errors.count, errors.first
    (1, "reward 'numeric_match' raised on sample 3 (prompt '1+1='): ValueError: bad")
    """

    policy: str = "raise"
    count: int = 0
    first: str | None = None
    _failed: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.policy not in REWARD_ERROR_POLICIES:
            raise ValueError(f"reward_errors={self.policy!r}; expected one of {REWARD_ERROR_POLICIES}")

    def value(self, reward: str, index: int, prompt: Any, error: Exception, uid: Any = None) -> float:
        """The score of sample ``index`` whose reward raised ``error``: 0.0 (``zero``) or NaN (``skip``).

        Raises:
            RewardCallError: under ``raise``, naming the reward, the sample, its prompt id and prompt.
        """
        text = str(prompt)
        text = text if len(text) <= _PROMPT_CHARS else text[:_PROMPT_CHARS] + "..."
        which = f"sample {index}" + ("" if uid is None else f", prompt id {uid}")
        message = f"reward {reward!r} raised on {which} (prompt {text!r}): {type(error).__name__}: {error}"
        if self.policy == "raise":
            raise RewardCallError(f"{message} (algorithm.reward_errors=zero or skip scores such samples)") from error
        if index not in self._failed:
            self._failed.add(index)
            self.count += 1
        self.first = self.first or message
        return 0.0 if self.policy == "zero" else math.nan

    def metrics(self, rows: int) -> dict[str, float]:
        """``{"reward_error_fraction": failed samples / rows}`` (the worker averages it over dp by rows)."""
        return {"reward_error_fraction": self.count / rows if rows else 0.0}

    def report(self, call: str) -> None:
        """Logs how many samples of ``call`` failed and the first failure (nothing when none did)."""
        if self.count:
            logger.warning(
                f"{call}: {self.count} reward error(s) scored by reward_errors={self.policy!r}; first: {self.first}"
            )
