"""Seconds of one forward (or backward) pass of one pipeline stage, and of the collectives around it.

A decoder layer on one tp rank is priced as the kernels rlflow's engines run, one after another:

* its matmuls (q, k, v, o, gate, up, down) and the attention scores at the roofline
  ``max(flops / F, bytes / B)``, the bytes being the weights and the matmuls' inputs and outputs;
* its element-wise kernels at the memory bandwidth, added: two RMSNorms, rotary embeddings of q
  and k, SiLU and the gate product, two residual adds, the attention's reads and writes, and in
  a decode step the KV cache — read by the attention and copied once more by HF's
  ``DynamicCache``, which appends a token with ``torch.cat``.

:class:`Rates` holds ``F`` and ``B`` of a cluster (the analytic roofline);
:class:`rlflow.planner.profile.ProfiledRates` replaces them by rates measured on real layers.

The LM head is column-parallel and its logits are all-gathered over tp
(``rlflow.parallel.tensor_parallel``): every tp rank then holds the full-vocabulary logits and
runs the log-softmax and the entropy over them in fp32 (``token_log_probs``), so those kernels
are not divided by tp. tp also costs two all-reduces of the hidden states per layer (column/row
split) and one for the vocabulary-parallel embedding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from rlflow.planner.cluster import ClusterSpec
from rlflow.planner.mesh import DeviceMesh
from rlflow.planner.model_spec import ModelSpec
from rlflow.strategy import ParallelStrategy

BACKWARD_FLOPS_FACTOR = 2.0  # d(input) and d(weight) matmuls each cost one forward
# Element-wise traffic of one HF Llama layer per token, in elements read + written: hidden-size
# tensors (two RMSNorms of 7 passes — upcast, square, mean, scale, weight — and two residual adds
# of 3), q/k-size tensors (rotary: 9 passes over q and over k; attention: read q, k, v, write o)
# and intermediate-size tensors (SiLU 2 passes, gate * up 3 passes).
ELEMENTWISE_HIDDEN = 20
ELEMENTWISE_QK = 11
ELEMENTWISE_INTERMEDIATE = 5
# Matmul inputs and outputs per token, hidden-size part: q, k, v, gate and up each read the
# normed input, o and down each write a hidden-size output.
MATMUL_IO_HIDDEN = 7
# A decode step touches the KV cache three times: the attention reads it, and DynamicCache's
# torch.cat reads it and writes it again with the new token.
KV_CACHE_PASSES = 3
# fp32 passes over the (tokens, vocabulary) logits after the head: log-softmax (max, exp-sum,
# subtract), the picked log-prob, the entropy's softmax and its product with the logits.
LOGIT_PASSES = 6


class Rates:
    """Analytic device rates: the roofline against sustained peak compute and bandwidth."""

    def __init__(self, cluster: ClusterSpec):
        self.flops = cluster.flops
        self.fp32_flops = cluster.fp32_flops
        self.bandwidth = cluster.bandwidth
        # Fixed seconds of framework dispatch, measured by a profile (0 for the analytic roofline):
        self.overhead_s = 0.0  # per layer pass
        self.pass_overhead_s = 0.0  # per pass of a whole stage (embedding, rotary, masks, norm, head)
        self._sample_step_s = cluster.decode_step_dispatch_s

    def matmul_flops(self, nbytes: int | None = None) -> float:
        """Sustained matmul FLOP/s of a pass computing in ``nbytes``-byte elements: a GPU's fp32
        rate for 4 (no TF32: torch's default), its bf16 rate otherwise."""
        return self.fp32_flops if nbytes == 4 else self.flops

    def compute_s(self, flops, matmul_bytes, stream_bytes, tokens, backward: bool = False, nbytes: int | None = None):
        """Seconds of a layer pass: matmuls at the roofline, then the element-wise ``stream_bytes``.

        Args:
            flops: FLOPs of the matmuls and the attention.
            matmul_bytes: bytes the matmuls move (weights, inputs, outputs).
            stream_bytes: bytes of the element-wise kernels.
            tokens: tokens of the pass (a profile's rates depend on it).
            backward: a backward pass (a profile has separate rates).
            nbytes: bytes per element the pass computes in (:meth:`matmul_flops`).
        """
        rate = self.matmul_flops(nbytes)
        matmul = np.maximum(np.asarray(flops) / rate, np.asarray(matmul_bytes) / self.bandwidth)
        return self.overhead_s + matmul + np.asarray(stream_bytes) / self.bandwidth

    def sample_step_s(self, rows):
        """Fixed seconds of the sampler's per-token work (draw, log-softmax, stop check, its loop)
        over ``rows`` rows: the cluster's ``decode_step_dispatch_s`` (the head's softmax bytes are
        priced with the head)."""
        return np.full_like(np.asarray(rows, dtype=np.float64), self._sample_step_s)

    def call_scale(self, interface_type: str, busy_devices: int | None = None) -> float:
        """Measured over estimated seconds of whole calls of this interface type (a profile's
        calibration) when the call keeps ``busy_devices`` devices of a host busy (None: every
        device of the host); 1 for the analytic roofline."""
        return 1.0

    def call_fixed_s(self, interface_type: str, busy_devices: int | None = None) -> float:
        """Seconds a call of this interface type takes whatever its rows (per optimizer step of
        a training call), from a profile's calibration (``busy_devices`` as in
        :meth:`call_scale`); 0 for the analytic roofline."""
        return 0.0

    def memory_s(self, nbytes):
        """Seconds of a purely memory-bound pass (optimizer step, embedding gather, softmax)."""
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


# ----------------------------------------------------------------------------- one layer, the head


def layer_work(
    model: ModelSpec, tp: int, seqs, new_tokens, pairs, nbytes: int, kv_read_tokens=0, kv_passes: int = KV_CACHE_PASSES
):
    """``(flops, matmul_bytes, stream_bytes)`` of one decoder layer on one tp rank.

    Args:
        model: the model.
        tp: tensor-parallel degree.
        seqs: sequences in the micro-batch.
        new_tokens: tokens per sequence processed now (prompt length, or 1 per decode step).
        pairs: (query, key) pairs per sequence the attention scores (``s(s+1)/2`` for a causal
            pass over ``s`` tokens, ``c+1`` for a decode step at context ``c``); may be an array.
        nbytes: bytes per weight and activation element (the call's compute dtype).
        kv_read_tokens: cached tokens per sequence (decode): read, then copied by the append.
        kv_passes: passes over the KV cache per decode step (1 for an engine that appends in place).

    >>> from rlflow.planner.model_spec import ModelSpec
    >>> m = ModelSpec(num_layers=1, hidden_size=4, intermediate_size=8, num_heads=1, num_kv_heads=1, vocab_size=2)
    >>> flops, matmul, stream = layer_work(m, 1, seqs=1, new_tokens=1, pairs=1, nbytes=4)
    >>> int(flops), int(matmul), int(stream)  # 2*(4*16 + 3*32) + 4*4; weights 168*4 + 4*(28+16+24); 4*(80+88+40)
    (336, 944, 832)
    """
    h, i, q, kv = model.hidden_size, model.intermediate_size, model.q_size, model.kv_size
    tokens = seqs * new_tokens
    flops = 2.0 * model.layer_matmul_params * tokens / tp + 4.0 * q * seqs * np.asarray(pairs) / tp
    io = MATMUL_IO_HIDDEN * h + (2 * q + 2 * kv + 3 * i) / tp
    matmul = model.layer_params * nbytes / tp + tokens * nbytes * io
    per_token = ELEMENTWISE_HIDDEN * h + (ELEMENTWISE_QK * (q + kv) + ELEMENTWISE_INTERMEDIATE * i) / tp
    kv_cache = seqs * np.asarray(kv_read_tokens) * 2 * kv / tp * nbytes
    return flops, matmul, tokens * nbytes * per_token + kv_passes * kv_cache


def head_s(model: ModelSpec, tp: int, logit_tokens, nbytes: int, cluster: ClusterSpec, rates: Rates, backward=False):
    """Seconds of the head on ``logit_tokens`` tokens: the column-parallel matmul on the rank's
    vocabulary shard, the all-gather of the logits over tp, and the fp32 log-softmax and entropy
    over the full vocabulary on every tp rank (a scalar value head has one output, nothing to gather).
    """
    factor = BACKWARD_FLOPS_FACTOR if backward else 1.0
    out = math.ceil(model.head_out / tp)
    flops = factor * 2.0 * model.hidden_size * out * np.asarray(logit_tokens)
    weights = model.hidden_size * out * nbytes
    io = np.asarray(logit_tokens) * (model.hidden_size + out) * nbytes
    matmul = np.maximum(flops / rates.matmul_flops(nbytes), factor * (weights + io) / rates.bandwidth)
    full = np.asarray(logit_tokens) * model.head_out
    gather = 0.0 if backward else collective_s(cluster, full * nbytes, tp, False, "all_gather")
    softmax = rates.memory_s(LOGIT_PASSES * full * cluster.precision.logit_bytes)
    return matmul + gather + softmax


@dataclass(frozen=True)
class StagePass:
    """One micro-batch pass through a stage: ``seqs`` x ``new_tokens``, logits on ``logit_tokens``.

    ``pairs`` and ``kv_read_tokens`` may be arrays over decode steps; ``nbytes`` is the dtype
    the pass computes in.
    """

    seqs: int
    new_tokens: int
    pairs: object
    nbytes: int
    kv_read_tokens: object = 0
    logit_tokens: int = 0


def stage_pass_s(model, strategy, cluster, rates: Rates, p: StagePass, backward: bool = False):
    """Seconds of the slowest stage for one micro-batch pass, tp collectives included.

    The backward of the logits' all-gather takes each rank's slice of the (replicated) gradient:
    no communication; the backward of the embedding's all-reduce is an identity.
    """
    tp = strategy.tp
    factor = BACKWARD_FLOPS_FACTOR if backward else 1.0
    tokens = p.seqs * p.new_tokens
    hidden_bytes = tokens * model.hidden_size * p.nbytes
    all_reduce = collective_s(cluster, hidden_bytes, tp, False)
    kv = 0 if backward else p.kv_read_tokens
    kv_passes = KV_CACHE_PASSES if cluster.decode_kv_passes is None else cluster.decode_kv_passes
    flops, matmul, stream = layer_work(model, tp, p.seqs, p.new_tokens, p.pairs, p.nbytes, kv, kv_passes)
    layer = (
        rates.compute_s(factor * flops, factor * matmul, factor * stream, tokens, backward, p.nbytes) + 2 * all_reduce
    )
    head = head_s(model, tp, p.logit_tokens, p.nbytes, cluster, rates, backward)
    embed = rates.memory_s(2 * hidden_bytes) + (0.0 if backward else all_reduce)  # gather rows, sum shards
    layers = model.stage_layers(strategy.pp)
    last = strategy.pp - 1
    stages = [
        layers[k] * layer + (embed if k == 0 else 0) + (head if k == last else 0) + rates.pass_overhead_s
        for k in range(strategy.pp)
    ]
    return np.max(np.stack(np.broadcast_arrays(*stages)), axis=0)
