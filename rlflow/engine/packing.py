"""Sequence packing: padded ``(B, T)`` batches ↔ one packed row of valid tokens.

Padding wastes compute on tokens that are thrown away; the variable-length attention kernels
(flash-attn ``flash_attn_varlen_func``, HF's packed-sequence path) instead take the valid
tokens of every sequence laid end to end in one row, plus ``cu_seqlens`` — the cumulative
sequence lengths ``[0, l0, l0+l1, ...]`` that tell the kernel where each sequence starts.

The valid tokens of row ``b`` are the positions where ``attention_mask[b] == 1``, kept in
order, so left padding, right padding and both at once pack the same way, and :func:`unpack`
puts every value back at the position it came from.

>>> ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
>>> mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
>>> packed, cu_seqlens, position_ids = pack(ids, mask)
>>> packed.tolist(), cu_seqlens.tolist(), position_ids.tolist()
([[5, 6, 7, 8, 9]], [0, 2, 5], [[0, 1, 0, 1, 2]])
>>> unpack(packed, mask).tolist()
[[0, 5, 6], [7, 8, 9]]

The training engine runs a packed row through a varlen attention kernel and hands it the
boundaries explicitly (``cu_seqlens`` and :func:`max_seqlen`, see
:mod:`rlflow.engine.attention`). A plain HF model can also run one: called with
``position_ids``, without ``attention_mask`` *and* with ``use_cache=False``, it detects the
restarts of ``position_ids`` and masks each sequence off (with a cache, HF skips that
detection and lets the sequences attend to each other)::

    logits = model(input_ids=packed, position_ids=position_ids, use_cache=False).logits
"""

from __future__ import annotations

import torch

__all__ = ["cu_seqlens_from_mask", "max_seqlen", "pack", "pack_tensor", "position_ids_from_mask", "unpack"]


def _check_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be 2-D (B, T), got shape {tuple(attention_mask.shape)}")
    return attention_mask.bool()


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position of every token inside its own sequence, counting only valid tokens.

    Args:
        attention_mask: ``(B, T)``, 1 for real tokens, 0 for padding.

    Returns:
        ``(B, T)`` int64: ``0, 1, 2, ...`` over the valid tokens of each row; padding gets 0.
        For a left-padded prompt this is what the model saw during generation.

    >>> position_ids_from_mask(torch.tensor([[0, 0, 1, 1, 1]])).tolist()
    [[0, 0, 0, 1, 2]]
    """
    mask = _check_mask(attention_mask).long()
    return ((mask.cumsum(dim=1) - 1) * mask).clamp(min=0)


def cu_seqlens_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Cumulative valid lengths ``[0, l0, l0+l1, ..., total]``.

    Args:
        attention_mask: ``(B, T)``, 1 for real tokens.

    Returns:
        ``(B + 1,)`` int32, the dtype flash-attn's varlen kernels expect.
    """
    lengths = _check_mask(attention_mask).sum(dim=1, dtype=torch.int32)
    return torch.nn.functional.pad(lengths.cumsum(dim=0, dtype=torch.int32), (1, 0))


def max_seqlen(cu_seqlens: torch.Tensor) -> int:
    """Longest sequence of a packed batch (the ``max_seqlen_q/k`` argument of varlen kernels)."""
    if cu_seqlens.numel() < 2:
        return 0
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def pack_tensor(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Pack any per-token tensor the same way :func:`pack` packs token ids.

    Args:
        values: ``(B, T, ...)`` — log-probs, advantages, hidden states...
        attention_mask: ``(B, T)``.

    Returns:
        ``(1, total, ...)`` where ``total = attention_mask.sum()``.
    """
    mask = _check_mask(attention_mask)
    if values.shape[:2] != mask.shape:
        raise ValueError(f"values shape {tuple(values.shape)} does not start with mask shape {tuple(mask.shape)}")
    return values[mask].unsqueeze(0)


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lay the valid tokens of a padded batch end to end.

    Args:
        input_ids: ``(B, T)`` token ids, padded anywhere.
        attention_mask: ``(B, T)``, 1 for real tokens, 0 for padding.

    Returns:
        ``(packed_ids, cu_seqlens, position_ids)``: ``(1, total)`` ids, ``(B + 1,)`` int32
        boundaries, ``(1, total)`` int64 positions restarting at 0 for each sequence.
    """
    packed_ids = pack_tensor(input_ids, attention_mask)
    position_ids = pack_tensor(position_ids_from_mask(attention_mask), attention_mask)
    return packed_ids, cu_seqlens_from_mask(attention_mask), position_ids


def unpack(packed: torch.Tensor, attention_mask: torch.Tensor, pad_value: float | int = 0) -> torch.Tensor:
    """Inverse of :func:`pack` / :func:`pack_tensor`: scatter packed values back to ``(B, T, ...)``.

    Args:
        packed: ``(1, total, ...)`` values in packed order (unsqueeze a varlen kernel's
            ``(total, ...)`` output first).
        attention_mask: ``(B, T)``, the mask the values were packed with.
        pad_value: value written at padding positions.

    Returns:
        ``(B, T, ...)`` with ``packed``'s dtype and device.
    """
    mask = _check_mask(attention_mask)
    if packed.dim() < 2 or packed.shape[0] != 1:
        raise ValueError(f"packed must have shape (1, total, ...), got {tuple(packed.shape)}")
    flat = packed[0]
    total = int(mask.sum())
    if flat.shape[0] != total:
        raise ValueError(f"packed has {flat.shape[0]} tokens but attention_mask holds {total} valid tokens")
    out = flat.new_full((*mask.shape, *flat.shape[1:]), pad_value)
    out[mask] = flat
    return out
