"""The engine on one CUDA device: bf16 mixed precision, and packed rows (flash-attn varlen when installed)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from train_engine_helpers import actor_loss, build_model, critic_loss, make_batch, reference_outputs

from rlflow.rendezvous import free_port

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda_mesh():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    port = free_port()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        yield init_device_mesh("cuda", (1, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
    finally:
        dist.destroy_process_group()


def _engine(mesh, packing: str, head: str = "lm"):
    from rlflow.engine.optim import OptimConfig
    from rlflow.engine.train_engine import EngineConfig, TrainEngine

    config = EngineConfig(optim=OptimConfig(lr=1e-3), device="cuda", packing=packing, num_micro_batches=2)
    return TrainEngine(build_model(head=head), mesh, config)


def test_bf16_forward_and_step_on_cuda(cuda_mesh) -> None:
    batch = make_batch()
    with torch.no_grad():
        want = reference_outputs(build_model().eval(), batch)
    engine = _engine(cuda_mesh, packing="off")
    assert engine.compute_dtype == torch.bfloat16
    got = engine.forward(batch)
    valid = batch["attention_mask"].bool()
    torch.testing.assert_close(got["log_probs"][valid], want["log_probs"][valid], atol=0.1, rtol=0.05)
    metrics = engine.train_step(batch, actor_loss, num_mini_batches=2, loss_mask_key="response_mask")
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    # Master weights stay fp32 under the bf16 compute policy.
    assert all(p.dtype == torch.float32 for p in engine.stage.parameters())


def _packed_equals_padded(mesh, packed_mode: str, implementation: str) -> None:
    """Packed engines (``packed_mode``) against padded SDPA engines, bf16, LM and value head."""
    batch = make_batch()
    valid = batch["attention_mask"].bool()
    for head, loss_fn in (("lm", actor_loss), ("value", critic_loss)):
        packed, padded = _engine(mesh, packed_mode, head), _engine(mesh, "off", head)
        assert packed.packing and packed.hf_config._attn_implementation == implementation
        assert padded.hf_config._attn_implementation == "sdpa"
        a, b = packed.forward(batch), padded.forward(batch)
        for key in a:  # bf16 compute: ~3 significant digits per op, a few layers deep
            got, want = (a[key][valid], b[key][valid]) if a[key].shape == valid.shape else (a[key], b[key])
            torch.testing.assert_close(got, want, atol=0.05, rtol=0.05, msg=f"{head}: {key}")
        la = packed.train_step(batch, loss_fn, loss_mask_key="response_mask")["loss"]
        lb = padded.train_step(batch, loss_fn, loss_mask_key="response_mask")["loss"]
        assert la == pytest.approx(lb, rel=0.02, abs=0.01), head


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash-attn is not installed")
def test_flash_attn_packed_rows_equal_padded_sdpa(cuda_mesh) -> None:
    _packed_equals_padded(cuda_mesh, "auto", "flash_attention_2")  # auto: on with CUDA and flash-attn


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn takes the packed path")
def test_varlen_sdpa_packed_rows_on_cuda_equal_padded_sdpa(cuda_mesh) -> None:
    from rlflow.engine.attention import VARLEN_SDPA

    assert not _engine(cuda_mesh, "auto").packing, "auto packing needs flash-attn"
    _packed_equals_padded(cuda_mesh, "on", VARLEN_SDPA)
