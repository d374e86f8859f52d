"""Packed-sequence GAE: the C++ kernel against its torch twin and a naive loop."""

from __future__ import annotations

import pytest
import torch

from rlflow.algos import gae_packed, gae_packed_torch, has_cpp_gae
from rlflow.algos import packed_gae as packed_module

needs_cpp = pytest.mark.skipif(not has_cpp_gae(), reason="rlflow._C_gae not built (run setup.py build_ext)")


def random_packed(seed: int, num_seqs: int, max_len: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, max_len + 1, (num_seqs,), generator=gen)  # zero-length sequences included
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
    num_tokens = int(cu_seqlens[-1])
    rewards = torch.randn(num_tokens, generator=gen, dtype=dtype)
    values = torch.randn(num_tokens, generator=gen, dtype=dtype)
    return rewards, values, cu_seqlens


def naive_packed(rewards, values, cu_seqlens, gamma, lam):
    advantages = torch.zeros_like(rewards, dtype=torch.float64)
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        running = 0.0
        for t in reversed(range(start, end)):
            next_value = values[t + 1].item() if t + 1 < end else 0.0
            running = rewards[t].item() + gamma * next_value - values[t].item() + gamma * lam * running
            advantages[t] = running
    return advantages, advantages + values.double()


def test_torch_twin_matches_naive_loop():
    rewards, values, cu = random_packed(seed=1, num_seqs=7, max_len=12, dtype=torch.float64)
    adv, ret = gae_packed_torch(rewards, values, cu, gamma=0.95, lam=0.9)
    want_adv, want_ret = naive_packed(rewards, values, cu, 0.95, 0.9)
    torch.testing.assert_close(adv, want_adv)
    torch.testing.assert_close(ret, want_ret)


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cpp_kernel_equals_torch_on_random_packed_batches(dtype, seed):
    rewards, values, cu = random_packed(seed, num_seqs=64, max_len=200, dtype=dtype)
    gamma, lam = 0.99, 0.95
    adv_cpp, ret_cpp = gae_packed(rewards, values, cu, gamma, lam, use_cpp=True)
    adv_ref, ret_ref = gae_packed_torch(rewards, values, cu, gamma, lam)
    assert adv_cpp.dtype == dtype and adv_cpp.shape == rewards.shape
    torch.testing.assert_close(adv_cpp, adv_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ret_cpp, ret_ref, rtol=1e-6, atol=1e-6)


@needs_cpp
def test_cpp_kernel_handles_bf16_and_single_sequence():
    rewards, values, cu = random_packed(seed=3, num_seqs=1, max_len=50)
    adv, _ = gae_packed(rewards.bfloat16(), values.bfloat16(), cu)
    ref, _ = gae_packed_torch(rewards.bfloat16().float(), values.bfloat16().float(), cu)
    assert adv.dtype == torch.bfloat16
    torch.testing.assert_close(adv.float(), ref, rtol=1e-2, atol=1e-2)


def test_falls_back_to_torch_when_kernel_missing(monkeypatch):
    rewards, values, cu = random_packed(seed=4, num_seqs=5, max_len=9)
    monkeypatch.setattr(packed_module, "_C_gae", None)
    assert not has_cpp_gae()
    adv, ret = gae_packed(rewards, values, cu, 0.9, 0.8)
    ref_adv, ref_ret = gae_packed_torch(rewards, values, cu, 0.9, 0.8)
    assert torch.equal(adv, ref_adv) and torch.equal(ret, ref_ret)


@pytest.mark.parametrize("use_cpp", [True, False])
def test_bad_offsets_are_rejected(use_cpp):
    rewards, values = torch.zeros(5), torch.zeros(5)
    with pytest.raises(ValueError, match="non-decreasing"):
        gae_packed(rewards, values, torch.tensor([0, 3, 2, 5]), use_cpp=use_cpp)
    with pytest.raises(ValueError, match="from 0 to the number of tokens 5"):
        gae_packed(rewards, values, torch.tensor([0, 4]), use_cpp=use_cpp)
    with pytest.raises(ValueError, match="equal 1-D shapes"):
        gae_packed(rewards, torch.zeros(4), torch.tensor([0, 5]), use_cpp=use_cpp)


@needs_cpp
def test_kernel_validates_its_own_inputs():
    from rlflow import _C_gae

    with pytest.raises(ValueError, match="cu_seqlens\\[0\\] must be 0"):
        _C_gae.gae_packed_f32(torch.zeros(3).numpy(), torch.zeros(3).numpy(), torch.tensor([1, 3]).numpy(), 1.0, 1.0)
