"""A model family as one record: what every part of rlflow needs to know about an HF decoder.

rlflow splits, moves and prices models by their HF parameter names. Everything that depends on
the architecture — the parameter names and shapes, the tensor-parallel split, vLLM's fused
names, the pipeline items and their module paths, the planner's dimensions, the tiny-model
factory — is read from a :class:`ModelFamily`, found by the config's ``model_type``
(:func:`family_of`). Adding a family is one module that calls :func:`register_family`.

The families registered so far share the Llama module tree::

    model.embed_tokens                      pipeline item "embed"    vocabulary-parallel
    model.layers.<i>.<layer module>         pipeline item "layer.i"  by ModelFamily.layer_tp
    model.norm                              pipeline item "norm"     replicated
    lm_head  (or score, a value head)       pipeline item "head"     column-parallel (score replicated)

and differ in their layers' biases, q/k norms and attention windows.

This package sits at the bottom of rlflow's layers: it imports nothing else from rlflow.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Any, Literal

__all__ = [
    "DECODER_LAYER_TP",
    "DecoderDims",
    "HEAD_KINDS",
    "LayerFeatures",
    "ModelFamily",
    "TPKind",
    "VLLM_FUSED",
    "config_value",
    "decoder_layer_shapes",
    "family_of",
    "get_family",
    "import_path",
    "list_families",
    "register_family",
]

TPKind = Literal["vocab", "colwise", "rowwise", "replicate"]
HEAD_KINDS = ("lm", "value")

# The tensor-parallel split of a Llama-style decoder layer (Megatron's), by module path in the
# layer: column-parallel q/k/v/gate/up (weight and bias on dim 0), row-parallel o/down (weight
# on dim 1, bias replicated), norms replicated.
DECODER_LAYER_TP: Mapping[str, TPKind] = MappingProxyType(
    {
        "self_attn.q_proj": "colwise",
        "self_attn.k_proj": "colwise",
        "self_attn.v_proj": "colwise",
        "self_attn.o_proj": "rowwise",
        "mlp.gate_proj": "colwise",
        "mlp.up_proj": "colwise",
        "mlp.down_proj": "rowwise",
        "input_layernorm": "replicate",
        "post_attention_layernorm": "replicate",
    }
)

# vLLM's fused modules of a Llama-style layer and the HF modules stacked along dim 0 in them, in
# order (vllm/model_executor/models/llama.py: QKVParallelLinear, MergedColumnParallelLinear).
VLLM_FUSED: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    }
)


def config_value(config: Any, key: str, default: Any = None) -> Any:
    """``config.key`` of an HF config object, or ``config[key]`` of its ``config.json`` dict."""
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


@dataclass(frozen=True)
class DecoderDims:
    """The dimensions of a decoder, read from its HF config (:meth:`ModelFamily.dims`).

    Attributes:
        num_layers, hidden_size, intermediate_size, num_heads, num_kv_heads, vocab_size: as in the
            HF config (``num_kv_heads`` defaults to ``num_heads``).
        head_dim: per-head size; the config's ``head_dim`` or ``hidden_size // num_heads``.
        tie_embeddings: the LM head is the embedding tensor.
    """

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_embeddings: bool


@dataclass(frozen=True)
class LayerFeatures:
    """What varies between the decoder layers of the families (:attr:`ModelFamily.features`).

    Attributes:
        qkv_bias: q/k/v projections have a bias.
        o_bias: the output projection has a bias.
        mlp_bias: gate/up/down projections have a bias.
        qk_norm: per-head RMSNorm on q and k (``self_attn.q_norm`` / ``k_norm``, ``head_dim`` wide).
    """

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False


def decoder_layer_shapes(dims: DecoderDims, features: LayerFeatures) -> dict[str, tuple[int, ...]]:
    """Parameter names (relative to the layer) and shapes of a Llama-style decoder layer.

    Names are in HF's module registration order: attention (q, k, v, o, then q/k norms), MLP
    (gate, up, down), then the two layer norms.

    >>> dims = DecoderDims(1, 64, 128, 4, 2, 16, 100, False)
    >>> shapes = decoder_layer_shapes(dims, LayerFeatures(qkv_bias=True))
    >>> shapes["self_attn.k_proj.weight"], shapes["self_attn.k_proj.bias"], len(shapes)
    ((32, 64), (32,), 12)
    """
    h, d, inter = dims.hidden_size, dims.head_dim, dims.intermediate_size
    q_out, kv_out = dims.num_heads * d, dims.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {}

    def linear(module: str, out_features: int, in_features: int, bias: bool) -> None:
        shapes[f"{module}.weight"] = (out_features, in_features)
        if bias:
            shapes[f"{module}.bias"] = (out_features,)

    linear("self_attn.q_proj", q_out, h, features.qkv_bias)
    linear("self_attn.k_proj", kv_out, h, features.qkv_bias)
    linear("self_attn.v_proj", kv_out, h, features.qkv_bias)
    linear("self_attn.o_proj", h, q_out, features.o_bias)
    if features.qk_norm:
        shapes["self_attn.q_norm.weight"] = (d,)
        shapes["self_attn.k_norm.weight"] = (d,)
    linear("mlp.gate_proj", inter, h, features.mlp_bias)
    linear("mlp.up_proj", inter, h, features.mlp_bias)
    linear("mlp.down_proj", h, inter, features.mlp_bias)
    shapes["input_layernorm.weight"] = (h,)
    shapes["post_attention_layernorm.weight"] = (h,)
    return shapes


def _config_layer_types(config: Any) -> tuple[str, ...]:
    """HF's per-layer attention kinds (``config.layer_types``), full attention where absent."""
    layer_types = config_value(config, "layer_types")
    return tuple(layer_types) if layer_types else ("full_attention",) * config_value(config, "num_hidden_layers")


@dataclass(frozen=True, eq=False)  # a registered singleton: compared and hashed by identity
class ModelFamily:
    """Everything rlflow knows about one HF decoder architecture.

    Attributes:
        name: the family's name (``models.<role>.family`` in a run's config).
        model_types: HF ``model_type`` values this family reads.
        causal_lm: HF ``*ForCausalLM`` class, or its import path (``"transformers.LlamaForCausalLM"``)
            imported on the first read of :attr:`causal_lm_class`: a process that only reads the
            record (the driver: config, planner) then never imports HF's modeling code, seconds
            of start-up.
        build_config: ``build_config(**hf_config_kwargs)`` -> HF config, for tiny models; it
            takes the keyword names of ``LlamaConfig`` and sets whatever else the family needs
            (``import_path("transformers.LlamaConfig")`` imports the class on the first call).
        features: ``features(config) -> LayerFeatures`` (biases, q/k norms) of an HF config
            object or ``config.json`` dict.
        layer_shapes: ``layer_shapes(dims, features)`` -> ``{name in layer: shape}``.
        layer_tp: the tensor-parallel split of every parameter-holding module of a layer.
        kv_modules: column-parallel layer modules whose output rows are kv heads: replicated
            when tp does not divide the kv heads (vLLM keeps one head per group of ranks).
        vllm_fused: vLLM's fused layer modules and the HF modules stacked in them, in order (empty
            in the generic family, whose table is read from vLLM's model class:
            ``rlflow.parallel.vllm_layout.vllm_fusion``).
        vllm_o_bias: vLLM's model of the family has an o_proj bias when HF's has one.
        layer_types: ``layer_types(config)`` -> attention kind of every layer,
            ``"full_attention"`` or ``"sliding_attention"`` (the masks the pipeline builds).
        embed_module, layers_module, norm_module, rotary_module, lm_head_module,
            value_head_module: module paths in the HF model (``*ForCausalLM`` /
            ``*ForTokenClassification``) of the pipeline items and the rotary embedding.
        fast_decode: the layers are the Llama decoder with this family's :class:`LayerFeatures`
            (pre-norm RMSNorm, RoPE attention, optional per-head q/k RMSNorm, gated MLP of
            ``config.hidden_act``) and full or sliding-window attention, so the built-in
            sampler's lean decoder (:mod:`rlflow.engine.rollout.fast_decode`) may run them;
            False sends the family through HF's modules.
        tp_blocker, pp_blocker: why tensor (pipeline) parallelism is not offered for the family
            (the planner proposes tp = 1 (pp = 1), and a config asking more is refused with it);
            None where it is.
    """

    name: str
    model_types: tuple[str, ...]
    causal_lm: type | str
    build_config: Callable[..., Any]
    features: Callable[[Any], LayerFeatures]
    layer_shapes: Callable[[DecoderDims, LayerFeatures], dict[str, tuple[int, ...]]] = decoder_layer_shapes
    layer_tp: Mapping[str, TPKind] = field(default_factory=lambda: DECODER_LAYER_TP)
    kv_modules: tuple[str, ...] = ("self_attn.k_proj", "self_attn.v_proj")
    vllm_fused: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: VLLM_FUSED)
    vllm_o_bias: bool = True
    layer_types: Callable[[Any], tuple[str, ...]] = _config_layer_types
    embed_module: str = "model.embed_tokens"
    layers_module: str = "model.layers"
    norm_module: str = "model.norm"
    rotary_module: str = "model.rotary_emb"
    lm_head_module: str = "lm_head"
    value_head_module: str = "score"
    fast_decode: bool = True
    tp_blocker: str | None = None
    pp_blocker: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_tp", MappingProxyType(dict(self.layer_tp)))  # read-only tables
        object.__setattr__(self, "vllm_fused", MappingProxyType(dict(self.vllm_fused)))
        if not self.model_types:
            raise ValueError(f"family {self.name!r} has no model_types")
        if isinstance(self.causal_lm, str) and "." not in self.causal_lm:
            raise ValueError(f"family {self.name!r}: causal_lm={self.causal_lm!r} is not a 'module.Class' import path")
        for module in (*self.kv_modules, *(p for parts in self.vllm_fused.values() for p in parts)):
            if module not in self.layer_tp:
                raise ValueError(
                    f"family {self.name!r}: {module!r} is not a module of layer_tp {sorted(self.layer_tp)}"
                )
        for module in self.kv_modules:
            if self.layer_tp[module] != "colwise":
                raise ValueError(f"family {self.name!r}: kv module {module!r} must be 'colwise'")

    def __reduce__(self) -> tuple[Callable[[str], ModelFamily], tuple[str]]:
        # Pickled (Ray, deepcopy) by name: the copy is the registered record itself.
        return get_family, (self.name,)

    @cached_property
    def causal_lm_class(self) -> type:
        """The HF ``*ForCausalLM`` class (:attr:`causal_lm`, imported on first read)."""
        if not isinstance(self.causal_lm, str):
            return self.causal_lm
        return _imported(self.causal_lm)

    # ---------------------------------------------------------------- names and shapes

    @property
    def embed_name(self) -> str:
        """The embedding weight's name (also the name of a tied LM head)."""
        return f"{self.embed_module}.weight"

    @property
    def lm_head_name(self) -> str:
        """The untied LM head weight's name."""
        return f"{self.lm_head_module}.weight"

    def dims(self, config: Any) -> DecoderDims:
        """The dimensions of an HF config object or ``config.json`` dict.

        Raises:
            ValueError: the config lacks one of the HF keys the dimensions are read from.
        """
        keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
        missing = [k for k in keys if config_value(config, k) is None]
        if missing:
            raise ValueError(f"HF config of family {self.name!r} lacks {missing}")
        heads, hidden = int(config_value(config, "num_attention_heads")), int(config_value(config, "hidden_size"))
        return DecoderDims(
            num_layers=int(config_value(config, "num_hidden_layers")),
            hidden_size=hidden,
            intermediate_size=int(config_value(config, "intermediate_size")),
            num_heads=heads,
            num_kv_heads=int(config_value(config, "num_key_value_heads") or heads),
            head_dim=int(config_value(config, "head_dim") or hidden // heads),
            vocab_size=int(config_value(config, "vocab_size")),
            tie_embeddings=bool(config_value(config, "tie_word_embeddings", False)),
        )

    def layer_param_shapes(self, config: Any, layer: int) -> dict[str, tuple[int, ...]]:
        """Full HF names and shapes of the parameters of decoder layer ``layer``, in registration order."""
        return self._prefixed(layer, self.layer_shapes(self.dims(config), self.features(config)))

    def _prefixed(self, layer: int, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        prefix = f"{self.layers_module}.{layer}."
        return {prefix + name: shape for name, shape in shapes.items()}

    def head_param_shapes(self, config: Any, head: str = "lm") -> dict[str, tuple[int, ...]]:
        """Parameters of the ``head`` item: the LM head (the embedding when tied) or a value head.

        Args:
            config: HF config.
            head: ``"lm"`` (``*ForCausalLM``) or ``"value"`` (``*ForTokenClassification``:
                ``score``, ``config.num_labels`` outputs).
        """
        dims = self.dims(config)
        if head == "lm":
            name = self.embed_name if dims.tie_embeddings else self.lm_head_name
            return {name: (dims.vocab_size, dims.hidden_size)}
        if head == "value":
            num_labels = int(config_value(config, "num_labels", 2))
            shapes = {f"{self.value_head_module}.weight": (num_labels, dims.hidden_size)}
            if config_value(config, "token_classification_bias", True):
                shapes[f"{self.value_head_module}.bias"] = (num_labels,)
            return shapes
        raise ValueError(f"head={head!r}; expected one of {HEAD_KINDS}")

    def item_param_shapes(self, config: Any, head: str = "lm") -> list[tuple[str, dict[str, tuple[int, ...]]]]:
        """The pipeline items ``embed``, ``layer.0`` … ``layer.{L-1}``, ``norm``, ``head`` with their parameters.

        With tied embeddings the ``head`` item holds the embedding weight (the last pipeline
        stage keeps its own copy of it).
        """
        dims = self.dims(config)
        items = [("embed", {self.embed_name: (dims.vocab_size, dims.hidden_size)})]
        shapes = self.layer_shapes(dims, self.features(config))  # the same for every layer
        items += [(f"layer.{i}", self._prefixed(i, shapes)) for i in range(dims.num_layers)]
        items.append(("norm", {f"{self.norm_module}.weight": (dims.hidden_size,)}))
        items.append(("head", self.head_param_shapes(config, head)))
        return items

    # ---------------------------------------------------------------- tensor parallelism

    def split_layer_path(self, path: str) -> tuple[str, str] | None:
        """``("model.layers.3", "self_attn.q_proj")`` for a path inside a decoder layer, else None."""
        prefix = f"{self.layers_module}."
        if not path.startswith(prefix):
            return None
        index, _, inner = path[len(prefix) :].partition(".")
        if not index.isdigit() or not inner:
            return None
        return f"{prefix}{index}", inner

    def tp_kind(self, module: str) -> TPKind:
        """How tensor parallelism splits the parameters of ``module`` (a module path of the HF model).

        Raises:
            ValueError: ``module`` is not a parameter-holding module of this family.
        """
        if module == self.embed_module:
            return "vocab"
        if module == self.lm_head_module:
            return "colwise"
        if module in (self.norm_module, self.value_head_module):
            return "replicate"
        parts = self.split_layer_path(module)
        if parts is not None and parts[1] in self.layer_tp:
            return self.layer_tp[parts[1]]
        raise ValueError(
            f"family {self.name!r} has no tensor-parallel split for module {module!r}; layer modules: "
            f"{sorted(self.layer_tp)}"
        )

    def is_kv_module(self, module: str) -> bool:
        """Whether ``module`` (a full path) is a column-parallel module whose rows are kv heads."""
        parts = self.split_layer_path(module)
        return parts is not None and parts[1] in self.kv_modules

    def vllm_fused_part(self, module: str) -> tuple[str, int] | None:
        """``(vLLM's fused module, index of the part)`` for a layer module vLLM fuses, else None.

        >>> from rlflow.families import get_family
        >>> get_family("llama").vllm_fused_part("self_attn.k_proj")
        ('self_attn.qkv_proj', 1)
        """
        for fused, parts in self.vllm_fused.items():
            if module in parts:
                return fused, parts.index(module)
        return None


def _imported(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def import_path(path: str) -> Callable[..., Any]:
    """A callable that imports ``path`` (``"module.Name"``) on its first call and calls it.

    For a family's ``build_config``: HF's config classes import ``torch.distributed.tensor`` and
    HF's kernel hub (about a second), which a process that only plans never needs.

    >>> half = import_path("fractions.Fraction")
    >>> half(1, 2)
    Fraction(1, 2)
    """

    def call(*args: Any, **kwargs: Any) -> Any:
        return _imported(path)(*args, **kwargs)

    call.__qualname__ = call.__name__ = path.rpartition(".")[2]
    return call


_REGISTRY: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    """Add ``family`` to the registry; refuses a name or ``model_type`` already registered.

    Returns:
        ``family``, so a family module can write ``LLAMA = register_family(ModelFamily(...))``.
    """
    if family.name in _REGISTRY:
        raise ValueError(f"model family {family.name!r} is already registered")
    for other in _REGISTRY.values():
        shared = set(family.model_types) & set(other.model_types)
        if shared:
            raise ValueError(f"model_type {sorted(shared)} of family {family.name!r} already belongs to {other.name!r}")
    _REGISTRY[family.name] = family
    return family


def get_family(name: str) -> ModelFamily:
    """The registered family called ``name``, or the generic family of the HF ``model_type`` ``name``."""
    family = _REGISTRY.get(name) or _generic_family(name)
    if family is None:
        raise ValueError(f"unknown model family {name!r}; expected one of {list_families()} or an HF model_type")
    return family


def family_of(config: Any) -> ModelFamily:
    """The family whose ``model_types`` hold ``config.model_type`` (an HF config object or dict);
    for a ``model_type`` of no hand-written record, its generic family (:mod:`rlflow.families.generic`).

    Raises:
        ValueError: transformers ships no causal LM of the ``model_type``, or one whose module
            tree rlflow's decoder does not run.
    """
    model_type = config_value(config, "model_type")
    for family in _REGISTRY.values():
        if model_type in family.model_types:
            return family
    generic = _generic_family(model_type) if isinstance(model_type, str) else None
    if generic is not None:
        return generic
    known = ", ".join(f"{f.name} {list(f.model_types)}" for f in _REGISTRY.values())
    raise ValueError(
        f"model_type={model_type!r} belongs to no registered model family and transformers ships no causal LM of "
        f"it; registered: {known}"
    )


def _generic_family(model_type: str) -> ModelFamily | None:
    # Imported here: the generic family imports transformers' auto mappings, which records never need.
    from rlflow.families.generic import generic_family

    return generic_family(model_type)


def list_families() -> list[str]:
    """Names of the registered families, sorted."""
    return sorted(_REGISTRY)
