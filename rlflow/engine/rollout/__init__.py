"""Rollout engines: sample responses from a policy.

Importing this package registers the built-in engines: ``"hf"`` (own KV-cache sampling
loop over any HF causal LM; CPU or GPU; dp × tp) and ``"vllm"`` (GPU; vLLM imported only
when the engine is built).

>>> from rlflow.engine.rollout import build_rollout_engine, SamplingParams  # doctest: +SKIP
>>> engine = build_rollout_engine("hf", model, device_mesh)  # doctest: +SKIP
"""

from __future__ import annotations

from rlflow.engine.rollout.base import (
    ROLLOUT_CAPABILITIES,
    ROLLOUT_OUTPUT_KEYS,
    Prompts,
    RolloutCapabilities,
    RolloutEngine,
    SamplingParams,
    assemble_rollout,
    build_rollout_engine,
    register_rollout_engine,
    rollout_engine_names,
    split_prompts,
)
from rlflow.engine.rollout.hf_sampler import HFRolloutEngine, sample_responses
from rlflow.engine.rollout.vllm_engine import VLLMRolloutEngine

__all__ = [
    "ROLLOUT_CAPABILITIES",
    "ROLLOUT_OUTPUT_KEYS",
    "HFRolloutEngine",
    "Prompts",
    "RolloutCapabilities",
    "RolloutEngine",
    "SamplingParams",
    "VLLMRolloutEngine",
    "assemble_rollout",
    "build_rollout_engine",
    "register_rollout_engine",
    "rollout_engine_names",
    "sample_responses",
    "split_prompts",
]
