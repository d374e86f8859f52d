"""Multi-turn rollouts: the policy samples a turn, an episode answers it, the answer is appended, and so on.

The engine layer knows nothing of tools or chat templates: it drives :class:`Episode` objects that
speak token ids (the workers hand it :meth:`rlflow.workers.environments.EnvironmentSpec.episodes`).
Token in, token out: a row's response is exactly the sampled ids and the observation ids as the
episode returned them, never decoded and re-encoded.

Each turn is one batched ``sample`` call over the episodes still running, with each episode's whole
context (prompt, earlier turns, observations) as its prompt: the KV cache does not survive a turn,
so a turn re-reads its context (a prefill of the context per turn). The turn's ``step`` calls run on
a thread pool, all episodes' at once; the next turn starts when every ``step`` of this one returned,
so a turn lasts as long as its slowest step, and the sampling stays reproducible for a seed. With
``MultiTurn.overlap`` the episodes whose step answered go on at once, while slower steps still run.

Output rows (:func:`assemble_episodes`) follow :mod:`rlflow.engine.rollout.base`, with ``R =
max_total_tokens`` and ``P = max_prompt_tokens``; ``response_mask`` is 1 on sampled tokens only
(the loss mask), ``response_attention`` 1 on sampled and observation tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from rlflow.engine.packing import position_ids_from_mask
from rlflow.engine.rollout.base import SamplingParams
from rlflow.protocol import DataProto

__all__ = [
    "ENV_REWARDS",
    "Episode",
    "EpisodeRecord",
    "MultiTurn",
    "SampleFn",
    "assemble_episodes",
    "episode_metrics",
    "episode_rows",
    "run_episodes",
]

# The rollout column of each episode's summed step rewards; the reward call adds it to its score.
ENV_REWARDS = "env_rewards"

# ``sample(input_ids (b, p) left-padded, attention_mask (b, p), params with n=1)`` ->
# ``(responses, response_mask, old_logp)``, each ``(b, params.max_new_tokens)``.
SampleFn = Callable[[torch.Tensor, torch.Tensor, SamplingParams], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

# Seeds of successive turns are spread apart, as rollouts' are (a large prime).
_TURN_SEED_STRIDE = 7_919


@runtime_checkable
class Episode(Protocol):
    """One episode in token ids (:class:`rlflow.workers.environments.TokenEpisode` is one).

    ``step`` returns ``(observation ids, reward, done)``; ``metrics`` per-episode counts
    (``tools/calls``...), summed over a batch's episodes by :func:`episode_metrics`.
    """

    def reset(self, row: Mapping[str, Any]) -> Sequence[int]: ...

    def step(self, ids: Sequence[int]) -> tuple[Sequence[int], float, bool]: ...

    def metrics(self) -> Mapping[str, float]: ...


@dataclass(frozen=True, kw_only=True)
class MultiTurn:
    """How a generate call runs episodes instead of one response per prompt.

    Args:
        episodes: makes one :class:`Episode` per sampled row.
        max_turns: sampled turns per episode at most.
        max_total_tokens: response tokens per episode (sampled + observation), ``R`` of the output.
        max_prompt_tokens: prompt ids an episode's ``reset`` may return, ``P`` of the output.
        num_threads: episodes whose ``step`` runs at once.
        overlap: episodes whose ``step`` answered sample their next turn without waiting for the
            slower steps of their turn (a slow tool stalls only its own episode); which episodes
            share a batched ``sample`` then depends on the steps' timing, so a seed no longer fixes
            the tokens. False: turn by turn (module docstring).
        stop_sequences: token-id sequences a turn also ends on, besides the stop tokens (a tool
            call's closing tag, :attr:`SamplingParams.stop_sequences`): the turn keeps the sampled
            ids up to and including the sequence, nothing after.
    """

    episodes: Callable[[], Episode]
    max_turns: int = 4
    max_total_tokens: int = 256
    max_prompt_tokens: int = 256
    num_threads: int = 8
    overlap: bool = False
    stop_sequences: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_total_tokens", "max_prompt_tokens", "num_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"MultiTurn.{name}={getattr(self, name)} must be >= 1")
        if not callable(self.episodes):
            raise TypeError(f"MultiTurn.episodes={self.episodes!r} must be a callable making episodes")
        sequences = tuple(tuple(int(t) for t in seq) for seq in self.stop_sequences)
        if any(not seq or min(seq) < 0 for seq in sequences):
            raise ValueError(f"MultiTurn.stop_sequences={sequences} must be non-empty sequences of token ids")
        object.__setattr__(self, "stop_sequences", sequences)


@dataclass
class EpisodeRecord:
    """One episode as it ran: its prompt, its response tokens and what they are."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)  # sampled and observation ids, in order
    sampled: list[bool] = field(default_factory=list)  # per id: the policy sampled it (else an observation)
    logp: list[float] = field(default_factory=list)  # per id: its log-prob when sampled, else 0
    reward: float = 0.0  # the sum of the step rewards
    turns: int = 0
    done: bool = False
    step_s: float = 0.0  # seconds in ``step``

    def add(self, ids: Sequence[int], logp: Sequence[float] | None) -> None:
        self.ids += list(ids)
        self.sampled += [logp is not None] * len(ids)
        self.logp += list(logp) if logp is not None else [0.0] * len(ids)


def episode_rows(prompts: DataProto) -> list[dict[str, Any]]:
    """What each episode's ``reset`` reads: the row's dataset record (its ``columns`` entry, with
    ``prompt``) when the rows carry one, else its non-tensor columns; ``prompt_ids`` is always
    added (the row's prompt ids, padding removed)."""
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"].bool()
    records = prompts.non_tensor_batch.get("columns")
    rows = []
    for i in range(len(prompts)):
        if records is not None:
            row = dict(records[i])
        else:
            row = {k: v[i] for k, v in prompts.non_tensor_batch.items()}
        rows.append({**row, "prompt_ids": ids[i][mask[i]].tolist()})
    return rows


def run_episodes(
    sample: SampleFn, rows: Sequence[Mapping[str, Any]], params: SamplingParams, multi: MultiTurn
) -> tuple[list[EpisodeRecord], list[Episode]]:
    """Runs ``params.n`` episodes per row, interleaved as rollouts are (row ``i*n + j``).

    Each turn samples at most ``params.max_new_tokens`` tokens (ending on a stop token of
    ``params`` or a sequence of ``multi.stop_sequences``) and no more than the episode's token budget has left; an observation that would
    leave no room to sample, or that follows the last turn, is not appended (the episode ends).

    Raises:
        ValueError: an episode's prompt is empty or longer than ``multi.max_prompt_tokens``.
    """
    episodes = [multi.episodes() for _ in rows for _ in range(params.n)]
    records = []
    for i, episode in enumerate(episodes):
        prompt = [int(t) for t in episode.reset(rows[i // params.n])]
        if not 0 < len(prompt) <= multi.max_prompt_tokens:
            raise ValueError(
                f"episode {i}: reset returned {len(prompt)} prompt ids; expected 1..max_prompt_tokens="
                f"{multi.max_prompt_tokens} (rollout.multi_turn.max_prompt_tokens)"
            )
        records.append(EpisodeRecord(prompt))
    with ThreadPoolExecutor(max_workers=multi.num_threads, thread_name_prefix="episode") as pool:
        (_run_overlapped if multi.overlap else _run_in_turns)(sample, episodes, records, params, multi, pool)
    return records, episodes


def _run_in_turns(sample, episodes, records, params, multi, pool: ThreadPoolExecutor) -> None:
    """Turn by turn: every running episode samples, then every one steps; the next turn waits for all."""
    for turn in range(multi.max_turns):
        running = [i for i, r in enumerate(records) if not r.done]
        if not running:
            break
        _sample_turn(sample, records, running, params, multi, turn)
        answers = pool.map(lambda i: _step(episodes[i], records[i]), running)
        for i, (obs, reward, done) in zip(running, answers):
            _answer(records[i], obs, reward, done, multi)


def _run_overlapped(sample, episodes, records, params, multi, pool: ThreadPoolExecutor) -> None:
    """Episodes whose step answered sample their next turn together while slower steps still run."""
    ready, pending, calls = list(range(len(records))), {}, 0
    while ready or pending:
        if ready:
            _sample_turn(sample, records, ready, params, multi, calls)
            calls += 1
            pending.update({pool.submit(_step, episodes[i], records[i]): i for i in ready})
            ready = []
        finished, _ = wait_futures(pending, return_when=FIRST_COMPLETED)
        for i, future in sorted((pending.pop(f), f) for f in finished):
            _answer(records[i], *future.result(), multi)
            if not records[i].done:
                ready.append(i)


def _sample_turn(
    sample: SampleFn, records: list[EpisodeRecord], running: list[int], params: SamplingParams, multi: MultiTurn, turn
) -> None:
    """One batched ``sample`` over the running episodes' contexts; appends each one's sampled ids."""
    contexts = [records[i].prompt + records[i].ids for i in running]
    room = [multi.max_total_tokens - len(records[i].ids) for i in running]
    width = max(len(c) for c in contexts)
    ids = torch.zeros((len(running), width), dtype=torch.long)
    mask = torch.zeros((len(running), width), dtype=torch.long)
    for row, context in enumerate(contexts):
        ids[row, width - len(context) :] = torch.tensor(context)
        mask[row, width - len(context) :] = 1
    max_new = min(params.max_new_tokens, max(room))
    seed = None if params.seed is None else (params.seed + _TURN_SEED_STRIDE * turn) % 2**62
    turn_params = replace(params, n=1, max_new_tokens=max_new, min_new_tokens=min(params.min_new_tokens, max_new),
                          seed=seed, stop_sequences=params.stop_sequences + multi.stop_sequences)  # fmt: skip
    responses, response_mask, old_logp = (t.cpu() for t in sample(ids, mask, turn_params))
    for row, i in enumerate(running):
        keep = response_mask[row].bool()
        sampled = responses[row][keep].tolist()[: room[row]]
        records[i].add(sampled, old_logp[row][keep].tolist()[: room[row]])
        records[i].turns += 1


def _step(episode: Episode, record: EpisodeRecord) -> tuple[list[int], float, bool]:
    """The episode's answer to its last turn (the ids sampled since the last observation)."""
    start = len(record.sampled)
    while start > 0 and record.sampled[start - 1]:
        start -= 1
    began = time.perf_counter()
    obs, reward, done = episode.step(record.ids[start:])
    record.step_s += time.perf_counter() - began
    return [int(t) for t in obs], float(reward), bool(done)


def _answer(record: EpisodeRecord, obs: list[int], reward: float, done: bool, multi: MultiTurn) -> None:
    record.reward += reward
    last_turn = record.turns >= multi.max_turns
    if done or last_turn or len(record.ids) + len(obs) >= multi.max_total_tokens:
        record.done = True  # nothing would be sampled after the observation: it is left out
        return
    record.add(obs, None)


def assemble_episodes(
    records: Sequence[EpisodeRecord], multi: MultiTurn, pad_token_id: int, source: DataProto | None, n: int
) -> DataProto:
    """The records as :meth:`RolloutEngine.generate` output (``source``'s columns repeated ``n``
    times), plus the column ``env_rewards`` (each episode's summed step rewards) and the
    tensor ``response_attention``."""
    t = _episode_tensors(records, multi, pad_token_id)
    attention_mask = torch.cat([t["prompt_mask"], t["response_attention"]], dim=1)
    out = {
        "prompts": t["prompts"],
        "responses": t["responses"],
        "response_mask": t["response_mask"],
        "response_attention": t["response_attention"],
        "input_ids": torch.cat([t["prompts"], t["responses"]], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
        "old_logp": t["old_logp"],
    }
    columns = {ENV_REWARDS: np.asarray([r.reward for r in records], dtype=np.float64)}
    if source is not None:
        columns.update({k: np.repeat(v, n, axis=0) for k, v in source.non_tensor_batch.items()})
    return DataProto.from_dict(out, columns)


def _episode_tensors(records: Sequence[EpisodeRecord], multi: MultiTurn, pad_token_id: int) -> dict[str, torch.Tensor]:
    num, width, room = len(records), multi.max_prompt_tokens, multi.max_total_tokens
    out = {
        "prompts": torch.full((num, width), pad_token_id, dtype=torch.long),
        "prompt_mask": torch.zeros((num, width), dtype=torch.long),
        "responses": torch.full((num, room), pad_token_id, dtype=torch.long),
        "response_mask": torch.zeros((num, room), dtype=torch.long),
        "response_attention": torch.zeros((num, room), dtype=torch.long),
        "old_logp": torch.zeros((num, room), dtype=torch.float32),
    }
    for row, r in enumerate(records):
        p, n = len(r.prompt), len(r.ids)
        out["prompts"][row, width - p :] = torch.tensor(r.prompt)
        out["prompt_mask"][row, width - p :] = 1
        out["responses"][row, :n] = torch.tensor(r.ids, dtype=torch.long)
        out["response_mask"][row, :n] = torch.tensor(r.sampled, dtype=torch.long)
        out["response_attention"][row, :n] = 1
        out["old_logp"][row, :n] = torch.tensor(r.logp, dtype=torch.float32)
    return out


def episode_metrics(records: Sequence[EpisodeRecord], episodes: Sequence[Episode]) -> dict[str, float]:
    """Per-batch means: ``multi_turn/turns``, ``multi_turn/env_reward``, ``multi_turn/step_s`` (seconds
    in ``step`` per episode), ``multi_turn/observation_share`` (observation tokens / response tokens),
    and each key of the episodes' ``metrics()`` (``tools/calls``...) as a mean per episode."""
    num = max(len(records), 1)
    tokens = sum(len(r.ids) for r in records)
    observed = sum(len(r.ids) - sum(r.sampled) for r in records)
    out = {
        "multi_turn/turns": sum(r.turns for r in records) / num,
        "multi_turn/env_reward": sum(r.reward for r in records) / num,
        "multi_turn/step_s": sum(r.step_s for r in records) / num,
        "multi_turn/observation_share": observed / tokens if tokens else 0.0,
    }
    for episode in episodes:
        for key, value in episode.metrics().items():
            out[key] = out.get(key, 0.0) + float(value) / num
    return out
