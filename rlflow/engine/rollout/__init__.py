"""Rollout engines: sample responses from a policy.

Importing this package registers the built-in engines: ``"hf"`` (own KV-cache sampling
loop over any HF causal LM; CPU or GPU; dp × tp × pp, pp pipelined over micro-batches; built
per call) and ``"vllm"`` (GPU; built once per process and asleep between calls; vLLM imported
only when the engine is built).
Workers, config and planner read an engine's declarations (:class:`RolloutEngine`), never its
name; a new engine is a class registered with :func:`register_rollout_engine`.

>>> from rlflow.engine.rollout import get_rollout_engine, SamplingParams  # doctest: +SKIP
>>> engine = get_rollout_engine("hf")(model, device_mesh)  # doctest: +SKIP
"""

from __future__ import annotations

from rlflow.engine.rollout.base import (
    PER_CALL,
    PER_PROCESS,
    PERSISTENCE,
    ROLLOUT_OUTPUT_KEYS,
    Prompts,
    RolloutBuild,
    RolloutCapabilities,
    RolloutEngine,
    SamplingParams,
    SleepsBetweenCalls,
    assemble_rollout,
    get_rollout_engine,
    list_episode_engines,
    list_rollout_engines,
    register_rollout_engine,
    split_prompts,
)
from rlflow.engine.rollout.hf_sampler import HFRolloutEngine, sample_responses
from rlflow.engine.rollout.vllm_engine import VLLMRolloutEngine

__all__ = [
    "PERSISTENCE",
    "PER_CALL",
    "PER_PROCESS",
    "ROLLOUT_OUTPUT_KEYS",
    "HFRolloutEngine",
    "Prompts",
    "RolloutBuild",
    "RolloutCapabilities",
    "RolloutEngine",
    "SamplingParams",
    "SleepsBetweenCalls",
    "VLLMRolloutEngine",
    "assemble_rollout",
    "get_rollout_engine",
    "list_episode_engines",
    "list_rollout_engines",
    "register_rollout_engine",
    "sample_responses",
    "split_prompts",
]
