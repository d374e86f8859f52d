"""A lean decoder for the built-in sampler: the family's decoder math on the module's weights.

On small models a decode step through HF's modules is mostly Python dispatch (hooks, cache
objects, mask checks, many small ops), not arithmetic (docs/benchmarks.md, "Sampler"). This
module runs the same math in a fraction of the ops, for every family whose layers are the
Llama decoder with the variations :class:`rlflow.families.LayerFeatures` names (q/k/v biases,
o and MLP biases, per-head q/k RMSNorm) and whose attention is full or sliding-window
(:attr:`rlflow.families.ModelFamily.fast_decode`):

* **Weights** are read by the family's parameter names; q/k/v and gate/up are concatenated so
  that each is one matmul (cached per model until any source weight changes in place, so a
  rollout engine kept between calls concatenates once per weight version). On a CPU every
  float32 matrix, and a head up to 64 MB, is held ``(in, out)`` contiguous: MKL spreads a decode
  step's few rows times it over several threads, which it hardly does on the transposed view;
  bf16 matrices are held in oneDNN's layout.
* **KV cache**: one preallocated ``(N, kv_heads, P + R, head_dim)`` buffer per layer for k and
  v, written in place at each step; attention reads a view of its first ``P + s + 1`` slots.
* **RoPE** from cos/sin tables built once per call by the model's own rotary module (so every
  rope type whose angles depend on the position alone is exact); ``rotate_half`` is a ``roll``
  against a sine table with its first half negated, the same products as HF's.
* **Masks** (padding, causality, sliding windows) are built once per call; a step takes a view.
* **Attention** is torch's ``scaled_dot_product_attention`` over the prompts and two matmuls
  and a softmax over grouped-query heads per decode step; the final norm and the LM head run on
  the last position only.

:func:`fast_decode_blocker` says why a model cannot take this path (the sampler then decodes
through HF's modules); the outputs match HF's forward to float rounding
(``tests/engine/test_fast_decode.py``).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.activations import ACT2FN

from rlflow.engine.packing import position_ids_from_mask
from rlflow.families import ModelFamily, config_value, family_of

__all__ = ["FastDecoder", "fast_decode_blocker", "kv_cache_bytes"]

# Rope types whose angle depends on the position alone, so one table serves the whole call;
# "dynamic" and "longrope" rescale with the sequence length and decode through HF's modules.
_STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
_ATTENTION_KINDS = frozenset({"full_attention", "sliding_attention"})
# Decode attention as baddbmm + softmax + bmm up to this many (row, kv head) batches on CPU,
# scaled_dot_product_attention above: the crossover measured on a 2-core EPYC lies between 64 and
# 128 batches.
_BMM_MAX_BATCHES = 64


def _text_config(model: nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def fast_decode_blocker(model: nn.Module) -> str | None:
    """Why :class:`FastDecoder` cannot decode ``model``, or None when it can.

    Args:
        model: an HF causal LM.

    Returns:
        A reason for the debug log (tensor-parallel weights, an unknown family, a family that
        declares no fast decode, a rope type or attention kind it does not implement, parameters
        other than the family's), or None.
    """
    config = _text_config(model)
    try:
        family = family_of(config)
    except ValueError as err:
        return str(err)
    if not family.fast_decode:
        return f"family {family.name!r} declares fast_decode=False"
    if any(isinstance(p, DTensor) for p in model.parameters()):
        return "the weights are tensor-parallel DTensors"
    kinds = set(family.layer_types(config)) - _ATTENTION_KINDS
    if kinds:
        return f"attention kinds {sorted(kinds)} are not implemented"
    if config_value(config, "hidden_act", "silu") not in ACT2FN:
        return f"hidden_act={config_value(config, 'hidden_act')!r} is not an HF activation"
    try:
        rotary = model.get_submodule(family.rotary_module)
    except AttributeError:
        return f"no rotary module at {family.rotary_module!r}"
    rope_type = getattr(rotary, "rope_type", "default")
    if rope_type not in _STATIC_ROPE_TYPES:
        return f"rope_type={rope_type!r} is not one of {sorted(_STATIC_ROPE_TYPES)}"
    partial = config_value(config, "partial_rotary_factor")
    if partial not in (None, 1, 1.0):  # RoPE on part of each head is not implemented
        return f"partial_rotary_factor={partial}"
    expected = _expected_params(model, family, config)
    actual = {name for name, _ in model.named_parameters()}
    if expected != actual:
        missing, extra = sorted(expected - actual), sorted(actual - expected)
        parts = [
            f"{what} {names[:3]}{' …' if len(names) > 3 else ''}"
            for what, names in (("missing", missing), ("unexpected", extra))
            if names
        ]
        return f"parameters differ from family {family.name!r}'s: {', '.join(parts)}"
    return None


def _stage_items(model: nn.Module) -> list[str] | None:
    """The pipeline items a stage (:class:`rlflow.engine.pipeline.DecoderStage`) holds; None for a whole model."""
    items = getattr(model, "items", None)
    return list(items) if items is not None else None


def _expected_params(model: nn.Module, family: ModelFamily, config) -> set[str]:
    """The family's parameter names of ``model``: all of them, or a stage's items' (a last stage's own
    copy of a tied embedding under the LM head's name)."""
    items = _stage_items(model)
    per_item = family.item_param_shapes(config)
    if items is None:
        return {name for _, shapes in per_item for name in shapes}
    names = {name for item, shapes in per_item if item in items for name in shapes}
    if "head" in items and "embed" not in items and family.embed_name in names:
        names = (names - {family.embed_name}) | {family.lm_head_name}
    return names


def kv_cache_bytes(model: nn.Module, num_rows: int, total_len: int) -> int:
    """Bytes of :class:`FastDecoder`'s preallocated KV buffers for ``num_rows`` sequences of
    ``total_len`` (prompt + new) tokens: k and v, every layer, ``(rows, kv_heads, total_len, head_dim)``."""
    config = _text_config(model)
    dims = family_of(config).dims(config)
    itemsize = next(model.parameters()).element_size()
    return 2 * dims.num_layers * num_rows * dims.num_kv_heads * total_len * dims.head_dim * itemsize


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's weights in the decoder's form: matrices transposed to ``(in, out)``
    (what ``x @ w`` takes) or packed for oneDNN (:class:`_Packed`), biases and the q/k norm None
    when absent."""

    input_norm: torch.Tensor  # (hidden,)
    qkv_weight: torch.Tensor  # (hidden, (H + 2 Hkv) D): q, k, v side by side
    qkv_bias: torch.Tensor | None
    qk_norm: torch.Tensor | None  # (H + Hkv, D): q_norm for the H q heads, k_norm for the Hkv k heads
    o_weight: torch.Tensor  # (H D, hidden)
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_weight: torch.Tensor  # (hidden, 2 I): gate, up side by side
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor  # (I, hidden)
    down_bias: torch.Tensor | None
    window: int | None  # attend to the last `window` positions; None: all


def _cat(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if tensors[0] is None else torch.cat(tensors, dim=0)


def _build_layers(model: nn.Module, family: ModelFamily, config, indices: frozenset[int] | None) -> list[_Layer]:
    dims = family.dims(config)
    params = dict(model.named_parameters())
    window = config_value(config, "sliding_window")

    def get(layer: int, name: str) -> torch.Tensor | None:
        return params.get(f"{family.layers_module}.{layer}.{name}")

    def weight(layer: int, *modules: str) -> torch.Tensor | _Packed:  # the modules' outputs side by side
        return _in_out(*(get(layer, f"{m}.weight") for m in modules))

    layers = []
    for i, kind in enumerate(family.layer_types(config)):
        if indices is not None and i not in indices:  # another pipeline stage's layer
            continue
        q_norm = get(i, "self_attn.q_norm.weight")
        qk_norm = None
        if q_norm is not None:
            k_norm = get(i, "self_attn.k_norm.weight")
            qk_norm = torch.cat([q_norm.expand(dims.num_heads, -1), k_norm.expand(dims.num_kv_heads, -1)])
        layers.append(
            _Layer(
                input_norm=get(i, "input_layernorm.weight"),
                qkv_weight=weight(i, "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                qkv_bias=_cat([get(i, f"self_attn.{p}_proj.bias") for p in "qkv"]),
                qk_norm=qk_norm,
                o_weight=weight(i, "self_attn.o_proj"),
                o_bias=get(i, "self_attn.o_proj.bias"),
                post_norm=get(i, "post_attention_layernorm.weight"),
                gate_up_weight=weight(i, "mlp.gate_proj", "mlp.up_proj"),
                gate_up_bias=_cat([get(i, "mlp.gate_proj.bias"), get(i, "mlp.up_proj.bias")]),
                down_weight=weight(i, "mlp.down_proj"),
                down_bias=get(i, "mlp.down_proj.bias"),
                window=int(window) if kind == "sliding_attention" and window is not None else None,
            )
        )
    return layers


class _Packed:
    """A bfloat16 ``(out, in)`` weight reordered once into oneDNN's blocked layout, so that each
    ``x @ w.T`` skips the reorder oneDNN otherwise does on every call (docs/benchmarks.md,
    "Precision", times a decode step's projection both ways; the products are the same, bit for bit)."""

    __slots__ = ("nbytes", "weight")

    def __init__(self, weight: torch.Tensor):
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS)
        self.nbytes = weight.nbytes

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, "none", [], "")


# The row count oneDNN's weight layout is chosen for (a decode step's rows); any count runs on it.
_PACK_ROWS = 16


def packs_weights(weight: torch.Tensor) -> bool:
    """Whether the decoder keeps ``weight`` in oneDNN's layout (:class:`_Packed`): bfloat16 on a CPU
    whose torch has oneDNN's linear ops and whose oneDNN computes bf16 there (AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT; elsewhere its reorder raises, and torch's own bf16 linear runs)."""
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and _onednn_bf16()
        and not isinstance(weight, DTensor)
    )


@functools.cache
def _onednn_bf16() -> bool:
    """Whether oneDNN runs bf16 on this CPU (asked once a process)."""
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(supported()) if supported is not None else True


def _in_out(*weights: torch.Tensor) -> torch.Tensor | _Packed:
    """``(out, in)`` weights side by side (their outputs concatenated) in the decoder's form: packed
    (:func:`packs_weights`), an ``(in, out)`` contiguous copy (:func:`_copies_in_out`), else an
    ``(in, out)`` view."""
    if _copies_in_out(weights[0]):
        return torch.cat([w.t() for w in weights], dim=1).contiguous()
    fused = weights[0] if len(weights) == 1 else torch.cat(weights, dim=0)
    return _Packed(fused) if packs_weights(fused) else fused.t()


def _copies_in_out(weight: torch.Tensor) -> bool:
    """Whether the decoder multiplies by an ``(in, out)`` contiguous copy of ``weight`` rather than
    its transposed view: a float32 weight on a CPU, where MKL spreads the GEMM of a decode step's few
    rows over its threads on the copy and hardly on the view (docs/benchmarks.md, "All three tasks
    on an AVX-512 CPU whose bf16 matmuls are slower than its fp32 ones"); the products are the same."""
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and not isinstance(weight, DTensor)


# The LM head gets its (in, out) copy up to this size: a small head gains most from it, a Qwen-sized
# one (151936 x 896, 545 MB) little for a copy of the embedding (the same section measures both).
_HEAD_COPY_MAX_BYTES = 64 << 20


def _project(x: torch.Tensor, weight, bias: torch.Tensor | None, residual=None) -> torch.Tensor:
    """``residual + (x @ weight + bias)`` for 2-D ``x``, in one op where there is no bias.

    The residual is folded into the matmul in float32 only: in 16-bit dtypes HF rounds the
    projection before adding it, and one rounding fewer would move the logits by an ulp.
    """
    if isinstance(weight, _Packed):
        out = weight.linear(x, bias)
        return out if residual is None else residual + out
    if residual is not None and bias is None and x.dtype == torch.float32:
        return torch.addmm(residual, x, weight)
    out = torch.mm(x, weight) if bias is None else torch.addmm(bias, x, weight)
    return out if residual is None else residual + out


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """HF's RMSNorm over the last dim: computed in float32, the weight applied in ``x``'s dtype.

    HF's ops, in place where HF makes new tensors: the same bits as ``torch.rms_norm``, which took
    about 1.5 times as long on a decode step's few rows (docs/benchmarks.md, section "All three tasks
    on an AVX-512 CPU whose bf16 matmuls are slower than its fp32 ones")."""
    wide = x.float()
    normed = wide * wide.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    if x.dtype == torch.float32:
        return normed if weight is None else normed.mul_(weight)
    normed = normed.to(x.dtype)
    return normed if weight is None else weight * normed


# model -> (weight key, layers): the concatenated weights, reused while no source weight changed.
# Kept between calls only up to _CACHE_MAX_BYTES: on a small model concatenating costs as much as
# a decode step; on a large one a second copy of most weights outlives the call for little gain.
_CACHE_MAX_BYTES = 256 << 20
_LAYER_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _weight_key(model: nn.Module) -> tuple:
    """Identity and in-place version of every parameter: any copy into a weight changes it."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


def _cached_layers(model: nn.Module, family: ModelFamily, config, indices: frozenset[int] | None) -> list[_Layer]:
    """The layers of ``model`` (those of ``indices`` on a pipeline stage), concatenated once per
    weight version where that is small."""
    key = _weight_key(model)
    cached = _LAYER_CACHE.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    layers = _build_layers(model, family, config, indices)
    # the fused matrices are copies, and so is every packed one and every (in, out) contiguous one
    copied_bytes = sum(
        w.nbytes
        for layer in layers
        for w in (layer.qkv_weight, layer.gate_up_weight, layer.o_weight, layer.down_weight)
        if isinstance(w, _Packed) or w is layer.qkv_weight or w is layer.gate_up_weight or w.is_contiguous()
    )
    if copied_bytes <= _CACHE_MAX_BYTES:
        _LAYER_CACHE[model] = (key, layers)
    return layers


def _head_in_out(weight: torch.Tensor) -> torch.Tensor:
    """The LM head's ``(hidden, vocab)`` matrix: a contiguous copy where :func:`_copies_in_out` and it
    is at most :data:`_HEAD_COPY_MAX_BYTES`, else a view."""
    if _copies_in_out(weight) and weight.nbytes <= _HEAD_COPY_MAX_BYTES:
        return weight.detach().t().contiguous()
    return weight.t()


class FastDecoder:
    """The prefill and decode steps of :func:`~rlflow.engine.rollout.hf_sampler.sample_responses`
    on a model :func:`fast_decode_blocker` accepts; the same interface as the sampler's HF path.

    Args:
        model: an HF causal LM of a family with ``fast_decode``, or a pipeline stage of one
            (:class:`rlflow.engine.pipeline.DecoderStage`: its layers, with the embedding on the
            first stage and the head on the last; the stages pass hidden states).
        max_new_tokens: ``R``, the decode steps the KV buffers are sized for.

    >>> from rlflow.data.tiny_models import build_tiny_model
    >>> model = build_tiny_model(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1)
    >>> decoder = FastDecoder(model, max_new_tokens=3)
    >>> with torch.inference_mode():
    ...     logits = decoder.prefill(torch.tensor([[0, 5, 6]]), torch.tensor([[0, 1, 1]]), n=2)
    ...     logits = decoder.step(logits.argmax(-1), 0)
    >>> tuple(logits.shape)
    (2, 32)
    """

    def __init__(self, model: nn.Module, max_new_tokens: int):
        config = _text_config(model)
        family = family_of(config)
        dims = family.dims(config)
        self._rotary = model.get_submodule(family.rotary_module)
        items = _stage_items(model)  # a pipeline stage runs its items only
        holds = (lambda item: True) if items is None else items.__contains__
        layers = None if items is None else frozenset(int(i.split(".")[1]) for i in items if i.startswith("layer."))
        self._layers = _cached_layers(model, family, config, layers)
        self._embed = model.get_parameter(family.embed_name) if holds("embed") else None
        self._norm = model.get_parameter(f"{family.norm_module}.weight") if holds("norm") else None
        self._head_t = _head_in_out(model.get_submodule(family.lm_head_module).weight) if holds("head") else None
        param = next(model.parameters())
        self._dtype, self._device = param.dtype, param.device
        self._eps = float(config_value(config, "rms_norm_eps", 1e-6))
        self._act = ACT2FN[config_value(config, "hidden_act", "silu")].forward  # skip nn.Module's call hooks
        self._heads, self._kv_heads, self._head_dim = dims.num_heads, dims.num_kv_heads, dims.head_dim
        self._inter, self._scale = dims.intermediate_size, dims.head_dim**-0.5
        self._max_new = max_new_tokens

    # ------------------------------------------------------------------ the sampler's interface

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, n: int) -> torch.Tensor:
        """Run the ``(B, P)`` left-padded prompts, fill the KV buffers, repeat them ``n`` times.

        On a pipeline stage without the embedding ``input_ids`` are the previous stage's
        ``(B, P, H)`` hidden states.

        Returns:
            ``(B*n, V)`` float32 logits of the next position, rows interleaved by prompt; on a
            stage without the head, its ``(B, P, H)`` hidden states (one row per prompt).
        """
        batch, prompt_len = attention_mask.shape
        total = prompt_len + self._max_new
        dtype, device = self._dtype, self._device
        positions = position_ids_from_mask(attention_mask)  # (B, P)
        self._build_tables(attention_mask, total, dtype, device)
        shape = (batch, self._kv_heads, total, self._head_dim)
        self._k = [torch.empty(shape, dtype=dtype, device=device) for _ in self._layers]
        self._v = [torch.empty(shape, dtype=dtype, device=device) for _ in self._layers]
        self._length = prompt_len

        cos, sin = self._cos[positions][:, :, None], self._sin[positions][:, :, None]  # (B, P, 1, D)
        valid = attention_mask.bool()
        if self._embed is not None:
            hidden = torch.embedding(self._embed, input_ids.reshape(-1))  # (B*P, hidden)
        else:
            hidden = input_ids.reshape(batch * prompt_len, -1)
        for index, layer in enumerate(self._layers):
            mask = self._prompt_mask(valid, layer.window)
            hidden = self._prompt_layer(hidden, batch, index, layer, cos, sin, mask)
        out = hidden.view(batch, prompt_len, -1)
        logits = self._logits(out[:, -1]) if self._head_t is not None else None
        # the n samples of a prompt share its cache, positions and masks
        self._k = [k.repeat_interleave(n, dim=0) for k in self._k]
        self._v = [v.repeat_interleave(n, dim=0) for v in self._v]
        next_pos = attention_mask.sum(dim=1, keepdim=True).repeat_interleave(n, dim=0)  # (N, 1)
        steps = next_pos + torch.arange(self._max_new, device=device)  # (N, R) position of every step
        self._step_cos, self._step_sin = self._cos[steps][:, :, None], self._sin[steps][:, :, None]  # (N, R, 1, D)
        keys = torch.cat([valid, valid.new_ones(batch, self._max_new)], dim=1).repeat_interleave(n, dim=0)
        additive = torch.zeros(keys.shape, dtype=dtype, device=device).masked_fill_(~keys, float("-inf"))
        # bmm would round the scores to a 16-bit dtype where sdpa keeps them in float32
        few_batches = keys.shape[0] * self._kv_heads <= _BMM_MAX_BATCHES
        self._bmm_attention = device.type == "cpu" and dtype == torch.float32 and few_batches
        if self._bmm_attention:  # the bmm's batches are (row, kv head): the mask repeated per kv head
            self._key_mask = additive[:, None, None, :].expand(-1, self._kv_heads, 1, -1).contiguous()
        else:
            self._key_mask = additive[:, None, None, :]  # (N, 1, 1, T)
        self._grouped_views()
        return out if logits is None else logits.repeat_interleave(n, dim=0)

    def step(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        """Feed ``(N,)`` tokens (response position ``step``), or on a stage without the embedding the
        previous stage's ``(N, 1, H)``; ``(N, V)`` float32 next logits, or a stage's ``(N, 1, H)``."""
        slot = self._length + step
        cos, sin = self._step_cos.select(1, step), self._step_sin.select(1, step)  # (N, 1, D)
        if self._embed is not None:
            hidden = torch.embedding(self._embed, tokens)  # (N, hidden)
        else:
            hidden = tokens.reshape(tokens.shape[0], -1)
        for index, layer in enumerate(self._layers):
            hidden = self._step_layer(hidden, index, layer, cos, sin, slot)
        return self._logits(hidden) if self._head_t is not None else hidden.view(hidden.shape[0], 1, -1)

    def select(self, keep: torch.Tensor) -> None:
        """Keep only the decoding rows ``keep`` (indices into the current rows)."""
        self._k = [k[keep] for k in self._k]
        self._v = [v[keep] for v in self._v]
        self._step_cos, self._step_sin = self._step_cos[keep], self._step_sin[keep]
        self._key_mask = self._key_mask[keep]
        self._grouped_views()

    # ------------------------------------------------------------------ the decoder

    def _grouped_views(self) -> None:
        """``(N*Hkv, ...)`` views of the KV buffers and key mask, the batches of the step's bmm."""
        if self._bmm_attention:
            self._k3, self._v3 = [k.flatten(0, 1) for k in self._k], [v.flatten(0, 1) for v in self._v]
            self._key_mask3 = self._key_mask.flatten(0, 1)

    def _qk_rope(self, qkv: torch.Tensor, layer: _Layer, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q and k heads ``(..., H + Hkv, D)`` of ``qkv`` after the q/k norm and RoPE.

        HF's ``q * cos + rotate_half(q) * sin`` with ``rotate_half(q) = cat(-q2, q1)``: here
        ``roll(q) = cat(q2, q1)`` times ``sin`` with its first half negated, the same products.
        """
        qk = qkv.narrow(-2, 0, self._heads + self._kv_heads)
        if layer.qk_norm is not None:  # per-head RMSNorm of q and k, before RoPE
            qk = _rms_norm(qk, None, self._eps) * layer.qk_norm
        return qk * cos + qk.roll(self._head_dim // 2, -1) * sin

    def _mlp(self, hidden: torch.Tensor, layer: _Layer) -> torch.Tensor:
        """``hidden + mlp(norm(hidden))`` of ``(rows, hidden)``."""
        x = _rms_norm(hidden, layer.post_norm, self._eps)
        gate_up = _project(x, layer.gate_up_weight, layer.gate_up_bias)
        gated = self._act(gate_up.narrow(-1, 0, self._inter)) * gate_up.narrow(-1, self._inter, self._inter)
        return _project(gated, layer.down_weight, layer.down_bias, residual=hidden)

    def _prompt_layer(self, hidden, batch: int, index: int, layer: _Layer, cos, sin, mask) -> torch.Tensor:
        """One decoder layer over the prompts' ``(B*P, hidden)``; k/v go to the first P slots."""
        heads, length = self._heads, hidden.shape[0] // batch
        x = _rms_norm(hidden, layer.input_norm, self._eps)
        qkv = _project(x, layer.qkv_weight, layer.qkv_bias).view(batch, length, -1, self._head_dim)
        qk = self._qk_rope(qkv, layer, cos, sin).transpose(1, 2)  # (B, H + Hkv, P, D)
        k, v = qk[:, heads:], qkv[:, :, heads + self._kv_heads :].transpose(1, 2)
        self._k[index][:, :, :length] = k
        self._v[index][:, :, :length] = v
        attn = F.scaled_dot_product_attention(
            qk[:, :heads], k, v, attn_mask=mask, scale=self._scale, enable_gqa=heads != self._kv_heads
        )
        attn = attn.transpose(1, 2).reshape(batch * length, heads * self._head_dim)
        return self._mlp(_project(attn, layer.o_weight, layer.o_bias, residual=hidden), layer)

    def _step_layer(self, hidden, index: int, layer: _Layer, cos, sin, slot: int) -> torch.Tensor:
        """One decoder layer over one token per row, ``(N, hidden)``; its k/v go to KV slot ``slot``.

        A sliding window is where the keys start. With few rows on CPU, attention is a
        ``baddbmm`` (key mask + scaled scores), a softmax and a ``bmm`` over the grouped heads
        ``(N*Hkv, H/Hkv, ·)``: cheaper than ``scaled_dot_product_attention``'s set-up there
        (and dearer with many rows, see ``_BMM_MAX_BATCHES``). Views are taken with
        ``narrow``/``select``: Python indexing parses its index on every call.
        """
        rows, heads, kv_heads, dim = hidden.shape[0], self._heads, self._kv_heads, self._head_dim
        x = _rms_norm(hidden, layer.input_norm, self._eps)
        qkv = _project(x, layer.qkv_weight, layer.qkv_bias).view(rows, -1, dim)
        qk = self._qk_rope(qkv, layer, cos, sin)  # (N, H + Hkv, D)
        self._k[index].select(2, slot).copy_(qk.narrow(1, heads, kv_heads))
        self._v[index].select(2, slot).copy_(qkv.narrow(1, heads + kv_heads, kv_heads))
        start = 0 if layer.window is None else max(0, slot + 1 - layer.window)
        num_keys = slot + 1 - start
        query = qk.narrow(1, 0, heads)
        if self._bmm_attention:
            keys = self._k3[index].narrow(1, start, num_keys).transpose(1, 2)
            scores = torch.baddbmm(
                self._key_mask3.narrow(2, start, num_keys), query.reshape(rows * kv_heads, heads // kv_heads, dim),
                keys, alpha=self._scale,
            )  # fmt: skip
            attn = torch.bmm(scores.softmax(dim=-1), self._v3[index].narrow(1, start, num_keys))
        else:
            attn = F.scaled_dot_product_attention(
                query.unsqueeze(2), self._k[index].narrow(2, start, num_keys), self._v[index].narrow(2, start, num_keys),
                attn_mask=self._key_mask.narrow(3, start, num_keys), scale=self._scale, enable_gqa=heads != kv_heads,
            )  # fmt: skip
        attn = attn.view(rows, heads * dim)
        return self._mlp(_project(attn, layer.o_weight, layer.o_bias, residual=hidden), layer)

    def _logits(self, last: torch.Tensor) -> torch.Tensor:
        """``(rows, V)`` float32 logits from the last position's ``(rows, hidden)`` states."""
        normed = last if self._norm is None else _rms_norm(last, self._norm, self._eps)
        return torch.mm(normed, self._head_t).float()

    # ------------------------------------------------------------------ tables and masks, once per call

    def _build_tables(self, attention_mask, total: int, dtype, device) -> None:
        # the rotary module computes cos/sin per position, so a table of positions 0..max is exact
        max_pos = int(attention_mask.sum(dim=1).max()) + self._max_new
        table_pos = torch.arange(max(max_pos, total), device=device)[None]
        cos, sin = self._rotary(torch.empty(0, dtype=dtype, device=device), table_pos)
        half = self._head_dim // 2
        self._cos, self._sin = cos[0], torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)  # (L, D)

    def _prompt_mask(self, valid: torch.Tensor, window: int | None) -> torch.Tensor:
        """``(B, 1, P, P)`` bool: causal over real tokens (within ``window``); a padding query
        attends to itself only, so no row is empty (its output is never read)."""
        length = valid.shape[1]
        query = torch.arange(length, device=valid.device)[:, None]
        allowed = query >= query.T
        if window is not None:
            allowed = allowed & (query.T > query - window)
        mask = allowed[None] & valid[:, None, :]
        return (mask | torch.eye(length, dtype=torch.bool, device=valid.device))[:, None]
