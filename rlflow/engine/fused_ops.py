"""Fused CPU kernels for the training engine's decoder layers: RMSNorm, SwiGLU and RoPE, forward
and backward in one pass each, and causal attention in one kernel.

On a CPU a training step's elementwise ops are memory-bound: autograd runs HF's RMSNorm as about
five ops forward and a dozen backward, its MLP's ``act_fn(gate) * up`` as two and three, and RoPE
(``x * cos + rotate_half(x) * sin``) as five and more, each a pass over the activations at the
speed of memory. :func:`fuse_cpu_ops` points each at ``rlflow._C_fused`` (``kernels/fused.cpp``),
whose passes read their inputs and write their outputs once:

* every RMSNorm whose math is Llama's — the same code object as ``LlamaRMSNorm.forward``, which
  the Mistral, Qwen2, Qwen3 and Mixtral norms copy — at :class:`RMSNormFunction` (its forward);
* every MLP whose forward is ``LlamaMLP``'s with a SiLU activation at :class:`SwiGLUFunction` for
  ``SiLU(gate) * up`` (its forward; the three projections stay the module's own);
* the ``apply_rotary_pos_emb`` of every modeling module whose function is Llama's at
  :class:`RoPEFunction`. That function is a module global HF's attention looks up on each call, so
  this one is replaced for the whole process, once; it computes as before for every input the
  kernels do not take;
* every HF attention module (``is_causal`` set) is marked (:data:`FUSED_ATTENTION`), and the
  engine's attention function (:func:`rlflow.engine.attention.varlen_sdpa_attention`) runs its
  causal attention over whole sequences — a packed row's, or rows without padding — at
  :class:`PackedAttentionFunction` (``rlflow._C_attention``, ``kernels/attention.cpp``): SDPA's
  CPU flash kernel multiplies every query block against all the keys of its sequence, masked
  ones too; this kernel only the causal triangle, each (sequence, kv head) on one thread.

They take plain float32 CPU tensors outside autocast (FSDP's gathered weights are plain during
the forward); anything else — a GPU, bf16 compute, a tensor-parallel layer's DTensors or its
not-yet-waited collective results — runs HF's own ops, call by call. The results equal HF's to
float rounding (``tests/engine/test_fused_ops.py``, ``tests/engine/test_packed_attention.py``; the
exponentials are polynomials within 2 ulp); the norm weight's gradient sums rows in fixed blocks and
each attention task is one thread's, so every result has the same bits at any thread count.
"""

from __future__ import annotations

import sys
import types

import torch
from torch import nn

try:  # built by `pip install -e .` (setup.py); without it the modules keep their own forward
    from rlflow import _C_fused
except ImportError:  # pragma: no cover - a source tree without its build
    _C_fused = None
try:  # likewise; without it attention stays on SDPA
    from rlflow import _C_attention
except ImportError:  # pragma: no cover - a source tree without its build
    _C_attention = None

__all__ = [
    "FUSED_ATTENTION",
    "PACKED_ATTENTION_MAX_LEN",
    "PackedAttentionFunction",
    "RMSNormFunction",
    "RoPEFunction",
    "SwiGLUFunction",
    "fuse_cpu_ops",
    "fused_cpu_ops_blocker",
    "kernel_cap",
    "packed_attention_takes",
]

# torch's CPU capability (ATEN_CPU_CAPABILITY caps it) -> the widest kernels rlflow's C++ may use.
_KERNEL_LEVELS = {"AVX512": 2, "AVX2": 1}


def kernel_cap() -> int:
    """The widest kernels rlflow's C++ passes may run: 2 (AVX-512), 1 (AVX2/FMA) or 0 (scalar) —
    torch's own CPU capability, so ``ATEN_CPU_CAPABILITY=avx2`` holds them to AVX2 as it holds
    ATen's kernels (they also take no more than the CPU has)."""
    return _KERNEL_LEVELS.get(torch.backends.cpu.get_cpu_capability(), 0)


def _llama():
    from transformers.models.llama import modeling_llama

    return modeling_llama


def _consts(fn) -> tuple:
    """``fn``'s code constants without its docstring."""
    doc = fn.__doc__
    return tuple(c for c in fn.__code__.co_consts if doc is None or c is not doc)


def _same_body(f, g) -> bool:
    """Whether functions ``f`` and ``g`` run the same code (HF's "Copied from" twins), docstrings aside."""
    return (f.__code__.co_code, f.__code__.co_names, _consts(f)) == (
        g.__code__.co_code,
        g.__code__.co_names,
        _consts(g),
    )


def fused_cpu_ops_blocker() -> str | None:
    """Why no module can take the fused kernels in this process, or None."""
    return "rlflow._C_fused is not built (pip install -e .)" if _C_fused is None else None


class RMSNormFunction(torch.autograd.Function):
    """``weight * (x * rsqrt(mean(x^2, -1) + eps))`` over the last dim of float32 CPU ``x``, both
    passes in C++ on torch's thread count."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # the kernels take addresses (kernels/fused.cpp says why not numpy arrays): every tensor
        # here is float32, C-contiguous and on the CPU, of the sizes passed with it
        rows = x.detach().reshape(-1, x.shape[-1]).contiguous()
        weight = weight.contiguous()
        out = torch.empty_like(rows)
        rstd = torch.empty(rows.shape[0], dtype=torch.float32)
        _C_fused.rms_norm(
            rows.data_ptr(), weight.data_ptr(), rows.shape[0], rows.shape[1], eps, out.data_ptr(), rstd.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        ctx.save_for_backward(rows, weight, rstd)
        return out.view(x.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, weight, rstd = ctx.saved_tensors
        grad_rows = grad.reshape(rows.shape).contiguous().float()
        grad_x = torch.empty_like(rows)
        grad_weight = torch.empty(weight.shape, dtype=torch.float32)
        _C_fused.rms_norm_backward(
            grad_rows.data_ptr(), rows.data_ptr(), weight.data_ptr(), rstd.data_ptr(), rows.shape[0], rows.shape[1],
            grad_x.data_ptr(), grad_weight.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        return grad_x.view(grad.shape), grad_weight if ctx.needs_input_grad[1] else None, None


def _plain_float32(*tensors: torch.Tensor) -> bool:
    """Plain float32 CPU tensors outside autocast. Not a subclass: a DTensor, or the
    AsyncCollectiveTensor a tensor-parallel layer's input arrives as, whose data is not there until
    waited for."""
    return not torch.is_autocast_enabled("cpu") and all(
        type(t) in (torch.Tensor, nn.Parameter) and t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors
    )


class SwiGLUFunction(torch.autograd.Function):
    """``SiLU(gate) * up`` of two float32 CPU tensors of one shape, both passes in C++."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate, up = gate.detach().contiguous(), up.detach().contiguous()
        out = torch.empty_like(gate)
        _C_fused.swiglu(gate.data_ptr(), up.data_ptr(), gate.numel(), out.data_ptr(), torch.get_num_threads())
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad = grad.contiguous().float()
        grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
        _C_fused.swiglu_backward(
            grad.data_ptr(), gate.data_ptr(), up.data_ptr(), gate.numel(), grad_gate.data_ptr(), grad_up.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return grad_gate, grad_up


class RoPEFunction(torch.autograd.Function):
    """HF's ``x * cos + rotate_half(x) * sin`` of ``x`` ``(B, H, T, D)`` (a transposed view of the
    projection's ``(B, T, H, D)``, as HF's attention makes it) with ``cos``/``sin`` ``(B or 1, T, D)``,
    both passes in C++; the result is laid out ``(B, T, H, D)`` as HF's is, seen ``(B, H, T, D)``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cos, sin = cos.detach().contiguous(), sin.detach().contiguous()
        ctx.save_for_backward(cos, sin)
        return _rope(x.detach(), cos, sin, backward=False)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rope(grad.float(), cos, sin, backward=True), None, None


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """The C++ RoPE pass (or its transpose) of ``(B, H, T, D)`` ``x``, computed ``(B, T, H, D)``."""
    rows = x.transpose(1, 2).contiguous()  # no copy for HF's view of its projection
    out = torch.empty_like(rows)
    batch, length, heads, dim = rows.shape
    _C_fused.rope(
        rows.data_ptr(), cos.data_ptr(), sin.data_ptr(), batch * length, heads, dim, cos.shape[0] * length, backward,
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out.transpose(1, 2)


def _rope_takes(x: torch.Tensor, cos: torch.Tensor) -> bool:
    return (
        x.dim() == 4
        and cos.dim() == 3
        and cos.shape[0] in (1, x.shape[0])
        and cos.shape[1] == x.shape[2]
        and cos.shape[2] == x.shape[3]
        and x.shape[3] % 2 == 0
    )


def _fused_rope(original):
    """``apply_rotary_pos_emb`` that runs :class:`RoPEFunction` where it applies, else ``original``."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if (
            unsqueeze_dim == 1
            and _plain_float32(q, k, cos, sin)
            and not (cos.requires_grad or sin.requires_grad)
            and _rope_takes(q, cos)
            and _rope_takes(k, cos)
        ):
            return RoPEFunction.apply(q, cos, sin), RoPEFunction.apply(k, cos, sin)
        return original(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.rlflow_fused = original
    return apply_rotary_pos_emb


# The attribute fuse_cpu_ops sets on a model's attention modules: their packed rows' causal attention
# runs PackedAttentionFunction (rlflow.engine.attention.varlen_sdpa_attention reads it).
FUSED_ATTENTION = "rlflow_fused_attention"
# The longest sequence the packed attention kernel takes: each thread holds two (L, L) float32
# matrices of a sequence's scores; longer ones go to SDPA's flash kernel, which tiles them.
PACKED_ATTENTION_MAX_LEN = 1024


def packed_attention_takes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, max_len: int) -> bool:
    """Whether :class:`PackedAttentionFunction` runs this attention: float32 CPU tensors outside
    autocast laid out ``(B, H, L, D)`` (one packed row, or B rows of one length), heads a multiple
    of the kv heads, sequences up to :data:`PACKED_ATTENTION_MAX_LEN`, and the AVX2 or AVX-512
    kernels allowed (:func:`kernel_cap`)."""
    return (
        _C_attention is not None
        and kernel_cap() >= 1
        and 0 < max_len <= PACKED_ATTENTION_MAX_LEN
        and _plain_float32(query, key, value)
        and query.dim() == key.dim() == value.dim() == 4
        and key.shape == value.shape
        and query.shape[0] == key.shape[0]
        and query.shape[2:] == key.shape[2:]
        and query.shape[1] % key.shape[1] == 0
    )


def _token_major(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, L, D)`` as ``(B * L, H, D)`` C-contiguous: no copy for HF's view of a projection."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]).contiguous()


class PackedAttentionFunction(torch.autograd.Function):
    """Causal self-attention within each sequence, both passes in C++ (``kernels/attention.cpp``) on
    torch's thread count.

    ``query`` ``(B, Hq, L, D)``, ``key``/``value`` ``(B, Hkv, L, D)`` (GQA: Hq a multiple of Hkv), over
    the sequences ``cu_seqlens`` bounds in their B * L tokens (one packed row, B = 1; or B rows of L
    tokens each); ``max_len`` the longest. Returns ``(B, L, Hq, D)`` as HF's attention functions do.
    Equals SDPA with ``is_causal=True`` on each sequence alone to float rounding, with the same bits
    at any thread count.
    """

    @staticmethod
    def forward(ctx, query, key, value, cu_seqlens: torch.Tensor, max_len: int, scale: float):
        q, k, v = _token_major(query.detach()), _token_major(key.detach()), _token_major(value.detach())
        cu = cu_seqlens.to(device="cpu", dtype=torch.int64).contiguous()
        heads, dim = q.shape[1:]
        out = torch.empty_like(q)
        lse = torch.empty(heads, q.shape[0], dtype=torch.float32)
        # sizes only: under activation checkpointing the saved tensors come back as new ones
        ctx.sizes, ctx.level = (cu.numel() - 1, heads, k.shape[1], dim, max_len, scale), kernel_cap()
        ctx.rows = query.shape[0]
        _C_attention.forward(
            cu.data_ptr(), *ctx.sizes, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
            ctx.level, torch.get_num_threads(),
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse, cu)
        return out.view(ctx.rows, -1, heads, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        q, k, v, out, lse, cu = ctx.saved_tensors
        grad_out = grad.float().reshape(out.shape).contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _C_attention.backward(
            cu.data_ptr(), *ctx.sizes, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(),
            grad_out.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), ctx.level, torch.get_num_threads(),
        )  # fmt: skip
        grads = (t.view(ctx.rows, -1, *t.shape[1:]).transpose(1, 2) for t in (dq, dk, dv))
        return *grads, None, None, None


def _fused_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_proj(x), self.up_proj(x)
    if _plain_float32(gate, up) and gate.shape == up.shape:
        return self.down_proj(SwiGLUFunction.apply(gate, up))
    return self.down_proj(self.act_fn(gate) * up)


def _takes_fused(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return _plain_float32(x, weight) and x.shape[-1] == weight.numel()


def _fused_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if _takes_fused(hidden_states, self.weight):
        return RMSNormFunction.apply(hidden_states, self.weight, float(self.variance_epsilon))
    return type(self).forward(self, hidden_states)


def _original(rope):
    """HF's function behind a fused ``apply_rotary_pos_emb`` (itself where not fused)."""
    return getattr(rope, "rlflow_fused", rope)


def _is_silu(act) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def fuse_cpu_ops(model: nn.Module) -> int:
    """Point ``model``'s Llama-style RMSNorms and SwiGLU MLPs, and its modeling module's RoPE, at
    the fused kernels, and mark its attention modules for the attention kernel (module docstring);
    returns how many modules. Each decides per call: inputs the kernels do not take run HF's own ops."""
    if fused_cpu_ops_blocker() is not None:
        return 0
    llama = _llama()
    fused, modelings = 0, set()
    for module in model.modules():
        forward = getattr(type(module), "forward", None)
        if getattr(forward, "__code__", None) is None:
            continue
        modelings.add(type(module).__module__)
        weight = getattr(module, "weight", None)
        if _same_body(forward, llama.LlamaRMSNorm.forward) and isinstance(weight, torch.Tensor) and weight.dim() == 1:
            module.forward = types.MethodType(_fused_rms_norm_forward, module)
            fused += 1
        elif _same_body(forward, llama.LlamaMLP.forward) and _is_silu(getattr(module, "act_fn", None)):
            module.forward = types.MethodType(_fused_mlp_forward, module)
            fused += 1
        elif getattr(module, "is_causal", None) is True:  # an HF attention module
            setattr(module, FUSED_ATTENTION, True)
            fused += 1
    llama_rope = _original(llama.apply_rotary_pos_emb)
    for name in modelings:
        modeling = sys.modules.get(name)
        rope = getattr(modeling, "apply_rotary_pos_emb", None)
        if getattr(rope, "__code__", None) is not None and _same_body(rope, llama_rope):
            modeling.apply_rotary_pos_emb = _fused_rope(rope)  # once a process: the fused one has other code
    return fused
