"""Tests of offloading a module (weights, grads, optimizer state) to host memory and back."""

from __future__ import annotations

import pytest
import torch
from realloc_helpers import build_model, tiny_qwen2_tied

from rlflow.parallel.offload import offload_module

INPUT_IDS = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))


def snapshot(model, optimizer=None) -> dict[str, torch.Tensor]:
    out = {f"p:{n}": p.detach().clone() for n, p in model.named_parameters()}
    out.update({f"g:{n}": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    if optimizer is not None:
        for i, state in enumerate(optimizer.state.values()):
            out.update({f"s{i}:{k}": v.clone() for k, v in state.items() if torch.is_tensor(v)})
    return out


def test_offload_frees_storage_and_reload_restores_everything_bit_for_bit():
    model = build_model(tiny_qwen2_tied()).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(INPUT_IDS).logits.square().mean().backward()
    optimizer.step()
    model(INPUT_IDS).logits.square().mean().backward()  # fresh grads to carry as well
    before = snapshot(model, optimizer)
    handle = offload_module(model, grads=True, buffers=True, optimizer=optimizer)
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert all(p.grad.untyped_storage().nbytes() == 0 for p in model.parameters())
    exp_avg = next(iter(optimizer.state.values()))["exp_avg"]
    assert exp_avg.untyped_storage().nbytes() == 0
    # The tied embedding/head storage is held once.
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert handle.nbytes >= 3 * params  # weights + grads + two Adam moments (+ buffers)
    handle.reload()
    after = snapshot(model, optimizer)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    optimizer.step()  # the optimizer still steps the same tensors


def test_forward_after_reload_is_identical_and_misuse_is_rejected():
    model = build_model(tiny_qwen2_tied())
    with torch.no_grad():
        expected = model(INPUT_IDS).logits
        handle = offload_module(model)
        with pytest.raises(RuntimeError, match="already offloaded"):
            handle.offload()
        handle.reload()
        assert torch.equal(model(INPUT_IDS).logits, expected)
    with pytest.raises(RuntimeError, match="not offloaded"):
        handle.reload()


@pytest.mark.gpu
def test_cuda_offload_uses_pinned_memory_and_overlapped_reload():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = build_model(tiny_qwen2_tied()).cuda()
    ids = INPUT_IDS.cuda()
    with torch.no_grad():
        expected = model(ids).logits
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        handle = offload_module(model)
        assert torch.cuda.memory_allocated() < allocated - handle.nbytes // 2
        assert all(s.host.is_pinned() for _, slots in handle._groups for s in slots)
        for _ in range(2):
            handle.reload(overlap_forward=True)
            assert torch.equal(model(ids).logits, expected)  # layers wait for their own weights
            handle.wait_reloaded()
            assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
            handle.offload()
