"""What a model worker reports about the calls it ran: timing records, profiler traces and call errors.

Every rank keeps one :class:`CallRecord` per MFC call and per reallocation hook it ran;
the driver pops them (``ModelWorker.pop_metrics``) and groups them by the training step the
driver gave the call. Chosen calls at chosen steps run under ``torch.profiler``
(:class:`CallProfiler`, ``trainer.profile_calls``), each rank writing a Chrome trace. An
exception inside a call or hook leaves the worker as a :class:`~rlflow.controller.TaskError`
whose message names the call, its model and the rank (``reward_inf (model reward) on rank 1:
ValueError: ...``), with the original exception chained.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity

from rlflow.controller import TaskError

__all__ = ["INTERVAL_KINDS", "RECORD_KINDS", "CallProfiler", "CallRecord", "call_error"]

# What ran: the call itself or one of its reallocation hooks.
RECORD_KINDS = ("call", "pre_call", "post_call")
# How the measured timeline draws it (rlflow.planner.timeline.KINDS): a call, weights moved between
# layouts, or a home reloaded/offloaded.
INTERVAL_KINDS = ("call", "realloc", "reload")


@dataclass(frozen=True)
class CallRecord:
    """One call or hook that one rank ran.

    Attributes:
        mfc: the MFC's name.
        model: the model it ran on.
        kind: ``"call"``, ``"pre_call"`` or ``"post_call"``.
        interval_kind: how the timeline draws it: ``"call"``, ``"realloc"`` (weights moved
            between layouts) or ``"reload"`` (a home reloaded or offloaded).
        rank: global rank of the worker.
        step: the training step the driver issued the call for (0: before training — the
            warm-up and the first evaluation).
        start, end: wall-clock seconds (``time.time``) on the worker.
        metrics: the call's numbers (its ``meta_info``: ``time_s``, ``tokens``, losses, ...;
            hooks: ``realloc_reshards``, ``realloc_reshard_seconds``, ``realloc_sent_bytes``,
            ``realloc_received_bytes``, ``realloc_sent_intra_host_bytes`` and
            ``realloc_sent_inter_host_bytes`` (what the rank sent to its own host / other hosts),
            ``realloc_copied_bytes`` (what it copied within itself), ``realloc_skipped`` — calls
            whose kept copy was current).
    """

    mfc: str
    model: str
    kind: str
    interval_kind: str
    rank: int
    step: int
    start: float
    end: float
    metrics: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in RECORD_KINDS:
            raise ValueError(f"record of {self.mfc!r}: kind={self.kind!r}; expected one of {RECORD_KINDS}")
        if self.interval_kind not in INTERVAL_KINDS:
            raise ValueError(
                f"record of {self.mfc!r}: interval_kind={self.interval_kind!r}; expected one of {INTERVAL_KINDS}"
            )
        if self.step < 0:
            raise ValueError(f"record of {self.mfc!r}: step={self.step}; expected >= 0")
        if self.end < self.start:
            raise ValueError(
                f"record of {self.mfc!r} on rank {self.rank} ends ({self.end}) before it starts ({self.start})"
            )

    @property
    def seconds(self) -> float:
        """Wall-clock duration on the worker."""
        return self.end - self.start


@dataclass(frozen=True)
class CallProfiler:
    """Which calls a worker runs under ``torch.profiler``, and where their traces go.

    Attributes:
        calls: MFC names to profile.
        steps: the training steps (a call's ``step``) at which they are profiled.
        directory: where each rank writes ``step{N}_{mfc}_rank{R}.json`` (a Chrome trace).
    """

    calls: frozenset[str]
    steps: frozenset[int]
    directory: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "calls", frozenset(self.calls))
        object.__setattr__(self, "steps", frozenset(self.steps))

    @contextmanager
    def profile(self, mfc: str, step: int, rank: int, device: torch.device) -> Iterator[None]:
        """Runs the body under the torch profiler (CPU, and CUDA on a GPU) when ``mfc`` at ``step``
        is chosen, then writes its Chrome trace; otherwise runs it as it is."""
        if mfc not in self.calls or step not in self.steps:
            yield
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch.profiler.profile(activities=activities, record_shapes=True, with_stack=False) as prof:
            yield
        os.makedirs(self.directory, exist_ok=True)
        prof.export_chrome_trace(os.path.join(self.directory, f"step{step}_{mfc}_rank{rank}.json"))


def call_error(mfc: str, model: str, kind: str, rank: int, error: Exception) -> TaskError:
    """The error a worker raises (``from error``) when a call or hook of ``mfc`` fails.

    >>> str(call_error("reward_inf", "reward", "call", 1, ValueError("bad answer")))
    'reward_inf (model reward) on rank 1: ValueError: bad answer'
    >>> str(call_error("actor_gen", "actor", "pre_call", 0, KeyError("w")))
    "actor_gen pre_call (model actor) on rank 0: KeyError: 'w'"
    """
    what = mfc if kind == "call" else f"{mfc} {kind}"
    return TaskError(f"{what} (model {model}) on rank {rank}: {type(error).__name__}: {error}")
