"""vLLM's tensor-parallel layout: which slices of the HF parameters a vLLM rank holds, and where.

vLLM fuses and splits a decoder its own way (``vllm/model_executor/layers/linear.py`` and
``vocab_parallel_embedding.py``; the models in ``vllm/model_executor/models/``). Which modules it
fuses, and in what order, is the model family's ``vllm_fused`` table (:mod:`rlflow.families`);
for the Llama-style families:

=================================  =============================  ==========================================
vLLM parameter (rank ``r`` of tp)  holds                          split
=================================  =============================  ==========================================
``self_attn.qkv_proj`` (w, b)      q, k, v of rank ``r``, cat     ``QKVParallelLinear``: ``num_heads / tp``
                                   along dim 0                    q heads; ``num_kv_heads / tp`` kv heads,
                                                                  or one kv head — head ``r // replicas`` —
                                                                  when tp > num_kv_heads (``replicas = tp /
                                                                  num_kv_heads``, ``num_kv_head_replicas``)
``mlp.gate_up_proj`` (w, b)        gate then up of rank ``r``     ``MergedColumnParallelLinear``: even rows
``self_attn.o_proj``,              columns of rank ``r``          ``RowParallelLinear``: even split of dim 1;
``mlp.down_proj``                                                 a bias is full on every rank
``model.embed_tokens``,            rows ``[r*s, (r+1)*s)`` of     ``VocabParallelEmbedding`` /
``lm_head``                        the vocabulary padded to a     ``ParallelLMHead``: ``s = padded / tp``;
                                   multiple of 64, ``s`` rows     rows past the real vocabulary are padding
norms, ``q_norm``/``k_norm``       full                           replicated
=================================  =============================  ==========================================

With tied embeddings vLLM keeps one tensor (``lm_head`` *is* ``model.embed_tokens``). The
biases are the family's (:class:`rlflow.families.LayerFeatures`); a family whose vLLM model has
no o bias (``vllm_o_bias=False``: Qwen3) refuses a config with one.

Two things follow from it, both keyed by HF parameter names like :mod:`rlflow.parallel.layout`:

* :func:`vllm_param_specs` — the :class:`~rlflow.parallel.layout.ParamSpec` s of
  ``build_layout(..., style="vllm")``: where vLLM's split differs from ``torch.chunk`` (kv
  heads replicated, padded vocabulary shards) each spec carries explicit ``tp_bounds``, so the
  reshard planner moves exactly the bytes vLLM needs — a rank receives only its own kv head and
  the real rows of its vocabulary shard, never a full tensor;
* :func:`vllm_param_views` — views *into* vLLM's fused parameters on one rank, in the form of
  :func:`rlflow.parallel.executor.module_param_tensors`, so ``execute_reshard`` writes the
  weights straight into vLLM's memory (no staging copy; padding rows are left alone).

Both are pure and need neither vLLM nor a GPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from rlflow.families import ModelFamily, family_of
from rlflow.parallel.layout import ParamSpec, build_layout, model_param_specs
from rlflow.strategy import ParallelStrategy

__all__ = [
    "VOCAB_PADDING",
    "check_vllm_tp",
    "padded_vocab_size",
    "vllm_param_specs",
    "vllm_param_views",
    "vocab_shard_rows",
]

# vLLM's DEFAULT_VOCAB_PADDING_SIZE (vllm/model_executor/layers/vocab_parallel_embedding.py).
VOCAB_PADDING = 64


def check_vllm_tp(config: Any, tp: int) -> None:
    """Raise ``ValueError`` unless vLLM can split the decoder ``config`` over ``tp`` ranks.

    vLLM needs tp to divide the query heads and the MLP width, and either to divide the kv
    heads or to be a multiple of them (each kv head then lives on ``tp / num_kv_heads`` ranks).
    """
    family = family_of(config)
    dims = family.dims(config)
    heads, kv = dims.num_heads, dims.num_kv_heads
    if tp < 1 or heads % tp:
        raise ValueError(f"vLLM: tp={tp} does not divide num_attention_heads={heads}")
    if kv % tp and tp % kv:
        raise ValueError(
            f"vLLM: tp={tp} must divide num_key_value_heads={kv} or be a multiple of it (kv heads are replicated)"
        )
    if dims.intermediate_size % tp:
        raise ValueError(f"vLLM: tp={tp} does not divide intermediate_size={dims.intermediate_size}")
    if family.features(config).o_bias and not family.vllm_o_bias:
        raise ValueError(
            f"vLLM's {family.name} has no o_proj bias: a {family.name} config with an o_proj bias "
            "(attention_bias=True) cannot be pushed"
        )


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Rows of vLLM's embedding and LM head over all tp ranks: the vocabulary padded to a multiple
    of ``lcm(64, tp)``.

    That is vLLM's ``pad_vocab_size(vocab, 64)`` whenever tp divides it (older vLLM refuses
    the other cases; current vLLM pads to ``lcm(64, tp)`` itself).

    >>> padded_vocab_size(100, 4), padded_vocab_size(100, 3)
    (128, 192)
    """
    step = math.lcm(VOCAB_PADDING, tp)
    return -(-vocab_size // step) * step


def vocab_shard_rows(vocab_size: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """``[start, stop)`` of the real vocabulary rows tp rank ``tp_rank`` holds in vLLM.

    The rank's tensor has ``padded_vocab_size / tp`` rows; its first ``stop - start`` rows are
    these tokens, the rest padding (possibly all of them, on the last ranks).

    >>> [vocab_shard_rows(100, 4, r) for r in range(4)]
    [(0, 32), (32, 64), (64, 96), (96, 100)]
    """
    per_rank = padded_vocab_size(vocab_size, tp) // tp
    start = min(tp_rank * per_rank, vocab_size)
    return start, min(start + per_rank, vocab_size)


def _kv_bounds(num_kv_heads: int, head_dim: int, tp: int) -> tuple[tuple[int, int], ...] | None:
    """Rows of k (or v) per tp rank when tp > num_kv_heads (head ``r // replicas``); else None (even split)."""
    if num_kv_heads >= tp:
        return None
    replicas = tp // num_kv_heads
    return tuple(((r // replicas) * head_dim, (r // replicas + 1) * head_dim) for r in range(tp))


def vllm_param_specs(config: Any, tp: int) -> tuple[ParamSpec, ...]:
    """The HF parameters of a causal LM, each with the slice vLLM's tp rank ``r`` holds.

    Args:
        config: HF decoder config of a registered family.
        tp: vLLM's tensor-parallel size.

    Returns:
        Specs in model order, named and shaped like :func:`~rlflow.parallel.layout.model_param_specs`
        (so plans between an FSDP layout and a vLLM layout need no renaming). Column-parallel
        parameters split dim 0 and row-parallel weights dim 1 evenly; k/v (weights and biases)
        carry ``tp_bounds`` of one replicated head when tp > num_kv_heads; the embedding and an
        untied LM head carry the real rows of every rank's padded vocabulary shard.

    Raises:
        ValueError: vLLM cannot split ``config`` over ``tp`` (:func:`check_vllm_tp`).
    """
    check_vllm_tp(config, tp)
    family = family_of(config)
    dims = family.dims(config)
    kv_bounds = _kv_bounds(dims.num_kv_heads, dims.head_dim, tp)
    vocab = tuple(vocab_shard_rows(dims.vocab_size, tp, r) for r in range(tp))
    specs = []
    for spec in model_param_specs(config, 1, "lm"):  # tp=1: every split parameter has its tp_dim
        module = spec.name.rpartition(".")[0]
        if spec.name in (family.embed_name, family.lm_head_name):
            spec = replace(spec, tp_dim=0, tp_bounds=vocab)
        elif family.is_kv_module(module) and kv_bounds is not None:
            spec = replace(spec, tp_bounds=kv_bounds)
        specs.append(spec)
    return tuple(specs)


def _take(params: Mapping[str, torch.Tensor], name: str, used: set[str]) -> torch.Tensor:
    if name not in params:
        raise ValueError(f"vLLM's model has no parameter {name!r}; its parameters include {sorted(params)[:6]}")
    used.add(name)
    return params[name]


def _fused_part(family: ModelFamily, name: str) -> tuple[str, str, str, int] | None:
    """``(layer path, fused module, leaf, part index)`` of a layer parameter vLLM fuses, else None."""
    module, _, leaf = name.rpartition(".")
    parts = family.split_layer_path(module)
    fused = None if parts is None else family.vllm_fused_part(parts[1])
    if fused is None:
        return None
    return parts[0], fused[0], leaf, fused[1]


def _fused_view(
    family: ModelFamily,
    params: Mapping[str, torch.Tensor],
    name: str,
    boxes: Mapping[str, tuple],
    used: set[str],
) -> torch.Tensor:
    """The rows of vLLM's fused tensor (q/k/v, gate/up) that hold HF parameter ``name`` (its dim 0 part)."""
    layer, fused, kind, index = _fused_part(family, name)
    part_names = [f"{layer}.{p}.{kind}" for p in family.vllm_fused[fused]]
    rows = [boxes[p][0][1] - boxes[p][0][0] for p in part_names]
    tensor = _take(params, f"{layer}.{fused}.{kind}", used)
    if tensor.shape[0] != sum(rows):
        raise ValueError(
            f"vLLM's {layer}.{fused}.{kind} has {tensor.shape[0]} rows on this rank; the layout expects "
            f"{' + '.join(map(str, rows))} (does this vLLM split {fused} differently?)"
        )
    return tensor.narrow(0, sum(rows[:index]), rows[index])


def _vocab_rows(tensor: torch.Tensor, name: str, vocab_size: int, tp: int, box: tuple) -> torch.Tensor:
    """The real rows of a rank's vocabulary shard (the padding rows after them stay as they are)."""
    per_rank = padded_vocab_size(vocab_size, tp) // tp
    if tensor.shape[0] != per_rank:  # another padding would shift every rank's first token
        raise ValueError(
            f"vLLM's {name} has {tensor.shape[0]} rows on this rank; expected {per_rank} "
            f"(vocab_size={vocab_size} padded to {padded_vocab_size(vocab_size, tp)} over tp={tp})"
        )
    return tensor[: box[0][1] - box[0][0]]


def vllm_param_views(
    config: Any, tp: int, tp_rank: int, params: Mapping[str, torch.Tensor]
) -> dict[str, list[torch.Tensor]]:
    """Views into vLLM's parameters of one rank, keyed by HF name (the reshard destination).

    Args:
        config: the model's HF config.
        tp: vLLM's tensor-parallel size; ``tp_rank``: this rank's index in it.
        params: vLLM's parameters on this rank by vLLM name (``model.named_parameters()``):
            ``model.layers.{i}.self_attn.qkv_proj.weight`` …, ``lm_head.weight`` absent or the
            embedding itself when tied.

    Returns:
        ``{hf_name: [views]}`` as :func:`rlflow.parallel.executor.module_param_tensors` returns
        for an HF module, shaped like the boxes of ``build_layout(config, (dp, tp), ranks,
        style="vllm")`` for this tp rank; writing into a view writes vLLM's parameter. A tied
        embedding has one view, two if vLLM kept a separate ``lm_head`` tensor.

    Raises:
        ValueError: a parameter is missing or shaped unlike vLLM's split, or vLLM has a
            parameter this mapping would never write.
    """
    if not 0 <= tp_rank < tp:
        raise ValueError(f"tp_rank={tp_rank} outside tp={tp}")
    family = family_of(config)
    embed_name, head_name = family.embed_name, family.lm_head_name
    boxes = build_layout(config, ParallelStrategy(tp=tp), range(tp), style="vllm").boxes(tp_rank)
    used: set[str] = set()
    out: dict[str, list[torch.Tensor]] = {}
    for name, box in boxes.items():
        if _fused_part(family, name) is not None:
            view = _fused_view(family, params, name, boxes, used)
        elif name in (embed_name, head_name):
            view = _vocab_rows(_take(params, name, used), name, config.vocab_size, tp, box)
        else:
            view = _take(params, name, used)
        expected = tuple(b - a for a, b in box)
        if tuple(view.shape) != expected:
            raise ValueError(
                f"vLLM's tensor for {name} is {tuple(view.shape)} on tp rank {tp_rank}; expected {expected}"
            )
        out[name] = [view]
    head = params.get(head_name)
    if embed_name in out and head_name not in out and head is not None:  # tied: one tensor, or a copy to fill too
        used.add(head_name)
        if head.data_ptr() != params[embed_name].data_ptr():
            out[embed_name].append(_vocab_rows(head, head_name, config.vocab_size, tp, boxes[embed_name]))
    unwritten = sorted(set(params) - used)
    if unwritten:
        raise ValueError(
            f"vLLM parameters that no HF parameter maps to (they would keep dummy values): {unwritten[:6]}"
        )
    return out
