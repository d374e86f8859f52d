"""Time of one model function call under a strategy on a mesh (seconds), and its memory (bytes).

What is priced is what rlflow's engines run, in the dtypes of ``cluster.precision``; one pass
of one pipeline stage is priced by :mod:`rlflow.planner.passes` (layers, the gathered LM head,
tp collectives). On top come:

* pp: a point-to-point send of the hidden states per micro-batch and stage boundary, and the
  pipeline bubble: ``n_mb + pp - 1`` micro-batch slots for ``n_mb`` micro-batches (a pipelined
  decode step: the longer of ``n_mb`` stage passes and one micro-batch's round trip through the
  stages and back, :func:`_pipelined_decode_step_s`). An engine whose stages advance in lock-step
  (``cluster.pipeline_lockstep``: DeepSpeed's ``TrainSchedule`` with blocking sends, as ReaLHF
  runs it) pays more: each schedule step of training is a forward on half the stages and a
  backward on the others, and neither pair exchanges until both are done, so every micro-batch's
  forward waits as long as its neighbour's backward (``n_mb x |backward - forward|`` on top of
  the slots); its pipelined generation runs ``pp - 1`` decode steps more, so that the last
  stage's stop signal reaches every stage (ReaLHF's ``PipelineRunner.generate``);
* dp: every call but a generation runs on FSDP2 (``TrainEngine``, homes and forward copies
  alike): each micro-batch all-gathers every layer's weights in the compute dtype — once per
  forward, and again in backward when layers are resharded after forward (``pp == 1``) — and
  training reduce-scatters fp32 gradients. FSDP prefetches the next layer during the current
  one, so only what compute cannot hide, and one layer's gather, is exposed; on CPU workers gloo
  shares the workers' cores and nothing is hidden. FSDP runs one collective per unit (each
  decoder layer, and the root). Each optimizer step also all-reduces three scalars over dp (loss
  units, gradient norm, metrics).

Generation (``rlflow.engine.rollout.hf_sampler``): one prefill of the prompts — ``n_seqs /
n_samples_per_prompt`` of them, before the KV cache is repeated for the samples — with the
logits of the last position only; then ``gen_len - 1`` decode steps over every row (the
prefill's logits give the first token), each reading the weights and the KV cache, appending to
the cache, all-gathering the rows' logits over tp and sampling over the full vocabulary.
Generation is priced to ``gen_len`` tokens; the sampler stops earlier when every row has hit a
stop token. A multi-turn generation (``Workload.turns`` > 1, ``rlflow.engine.rollout.multi_turn``)
is priced turn by turn: each turn prefills every episode's whole context (prompt, earlier turns and
observations) and decodes ``turn_len`` tokens; each turn but the last then waits for the episodes'
steps, ``tool_threads`` at a time on a rank, ``tool_s`` each.

Training (``TrainEngine.train_step``): per mini-batch and epoch, forward, backward (2x the
forward FLOPs), recomputation under gradient checkpointing, the gradient-norm clip and one
AdamW step over the fp32 master weights, gradients and moments.

Training and inference passes over the samples of prompts (``Workload.shared_prompts``,
``pp = 1``) are priced as the engine runs them (:mod:`rlflow.engine.shared_prefix`): one
sequence per prompt — the prompt once, then its samples' responses, attending over a dense mask —
where :func:`shares_prompts` finds that cheaper than the padded rows, the head still over every row.

A profile taken with the planned model's calls (``rlflow.workers.profiling.run_profile(calls=...)``)
calibrates every call type by whole calls of it timed at two batch sizes: the compute (not the
collectives) is scaled (:meth:`Rates.call_scale`) and a fixed time added per call, or per
optimizer step of a training call (:meth:`Rates.call_fixed_s`: per-op dispatch, the sampler's
per-step Python, the loss and optimizer bookkeeping — what dominates a tiny model on CPU); see
:class:`rlflow.planner.profile.ProfiledRates`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from rlflow.dataflow.mfc import MFCDef
from rlflow.planner import memory
from rlflow.planner.cluster import ClusterSpec, Precision
from rlflow.planner.mesh import DeviceMesh
from rlflow.planner.model_spec import ModelSpec
from rlflow.planner.passes import (
    BACKWARD_FLOPS_FACTOR,
    Rates,
    StagePass,
    collective_s,
    dp_group_crosses_hosts,
    p2p_s,
    stage_pass_s,
)
from rlflow.planner.space import num_microbatches, seqs_per_rank
from rlflow.strategy import ParallelStrategy

__all__ = [
    "BACKWARD_FLOPS_FACTOR",
    "CallCost",
    "Rates",
    "Workload",
    "adam_step_bytes_per_param",
    "call_cost",
    "collective_s",
    "estimate_call",
]

# verl's default token budget per GPU micro-batch (ppo_max_token_len_per_gpu).
DEFAULT_MAX_TOKENS_PER_MB = 16384


def adam_step_bytes_per_param(precision: Precision) -> int:
    """Bytes one optimizer step moves per parameter: the gradient-norm clip reads the gradient,
    AdamW reads it again and reads and writes the master weight and both moments.

    >>> adam_step_bytes_per_param(Precision())  # fp32: 2 * 4 + 2 * 4 + 2 * 8
    32
    """
    return 2 * precision.grad_bytes + 2 * precision.param_bytes + 2 * precision.optimizer_bytes


@dataclass(frozen=True)
class Workload:
    """What one iteration processes.

    Attributes:
        batch_size: prompts per iteration.
        prompt_len / gen_len: tokens per prompt / per response (generation runs to gen_len).
        n_samples_per_prompt: responses per prompt (GRPO/RLOO group size).
        n_ppo_minibatches: optimizer steps per epoch of an RL train call unless the MFC sets its own.
        ppo_epochs: passes of an RL train call (one that reads ``rewards``) over its batch.
        gradient_checkpointing: recompute activations in backward.
        max_tokens_per_mb: token budget of one micro-batch (``None``: one micro-batch per
            mini-batch and dp rank, the engine's default without a budget).
        turns: sampled turns of a multi-turn generation (``gen_len`` is then each row's whole
            response: the turns and the observations between them); 1: one response per row.
        observation_len: tokens an environment appends after each turn but the last.
        tool_s: seconds one episode's step (its tool calls) takes after a turn.
        tool_threads: episodes stepping at once on a dp rank (``rollout.multi_turn.num_threads``).
        rollout_rounds: times an iteration runs each of ``rollout_calls`` (dynamic sampling's
            generation rounds, :mod:`rlflow.trainer.dynamic_sampling`); a call's option is priced
            that many calls an iteration.
        rollout_calls: the calls a generation round runs (:func:`rlflow.dataflow.rollout_calls`).
        shared_prompts: training and inference passes run the samples of a prompt as one sequence
            where :func:`shares_prompts` finds it cheaper (the engines' ``shared_prefix``).
    """

    batch_size: int
    prompt_len: int
    gen_len: int
    n_samples_per_prompt: int = 1
    n_ppo_minibatches: int = 4
    ppo_epochs: int = 1
    gradient_checkpointing: bool = True
    max_tokens_per_mb: int | None = DEFAULT_MAX_TOKENS_PER_MB
    turns: int = 1
    observation_len: int = 0
    tool_s: float = 0.0
    tool_threads: int = 1
    rollout_rounds: float = 1.0
    rollout_calls: frozenset[str] = frozenset()
    shared_prompts: bool = False

    def __post_init__(self) -> None:
        for attr in ("batch_size", "prompt_len", "n_samples_per_prompt", "n_ppo_minibatches", "ppo_epochs"):
            if getattr(self, attr) < 1:
                raise ValueError(f"Workload.{attr}={getattr(self, attr)} must be >= 1")
        if self.turns < 1 or self.tool_threads < 1 or self.observation_len < 0 or self.tool_s < 0:
            raise ValueError(
                f"Workload turns={self.turns}, tool_threads={self.tool_threads} must be >= 1 and "
                f"observation_len={self.observation_len}, tool_s={self.tool_s} >= 0"
            )
        if self.rollout_rounds < 1:
            raise ValueError(f"Workload.rollout_rounds={self.rollout_rounds} must be >= 1")
        if self.turns > 1 and self.turn_len < 1:
            raise ValueError(
                f"Workload: gen_len={self.gen_len} leaves no token to sample in each of turns={self.turns} "
                f"after {self.turns - 1} observations of observation_len={self.observation_len}"
            )
        if self.gen_len < 0:
            raise ValueError(f"Workload.gen_len={self.gen_len} must be >= 0")
        if self.max_tokens_per_mb is not None and self.max_tokens_per_mb < 1:
            raise ValueError(f"Workload.max_tokens_per_mb={self.max_tokens_per_mb} must be >= 1 or None")

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.gen_len

    @property
    def turn_len(self) -> int:
        """Tokens sampled per turn: the response less its observations, shared by the turns."""
        return (self.gen_len - (self.turns - 1) * self.observation_len) // self.turns

    def n_seqs(self, mfc: MFCDef) -> int:
        """Sequences the call processes: its own ``n_seqs`` or ``batch_size * n_samples_per_prompt``."""
        return mfc.n_seqs or self.batch_size * self.n_samples_per_prompt

    def n_prompts(self, mfc: MFCDef) -> int:
        """Prompts a generation prefills: its sequences over the samples drawn per prompt."""
        return math.ceil(self.n_seqs(mfc) / self.n_samples_per_prompt)

    def calls_per_iteration(self, mfc: MFCDef) -> float:
        """Times an iteration runs ``mfc``: ``rollout_rounds`` for a call of a generation round, else 1."""
        return self.rollout_rounds if mfc.name in self.rollout_calls else 1.0

    def tool_wait_s(self, rows: int) -> float:
        """Seconds a rank of ``rows`` episodes waits for their steps: after each turn but the last,
        ``tool_threads`` at a time, ``tool_s`` each (with overlap the wait hides behind other
        episodes' decoding: an upper bound then). 0 for a single-turn generation."""
        if self.turns < 2:
            return 0.0
        return (self.turns - 1) * math.ceil(rows / self.tool_threads) * self.tool_s

    def n_minibatches(self, mfc: MFCDef) -> int:
        """Optimizer steps per epoch of a train call (1 for other calls)."""
        if mfc.interface_type != "train_step":
            return 1
        return mfc.n_minibatches or self.n_ppo_minibatches

    def n_epochs(self, mfc: MFCDef) -> int:
        """Passes of a train call over its batch: ``ppo_epochs`` for RL (it reads ``rewards``), else 1."""
        rl = mfc.interface_type == "train_step" and "rewards" in mfc.interface_inputs().values()
        return self.ppo_epochs if rl else 1


@dataclass(frozen=True)
class CallCost:
    """Estimated cost of one call: seconds and bytes per device, with a breakdown (seconds)."""

    time_s: float
    act_bytes: float
    weight_bytes: float
    train_state_bytes: float
    first_pass_s: float  # the call's first forward pass (what a layer-by-layer reload can hide behind)
    breakdown: dict[str, float] = field(default_factory=dict)


def _pipeline(slot_s, n_mbs: int, pp: int):
    """Time of ``n_mbs`` micro-batches through ``pp`` stages: ``n_mbs + pp - 1`` slots."""
    return (n_mbs + pp - 1) * slot_s


def _pipelined_decode_step_s(stage_s, hidden_send_s, token_send_s, n_mbs: int, pp: int):
    """One decode step of ``n_mbs`` micro-batches through ``pp`` stages (the pipelined sampler,
    ``rlflow.engine.rollout.pipelined``): each stage runs every micro-batch once, ``n_mbs`` stage
    passes, but a micro-batch's next step waits for its round trip — ``pp`` stage passes,
    ``pp - 1`` sends of its hidden states and one of its tokens back to the first stage. Sends
    overlap the stages' compute; with fewer micro-batches than stages the round trip is the step
    (the bubble)."""
    return np.maximum(n_mbs * stage_s, pp * stage_s + (pp - 1) * hidden_send_s + token_send_s)


def _fsdp_exposed_s(model, strategy, mesh, cluster, compute_s: float, gathers: int, train: bool) -> float:
    """FSDP communication of one (mini-)batch that compute does not hide: ``gathers`` all-gathers
    of the stage in the compute dtype (and a reduce-scatter of fp32 gradients when ``train``),
    one collective per FSDP unit (each decoder layer, and the root: embedding, norm, head).

    With ``cluster.comm_overlaps_compute`` they run while ``compute_s`` computes and only what
    compute cannot hide, and one unit's gather, is exposed; otherwise (gloo on CPU workers) all
    of it adds to the call."""
    if strategy.dp == 1:
        return 0.0
    prec, cross = cluster.precision, dp_group_crosses_hosts(mesh, strategy)
    stage = memory.max_stage_params(model, strategy.pp) / strategy.tp
    units = max(1, int(model.stage_layers(strategy.pp).max())) + 1
    gather = units * float(collective_s(cluster, stage * prec.compute_bytes / units, strategy.dp, cross, "all_gather"))
    # Only trained parameters have gradients to reduce (a LoRA model: its adapters).
    trained = model.stage_trainable_params(strategy.pp) / strategy.tp
    scatter = units * float(
        collective_s(cluster, trained * prec.grad_bytes / units, strategy.dp, cross, "reduce_scatter")
    )
    comm = gathers * gather + (scatter if train else 0.0)
    if not cluster.comm_overlaps_compute:
        return comm
    return max(0.0, comm - compute_s) + gather / units


def _step_sync_s(strategy, mesh, cluster) -> float:
    """The small all-reduces of one optimizer step over dp: the mini-batch's loss units, the
    gradient norm and the step's metrics."""
    return 3 * float(collective_s(cluster, 8, strategy.dp, dp_group_crosses_hosts(mesh, strategy)))


def busy_devices(mesh: DeviceMesh) -> int:
    """Devices of one host that a call on ``mesh`` keeps busy (a profile prices a call on one
    worker of an otherwise idle host apart from one that loads every worker: CPU workers share
    the host's cores, caches and memory bandwidth)."""
    return mesh.num_devices


def _decode_latency_s(model, strategy, cluster) -> float:
    """Fixed seconds a decode step spends on its slowest stage beyond the roofline: the host's launch of
    each layer's kernels (an eager step's kernels are too short to hide it) and, under tp, the wait of
    the layer's two all-reduces for every tp rank (``cluster.decode_tp_step_s`` per ring step)."""
    layers = int(model.stage_layers(strategy.pp).max())
    sync = 2 * 2 * (strategy.tp - 1) * cluster.decode_tp_step_s
    return layers * (cluster.decode_layer_dispatch_s + sync)


def _generate(mfc, model, strategy, mesh, cluster, workload, rates) -> CallCost:
    prec = cluster.precision
    n = workload.n_seqs(mfc)
    rows = seqs_per_rank(n, strategy.dp)
    prompts = seqs_per_rank(workload.n_prompts(mfc), strategy.dp)
    # The sampler cuts micro-batches of whole prompts: in flight under pp, one after another at pp = 1.
    n_mbs = min(num_microbatches(mfc, strategy, n, workload.seq_len), prompts)
    parts = [_rollout_s(model, strategy, mesh, cluster, rates, prompts, rows, n_mbs, workload.prompt_len,
                        workload.gen_len)] if workload.turns == 1 else [
        # Multi-turn (rlflow.engine.rollout.multi_turn): every turn, each episode prefills its whole
        # context (the KV cache does not survive a turn) and samples its turn's tokens.
        _rollout_s(model, strategy, mesh, cluster, rates, rows, rows, n_mbs,
                   workload.prompt_len + t * (workload.turn_len + workload.observation_len), workload.turn_len)
        for t in range(workload.turns)
    ]  # fmt: skip
    busy = busy_devices(mesh)
    scale, fixed = rates.call_scale("generate", busy), rates.call_fixed_s("generate", busy)
    prefill, repeat, decode = (sum(x) * scale for x in zip(*parts))
    first = parts[0][0] * scale
    breakdown = {"fixed_s": fixed, "prefill_s": prefill, "kv_repeat_s": repeat, "decode_s": decode}
    tool = workload.tool_wait_s(rows)
    if workload.turns > 1:
        breakdown["tool_s"] = tool
    act = memory.generate_act_bytes(model, strategy, prec, prompts, rows, workload.prompt_len, workload.gen_len)
    weights = memory.weight_bytes(model, strategy, prec, generate=True)
    if cluster.rollout_memory_fraction is not None:  # vLLM takes its share whatever the batch needs
        act = max(act, cluster.rollout_memory_fraction * cluster.device_memory_bytes - weights)
    return CallCost(fixed + prefill + repeat + decode + tool, act, weights, 0.0, first, breakdown)


def _rollout_s(model, strategy, mesh, cluster, rates, prompts, rows, n_mbs, p_len, gen_len) -> tuple[float, ...]:
    """``(prefill, kv_repeat, decode)`` seconds (uncalibrated) of sampling ``gen_len`` tokens for
    ``rows`` rows of ``prompts`` prompts of ``p_len`` tokens on one rank, in ``n_mbs`` micro-batches."""
    b, tp = cluster.precision.generate_bytes, strategy.tp
    mb, prompt_mb = math.ceil(rows / n_mbs), math.ceil(prompts / n_mbs)
    cross = mesh.num_nodes > 1
    # A lock-step pipeline runs pp - 1 tokens more (its cache holds them too: not priced, a few tokens).
    tokens = gen_len + (strategy.pp - 1 if strategy.pp > 1 and cluster.pipeline_lockstep else 0)
    steps = np.arange(max(0, tokens - 1))
    hidden = model.hidden_size * b
    prefill_pass = StagePass(prompt_mb, p_len, p_len * (p_len + 1) / 2, b, 0, prompt_mb)
    prefill_slot = stage_pass_s(model, strategy, cluster, rates, prefill_pass)
    prefill_slot = prefill_slot + (p2p_s(cluster, prompt_mb * p_len * hidden, cross) if strategy.pp > 1 else 0)
    prefill = float(_pipeline(prefill_slot, n_mbs, strategy.pp))
    # The prompts' cache is repeated for the samples (read once, written for every row).
    prompt_kv = memory.kv_cache_bytes(model, strategy, prompts, p_len, b)
    repeat = float(rates.memory_s(prompt_kv * (1 + rows / prompts))) if rows > prompts else 0.0
    decode_pass = StagePass(mb, 1, p_len + steps + 1, b, p_len + steps, mb)
    decode_slot = stage_pass_s(model, strategy, cluster, rates, decode_pass)
    decode_slot = decode_slot + _decode_latency_s(model, strategy, cluster)
    # Every token: tp rank 0 draws it and broadcasts it to its tp peers, and the sampler's own
    # fixed work (its bytes are in the head's softmax passes).
    broadcast = float(collective_s(cluster, rows * 8, tp, False, "all_gather"))
    per_token = (broadcast + float(rates.sample_step_s(rows))) * tokens
    if strategy.pp > 1:
        hops = p2p_s(cluster, mb * hidden, cross), p2p_s(cluster, mb * 8, cross)  # hidden states on, tokens back
        decode_steps = _pipelined_decode_step_s(decode_slot, *hops, n_mbs, strategy.pp)
    else:
        decode_steps = decode_slot * n_mbs
    return prefill, repeat, float(np.sum(decode_steps)) + per_token


# A layout of one sequence per prompt is taken when it costs at most this share of the padded rows.
SHARED_PROMPT_MAX_SHARE = 0.8


def layout_cost(rows: int, width: int, layer_params: int, pair_cost: int, causal: bool) -> float:
    """Multiply-adds of one decoder layer over ``rows`` sequences of ``width`` tokens: the
    projections and MLP (``layer_params`` a token) and attention (``pair_cost`` a query-key pair,
    half of the pairs when ``causal``, all of them under a dense mask)."""
    pairs = rows * width * width * (0.5 if causal else 1.0)
    return rows * width * layer_params + pairs * pair_cost


def shares_prompts(rows: int, width: int, groups: int, length: int, layer_params: int, pair_cost: int) -> bool:
    """Whether ``groups`` sequences of ``length`` tokens under dense masks (a prompt once, then its
    rows' own tokens) cost at most :data:`SHARED_PROMPT_MAX_SHARE` of ``rows`` padded causal rows
    of ``width``."""
    shared = layout_cost(groups, length, layer_params, pair_cost, causal=False)
    return shared <= SHARED_PROMPT_MAX_SHARE * layout_cost(rows, width, layer_params, pair_cost, causal=True)


def _pass(model: ModelSpec, strategy: ParallelStrategy, workload: Workload, rows: int, nbytes: int) -> StagePass:
    """One training or inference pass over ``rows`` rows: padded, or one sequence per prompt
    where the engine takes that layout (``Workload.shared_prompts``)."""
    s, n = workload.seq_len, workload.n_samples_per_prompt
    padded = StagePass(rows, s, s * (s + 1) / 2, nbytes, 0, rows * s)
    if not workload.shared_prompts or strategy.pp > 1 or n < 2 or rows < 2:
        return padded
    groups, length = math.ceil(rows / n), workload.prompt_len + min(n, rows) * workload.gen_len
    pair = 2 * model.num_heads * model.dim_head
    if not shares_prompts(rows, s, groups, length, model.layer_matmul_params, pair):
        return padded
    return StagePass(groups, length, length * length, nbytes, 0, rows * s)


def _inference(mfc, model, strategy, mesh, cluster, workload, rates) -> CallCost:
    prec = cluster.precision
    n, s = workload.n_seqs(mfc), workload.seq_len
    seqs = seqs_per_rank(n, strategy.dp)
    n_mbs = num_microbatches(mfc, strategy, n, s, max_tokens_per_mb=workload.max_tokens_per_mb)
    mb = math.ceil(seqs / n_mbs)
    b = prec.compute_bytes
    slot = stage_pass_s(model, strategy, cluster, rates, _pass(model, strategy, workload, mb, b))
    if strategy.pp > 1:
        slot = slot + p2p_s(cluster, mb * s * model.hidden_size * b, mesh.num_nodes > 1)
    busy = busy_devices(mesh)
    compute = float(_pipeline(slot, n_mbs, strategy.pp)) * rates.call_scale("inference", busy)
    fixed = rates.call_fixed_s("inference", busy)
    fsdp = _fsdp_exposed_s(model, strategy, mesh, cluster, compute, n_mbs, train=False)
    act = memory.inference_act_bytes(model, strategy, prec, mb, s, n_mbs)
    first = compute / n_mbs
    return CallCost(
        fixed + compute + fsdp,
        act,
        memory.weight_bytes(model, strategy, prec),
        0.0,
        first,
        {"fixed_s": fixed, "forward_s": compute, "fsdp_exposed_s": fsdp},
    )


def _train(mfc, model, strategy, mesh, cluster, workload, rates) -> CallCost:
    prec = cluster.precision
    n, s = workload.n_seqs(mfc), workload.seq_len
    n_minib = workload.n_minibatches(mfc)
    n_steps = n_minib * workload.n_epochs(mfc)
    seqs = seqs_per_rank(n, strategy.dp, n_minib)
    n_mbs = num_microbatches(mfc, strategy, n, s, n_minib, workload.max_tokens_per_mb)
    mb = math.ceil(seqs / n_mbs)
    b = prec.compute_bytes
    p = _pass(model, strategy, workload, mb, b)
    fwd = float(stage_pass_s(model, strategy, cluster, rates, p))
    bwd = float(stage_pass_s(model, strategy, cluster, rates, p, backward=True))
    if workload.gradient_checkpointing:
        bwd += fwd
    hidden_bytes = mb * s * model.hidden_size * b
    p2p = 2 * float(p2p_s(cluster, hidden_bytes, mesh.num_nodes > 1)) if strategy.pp > 1 else 0.0
    busy = busy_devices(mesh)
    scale = rates.call_scale("train_step", busy)
    compute = float(_pipeline(fwd + bwd + p2p, n_mbs, strategy.pp))
    if strategy.pp > 1 and cluster.pipeline_lockstep:  # each forward waits for a neighbour's backward
        compute += n_mbs * abs(bwd - fwd)
    compute *= scale
    # Layers are resharded after forward (and gathered again in backward) only without pipelining.
    gathers = n_mbs * (2 if strategy.pp == 1 else 1)
    fsdp = _fsdp_exposed_s(model, strategy, mesh, cluster, compute, gathers, train=True)
    opt_params = model.stage_trainable_params(strategy.pp) / (strategy.tp * strategy.dp)
    optimizer = float(rates.memory_s(adam_step_bytes_per_param(prec) * opt_params)) * scale
    sync = _step_sync_s(strategy, mesh, cluster)
    fixed = rates.call_fixed_s("train_step", busy)
    total = n_steps * (fixed + compute + fsdp + sync + optimizer)
    act = memory.train_act_bytes(model, strategy, prec, mb, s, n_mbs, workload.gradient_checkpointing)
    return CallCost(
        total,
        act,
        memory.weight_bytes(model, strategy, prec),
        memory.train_state_bytes(model, strategy, prec),
        fwd * scale,
        {
            "fixed_s": n_steps * fixed,
            "compute_s": n_steps * compute,
            "fsdp_exposed_s": n_steps * fsdp,
            "sync_s": n_steps * sync,
            "optimizer_s": n_steps * optimizer,
        },
    )


_ESTIMATORS = {"generate": _generate, "inference": _inference, "train_step": _train}


def call_cost(
    mfc: MFCDef,
    model: ModelSpec,
    strategy: ParallelStrategy,
    mesh: DeviceMesh,
    cluster: ClusterSpec,
    workload: Workload,
    rates: Rates | None = None,
) -> CallCost:
    """Full estimate of one call (time, memory, breakdown); see the module docstring."""
    if strategy.world_size != mesh.size:
        raise ValueError(f"strategy {strategy} does not fill mesh {mesh} of {mesh.size} devices")
    return _ESTIMATORS[mfc.interface_type](mfc, model, strategy, mesh, cluster, workload, rates or Rates(cluster))


def estimate_call(
    mfc: MFCDef,
    model: ModelSpec,
    strategy: ParallelStrategy,
    mesh: DeviceMesh,
    cluster: ClusterSpec,
    workload: Workload,
    profile=None,
) -> tuple[float, float]:
    """``(time_s, act_bytes)`` of one call: seconds, and peak dynamic bytes per device (weights excluded).

    Args:
        mfc, model, strategy, mesh, cluster, workload: what runs where.
        profile: a measured :class:`~rlflow.planner.profile.MachineProfile` or the JSON path
            ``rlflow profile`` wrote; ``None`` uses
            the analytic roofline of ``cluster``.

    >>> from rlflow.dataflow import algorithm_mfcs
    >>> from rlflow.planner.cluster import cluster_preset
    >>> from rlflow.planner.model_spec import model_preset
    >>> gen = algorithm_mfcs("ppo")[0]
    >>> t, act = estimate_call(gen, model_preset("llama2-7b"), ParallelStrategy(dp=8), DeviceMesh(1, 8),
    ...                        cluster_preset("a100-80g"), Workload(batch_size=512, prompt_len=128, gen_len=128))
    >>> 1 < t < 100 and act > 0
    True
    """
    rates = None
    if profile is not None:
        from rlflow.planner.profile import ProfiledRates

        rates = ProfiledRates.from_profile(profile, cluster)
    cost = call_cost(mfc, model, strategy, mesh, cluster, workload, rates)
    return cost.time_s, cost.act_bytes
