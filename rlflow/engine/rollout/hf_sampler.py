"""The built-in rollout engine: batched sampling with a KV cache over any HF causal LM.

The decoding loop is our own (not ``model.generate``) so that it returns exactly what RL
needs — response ids, masks and the log-probs of the sampled tokens — and runs the same way
under tensor parallelism:

1. **Prefill** the ``B`` left-padded prompts once, with position ids counted over real
   tokens (a prompt's continuation does not depend on how much padding it got), then repeat
   the KV cache ``n`` times for the ``n`` samples of each prompt.
2. **Decode** one token per step for every unfinished row, feeding the new token with the
   grown attention mask and its position. A row finishes on a stop token (or on a sequence of
   ``params.stop_sequences``); finished rows are
   pruned from the batch (and the cache) once a quarter of the rows have finished, and the
   loop ends when all rows are done or after ``max_new_tokens``.

**Cost per token.** On small models a decode step is dominated by per-op overhead, so the
forward is :class:`~rlflow.engine.rollout.fast_decode.FastDecoder` wherever
:func:`~rlflow.engine.rollout.fast_decode.fast_decode_blocker` allows it: the family's decoder
math on the module's weights with fused projections and a preallocated KV cache, in a fraction
of the ops of HF's modules (docs/benchmarks.md, "Sampler", times both); on small float32 CPU
models its decode steps run in C++, one call a
step (:class:`~rlflow.engine.rollout.native_decode.NativeDecoder`, where
:func:`~rlflow.engine.rollout.native_decode.native_decode_blocker` allows it). Elsewhere (tensor-parallel weights, an unknown family, a rope
type whose angles depend on the sequence length, parameters the family does not name, a
preallocated KV cache beyond half the free GPU memory, or ``fast_decode=False``) the loop runs HF's modules with a ``DynamicCache`` (:class:`_HFDecoder`,
the reason in a debug log), with the masks of all steps built once in the form the model
builds them (:class:`_DecodeMasks`). Both run in ``torch.inference_mode`` (into output buffers
allocated outside it, so training can use them); without stop tokens the outputs are written as
whole columns and the loop never syncs on the host; tokens are drawn by ``torch.multinomial``'s
own algorithm without its per-call validity check (a host sync), so both decoders draw the same
tokens from the same generator.

**Parallelism.** Under dp each rank samples its own rows with a generator seeded from
``(seed, dp_rank)``. Under tp the model is split with
:func:`rlflow.parallel.tensor_parallel.apply_tp` (logits come back replicated); tp rank 0
chooses the tokens and broadcasts them in the tp group, so all tp ranks append the same token
even if their logits differ in the last bit, and all of them stop at the same step (same
number of collectives). Under pp > 1 each rank holds one pipeline stage and the stages pass
activations every decode step over micro-batches of prompts (:mod:`~rlflow.engine.rollout.pipelined`),
drawing the same noise as pp = 1. Greedy decoding gives the same tokens under every (dp, tp, pp).

**Precision.** The sampler computes in the dtype of the module it is given — the workers build
it in the model's compute dtype (``models.<role>.dtype``), so the KV cache is in that dtype too.
Its logits are turned to float32 before the token choice and the log-probs (softmax and
log-softmax over the vocabulary in float32, as the training engine's log-probs are), so a bf16
rollout reports float32 ``old_logp``. The C++ decode step runs float32 only: a bf16 model
decodes with the torch lean decoder.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from transformers import AutoModelForCausalLM, DynamicCache

from rlflow.engine.models import cache_kwarg
from rlflow.engine.packing import position_ids_from_mask
from rlflow.engine.rollout.base import (
    PER_CALL,
    Prompts,
    RolloutBuild,
    RolloutCapabilities,
    SamplingParams,
    assemble_rollout,
    register_rollout_engine,
    split_prompts,
)
from rlflow.engine.rollout.fast_decode import FastDecoder, fast_decode_blocker, kv_cache_bytes
from rlflow.engine.rollout.multi_turn import (
    MultiTurn,
    assemble_episodes,
    episode_metrics,
    episode_rows,
    run_episodes,
)
from rlflow.engine.rollout.native_decode import (
    NativeDecoder,
    native_decode_blocker,
    native_sampling_blocker,
    sample_step,
)
from rlflow.protocol import DataProto

__all__ = ["HFRolloutEngine", "apply_top_k", "apply_top_p", "choose_tokens", "sample_responses", "token_logprobs"]

# Prune finished rows once they are this fraction of the decoding batch: pruning copies the
# whole KV cache, so doing it on every finished row would cost more than it saves.
_PRUNE_FRACTION = 0.25
_MESH_DIMS = ("pp", "dp", "tp")
_log = logging.getLogger(__name__)


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the ``k`` largest logits of each row (ties at the k-th value kept), others ``-inf``.

    Args:
        logits: ``(N, V)``.
        k: tokens kept; 0 or >= V keeps all.
    """
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[:, -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter: keep the most likely tokens until their probability reaches ``p``.

    A token is kept when the probability of the tokens ranked strictly above it is < ``p``,
    so the most likely token always survives.

    Args:
        logits: ``(N, V)`` (already temperature-scaled).
        p: in (0, 1]; 1 keeps all.
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_above = probs.cumsum(dim=-1) - probs
    remove_sorted = mass_above >= p
    remove = remove_sorted.scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def choose_tokens(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next token of each row: argmax when greedy, else temperature → top-k → top-p → sample.

    Args:
        logits: ``(N, V)`` float logits of the next position.
        params: sampling parameters.
        generator: random source for sampling (ignored when greedy or given ``noise``).
        noise: ``(N, V)`` float32 Exp(1) draws to sample with instead of drawing them from
            ``generator`` (pipelined generation draws a whole step's at once, as pp = 1 does, and
            hands each micro-batch its rows); overwritten.

    Returns:
        ``(N,)`` int64 token ids.
    """
    if params.greedy:
        return logits.argmax(dim=-1)
    scaled = logits / params.temperature if params.temperature != 1.0 else logits  # x / 1 is x: skip the op
    probs = apply_top_p(apply_top_k(scaled, params.top_k), params.top_p).softmax(dim=-1)
    # torch.multinomial's own algorithm for one sample (ATen's Distributions.cpp: argmax of p / q,
    # q ~ Exp(1) from the generator), so the same draws and tokens, without its validity checks,
    # whose host sync costs more than the draw (sample_responses checks the log-probs once instead).
    if noise is None:
        noise = torch.empty_like(probs).exponential_(generator=generator)
    return torch.div(probs, noise, out=noise).argmax(dim=-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(logits / temperature)[token]`` over the full vocabulary (see rollout.base).

    Args:
        logits: ``(N, V)``; tokens: ``(N,)``.

    Returns:
        ``(N,)`` float32.
    """
    logits = logits.float()
    logp = torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _next_logits(model: nn.Module, cache_name: str, cache: DynamicCache, **inputs: torch.Tensor | None) -> torch.Tensor:
    """``(N, V)`` float32 logits of the last position, extending ``cache``."""
    out = model(**inputs, **{cache_name: cache}, use_cache=True, logits_to_keep=1)
    logits = out.logits[:, -1]
    if isinstance(logits, DTensor):  # a head left vocabulary-sharded: gather the full vocabulary
        logits = logits.full_tensor()
    return logits.float()


def _choose_synced(logits, params, generator, tp_group) -> torch.Tensor:
    """:func:`choose_tokens` on tp rank 0, broadcast to the other tp ranks."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return choose_tokens(logits, params, generator)
    if dist.get_rank(tp_group) == 0:
        tokens = choose_tokens(logits, params, generator)
    else:
        tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    dist.broadcast(tokens, group=tp_group, group_src=0)
    return tokens


def _mask_kind(model: nn.Module, total_len: int) -> str:
    """``"sdpa"`` or ``"eager"`` when the decode masks can be built once here rather than by the
    model at every step, else ``"hf"``.

    They can when every layer attends causally over the whole sequence — full attention, or a
    sliding window at least as long as ``total_len`` — through sdpa or eager attention, whose
    per-step mask is just the padding mask (bool for sdpa, additive for eager). Other
    attention kinds (flash, flex, chunked or linear layers) get a 2-D mask and build their own.
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    kind = getattr(config, "_attn_implementation", None)
    if kind not in ("sdpa", "eager"):
        return "hf"
    if set(getattr(config, "layer_types", None) or ()) - {"full_attention", "sliding_attention"}:
        return "hf"
    window = getattr(config, "sliding_window", None)
    return kind if window is None or total_len <= window else "hf"


class _DecodeMasks:
    """Attention masks of all decode steps, allocated once; step ``s`` takes a view of them.

    Building the mask inside the model costs about half a decoder layer per step at small sizes,
    so where :func:`_mask_kind` allows it the masks are what the model would have built:
    sdpa gets the bool padding mask ``(N, 1, 1, P+R)`` (None when no row has padding, which is
    what sdpa sees from the model then), eager the additive one. Otherwise the model gets the
    2-D ``(N, P+R)`` mask and builds its own.

    Args:
        model: the model being decoded (its config picks the mask kind).
        prompt_mask: ``(N, P)`` prompt attention mask of the decoding rows.
        max_new_tokens: ``R``.
    """

    def __init__(self, model: nn.Module, prompt_mask: torch.Tensor, max_new_tokens: int):
        num_rows, prompt_len = prompt_mask.shape
        self._prompt_len = prompt_len
        self._prompt_mask = prompt_mask.bool()
        full = torch.cat([self._prompt_mask, self._prompt_mask.new_ones(num_rows, max_new_tokens)], dim=1)
        self._kind = _mask_kind(model, full.shape[1])
        if self._kind == "sdpa":
            self._mask = full[:, None, None, :]
        elif self._kind == "eager":
            dtype = next(model.parameters()).dtype
            additive = torch.zeros(full.shape, dtype=dtype, device=full.device)
            self._mask = additive.masked_fill_(~full, torch.finfo(dtype).min)[:, None, None, :]
        else:
            self._mask = full.long()
        self._no_padding = bool(self._prompt_mask.all())

    def select(self, keep: torch.Tensor) -> None:
        """Keep only the rows ``keep`` (indices into the current rows)."""
        self._mask, self._prompt_mask = self._mask[keep], self._prompt_mask[keep]
        self._no_padding = bool(self._prompt_mask.all())

    def step(self, step: int) -> torch.Tensor | None:
        """The mask of decode step ``step``: prompt plus ``step + 1`` response tokens."""
        if self._kind == "sdpa" and self._no_padding:
            return None
        return self._mask[..., : self._prompt_len + step + 1]


def sample_responses(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    params: SamplingParams,
    *,
    pad_token_id: int,
    generator: torch.Generator | None = None,
    tp_group: dist.ProcessGroup | None = None,
    fast_decode: bool = True,
    native_decode: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample ``params.n`` responses per prompt with a KV cache (module docstring).

    Args:
        model: an HF causal LM (plain or split by ``apply_tp``) on the inputs' device.
        input_ids: ``(B, P)`` left-padded prompt ids.
        attention_mask: ``(B, P)``.
        params: sampling parameters.
        pad_token_id: written into responses after a row's stop token.
        generator: random source (used on tp rank 0 only).
        tp_group: the tensor-parallel group when the model is split; every rank of it calls
            this function with the same prompts.
        fast_decode: decode with :class:`~rlflow.engine.rollout.fast_decode.FastDecoder` where
            :func:`~rlflow.engine.rollout.fast_decode.fast_decode_blocker` allows it; False
            always decodes through HF's modules.
        native_decode: run the lean decoder's steps in C++
            (:class:`~rlflow.engine.rollout.native_decode.NativeDecoder`) where
            :func:`~rlflow.engine.rollout.native_decode.native_decode_blocker` allows it, and each
            step's token choice and bookkeeping too
            (:func:`~rlflow.engine.rollout.native_decode.sample_step`, where
            :func:`~rlflow.engine.rollout.native_decode.native_sampling_blocker` allows it, whatever
            the decoder); False keeps both in torch.

    Returns:
        ``(responses, response_mask, old_logp)``, each ``(B*n, R)`` with rows interleaved by
        prompt; int64, int64, float32. Ordinary tensors (not inference tensors), so training
        may use them.
    """
    num_rows, max_new, device = input_ids.shape[0] * params.n, params.max_new_tokens, input_ids.device
    with torch.no_grad():  # outside inference mode: the outputs must be usable by autograd later
        responses = torch.full((num_rows, max_new), pad_token_id, dtype=torch.long, device=device)
        response_mask = torch.zeros((num_rows, max_new), dtype=torch.long, device=device)
        old_logp = torch.zeros((num_rows, max_new), dtype=torch.float32, device=device)
    with torch.inference_mode():
        _decode(
            model, input_ids, attention_mask, params, pad_token_id, generator, tp_group, responses, response_mask,
            old_logp, fast_decode, native_decode,
        )  # fmt: skip
    if bool(torch.isnan(old_logp).any()):  # choose_tokens draws without torch.multinomial's checks
        raise ValueError("sample_responses: the model's logits contain NaN (see old_logp)")
    return responses, response_mask, old_logp


def _decode(
    model, input_ids, attention_mask, params, pad_token_id, generator, tp_group, responses, response_mask, old_logp,
    fast_decode, native_decode,
) -> None:  # fmt: skip
    """The prefill and decoding loop of :func:`sample_responses`, writing its three outputs in place."""
    max_new, num_rows, device = params.max_new_tokens, responses.shape[0], input_ids.device
    temperature = 1.0 if params.greedy else params.temperature
    decoder = _decoder(model, num_rows, input_ids.shape[1] + max_new, max_new, tp_group, fast_decode, native_decode)
    logits = decoder.prefill(input_ids, attention_mask, params.n)
    start = min(params.min_new_tokens, max_new) if params.stop_token_ids else 0
    if start:
        logits = _decode_unstoppable(decoder, logits, params, generator, tp_group, responses, old_logp, start)
        response_mask[:, :start] = 1
        if start == max_new:
            return
    sequences = _StopSequences(params, responses.device) if params.stop_sequences else None
    if native_decode and native_sampling_blocker(logits, params, tp_group) is None:
        _native_sampling_loop(
            decoder, logits, params, pad_token_id, generator, responses, response_mask, old_logp, start, sequences
        )  # fmt: skip
        return
    if sequences is None and not params.stop_token_ids:  # every row decodes every step: column writes, no syncs
        for step in range(max_new):
            tokens = _choose_synced(logits, params, generator, tp_group)
            responses[:, step] = tokens
            old_logp[:, step] = token_logprobs(logits, tokens, temperature)
            if step == max_new - 1:
                break
            logits = decoder.step(tokens, step)
        response_mask.fill_(1)
        return

    stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=device)
    rows = torch.arange(num_rows, device=device)  # output row of each decoding row
    alive = torch.ones(num_rows, dtype=torch.bool, device=device)
    for step in range(start, max_new):
        tokens = _choose_synced(logits, params, generator, tp_group)
        # Finished rows not yet pruned keep decoding; their outputs stay pad / 0 here.
        responses[rows, step] = torch.where(alive, tokens, pad_token_id)
        response_mask[rows, step] = alive.long()
        old_logp[rows, step] = token_logprobs(logits, tokens, temperature).masked_fill_(~alive, 0.0)
        alive &= ~torch.isin(tokens, stop_ids)
        if sequences is not None:
            alive &= ~sequences.ended(responses, rows, step)
        num_alive = int(alive.sum())
        if num_alive == 0 or step == max_new - 1:
            break
        logits, rows, alive = _advance(decoder, tokens, rows, alive, num_alive, step)


def _decode_unstoppable(decoder, logits, params, generator, tp_group, responses, old_logp, steps: int):
    """The first ``steps`` tokens of every row (``min_new_tokens``), the stop tokens kept out of the
    choice; ``old_logp`` is the model's log-prob of each token, unmasked. The next logits."""
    temperature = 1.0 if params.greedy else params.temperature
    stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=logits.device)
    for step in range(steps):
        tokens = _choose_synced(logits.index_fill(-1, stop_ids, float("-inf")), params, generator, tp_group)
        responses[:, step] = tokens
        old_logp[:, step] = token_logprobs(logits, tokens, temperature)
        if step == params.max_new_tokens - 1:
            break
        logits = decoder.step(tokens, step)
    return logits


def _native_sampling_loop(
    decoder, logits, params, pad_token_id, generator, responses, response_mask, old_logp, start: int = 0,
    sequences: _StopSequences | None = None,
) -> None:  # fmt: skip
    """The decoding loop above with each step's choice, outputs and stop-token checks in one C++ call
    (:func:`~rlflow.engine.rollout.native_decode.sample_step`): the same draws from ``generator``,
    the same tokens, outputs and pruning. Stop sequences are checked after the call, on the outputs."""
    num_rows, max_new = responses.shape
    stop_ids = np.asarray(params.stop_token_ids, dtype=np.int64)
    rows = torch.arange(num_rows)  # output row of each decoding row
    alive = torch.ones(num_rows, dtype=torch.bool)
    for step in range(start, max_new):
        tokens, num_alive = sample_step(logits, params, generator, stop_ids, alive, rows, step, pad_token_id,
                                        responses, response_mask, old_logp)  # fmt: skip
        if sequences is not None and num_alive:
            alive &= ~sequences.ended(responses, rows, step)  # in place: the C++ step reads this buffer
            num_alive = int(alive.sum())
        if num_alive == 0 or step == max_new - 1:
            break
        logits, rows, alive = _advance(decoder, tokens, rows, alive, num_alive, step)


class _StopSequences:
    """The rows whose sampled ids end on one of ``params.stop_sequences`` (token ids, not text).

    A sequence matches when the row's response tokens ``step - len + 1 .. step`` are exactly its
    ids; the same text sampled with other token boundaries does not match (the workers list the
    tokenizations of a tag that the sampler should stop on:
    :func:`rlflow.workers.tool_render.stop_sequences`). Checked from token ``min_new_tokens`` on.
    """

    def __init__(self, params: SamplingParams, device: torch.device):
        self._first = min(params.min_new_tokens, params.max_new_tokens)
        self._seqs = [torch.tensor(seq, dtype=torch.long, device=device) for seq in params.stop_sequences]

    def ended(self, responses: torch.Tensor, rows: torch.Tensor, step: int) -> torch.Tensor:
        """``(len(rows),)`` bool: the decoding rows ``rows`` (output rows) whose token ``step`` ends a sequence."""
        hit = torch.zeros(rows.shape[0], dtype=torch.bool, device=responses.device)
        if step < self._first:
            return hit
        for seq in self._seqs:
            if seq.numel() <= step + 1:
                hit |= (responses[rows, step + 1 - seq.numel() : step + 1] == seq).all(dim=1)
        return hit


def _advance(decoder, tokens, rows, alive, num_alive: int, step: int):
    """Prune the finished rows (and their cache) once a quarter of them are done, then decode
    ``step``'s tokens of the rows left: ``(next logits, rows, alive)`` of the rows still decoding."""
    if num_alive <= (1 - _PRUNE_FRACTION) * alive.numel():
        keep = alive.nonzero().squeeze(1)
        decoder.select(keep)
        rows, alive, tokens = rows[keep], alive[keep], tokens[keep]
    return decoder.step(tokens, step), rows, alive


def _decoder(
    model: nn.Module, num_rows: int, total_len: int, max_new_tokens: int, tp_group, fast_decode: bool,
    native_decode: bool,
) -> FastDecoder | _HFDecoder:  # fmt: skip
    """The lean decoder where it applies (module :mod:`~rlflow.engine.rollout.fast_decode`), its steps in
    C++ where that applies too (:mod:`~rlflow.engine.rollout.native_decode`), else HF's modules."""
    if not fast_decode:
        reason = "fast_decode=False"
    elif tp_group is not None and dist.get_world_size(tp_group) > 1:
        reason = "tensor parallelism"
    else:
        reason = fast_decode_blocker(model) or _kv_memory_blocker(model, num_rows, total_len)
    if reason is None:
        native_reason = native_decode_blocker(model, num_rows) if native_decode else "native_decode=False"
        if native_reason is None:
            return NativeDecoder(model, max_new_tokens)
        _log.debug("sampler decodes with the torch lean decoder: %s", native_reason)
        return FastDecoder(model, max_new_tokens)
    _log.debug("sampler decodes through HF's modules: %s", reason)
    return _HFDecoder(model, max_new_tokens)


def _kv_memory_blocker(model: nn.Module, num_rows: int, total_len: int) -> str | None:
    """Why the lean decoder's preallocated KV cache should not be allocated on a GPU, or None.

    It reserves every row's full length up front, where HF's cache grows and drops finished
    rows; beyond half the free GPU memory the HF path is the safer one.
    """
    device = next(model.parameters()).device
    if device.type != "cuda":
        return None
    needed, (free, _) = kv_cache_bytes(model, num_rows, total_len), torch.cuda.mem_get_info(device)
    if needed > free // 2:
        return f"its preallocated KV cache ({needed / 2**30:.2f} GiB) exceeds half the free GPU memory"
    return None


class _HFDecoder:
    """Prefill and decode steps through the HF model's forward and its ``DynamicCache``.

    Args:
        model: any HF causal LM (plain or split by ``apply_tp``).
        max_new_tokens: ``R``, the decode steps the masks are built for.
    """

    def __init__(self, model: nn.Module, max_new_tokens: int):
        self._model, self._max_new = model, max_new_tokens
        self._cache_name = cache_kwarg(model.forward)
        self._cache = DynamicCache(config=model.config)

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, n: int) -> torch.Tensor:
        """One prefill per prompt, then ``n`` copies of its cache; ``(B*n, V)`` float32 logits."""
        position_ids = position_ids_from_mask(attention_mask)
        logits = _next_logits(
            self._model, self._cache_name, self._cache, input_ids=input_ids, attention_mask=attention_mask,
            position_ids=position_ids,
        )  # fmt: skip
        if n > 1:
            self._cache.batch_repeat_interleave(n)
            logits = logits.repeat_interleave(n, dim=0)
        self._masks = _DecodeMasks(self._model, attention_mask.repeat_interleave(n, dim=0), self._max_new)
        self._next_pos = attention_mask.sum(dim=1, keepdim=True).repeat_interleave(n, dim=0)  # (N, 1)
        return logits

    def step(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        """Feed ``(N,)`` tokens (response position ``step``); ``(N, V)`` float32 next logits."""
        logits = _next_logits(
            self._model, self._cache_name, self._cache, input_ids=tokens[:, None],
            attention_mask=self._masks.step(step), position_ids=self._next_pos,
        )  # fmt: skip
        self._next_pos = self._next_pos + 1
        return logits

    def select(self, keep: torch.Tensor) -> None:
        """Keep only the decoding rows ``keep`` (indices into the current rows)."""
        self._cache.batch_select_indices(keep)
        self._masks.select(keep)
        self._next_pos = self._next_pos[keep]


@dataclass(frozen=True)
class _MeshCoords:
    """This rank's place in a generate call's ``("pp", "dp", "tp")`` mesh."""

    dp_rank: int = 0
    pp: int = 1
    pp_rank: int = 0
    pp_group: dist.ProcessGroup | None = None
    tp_group: dist.ProcessGroup | None = None
    tp_mesh: DeviceMesh | None = None


def _mesh_coords(device_mesh: DeviceMesh | None) -> _MeshCoords:
    """This rank's coordinates and groups; validates the ``("pp", "dp", "tp")`` mesh."""
    if device_mesh is None:
        return _MeshCoords()
    if tuple(device_mesh.mesh_dim_names or ()) != _MESH_DIMS:
        raise ValueError(f"device_mesh dims must be {_MESH_DIMS}, got {device_mesh.mesh_dim_names}")
    tp_mesh, pp_mesh = device_mesh["tp"], device_mesh["pp"]
    return _MeshCoords(
        dp_rank=device_mesh["dp"].get_local_rank(),
        pp=pp_mesh.size(),
        pp_rank=pp_mesh.get_local_rank(),
        pp_group=pp_mesh.get_group() if pp_mesh.size() > 1 else None,
        tp_group=tp_mesh.get_group() if tp_mesh.size() > 1 else None,
        tp_mesh=tp_mesh,
    )


def _local_part(param: torch.Tensor, tensor: torch.Tensor, name: str) -> torch.Tensor:
    """The part of ``tensor`` (full or already this rank's shard) that ``param`` holds here."""
    if isinstance(tensor, DTensor):
        same_layout = (
            isinstance(param, DTensor)
            and tensor.device_mesh == param.device_mesh
            and tensor.placements == param.placements
        )
        tensor = tensor.to_local() if same_layout else tensor.full_tensor()
    if not isinstance(param, DTensor):
        if tensor.shape != param.shape:
            raise ValueError(f"update_weights: {name!r} has shape {tuple(param.shape)}, got {tuple(tensor.shape)}")
        return tensor
    local = param.to_local()
    if tensor.shape == local.shape:  # already this rank's shard (what the reshard executor sends)
        return tensor
    if tensor.shape != param.shape:
        raise ValueError(
            f"update_weights: {name!r} is {tuple(param.shape)} (local shard {tuple(local.shape)}), "
            f"got {tuple(tensor.shape)}"
        )
    for mesh_dim, placement in enumerate(param.placements):  # a full tensor: cut out our shard
        if isinstance(placement, Shard):
            num_chunks, index = param.device_mesh.size(mesh_dim), param.device_mesh.get_local_rank(mesh_dim)
            tensor = torch.chunk(tensor, num_chunks, dim=placement.dim)[index]
        elif not isinstance(placement, Replicate):
            raise ValueError(f"update_weights: {name!r} has unsupported placement {placement}")
    return tensor


@register_rollout_engine("hf")
class HFRolloutEngine:
    """Rollout engine over an HF causal LM, on CPU or GPU, under dp × tp × pp.

    Declarations (:class:`~rlflow.engine.rollout.base.RolloutEngine`): the worker builds it per
    call around a plain HF model of the call's tensor-parallel layout (``style="hf"``), which the
    reshard executor writes; it generates in the dtype of that copy and holds only what the batch
    needs. Subclasses may declare another persistence and add sleep/wake.

    Under pp > 1 each rank holds its pipeline stage (:func:`rlflow.engine.pipeline.build_stage`,
    the training engine's split) and generation is pipelined over micro-batches of prompts
    (:mod:`~rlflow.engine.rollout.pipelined`); the module is then that stage.

    Args:
        model: an HF causal LM (Llama/Qwen2 family for tp > 1 or pp > 1) on this rank's device,
            or, under pp > 1, this rank's :class:`~rlflow.engine.pipeline.DecoderStage` of one.
            A full model is cut to this rank's stage; the stage is split in place with
            ``apply_tp`` when the mesh has tp > 1 and it is not split yet.
        device_mesh: this call's torch mesh with dims ``("pp", "dp", "tp")``; None for a single
            process.
        pad_token_id: written after a row's stop token; defaults to the model config's
            ``pad_token_id``, else 0.
        fast_decode: decode with the lean decoder of :mod:`~rlflow.engine.rollout.fast_decode`
            where it applies (else HF's modules, said in a debug log); False forces HF's modules.
        native_decode: run that decoder's steps and each step's sampling in C++ where they apply
            (one process; pipeline stages keep torch's; see :func:`sample_responses`); False keeps
            them in torch.
        num_micro_batches: micro-batches of whole prompts per call (at most the rank's prompts):
            under pp > 1 in flight through the stages (default ``pp``); at pp = 1 generated one
            after another, each with only its own KV cache in memory (default 1: all at once),
            the sampling generator drawn in their order. The planner prices a generate call's
            ``MFCDef.n_mbs`` so (``rlflow.planner.space.num_microbatches``).

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    ...                      num_attention_heads=2, num_key_value_heads=1)
    >>> engine = HFRolloutEngine(LlamaForCausalLM(config))
    >>> ids, mask = torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]])
    >>> out = engine.generate((ids, mask), SamplingParams(n=2, max_new_tokens=4, seed=0))
    >>> tuple(out["responses"].shape), tuple(out["input_ids"].shape)
    ((4, 4), (4, 7))
    """

    layout_style: ClassVar[str] = "hf"
    persistence: ClassVar[str] = PER_CALL
    can_sleep: ClassVar[bool] = False
    capabilities: ClassVar[RolloutCapabilities] = RolloutCapabilities(dp=True, tp=True, pp=True)
    weight_dtype: ClassVar[torch.dtype | None] = None
    holds_memory_fraction: ClassVar[bool] = False

    def __init__(
        self,
        model: nn.Module,
        device_mesh: DeviceMesh | None = None,
        *,
        pad_token_id: int | None = None,
        fast_decode: bool = True,
        native_decode: bool = True,
        num_micro_batches: int | None = None,
    ):
        self._coords = coords = _mesh_coords(device_mesh)
        self._dp_rank, self._tp_group = coords.dp_rank, coords.tp_group
        if num_micro_batches is not None and num_micro_batches < 1:
            raise ValueError(f"num_micro_batches={num_micro_batches} must be >= 1")
        self._num_micro_batches = num_micro_batches
        if coords.pp > 1:
            model = _pipeline_stage(model, coords.pp, coords.pp_rank)
        tp_mesh = coords.tp_mesh
        if tp_mesh is not None and tp_mesh.size() > 1 and not any(isinstance(p, DTensor) for p in model.parameters()):
            from rlflow.parallel.tensor_parallel import apply_tp

            apply_tp(model, tp_mesh)
        if pad_token_id is None:
            pad_token_id = getattr(model.config, "pad_token_id", None)
        self._pad_token_id = 0 if pad_token_id is None else int(pad_token_id)
        self._model = model.eval()
        self._fast_decode, self._native_decode = fast_decode, native_decode

    @classmethod
    def available(cls) -> bool:
        """Always: it needs torch and transformers only."""
        return True

    @classmethod
    def supports_device(cls, device_type: str) -> bool:
        """Any device torch runs the model on."""
        return True

    @classmethod
    def build(cls, spec: RolloutBuild) -> HFRolloutEngine:
        """An HF causal LM of ``spec.config`` in ``spec.dtype`` on ``spec.device``, tensor-parallel
        over the mesh's tp axis; its weights are about to be overwritten (the random init is skipped)."""
        try:
            from transformers.initialization import no_init_weights
        except ImportError:  # older transformers: pay for the random init
            from contextlib import nullcontext as no_init_weights
        coords = _mesh_coords(spec.device_mesh)
        if coords.pp > 1:  # only this rank's stage is materialised (uninitialised: weights come next)
            from rlflow.engine.loading import build_meta_model, init_buffers
            from rlflow.engine.pipeline import build_stage

            stage = build_stage(build_meta_model(spec.config, "lm", dtype=spec.dtype), coords.pp, coords.pp_rank)
            stage.to_empty(device=spec.device)
            init_buffers(stage)
            return cls(
                stage, spec.device_mesh, pad_token_id=spec.pad_token_id, num_micro_batches=spec.num_micro_batches
            )
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(spec.config, dtype=spec.dtype)
        # Skipping the init also skips tying: a tied LM head would be a parameter of its own,
        # written by every reshard and refused by the lean decoder (it decodes the family's names).
        model.tie_weights()
        return cls(
            model.to(spec.device),
            spec.device_mesh,
            pad_token_id=spec.pad_token_id,
            num_micro_batches=spec.num_micro_batches,
        )

    def weight_target(self) -> nn.Module:
        """The HF model, or this rank's pipeline stage: the reshard executor writes its (tensor-parallel)
        parameters."""
        return self._model

    @property
    def module(self) -> nn.Module:
        return self._model

    @property
    def pad_token_id(self) -> int:
        return self._pad_token_id

    def _generator(self, seed: int | None, device: torch.device) -> torch.Generator:
        generator = torch.Generator(device=device)
        if seed is None:
            generator.seed()
        else:  # distinct, reproducible streams per dp rank
            generator.manual_seed((seed + 0x9E3779B1 * self._dp_rank) % 2**63)
        return generator

    def generate(self, prompts: Prompts, params: SamplingParams) -> DataProto | dict[str, torch.Tensor]:
        """See :meth:`rlflow.engine.rollout.base.RolloutEngine.generate`. Outputs on the prompts' device."""
        input_ids, attention_mask, source = split_prompts(prompts)
        device = next(self._model.parameters()).device
        ids, mask = input_ids.to(device), attention_mask.to(device)
        common = dict(
            pad_token_id=self._pad_token_id,
            generator=self._generator(params.seed, device),
            tp_group=self._tp_group,
            fast_decode=self._fast_decode,
        )
        if self._coords.pp > 1:
            from rlflow.engine.rollout.pipelined import pipelined_sample  # it builds on this module

            responses, response_mask, old_logp = pipelined_sample(
                self._model, ids, mask, params, pp_group=self._coords.pp_group,
                num_micro_batches=self._num_micro_batches, **common,
            )  # fmt: skip
        else:
            responses, response_mask, old_logp = self._sample_in_turn(ids, mask, params, common)
        out_device = input_ids.device
        return assemble_rollout(
            input_ids,
            attention_mask,
            responses.to(out_device),
            response_mask.to(out_device),
            old_logp.to(out_device),
            params.n,
            source,
        )

    def generate_episodes(self, prompts: DataProto, params: SamplingParams, multi: MultiTurn) -> DataProto:
        """``params.n`` multi-turn episodes per row of ``prompts`` (:mod:`~rlflow.engine.rollout.multi_turn`).

        Each episode's ``reset`` reads its row (:func:`~rlflow.engine.rollout.multi_turn.episode_rows`).
        Outputs are on the host; ``meta_info`` holds :func:`~rlflow.engine.rollout.multi_turn.episode_metrics`.

        Raises:
            ValueError: the engine is pipelined or tensor-parallel (an episode's tools would run
                once per rank).
        """
        if self._coords.pp > 1 or (self._tp_group is not None and dist.get_world_size(self._tp_group) > 1):
            raise ValueError("multi-turn rollouts need the hf engine on one process per dp rank (pp = tp = 1)")
        device = next(self._model.parameters()).device
        common = dict(pad_token_id=self._pad_token_id, tp_group=None, fast_decode=self._fast_decode)

        def sample(ids: torch.Tensor, mask: torch.Tensor, turn_params: SamplingParams) -> tuple[torch.Tensor, ...]:
            generator = self._generator(turn_params.seed, device)
            return self._sample_in_turn(
                ids.to(device), mask.to(device), turn_params, {**common, "generator": generator}
            )

        records, episodes = run_episodes(sample, episode_rows(prompts), params, multi)
        out = assemble_episodes(records, multi, self._pad_token_id, prompts, params.n)
        out.meta_info.update(episode_metrics(records, episodes))
        return out

    def _sample_in_turn(self, ids, mask, params: SamplingParams, common: dict) -> tuple[torch.Tensor, ...]:
        """pp = 1: the prompts at once, or ``num_micro_batches`` groups of whole prompts one after
        another (their rows stay in prompt order; tp peers split the same prompts alike)."""
        groups = min(self._num_micro_batches or 1, ids.shape[0])
        parts = [
            sample_responses(self._model, i, m, params, native_decode=self._native_decode, **common)
            for i, m in zip(ids.tensor_split(groups), mask.tensor_split(groups))
        ]
        return parts[0] if groups == 1 else tuple(torch.cat(t) for t in zip(*parts))

    @torch.no_grad()
    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> None:
        """Copy tensors into the parameters named like HF's ``named_parameters()``.

        Each tensor may be the full parameter (this rank cuts its tp shard out) or exactly this
        rank's shard. Tied parameters may be given under either name. Under pp > 1 the parameters
        of other stages are skipped.

        Raises:
            KeyError: an unknown name (the message shows a few known ones).
            ValueError: a shape that is neither the full nor the local shape.
        """
        params = dict(self._model.named_parameters(remove_duplicate=False))
        elsewhere: set[str] = set()
        if self._coords.pp > 1:
            params, elsewhere = _stage_params(self._model, params)
        items = weights.items() if isinstance(weights, Mapping) else weights
        for name, tensor in items:
            if name in elsewhere:
                continue
            if name not in params:
                raise KeyError(f"update_weights: no parameter {name!r}; known e.g. {sorted(params)[:4]}")
            param = params[name]
            target = param.to_local() if isinstance(param, DTensor) else param
            target.copy_(_local_part(param, tensor, name))


def _pipeline_stage(model: nn.Module, pp: int, pp_rank: int) -> nn.Module:
    """This rank's :class:`~rlflow.engine.pipeline.DecoderStage` of ``model`` (cut here when whole)."""
    from rlflow.engine.pipeline import DecoderStage, build_stage
    from rlflow.parallel.layout import pipeline_stages

    if not isinstance(model, DecoderStage):
        return build_stage(model, pp, pp_rank)
    expected = pipeline_stages(model.config, pp, "lm")[pp_rank]
    if model.items != expected:
        raise ValueError(f"the stage given holds {model.items}; pp_rank {pp_rank} of pp={pp} holds {expected}")
    return model


def _stage_params(stage: nn.Module, params: dict[str, nn.Parameter]) -> tuple[dict[str, nn.Parameter], set[str]]:
    """``(this stage's parameters by HF name, the names other stages hold)``; a last stage's own copy
    of a tied embedding answers to the embedding's name too."""
    family = stage.family
    names = {name for _, shapes in family.item_param_shapes(stage.config) for name in shapes}
    names.add(family.lm_head_name)  # a tied head may be given under its own name
    if stage.tied and stage.is_last and not stage.is_first:
        params = {**params, family.embed_name: params[family.lm_head_name]}
    return params, names - set(params)
