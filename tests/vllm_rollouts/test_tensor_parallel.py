"""vLLM with tp=2 on two CPU processes (each one rank of vLLM's external launcher, over gloo): the
weights reach each rank's half of vLLM's fused parameters through the reshard executor, straight
from the full model on rank 0, and both ranks generate what the built-in sampler generates."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from vllm_helpers import left_padded_prompts, tiny_model

from rlflow.engine.rollout import HFRolloutEngine, SamplingParams
from rlflow.rendezvous import free_port
from rlflow.strategy import ParallelStrategy

pytestmark = pytest.mark.vllm
TP = 2
PARAMS = SamplingParams(greedy=True, max_new_tokens=10)


def _rank(rank: int, port: int, out_dir: str) -> None:
    from rlflow.engine.rollout.vllm_engine import VLLMRolloutEngine
    from rlflow.parallel.executor import execute_reshard, module_param_tensors
    from rlflow.parallel.layout import build_layout
    from rlflow.parallel.reshard import plan_reshard

    os.environ.update(OMP_NUM_THREADS="1", LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP)
    mesh = torch.distributed.device_mesh.DeviceMesh(
        "cpu", torch.arange(TP).view(1, 1, TP), mesh_dim_names=("pp", "dp", "tp")
    )
    model = tiny_model(seed=7)
    engine = VLLMRolloutEngine(model.config, mesh)
    src = build_layout(model.config, ParallelStrategy(), [0])  # the full model, on rank 0 only
    plan = plan_reshard(src, build_layout(model.config, ParallelStrategy(tp=TP), range(TP), style="vllm"))
    stats = execute_reshard(
        plan, rank, module_param_tensors(model) if rank == 0 else None, engine.param_tensors(), dtype=torch.float32
    )
    engine.weights_updated()
    pushed = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    ids, mask = left_padded_prompts([5, 9, 3, 7, 11, 2], seed=3)
    responses = engine.generate((ids, mask), PARAMS)["responses"]
    engine.update_weights(model.state_dict())  # vLLM's own loader: each rank cuts its half
    loaded = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    torch.save({"responses": responses, "pushed": pushed, "loaded": loaded, "bytes": stats.received_bytes},
               os.path.join(out_dir, f"rank{rank}.pt"))  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(900)
def test_tp2_on_two_cpu_processes_pushes_and_generates_like_the_builtin_sampler(tmp_path):
    mp.start_processes(_rank, args=(free_port(), str(tmp_path)), nprocs=TP, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(TP)]
    model = tiny_model(seed=7)
    ids, mask = left_padded_prompts([5, 9, 3, 7, 11, 2], seed=3)
    expected = HFRolloutEngine(model).generate((ids, mask), PARAMS)["responses"]
    for r in ranks:
        assert torch.equal(r["responses"], expected)
        assert r["pushed"].keys() == r["loaded"].keys()
        assert all(torch.equal(r["pushed"][n], r["loaded"][n]) for n in r["pushed"])
    # Each rank holds half of every split parameter: qkv is (4 + 2*2) heads * 32 / 2 rows.
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert ranks[0]["pushed"][qkv].shape == ranks[1]["pushed"][qkv].shape == (4 * 32, 128)
    assert not torch.equal(ranks[0]["pushed"][qkv], ranks[1]["pushed"][qkv])
    assert ranks[1]["bytes"] > 0  # rank 1 received its half from rank 0
