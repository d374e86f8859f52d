"""Tensor parallelism for HF decoders: one split shared by the engines and the layouts.

The split is Megatron's, expressed with DTensor ``parallelize_module``; which module is which
kind is the model family's table (:meth:`rlflow.families.ModelFamily.tp_kind`), which the
layouts read too. For the Llama-style families:

========================  ===============  ===============================================
module                    kind             weight placement on the tp mesh
========================  ===============  ===============================================
``embed_tokens``          ``vocab``        ``Shard(0)``: each rank holds a vocabulary slice
q/k/v, gate/up            ``colwise``      ``Shard(0)`` (and q/k/v biases ``Shard(0)``)
o, down                   ``rowwise``      ``Shard(1)`` (a bias, if any, replicated)
``lm_head``               ``colwise``      ``Shard(0)``; logits all-gathered to full vocab
``score`` (scalar head)   ``replicate``    full copy (one output feature cannot be split)
norms                     ``replicate``    full copy
========================  ===============  ===============================================

Shards follow ``torch.chunk`` sizes (what ``DTensor`` does). Activations between blocks stay
replicated, so a TP-parallelized decoder layer is a drop-in for the plain one: attention
reshapes q/k/v with ``view(..., -1, head_dim)``, which makes each rank run
``num_heads / tp`` query heads and ``num_kv_heads / tp`` kv heads, and
``num_key_value_groups`` (their ratio) is unchanged. This is why tp must divide both counts.

The LM head gathers its output (``Replicate`` logits on every tp rank) rather than keeping
the logits vocabulary-sharded for a loss-parallel cross-entropy: rlflow's losses read
log-probs and entropies of the full distribution, and the gather keeps them oblivious to
TP. Loss-parallel would save ``(tp-1)/tp`` of the logits memory and is the next step for
large vocabularies.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from rlflow.families import ModelFamily, TPKind, family_of

__all__ = ["TPKind", "apply_tp", "check_tp_degree", "local_heads", "tp_plan_for"]


def check_tp_degree(config: Any, tp: int) -> None:
    """Raise ``ValueError`` unless ``tp`` evenly splits the attention heads of ``config``.

    Args:
        config: an HF decoder config of a registered family.
        tp: tensor-parallel degree, >= 1.
    """
    if tp < 1:
        raise ValueError(f"tp={tp} must be >= 1")
    dims = family_of(config).dims(config)
    num_heads, num_kv_heads = dims.num_heads, dims.num_kv_heads
    if num_heads % tp != 0:
        raise ValueError(f"tp={tp} does not divide num_attention_heads={num_heads}")
    if num_kv_heads % tp != 0:
        raise ValueError(f"tp={tp} does not divide num_key_value_heads={num_kv_heads}")


def tp_plan_for(model: nn.Module) -> dict[str, TPKind]:
    """How :func:`apply_tp` splits each module of ``model``, by module path.

    Works on an HF ``*ForCausalLM`` / ``*ForTokenClassification`` model of a registered family
    and on a pipeline stage (which keeps HF module paths; absent modules are left out). Every
    module that holds parameters gets a kind, read from the family.

    Args:
        model: the module tree to describe; ``model.config`` names its family.

    Returns:
        ``{module_path: kind}`` with kind one of ``"vocab"`` (weight ``Shard(0)``),
        ``"colwise"`` (weight and bias ``Shard(0)``), ``"rowwise"`` (weight ``Shard(1)``,
        bias replicated), ``"replicate"`` (full copy on every tp rank).

    Raises:
        ValueError: a module holds parameters that the family does not split.

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    ...                   num_attention_heads=4, num_key_value_heads=2)
    >>> plan = tp_plan_for(LlamaForCausalLM(cfg))
    >>> plan["model.embed_tokens"], plan["model.layers.0.self_attn.k_proj"], plan["lm_head"]
    ('vocab', 'colwise', 'colwise')
    """
    family = _family(model)
    return {
        name: family.tp_kind(name)
        for name, module in model.named_modules()
        if next(module.parameters(recurse=False), None) is not None
    }


def _family(model: nn.Module) -> ModelFamily:
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no HF `config`; tensor parallelism reads its family and heads")
    return family_of(config)


def _style(family: ModelFamily, path: str, kind: TPKind):
    if kind == "vocab":
        # nn.Embedding under RowwiseParallel is sharded on dim 0 (vocabulary); each rank
        # embeds the ids it owns and the partial sums are all-reduced to a full activation.
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if path == family.lm_head_module:
        return ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate(), use_local_output=True)
    if kind == "colwise":
        return ColwiseParallel()
    if kind == "rowwise":
        return RowwiseParallel()
    raise AssertionError(f"no parallel style for kind={kind!r} at {path}")


def _present(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def _is_tied(model: nn.Module, family: ModelFamily) -> bool:
    """Whether the model's LM head weight is its embedding weight object."""
    if not (_present(model, family.lm_head_module) and _present(model, family.embed_module)):
        return False
    return model.get_submodule(family.lm_head_module).weight is model.get_submodule(family.embed_module).weight


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Split ``model`` in place over ``tp_mesh`` by :func:`tp_plan_for` (see the module docstring).

    Replicated modules are left as plain tensors: their inputs are replicated, so every tp
    rank computes the same values and (through the all-reduces in the backward of the
    column-parallel inputs) the same gradients. Tied input/output embeddings stay tied: both
    are ``Shard(0)`` of the same ``(vocab, hidden)`` tensor, so the head is re-pointed at the
    embedding's DTensor after the split.

    Args:
        model: an HF ``*ForCausalLM`` or ``*ForTokenClassification`` model of a registered
            family, or a pipeline stage of one, with its parameters on the mesh's device.
        tp_mesh: 1-D device mesh of the tensor-parallel group.

    Returns:
        ``model``, whose split parameters are ``DTensor`` s on ``tp_mesh``.

    Raises:
        ValueError: if the mesh is not 1-D or its size does not divide the head counts.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"tp_mesh must be 1-D, got shape {tuple(tp_mesh.shape)}")
    family = _family(model)
    check_tp_degree(model.config, tp_mesh.size())
    if tp_mesh.size() == 1:
        return model
    tied = _is_tied(model, family)
    plan = {path: _style(family, path, kind) for path, kind in tp_plan_for(model).items() if kind != "replicate"}
    parallelize_module(model, tp_mesh, plan)
    if tied:
        model.get_submodule(family.lm_head_module).weight = model.get_submodule(family.embed_module).weight
    return model


def local_heads(config: Any, tp: int) -> tuple[int, int]:
    """``(query heads, kv heads)`` each tp rank runs.

    >>> from transformers import LlamaConfig
    >>> local_heads(LlamaConfig(num_attention_heads=8, num_key_value_heads=2), 2)
    (4, 1)
    """
    check_tp_degree(config, tp)
    dims = family_of(config).dims(config)
    return dims.num_heads // tp, dims.num_kv_heads // tp
