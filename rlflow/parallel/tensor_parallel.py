"""Tensor parallelism for HF Llama-family decoders: one split shared by the engines and the layouts.

The split is Megatron's, expressed with DTensor ``parallelize_module``:

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

from typing import Any, Literal

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

__all__ = ["TPKind", "apply_tp", "check_tp_degree", "local_heads", "tp_plan_for"]

TPKind = Literal["vocab", "colwise", "rowwise", "replicate"]

_COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
_LAYER_REPLICATED = ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")


def check_tp_degree(config: Any, tp: int) -> None:
    """Raise ``ValueError`` unless ``tp`` evenly splits the attention heads of ``config``.

    Args:
        config: an HF decoder config with ``num_attention_heads`` and ``num_key_value_heads``.
        tp: tensor-parallel degree, >= 1.
    """
    if tp < 1:
        raise ValueError(f"tp={tp} must be >= 1")
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    if num_heads % tp != 0:
        raise ValueError(f"tp={tp} does not divide num_attention_heads={num_heads}")
    if num_kv_heads % tp != 0:
        raise ValueError(f"tp={tp} does not divide num_key_value_heads={num_kv_heads}")


def _decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(path, layer)`` of every decoder layer under ``<prefix>.layers`` (ModuleList or ModuleDict)."""
    out = []
    for name, module in model.named_modules():
        if name.endswith(".layers") or name == "layers":
            children = module.items() if isinstance(module, nn.ModuleDict) else enumerate(module)
            out += [(f"{name}.{key}", layer) for key, layer in children]
    return out


def _present(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def tp_plan_for(model: nn.Module) -> dict[str, TPKind]:
    """How :func:`apply_tp` splits each module of ``model``, by module path.

    Works on an HF ``*ForCausalLM`` / ``*ForTokenClassification`` model and on a pipeline
    stage (which keeps HF module paths; absent modules are left out).

    Args:
        model: the module tree to describe.

    Returns:
        ``{module_path: kind}`` with kind one of ``"vocab"`` (weight ``Shard(0)``),
        ``"colwise"`` (weight and bias ``Shard(0)``), ``"rowwise"`` (weight ``Shard(1)``,
        bias replicated), ``"replicate"`` (full copy on every tp rank).

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    ...                   num_attention_heads=4, num_key_value_heads=2)
    >>> plan = tp_plan_for(LlamaForCausalLM(cfg))
    >>> plan["model.embed_tokens"], plan["model.layers.0.self_attn.k_proj"], plan["lm_head"]
    ('vocab', 'colwise', 'colwise')
    """
    plan: dict[str, TPKind] = {}
    for name, _ in model.named_modules():
        if name.endswith("embed_tokens"):
            plan[name] = "vocab"
    for layer_path, layer in _decoder_layers(model):
        for suffix in _COLWISE:
            if _present(layer, suffix):
                plan[f"{layer_path}.{suffix}"] = "colwise"
        for suffix in _ROWWISE:
            if _present(layer, suffix):
                plan[f"{layer_path}.{suffix}"] = "rowwise"
        for suffix in _LAYER_REPLICATED:
            if _present(layer, suffix):
                plan[f"{layer_path}.{suffix}"] = "replicate"
    for name, _ in model.named_modules():
        if name.rsplit(".", 1)[-1] == "norm":
            plan[name] = "replicate"
    if _present(model, "lm_head"):
        plan["lm_head"] = "colwise"
    if _present(model, "score"):
        plan["score"] = "replicate"
    return plan


def _style(path: str, kind: TPKind):
    if kind == "vocab":
        # nn.Embedding under RowwiseParallel is sharded on dim 0 (vocabulary); each rank
        # embeds the ids it owns and the partial sums are all-reduced to a full activation.
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if kind == "colwise" and path.rsplit(".", 1)[-1] == "lm_head":
        return ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate(), use_local_output=True)
    if kind == "colwise":
        return ColwiseParallel()
    if kind == "rowwise":
        return RowwiseParallel()
    raise AssertionError(f"no parallel style for kind={kind!r} at {path}")


def _tied_head(model: nn.Module) -> tuple[str, str] | None:
    """``(embedding path, head path)`` when the head weight is the embedding weight object."""
    if not _present(model, "lm_head"):
        return None
    head = model.get_submodule("lm_head")
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and module.weight is head.weight:
            return name, "lm_head"
    return None


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Split ``model`` in place over ``tp_mesh`` by :func:`tp_plan_for` (see the module docstring).

    Replicated modules are left as plain tensors: their inputs are replicated, so every tp
    rank computes the same values and (through the all-reduces in the backward of the
    column-parallel inputs) the same gradients. Tied input/output embeddings stay tied: both
    are ``Shard(0)`` of the same ``(vocab, hidden)`` tensor, so the head is re-pointed at the
    embedding's DTensor after the split.

    Args:
        model: an HF Llama/Qwen2-family ``*ForCausalLM`` or ``*ForTokenClassification``
            model, or a pipeline stage of one, with its parameters on the mesh's device.
        tp_mesh: 1-D device mesh of the tensor-parallel group.

    Returns:
        ``model``, whose split parameters are ``DTensor`` s on ``tp_mesh``.

    Raises:
        ValueError: if the mesh is not 1-D or its size does not divide the head counts.
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"tp_mesh must be 1-D, got shape {tuple(tp_mesh.shape)}")
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no HF `config`; apply_tp needs the head counts")
    check_tp_degree(config, tp_mesh.size())
    if tp_mesh.size() == 1:
        return model
    tied = _tied_head(model)
    plan = {path: _style(path, kind) for path, kind in tp_plan_for(model).items() if kind != "replicate"}
    parallelize_module(model, tp_mesh, plan)
    if tied is not None:
        embed_path, head_path = tied
        model.get_submodule(head_path).weight = model.get_submodule(embed_path).weight
    return model


def local_heads(config: Any, tp: int) -> tuple[int, int]:
    """``(query heads, kv heads)`` each tp rank runs.

    >>> from types import SimpleNamespace
    >>> local_heads(SimpleNamespace(num_attention_heads=8, num_key_value_heads=2), 2)
    (4, 1)
    """
    check_tp_degree(config, tp)
    num_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_attention_heads // tp, num_kv // tp
