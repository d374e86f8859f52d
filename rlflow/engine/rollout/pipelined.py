"""Pipelined generation for the built-in sampler: ``pp`` stages pass activations every decode step.

Each rank of a pipelined generate call holds one stage of the model — the items
:func:`rlflow.parallel.layout.pipeline_stages` gives it, cut by
:func:`rlflow.engine.pipeline.build_stage` as the training engine cuts them, tensor-parallel
inside when tp > 1 — and its own KV cache of those layers (the sampler's lean decoder,
:class:`~rlflow.engine.rollout.fast_decode.FastDecoder`, where it applies; HF's layers,
:class:`StageDecoder`, under tp or elsewhere). The rows of a
dp rank are cut into ``M`` micro-batches of whole prompts (default ``min(pp, prompts)``, what
the planner prices). In every *round* each stage runs every unfinished micro-batch once, in
order: round 0 is the prefill, round ``r`` feeds the tokens chosen in round ``r - 1``:

* stage 0 embeds the tokens, runs its layers and sends the hidden states to stage 1; stage
  ``s`` receives from ``s - 1``, runs its layers and sends on (point-to-point ``isend``/``recv``
  over the pp group: gloo on CPU, NCCL on GPU);
* the last stage computes the logits, chooses the tokens with the sampler's own code
  (:func:`~rlflow.engine.rollout.hf_sampler.choose_tokens`, tp rank 0 choosing and
  broadcasting as at pp = 1), records them, and sends them back to stage 0 over a second group
  of the same ranks (NCCL serialises the point-to-point operations of one communicator: hidden
  states going forward and tokens coming back on one stream could wait on each other).

With ``M`` micro-batches in flight, stage ``s`` works on micro-batch ``m`` while ``s + 1`` works
on ``m - 1``, so with ``M >= pp`` no stage idles once the pipeline is full.

**Same output as pp = 1.** Greedy decoding takes the argmax of the same logits. Seeded sampling
draws the same noise: the last stage draws one step's exponential noise for the rows pp = 1
would be decoding at that step — it tracks pp = 1's pruning of finished rows over the whole
batch — and hands each micro-batch its rows of it. Stop tokens: the last stage sends, with the
tokens, which rows are still alive; every stage then prunes a micro-batch's finished rows by
pp = 1's rule (once a quarter of its rows have finished) and forgets a micro-batch whose rows
have all finished, so all stages stay in step without a global synchronisation.

Every rank of the pp group returns the same rollout: the last stage broadcasts it at the end
(like tp peers, every rank of a call returns what it sampled).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import DynamicCache

from rlflow.engine.models import cache_kwarg
from rlflow.engine.packing import position_ids_from_mask
from rlflow.engine.pipeline import DecoderStage
from rlflow.engine.rollout.base import SamplingParams
from rlflow.engine.rollout.fast_decode import FastDecoder, fast_decode_blocker
from rlflow.engine.rollout.hf_sampler import _PRUNE_FRACTION, _DecodeMasks, _mask_kind, choose_tokens, token_logprobs
from rlflow.parallel.groups import pp_return_group

__all__ = ["StageDecoder", "back_group", "pipelined_sample"]

_log = logging.getLogger(__name__)


class StageDecoder:
    """Prefill and decode steps of one pipeline stage's layers for one micro-batch, with their KV cache.

    Runs HF's decoder layers of the stage (plain or tensor-parallel) with a ``DynamicCache`` and
    the attention masks built here: bool masks for sdpa, additive ones for eager attention.

    Args:
        stage: this rank's :class:`~rlflow.engine.pipeline.DecoderStage` of an LM.
        max_new_tokens: ``R``, the decode steps the masks are built for.
        total_len: prompt + response length (sliding windows shorter than it are refused).

    Raises:
        ValueError: an attention implementation other than sdpa/eager, or a sliding window
            shorter than ``total_len`` (the masks here are full causal ones).
    """

    def __init__(self, stage: DecoderStage, max_new_tokens: int, total_len: int):
        kind = _mask_kind(stage, total_len)
        if kind == "hf":
            config = stage.config
            raise ValueError(
                "pipelined generation needs sdpa or eager attention over the whole sequence; got "
                f"_attn_implementation={getattr(config, '_attn_implementation', None)!r}, "
                f"sliding_window={getattr(config, 'sliding_window', None)} for {total_len} tokens"
            )
        family = stage.family
        self._stage, self._kind, self._max_new = stage, kind, max_new_tokens
        self._embed = stage.get_submodule(family.embed_module) if stage.is_first else None
        self._layers = list(stage.get_submodule(family.layers_module).values())
        self._rotary = stage.get_submodule(family.rotary_module)
        self._norm = stage.get_submodule(family.norm_module) if "norm" in stage.items else None
        self._head = stage.get_submodule(family.lm_head_module) if stage.is_last else None
        self._cache_name = cache_kwarg(self._layers[0].forward) if self._layers else None
        self._cache = DynamicCache()
        self._dtype = next(stage.parameters()).dtype

    def prefill(self, x: torch.Tensor, attention_mask: torch.Tensor, n: int) -> torch.Tensor:
        """Run the stage over ``B`` left-padded prompts and repeat its cache ``n`` times.

        Args:
            x: ``(B, P)`` token ids on the first stage, else ``(B, P, H)`` hidden states.
            attention_mask: ``(B, P)``.
            n: samples per prompt.

        Returns:
            ``(B, P, H)`` hidden states for the next stage (one row per prompt), or on the last
            stage ``(B*n, V)`` float32 logits of the next position, rows interleaved by prompt.
        """
        positions = position_ids_from_mask(attention_mask)
        hidden = self._embed(x) if self._embed is not None else x
        hidden = self._run_layers(hidden, self._prompt_mask(attention_mask), positions)
        self._masks = _DecodeMasks(self._stage, attention_mask.repeat_interleave(n, dim=0), self._max_new)
        self._next_pos = attention_mask.sum(dim=1, keepdim=True).repeat_interleave(n, dim=0)  # (N, 1)
        if n > 1:
            self._cache.batch_repeat_interleave(n)
        if self._head is None:
            return hidden
        return self._logits(hidden[:, -1]).repeat_interleave(n, dim=0)

    def step(self, x: torch.Tensor, step: int) -> torch.Tensor:
        """Feed response position ``step``: ``(N,)`` tokens on the first stage, else ``(N, 1, H)``.

        Returns:
            ``(N, 1, H)`` hidden states, or ``(N, V)`` float32 logits on the last stage.
        """
        hidden = self._embed(x[:, None]) if self._embed is not None else x
        hidden = self._run_layers(hidden, self._masks.step(step), self._next_pos)
        self._next_pos = self._next_pos + 1
        return hidden if self._head is None else self._logits(hidden[:, -1])

    def select(self, keep: torch.Tensor) -> None:
        """Keep only the decoding rows ``keep`` (indices into the current rows)."""
        self._cache.batch_select_indices(keep)
        self._masks.select(keep)
        self._next_pos = self._next_pos[keep]

    def _run_layers(self, hidden: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
        if not self._layers:
            return hidden
        position_embeddings = self._rotary(hidden, positions)
        for layer in self._layers:
            hidden = layer(
                hidden, attention_mask=mask, position_ids=positions, position_embeddings=position_embeddings,
                use_cache=True, **{self._cache_name: self._cache},
            )  # fmt: skip
        return hidden

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        """``(rows, V)`` float32 logits of the last position's ``(rows, H)`` states."""
        logits = self._head(self._norm(last) if self._norm is not None else last)
        if isinstance(logits, DTensor):  # a head left vocabulary-sharded: gather the full vocabulary
            logits = logits.full_tensor()
        return logits.float()

    def _prompt_mask(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """``(B, 1, P, P)``: causal over real tokens; a padding query attends to itself only, so no
        row is empty (its output is never read). Bool for sdpa, additive for eager."""
        valid = attention_mask.bool()
        length = valid.shape[1]
        query = torch.arange(length, device=valid.device)[:, None]
        eye = torch.eye(length, dtype=torch.bool, device=valid.device)
        allowed = ((query >= query.T)[None] & valid[:, None, :] | eye)[:, None]
        if self._kind == "sdpa":
            return allowed
        additive = torch.zeros(allowed.shape, dtype=self._dtype, device=valid.device)
        return additive.masked_fill_(~allowed, torch.finfo(self._dtype).min)


# ranks -> the group tokens travel back on, where the members made it themselves; once per process.
_BACK_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


def clear_back_groups() -> None:
    """Forget the cached return groups (after ``destroy_process_group``)."""
    _BACK_GROUPS.clear()


def back_group(pp_group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A second group of the ranks of ``pp_group``, for the tokens the last stage sends back.

    In a worker pool it is the one :func:`rlflow.parallel.groups.build_call_groups` made with the
    call's groups (every pool rank creates groups, in the same order). Outside one (ranks that
    built their mesh themselves, as the tests do) the group's members create it here, together.
    """
    ranks = tuple(dist.get_process_group_ranks(pp_group))
    made = pp_return_group(ranks)
    if made is not None:
        return made
    if ranks not in _BACK_GROUPS:
        _BACK_GROUPS[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return _BACK_GROUPS[ranks]


@dataclass
class _MicroBatch:
    """One micro-batch of prompts as every stage tracks it."""

    prompts: slice  # its prompts (rows of the dp rank's input)
    rows: torch.Tensor  # (N_m,) output row of each decoding row
    decoder: StageDecoder
    alive: torch.Tensor | None = None  # (N_m,) bool, rows not yet stopped (last stage, with stop tokens)
    done: bool = False


@dataclass
class _Pipe:
    """The ranks, groups and device of one pipelined generate call on this rank."""

    rank: int
    size: int
    group: dist.ProcessGroup
    back: dist.ProcessGroup
    tp_group: dist.ProcessGroup | None
    device: torch.device
    hidden_size: int
    dtype: torch.dtype
    sends: list = field(default_factory=list)  # this round's sends in flight
    older: list = field(default_factory=list)  # the round before's

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    def send(self, tensor: torch.Tensor, dst: int, back: bool = False) -> None:
        work = dist.isend(tensor.contiguous(), group=self.back if back else self.group, group_dst=dst)
        self.sends.append((work, tensor))  # the buffer must outlive the send

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int, back: bool = False) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buf, group=self.back if back else self.group, group_src=src)
        return buf

    def end_round(self) -> None:
        """Wait for the sends of the round before this one: a send may complete only once its peer
        receives it, which for the tokens is during the first stage's next round, so waiting for
        this round's would keep the last stage from starting the next one."""
        for work, _ in self.older:
            work.wait()
        self.older, self.sends = self.sends, []

    def wait_sends(self) -> None:
        self.end_round()
        self.end_round()


def _prune(mb: _MicroBatch, alive: torch.Tensor) -> torch.Tensor | None:
    """pp = 1's rule on one micro-batch: done when no row is alive; the alive rows kept once a
    quarter have finished. Returns the kept indices (None: keep all), marks ``mb.done``."""
    num_alive = int(alive.sum())
    if num_alive == 0:
        mb.done = True
        return None
    if num_alive <= (1 - _PRUNE_FRACTION) * alive.numel():
        keep = alive.nonzero().squeeze(1)
        mb.decoder.select(keep)
        mb.rows = mb.rows[keep]
        return keep
    return None


def pipelined_sample(
    stage: DecoderStage,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    params: SamplingParams,
    *,
    pad_token_id: int,
    pp_group: dist.ProcessGroup,
    generator: torch.Generator | None = None,
    tp_group: dist.ProcessGroup | None = None,
    num_micro_batches: int | None = None,
    fast_decode: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~rlflow.engine.rollout.hf_sampler.sample_responses` with the model cut into pipeline stages.

    Every rank of ``pp_group`` (and of ``tp_group``) calls it with the same prompts.

    Args:
        stage: this rank's stage (rank ``r`` of ``pp_group`` holds stage ``r``).
        input_ids, attention_mask: ``(B, P)`` left-padded prompts.
        params: sampling parameters.
        pad_token_id: written into responses after a row's stop token.
        pp_group: the pipeline group of this rank's (dp, tp) coordinates.
        generator: random source (used on the last stage's tp rank 0 only).
        tp_group: the stage's tensor-parallel group when it is split.
        num_micro_batches: micro-batches of whole prompts; default ``min(pp, B)``.
        fast_decode: run the stage with the sampler's lean decoder
            (:class:`~rlflow.engine.rollout.fast_decode.FastDecoder`) where
            :func:`~rlflow.engine.rollout.fast_decode.fast_decode_blocker` allows it (not under
            tp); else, or when False, HF's layers (:class:`StageDecoder`). Both pass the same
            hidden states, so stages may differ.

    Returns:
        ``(responses, response_mask, old_logp)``, each ``(B*n, R)`` as at pp = 1, on every rank.

    Raises:
        ValueError: ``params.stop_sequences`` (pipelined stages stop on single tokens only).
    """
    if params.stop_sequences:
        raise ValueError(f"stop_sequences={params.stop_sequences}: pipelined generation stops on single tokens only")
    pp, batch = dist.get_world_size(pp_group), input_ids.shape[0]
    num_micro_batches = min(num_micro_batches or pp, batch)
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches={num_micro_batches} must be >= 1")
    num_rows, max_new, device = batch * params.n, params.max_new_tokens, input_ids.device
    with torch.no_grad():  # outside inference mode: the outputs must be usable by autograd later
        responses = torch.full((num_rows, max_new), pad_token_id, dtype=torch.long, device=device)
        response_mask = torch.zeros((num_rows, max_new), dtype=torch.long, device=device)
        old_logp = torch.zeros((num_rows, max_new), dtype=torch.float32, device=device)
    pipe = _Pipe(
        rank=dist.get_rank(pp_group), size=pp, group=pp_group, back=back_group(pp_group), tp_group=tp_group,
        device=device, hidden_size=stage.config.hidden_size, dtype=next(stage.parameters()).dtype,
    )  # fmt: skip
    with torch.inference_mode():
        decoder = _decoder_factory(stage, params.max_new_tokens, input_ids.shape[1], tp_group, fast_decode)
        _Schedule(pipe, decoder, input_ids, attention_mask, params, pad_token_id, generator, num_micro_batches).run(
            responses, response_mask, old_logp
        )
    last = pp - 1
    for out in (responses, response_mask, old_logp):
        dist.broadcast(out, group=pp_group, group_src=last)
    if bool(torch.isnan(old_logp).any()):
        raise ValueError("pipelined_sample: the model's logits contain NaN (see old_logp)")
    return responses, response_mask, old_logp


def _decoder_factory(stage, max_new_tokens: int, prompt_len: int, tp_group, fast_decode: bool):
    """What builds this stage's decoder of one micro-batch: the lean one where it applies (logged otherwise)."""
    if not fast_decode:
        reason = "fast_decode=False"
    elif tp_group is not None and dist.get_world_size(tp_group) > 1:
        reason = "tensor parallelism"
    else:
        reason = fast_decode_blocker(stage)
    if reason is None:
        return lambda: FastDecoder(stage, max_new_tokens)
    _log.debug("pipelined stage decodes through HF's layers: %s", reason)
    return lambda: StageDecoder(stage, max_new_tokens, prompt_len + max_new_tokens)


class _Schedule:
    """The rounds of one pipelined generate call on one rank (module docstring)."""

    def __init__(self, pipe, decoder, input_ids, attention_mask, params, pad_token_id, generator, num_mbs):
        self.pipe, self.params, self.pad, self.generator = pipe, params, pad_token_id, generator
        self.input_ids, self.attention_mask = input_ids, attention_mask
        n = params.n
        self.mbs = []
        for part in torch.arange(input_ids.shape[0]).tensor_split(num_mbs):
            a, b = int(part[0]), int(part[-1]) + 1
            rows = torch.arange(a * n, b * n, device=input_ids.device)
            self.mbs.append(_MicroBatch(slice(a, b), rows, decoder()))
        self.stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=input_ids.device)
        self.temperature = 1.0 if params.greedy else params.temperature
        # pp = 1's decoding rows (last stage): the rows one step's noise is drawn for
        num_rows = input_ids.shape[0] * n
        self.pp1_rows = torch.arange(num_rows, device=input_ids.device)
        self.pp1_alive = torch.ones(num_rows, dtype=torch.bool, device=input_ids.device)
        self.noise: torch.Tensor | None = None

    @property
    def stops(self) -> bool:
        return bool(self.params.stop_token_ids)

    def run(self, responses, response_mask, old_logp) -> None:
        pipe = self.pipe
        for rnd in range(self.params.max_new_tokens):
            self.noise = None
            for mb in self.mbs:
                if not mb.done:
                    self._micro_batch(mb, rnd, responses, response_mask, old_logp)
            pipe.end_round()
            if all(mb.done for mb in self.mbs) or (pipe.last and not self._pp1_prune()):
                break
        pipe.wait_sends()
        if not self.stops:
            response_mask.fill_(1)

    def _micro_batch(self, mb: _MicroBatch, rnd: int, responses, response_mask, old_logp) -> None:
        pipe, prompts = self.pipe, mb.prompts
        mask = self.attention_mask[prompts]
        if rnd == 0:
            if pipe.first:
                x = self.input_ids[prompts]
            else:
                x = pipe.recv((mask.shape[0], mask.shape[1], pipe.hidden_size), pipe.dtype, pipe.rank - 1)
            out = mb.decoder.prefill(x, mask, self.params.n)
        else:
            x = self._next_input(mb)
            if mb.done:
                return
            out = mb.decoder.step(x, rnd - 1)
        if not pipe.last:
            pipe.send(out, pipe.rank + 1)
            return
        choice = out.index_fill(-1, self.stop_ids, float("-inf")) if rnd < self.params.min_new_tokens else out
        tokens = self._choose(choice, mb)
        self._record(mb, rnd, tokens, out, responses, response_mask, old_logp)
        if rnd < self.params.max_new_tokens - 1:
            message = torch.stack([tokens, mb.alive.long()]) if self.stops else tokens
            pipe.send(message, 0, back=True)

    def _next_input(self, mb: _MicroBatch) -> torch.Tensor | None:
        """This stage's input of a decode step of ``mb``, after pruning its finished rows; marks it done."""
        pipe, rows = self.pipe, mb.rows.numel()
        if pipe.first:
            if self.stops:
                message = pipe.recv((2, rows), torch.long, pipe.size - 1, back=True)
                tokens, alive = message[0], message[1].bool()
            else:
                tokens, alive = pipe.recv((rows,), torch.long, pipe.size - 1, back=True), None
        elif pipe.last:
            alive = mb.alive if self.stops else None
        else:
            alive = pipe.recv((rows,), torch.long, pipe.rank - 1).bool() if self.stops else None
        if alive is not None:
            if not pipe.last and pipe.rank + 1 < pipe.size - 1:  # the last stage knows it already
                pipe.send(alive.long(), pipe.rank + 1)  # as int64: gloo sends no bool tensors
            keep = _prune(mb, alive)
            if mb.done:
                return None
            if keep is not None:
                if pipe.first:
                    tokens = tokens[keep]
                if pipe.last:
                    mb.alive = mb.alive[keep]
        if pipe.first:
            return tokens
        return pipe.recv((mb.rows.numel(), 1, pipe.hidden_size), pipe.dtype, pipe.rank - 1)

    def _choose(self, logits: torch.Tensor, mb: _MicroBatch) -> torch.Tensor:
        """The tokens of ``mb``'s rows: chosen on tp rank 0 with its rows of pp = 1's noise, broadcast over tp."""
        tp_group, params = self.pipe.tp_group, self.params
        chooses = tp_group is None or dist.get_rank(tp_group) == 0
        if chooses:
            noise = None
            if not params.greedy:
                if self.noise is None:  # one draw per step, shaped like pp = 1's
                    shape = (self.pp1_rows.numel(), logits.shape[-1])
                    self.noise = torch.empty(shape, dtype=torch.float32, device=logits.device)
                    self.noise.exponential_(generator=self.generator)
                    self.pp1_index = torch.full_like(self.pp1_alive, -1, dtype=torch.long)
                    self.pp1_index[self.pp1_rows] = torch.arange(self.pp1_rows.numel(), device=logits.device)
                # a row pp = 1 already pruned has finished: its token is never recorded
                noise = self.noise[self.pp1_index[mb.rows].clamp(min=0)]
            tokens = choose_tokens(logits, params, self.generator, noise=noise)
        else:
            tokens = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        if tp_group is not None and dist.get_world_size(tp_group) > 1:
            dist.broadcast(tokens, group=tp_group, group_src=0)
        return tokens

    def _record(self, mb, step, tokens, logits, responses, response_mask, old_logp) -> None:
        logp = token_logprobs(logits, tokens, self.temperature)
        if not self.stops:
            responses[mb.rows, step] = tokens
            old_logp[mb.rows, step] = logp
            return
        if mb.alive is None:
            mb.alive = torch.ones(mb.rows.numel(), dtype=torch.bool, device=tokens.device)
        alive = mb.alive
        responses[mb.rows, step] = torch.where(alive, tokens, self.pad)
        response_mask[mb.rows, step] = alive.long()
        old_logp[mb.rows, step] = logp.masked_fill_(~alive, 0.0)
        mb.alive = alive & ~torch.isin(tokens, self.stop_ids)
        self.pp1_alive[mb.rows] = mb.alive

    def _pp1_prune(self) -> bool:
        """After a round on the last stage: pp = 1's pruning of its decoding rows; False when none is alive."""
        if not self.stops:
            return True
        alive = self.pp1_alive[self.pp1_rows]
        num_alive = int(alive.sum())
        if num_alive == 0:
            return False
        if num_alive <= (1 - _PRUNE_FRACTION) * alive.numel():
            self.pp1_rows = self.pp1_rows[alive]
        return True
