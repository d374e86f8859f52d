"""Variable-length attention over packed rows: flash-attn's varlen kernel on CUDA, SDPA elsewhere.

A packed micro-batch is one row of ``total`` valid tokens, several sequences laid end to end
(:mod:`rlflow.engine.packing`), with ``cu_seqlens = [0, l0, l0+l1, ..., total]`` marking
where each sequence starts. Attention must stay inside each sequence: the mask is block
diagonal, and causal inside each block.

The engine passes ``cu_seqlens`` and ``max_seqlen`` explicitly to every attention call, as
the keyword arguments of HF's ``FlashAttentionKwargs`` (:func:`varlen_kwargs`), instead of
letting HF re-derive them from ``position_ids`` in every layer. Two implementations take them:

* ``"flash_attention_2"`` — HF's own; with these kwargs and no mask it calls
  ``flash_attn_varlen_func`` on the packed tokens. Used on CUDA when flash-attn is installed.
* ``"rlflow_varlen_sdpa"`` (:data:`VARLEN_SDPA`, registered with transformers'
  ``AttentionInterface`` when this module is imported) — :func:`varlen_sdpa_attention`,
  PyTorch's ``scaled_dot_product_attention``: used on CPU, and on CUDA without flash-attn.

So the packed path is the same code on every device; only the kernel differs.

How :func:`varlen_sdpa_attention` stays inside each sequence: it gathers q/k/v of the
packed row into a right-padded ``(B, max_seqlen)`` layout, runs one causal SDPA call, and
gathers the valid outputs back. With right padding, a causal query of a sequence only sees
keys of its own sequence, so no mask is needed (SDPA's fast causal kernels apply, and GQA
runs without repeating k/v). Only the attention scores pay for padding, ``B·max_seqlen²``
instead of ``Σ lᵢ²``; the projections, MLPs and heads (most of the work) run on the
``total`` valid tokens. The alternatives are worse on CPU: one SDPA call per sequence costs
a Python round trip per sequence and layer, and a block-diagonal mask over the packed row
costs ``total²``.

Padded calls (``attention_mask`` given, no ``cu_seq_lens_q``) go to HF's SDPA unchanged,
and the mask builder registered under the same name is SDPA's, so a model set to
:data:`VARLEN_SDPA` also runs ordinary padded batches exactly as ``"sdpa"`` does.

On a CPU, an attention module marked by :func:`rlflow.engine.fused_ops.fuse_cpu_ops` sends its
causal attention over whole sequences — a packed row, or rows of one length without a mask — to
:class:`~rlflow.engine.fused_ops.PackedAttentionFunction` (the causal triangle only, in C++) where
:func:`~rlflow.engine.fused_ops.packed_attention_takes` says the kernel takes it; the rest as above.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rlflow.engine.fused_ops import FUSED_ATTENTION, PackedAttentionFunction, packed_attention_takes

__all__ = [
    "VARLEN_IMPLEMENTATIONS",
    "VARLEN_SDPA",
    "check_varlen_implementation",
    "flash_attn_available",
    "repad_indices",
    "varlen_implementation",
    "varlen_kwargs",
    "varlen_sdpa_attention",
]

VARLEN_SDPA = "rlflow_varlen_sdpa"
# Implementations that attend within each packed sequence when given varlen_kwargs().
VARLEN_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3", VARLEN_SDPA)


def flash_attn_available() -> bool:
    """Whether the ``flash_attn`` package (flash-attention 2) can be imported."""
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def varlen_implementation(device: torch.device) -> str:
    """The attention implementation the engine runs packed rows with on ``device``."""
    if device.type == "cuda" and flash_attn_available():
        return "flash_attention_2"
    return VARLEN_SDPA


def check_varlen_implementation(attn_implementation: str | None) -> None:
    """Raise ``ValueError`` unless ``attn_implementation`` honours ``cu_seqlens``.

    Other implementations (``"sdpa"``, ``"eager"``) ignore the varlen kwargs and, given a
    packed row without a mask, would let the sequences attend to each other.
    """
    if attn_implementation not in VARLEN_IMPLEMENTATIONS:
        raise ValueError(
            f"a packed row needs a varlen attention implementation, one of {VARLEN_IMPLEMENTATIONS}; "
            f"the model's config._attn_implementation is {attn_implementation!r}"
        )


def varlen_kwargs(cu_seqlens: torch.Tensor, max_seqlen: int) -> dict[str, torch.Tensor | int]:
    """Keyword arguments of an HF decoder layer that describe a packed row (``FlashAttentionKwargs``).

    Args:
        cu_seqlens: ``(B + 1,)`` int32 cumulative sequence lengths ``[0, l0, ..., total]``.
        max_seqlen: ``max(lᵢ)``, a Python int (flash-attn's varlen kernels need an int).

    Returns:
        ``{cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k}`` (self-attention: q = k).
    """
    return {
        "cu_seq_lens_q": cu_seqlens,
        "cu_seq_lens_k": cu_seqlens,
        "max_length_q": max_seqlen,
        "max_length_k": max_seqlen,
    }


def repad_indices(cu_seqlens: torch.Tensor, max_seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices that move a packed row into a right-padded ``(B, max_seqlen)`` layout and back.

    Args:
        cu_seqlens: ``(B + 1,)`` cumulative sequence lengths.
        max_seqlen: at least the longest sequence.

    Returns:
        ``(gather, scatter)``: ``gather`` ``(B * max_seqlen,)`` is the packed token to put at
        every padded slot (padding slots repeat a valid token; causal attention never lets a
        valid query see them); ``scatter`` ``(total,)`` is the padded slot of every packed
        token, in packed order.

    >>> g, s = repad_indices(torch.tensor([0, 2, 5]), 3)
    >>> g.tolist(), s.tolist()
    ([0, 1, 1, 2, 3, 4], [0, 1, 3, 4, 5])
    """
    cu = cu_seqlens.to(torch.long)
    lengths = cu[1:] - cu[:-1]
    cols = torch.arange(max_seqlen, device=cu.device)
    gather = torch.minimum(cu[:-1, None] + cols, (cu[1:, None] - 1).clamp(min=0))
    scatter = (cols < lengths[:, None]).flatten().nonzero().squeeze(1)
    return gather.flatten(), scatter


def _attention_mask(max_seqlen: int, device: torch.device, *, causal: bool, sliding_window: int | None):
    """``(L, L)`` bool mask (True = attend) for the padded layout, or ``None`` for plain causal."""
    if causal and sliding_window is None:
        return None
    q = torch.arange(max_seqlen, device=device)[:, None]
    k = torch.arange(max_seqlen, device=device)[None, :]
    # Non-causal attention would let valid queries see padding keys: the caller masks them.
    mask = k <= q if causal else torch.ones(max_seqlen, max_seqlen, dtype=torch.bool, device=device)
    if sliding_window is not None:
        mask = mask & (q - k < sliding_window)  # HF's sliding window: the last `sliding_window` keys
    return mask


def _widened_on_cpu(query: torch.Tensor) -> bool:
    """Whether a 16-bit attention on a CPU runs in float32: torch's CPU flash kernel, forward and
    backward, is slower in bfloat16 than in float32 (docs/benchmarks.md, "Precision", times both),
    and the scores are the most rounding-sensitive part of a layer."""
    return query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16)


def _fused_causal(module: nn.Module, is_causal: bool | None, sliding_window: int | None, dropout: float) -> bool:
    """Whether a call of ``module`` may take the fused packed-attention kernel: causal over whole
    sequences, no dropout, and the module marked by ``fuse_cpu_ops`` (``models.<role>.fused_cpu_ops``)."""
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    return bool(causal) and sliding_window is None and not dropout and getattr(module, FUSED_ATTENTION, False)


def _scale(query: torch.Tensor, scaling: float | None) -> float:
    return query.shape[-1] ** -0.5 if scaling is None else scaling


def varlen_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention function (``AttentionInterface``) for packed rows, on PyTorch SDPA.

    Args:
        module: the HF attention module (reads ``is_causal``).
        query: ``(1, Hq, total, D)`` packed queries (after rotary embeddings).
        key, value: ``(1, Hkv, total, D)``; ``Hq`` a multiple of ``Hkv`` (GQA).
        attention_mask: must be ``None`` for a packed row; a padded call (mask given, no
            ``cu_seq_lens_q``) is handed to HF's SDPA attention unchanged.
        dropout: attention dropout probability.
        scaling: softmax scale (default ``D ** -0.5``).
        is_causal: overrides ``module.is_causal``.
        sliding_window: attend to at most this many most recent keys (``None``: all).
        cu_seq_lens_q, cu_seq_lens_k: ``(B + 1,)`` sequence boundaries (equal: self-attention).
        max_length_q, max_length_k: the longest sequence, an int.

    Returns:
        ``(output, None)`` with output ``(1, total, Hq, D)``, what HF attention functions return.
    """
    if _widened_on_cpu(query):
        out, weights = varlen_sdpa_attention(
            module, query.float(), key.float(), value.float(),
            attention_mask.float() if attention_mask is not None and attention_mask.is_floating_point() else attention_mask,
            dropout=dropout, scaling=scaling, is_causal=is_causal, sliding_window=sliding_window,
            cu_seq_lens_q=cu_seq_lens_q, cu_seq_lens_k=cu_seq_lens_k, max_length_q=max_length_q,
            max_length_k=max_length_k, **kwargs,
        )  # fmt: skip
        return out.to(query.dtype), weights
    if cu_seq_lens_q is None:
        rows, length = query.shape[0], query.shape[2]
        if (
            attention_mask is None
            and _fused_causal(module, is_causal, sliding_window, dropout)
            and key.shape[2] == length
            and packed_attention_takes(query, key, value, length)
        ):  # rows of one length, each causal on its own: packed rows of equal lengths
            bounds = torch.arange(rows + 1, dtype=torch.int64) * length
            return PackedAttentionFunction.apply(query, key, value, bounds, length, _scale(query, scaling)), None
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if attention_mask is not None or query.shape[0] != 1:
        raise ValueError(
            f"a packed row is one row without a mask; got query batch {query.shape[0]} and "
            f"attention_mask {None if attention_mask is None else tuple(attention_mask.shape)}"
        )
    if cu_seq_lens_k is not cu_seq_lens_q and not torch.equal(cu_seq_lens_k, cu_seq_lens_q):
        raise ValueError("varlen_sdpa_attention runs self-attention only: cu_seq_lens_k must equal cu_seq_lens_q")
    if kwargs.get("softcap") is not None:
        raise ValueError(f"softcap={kwargs['softcap']} is not supported by {VARLEN_SDPA}")
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if query.shape[2] == 0:  # no valid token in the micro-batch
        return query.new_zeros(1, 0, query.shape[1], query.shape[3]), None
    num_seqs, max_len = cu_seq_lens_q.numel() - 1, int(max_length_q if max_length_q is not None else max_length_k)
    if _fused_causal(module, is_causal, sliding_window, dropout) and packed_attention_takes(query, key, value, max_len):
        return PackedAttentionFunction.apply(query, key, value, cu_seq_lens_q, max_len, _scale(query, scaling)), None
    gather, scatter = repad_indices(cu_seq_lens_q, max_len)

    def repad(x: torch.Tensor) -> torch.Tensor:  # (1, H, total, D) -> (B, H, L, D)
        heads, dim = x.shape[1], x.shape[3]
        return x[0].index_select(1, gather).view(heads, num_seqs, max_len, dim).transpose(0, 1)

    q, k, v = repad(query), repad(key), repad(value)
    mask = _attention_mask(max_len, query.device, causal=causal, sliding_window=sliding_window)
    if not causal:  # padding keys: keep each sequence's own keys (and the diagonal, so no row is empty)
        own = torch.arange(max_len, device=query.device) < (cu_seq_lens_q[1:] - cu_seq_lens_q[:-1])[:, None]
        mask = (mask & own[:, None, None, :]) | torch.eye(max_len, dtype=torch.bool, device=query.device)
    out = nn.functional.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=mask is None,
        enable_gqa=q.shape[1] != k.shape[1],
    )  # (B, Hq, L, D)
    out = out.transpose(1, 2).reshape(num_seqs * max_len, out.shape[1], out.shape[3])
    return out.index_select(0, scatter).unsqueeze(0), None


AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention)
AttentionMaskInterface.register(VARLEN_SDPA, sdpa_mask)
