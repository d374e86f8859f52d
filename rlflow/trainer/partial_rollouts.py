"""Partial (interruptible) rollouts: responses sampled over several steps, trained once whole.

With ``rollout.partial_tokens`` N, :class:`PartialRollouts` runs each step's generation in
rounds. A round's generate call samples at most N new tokens for every open response: the
fresh prompts' first tokens, and the carried responses' next ones under the current weights
(:meth:`~rlflow.workers.interfaces.actor.ActorInterface.continue_rows`). Rows come to the driver;
unfinished ones are carried, finished ones wait until their whole group (the ``n`` samples of a
prompt) is finished. Each round takes in fresh prompts for the groups the batch still lacks, so
responses that need k calls keep about k - 1 batches of groups open. Rounds go on (one at least,
while responses are carried) until ``data.batch_size`` groups are finished; the step trains on
them, oldest first, and the rest wait for a later step. A group whose oldest token is more
than ``rollout.partial_max_lag`` weight versions behind is dropped (counted), whether it is still
sampled or waits, and a fresh prompt takes its slot. Everything carried is DataProto rows in the driver, so a checkpoint saves it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from rlflow.engine.rollout.base import SamplingParams
from rlflow.engine.rollout.partial import TOKEN_VERSION, unfinished_rows
from rlflow.protocol import DataProto
from rlflow.trainer.config import RLFlowConfig
from rlflow.trainer.runner import DataflowRunner, Submitted
from rlflow.workers.interfaces.actor import POLICY_VERSION

__all__ = ["PartialRollouts", "build_sampler"]

# The driver's buffers, each a DataProto file in a checkpoint's folder of partial rollouts.
_BUFFERS = ("carried", "done", "prompts")


class PartialRollouts:
    """Carries unfinished responses between steps; hands each step ``num_groups`` finished groups.

    Args:
        runner: the runner of the algorithm's graph.
        rollouts: the rollout calls (:meth:`DataflowRunner.rollout_calls`), the generate call first.
        num_groups: groups per training batch (``data.batch_size``).
        sampling: the training sampling parameters (``n``, ``max_new_tokens``, ``stop_token_ids``).
        max_tokens: new tokens per response per generate call (``rollout.partial_tokens``).
        max_lag: versions a group's oldest token may lag the weights training on it.
    """

    def __init__(
        self,
        runner: DataflowRunner,
        rollouts: Sequence[str],
        num_groups: int,
        sampling: SamplingParams,
        max_tokens: int,
        max_lag: int,
    ) -> None:
        generate = [n for n in rollouts if runner.placements[n].mfc.interface_type == "generate"]
        if len(generate) != 1 or rollouts[0] != generate[0]:
            raise ValueError(f"partial rollouts continue one generate call, first of the rollout calls {rollouts}")
        self.runner, self.generate, self.rest = runner, generate[0], [n for n in rollouts if n != generate[0]]
        self.num_groups, self.sampling, self.max_tokens, self.max_lag = num_groups, sampling, max_tokens, max_lag
        self.carried: DataProto | None = None  # unfinished rows
        self.done: DataProto | None = None  # finished rows of groups not trained yet
        self.prompts: DataProto | None = None  # dataset prompts drawn, not sampled yet
        self.num_drawn = 0  # prompts drawn so far: names each group uniquely
        self.seen: tuple[int, int] | None = None  # (step, weights version) of the last round
        self.metrics: dict[int, dict[str, float]] = {}  # step -> its counts, popped when the step is logged

    def sample(self, step: int, batches: Iterator[DataProto]) -> tuple[DataProto, Submitted]:
        """Runs ``step``'s generation rounds (waiting for each); returns the training rows of
        ``num_groups`` finished groups and the submission of the other rollout calls on them."""
        rounds = 0
        # Groups that waited since the last round may have grown stale without a round to see it:
        # the weights gain one version per step.
        dropped = self._drop_stale(self.seen[1] + step - self.seen[0]) if self.seen is not None else 0
        # Every step continues the carried responses at least once; rounds go on until enough groups
        # are finished, each taking in fresh prompts for the groups the batch still lacks.
        while (rounds == 0 and self.carried is not None) or len(self._finished_groups()) < self.num_groups:
            fresh = self._draw(self.num_groups - len(self._finished_groups()), batches)
            sampled = []
            if fresh is not None:
                sampled.append(self._call(fresh, step, resume=False))
            if self.carried is not None:
                sampled.append(self._call(self.carried, step, resume=True))
            rows = DataProto.concat(sampled)
            rounds += 1
            version = int(rows.batch[TOKEN_VERSION].max())  # every row got a token of this call
            self.seen = (step, version)
            width = rows.batch["input_ids"].shape[1] - self.sampling.max_new_tokens
            open_rows = unfinished_rows(
                rows.batch["input_ids"], rows.batch["response_mask"], width, self.sampling.stop_token_ids
            )
            self.carried = _nonempty(rows[open_rows])
            self.done = _cat(self.done, rows[~open_rows])
            dropped += self._drop_stale(version)
        batch = self._take(self._finished_groups()[: self.num_groups])
        self.metrics[step] = {
            "partial/rounds": float(rounds),
            "partial/groups_dropped": float(dropped),
            "partial/carried_responses": float(len(self.carried) if self.carried is not None else 0),
            "partial/waiting_groups": float(len(self._finished_groups())),
        }
        upstream = Submitted({self.generate: batch})
        return batch, self.runner.submit(batch, self.rest, step=step, upstream=upstream) if self.rest else upstream

    def _call(self, rows: DataProto, step: int, *, resume: bool) -> DataProto:
        """One generate call on fresh prompts or carried rows; its rows, in the driver."""
        kwargs = {self.generate: {"partial_tokens": self.max_tokens, "resume": resume}}
        if resume:  # the runner hands a generate call the prompt columns it declares: the rows' own
            width = rows.batch["input_ids"].shape[1] - self.sampling.max_new_tokens
            prompt = {
                "prompts": rows.batch["input_ids"][:, :width],
                "prompt_mask": rows.batch["attention_mask"][:, :width],
            }
            rows = rows.union(DataProto.from_dict(prompt))
        submitted = self.runner.submit(rows, [self.generate], kwargs, step=step)
        out = self.runner.wait(submitted, fetch=[self.generate])[self.generate]
        return DataProto(out.batch, dict(out.non_tensor_batch))  # per-call meta_info differs between calls

    def _draw(self, count: int, batches: Iterator[DataProto]) -> DataProto | None:
        """``count`` prompts from the queue, drawing dataset batches as needed; each gets a ``uid``
        of its own (a prompt drawn again in a later epoch must not join an open group)."""
        if count <= 0:
            return None
        while self.prompts is None or len(self.prompts) < count:
            batch = next(batches)
            uids = [f"{uid}@{self.num_drawn + i}" for i, uid in enumerate(batch.non_tensor_batch["uid"].tolist())]
            self.num_drawn += len(batch)
            batch = DataProto(batch.batch, {**batch.non_tensor_batch, "uid": np.asarray(uids, dtype=object)})
            self.prompts = _cat(self.prompts, batch)
        taken, self.prompts = self.prompts[:count], _nonempty(self.prompts[count:])
        return taken

    def _open_groups(self) -> set[str]:
        """Groups not finished yet: some of their rows are carried."""
        return set() if self.carried is None else set(self.carried.non_tensor_batch["uid"].tolist())

    def _finished_groups(self) -> list[str]:
        """Groups whose ``n`` rows are all finished, oldest first (then in the order they finished)."""
        if self.done is None:
            return []
        uids, versions = self.done.non_tensor_batch["uid"], self.done.non_tensor_batch[POLICY_VERSION]
        open_groups, oldest, count = self._open_groups(), {}, {}
        for uid, version in zip(uids.tolist(), versions.tolist()):
            oldest[uid] = min(version, oldest.get(uid, version))
            count[uid] = count.get(uid, 0) + 1
        ready = [u for u in oldest if count[u] == self.sampling.n and u not in open_groups]
        return sorted(ready, key=lambda u: oldest[u])  # stable: ties keep finishing order

    def _drop_stale(self, version: int) -> int:
        """Drop the groups whose oldest token is more than ``max_lag`` versions behind ``version``;
        returns how many."""
        stale: set[str] = set()
        for part in (self.carried, self.done):
            if part is not None:
                old = version - part.non_tensor_batch[POLICY_VERSION] > self.max_lag
                stale.update(part.non_tensor_batch["uid"][old].tolist())
        if stale:
            self.carried, self.done = (_without(part, stale) for part in (self.carried, self.done))
        return len(stale)

    def _take(self, groups: list[str]) -> DataProto:
        """The rows of ``groups`` out of the finished ones, each group's rows consecutive (the dp
        split keeps a group on one rank)."""
        uids = self.done.non_tensor_batch["uid"]
        index = np.concatenate([np.flatnonzero(uids == uid) for uid in groups])
        taken = self.done[torch.as_tensor(index)]
        self.done = _without(self.done, set(groups))
        return taken

    def save(self, directory: Path) -> dict:
        """Write the carried, finished and queued rows under ``directory``; returns what a resume reads back."""
        directory.mkdir(parents=True, exist_ok=True)
        for name in _BUFFERS:
            part = getattr(self, name)
            if part is not None:
                part.save(directory / f"{name}.safetensors")
        return {"num_drawn": self.num_drawn, "seen": list(self.seen) if self.seen is not None else None}

    def load(self, directory: Path, state: dict) -> None:
        """Take back what :meth:`save` wrote: the resumed run continues the same responses."""
        self.num_drawn = int(state["num_drawn"])
        self.seen = tuple(state["seen"]) if state.get("seen") is not None else None
        for name in _BUFFERS:
            path = directory / f"{name}.safetensors"
            setattr(self, name, DataProto.load(path) if path.exists() else None)


def _cat(a: DataProto | None, b: DataProto) -> DataProto | None:
    return _nonempty(b) if a is None else _nonempty(DataProto.concat([a, b]))


def _nonempty(rows: DataProto) -> DataProto | None:
    return rows if len(rows) else None


def _without(rows: DataProto | None, uids: set[str]) -> DataProto | None:
    """``rows`` less those of the groups ``uids``."""
    if rows is None:
        return None
    keep = ~np.isin(rows.non_tensor_batch["uid"].astype(str), sorted(uids))
    return _nonempty(rows[torch.as_tensor(keep)])


def build_sampler(cfg: RLFlowConfig, runner: DataflowRunner, sampling: SamplingParams) -> PartialRollouts | None:
    """The run's partial rollouts when ``rollout.partial_tokens`` is set, else None."""
    if not cfg.rollout.partial_tokens:
        return None
    return PartialRollouts(
        runner,
        runner.rollout_calls(),
        cfg.data.batch_size,
        sampling,
        cfg.rollout.partial_tokens,
        cfg.rollout.partial_max_lag,
    )
