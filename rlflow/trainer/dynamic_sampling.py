"""DAPO's dynamic sampling: a step trains only on groups whose responses score differently.

A group (the responses to one prompt) whose rewards are all equal gets advantage 0 under a
group baseline (GRPO, RLOO) and so carries no gradient, while it still dilutes a token-mean
loss. :class:`DynamicSampler` issues a step's rollout calls, brings their rows to the driver,
keeps the informative groups and, while the batch is short of them, issues the rollout calls
again on further prompts (at most ``max_rounds`` generation rounds per step). The step's other
calls then read the kept rows. It needs the rewards among the rollout calls
(:meth:`~rlflow.trainer.runner.DataflowRunner.rollout_calls`: a rule or a frozen reward model).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from rlflow.protocol import DataProto
from rlflow.trainer.config import ConfigError, RLFlowConfig
from rlflow.trainer.runner import DataflowRunner, Submitted

__all__ = ["DynamicSampler", "build_sampler", "informative_groups"]


def informative_groups(rewards: np.ndarray, uids: Sequence[object]) -> dict[object, bool]:
    """Whether each group's rewards differ (in first-seen order of ``uids``).

    Args:
        rewards: ``(N,)`` reward of each row.
        uids: ``N`` group ids (rows of one group need not be adjacent).

    >>> informative_groups(np.array([1.0, 1.0, 0.0, 1.0, 0.5, 0.5]), ["a", "a", "b", "b", "c", "c"])
    {'a': False, 'b': True, 'c': False}
    """
    seen: dict[object, list[float]] = {}
    for uid, reward in zip(uids, rewards.tolist()):
        seen.setdefault(uid, []).append(reward)
    return {uid: max(values) > min(values) for uid, values in seen.items()}


class DynamicSampler:
    """Issues a step's rollout calls until the batch holds ``num_groups`` informative groups.

    Args:
        runner: the runner of the algorithm's graph.
        rollouts: the rollout calls, in issue order; the first generate call among them gives
            each row's group (``uid``).
        reward_call: the rollout call whose output holds ``rewards``.
        num_groups: groups per batch (``data.batch_size`` prompts).
        max_rounds: generation rounds per step at most, the first included.
    """

    def __init__(
        self, runner: DataflowRunner, rollouts: Sequence[str], reward_call: str, num_groups: int, max_rounds: int
    ) -> None:
        if max_rounds < 1:
            raise ValueError(f"max_rounds={max_rounds} must be >= 1")
        generate = [n for n in rollouts if runner.placements[n].mfc.interface_type == "generate"]
        if reward_call not in rollouts or not generate:
            raise ValueError(f"dynamic sampling needs a generate call and {reward_call!r} among the rollout calls")
        self.runner, self.rollouts, self.reward_call = runner, list(rollouts), reward_call
        self.generate, self.num_groups, self.max_rounds = generate[0], num_groups, max_rounds
        self.metrics: dict[int, dict[str, float]] = {}  # step -> its counts, popped when the step is logged

    def sample(self, step: int, batches: Iterator[DataProto]) -> tuple[DataProto, Submitted]:
        """Runs ``step``'s rollout rounds (waiting for each); returns the first round's dataset
        batch and the kept rows of every rollout call, as a submission the step's other calls read."""
        kept: list[dict[str, DataProto]] = []
        spare: list[dict[str, DataProto]] = []  # groups dropped, to fill a batch the rounds left short
        groups = dropped = rounds = 0
        first = None
        while groups < self.num_groups and rounds < self.max_rounds:
            batch = next(batches)
            first = batch if first is None else first
            rows = self.runner.wait(self.runner.submit(batch, self.rollouts, step=step), fetch=self.rollouts)
            rounds += 1
            uids = rows[self.generate].non_tensor_batch["uid"]
            informative = informative_groups(rows[self.reward_call].batch["rewards"].float().numpy(), uids)
            for uid, useful in informative.items():
                group = {name: _rows_of(part, np.flatnonzero(uids == uid)) for name, part in rows.items()}
                if useful and groups < self.num_groups:
                    kept.append(group)
                    groups += 1
                elif not useful:
                    spare.append(group)
                    dropped += 1
        filled = spare[: self.num_groups - groups]
        kept += filled
        self.metrics[step] = {
            "dynamic_sampling/rounds": float(rounds),
            "dynamic_sampling/groups_dropped": float(dropped),
            "dynamic_sampling/groups_short": float(len(filled)),
        }
        outputs = {name: DataProto.concat([group[name] for group in kept]) for name in self.rollouts}
        return first, Submitted(dict(outputs))


def _rows_of(data: DataProto, rows: np.ndarray) -> DataProto:
    """The rows ``rows`` of ``data`` without its meta_info (per-round statistics that differ between rounds)."""
    part = data[rows]
    return DataProto(part.batch, dict(part.non_tensor_batch))


def build_sampler(cfg: RLFlowConfig, runner: DataflowRunner) -> DynamicSampler | None:
    """The run's sampler when ``algorithm.dynamic_sampling`` is on, else None.

    Raises:
        ConfigError: the rewards come from a call that is not a rollout call (a reward model the
            run trains): they would only exist after the step's rollout is over.
    """
    algo = cfg.algorithm
    if not algo.dynamic_sampling:
        return None
    rollouts = runner.rollout_calls()
    producers = [n for n in runner.order if "rewards" in runner.placements[n].mfc.output_keys]
    reward_call = next((n for n in producers if n in rollouts), None)
    if reward_call is None:
        raise ConfigError(
            "algorithm.dynamic_sampling",
            f"true needs rewards scored with the rollout (a rule, reward functions or a frozen reward model); "
            f"they come from {producers}, outside the rollout calls {rollouts}",
        )
    return DynamicSampler(runner, rollouts, reward_call, cfg.data.batch_size, algo.dynamic_sampling_max_rounds)
