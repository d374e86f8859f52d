"""The lean decoder's decode step in C++: one call per step instead of a few dozen torch ops.

:class:`~rlflow.engine.rollout.fast_decode.FastDecoder` cut HF's decode step to the family's
math in about sixty torch ops; on the small models CPU rollouts run, those ops still cost far
more than their arithmetic (docs/benchmarks.md, "Sampler"). :class:`NativeDecoder`
keeps its twin's prefill (one pass, torch's kernels are the right tool there) and runs every
decode step in ``rlflow._C_decode`` (``kernels/decode.cpp``) over the twin's own KV buffers,
rope tables and key mask: the same math, the same sampler loop around it (the same draws, the
same pruning of finished rows), logits equal to the twin's to float rounding
(``tests/engine/test_native_decode.py``).

The step runs on torch's thread count (OpenMP threads, the same runtime as torch's) with the
widest kernels torch's CPU capability allows (AVX-512, AVX2/FMA or scalar, :func:`kernel_cap`).
Its matrices are packed once per decoder into panels of 16 output columns, each streamed front to
back with the next pages prefetched: with a decode step's few rows the step reads every weight once
from memory, and that read and the multiply-adds it feeds bound it (docs/benchmarks.md, the compute
task against the machine's limits).

It applies where :func:`native_decode_blocker` finds nothing against it: a whole model (not a
pipeline stage) in float32 on the CPU, SiLU MLP, matrices of at most
:data:`NATIVE_MAX_WEIGHT_BYTES`, and a step of few rows (:data:`NATIVE_MAX_ROWS`: streaming the
weights sets its time) or little work (:data:`NATIVE_MAX_STEP_MACS`: per-op overhead sets it);
steps of many rows on big matrices keep torch's GEMMs, which win where the arithmetic is the bound.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from rlflow.engine.fused_ops import kernel_cap
from rlflow.engine.rollout.base import SamplingParams
from rlflow.engine.rollout.fast_decode import FastDecoder, _text_config
from rlflow.families import config_value, family_of

try:  # built by `pip install -e .` (setup.py); without it the sampler keeps the torch twin
    from rlflow import _C_decode
except ImportError:  # pragma: no cover - a source tree without its build
    _C_decode = None

__all__ = [
    "NATIVE_MAX_ROWS",
    "NATIVE_MAX_STEP_MACS",
    "NATIVE_MAX_WEIGHT_BYTES",
    "NativeDecoder",
    "kernel_cap",
    "native_decode_blocker",
    "native_sampling_blocker",
    "sample_step",
    "step_macs",
]

# Largest decode step of more than NATIVE_MAX_ROWS rows run in C++, in multiply-adds per layer (rows x
# the layer's matrices). The C++ step wins where torch's per-op overhead dominates a step and loses
# where MKL's GEMMs outrun its tiles; `python -m benchmarks.run sampler` times the crossover (its
# `sampler_step_*` records; the figures and the level point below which this limit sits:
# docs/benchmarks.md, "Sampler").
NATIVE_MAX_STEP_MACS = 32_000_000
# Rows up to which the C++ step runs at any width: its panels are read once per 16 rows, and up to
# this many rows streaming them from memory bounds a step (the same benchmark's records at 16 and 32
# rows); above it, and above NATIVE_MAX_STEP_MACS, MKL's GEMMs win on arithmetic.
NATIVE_MAX_ROWS = 32
# Largest total of packed matrices (float32 bytes, the LM head included): the decoder holds them
# besides the model's weights for the length of a generate call.
NATIVE_MAX_WEIGHT_BYTES = 1 << 30


def step_macs(model: nn.Module, num_rows: int) -> int:
    """Multiply-adds of one decode step of ``num_rows`` rows through one layer of ``model``:
    q/k/v, o and the three MLP matrices.

    >>> from rlflow.data.tiny_models import build_tiny_model
    >>> step_macs(build_tiny_model(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=64), 4)
    16384
    """
    config = _text_config(model)
    d = family_of(config).dims(config)
    attention = (d.num_heads + 2 * d.num_kv_heads) * d.head_dim + d.num_heads * d.head_dim
    return num_rows * d.hidden_size * (attention + 3 * d.intermediate_size)


def native_decode_blocker(model: nn.Module, num_rows: int) -> str | None:
    """Why :class:`NativeDecoder` cannot decode ``num_rows`` rows of ``model`` (which
    :func:`fast_decode_blocker` already accepted), or None when it can.

    >>> from rlflow.data.tiny_models import build_tiny_model
    >>> native_decode_blocker(build_tiny_model(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2), 16)
    """
    if _C_decode is None:
        return "rlflow._C_decode is not built (pip install -e .)"
    if getattr(model, "items", None) is not None:
        return "a pipeline stage (the native step runs whole models)"
    param = next(model.parameters())
    # Its kernels read and write float32 (weights, KV buffers, logits); a bf16 copy
    # (models.<role>.dtype) decodes with the torch twin instead, whose matmuls run in bf16 on
    # CPUs that have bf16 instructions, rather than converting every weight at each step.
    if param.device.type != "cpu" or param.dtype != torch.float32:
        return f"weights are {param.dtype} on {param.device.type} (the native step runs float32 on the CPU)"
    config = _text_config(model)
    act = config_value(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        return f"hidden_act={act!r} (the native step implements SiLU)"
    matrix_bytes = sum(p.nbytes for p in model.parameters() if p.dim() == 2)  # the embedding for the tied head
    if matrix_bytes > NATIVE_MAX_WEIGHT_BYTES:
        return f"{matrix_bytes} bytes of matrices > {NATIVE_MAX_WEIGHT_BYTES} (the native step packs a copy of each)"
    macs = step_macs(model, num_rows)
    if num_rows > NATIVE_MAX_ROWS and macs > NATIVE_MAX_STEP_MACS:
        return (
            f"{num_rows} rows > {NATIVE_MAX_ROWS} and {macs} multiply-adds per layer and step > "
            f"{NATIVE_MAX_STEP_MACS}: torch's GEMMs are faster there"
        )
    return None


def _packed(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().contiguous()


class NativeDecoder(FastDecoder):
    """:class:`FastDecoder` whose :meth:`step` runs in C++ (module docstring); same interface.

    The C++ side packs the twin's ``(in, out)`` matrices into its panels once per decoder (a copy of
    the weights for the length of one rollout; the buffers are kept for the next decoder of the
    same shapes).

    Args:
        model, max_new_tokens: as :class:`FastDecoder`'s.
        threads: the step's threads; torch's thread count by default.
        kernels: the widest kernels to use (2 AVX-512, 1 AVX2/FMA, 0 scalar; never wider than the
            CPU has); :func:`kernel_cap` by default. ``kernels`` and ``threads`` attributes say
            what the step runs.
    """

    def __init__(self, model: nn.Module, max_new_tokens: int, threads: int | None = None, kernels: int | None = None):
        super().__init__(model, max_new_tokens)
        family = family_of(_text_config(model))
        head_t = model.get_submodule(family.lm_head_module).weight.t()  # (H, V)
        layers = [
            {
                "input_norm": _packed(layer.input_norm).numpy(),
                "qkv_w": _packed(layer.qkv_weight).numpy(),
                "qkv_b": None if layer.qkv_bias is None else _packed(layer.qkv_bias).numpy(),
                "qk_norm": None if layer.qk_norm is None else _packed(layer.qk_norm).numpy(),
                "o_w": _packed(layer.o_weight).numpy(),
                "o_b": None if layer.o_bias is None else _packed(layer.o_bias).numpy(),
                "post_norm": _packed(layer.post_norm).numpy(),
                "gate_up_w": _packed(layer.gate_up_weight).numpy(),
                "gate_up_b": None if layer.gate_up_bias is None else _packed(layer.gate_up_bias).numpy(),
                "down_w": _packed(layer.down_weight).numpy(),
                "down_b": None if layer.down_bias is None else _packed(layer.down_bias).numpy(),
                "window": layer.window,
            }
            for layer in self._layers
        ]
        self._native = _C_decode.Decoder(
            hidden=self._embed.shape[1], heads=self._heads, kv_heads=self._kv_heads, head_dim=self._head_dim,
            inter=self._inter, vocab=head_t.shape[1], eps=self._eps, scale=self._scale,
            embed=_packed(self._embed).numpy(), final_norm=_packed(self._norm).numpy(), head_t=_packed(head_t).numpy(),
            layers=layers, threads=torch.get_num_threads() if threads is None else threads,
            kernels=kernel_cap() if kernels is None else kernels,
        )  # fmt: skip
        self._vocab = head_t.shape[1]
        self.kernels, self.threads = self._native.kernels, self._native.threads

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, n: int) -> torch.Tensor:
        logits = super().prefill(input_ids, attention_mask, n)
        self._hand_over()
        return logits

    def select(self, keep: torch.Tensor) -> None:
        super().select(keep)
        self._hand_over()

    def step(self, tokens: torch.Tensor, step: int) -> torch.Tensor:
        logits = torch.empty((tokens.shape[0], self._vocab), dtype=torch.float32)
        self._native.step(tokens.contiguous().numpy(), step, self._length + step, logits.numpy())
        return logits

    def _hand_over(self) -> None:
        """Give the C++ step the current rows' KV buffers, rope tables and key mask (shared memory)."""
        rows, steps = self._step_cos.shape[:2]
        self._native.set_state(
            [k.numpy() for k in self._k], [v.numpy() for v in self._v],
            self._step_cos.reshape(rows, steps, -1).contiguous().numpy(),
            self._step_sin.reshape(rows, steps, -1).contiguous().numpy(),
            self._key_mask[:, 0, 0].contiguous().numpy(),  # (N, T) additive: every kv head's is the same
        )  # fmt: skip


def native_sampling_blocker(logits: torch.Tensor, params: SamplingParams, tp_group) -> str | None:
    """Why :func:`sample_step` cannot run the sampler's steps for these first logits, or None.

    It takes float32 CPU logits of one process, plain temperature sampling or greedy (top-k and
    top-p keep torch's filters).
    """
    if _C_decode is None:
        return "rlflow._C_decode is not built"
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return f"logits are {logits.dtype} on {logits.device.type}"
    if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
        return "tensor parallelism (tp rank 0 draws and broadcasts)"
    if not params.greedy and (params.top_k > 0 or params.top_p < 1.0):
        return "top-k / top-p filtering"
    return None


def sample_step(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    stop_ids: np.ndarray,
    alive: torch.Tensor,
    rows: torch.Tensor,
    step: int,
    pad_token_id: int,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    old_logp: torch.Tensor,
) -> tuple[torch.Tensor, int]:
    """One step of the sampler's loop in C++: choose each row's token, write the outputs of the
    rows still ``alive`` at ``(rows, step)`` (pad / 0 / 0 for finished ones), finish rows on a stop
    token (``alive`` updated in place).

    Tokens are drawn as :func:`~rlflow.engine.rollout.hf_sampler.choose_tokens` draws them (the
    argmax of the probabilities over Exp(1) noise from ``generator``, one ``(N, V)`` draw a step),
    so both loops give the same tokens for the same generator.

    Returns:
        ``(tokens, num_alive)``: ``(N,)`` int64 and the rows alive after this step.
    """
    noise = None if params.greedy else torch.empty_like(logits).exponential_(generator=generator)
    tokens = torch.empty(logits.shape[0], dtype=torch.long)
    num_alive = _C_decode.sample_step(
        logits.contiguous().numpy(), None if noise is None else noise.numpy(), float(params.temperature),
        bool(params.greedy), stop_ids, alive.numpy(), rows.numpy(), step, pad_token_id, responses.numpy(),
        response_mask.numpy(), old_logp.numpy(), tokens.numpy(),
    )  # fmt: skip
    return tokens, int(num_alive)
