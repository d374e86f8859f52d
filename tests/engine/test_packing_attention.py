"""The varlen SDPA attention: per-sequence equivalence, fallbacks, errors, and packed HF stages."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rlflow.engine.attention import (
    VARLEN_SDPA,
    check_varlen_implementation,
    repad_indices,
    varlen_kwargs,
    varlen_sdpa_attention,
)
from rlflow.engine.packing import max_seqlen, pack, position_ids_from_mask, unpack
from rlflow.engine.pipeline import build_stage

torch.set_num_threads(1)

LENGTHS = [5, 1, 17, 0, 9]  # very different lengths and an empty sequence


class _Attn(nn.Module):
    is_causal = True


def _packed_qkv(lengths: list[int], heads: int = 4, kv_heads: int = 2, dim: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(1, heads, total, dim, generator=g, dtype=torch.float64)
    k = torch.randn(1, kv_heads, total, dim, generator=g, dtype=torch.float64)
    v = torch.randn(1, kv_heads, total, dim, generator=g, dtype=torch.float64)
    cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    return q, k, v, cu


def _per_sequence_reference(q, k, v, cu, *, causal: bool, window: int | None) -> torch.Tensor:
    """Attention of every sequence on its own, written out: softmax(q kᵀ / √d + mask) v."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    outs = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        scores = q[0, :, s:e] @ k[0, :, s:e].transpose(-1, -2) / q.shape[-1] ** 0.5
        i = torch.arange(e - s)
        allowed = torch.ones(e - s, e - s, dtype=torch.bool)
        if causal:
            allowed &= i[None, :] <= i[:, None]
        if window is not None:
            allowed &= i[:, None] - i[None, :] < window
        outs.append(torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v[0, :, s:e])
    return torch.cat(outs, dim=1).transpose(0, 1).unsqueeze(0)  # (1, total, H, D)


def test_repad_indices_round_trip() -> None:
    cu = torch.tensor([0, 5, 6, 23, 23, 32], dtype=torch.int32)
    gather, scatter = repad_indices(cu, 17)
    packed = torch.arange(32)
    assert torch.equal(packed.index_select(0, gather).index_select(0, scatter), packed)
    padded = packed.index_select(0, gather).view(5, 17)
    assert padded[0, :5].tolist() == [0, 1, 2, 3, 4] and padded[2].tolist() == list(range(6, 23))


@pytest.mark.parametrize(("causal", "window"), [(True, None), (True, 3), (False, None)])
def test_matches_attention_of_each_sequence_alone(causal: bool, window: int | None) -> None:
    q, k, v, cu = _packed_qkv(LENGTHS)
    for t in (q, k, v):
        t.requires_grad_(True)
    got, _ = varlen_sdpa_attention(
        _Attn(), q, k, v, None, is_causal=causal, sliding_window=window, **varlen_kwargs(cu, max_seqlen(cu))
    )
    want = _per_sequence_reference(q, k, v, cu, causal=causal, window=window)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    grad = torch.randn_like(want)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    # The boundaries matter: the same row read as one sequence attends across them.
    whole = torch.tensor([0, sum(LENGTHS)], dtype=torch.int32)
    mixed, _ = varlen_sdpa_attention(_Attn(), q, k, v, None, is_causal=causal, **varlen_kwargs(whole, sum(LENGTHS)))
    assert (mixed - got).abs().max() > 0.1


def test_padded_calls_run_hf_sdpa() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, h, 6, 8, generator=g) for h in (4, 2, 2))
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    mask[0, :, :, :2] = False
    mask[0, :, :2, :2] = torch.eye(2, dtype=torch.bool)
    module = _Attn()
    module.num_key_value_groups = 2
    got, _ = varlen_sdpa_attention(module, q, k, v, mask)
    want, _ = sdpa_attention_forward(module, q, k, v, mask)
    assert torch.equal(got, want)


def test_errors_name_the_problem() -> None:
    q, k, v, cu = _packed_qkv([3, 4])
    kwargs = varlen_kwargs(cu, 4)
    with pytest.raises(ValueError, match="without a mask"):
        varlen_sdpa_attention(_Attn(), q, k, v, torch.ones(1, 1, 7, 7, dtype=torch.bool), **kwargs)
    with pytest.raises(ValueError, match="cu_seq_lens_k must equal"):
        varlen_sdpa_attention(_Attn(), q, k, v, None, **{**kwargs, "cu_seq_lens_k": torch.tensor([0, 2, 7])})
    with pytest.raises(ValueError, match="softcap=30.0"):
        varlen_sdpa_attention(_Attn(), q, k, v, None, softcap=30.0, **kwargs)
    with pytest.raises(ValueError, match="'sdpa'"):
        check_varlen_implementation("sdpa")


def _sliding_qwen2() -> nn.Module:
    """Qwen2 with GQA and sliding-window attention on its last two layers."""
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=2,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


def test_packed_stage_equals_padded_hf_model_with_sliding_windows() -> None:
    model = _sliding_qwen2()
    assert "sliding_attention" in model.config.layer_types
    lengths = [3, 21, 9, 14]
    mask = torch.zeros(len(lengths), 24, dtype=torch.long)
    for row, n in enumerate(lengths):  # left padding on even rows, right padding on odd ones
        if row % 2 == 0:
            mask[row, 24 - n :] = 1
        else:
            mask[row, :n] = 1
    ids = torch.randint(1, 64, mask.shape, generator=torch.Generator().manual_seed(2)) * mask
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
        packed_ids, cu, pos = pack(ids, mask)
        stage = build_stage(model, 1, 0)
        with pytest.raises(ValueError, match="varlen attention implementation"):
            stage(packed_ids, position_ids=pos, cu_seqlens=cu, max_seqlen=max_seqlen(cu))
        model.set_attn_implementation(VARLEN_SDPA)
        got = unpack(stage(packed_ids, position_ids=pos, cu_seqlens=cu, max_seqlen=max_seqlen(cu)), mask)
    valid = mask.bool()
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=1e-5)


def test_16_bit_attention_on_a_cpu_runs_in_float32():
    # torch's CPU flash kernel is slower in bf16 than in fp32 (its backward about 3x): bf16 models
    # attend in fp32 there, packed rows and padded batches alike, and the output is rounded back.
    q, k, v, cu = _packed_qkv([5, 3, 7])
    module = nn.Module()
    module.is_causal = True
    half = [t.bfloat16() for t in (q, k, v)]
    kwargs = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)
    out, _ = varlen_sdpa_attention(module, *half, None, **kwargs)
    wide, _ = varlen_sdpa_attention(module, *(t.float() for t in half), None, **kwargs)
    assert out.dtype == torch.bfloat16 and torch.equal(out, wide.bfloat16())
    padded = [t.bfloat16() for t in torch.randn(3, 2, 4, 6, 8).unbind(0)]
    out, _ = varlen_sdpa_attention(module, *padded, None, is_causal=True)
    wide, _ = sdpa_attention_forward(module, *(t.float() for t in padded), None, is_causal=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, wide.bfloat16())


@pytest.mark.parametrize(
    "precision, fused, rlflows", [("bf16", False, True), ("fp32", True, True), ("fp32", False, False)]
)
def test_a_cpu_engine_attends_through_rlflows_sdpa_in_16_bit_or_fused(single_mesh, precision, fused, rlflows):
    """16-bit attention widened to float32, or the fused causal kernel (fused_cpu_ops), go through
    rlflow's attention function; a float32 engine without the fused ops keeps HF's SDPA."""
    from rlflow.data.tiny_models import build_tiny_model
    from rlflow.engine.train_engine import EngineConfig, TrainEngine

    model = build_tiny_model("llama", vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1)
    config = EngineConfig(device="cpu", mixed_precision=precision, fused_cpu_ops=fused)
    engine = TrainEngine(model, single_mesh, config)
    assert (engine.hf_config._attn_implementation == VARLEN_SDPA) == rlflows
