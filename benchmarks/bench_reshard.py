"""Resharding a ~100M-parameter Llama from FSDP over 4 CPU processes: planned transfers vs all-gather.

Four spawned gloo processes hold the FSDP2 training layout (dp=4) of a random Llama with
~100M parameters (fp32). For each destination — tp=2 x dp=2, pp=2 x dp=2, tp=4 — it times

* **planned**: :func:`rlflow.parallel.reshard.plan_reshard` + :func:`execute_reshard`
  (packed point-to-point messages, local copies), and
* **naive**: all-gather the full state dict on every rank (one flat ``all_gather_into_tensor``,
  the fastest form of it), then slice out the destination,

checks that both give the same destination tensors bit for bit, and reports seconds,
effective GB/s (bytes crossing processes / seconds), the speed-up, and the bytes moved next to
the layouts' minimum (:func:`minimum_moved_numel`).

Run: ``python -m benchmarks.run reshard``.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig

from rlflow.parallel.executor import execute_reshard
from rlflow.parallel.layout import Layout, build_layout
from rlflow.parallel.reshard import minimum_moved_numel, plan_reshard, transfer_bytes_summary
from rlflow.strategy import ParallelStrategy

WORLD = 4
REPEATS = 5
DESTINATIONS = {
    "tp2_dp2": ParallelStrategy(tp=2, dp=2),
    "pp2_dp2": ParallelStrategy(pp=2, dp=2),
    "tp4": ParallelStrategy(tp=4),
}


def config() -> LlamaConfig:
    """~101M parameters: 12 layers of hidden 768 (12 heads, 4 kv heads), vocabulary 16384, untied head."""
    return LlamaConfig(
        vocab_size=16384,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )


def _local_tensors(layout: Layout, rank: int, fill: bool) -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(rank)
    out = {}
    for name in layout.boxes(rank):
        shape = layout.local_shape(rank, name)
        out[name] = [torch.randn(shape, generator=gen) if fill else torch.empty(shape)]
    return out


def _naive(src: Layout, dst: Layout, rank: int, src_t, dst_t) -> None:
    """All-gather every FSDP shard (padded to the chunk size) in one flat buffer, then slice."""
    world = len(src.ranks)
    chunks = {s.name: -(-s.shape[0] // world) * (s.numel // s.shape[0]) for s in src.params}
    flat = torch.zeros(sum(chunks.values()))
    offset = 0
    for spec in src.params:
        local = src_t[spec.name][0].reshape(-1)
        flat[offset : offset + local.numel()] = local
        offset += chunks[spec.name]
    gathered = torch.empty(world * flat.numel())
    dist.all_gather_single(gathered, flat)
    parts = gathered.view(world, -1)
    offset = 0
    boxes = dst.boxes(rank)
    for spec in src.params:
        n = chunks[spec.name]
        if spec.name in boxes:
            full = parts[:, offset : offset + n].reshape(-1)[: spec.numel].view(spec.shape)
            dst_t[spec.name][0].copy_(full[tuple(slice(a, b) for a, b in boxes[spec.name])])
        offset += n


def _broadcast_variant(plan, rank: int, src_t, dst_t, groups: dict) -> None:
    """The design not taken, for comparison: each multi-destination transfer as a gloo broadcast
    on its own process group (created once, outside the timing, by every rank in plan order);
    single-destination transfers and local copies as in ``execute_reshard``."""
    from rlflow.parallel.executor import _pack, _unpack

    works, received = [], []
    p2p = []
    for t in plan.transfers:
        if rank != t.src and rank not in t.dsts:
            continue
        if len(t.dsts) == 1:
            if rank == t.src:
                p2p.append(
                    dist.P2POp(dist.isend, _pack(list(t.pieces), plan.src, rank, src_t, torch.float32), t.dsts[0])
                )
            else:
                buf = torch.empty(t.numel)
                p2p.append(dist.P2POp(dist.irecv, buf, t.src))
                received.append((buf, t))
            continue
        buf = _pack(list(t.pieces), plan.src, rank, src_t, torch.float32) if rank == t.src else torch.empty(t.numel)
        works.append(dist.broadcast(buf, t.src, group=groups[(t.src, *t.dsts)], async_op=True))
        if rank != t.src:
            received.append((buf, t))
    works += dist.batch_isend_irecv(p2p) if p2p else []
    for t in plan.local_copies(rank):
        _unpack(_pack(list(t.pieces), plan.src, rank, src_t, torch.float32), list(t.pieces), plan.dst, rank, dst_t)
    for w in works:
        w.wait()
    for buf, t in received:
        _unpack(buf, list(t.pieces), plan.dst, rank, dst_t)


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _measure(label: str, strategy: ParallelStrategy, src: Layout, src_t, rank: int) -> dict | None:
    """Time the three methods for one destination (collective); the record on rank 0."""
    dst = build_layout(config(), strategy, range(WORLD))
    start = time.perf_counter()
    plan = plan_reshard(src, dst, {r: 0 for r in range(WORLD)})
    plan_s = time.perf_counter() - start
    planned_t, naive_t, bcast_t = (_local_tensors(dst, rank, fill=False) for _ in range(3))
    start = time.perf_counter()  # every rank creates every broadcast group, in plan order
    groups = {(t.src, *t.dsts): dist.new_group(sorted({t.src, *t.dsts})) for t in plan.transfers if len(t.dsts) > 1}
    groups_s = time.perf_counter() - start
    stats = []
    methods = {
        "planned": lambda: stats.append(execute_reshard(plan, rank, src_t, planned_t, dtype=torch.float32)),
        "naive": lambda: _naive(src, dst, rank, src_t, naive_t),
        "broadcast": lambda: _broadcast_variant(plan, rank, src_t, bcast_t, groups),
    }
    times: dict[str, list[float]] = {m: [] for m in methods}
    for i in range(REPEATS + 1):  # interleaved, so load drifts hit all methods alike; run 0 warms up
        for m, fn in methods.items():
            elapsed = _timed(fn)
            if i > 0:
                times[m].append(elapsed)
    same = all(
        torch.equal(planned_t[n][0], naive_t[n][0]) and torch.equal(planned_t[n][0], bcast_t[n][0]) for n in planned_t
    )
    sent = torch.tensor([stats[-1].sent_bytes, int(not same)])
    dist.all_reduce(sent)
    if rank != 0:
        return None
    med = {m: statistics.median(ts) for m, ts in times.items()}
    moved = int(sent[0])
    padded = sum(-(-s.shape[0] // WORLD) * (s.numel // s.shape[0]) for s in src.params)
    naive_moved = (WORLD - 1) * WORLD * padded * 4  # every rank receives the other ranks' padded shards
    return {
        "name": f"reshard_fsdp4_to_{label}",
        "params": sum(s.numel for s in src.params),
        "planned_s": round(med["planned"], 4),
        "naive_allgather_s": round(med["naive"], 4),
        "broadcast_groups_s": round(med["broadcast"], 4),
        "speedup_vs_naive": round(med["naive"] / med["planned"], 2),
        "planned_GBps": round(moved / med["planned"] / 1e9, 3),
        "naive_GBps": round(naive_moved / med["naive"] / 1e9, 3),
        "moved_bytes": moved,
        "min_moved_bytes": 4 * minimum_moved_numel(src, dst),
        "naive_moved_bytes": naive_moved,
        "local_copy_bytes": transfer_bytes_summary(plan, itemsize=4)["local_bytes"],
        "messages_per_rank": stats[-1].num_messages,
        "plan_s": round(plan_s, 4),
        "broadcast_groups": len(groups),
        "broadcast_group_creation_s": round(groups_s, 4),
        "identical_to_naive": int(sent[1]) == 0,
        "repeats": REPEATS,
        "all_times_s": {m: [round(t, 4) for t in ts] for m, ts in times.items()},
    }


def _worker(rank: int, port: int, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    src = build_layout(config(), ParallelStrategy(dp=WORLD), range(WORLD), fsdp=True)
    src_t = _local_tensors(src, rank, fill=True)
    for label, strategy in DESTINATIONS.items():
        record = _measure(label, strategy, src, src_t, rank)
        if record is not None:
            queue.put(record)
    dist.destroy_process_group()


def run() -> list[dict]:
    """Spawn the 4 workers and return one record per destination layout."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(port, queue), nprocs=WORLD, join=True, start_method="spawn")
    records = []
    while not queue.empty():
        records.append(queue.get())
    return records


if __name__ == "__main__":
    import json

    for record in run():
        print(json.dumps(record))
