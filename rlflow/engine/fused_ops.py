"""Fused CPU kernels for the training engine's decoder layers: RMSNorm forward and backward in one
pass each.

On a CPU a training step's norms are memory-bound: autograd runs HF's RMSNorm as about five ops
forward and a dozen backward, each a pass over the ``(rows, hidden)`` activations, at the speed of
memory. :func:`fuse_cpu_ops` points the forward of every RMSNorm whose math is Llama's
(``weight * (x * rsqrt(mean(x^2) + eps))``: the same code object as ``LlamaRMSNorm.forward``, which
the Mistral, Qwen2, Qwen3 and Mixtral norms copy) at :class:`RMSNormFunction`, whose two passes are
``rlflow._C_fused`` (``kernels/fused.cpp``): the forward reads ``x`` and writes ``y``, the backward
reads ``dy`` and ``x`` and writes ``dx`` and the weight's gradient.

It takes plain float32 CPU tensors outside autocast (FSDP's gathered weights are plain during
the forward); anything else — a GPU, bf16 compute, a tensor-parallel layer's DTensors or its
not-yet-waited collective results — runs the module's own forward, call by call. The results equal HF's to float rounding (``tests/engine/test_fused_ops.py``); the weight's
gradient sums rows in fixed blocks, so it has the same bits at any thread count.
"""

from __future__ import annotations

import types

import torch
from torch import nn

try:  # built by `pip install -e .` (setup.py); without it the modules keep their own forward
    from rlflow import _C_fused
except ImportError:  # pragma: no cover - a source tree without its build
    _C_fused = None

__all__ = ["RMSNormFunction", "fuse_cpu_ops", "fused_cpu_ops_blocker"]


def _llama_rms_norm_code():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm.forward.__code__


def _same_code(a, b) -> bool:
    return (a.co_code, a.co_names, a.co_consts) == (b.co_code, b.co_names, b.co_consts)


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


def _takes_fused(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # Plain tensors only: a subclass — a DTensor, or the AsyncCollectiveTensor a tensor-parallel
    # layer's input arrives as, whose data is not there until waited for — runs the module's forward.
    return (
        type(x) is torch.Tensor
        and type(weight) in (torch.Tensor, nn.Parameter)
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and x.shape[-1] == weight.numel()
        and not torch.is_autocast_enabled("cpu")
    )


def _fused_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if _takes_fused(hidden_states, self.weight):
        return RMSNormFunction.apply(hidden_states, self.weight, float(self.variance_epsilon))
    return type(self).forward(self, hidden_states)


def fuse_cpu_ops(model: nn.Module) -> int:
    """Point every Llama-style RMSNorm of ``model`` at the fused kernels (module docstring); returns
    how many. Each module decides per call: inputs the kernels do not take run its own forward."""
    if fused_cpu_ops_blocker() is not None:
        return 0
    code = _llama_rms_norm_code()
    fused = 0
    for module in model.modules():
        forward = getattr(type(module), "forward", None)
        if getattr(forward, "__code__", None) is None or not _same_code(forward.__code__, code):
            continue
        if not isinstance(getattr(module, "weight", None), torch.Tensor) or module.weight.dim() != 1:
            continue
        module.forward = types.MethodType(_fused_rms_norm_forward, module)
        fused += 1
    return fused
