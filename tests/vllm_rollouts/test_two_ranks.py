"""vLLM on two CPU processes (each one rank of vLLM's external launcher, over gloo), with tp = 2 and
with dp = 2: the weights reach each rank's share of vLLM's fused parameters through the reshard
executor, straight from the full model on rank 0, and every rank generates for its prompts what the
built-in sampler generates."""

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

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
WORLD = 2
PARAMS = SamplingParams(greedy=True, max_new_tokens=10)


def _prompts(dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return left_padded_prompts([5, 9, 3, 7, 11, 2], seed=3 + dp_rank)


def _rank(rank: int, dp: int, tp: int, port: int, out_dir: str) -> None:
    from rlflow.engine.rollout.vllm_engine import VLLMRolloutEngine
    from rlflow.parallel.executor import execute_reshard, module_param_tensors
    from rlflow.parallel.layout import build_layout
    from rlflow.parallel.reshard import plan_reshard

    os.environ.update(OMP_NUM_THREADS="1", LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    mesh = torch.distributed.device_mesh.DeviceMesh(
        "cpu", torch.arange(WORLD).view(1, dp, tp), mesh_dim_names=("pp", "dp", "tp")
    )
    model = tiny_model(seed=7)
    engine = VLLMRolloutEngine(model.config, mesh)
    src = build_layout(model.config, ParallelStrategy(), [0])  # the full model, on rank 0 only
    plan = plan_reshard(src, build_layout(model.config, ParallelStrategy(dp=dp, tp=tp), range(WORLD), style="vllm"))
    stats = execute_reshard(
        plan, rank, module_param_tensors(model) if rank == 0 else None, engine.param_tensors(), dtype=torch.float32
    )
    engine.weights_updated()
    pushed = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    responses = engine.generate(_prompts(mesh["dp"].get_local_rank()), PARAMS)["responses"]
    engine.update_weights(model.state_dict())  # vLLM's own loader: each rank cuts its share
    loaded = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    torch.save({"responses": responses, "pushed": pushed, "loaded": loaded, "bytes": stats.received_bytes},
               os.path.join(out_dir, f"rank{rank}.pt"))  # fmt: skip
    dist.barrier()


def _run(dp: int, tp: int, out_dir) -> list[dict]:
    mp.start_processes(_rank, args=(dp, tp, free_port(), str(out_dir)), nprocs=WORLD, start_method="spawn")
    ranks = [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD)]
    model = tiny_model(seed=7)
    for r, out in enumerate(ranks):
        expected = HFRolloutEngine(model).generate(_prompts(r // tp), PARAMS)["responses"]
        assert torch.equal(out["responses"], expected), r
        assert out["pushed"].keys() == out["loaded"].keys()
        assert all(torch.equal(out["pushed"][n], out["loaded"][n]) for n in out["pushed"])
    assert ranks[1]["bytes"] > 0  # rank 1 received its share from rank 0
    return ranks


def test_tp2_on_two_cpu_processes_pushes_and_generates_like_the_builtin_sampler(tmp_path):
    ranks = _run(1, 2, tmp_path)
    # Each rank holds half of every split parameter: qkv is (4 + 2*2) heads * 32 / 2 rows.
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert ranks[0]["pushed"][qkv].shape == ranks[1]["pushed"][qkv].shape == (4 * 32, 128)
    assert not torch.equal(ranks[0]["pushed"][qkv], ranks[1]["pushed"][qkv])


def test_dp2_on_two_cpu_processes_pushes_and_generates_like_the_builtin_sampler(tmp_path):
    ranks = _run(2, 1, tmp_path)
    assert not torch.equal(ranks[0]["responses"], ranks[1]["responses"])  # each rank its own prompts
    assert all(torch.equal(ranks[0]["pushed"][n], ranks[1]["pushed"][n]) for n in ranks[0]["pushed"])
