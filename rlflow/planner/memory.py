"""Per-device memory of a call: static state of trained models and the dynamic peak of a call.

Static (lives across calls): a trained model's bf16 weights, bf16 gradients and Adam state —
an fp32 master copy and two fp32 moments, 12 bytes per parameter — all sharded by FSDP over dp
and split by tp and pp: ``(2 + 2 + 12) * P_stage / (tp * dp)`` bytes. Weights of a model used
without training are split by tp and pp and replicated over dp: ``2 * P_stage / tp``.

Dynamic (during one call, weights excluded): the KV cache of a generation, the activations a
training micro-batch saves for backward (or, with gradient checkpointing, only each layer's
input plus one layer being recomputed), the logits, and the transient buffers of FSDP.

All functions return bytes per device for the busiest pipeline stage (the first stage holds
the most in-flight micro-batches under 1F1B; stages are balanced by parameter count).
"""

from __future__ import annotations

import math

from rlflow.planner.mesh import ParallelStrategy
from rlflow.planner.model_spec import ModelSpec

ADAM_STATE_BYTES_PER_PARAM = 12  # fp32 master weights + fp32 first and second moments
GRAD_BYTES_PER_PARAM = 2  # bf16 gradients
LOGIT_BYTES = 4  # logits and log-softmax are computed in fp32


def max_stage_params(model: ModelSpec, pp: int) -> int:
    """Parameters of the largest pipeline stage."""
    return int(model.stage_params(pp).max())


def weight_bytes(model: ModelSpec, strategy: ParallelStrategy, fsdp: bool = False) -> float:
    """Bytes of weights per device: the stage's tp shard, further split over dp when ``fsdp``.

    >>> from rlflow.planner.model_spec import model_preset
    >>> round(weight_bytes(model_preset("llama2-7b"), ParallelStrategy(dp=8), fsdp=True) / 1e9, 3)
    1.685
    """
    shard = max_stage_params(model, strategy.pp) * model.bytes_per_param / strategy.tp
    return shard / strategy.dp if fsdp else shard


def train_state_bytes(model: ModelSpec, strategy: ParallelStrategy) -> float:
    """Gradients and Adam state per device of a model trained under ``strategy`` with FSDP over dp."""
    per_param = GRAD_BYTES_PER_PARAM + ADAM_STATE_BYTES_PER_PARAM
    return max_stage_params(model, strategy.pp) * per_param / (strategy.tp * strategy.dp)


def kv_cache_bytes(model: ModelSpec, strategy: ParallelStrategy, seqs: int, seq_len: int) -> float:
    """KV cache of ``seqs`` sequences of ``seq_len`` tokens on one device (keys and values of its layers)."""
    layers = int(model.stage_layers(strategy.pp).max())
    return 2.0 * seqs * seq_len * layers * model.kv_size / strategy.tp * model.bytes_per_param


def saved_bytes_per_token(model: ModelSpec, tp: int) -> float:
    """Bytes one layer saves for backward per token without checkpointing.

    Saved tensors: the inputs of the two norms and of the qkv and gate/up projections (hidden
    size each, replicated over tp without sequence parallelism), q/k/v and the attention output
    (flash attention keeps no score matrix), the gate and up outputs and their product.
    """
    h, i = model.hidden_size, model.intermediate_size
    return model.bytes_per_param * (4 * h + (model.q_size + 2 * model.kv_size + model.q_size + 3 * i) / tp)


def logits_bytes(model: ModelSpec, tp: int, tokens: int) -> float:
    """fp32 logits and their log-softmax (or gradient) for ``tokens`` tokens of a tp shard of the head."""
    return 2.0 * tokens * math.ceil(model.head_out / tp) * LOGIT_BYTES


def generate_act_bytes(model: ModelSpec, strategy: ParallelStrategy, seqs: int, prompt_len: int, gen_len: int) -> float:
    """Peak of a generation: full KV cache, plus the larger of the prefill's one-layer working set
    and one decode step's logits."""
    kv = kv_cache_bytes(model, strategy, seqs, prompt_len + gen_len)
    prefill = seqs * prompt_len * saved_bytes_per_token(model, strategy.tp)
    return kv + max(prefill, logits_bytes(model, strategy.tp, seqs))


def inference_act_bytes(model: ModelSpec, strategy: ParallelStrategy, mb_seqs: int, seq_len: int, n_mbs: int) -> float:
    """Peak of a forward-only call: one layer's working set and the logits of a micro-batch, plus the
    hidden states of the micro-batches in flight through the pipeline."""
    tokens = mb_seqs * seq_len
    in_flight = min(n_mbs, strategy.pp) * tokens * model.hidden_size * model.bytes_per_param
    return tokens * saved_bytes_per_token(model, strategy.tp) + logits_bytes(model, strategy.tp, tokens) + in_flight


def train_act_bytes(
    model: ModelSpec, strategy: ParallelStrategy, mb_seqs: int, seq_len: int, n_mbs: int, checkpointing: bool = True
) -> float:
    """Peak of a training call (1F1B, FSDP over dp).

    The first stage holds ``min(n_mbs, pp)`` micro-batches in flight; each saves either every
    layer's activations or, with checkpointing, every layer's input plus one layer being
    recomputed. Add the logits of one micro-batch and, under FSDP (dp > 1), the unsharded
    weights of two layers (current and prefetched) and the gradients of one.
    """
    tokens = mb_seqs * seq_len
    layers = int(model.stage_layers(strategy.pp).max())
    per_layer = tokens * saved_bytes_per_token(model, strategy.tp)
    in_flight = min(n_mbs, strategy.pp)
    if checkpointing:
        saved = in_flight * layers * tokens * model.hidden_size * model.bytes_per_param + per_layer
    else:
        saved = in_flight * layers * per_layer
    fsdp = 3.0 * model.layer_params / strategy.tp * model.bytes_per_param if strategy.dp > 1 else 0.0
    return saved + logits_bytes(model, strategy.tp, tokens) + fsdp
