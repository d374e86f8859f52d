"""Shapes of decoder-only transformers, as the cost and memory models see them.

A model is a sequence of *pipeline items* — ``embed``, ``layer.0`` … ``layer.{L-1}``,
``norm``, ``head`` — the same items, with the same parameter counts, as
``rlflow.parallel.layout.pipeline_items``: the head counts a tied embedding again, because
under pipeline parallelism the last stage holds its own copy. Stages are cut from items by
:func:`balanced_stages`, which reproduces ``rlflow.parallel.layout.assign_pipeline_stages``
(the planner may not import from ``rlflow.parallel``, which sits above it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property, lru_cache
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ModelSpec:
    """Dimensions of a Llama-style decoder (RMSNorm, rotary attention with GQA, SwiGLU MLP).

    :meth:`from_hf_config` reads them through the config's model family (:mod:`rlflow.families`).

    Attributes:
        num_layers, hidden_size, intermediate_size, num_heads, num_kv_heads, vocab_size: as in
            the HF config.
        head_dim: per-head size; ``None`` means ``hidden_size // num_heads``.
        tie_embeddings: the LM head shares the embedding tensor.
        qkv_bias / o_bias / mlp_bias: biases on q/k/v, o, and the MLP projections.
        qk_norm: per-head RMSNorm on q and k.
        value_head: the head is a scalar value/score head (critic, reward model) instead of
            the LM head.
        name: for reports.
        layer_param_count, layer_tensor_count: parameters and parameter tensors of one decoder
            layer as the model's family lists them (experts, fused projections and norms of any
            kind included); None: counted from the dimensions above (a Llama-style layer).
        tp_blocker, pp_blocker: why the model runs with tp = 1 (pp = 1) only (its family's
            :attr:`~rlflow.families.ModelFamily.tp_blocker` / ``pp_blocker``); None: any degree its
            heads (layers) allow.
        num_experts, experts_per_token: a mixture-of-experts layer's routed experts and how many
            of them each token runs through (top-k); 0 for a dense model.
        layer_expert_params: parameters of one layer's routed experts (every expert), part of
            ``layer_params``: memory holds all of them, a token computes with
            ``experts_per_token / num_experts`` of them.
        layer_active_matmul_count: multiplying parameters a token runs through in one layer (a
            mixture-of-experts layer: attention, router, shared experts and its top-k experts);
            None: counted from the dimensions (a Llama-style layer).
        trainable_params: parameters its optimizer trains, all inside the decoder layers (a LoRA
            model's adapters, :func:`lora_param_count`); the base weights stay frozen beside them.
            None: every parameter trains.
        push_params, push_tensors: what a push after the first moves to each device of a kept copy
            whose copy merges the adapters itself (a LoRA model, ``lora.push: adapters``): the
            adapters (:func:`lora_param_count`) and their tensors (``A`` and ``B`` of each adapted
            linear), all inside the decoder layers. None: the weights the copy holds.
        push_base_params: elements of the adapted weights (``out · in`` each), whose base such a
            generation copy keeps in fp32 beside its weights to merge the adapters into.

    Shapes only: the bytes of a weight or an activation depend on the engine and the device,
    and come from the cluster (:class:`rlflow.planner.cluster.Precision`).

    >>> m = model_preset("llama2-7b")
    >>> m.num_params, m.layer_params
    (6738415616, 202383360)
    """

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    head_dim: int | None = None
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    value_head: bool = False
    name: str = "custom"
    layer_param_count: int | None = None
    layer_tensor_count: int | None = None
    tp_blocker: str | None = None
    pp_blocker: str | None = None
    num_experts: int = 0
    experts_per_token: int = 0
    layer_expert_params: int = 0
    layer_active_matmul_count: int | None = None
    trainable_params: int | None = None
    push_params: int | None = None
    push_tensors: int = 0
    push_base_params: int = 0

    def __post_init__(self) -> None:
        for attr in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "vocab_size"):
            if getattr(self, attr) < 1:
                raise ValueError(f"ModelSpec.{attr}={getattr(self, attr)} must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} does not divide num_heads={self.num_heads}")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"experts_per_token={self.experts_per_token} must be in [1, num_experts={self.num_experts}]"
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"num_heads={self.num_heads} does not divide hidden_size={self.hidden_size}; give head_dim"
            )

    # ------------------------------------------------------------------ dimensions

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def q_size(self) -> int:
        """Output features of q_proj (= input features of o_proj)."""
        return self.num_heads * self.dim_head

    @property
    def kv_size(self) -> int:
        """Output features of k_proj and of v_proj."""
        return self.num_kv_heads * self.dim_head

    @property
    def head_out(self) -> int:
        """Output features of the head: the vocabulary, or 1 for a value head."""
        return 1 if self.value_head else self.vocab_size

    # ------------------------------------------------------------------ parameter counts

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def layer_matmul_params(self) -> int:
        """Weights of the layer's matmuls a token runs through (q, k, v, o, gate, up, down; of a
        mixture-of-experts layer, its router and active experts only): what its FLOPs scale with."""
        if self.layer_active_matmul_count is not None:
            return self.layer_active_matmul_count
        h = self.hidden_size
        return h * self.q_size + 2 * h * self.kv_size + self.q_size * h + 3 * h * self.intermediate_size

    @property
    def active_intermediate_size(self) -> int:
        """The MLP width a token runs through: ``intermediate_size``, or of a mixture-of-experts layer
        its active experts' (and shared experts') widths together, from its active matmul weights
        less attention's and the router's (a gated MLP: three matrices of hidden x width)."""
        if not self.num_experts or self.layer_active_matmul_count is None:
            return self.intermediate_size
        h = self.hidden_size
        attention = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        mlp = self.layer_active_matmul_count - attention - h * self.num_experts
        return max(1, round(mlp / (3 * h)))

    @property
    def layer_params(self) -> int:
        """All parameters of one decoder layer: matmuls, biases and norms."""
        if self.layer_param_count is not None:
            return self.layer_param_count
        h, i = self.hidden_size, self.intermediate_size
        biases = (self.q_size + 2 * self.kv_size) * self.qkv_bias + h * self.o_bias + (2 * i + h) * self.mlp_bias
        return self.layer_matmul_params + biases + 2 * h + 2 * self.dim_head * self.qk_norm

    @property
    def final_norm_params(self) -> int:
        return self.hidden_size

    @property
    def head_params(self) -> int:
        """Parameters of the head item; a tied LM head counts the embedding copy the last stage holds."""
        return self.hidden_size * self.head_out

    @property
    def num_params(self) -> int:
        """Distinct parameters of the model (a tied embedding counted once)."""
        tied = self.tie_embeddings and not self.value_head
        head = 0 if tied else self.head_params
        return self.embedding_params + self.num_layers * self.layer_params + self.final_norm_params + head

    @property
    def num_active_params(self) -> int:
        """Parameters a token computes with: all of them, but only ``experts_per_token / num_experts``
        of every layer's routed experts (a mixture-of-experts model)."""
        if not self.num_experts:
            return self.num_params
        idle = self.layer_expert_params * (self.num_experts - self.experts_per_token) // self.num_experts
        return self.num_params - self.num_layers * idle

    def stage_trainable_params(self, pp: int) -> int:
        """Trained parameters of the largest pipeline stage: all its parameters, or its share of the adapters."""
        stage = int(self.stage_params(pp).max())
        if self.trainable_params is None:
            return stage
        return self.trainable_params * max(1, int(self.stage_layers(pp).max())) // self.num_layers

    @property
    def layer_trainable_params(self) -> int:
        """Trained parameters of one decoder layer (a LoRA model: its adapters)."""
        return self.layer_params if self.trainable_params is None else self.trainable_params // self.num_layers

    @cached_property
    def item_params(self) -> np.ndarray:
        """Parameters of every pipeline item, shape ``(num_layers + 3,)``: embed, layers, norm, head."""
        items = [self.embedding_params] + [self.layer_params] * self.num_layers
        return np.array(items + [self.final_norm_params, self.head_params], dtype=np.int64)

    @cached_property
    def item_tensors(self) -> np.ndarray:
        """Parameter tensors of every pipeline item, shape ``(num_layers + 3,)`` (one collective each when moved)."""
        layer = self.layer_tensor_count
        if layer is None:
            layer = 9 + 3 * self.qkv_bias + self.o_bias + 3 * self.mlp_bias + 2 * self.qk_norm
        return np.array([1] + [layer] * self.num_layers + [1, 1], dtype=np.int64)

    @property
    def num_items(self) -> int:
        return self.num_layers + 3

    def stages(self, pp: int) -> list[range]:
        """Item indices of every pipeline stage (see :func:`balanced_stages`)."""
        return [range(a, b) for a, b in self.stage_bounds(pp)]

    def stage_bounds(self, pp: int) -> np.ndarray:
        """``[start, stop)`` item indices of every stage, shape ``(pp, 2)``."""
        return np.array(stage_bounds(tuple(self.item_params.tolist()), pp), dtype=np.int64)

    def stage_params(self, pp: int) -> np.ndarray:
        """Parameters held by every stage, shape ``(pp,)``; with ``pp == 1`` a tied head is not counted twice."""
        if pp == 1:
            return np.array([self.num_params], dtype=np.int64)
        cum = np.concatenate([[0], np.cumsum(self.item_params)])
        bounds = self.stage_bounds(pp)
        return cum[bounds[:, 1]] - cum[bounds[:, 0]]

    def stage_layers(self, pp: int) -> np.ndarray:
        """Decoder layers in every stage, shape ``(pp,)`` (items 1..num_layers are the layers)."""
        bounds = self.stage_bounds(pp)
        return np.clip(bounds[:, 1], 1, self.num_layers + 1) - np.clip(bounds[:, 0], 1, self.num_layers + 1)

    def as_value_model(self) -> ModelSpec:
        """The same trunk with a scalar head (critic or reward model)."""
        return replace(self, value_head=True, name=f"{self.name}-value" if not self.value_head else self.name)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_hf_config(cls, config: Any, value_head: bool = False, name: str | None = None) -> ModelSpec:
        """Read an HF decoder config of a registered model family (the config object or its dict).

        Args:
            config: a ``transformers`` config object or the dict of its ``config.json``.
            value_head: build the critic/reward variant with a scalar head.
            name: for reports; defaults to the config's ``_name_or_path`` or ``model_type``.

        Raises:
            ValueError: the config's ``model_type`` is of no registered family, or it lacks a dimension.
        """
        # Imported here: the families import transformers (seconds), which planning presets never needs.
        from rlflow.families import config_value, family_of

        family = family_of(config)
        dims, features = family.dims(config), family.features(config)
        layer = family.layer_param_shapes(config, 0)
        experts = _experts(config, layer)
        return cls(
            num_layers=dims.num_layers,
            hidden_size=dims.hidden_size,
            intermediate_size=dims.intermediate_size,
            num_heads=dims.num_heads,
            num_kv_heads=dims.num_kv_heads,
            vocab_size=dims.vocab_size,
            head_dim=dims.head_dim,
            tie_embeddings=dims.tie_embeddings,
            qkv_bias=features.qkv_bias,
            o_bias=features.o_bias,
            mlp_bias=features.mlp_bias,
            qk_norm=features.qk_norm,
            value_head=value_head,
            name=name or config_value(config, "_name_or_path") or config_value(config, "model_type"),
            layer_param_count=sum(math.prod(shape) for shape in layer.values()),
            layer_tensor_count=len(layer),
            tp_blocker=family.tp_blocker,
            pp_blocker=family.pp_blocker,
            **experts,
        )


def lora_param_count(config: Any, r: int, target_modules: Sequence[str]) -> int:
    """Parameters of LoRA adapters of rank ``r`` on the named linear modules of every decoder layer:
    ``r * (in_features + out_features)`` per adapted linear (peft's ``lora_A`` and ``lora_B``).

    Args:
        config: an HF decoder config of a registered model family (object or dict).
        r: rank of the adapters.
        target_modules: last components of the linear module paths, as ``models.<role>.lora`` names them.
    """
    return sum(r * (rows + cols) for rows, cols in _adapted_shapes(config, target_modules))


def lora_tensor_count(config: Any, target_modules: Sequence[str]) -> int:
    """Adapter tensors of LoRA on the named linear modules of every decoder layer: ``lora_A`` and ``lora_B`` each."""
    return 2 * len(_adapted_shapes(config, target_modules))


def lora_adapted_params(config: Any, target_modules: Sequence[str]) -> int:
    """Elements of the weights LoRA adapts on the named linear modules of every decoder layer (``out · in`` each)."""
    return sum(rows * cols for rows, cols in _adapted_shapes(config, target_modules))


def _adapted_shapes(config: Any, target_modules: Sequence[str]) -> list[tuple[int, int]]:
    """``(out, in)`` of every weight the named linear modules of the decoder layers have."""
    from rlflow.families import family_of

    family, targets = family_of(config), set(target_modules)
    shapes = []
    for layer in range(family.dims(config).num_layers):
        for name, shape in family.layer_param_shapes(config, layer).items():
            module, _, leaf = name.rpartition(".")
            if leaf == "weight" and len(shape) == 2 and module.rpartition(".")[2] in targets:
                shapes.append((shape[0], shape[1]))
    return shapes


# Config keys of a mixture-of-experts model's routed experts, and of its top-k.
_NUM_EXPERTS_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_EXPERT_MARKER = ".experts."  # parameter paths of routed experts (shared experts are named otherwise)


def _experts(config: Any, layer: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """The :class:`ModelSpec` fields of a mixture-of-experts layer (read from its parameter shapes), or none.

    Layer 0 stands for every layer: a model whose layers differ (dense layers between sparse ones)
    is priced as if all were like the first.
    """
    from rlflow.families import config_value

    num = next((n for k in _NUM_EXPERTS_KEYS if isinstance(n := config_value(config, k), int) and n > 0), 0)
    expert = {name: math.prod(shape) for name, shape in layer.items() if _EXPERT_MARKER in name}
    if not num or not expert:
        return {}
    top_k = int(config_value(config, "num_experts_per_tok"))
    # Multiplying parameters: every matrix (biases and norms are vectors), experts at top_k / num.
    matmul = sum(math.prod(shape) for name, shape in layer.items() if len(shape) >= 2 and name not in expert)
    expert_matmul = sum(math.prod(layer[name]) for name in expert if len(layer[name]) >= 2)
    return dict(
        num_experts=num,
        experts_per_token=top_k,
        layer_expert_params=sum(expert.values()),
        layer_active_matmul_count=matmul + expert_matmul * top_k // num,
    )


@lru_cache(maxsize=4096)
def stage_bounds(item_sizes: tuple[int, ...], pp: int) -> tuple[tuple[int, int], ...]:
    """``[start, stop)`` item bounds of ``pp`` balanced stages; cached (see :func:`balanced_stages`)."""
    return tuple((r.start, r.stop) for r in balanced_stages(item_sizes, pp))


def balanced_stages(item_sizes: Sequence[int], pp: int) -> list[range]:
    """Cut items into ``pp`` contiguous non-empty stages: smallest largest stage, then smallest
    sum of squared stage sizes, then earliest cuts (dynamic programming over cut points).

    Sizes are divided by their common divisor so that sums of squares stay exact in int64; the
    rare model whose squares would still overflow falls back to Python integers.

    >>> balanced_stages([4, 1, 1, 1, 1, 4], 2)
    [range(0, 3), range(3, 6)]
    """
    n = len(item_sizes)
    if not 1 <= pp <= n:
        raise ValueError(f"pp={pp} must be in [1, {n}] (one item per stage at least)")
    sizes = [int(x) for x in item_sizes]
    if any(x < 0 for x in sizes):
        raise ValueError(f"item sizes must be >= 0, got {sizes}")
    g = math.gcd(*sizes) or 1
    scaled = [x // g for x in sizes]
    if sum(scaled) ** 2 < 2**62:
        starts = _stage_dp_int64(np.array(scaled, dtype=np.int64), pp)
    else:
        starts = _stage_dp_python(scaled, pp)
    stages, j = [], n
    for k in range(pp, 0, -1):
        stages.append(range(int(starts[k][j]), j))
        j = int(starts[k][j])
    return stages[::-1]


def _stage_dp_int64(sizes: np.ndarray, pp: int) -> np.ndarray:
    """``start[k, j]``: where the k-th stage begins in the best cut of ``sizes[:j]`` into k stages.

    For each k, all (i, j) candidates at once: stage k spans ``[i, j)``.
    """
    n = len(sizes)
    prefix = np.concatenate([[0], np.cumsum(sizes)])
    big = np.iinfo(np.int64).max
    best_max = np.full(n + 1, big)
    best_sq = np.full(n + 1, big)
    best_max[0] = best_sq[0] = 0
    start = np.zeros((pp + 1, n + 1), dtype=np.int64)
    i, j = np.arange(n + 1)[:, None], np.arange(n + 1)[None, :]
    size = prefix[None, :] - prefix[:, None]  # size[i, j] of items [i, j)
    for k in range(1, pp + 1):
        # stage k ends at j, leaving one item at least for each of the pp - k later stages
        valid = (i >= k - 1) & (i < j) & (j >= k) & (j <= n - (pp - k)) & (best_max[:, None] < big)
        cand_max = np.where(valid, np.maximum(best_max[:, None], size), big)
        cand_sq = np.where(valid, best_sq[:, None] + size * size, big)
        top = cand_max.min(axis=0)
        cand_sq = np.where(cand_max == top[None, :], cand_sq, big)
        low = cand_sq.min(axis=0)
        # argmax returns the first (earliest) i reaching both minima: ties go to the earliest cut.
        start[k] = np.argmax((cand_max == top[None, :]) & (cand_sq == low[None, :]), axis=0)
        best_max, best_sq = top, low
    return start


def _stage_dp_python(sizes: list[int], pp: int) -> list[list[int]]:
    """The same dynamic program with Python integers (no overflow)."""
    n = len(sizes)
    prefix = [0]
    for x in sizes:
        prefix.append(prefix[-1] + x)
    worst = (float("inf"), float("inf"))
    best = [[worst] * (n + 1) for _ in range(pp + 1)]
    start = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = (0, 0)
    for k in range(1, pp + 1):
        for j in range(k, n - (pp - k) + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] is worst:
                    continue
                size = prefix[j] - prefix[i]
                cand = (max(best[k - 1][i][0], size), best[k - 1][i][1] + size * size)
                if cand < best[k][j]:
                    best[k][j], start[k][j] = cand, i
    return start


# Published configs (config.json of meta-llama/Llama-2-{7b,13b,70b}-hf and codellama/CodeLlama-34b-hf).
_PRESETS: dict[str, dict[str, int]] = {
    "llama2-7b": dict(num_layers=32, hidden_size=4096, intermediate_size=11008, num_heads=32, num_kv_heads=32),
    "llama2-13b": dict(num_layers=40, hidden_size=5120, intermediate_size=13824, num_heads=40, num_kv_heads=40),
    "llama2-34b": dict(num_layers=48, hidden_size=8192, intermediate_size=22016, num_heads=64, num_kv_heads=8),
    "llama2-70b": dict(num_layers=80, hidden_size=8192, intermediate_size=28672, num_heads=64, num_kv_heads=8),
}


def model_preset(name: str, value_head: bool = False) -> ModelSpec:
    """A published model shape: ``llama2-7b``, ``llama2-13b``, ``llama2-34b`` (CodeLlama-34B), ``llama2-70b``.

    Args:
        name: preset name.
        value_head: the critic / reward-model variant (scalar head).
    """
    if name not in _PRESETS:
        raise ValueError(f"unknown model preset {name!r}; expected one of {sorted(_PRESETS)}")
    return ModelSpec(vocab_size=32000, name=name, value_head=value_head, **_PRESETS[name])
