"""The engine on one CUDA device: bf16 mixed precision, and flash-attn packed rows when installed."""

from __future__ import annotations

import importlib.util
import os
import socket

import pytest
import torch
from train_engine_helpers import actor_loss, build_model, make_batch, reference_outputs

pytestmark = pytest.mark.gpu


@pytest.fixture
def cuda_mesh():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        yield init_device_mesh("cuda", (1, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
    finally:
        dist.destroy_process_group()


def _engine(mesh, packing: str):
    from rlflow.engine.optim import OptimConfig
    from rlflow.engine.train_engine import EngineConfig, TrainEngine

    config = EngineConfig(optim=OptimConfig(lr=1e-3), device="cuda", packing=packing, num_micro_batches=2)
    return TrainEngine(build_model(), mesh, config)


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


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash-attn is not installed")
def test_flash_attn_packed_rows_equal_padded(cuda_mesh) -> None:
    batch = make_batch()
    packed = _engine(cuda_mesh, packing="auto")
    assert packed.packing, "auto packing must turn on with CUDA and flash-attn"
    padded = _engine(cuda_mesh, packing="off")
    a, b = packed.forward(batch), padded.forward(batch)
    torch.testing.assert_close(a["log_probs"], b["log_probs"], atol=0.05, rtol=0.05)
