"""Correction of the mismatch between a rollout engine's log-probs and the trainer's, beyond the
token-level truncated weight of :func:`rlflow.algos.losses.behaviour_weights`: sequence-level
truncated importance sampling, masked importance sampling (sequences whose ratio leaves a band
are dropped) and token masking outside a band (IcePop-style).

Every correction is a per-token weight, without gradient, that multiplies the advantages: a
dropped sequence or token weighs 0 and so adds nothing to the policy gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlflow.algos.utils import masked_mean, masked_sum

__all__ = ["SEQ_RATIO_FORMS", "mismatch_weights", "sequence_log_ratio"]

# How a sequence's importance ratio is formed from its tokens' ratios.
SEQ_RATIO_FORMS = ("geometric_mean", "product")
# As in losses.py: exp() of a log-ratio beyond ±20 is 0 or inf in practice.
_MAX_LOG_RATIO = 20.0


def sequence_log_ratio(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, form: str) -> Tensor:
    """Log of each sequence's importance ratio ``pi_old(y) / pi_rollout(y)``.

    Args:
        old_logp: ``(B, T)`` the trainer's log-probs of the sampled tokens.
        rollout_logp: ``(B, T)`` the rollout engine's log-probs of the same tokens.
        mask: ``(B, T)`` 1 on response tokens.
        form: ``"product"`` (the sequence's likelihood ratio, ``sum_t log r_t``) or
            ``"geometric_mean"`` (length-normalised, ``mean_t log r_t``).

    Returns:
        ``(B,)``, clamped to ±20; 0 for a sequence without tokens.

    >>> sequence_log_ratio(torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2), torch.ones(1, 2), "geometric_mean")
    tensor([0.5000])
    """
    log_ratio = (old_logp.detach().float() - rollout_logp.float()) * mask.float()
    if form == "product":
        total = masked_sum(log_ratio, mask, dim=-1)
    elif form == "geometric_mean":
        total = masked_mean(log_ratio, mask, dim=-1)
    else:
        raise ValueError(f"unknown sequence ratio form {form!r}; expected one of {SEQ_RATIO_FORMS}")
    return total.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def _outside(values: Tensor, low: float | None, high: float | None) -> Tensor:
    """Where ``values`` leave ``[low, high]`` (an unset bound does not bind)."""
    out = torch.zeros_like(values, dtype=torch.bool)
    if low is not None:
        out |= values < low
    if high is not None:
        out |= values > high
    return out


def mismatch_weights(
    old_logp: Tensor,
    rollout_logp: Tensor,
    mask: Tensor,
    *,
    seq_tis_cap: float | None = None,
    seq_ratio: str = "geometric_mean",
    seq_mask_low: float | None = None,
    seq_mask_high: float | None = None,
    token_mask_low: float | None = None,
    token_mask_high: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Per-token weights correcting the rollout engine's sampling toward the trainer's policy.

    With ``r_t = pi_old(y_t) / pi_rollout(y_t)`` and the sequence ratio ``s`` of ``seq_ratio``
    (:func:`sequence_log_ratio`), the weight of token ``t`` of a sequence is the product of
    ``min(s, seq_tis_cap)`` (sequence TIS), ``[seq_mask_low <= s <= seq_mask_high]`` (masked IS)
    and ``[token_mask_low <= r_t <= token_mask_high]`` (token masking); an unset option is 1.

    Args:
        old_logp: ``(B, T)`` the trainer's (recomputed) log-probs of the sampled tokens.
        rollout_logp: ``(B, T)`` the rollout engine's log-probs of the same tokens.
        mask: ``(B, T)`` 1 on response tokens.
        seq_tis_cap: truncation of the sequence weight; ``None``: no sequence weight.
        seq_ratio: see :func:`sequence_log_ratio`.
        seq_mask_low, seq_mask_high: the band of ``s`` a sequence is kept in; ``None``: unbounded.
        token_mask_low, token_mask_high: the band of ``r_t`` a token is kept in; ``None``: unbounded.

    Returns:
        ``(weights, metrics)``: ``(B, T)`` weights (0 outside the mask, no gradient), and
        ``mismatch_seq_ratio_mean`` / ``_min`` / ``_max`` over the sequences with tokens, plus,
        for the options set, ``mismatch_seq_truncated_fraction`` (sequences whose weight hit the
        cap), ``mismatch_seq_masked_fraction`` (sequences dropped) and
        ``mismatch_token_masked_fraction`` (tokens dropped, of the response tokens).

    >>> old, rollout = torch.log(torch.tensor([[0.5, 0.5], [0.9, 0.1]])), torch.log(torch.full((2, 2), 0.5))
    >>> w, m = mismatch_weights(old, rollout, torch.ones(2, 2), token_mask_low=0.5, token_mask_high=2.0)
    >>> w.tolist(), m["mismatch_token_masked_fraction"]  # r = 1.8 is kept, 0.2 is not
    ([[1.0, 1.0], [1.0, 0.0]], 0.25)
    """
    real = mask.bool()
    has_tokens = real.any(dim=-1)  # (B,)
    seq_log = sequence_log_ratio(old_logp, rollout_logp, mask, seq_ratio)  # (B,)
    s = seq_log.exp()
    weights = real.float()
    kept = s[has_tokens]
    metrics = {
        "mismatch_seq_ratio_mean": float(kept.mean()) if kept.numel() else 0.0,
        "mismatch_seq_ratio_min": float(kept.min()) if kept.numel() else 0.0,
        "mismatch_seq_ratio_max": float(kept.max()) if kept.numel() else 0.0,
    }
    num_seqs = max(int(has_tokens.sum()), 1)
    if seq_tis_cap is not None:
        weights = weights * s.clamp(max=seq_tis_cap).unsqueeze(-1)
        metrics["mismatch_seq_truncated_fraction"] = float((kept > seq_tis_cap).sum()) / num_seqs
    if seq_mask_low is not None or seq_mask_high is not None:
        dropped = _outside(s, seq_mask_low, seq_mask_high)  # (B,)
        weights = weights * (~dropped).float().unsqueeze(-1)
        metrics["mismatch_seq_masked_fraction"] = float(dropped[has_tokens].sum()) / num_seqs
    if token_mask_low is not None or token_mask_high is not None:
        log_r = (old_logp.detach().float() - rollout_logp.float()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        dropped = _outside(log_r.exp(), token_mask_low, token_mask_high) & real
        weights = weights * (~dropped).float()
        metrics["mismatch_token_masked_fraction"] = float(dropped.sum()) / max(int(real.sum()), 1)
    return weights, metrics
