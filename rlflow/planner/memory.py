"""Per-device memory of a call: static state of trained models and the dynamic peak of a call.

Bytes follow rlflow's engines, in the dtypes of the cluster (:class:`~rlflow.planner.cluster.Precision`):

Static (lives across calls). Every call but a generation runs on FSDP2 over dp
(``rlflow.workers.residency``: homes and forward copies are ``TrainEngine`` stages), so a
model's weights on such a layout are its fp32 master shards: ``param_bytes * P_stage / (tp * dp)``.
A trained model adds its fp32 gradient shards and AdamW's two fp32 moments:
``(grad_bytes + optimizer_bytes) * P_stage / (tp * dp)`` — 16 bytes per parameter in all, on CPU
and GPU alike. A LoRA model (:attr:`ModelSpec.trainable_params`) holds its full base weights, and
its adapters with their gradients and moments: ``(param_bytes + grad_bytes + optimizer_bytes) * A / dp``
for ``A`` adapter parameters (tp = pp = 1). A generation runs on a dp-replicated tensor-parallel copy in the generation dtype
(bf16 for vLLM on GPUs; the HF sampler's copy is in the model's compute dtype):
``generate_bytes * P_stage / tp``.

Dynamic (during one call, weights excluded): the KV cache of a generation, the activations a
training micro-batch saves for backward (or, with gradient checkpointing, only each layer's
input plus one layer being recomputed), the logits, and the buffers FSDP gathers in the compute
dtype (two layers — the current and the prefetched one — plus the root group: embedding, final
norm and head stay gathered).

Logits: the LM head is column-parallel and its output is all-gathered over tp, so every tp rank
holds the full-vocabulary logits of its micro-batch (compute dtype) and the fp32 tensors of the
log-softmax and the entropy's softmax (``rlflow.engine.pipeline.token_log_probs``).

All functions return bytes per device for the busiest pipeline stage (the first stage holds
the most in-flight micro-batches under 1F1B; stages are balanced by parameter count).

Kept copies (:func:`copies_that_fit`): a copy kept between calls (``WorkerSetup.keep_copies``)
turns its weights from dynamic memory of the calls that run on it into static memory of its
devices for the whole step; the query says which models' copies fit that way.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from rlflow.planner.cluster import Precision
from rlflow.planner.model_spec import ModelSpec
from rlflow.strategy import ParallelStrategy

# fp32 tensors of the vocabulary's size besides the logits: the log-softmax input and the softmax.
LOGIT_WORK_TENSORS = 2
# Share of a device's memory a plan with kept copies must leave free: the model's bytes are an
# estimate, and a kept copy that does not fit would fail mid-run instead of costing time.
KEEP_COPY_MARGIN = 0.1


def max_stage_params(model: ModelSpec, pp: int) -> int:
    """Parameters of the largest pipeline stage."""
    return int(model.stage_params(pp).max())


def weight_bytes(model: ModelSpec, strategy: ParallelStrategy, precision: Precision, generate: bool = False) -> float:
    """Bytes of weights per device.

    Args:
        model: the model.
        strategy: its strategy.
        precision: the engines' dtypes.
        generate: a generation's dp-replicated copy (``generate_bytes * P_stage / tp``, plus, for a
            model whose copies merge its adapters (``push_params``), the base of its adapted weights
            in fp32: ``param_bytes * B_stage / tp``); else an FSDP layout (fp32 master shards,
            ``param_bytes * P_stage / (tp * dp)``).

    >>> from rlflow.planner.cluster import Precision
    >>> from rlflow.planner.model_spec import model_preset
    >>> round(weight_bytes(model_preset("llama2-7b"), ParallelStrategy(dp=8), Precision()) / 1e9, 3)
    3.369
    """
    stage = max_stage_params(model, strategy.pp) / strategy.tp
    if generate:
        base = 0.0
        if model.push_params is not None:  # rlflow.parallel.low_rank: W0 kept beside the merged weights
            layers = int(model.stage_layers(strategy.pp).max())
            base = model.push_base_params * layers / model.num_layers / strategy.tp * precision.param_bytes
        return stage * precision.generate_bytes + base
    return stage * precision.param_bytes / strategy.dp


def train_state_bytes(model: ModelSpec, strategy: ParallelStrategy, precision: Precision) -> float:
    """Gradient shards and optimizer state per device of a model trained under ``strategy`` (FSDP over dp),
    over the parameters it trains. A LoRA model's adapters add their fp32 weights here too: they live at the
    trained home only, while :func:`weight_bytes` (the base) prices every FSDP copy, merged ones included."""
    per_param = precision.grad_bytes + precision.optimizer_bytes
    if model.trainable_params is not None:
        per_param += precision.param_bytes
    return model.stage_trainable_params(strategy.pp) * per_param / (strategy.tp * strategy.dp)


def kv_cache_bytes(model: ModelSpec, strategy: ParallelStrategy, seqs: int, seq_len: int, nbytes: int) -> float:
    """KV cache of ``seqs`` sequences of ``seq_len`` tokens on one device, ``nbytes`` per entry."""
    layers = int(model.stage_layers(strategy.pp).max())
    return 2.0 * seqs * seq_len * layers * model.kv_size / strategy.tp * nbytes


def saved_bytes_per_token(model: ModelSpec, tp: int, nbytes: int) -> float:
    """Bytes one layer saves for backward per token without checkpointing, ``nbytes`` per element.

    Saved tensors: the inputs of the two norms and of the qkv and gate/up projections (hidden
    size each, replicated over tp without sequence parallelism), q/k/v and the attention output
    (flash attention keeps no score matrix), the gate and up outputs and their product. A
    mixture-of-experts layer saves these of its active experts (:attr:`ModelSpec.active_intermediate_size`),
    the token's copy handed to each of them, and the router's logits and probabilities.
    """
    h, i = model.hidden_size, model.active_intermediate_size
    routing = model.experts_per_token * h + 2 * model.num_experts if model.num_experts else 0
    return nbytes * (4 * h + routing + (model.q_size + 2 * model.kv_size + model.q_size + 3 * i) / tp)


def logits_bytes(model: ModelSpec, tp: int, tokens: float, precision: Precision, compute_bytes: int) -> float:
    """Logits of ``tokens`` tokens on one tp rank: the head's vocabulary shard (``tp > 1``), the
    all-gathered full-vocabulary logits (``compute_bytes`` each), and the fp32 log-softmax/softmax."""
    v = model.head_out
    local = tokens * math.ceil(v / tp) * compute_bytes if tp > 1 else 0.0
    return local + tokens * v * (compute_bytes + LOGIT_WORK_TENSORS * precision.logit_bytes)


def fsdp_buffer_bytes(model: ModelSpec, strategy: ParallelStrategy, precision: Precision, train: bool) -> float:
    """Weights FSDP2 gathers in the compute dtype: two layers (current and prefetched) and the root
    group (embedding, norm, head are kept gathered), plus one layer's unsharded gradients in training
    (of its trained parameters: a LoRA layer's adapters).

    Nothing when ``dp == 1`` and the compute dtype is the master dtype (the shard is the tensor).
    """
    if strategy.dp == 1 and precision.compute_bytes == precision.param_bytes:
        return 0.0
    layers = 2 * model.layer_params + (model.layer_trainable_params if train else 0)
    root = (model.embedding_params + model.final_norm_params + model.head_params) / strategy.tp
    return (layers / strategy.tp + root) * precision.compute_bytes


def generate_act_bytes(
    model: ModelSpec,
    strategy: ParallelStrategy,
    precision: Precision,
    prompts: int,
    seqs: int,
    prompt_len: int,
    gen_len: int,
) -> float:
    """Peak of a generation on one device: the KV cache of ``seqs`` rows at full length (plus one
    layer's cache being copied by the append), and the larger of the prefill's one-layer working
    set over ``prompts`` prompts and one decode step's logits."""
    b = precision.generate_bytes
    kv = kv_cache_bytes(model, strategy, seqs, prompt_len + gen_len, b)
    layers = max(1, int(model.stage_layers(strategy.pp).max()))
    prefill = prompts * prompt_len * saved_bytes_per_token(model, strategy.tp, b)
    return kv * (1 + 1 / layers) + max(prefill, logits_bytes(model, strategy.tp, seqs, precision, b))


def inference_act_bytes(
    model: ModelSpec, strategy: ParallelStrategy, precision: Precision, mb_seqs: int, seq_len: int, n_mbs: int
) -> float:
    """Peak of a forward-only call: one layer's working set and the logits of a micro-batch, the
    hidden states of the micro-batches in flight through the pipeline, and FSDP's gathered weights."""
    b = precision.compute_bytes
    tokens = mb_seqs * seq_len
    in_flight = min(n_mbs, strategy.pp) * tokens * model.hidden_size * b
    logits = logits_bytes(model, strategy.tp, tokens, precision, b)
    fsdp = fsdp_buffer_bytes(model, strategy, precision, train=False)
    return tokens * saved_bytes_per_token(model, strategy.tp, b) + logits + in_flight + fsdp


def train_act_bytes(
    model: ModelSpec,
    strategy: ParallelStrategy,
    precision: Precision,
    mb_seqs: int,
    seq_len: int,
    n_mbs: int,
    checkpointing: bool = True,
) -> float:
    """Peak of a training call (1F1B, FSDP over dp).

    The first stage holds ``min(n_mbs, pp)`` micro-batches in flight; each saves either every
    layer's activations or, with checkpointing, every layer's input plus one layer being
    recomputed. Add the logits of one micro-batch (and their gradient, as large) and FSDP's
    gathered weights and gradients.
    """
    b = precision.compute_bytes
    tokens = mb_seqs * seq_len
    layers = int(model.stage_layers(strategy.pp).max())
    per_layer = tokens * saved_bytes_per_token(model, strategy.tp, b)
    in_flight = min(n_mbs, strategy.pp)
    if checkpointing:
        saved = in_flight * layers * tokens * model.hidden_size * b + per_layer
    else:
        saved = in_flight * layers * per_layer
    logits = 2 * logits_bytes(model, strategy.tp, tokens, precision, b)
    return saved + logits + fsdp_buffer_bytes(model, strategy, precision, train=True)


@dataclass(frozen=True)
class CallMemory:
    """One call's memory as the simulator prices it (bytes per device of its mesh).

    Attributes:
        model: the model it runs on.
        devices: global device ids of its mesh.
        act_bytes: its dynamic bytes, weights excluded.
        copy_bytes: the weights of the copy it runs on (reallocated, or a reloaded frozen model);
            0 when it runs on the model's resident home.
        layout: identifies the copy: calls of one model with equal ``layout`` share one copy.
    """

    model: str
    devices: tuple[int, ...]
    act_bytes: float
    copy_bytes: float = 0.0
    layout: object = None


def peak_bytes_with_kept_copies(
    static_bytes: Sequence[float], calls: Sequence[CallMemory], kept: Collection[str]
) -> list[float]:
    """Peak bytes of every device when the copies of the models in ``kept`` live between calls.

    A kept copy is static on its devices (counted once however many calls run on it); the
    others stay dynamic, as in the simulator: ``static + kept copies + max(act + copy not kept)``.

    >>> calls = [CallMemory("actor", (0,), 1.0, copy_bytes=4.0, layout="tp1"), CallMemory("ref", (0,), 3.0)]
    >>> peak_bytes_with_kept_copies([10.0], calls, ()), peak_bytes_with_kept_copies([10.0], calls, ("actor",))
    ([15.0], [17.0])
    """
    static = [float(b) for b in static_bytes]
    copies = {(c.model, c.layout, c.devices): c.copy_bytes for c in calls if c.model in kept and c.copy_bytes > 0}
    for (_, _, devices), nbytes in copies.items():
        for d in devices:
            static[d] += nbytes
    dynamic = [0.0] * len(static)
    for c in calls:
        need = c.act_bytes + (0.0 if c.model in kept else c.copy_bytes)
        for d in c.devices:
            dynamic[d] = max(dynamic[d], need)
    return [s + d for s, d in zip(static, dynamic)]


def copies_that_fit(
    static_bytes: Sequence[float],
    calls: Sequence[CallMemory],
    device_memory_bytes: float,
    margin: float = KEEP_COPY_MARGIN,
) -> tuple[str, ...]:
    """The models whose copies can be kept between calls, chosen greedily in order of first call.

    A model is kept when, with its copies and those of the models kept before it made static,
    every device's peak (:func:`peak_bytes_with_kept_copies`) stays within
    ``(1 - margin) * device_memory_bytes``.

    >>> calls = [CallMemory("actor", (0,), 1.0, copy_bytes=4.0, layout="tp1"), CallMemory("ref", (0,), 3.0)]
    >>> copies_that_fit([10.0], calls, 20.0), copies_that_fit([10.0], calls, 18.0)
    (('actor',), ())
    """
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin={margin} must be in [0, 1)")
    limit = (1.0 - margin) * device_memory_bytes
    kept: list[str] = []
    for model in dict.fromkeys(c.model for c in calls if c.copy_bytes > 0):
        if max(peak_bytes_with_kept_copies(static_bytes, calls, (*kept, model)), default=0.0) <= limit:
            kept.append(model)
    return tuple(kept)
