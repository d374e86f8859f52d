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

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import PretrainedConfig

from rlflow.engine.packing import position_ids_from_mask
from rlflow.parallel.layout import LAYOUT_STYLES
from rlflow.protocol import DataProto
from rlflow.strategy import ParallelStrategy

if TYPE_CHECKING:
    from rlflow.parallel.executor import ParamViews

__all__ = [
    "PERSISTENCE",
    "PER_CALL",
    "PER_PROCESS",
    "ROLLOUT_OUTPUT_KEYS",
    "Prompts",
    "RolloutBuild",
    "RolloutCapabilities",
    "RolloutEngine",
    "SamplingParams",
    "SleepsBetweenCalls",
    "assemble_rollout",
    "get_rollout_engine",
    "list_episode_engines",
    "list_rollout_engines",
    "register_rollout_engine",
    "split_prompts",
    "stop_sequence_end",
    "truncate_at_stop_sequences",
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
        stop_sequences: a row finishes once its last sampled ids are one of these sequences (kept in
            the response), from its ``min_new_tokens``-th token on; what a multi-turn turn ends on at
            a tool call's closing tag. The built-in sampler on one pipeline stage checks them while
            decoding, the vLLM engine cuts its rows after the fact (:func:`truncate_at_stop_sequences`);
            the pipelined sampler refuses them.
        min_new_tokens: the stop tokens are kept out of the choice of a row's first this many
            tokens (HF's ``min_new_tokens``, vLLM's ``min_tokens``); ``old_logp`` stays the
            model's own log-prob of the chosen token, which training recomputes.
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
    stop_sequences: tuple[tuple[int, ...], ...] = field(default=())
    min_new_tokens: int = 0
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
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens={self.min_new_tokens} must be in [0, max_new_tokens={self.max_new_tokens}]"
            )
        stop = tuple(int(t) for t in self.stop_token_ids)
        if any(t < 0 for t in stop):
            raise ValueError(f"stop_token_ids={stop} must be non-negative token ids")
        object.__setattr__(self, "stop_token_ids", stop)
        sequences = tuple(tuple(int(t) for t in seq) for seq in self.stop_sequences)
        if any(not seq or min(seq) < 0 for seq in sequences):
            raise ValueError(f"stop_sequences={sequences} must be non-empty sequences of non-negative token ids")
        object.__setattr__(self, "stop_sequences", sequences)


# How long an engine lives (RolloutEngine.persistence).
PER_CALL = "per_call"  # built for a call from the worker's current copy, freed after it unless copies are kept
PER_PROCESS = "per_process"  # built once per process and (model, layout), kept between calls
PERSISTENCE = (PER_CALL, PER_PROCESS)


@dataclass(frozen=True)
class RolloutCapabilities:
    """Which parallel strategies an engine generates with; WorkerSetup and the planner read them.

    Args:
        dp: data parallel (ranks sample their own rows).
        tp: tensor parallel.
        pp: pipeline parallel.
        spans_world: a generate call must use every worker of the pool (``dp*tp*pp`` equal to
            the ``torch.distributed`` world), e.g. vLLM's external launcher builds its groups over
            the whole world.
        shared_layout: all generate calls share one layout (one engine instance per process), so
            the planner ties the generate calls of a model to one layout.
        graph_decode: on GPUs its decode step replays a captured CUDA graph (vLLM), so the host
            launches no kernels per layer: the planner prices no per-layer dispatch
            (``ClusterSpec.decode_layer_dispatch_s``) for its decode steps.
    """

    dp: bool = True
    tp: bool = True
    pp: bool = False
    spans_world: bool = False
    shared_layout: bool = False
    graph_decode: bool = False

    def unsupported(self, strategy: ParallelStrategy, world_size: int | None = None) -> str | None:
        """Why ``strategy`` cannot generate with this engine (in a pool of ``world_size`` workers,
        when given); ``None`` when it can.

        >>> RolloutCapabilities().unsupported(ParallelStrategy(pp=2))
        'pp=2 (no pipeline-parallel generation)'
        """
        for axis, size, allowed in (
            ("dp", strategy.dp, self.dp),
            ("tp", strategy.tp, self.tp),
            ("pp", strategy.pp, self.pp),
        ):
            if size > 1 and not allowed:
                kind = {"dp": "data", "tp": "tensor", "pp": "pipeline"}[axis]
                return f"{axis}={size} (no {kind}-parallel generation)"
        if self.spans_world and world_size is not None and strategy.world_size != world_size:
            return f"{strategy} on {strategy.world_size} of {world_size} workers (generation spans every worker)"
        return None

    def supports(self, strategy: ParallelStrategy, world_size: int | None = None) -> bool:
        """Whether ``strategy`` can generate with this engine (:meth:`unsupported` gives why not)."""
        return self.unsupported(strategy, world_size) is None


@dataclass(frozen=True, kw_only=True)
class RolloutBuild:
    """What a worker hands :meth:`RolloutEngine.build` for one model on one generate layout.

    Args:
        config: the model's HF config.
        device_mesh: this call's torch mesh with dims ``("pp", "dp", "tp")``; None for one process.
        device: this rank's device.
        dtype: the model's compute dtype (``models.<role>.dtype``): the copy's weights, and the
            generation's activations and KV cache, are held in it (the reshard casts into it).
        pad_token_id: written after a row's stop token; None: the config's, else 0.
        seed: the run's base seed.
        memory_fraction: the share of each device's memory an engine that
            :attr:`~RolloutEngine.holds_memory_fraction` takes while it generates.
        num_micro_batches: the generate call's ``MFCDef.n_mbs`` — micro-batches of prompts per
            call on each dp rank, as the planner prices them; None: the engine's own choice. An
            engine that schedules its own batches (vLLM) may ignore it.
    """

    config: PretrainedConfig
    device_mesh: DeviceMesh | None
    device: torch.device
    dtype: torch.dtype
    pad_token_id: int | None = None
    seed: int = 0
    memory_fraction: float = 0.5
    num_micro_batches: int | None = None


@runtime_checkable
class RolloutEngine(Protocol):
    """What the workers, WorkerSetup, the config and the planner use of a rollout engine.

    **Declarations** (class level; :func:`register_rollout_engine` checks them). Every place that
    treats engines differently reads these, never the engine's name or type:

    * :attr:`layout_style` — the ``build_layout`` style of the weights it generates with:
      ``"hf"``, a plain HF module resharded to the call's tensor-parallel layout; ``"vllm"``,
      vLLM's own fused tensor-parallel parameters;
    * :meth:`weight_target` — what the reshard executor writes: an ``nn.Module`` of that layout,
      or a :class:`~rlflow.parallel.executor.ParamViews` (views into the engine's parameters);
    * :attr:`persistence` — :data:`PER_CALL` (built for each call from the worker's current copy)
      or :data:`PER_PROCESS` (built once per process, model and layout; kept);
    * :attr:`can_sleep` — between calls it frees its memory with ``sleep()`` (the weights kept
      on the host, so a current copy needs no push) and wakes itself in :meth:`generate` and
      :meth:`weight_target`; such an engine also has ``wake_up()`` (:class:`SleepsBetweenCalls`);
    * :attr:`capabilities` — the strategies it generates with (:class:`RolloutCapabilities`);
    * :meth:`available` / :meth:`supports_device` — what it needs from the platform;
    * :attr:`weight_dtype`, :attr:`holds_memory_fraction` — its memory, as the planner prices it.

    **Calls.** Built by :meth:`build` on every rank of a generate call's mesh; every rank runs
    :meth:`generate` on its dp shard of the prompts; tp peers receive the same prompts and return
    the same responses.
    """

    layout_style: ClassVar[str]
    persistence: ClassVar[str]
    can_sleep: ClassVar[bool]
    capabilities: ClassVar[RolloutCapabilities]
    weight_dtype: ClassVar[torch.dtype | None]
    """The dtype it generates with; None: the dtype of the copy it is given (:attr:`RolloutBuild.dtype`)."""
    holds_memory_fraction: ClassVar[bool]
    """It takes :attr:`RolloutBuild.memory_fraction` of each device's memory while it generates
    (weights + KV cache), whatever the batch needs."""

    @classmethod
    def available(cls) -> bool:
        """Whether this process can build the engine (e.g. its package is importable)."""
        ...

    @classmethod
    def supports_device(cls, device_type: str) -> bool:
        """Whether it generates on workers whose device type is ``device_type`` (``"cpu"``, ``"cuda"``)."""
        ...

    @classmethod
    def build(cls, spec: RolloutBuild) -> RolloutEngine:
        """The engine a worker builds for one model on one generate layout, before the weights arrive."""
        ...

    def weight_target(self) -> nn.Module | ParamViews:
        """What the reshard executor writes the model's weights into (in :attr:`layout_style`)."""
        ...

    @property
    def module(self) -> nn.Module:
        """The model it generates with."""
        ...

    @property
    def pad_token_id(self) -> int:
        """The token written after a row's end (what rows built beside its own are padded with)."""
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


@runtime_checkable
class SleepsBetweenCalls(Protocol):
    """The methods of an engine that declares ``can_sleep``."""

    def sleep(self) -> None:
        """Free the engine's device memory until it is used again; the weights are kept (on the host)."""
        ...

    def wake_up(self) -> None:
        """Take back what :meth:`sleep` freed; a no-op on an awake engine."""
        ...


_ENGINES: dict[str, type[RolloutEngine]] = {}
_DECLARATIONS = (
    "layout_style",
    "persistence",
    "can_sleep",
    "capabilities",
    "weight_dtype",
    "holds_memory_fraction",
    "available",
    "supports_device",
    "build",
    "weight_target",
    "generate",
    "update_weights",
)


def _check_declarations(name: str, cls: type) -> None:
    missing = [d for d in _DECLARATIONS if not hasattr(cls, d)]
    if missing:
        raise TypeError(f"rollout engine {name!r} ({cls.__qualname__}) does not declare {missing}")
    if cls.layout_style not in LAYOUT_STYLES:
        raise ValueError(f"rollout engine {name!r}: layout_style={cls.layout_style!r}; expected one of {LAYOUT_STYLES}")
    if cls.persistence not in PERSISTENCE:
        raise ValueError(f"rollout engine {name!r}: persistence={cls.persistence!r}; expected one of {PERSISTENCE}")
    if not isinstance(cls.capabilities, RolloutCapabilities):
        raise TypeError(f"rollout engine {name!r}: capabilities={cls.capabilities!r} is not a RolloutCapabilities")
    if cls.weight_dtype is not None and not isinstance(cls.weight_dtype, torch.dtype):
        raise TypeError(f"rollout engine {name!r}: weight_dtype={cls.weight_dtype!r}; expected a torch.dtype or None")
    if cls.can_sleep and not issubclass(cls, SleepsBetweenCalls):
        raise TypeError(f"rollout engine {name!r} declares can_sleep but lacks sleep() / wake_up()")


def register_rollout_engine(name: str) -> Callable[[type], type]:
    """Class decorator adding a rollout engine under ``name``, after checking its declarations.

    >>> @register_rollout_engine("my_engine")  # doctest: +SKIP
    ... class MyEngine(HFRolloutEngine):
    ...     persistence = PER_PROCESS

    Raises:
        ValueError: ``name`` is already registered, or a declaration has a value outside its choices.
        TypeError: a declaration (:class:`RolloutEngine`) is missing or of the wrong type.
    """

    def decorate(cls: type) -> type:
        if name in _ENGINES:
            raise ValueError(
                f"rollout engine {name!r} is already registered (by {_ENGINES[name].__qualname__}); "
                f"registered: {list_rollout_engines()}"
            )
        _check_declarations(name, cls)
        _ENGINES[name] = cls
        return cls

    return decorate


def get_rollout_engine(name: str) -> type[RolloutEngine]:
    """The engine class registered as ``name``.

    >>> get_rollout_engine("hf").persistence
    'per_call'

    Raises:
        KeyError: unknown ``name`` (the message lists the registered names).
    """
    if name not in _ENGINES:
        raise KeyError(f"unknown rollout engine {name!r}; registered: {list_rollout_engines()}")
    return _ENGINES[name]


def list_rollout_engines() -> list[str]:
    """Names of the registered rollout engines, sorted."""
    return sorted(_ENGINES)


def list_episode_engines() -> list[str]:
    """Names of the registered rollout engines that run multi-turn episodes (a ``generate_episodes``
    method, :mod:`rlflow.engine.rollout.multi_turn`), sorted."""
    return sorted(name for name, cls in _ENGINES.items() if getattr(cls, "generate_episodes", None) is not None)


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


def stop_sequence_end(ids: Sequence[int], sequences: Sequence[Sequence[int]], first: int = 0) -> int | None:
    """Index of the token of ``ids`` that first completes one of ``sequences`` at or after index
    ``first``, else None; a sequence matches only within ``ids`` (token ids, not text).

    >>> stop_sequence_end([5, 1, 2, 9, 1, 2], [(1, 2)], first=3)
    5
    """
    seqs = [tuple(s) for s in sequences]
    for end in range(first, len(ids)):
        if any(len(s) <= end + 1 and tuple(ids[end + 1 - len(s) : end + 1]) == s for s in seqs):
            return end
    return None


def truncate_at_stop_sequences(
    responses: torch.Tensor, response_mask: torch.Tensor, old_logp: torch.Tensor, params: SamplingParams,
    pad_token_id: int,
) -> None:  # fmt: skip
    """Ends each row after the first of ``params.stop_sequences`` its sampled ids complete, in place:
    the tokens after it become ``pad_token_id`` with mask 0 and log-prob 0.

    For an engine that cannot stop on token-id sequences while decoding (vLLM: its ``stop`` is text
    and its ``stop_token_ids`` single tokens), applied to responses sampled without them. The rows
    are then what the built-in sampler's check after each step gives for the same draws: a sequence
    counts from token ``min_new_tokens`` on and only within the response, the tokens up to and
    including it are kept.

    Args:
        responses, response_mask, old_logp: ``(B, R)``, each row's sampled tokens first (mask 1).
        params: the stop sequences and ``min_new_tokens``.
        pad_token_id: written after a row's end.
    """
    if not params.stop_sequences:
        return
    first = min(params.min_new_tokens, params.max_new_tokens)
    for row in range(responses.shape[0]):
        length = int(response_mask[row].sum())
        end = stop_sequence_end(responses[row, :length].tolist(), params.stop_sequences, first)
        if end is not None:
            responses[row, end + 1 :] = pad_token_id
            response_mask[row, end + 1 :] = 0
            old_logp[row, end + 1 :] = 0.0
