"""The training engine's float32 linear layers on a CPU through OpenBLAS, where it multiplies faster
than torch's own BLAS.

torch's x86 wheels multiply float32 matrices with MKL, whose code paths are tuned for Intel's CPUs.
OpenBLAS, from the ``scipy-openblas32`` wheel NumPy's and SciPy's builds come from, picks its
kernels by the CPU's instruction sets; on an AMD EPYC (Zen 3) it runs a training step's forward and
backward a few percent faster (docs/benchmarks.md, "The training step's matmuls through OpenBLAS").
Run on its own threads it contends with torch's OpenMP team for the same cores, so
``kernels/gemm.cpp`` (``rlflow._C_gemm``) runs it on one thread inside each thread of torch's team,
each over its share of the product's rows.

:func:`route_linears` points every ``nn.Linear`` of a model at :class:`LinearFunction`, whose
forward and both gradients (input and weight) are three such products; anything else — a GPU, bf16
or autocast, a tensor-parallel layer's DTensors — runs ``F.linear``, call by call.

Which BLAS (``models.<role>.cpu_gemm``, :func:`resolve_cpu_gemm`): ``auto`` takes OpenBLAS on an
x86-64 CPU not made by Intel where the wheel loads, torch's own elsewhere; ``openblas`` asks for
it (an error where it cannot load); ``torch`` keeps torch's. The choice is the CPU's, not a
timing's, so every process of a run, and a run resumed from its checkpoint, computes alike. The
products equal torch's to float rounding (``tests/engine/test_cpu_gemm.py``); K is never split, so
the bits do not depend on the thread count.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import types

import torch
import torch.nn.functional as F
from torch import nn

from rlflow.engine.fused_ops import plain_float32

try:  # built by `pip install -e .` (setup.py); without it the layers keep F.linear
    from rlflow import _C_gemm
except ImportError:  # pragma: no cover - a source tree without its build
    _C_gemm = None

__all__ = [
    "CPU_GEMMS",
    "LinearFunction",
    "mm",
    "openblas_blocker",
    "resolve_cpu_gemm",
    "route_linears",
]

# models.<role>.cpu_gemm's values
CPU_GEMMS = ("auto", "openblas", "torch")


@functools.cache
def _openblas() -> tuple[int, str] | str:
    """(address of OpenBLAS's ``cblas_sgemm``, its kernels' name), or why it cannot be loaded.
    Loading sets this copy's own thread count to one; nothing else in the process uses it."""
    if _C_gemm is None:
        return "rlflow._C_gemm is not built (pip install -e .)"
    try:
        import scipy_openblas32
    except ImportError:
        return "the scipy-openblas32 wheel is not installed"
    path = os.path.join(scipy_openblas32.get_lib_dir(), f"lib{scipy_openblas32.get_library()}.so")
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        return f"OpenBLAS ({path}) does not load: {e}"
    lib.scipy_openblas_set_num_threads(1)
    lib.scipy_openblas_get_corename.restype = ctypes.c_char_p
    return ctypes.cast(lib.scipy_cblas_sgemm, ctypes.c_void_p).value, lib.scipy_openblas_get_corename().decode()


def openblas_blocker() -> str | None:
    """Why this process cannot multiply through OpenBLAS, or None."""
    loaded = _openblas()
    return loaded if isinstance(loaded, str) else None


def resolve_cpu_gemm(choice: str) -> str:
    """``models.<role>.cpu_gemm`` resolved on this machine: ``"openblas"`` or ``"torch"`` (module
    docstring). ``openblas`` where it cannot load is a ValueError that says why."""
    if choice not in CPU_GEMMS:
        raise ValueError(f"cpu_gemm={choice!r}: expected one of {', '.join(CPU_GEMMS)}")
    if choice == "torch":
        return "torch"
    blocker = openblas_blocker()
    if choice == "openblas":
        if blocker is not None:
            raise ValueError(f"cpu_gemm='openblas': {blocker}")
        return "openblas"
    from rlflow.engine.parallelize import cpu_vendor  # torch.distributed's mesh: not for the config's import

    x86 = platform.machine().lower() in ("x86_64", "amd64")
    return "openblas" if blocker is None and x86 and cpu_vendor() not in ("", "GenuineIntel") else "torch"


def _blas_operand(t: torch.Tensor) -> tuple[torch.Tensor, bool, int]:
    """``t`` (r, c) as a BLAS operand: (tensor, transposed, leading dimension) — row-major as it
    lies, its transpose's storage, or else a contiguous copy."""
    rows, cols = t.shape
    if t.stride(1) == 1 and t.stride(0) >= max(1, cols):
        return t, False, t.stride(0)
    if t.stride(0) == 1 and t.stride(1) >= max(1, rows):
        return t, True, t.stride(1)
    return t.contiguous(), False, max(1, cols)


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of two 2-D float32 CPU tensors through OpenBLAS on torch's threads (a new
    contiguous tensor). Either may be a transposed view: it is read in place."""
    sgemm = _openblas()
    if isinstance(sgemm, str):
        raise RuntimeError(sgemm)
    (m, k), n = a.shape, b.shape[1]
    if b.shape[0] != k:
        raise ValueError(f"mm: shapes {tuple(a.shape)} and {tuple(b.shape)} do not multiply")
    out = torch.empty(m, n, dtype=torch.float32)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    a, trans_a, lda = _blas_operand(a)
    b, trans_b, ldb = _blas_operand(b)
    _C_gemm.sgemm(
        sgemm[0], trans_a, trans_b, m, n, k, a.data_ptr(), lda, b.data_ptr(), ldb, 0.0, out.data_ptr(), max(1, n),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


class LinearFunction(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` of float32 CPU tensors, its three products through :func:`mm`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.detach().reshape(-1, x.shape[-1])
        out = mm(rows, weight.detach().t())
        if bias is not None:
            out += bias.detach()
        ctx.save_for_backward(rows, weight)
        ctx.has_bias = bias is not None
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, weight = ctx.saved_tensors
        grad_rows = grad.reshape(-1, weight.shape[0])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = mm(grad_rows, weight.detach()).view(*grad.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:
            grad_w = mm(grad_rows.t(), rows)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_rows.sum(0)
        return grad_x, grad_w, grad_b


def _routed_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if plain_float32(x, self.weight, self.bias) and x.shape[-1] == self.weight.shape[1]:
        return LinearFunction.apply(x, self.weight, self.bias)
    return F.linear(x, self.weight, self.bias)


def route_linears(model: nn.Module) -> int:
    """Point every ``nn.Linear`` of ``model`` at :class:`LinearFunction` (its instance's forward;
    each call takes it only for plain float32 CPU tensors); returns how many. Needs OpenBLAS
    (:func:`openblas_blocker`)."""
    blocker = openblas_blocker()
    if blocker is not None:
        raise RuntimeError(blocker)
    routed = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.forward = types.MethodType(_routed_linear_forward, module)
            routed += 1
    return routed
