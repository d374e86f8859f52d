"""The fused causal attention (rlflow.engine.fused_ops.PackedAttentionFunction, kernels/attention.cpp)
against SDPA on each sequence alone: both passes, its AVX-512 and AVX2 kernels, GQA, head sizes that
are no multiple of a vector, the same bits at any thread count; which calls of rlflow's attention
function take it; and the training engine's step with and without it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rlflow import _C_attention
from rlflow.data.tiny_models import build_tiny_model
from rlflow.engine import attention, fused_ops
from rlflow.engine.attention import varlen_kwargs, varlen_sdpa_attention
from rlflow.engine.fused_ops import FUSED_ATTENTION, PACKED_ATTENTION_MAX_LEN, PackedAttentionFunction
from rlflow.engine.train_engine import EngineConfig, TrainEngine

torch.set_num_threads(1)

LEVELS = [level for level in (2, 1) if _C_attention.kernels(level) == level]
# the kernels as torch's CPU capability allows them (ATEN_CPU_CAPABILITY=default: none)
needs_kernels = pytest.mark.skipif(fused_ops.kernel_cap() < 1, reason="torch's CPU capability allows no AVX2 kernels")


def _qkv(lengths, heads, kv_heads, dim, seed=0, rows=1):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths) if rows == 1 else lengths[0]
    # (B, T, H, D) projections seen (B, H, T, D), as HF's attention lays them out
    q = torch.randn(rows, total, heads, dim, generator=g).transpose(1, 2)
    k = torch.randn(rows, total, kv_heads, dim, generator=g).transpose(1, 2)
    v = torch.randn(rows, total, kv_heads, dim, generator=g).transpose(1, 2)
    cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    return q, k, v, cu


def _passes(fn, q, k, v, grad):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in leaves]


def _sdpa_per_sequence(q, k, v, cu):
    """SDPA (float64) on each sequence of a packed row alone; ``(1, total, H, D)``."""
    outs = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        o = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, s:e].double(), k[:, :, s:e].double(), v[:, :, s:e].double(), is_causal=True,
            enable_gqa=q.shape[1] != k.shape[1],
        )  # fmt: skip
        outs.append(o.float())
    return torch.cat(outs, dim=2).transpose(1, 2)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize(
    "lengths, heads, kv_heads, dim",
    [
        ([5, 1, 17, 0, 9], 4, 2, 8),  # an empty sequence, one of one token, GQA
        ([70, 135], 8, 8, 64),  # the compute task's heads; a last tile of 6 rows and one of 3
        ([40, 3], 6, 1, 24),  # one kv head for six; a head size of a vector and a half
        ([33], 2, 2, 100),  # a head size that is no multiple of 8
    ],
)
def test_both_passes_equal_sdpa_on_each_sequence(monkeypatch, level, lengths, heads, kv_heads, dim):
    monkeypatch.setattr(fused_ops, "kernel_cap", lambda: level)
    q, k, v, cu = _qkv(lengths, heads, kv_heads, dim)
    grad = torch.randn(1, sum(lengths), heads, dim, generator=torch.Generator().manual_seed(1))
    max_len = max(lengths)
    got = _passes(lambda *t: PackedAttentionFunction.apply(*t, cu, max_len, dim**-0.5), q, k, v, grad)
    want = _passes(lambda *t: _sdpa_per_sequence(*t, cu), q, k, v, grad)
    assert got[0].shape == (1, sum(lengths), heads, dim)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)


@needs_kernels
def test_rows_of_one_length_are_sequences_of_their_own():
    q, k, v, _ = _qkv([12], heads=4, kv_heads=2, dim=16, rows=3)
    bounds = torch.arange(4) * 12
    grad = torch.randn(3, 12, 4, 16)
    got = _passes(lambda *t: PackedAttentionFunction.apply(*t, bounds, 12, 0.3), q, k, v, grad)
    sdpa = lambda *t: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        *t, is_causal=True, scale=0.3, enable_gqa=True
    ).transpose(1, 2)
    want = _passes(sdpa, q, k, v, grad)
    for a, b in zip(got, want):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@needs_kernels
def test_the_same_bits_at_any_thread_count():
    q, k, v, cu = _qkv([33, 64, 7, 100], heads=4, kv_heads=2, dim=32)
    grad = torch.randn(1, 204, 4, 32)
    results = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        results.append(_passes(lambda *t: PackedAttentionFunction.apply(*t, cu, 100, 0.2), q, k, v, grad))
    torch.set_num_threads(1)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


@needs_kernels
def test_the_kernel_refuses_bounds_past_max_len():
    q, k, v, cu = _qkv([5, 9], heads=2, kv_heads=2, dim=8)
    with pytest.raises(ValueError, match="cu_seqlens must rise by at most max_len"):
        PackedAttentionFunction.apply(q, k, v, cu, 8, 0.3)


class _Attn(nn.Module):
    is_causal = True


def _marked() -> nn.Module:
    module = _Attn()
    setattr(module, FUSED_ATTENTION, True)
    return module


def _counting(monkeypatch) -> list[int]:
    calls = []
    apply = PackedAttentionFunction.apply
    monkeypatch.setattr(attention.PackedAttentionFunction, "apply", lambda *a: calls.append(1) or apply(*a))
    return calls


@needs_kernels
def test_packed_rows_of_a_marked_module_take_the_kernel(monkeypatch):
    calls = _counting(monkeypatch)
    q, k, v, cu = _qkv([5, 1, 17, 9], heads=4, kv_heads=2, dim=8)
    kwargs = varlen_kwargs(cu, 17)
    got, _ = varlen_sdpa_attention(_marked(), q, k, v, None, **kwargs)
    want, _ = varlen_sdpa_attention(_Attn(), q, k, v, None, **kwargs)  # unmarked: SDPA on the padded rows
    assert calls == [1]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@needs_kernels
def test_unmasked_rows_take_the_kernel_and_masked_ones_sdpa(monkeypatch):
    calls = _counting(monkeypatch)
    q, k, v, _ = _qkv([10], heads=4, kv_heads=4, dim=16, rows=2)
    got, _ = varlen_sdpa_attention(_marked(), q, k, v, None)
    want, _ = varlen_sdpa_attention(_Attn(), q, k, v, None)
    assert calls == [1]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    mask = torch.ones(2, 1, 10, 10, dtype=torch.bool).tril()
    varlen_sdpa_attention(_marked(), q, k, v, mask)  # a mask (padding): SDPA takes it
    assert calls == [1]


@pytest.mark.parametrize(
    "why",
    ["sliding window", "dropout", "not causal", "float64", "no vector kernels", "too long", "cached keys"],
)
def test_calls_the_kernel_does_not_take_run_sdpa(monkeypatch, why):
    calls = _counting(monkeypatch)
    q, k, v, cu = _qkv([6, 9], heads=2, kv_heads=2, dim=8)
    kwargs = {**varlen_kwargs(cu, 9)}
    if why == "sliding window":
        kwargs["sliding_window"] = 4
    elif why == "dropout":
        kwargs["dropout"] = 0.1
    elif why == "not causal":
        kwargs["is_causal"] = False
    elif why == "float64":
        q, k, v = q.double(), k.double(), v.double()
    elif why == "no vector kernels":
        monkeypatch.setattr(fused_ops, "kernel_cap", lambda: 0)
    elif why == "too long":
        monkeypatch.setattr(fused_ops, "PACKED_ATTENTION_MAX_LEN", 8)
    else:  # a decode step's query against its cached keys: no packed row, no causal square
        kwargs = {}
        q = q[:, :, -1:]
    varlen_sdpa_attention(_marked(), q, k, v, None, **kwargs)
    assert calls == []


@needs_kernels
def test_the_engines_step_equals_sdpa(single_mesh, monkeypatch):
    """A training step and a forward of rows without padding (the kernel) and with it (SDPA under a
    mask) give the losses, outputs and weights of the engine without the fused ops."""
    ids = torch.randint(0, 48, (3, 20), generator=torch.Generator().manual_seed(0))
    padded = torch.ones_like(ids)
    padded[0, :5] = 0  # a left-padded prompt

    def loss(outputs, batch):
        mask = batch["attention_mask"].float()
        return -(outputs["log_probs"] * mask).sum() / mask.sum(), {}

    calls, results = _counting(monkeypatch), {}
    for fused in (True, False):
        model = build_tiny_model(vocab_size=48, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, seed=5)
        engine = TrainEngine(model, single_mesh, EngineConfig(fused_cpu_ops=fused, device="cpu"))
        marked = [m for m in engine.stage.modules() if getattr(m, FUSED_ATTENTION, False)]
        assert len(marked) == (2 if fused else 0)
        steps = [
            engine.train_step({"input_ids": ids, "attention_mask": m}, loss) for m in (torch.ones_like(ids), padded)
        ]
        forward = engine.forward({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        weights = {n: p.detach().clone() for n, p in engine.stage.named_parameters()}
        results[fused] = ([s["loss"] for s in steps], forward, weights)
        assert len(calls) == (4 if fused else 0)  # two layers' unpadded step and forward; not the padded step
        calls.clear()
    (losses, forward, weights), (want_losses, want_forward, want_weights) = results[True], results[False]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want_losses), atol=1e-5, rtol=0)
    for key, value in want_forward.items():
        torch.testing.assert_close(forward[key], value, atol=1e-5, rtol=0, msg=key)
    for name, value in want_weights.items():
        torch.testing.assert_close(weights[name], value, atol=1e-6, rtol=0, msg=name)


@needs_kernels
def test_the_longest_sequence_it_takes_is_a_module_constant():
    assert fused_ops.packed_attention_takes(*_qkv([9], 2, 2, 8)[:3], PACKED_ATTENTION_MAX_LEN)
    assert not fused_ops.packed_attention_takes(*_qkv([9], 2, 2, 8)[:3], PACKED_ATTENTION_MAX_LEN + 1)
