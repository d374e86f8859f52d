"""Time of one model function call under a strategy on a mesh (seconds), and its memory (bytes).

Per pipeline stage and micro-batch, every decoder layer costs a roofline
``max(flops / sustained FLOP/s, bytes / sustained bandwidth)`` — or, with a measured profile,
FLOP/s interpolated from per-layer timings (:mod:`rlflow.planner.profile`). On top come the
collectives the strategy implies:

* tp: two all-reduces of the hidden states per layer and pass (Megatron-style column/row
  split), ring cost ``2(n-1)/n * bytes / bw`` plus NCCL latencies, inside a host;
* pp: a point-to-point send of the hidden states per micro-batch and stage boundary, and the
  pipeline bubble: ``n_mb + pp - 1`` micro-batch slots for ``n_mb`` micro-batches, i.e. a
  fraction ``(pp - 1) / n_mb`` over the ideal;
* dp (training only, FSDP): two all-gathers of the weights and one reduce-scatter of the
  gradients per micro-batch, overlapped with compute except for one layer's gather.

Generation = prefill + ``gen_len`` decode steps that read the weights and the growing KV cache
(generation always runs to the maximum length). Training = forward, backward (2x the forward
FLOPs), recomputation under gradient checkpointing, and one Adam step per mini-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from rlflow.dataflow.mfc import MFCDef
from rlflow.planner import memory
from rlflow.planner.cluster import ClusterSpec
from rlflow.planner.mesh import DeviceMesh, ParallelStrategy
from rlflow.planner.model_spec import ModelSpec
from rlflow.planner.space import num_microbatches, seqs_per_rank

BACKWARD_FLOPS_FACTOR = 2.0  # d(input) and d(weight) matmuls each cost one forward
# Adam traffic per parameter: read the bf16 gradient, read+write the fp32 master, m and v,
# write the bf16 weight.
ADAM_TRAFFIC_BYTES_PER_PARAM = 2 + 3 * 8 + 2
# verl's default token budget per GPU micro-batch (ppo_max_token_len_per_gpu).
DEFAULT_MAX_TOKENS_PER_MB = 16384


@dataclass(frozen=True)
class Workload:
    """What one iteration processes.

    Attributes:
        batch_size: prompts per iteration.
        prompt_len / gen_len: tokens per prompt / per response (generation runs to gen_len).
        n_samples_per_prompt: responses per prompt (GRPO/RLOO group size).
        n_ppo_minibatches: optimizer steps per RL train call unless the MFC sets its own.
        gradient_checkpointing: recompute activations in backward.
        max_tokens_per_mb: token budget of one micro-batch (``None``: unbounded).
    """

    batch_size: int
    prompt_len: int
    gen_len: int
    n_samples_per_prompt: int = 1
    n_ppo_minibatches: int = 4
    gradient_checkpointing: bool = True
    max_tokens_per_mb: int | None = DEFAULT_MAX_TOKENS_PER_MB

    def __post_init__(self) -> None:
        for attr in ("batch_size", "prompt_len", "n_samples_per_prompt", "n_ppo_minibatches"):
            if getattr(self, attr) < 1:
                raise ValueError(f"Workload.{attr}={getattr(self, attr)} must be >= 1")
        if self.gen_len < 0:
            raise ValueError(f"Workload.gen_len={self.gen_len} must be >= 0")
        if self.max_tokens_per_mb is not None and self.max_tokens_per_mb < 1:
            raise ValueError(f"Workload.max_tokens_per_mb={self.max_tokens_per_mb} must be >= 1 or None")

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.gen_len

    def n_seqs(self, mfc: MFCDef) -> int:
        """Sequences the call processes: its own ``n_seqs`` or ``batch_size * n_samples_per_prompt``."""
        return mfc.n_seqs or self.batch_size * self.n_samples_per_prompt

    def n_minibatches(self, mfc: MFCDef) -> int:
        """Optimizer steps of a train call (1 for other calls)."""
        if mfc.interface_type != "train_step":
            return 1
        return mfc.n_minibatches or self.n_ppo_minibatches


class Rates:
    """Analytic device rates: the roofline against sustained peak compute and bandwidth."""

    def __init__(self, cluster: ClusterSpec):
        self.flops = cluster.flops
        self.bandwidth = cluster.bandwidth

    def compute_s(self, flops, nbytes, tokens, backward: bool = False):
        """Seconds of a kernel sequence doing ``flops`` and moving ``nbytes`` over ``tokens`` tokens."""
        return np.maximum(np.asarray(flops) / self.flops, np.asarray(nbytes) / self.bandwidth)

    def memory_s(self, nbytes):
        """Seconds of a purely memory-bound pass (optimizer step, embedding gather)."""
        return np.asarray(nbytes) / self.bandwidth


# ----------------------------------------------------------------------------- collectives


def collective_s(cluster: ClusterSpec, nbytes, n: int, cross_host: bool, kind: str = "all_reduce"):
    """Ring collective over ``n`` ranks: NCCL latency plus ``steps/n * bytes / bw``.

    ``kind`` is ``all_reduce`` (2(n-1) steps) or ``all_gather`` / ``reduce_scatter`` ((n-1)
    steps, ``nbytes`` = the full gathered size).
    """
    if n <= 1:
        return np.zeros_like(np.asarray(nbytes, dtype=np.float64))
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    bw = cluster.inter_host_bandwidth if cross_host else cluster.intra_host_bandwidth
    step_latency = cluster.inter_host_latency_s if cross_host else cluster.intra_host_latency_s
    return cluster.collective_latency_s + steps * step_latency + steps / n * np.asarray(nbytes) / bw


def p2p_s(cluster: ClusterSpec, nbytes, cross_host: bool):
    """One point-to-point send."""
    bw = cluster.inter_host_bandwidth if cross_host else cluster.intra_host_bandwidth
    step_latency = cluster.inter_host_latency_s if cross_host else cluster.intra_host_latency_s
    return cluster.collective_latency_s + step_latency + np.asarray(nbytes) / bw


def dp_group_crosses_hosts(mesh: DeviceMesh, strategy: ParallelStrategy) -> bool:
    """A dp group spans ``dp*tp`` consecutive devices; it stays in a host when they fit in one."""
    span = strategy.dp * strategy.tp
    return mesh.num_nodes > 1 and not (span <= mesh.devices_per_node and mesh.devices_per_node % span == 0)


# ----------------------------------------------------------------------------- one pass of one stage


def layer_flops_bytes(model: ModelSpec, tp: int, seqs, new_tokens, pairs, kv_read_tokens=0):
    """FLOPs and bytes of one decoder layer on one tp rank.

    Args:
        seqs: sequences in the micro-batch.
        new_tokens: tokens per sequence processed now (prompt length, or 1 per decode step).
        pairs: (query, key) pairs per sequence the attention scores (``s(s+1)/2`` for a causal
            pass over ``s`` tokens, ``c+1`` for a decode step at context ``c``); may be an array.
        kv_read_tokens: cached tokens per sequence whose keys/values are read (decode).
    """
    b, h, i = model.bytes_per_param, model.hidden_size, model.intermediate_size
    tokens = seqs * new_tokens
    qkv = model.q_size + 2 * model.kv_size
    flops = 2.0 * model.layer_matmul_params * tokens / tp + 4.0 * model.q_size * seqs * np.asarray(pairs) / tp
    # Reads and writes of every intermediate tensor (norms, projections, attention, MLP, residuals).
    act = tokens * b * (14 * h + (2 * qkv + 2 * model.q_size + 6 * i) / tp)
    kv = seqs * np.asarray(kv_read_tokens) * 2 * model.kv_size / tp * b
    return flops, model.layer_params * b / tp + act + kv


def head_flops_bytes(model: ModelSpec, tp: int, logit_tokens):
    """FLOPs and bytes of the head on ``logit_tokens`` tokens (vocabulary-parallel over tp)."""
    out = math.ceil(model.head_out / tp)
    flops = 2.0 * model.hidden_size * out * logit_tokens
    nbytes = model.hidden_size * out * model.bytes_per_param + 2 * logit_tokens * out * memory.LOGIT_BYTES
    return flops, nbytes


@dataclass(frozen=True)
class _Pass:
    """One forward micro-batch pass through a stage: ``seqs`` x ``new_tokens``, logits on ``logit_tokens``."""

    seqs: int
    new_tokens: int
    pairs: object  # scalar or array over decode steps
    kv_read_tokens: object = 0
    logit_tokens: int = 0


def stage_pass_s(model, strategy, cluster, rates, p: _Pass, backward: bool = False):
    """Seconds of the slowest stage for one micro-batch pass, tp all-reduces included."""
    tp = strategy.tp
    factor = BACKWARD_FLOPS_FACTOR if backward else 1.0
    tokens = p.seqs * p.new_tokens
    hidden_bytes = tokens * model.hidden_size * model.bytes_per_param
    all_reduce = collective_s(cluster, hidden_bytes, tp, False)
    lf, lb = layer_flops_bytes(model, tp, p.seqs, p.new_tokens, p.pairs, 0 if backward else p.kv_read_tokens)
    layer = rates.compute_s(factor * lf, factor * lb, tokens, backward) + 2 * all_reduce
    hf, hb = head_flops_bytes(model, tp, p.logit_tokens)
    # Vocabulary-parallel heads reduce the softmax statistics across tp (two tiny all-reduces).
    softmax_stats = 2 * collective_s(cluster, 8 * p.logit_tokens, tp, False)
    head = rates.compute_s(factor * hf, factor * hb, p.logit_tokens, backward) + softmax_stats
    embed = rates.memory_s(2 * hidden_bytes) + all_reduce  # gather rows, sum the vocabulary shards
    layers = model.stage_layers(strategy.pp)
    last = strategy.pp - 1
    stages = [layers[k] * layer + (embed if k == 0 else 0) + (head if k == last else 0) for k in range(strategy.pp)]
    return np.max(np.stack(np.broadcast_arrays(*stages)), axis=0)


# ----------------------------------------------------------------------------- calls


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


def _generate(mfc, model, strategy, mesh, cluster, workload, rates) -> CallCost:
    n = workload.n_seqs(mfc)
    seqs = seqs_per_rank(n, strategy.dp)
    n_mbs = num_microbatches(mfc, strategy, n, workload.seq_len)
    mb = math.ceil(seqs / n_mbs)
    cross = mesh.num_nodes > 1
    p_len, steps = workload.prompt_len, np.arange(workload.gen_len)
    hidden = model.hidden_size * model.bytes_per_param
    prefill_slot = stage_pass_s(model, strategy, cluster, rates, _Pass(mb, p_len, p_len * (p_len + 1) / 2, 0, mb))
    prefill_slot = prefill_slot + (p2p_s(cluster, mb * p_len * hidden, cross) if strategy.pp > 1 else 0)
    prefill = float(_pipeline(prefill_slot, n_mbs, strategy.pp))
    decode_slot = stage_pass_s(model, strategy, cluster, rates, _Pass(mb, 1, p_len + steps + 1, p_len + steps, mb))
    if strategy.pp > 1:
        decode_slot = decode_slot + p2p_s(cluster, mb * hidden, cross)
    # In steady state the micro-batches circulate: each step takes max(n_mbs, pp) slots.
    decode = float(np.sum(decode_slot)) * max(n_mbs, strategy.pp)
    act = memory.generate_act_bytes(model, strategy, seqs, p_len, workload.gen_len)
    return CallCost(
        prefill + decode,
        act,
        memory.weight_bytes(model, strategy),
        0.0,
        prefill,
        {"prefill_s": prefill, "decode_s": decode},
    )


def _inference(mfc, model, strategy, mesh, cluster, workload, rates) -> CallCost:
    n, s = workload.n_seqs(mfc), workload.seq_len
    seqs = seqs_per_rank(n, strategy.dp)
    n_mbs = num_microbatches(mfc, strategy, n, s, max_tokens_per_mb=workload.max_tokens_per_mb)
    mb = math.ceil(seqs / n_mbs)
    slot = stage_pass_s(model, strategy, cluster, rates, _Pass(mb, s, s * (s + 1) / 2, 0, mb * s))
    if strategy.pp > 1:
        slot = slot + p2p_s(cluster, mb * s * model.hidden_size * model.bytes_per_param, mesh.num_nodes > 1)
    t = float(_pipeline(slot, n_mbs, strategy.pp))
    act = memory.inference_act_bytes(model, strategy, mb, s, n_mbs)
    return CallCost(t, act, memory.weight_bytes(model, strategy), 0.0, t, {"forward_s": t})


def _train(mfc, model, strategy, mesh, cluster, workload, rates) -> CallCost:
    n, s = workload.n_seqs(mfc), workload.seq_len
    n_minib = workload.n_minibatches(mfc)
    seqs = seqs_per_rank(n, strategy.dp, n_minib)
    n_mbs = num_microbatches(mfc, strategy, n, s, n_minib, workload.max_tokens_per_mb)
    mb = math.ceil(seqs / n_mbs)
    p = _Pass(mb, s, s * (s + 1) / 2, 0, mb * s)
    fwd = float(stage_pass_s(model, strategy, cluster, rates, p))
    bwd = float(stage_pass_s(model, strategy, cluster, rates, p, backward=True))
    if workload.gradient_checkpointing:
        bwd += fwd
    hidden_bytes = mb * s * model.hidden_size * model.bytes_per_param
    p2p = 2 * float(p2p_s(cluster, hidden_bytes, mesh.num_nodes > 1)) if strategy.pp > 1 else 0.0
    compute = float(_pipeline(fwd + bwd + p2p, n_mbs, strategy.pp))
    stage_bytes = memory.max_stage_params(model, strategy.pp) / strategy.tp * model.bytes_per_param
    cross = dp_group_crosses_hosts(mesh, strategy)
    gather = float(collective_s(cluster, stage_bytes, strategy.dp, cross, "all_gather"))
    scatter = float(collective_s(cluster, stage_bytes, strategy.dp, cross, "reduce_scatter"))
    fsdp_comm = n_mbs * (2 * gather + scatter)
    layers = max(1, int(model.stage_layers(strategy.pp).max()))
    # FSDP prefetches the next layer while computing this one: only the first gather is exposed.
    fsdp_exposed = max(0.0, fsdp_comm - compute) + (gather / layers if strategy.dp > 1 else 0.0)
    opt_params = memory.max_stage_params(model, strategy.pp) / (strategy.tp * strategy.dp)
    optimizer = float(rates.memory_s(ADAM_TRAFFIC_BYTES_PER_PARAM * opt_params))
    total = n_minib * (compute + fsdp_exposed + optimizer)
    act = memory.train_act_bytes(model, strategy, mb, s, n_mbs, workload.gradient_checkpointing)
    return CallCost(
        total,
        act,
        memory.weight_bytes(model, strategy, fsdp=True),
        memory.train_state_bytes(model, strategy),
        fwd,
        {"compute_s": n_minib * compute, "fsdp_exposed_s": n_minib * fsdp_exposed, "optimizer_s": n_minib * optimizer},
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
        profile: a measured profile (dict or JSON path from ``rlflow profile``); ``None`` uses
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
