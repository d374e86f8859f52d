"""GAE over packed (concatenated, variable-length) sequences, with a C++ kernel on CPU.

A packed batch stores the response tokens of ``S`` sequences back to back in 1-D tensors
of ``N`` tokens; ``cu_seqlens`` ``(S + 1,)`` holds the offsets, sequence ``s`` being
``[cu_seqlens[s], cu_seqlens[s + 1])`` — the layout of flash-attention's varlen kernels and
of rlflow's sequence packing. Every sequence is its own episode (value 0 after its end).

The kernel (``kernels/gae.cpp`` → ``rlflow._C_gae``) walks each sequence once; its twin
:func:`gae_packed_torch` pads to ``(S, max_len)`` and runs :func:`gae_advantages`, the
definition the kernel is tested against.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlflow.algos.advantages import gae_advantages

try:
    from rlflow import _C_gae
except ImportError:  # not built (e.g. a source checkout without `setup.py build_ext`)
    _C_gae = None

__all__ = ["gae_packed", "gae_packed_torch", "has_cpp_gae"]


def has_cpp_gae() -> bool:
    """Whether the C++ kernel ``rlflow._C_gae`` is built and importable."""
    return _C_gae is not None


def gae_packed(
    rewards: Tensor, values: Tensor, cu_seqlens: Tensor, gamma: float = 1.0, lam: float = 1.0, use_cpp: bool = True
) -> tuple[Tensor, Tensor]:
    """GAE advantages and returns of packed sequences (not whitened).

    Args:
        rewards: ``(N,)`` reward per token.
        values: ``(N,)`` critic value per token.
        cu_seqlens: ``(S + 1,)`` integer offsets: 0, then the running sum of sequence lengths.
        gamma: discount factor.
        lam: GAE lambda.
        use_cpp: use the C++ kernel when it is built and the tensors are on CPU; otherwise
            (or when it is not built, or for CUDA tensors) run :func:`gae_packed_torch`.

    Returns:
        ``(advantages, returns)``, each ``(N,)`` in the dtype and device of ``rewards``;
        ``returns = advantages + values``. Whiten with ``masked_whiten(adv, ones)`` if wanted.

    >>> r = torch.tensor([0.0, 1.0, 2.0]); v = torch.tensor([0.5, 0.5, 1.0])
    >>> gae_packed(r, v, torch.tensor([0, 2, 3]))[0]
    tensor([0.5000, 0.5000, 1.0000])
    """
    _check_packed(rewards, values, cu_seqlens)
    if not (use_cpp and _C_gae is not None and rewards.device.type == "cpu"):
        return gae_packed_torch(rewards, values, cu_seqlens, gamma, lam)
    # The kernel exists for float32 and float64; half precision runs in float32 (as the
    # torch recursion would need to anyway to avoid accumulating rounding over long sequences).
    dtype = rewards.dtype if rewards.dtype in (torch.float32, torch.float64) else torch.float32
    kernel = _C_gae.gae_packed_f64 if dtype == torch.float64 else _C_gae.gae_packed_f32
    advantages, returns = kernel(
        rewards.detach().to(dtype).contiguous().numpy(),
        values.detach().to(dtype).contiguous().numpy(),
        cu_seqlens.detach().to(torch.int64).contiguous().numpy(),
        float(gamma),
        float(lam),
    )
    return torch.from_numpy(advantages).to(rewards.dtype), torch.from_numpy(returns).to(rewards.dtype)


def gae_packed_torch(
    rewards: Tensor, values: Tensor, cu_seqlens: Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Pure-torch twin of the C++ kernel: pad to ``(S, max_len)``, run :func:`gae_advantages`
    without whitening, and pack the result again. Same arguments and returns as
    :func:`gae_packed`; runs on any device.
    """
    _check_packed(rewards, values, cu_seqlens)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # (S,)
    num_seqs, max_len = lengths.numel(), int(lengths.max().item()) if lengths.numel() else 0
    if max_len == 0:
        return torch.zeros_like(rewards), torch.zeros_like(rewards)
    positions = torch.arange(max_len, device=rewards.device)
    mask = positions.unsqueeze(0) < lengths.to(rewards.device).unsqueeze(1)  # (S, max_len)
    padded_rewards = rewards.new_zeros(num_seqs, max_len)
    padded_values = values.new_zeros(num_seqs, max_len)
    padded_rewards[mask] = rewards  # boolean-mask assignment fills row-major: sequence by sequence
    padded_values[mask] = values.to(rewards.dtype)
    advantages, returns = gae_advantages(padded_rewards, mask, padded_values, gamma=gamma, lam=lam, whiten=False)
    return advantages[mask], returns[mask]


def _check_packed(rewards: Tensor, values: Tensor, cu_seqlens: Tensor) -> None:
    if rewards.dim() != 1 or rewards.shape != values.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and values {tuple(values.shape)} must be equal 1-D shapes")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.is_floating_point():
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor of S + 1 offsets, got {cu_seqlens!r}")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != rewards.numel():
        raise ValueError(
            f"cu_seqlens must run from 0 to the number of tokens {rewards.numel()}, "
            f"got {int(cu_seqlens[0])}..{int(cu_seqlens[-1])}"
        )
    if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu_seqlens.tolist()}")
