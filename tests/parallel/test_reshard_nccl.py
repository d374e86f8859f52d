"""Reshard plans executed on device tensors: NCCL on two GPUs (``gpu``), and the same body on
two gloo processes so that it is checked on every machine.

The executor packs each peer's pieces into one buffer on the tensors' device and exchanges them
with ``batch_isend_irecv``; on NCCL that needs CUDA buffers and one GPU per rank (NCCL refuses
two ranks on one device, so a one-GPU machine cannot run it). The pairs cover FSDP-sharded,
tensor-parallel and replicated layouts on both ranks, and copies between disjoint single ranks.
"""

from __future__ import annotations

import pytest
import torch
from realloc_helpers import build_model, full_state, run_world, tiny_llama_gqa

from rlflow.parallel.executor import execute_reshard
from rlflow.parallel.layout import build_layout
from rlflow.parallel.reshard import plan_reshard, transfer_bytes_summary
from rlflow.strategy import ParallelStrategy

S = ParallelStrategy
PAIRS = [  # (source strategy, ranks, fsdp) -> (destination strategy, ranks, fsdp)
    ((S(dp=2), (0, 1), True), (S(tp=2), (0, 1), False)),  # FSDP home -> tp rollout
    ((S(tp=2), (0, 1), False), (S(dp=2), (0, 1), True)),  # and back
    ((S(dp=2), (0, 1), True), (S(dp=2), (0, 1), False)),  # FSDP -> replicas (all-gather)
    ((S(dp=2), (0, 1), True), (S(), (1,), False)),  # FSDP -> one rank
    ((S(), (0,), False), (S(), (1,), False)),  # a whole copy across ranks
    ((S(pp=2), (0, 1), False), (S(tp=2), (0, 1), False)),  # pipeline stages -> tp
]


def reshard_body(rank: int, world_size: int, device_type: str) -> None:
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    config = tiny_llama_gqa()
    full = {name: t.to(device) for name, t in full_state(build_model(config, 0)).items()}
    for (src_s, src_r, src_f), (dst_s, dst_r, dst_f) in PAIRS:
        src = build_layout(config, src_s, src_r, fsdp=src_f)
        dst = build_layout(config, dst_s, dst_r, fsdp=dst_f)
        src_t = {n: [full[n][s].clone()] for n, s in src.slices(rank).items()} if rank in src.ranks else None
        dst_t = None
        if rank in dst.ranks:
            dst_t = {n: [torch.full(dst.local_shape(rank, n), float("nan"), device=device)] for n in dst.slices(rank)}
        stats = execute_reshard(plan_reshard(src, dst), rank, src_t, dst_t, dtype=torch.float32)
        moved = torch.tensor([stats.sent_bytes, stats.received_bytes], device=device)
        torch.distributed.all_reduce(moved)
        expected = transfer_bytes_summary(plan_reshard(src, dst), itemsize=4)["moved_bytes"]
        assert moved.tolist() == [expected, expected], f"{src_s}@{src_r} -> {dst_s}@{dst_r}"
        if dst_t is not None:
            for name, slices in dst.slices(rank).items():
                got = dst_t[name][0]
                assert got.device == device
                assert torch.equal(got, full[name][slices]), f"{src_s}@{src_r} -> {dst_s}@{dst_r}: {name}"


@pytest.mark.distributed
def test_reshard_pairs_on_two_gloo_ranks():
    run_world(reshard_body, 2, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL refuses two ranks on one GPU)")
def test_reshard_pairs_over_nccl_on_two_gpus():
    run_world(reshard_body, 2, "cuda", backend="nccl")
