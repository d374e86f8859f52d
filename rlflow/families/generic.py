"""A family for any HF causal LM without a hand-written record, derived from transformers' own description.

A ``model_type`` that transformers maps to a ``*ForCausalLM`` class and whose module tree is the
decoder's of :mod:`rlflow.families.base` (``model.embed_tokens``, ``model.layers.<i>``,
``model.norm``, ``model.rotary_emb``, ``lm_head``; the config's ``base_model_pp_plan`` names the
same three pieces where it declares one) gets a :class:`GenericFamily` on first use. Its parameter
names and shapes are read from the model built on the meta device from the run's config, so
whatever a layer holds (fused projections, q/k norms, experts) is what rlflow moves and prices.

It is trained with data parallelism (FSDP); with pipeline parallelism where the config declares
its ``base_model_pp_plan`` (the stages cut its items as for any family); with tensor parallelism
where its ``base_model_tp_plan`` splits the layers' linears Megatron's way only (``colwise`` /
``rowwise``; other styles gather outputs or split experts, which rlflow's ``apply_tp`` does not
run: :attr:`~ModelFamily.tp_blocker` says so). The built-in sampler generates it through HF's own
modules (the lean decoder needs what only a hand-written record states); vLLM, where vLLM's own
model class fuses modules rlflow maps: its ``vllm_fused`` table is empty here and read from that
class where a vLLM rollout is laid out (:func:`rlflow.parallel.vllm_layout.vllm_fusion`).
Whether a model's HF forward is the decoder's item sequence (no scaled logits, no per-layer
rotary tables) is checked on the model itself before training (``rlflow.engine.pipeline``).
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any

from rlflow.families.base import DecoderDims, LayerFeatures, ModelFamily, config_value

__all__ = ["GenericFamily", "generic_family", "generic_model_types"]

# The pieces of a decoder's base model, as ``base_model_pp_plan`` names them.
_PP_PIECES = ("embed_tokens", "layers", "norm")
_KV_MODULES = ("self_attn.k_proj", "self_attn.v_proj")


@lru_cache(maxsize=1)
def generic_model_types() -> dict[str, str]:
    """``model_type -> *ForCausalLM class name`` of every causal LM transformers ships."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {t: name for t, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if isinstance(name, str)}


def _hf_config(config: Any) -> Any:
    """An HF config object of ``config`` (itself, or built from its ``config.json`` dict)."""
    if not isinstance(config, dict):
        return config.get_text_config() if hasattr(config, "get_text_config") else config
    from transformers import AutoConfig

    fields = {k: v for k, v in config.items() if k != "model_type"}
    return AutoConfig.for_model(config["model_type"], **fields)


@lru_cache(maxsize=64)
def _param_shapes(model_type: str, config_json: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Names and shapes of the ``*ForCausalLM`` of a config (its JSON), built on the meta device."""
    import torch
    from transformers import AutoConfig

    fields = json.loads(config_json)
    config = AutoConfig.for_model(model_type, **{k: v for k, v in fields.items() if k != "model_type"})
    with torch.device("meta"):
        model = GenericFamily.of(model_type).causal_lm_class(config)
    return tuple((name, tuple(p.shape)) for name, p in model.named_parameters())


def _build_config(model_type: str):
    def build(**kwargs: Any) -> Any:
        from transformers import AutoConfig

        # head_dim: some configs default it to a fixed width (128) whatever the hidden size.
        kwargs.setdefault("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
        return AutoConfig.for_model(model_type, **kwargs)

    build.__qualname__ = build.__name__ = f"build_{model_type}_config"
    return build


def _imported_class(class_name: str) -> type:
    import transformers

    return getattr(transformers, class_name)


def _config_json(config: Any) -> str:
    if isinstance(config, dict):
        return json.dumps(config, sort_keys=True)
    return _hf_config(config).to_json_string(use_diff=False)


def _layer_features(model_type: str):
    def features(config: Any) -> LayerFeatures:
        names = {n for n, _ in _param_shapes(model_type, _config_json(config))}
        has = lambda *leaves: any(f"model.layers.0.{leaf}" in names for leaf in leaves)  # noqa: E731
        return LayerFeatures(
            qkv_bias=has("self_attn.q_proj.bias", "self_attn.qkv_proj.bias"),
            o_bias=has("self_attn.o_proj.bias", "self_attn.dense.bias"),
            mlp_bias=has("mlp.down_proj.bias"),
            qk_norm=has("self_attn.q_norm.weight"),
        )

    return features


def _layer_types(config: Any) -> tuple[str, ...]:
    """The config's ``layer_types``; without them, every layer slides when the config class declares
    a ``sliding_window`` and it is set (Mistral's convention, which Mixtral, Phi-3 and Starcoder2
    keep), else none. A model of another convention computes other logits than a stage on a window
    shorter than its rows, which the check before training uses
    (``rlflow.engine.pipeline.stage_forward_mismatch``)."""
    layer_types = config_value(config, "layer_types")
    if layer_types:
        return tuple(layer_types)
    config = _hf_config(config)
    declared = "sliding_window" in inspect.signature(type(config).__init__).parameters
    kind = "sliding_attention" if declared and config_value(config, "sliding_window") is not None else "full_attention"
    return (kind,) * int(config_value(config, "num_hidden_layers"))


@dataclass(frozen=True, eq=False)
class GenericFamily(ModelFamily):
    """A :class:`ModelFamily` whose parameters are read from the HF model itself (module docstring).

    Its tensor-parallel table is the config's plan (empty, with the reason in
    :attr:`~ModelFamily.tp_blocker`, where that plan is not Megatron's); layer modules outside it
    (the norms) are replicated.
    """

    @classmethod
    def of(cls, model_type: str) -> GenericFamily:
        family = generic_family(model_type)
        if family is None:
            raise ValueError(f"transformers has no causal LM of model_type={model_type!r}")
        return family

    def dims(self, config: Any) -> DecoderDims:
        return super().dims(_hf_config(config) if isinstance(config, dict) else config)

    def item_param_shapes(self, config: Any, head: str = "lm") -> list[tuple[str, dict[str, tuple[int, ...]]]]:
        """The pipeline items and their parameters, as the HF model built from ``config`` holds them.

        Raises:
            ValueError: the model holds parameters outside the embedding, the layers, the final
                norm and the LM head (a module tree rlflow's decoder does not run).
        """
        shapes = dict(_param_shapes(self.model_types[0], _config_json(config)))
        num_layers = self.dims(config).num_layers
        items: list[tuple[str, dict[str, tuple[int, ...]]]] = [("embed", self._under(shapes, self.embed_module))]
        items += [(f"layer.{i}", self._under(shapes, f"{self.layers_module}.{i}")) for i in range(num_layers)]
        items.append(("norm", self._under(shapes, self.norm_module)))
        items.append(("head", self.head_param_shapes(config, head)))
        placed = {name for _, item in items[:-1] for name in item} | {self.lm_head_name}
        outside = sorted(set(shapes) - placed)
        if outside:
            raise ValueError(
                f"model_type={self.name!r} holds parameters outside {self.embed_module}, {self.layers_module}.<i>, "
                f"{self.norm_module} and {self.lm_head_module}: {outside[:4]}; rlflow's decoder cannot run it"
            )
        return items

    @staticmethod
    def _under(shapes: dict[str, tuple[int, ...]], module: str) -> dict[str, tuple[int, ...]]:
        return {name: shape for name, shape in shapes.items() if name.startswith(f"{module}.")}

    def layer_param_shapes(self, config: Any, layer: int) -> dict[str, tuple[int, ...]]:
        return dict(self.item_param_shapes(config)[1 + layer][1])

    def tp_kind(self, module: str):
        parts = self.split_layer_path(module)
        if parts is not None and parts[1] not in self.layer_tp:
            # Outside the plan: the layer's norms, whose inputs are the whole (replicated) hidden
            # states; without a plan, every layer module (tp = 1 only).
            return "replicate"
        return super().tp_kind(module)


def _layer_tp(model_type: str, plan: dict[str, str] | None) -> tuple[dict[str, str], str | None]:
    """``(layer_tp, tp_blocker)`` from the config's ``base_model_tp_plan``: its layer modules split
    Megatron's way (``colwise`` / ``rowwise``, as rlflow's :func:`~rlflow.parallel.tensor_parallel.apply_tp`
    does), the rest of a layer replicated; no table, and the reason, for a plan of other styles."""
    why = f"model_type={model_type!r} (generic family: no hand-written record)"
    if not plan:
        return {}, f"{why} declares no base_model_tp_plan: use tp=1 (FSDP shards its layers over dp)"
    other = {k: v for k, v in plan.items() if not k.startswith("layers.*.") or v not in ("colwise", "rowwise")}
    if other:
        return {}, (
            f"{why}: its base_model_tp_plan splits {other} in ways rlflow's tensor parallelism (colwise/rowwise "
            "linears, replicated norms) does not run: use tp=1 (FSDP shards its layers over dp)"
        )
    layer_tp = {k.removeprefix("layers.*."): v for k, v in plan.items()}
    if any(layer_tp.get(m) != "colwise" for m in _KV_MODULES):
        return {}, f"{why}: its base_model_tp_plan has no column-parallel {list(_KV_MODULES)}: use tp=1"
    return layer_tp, None


@cache
def generic_family(model_type: str) -> GenericFamily | None:
    """The generic family of ``model_type`` (one record per process, built on first use), or None
    when transformers ships no ``*ForCausalLM`` of it. It is kept apart from the registry:
    :func:`~rlflow.families.list_families` lists the hand-written records only.

    Raises:
        ValueError: the config declares a ``base_model_pp_plan`` of other pieces than
            ``embed_tokens``, ``layers`` and ``norm`` (a module tree rlflow's decoder does not run).
    """
    class_name = generic_model_types().get(model_type)
    if class_name is None:
        return None
    from transformers import AutoConfig

    prefix = getattr(_imported_class(class_name), "base_model_prefix", None)
    if prefix != "model":
        raise ValueError(
            f"model_type={model_type!r}: transformers.{class_name} keeps its decoder under {prefix!r}, not 'model' "
            "(model.embed_tokens, model.layers, model.norm); rlflow's decoder cannot run it"
        )
    config_class = type(AutoConfig.for_model(model_type))
    pp_plan = getattr(config_class, "base_model_pp_plan", None)
    layer_tp, tp_blocker = _layer_tp(model_type, getattr(config_class, "base_model_tp_plan", None))
    if pp_plan and tuple(pp_plan) != _PP_PIECES:
        raise ValueError(
            f"model_type={model_type!r}: its base_model_pp_plan holds {list(pp_plan)}, not the decoder's "
            f"{list(_PP_PIECES)}; rlflow's decoder cannot run it"
        )
    return GenericFamily(
        name=model_type,
        model_types=(model_type,),
        causal_lm=f"transformers.{class_name}",
        build_config=_build_config(model_type),
        features=_layer_features(model_type),
        layer_tp=layer_tp,
        kv_modules=_KV_MODULES if layer_tp else (),
        vllm_fused={},
        layer_types=_layer_types,
        fast_decode=False,
        tp_blocker=tp_blocker,
        pp_blocker=None
        if pp_plan
        else (
            f"model_type={model_type!r} declares no base_model_pp_plan, whose pieces the generic family's pipeline "
            "stages would cut: use pp=1"
        ),
    )
