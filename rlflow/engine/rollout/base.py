"""The rollout-engine interface: sampling parameters, the engine protocol and its registry.

A rollout engine turns left-padded prompts into sampled responses. Every engine returns the
same tensors, so the trainer and the losses never know which one ran:

==================  ===========  ===================================================================
key                 shape        meaning
==================  ===========  ===================================================================
``prompts``         (B*n, P)     the prompt ids, left-padded, each prompt repeated ``n`` times
``responses``       (B*n, R)     sampled ids, right-padded with the pad id; ``R = max_new_tokens``
``response_mask``   (B*n, R)     1 for generated tokens (a stop token included), 0 after the stop
``input_ids``       (B*n, P+R)   ``prompts`` then ``responses``
``attention_mask``  (B*n, P+R)   prompt mask then ``response_mask``
``position_ids``    (B*n, P+R)   position of each token counted over real tokens (pads: 0)
``old_logp``        (B*n, R)     float32 log-prob of each sampled token, 0 where masked
==================  ===========  ===================================================================

Rows are interleaved: row ``i*n + j`` is sample ``j`` of prompt ``i`` (GRPO groups are
consecutive). ``R`` is always ``max_new_tokens`` — not the longest response — so results of
dp ranks that stopped early still concatenate.

**Which log-probs.** ``old_logp`` is ``log_softmax(logits / temperature)`` at the sampled token
over the *full* vocabulary, before top-k/top-p filtering (verl's convention): it is exactly
what the training engine recomputes for the policy at the same temperature, so the PPO ratio
starts at 1. It is not the probability of the filtered distribution the token was drawn from.
Greedy decoding ignores temperature/top-k/top-p and reports ``log_softmax(logits)``
(temperature 1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from rlflow.engine.packing import position_ids_from_mask
from rlflow.protocol import DataProto
from rlflow.strategy import ParallelStrategy

__all__ = [
    "ROLLOUT_CAPABILITIES",
    "ROLLOUT_OUTPUT_KEYS",
    "RolloutCapabilities",
    "RolloutEngine",
    "SamplingParams",
    "Prompts",
    "assemble_rollout",
    "build_rollout_engine",
    "register_rollout_engine",
    "rollout_engine_names",
    "split_prompts",
]

ROLLOUT_OUTPUT_KEYS = (
    "prompts",
    "responses",
    "response_mask",
    "input_ids",
    "attention_mask",
    "position_ids",
    "old_logp",
)

Prompts = DataProto | tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to sample responses.

    Args:
        temperature: logits are divided by it before sampling and for ``old_logp``; > 0.
        top_p: nucleus sampling: keep the smallest set of tokens whose probability reaches
            ``top_p``; 1.0 disables it.
        top_k: keep the ``top_k`` most likely tokens; 0 disables it.
        n: samples per prompt.
        max_new_tokens: response length ``R``.
        stop_token_ids: a row finishes after emitting one of these (it is kept in the response).
        greedy: take the argmax instead of sampling; temperature/top-p/top-k are then ignored
            and ``old_logp`` is at temperature 1.
        seed: makes sampling reproducible; engines derive a per-dp-rank seed from it. None
            draws a fresh seed.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = field(default=())
    greedy: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (use greedy=True for argmax decoding)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 disables top-k)")
        if self.n < 1:
            raise ValueError(f"n={self.n} samples per prompt must be >= 1")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        stop = tuple(int(t) for t in self.stop_token_ids)
        if any(t < 0 for t in stop):
            raise ValueError(f"stop_token_ids={stop} must be non-negative token ids")
        object.__setattr__(self, "stop_token_ids", stop)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the rollout worker calls. Built once per (model, layout) on every rank of the call.

    Every rank of the call's mesh runs :meth:`generate` on its dp shard of the prompts; tp
    peers receive the same prompts and return the same responses.
    """

    @property
    def module(self) -> nn.Module:
        """The model whose parameters the reshard executor writes (in this engine's layout)."""
        ...

    def generate(self, prompts: Prompts, params: SamplingParams) -> DataProto | dict[str, torch.Tensor]:
        """Sample ``params.n`` responses per prompt.

        Args:
            prompts: a DataProto with ``input_ids`` and ``attention_mask`` (``(B, P)``,
                left-padded; other columns are repeated along with the prompts), or the
                tuple ``(input_ids, attention_mask)``.
            params: sampling parameters.

        Returns:
            The keys of :data:`ROLLOUT_OUTPUT_KEYS` (module docstring): a DataProto when given
            one, else a dict of tensors.
        """
        ...

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> None:
        """Overwrite parameters in place by HF name (full tensors or this rank's shards)."""
        ...


@dataclass(frozen=True)
class RolloutCapabilities:
    """Which parallel strategies an engine runs, for the planner's generate options.

    Args:
        dp: data parallel (every engine: ranks sample their own rows).
        tp: tensor parallel.
        pp: pipeline parallel.
        requires_gpu: the engine cannot run on CPU workers.
        spans_world: a generate call must use every worker of the pool (``dp*tp*pp`` equal to
            the ``torch.distributed`` world): vLLM's external launcher builds its groups over the
            whole world.
    """

    dp: bool = True
    tp: bool = True
    pp: bool = False
    requires_gpu: bool = False
    spans_world: bool = False

    def supports(self, strategy: ParallelStrategy, *, on_gpu: bool = True, world_size: int | None = None) -> bool:
        """Whether ``strategy`` can generate with this engine (on GPUs or not; in a pool of
        ``world_size`` workers, when given)."""
        if self.requires_gpu and not on_gpu:
            return False
        if self.spans_world and world_size is not None and strategy.world_size != world_size:
            return False
        return (strategy.dp == 1 or self.dp) and (strategy.tp == 1 or self.tp) and (strategy.pp == 1 or self.pp)


_ENGINES: dict[str, Callable[..., RolloutEngine]] = {}
ROLLOUT_CAPABILITIES: dict[str, RolloutCapabilities] = {}


def register_rollout_engine(name: str, capabilities: RolloutCapabilities | None = None) -> Callable[[type], type]:
    """Class decorator adding a rollout engine under ``name``.

    >>> @register_rollout_engine("my_engine")  # doctest: +SKIP
    ... class MyEngine: ...

    Raises:
        ValueError: ``name`` is already registered.
    """

    def decorate(cls: type) -> type:
        if name in _ENGINES:
            raise ValueError(f"rollout engine {name!r} is already registered (by {_ENGINES[name].__qualname__})")
        _ENGINES[name] = cls
        ROLLOUT_CAPABILITIES[name] = capabilities or RolloutCapabilities()
        return cls

    return decorate


def rollout_engine_names() -> list[str]:
    return sorted(_ENGINES)


def build_rollout_engine(name: str, *args: Any, **kwargs: Any) -> RolloutEngine:
    """Construct the engine registered as ``name`` with the given arguments.

    Raises:
        KeyError: unknown ``name`` (the message lists the registered names).
    """
    if name not in _ENGINES:
        raise KeyError(f"unknown rollout engine {name!r}; registered: {rollout_engine_names()}")
    return _ENGINES[name](*args, **kwargs)


def split_prompts(prompts: Prompts) -> tuple[torch.Tensor, torch.Tensor, DataProto | None]:
    """Validated ``(input_ids, attention_mask, source DataProto or None)`` of a generate call.

    Raises:
        ValueError: shapes differ, the batch is empty, padding is not on the left, or a
            prompt has no token.
    """
    if isinstance(prompts, DataProto):
        missing = [k for k in ("input_ids", "attention_mask") if k not in prompts.batch_keys]
        if missing:
            raise ValueError(f"prompts DataProto lacks {missing}; it has {prompts.batch_keys}")
        input_ids, attention_mask, source = prompts.batch["input_ids"], prompts.batch["attention_mask"], prompts
    else:
        (input_ids, attention_mask), source = prompts, None
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must both be (B, P)"
        )
    if input_ids.shape[0] == 0:
        raise ValueError("no prompts to generate from (batch of 0 rows)")
    mask = attention_mask.long()
    if ((mask[:, 1:] - mask[:, :-1]) < 0).any():
        raise ValueError("prompts must be left-padded: attention_mask rows must look like 0..0 1..1")
    if (mask[:, -1] == 0).any():
        raise ValueError(f"prompt rows {(mask[:, -1] == 0).nonzero().flatten().tolist()} have no token")
    return input_ids, mask, source


def assemble_rollout(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    old_logp: torch.Tensor,
    n: int,
    source: DataProto | None = None,
) -> DataProto | dict[str, torch.Tensor]:
    """Build the output of :meth:`RolloutEngine.generate` (keys in the module docstring).

    Args:
        prompt_ids, prompt_mask: ``(B, P)`` — one row per prompt, not yet repeated.
        responses, response_mask, old_logp: ``(B*n, R)``, interleaved by prompt.
        n: samples per prompt.
        source: the DataProto the prompts came from; its other columns and meta_info are
            repeated/kept in the result.
    """
    prompts = prompt_ids.repeat_interleave(n, dim=0)
    prompt_mask = prompt_mask.repeat_interleave(n, dim=0).to(response_mask.dtype)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    out = {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
        "old_logp": old_logp,
    }
    if source is None:
        return out
    kept = [k for k in source.batch_keys if k not in out]
    rest = source.select(batch_keys=kept).repeat(n, interleave=True)
    return rest.union(DataProto.from_dict(out))
