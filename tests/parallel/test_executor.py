"""Executing reshard plans on 4 gloo processes: every pair of strategies over 1, 2 and 4 ranks.

All pairs run inside one spawned world (spawning is the expensive part), for a Llama with
grouped-query attention and a Qwen2 with tied embeddings and q/k/v biases.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from realloc_helpers import (
    build_model,
    build_sharded_module,
    full_state,
    pipeline_logits,
    run_world,
    tensor_parallel_forward_supported,
    tiny_llama_gqa,
    tiny_qwen2_tied,
    world_strategies,
)

from rlflow.parallel.executor import execute_reshard, module_param_tensors
from rlflow.parallel.layout import build_layout
from rlflow.parallel.offload import offload_module
from rlflow.parallel.reshard import plan_reshard, transfer_bytes_summary
from rlflow.strategy import ParallelStrategy

HOSTS = {0: 0, 1: 0, 2: 1, 3: 1}  # two "hosts" of two ranks, so every cost tier is exercised
INPUT_IDS = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(3))


def source_layouts(config):
    """Every strategy on 1, 2 and 4 ranks starting at rank 0; dp > 1 both FSDP-sharded and replicated."""
    out = []
    for size in (4, 2, 1):
        for strategy in world_strategies(size):
            for fsdp in (True, False) if strategy.dp > 1 else (False,):
                out.append(build_layout(config, strategy, range(size), fsdp=fsdp))
    return out


def destination_layouts(config):
    """Every strategy on 1, 2 and 4 ranks, on ranks overlapping the sources ({0}, {0,1}) and
    disjoint from the smaller ones ({3}, {2,3}); FSDP destinations too on 4 ranks."""
    out = []
    for ranks in ([0], [3], [0, 1], [2, 3], [0, 1, 2, 3]):
        for strategy in world_strategies(len(ranks)):
            out.append(build_layout(config, strategy, ranks))
            if len(ranks) == 4 and strategy.dp > 1:
                out.append(build_layout(config, strategy, ranks, fsdp=True))
    return out


def gather_full(layout, rank, tensors, names_shapes):
    """Assemble the full state dict on rank 0 from every rank's local slices (NaN where missing)."""
    local = {n: (layout.slices(rank)[n], ts[0].clone()) for n, ts in tensors.items()} if tensors else {}
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, local)
    if rank != 0:
        return None
    full = {n: torch.full(shape, float("nan")) for n, shape in names_shapes.items()}
    for part in pieces:
        for name, (slices, value) in part.items():
            full[name][slices] = value
    return full


def check_pair(rank, src, src_tensors, dst, dst_tensors, expected):
    """Reshard into a NaN-filled destination; each rank's slices must equal the source model's.

    Local comparisons suffice for "the gathered destination equals the source": the layout
    tests show that the slices of a layout tile every tensor.
    """
    if dst_tensors is not None:
        for ts in dst_tensors.values():
            for t in ts:
                t.fill_(float("nan"))
    plan = plan_reshard(src, dst, HOSTS)
    stats = execute_reshard(plan, rank, src_tensors, dst_tensors, dtype=torch.float32)
    moved = torch.tensor(
        [stats.sent_bytes, stats.received_bytes, stats.sent_intra_host_bytes, stats.sent_inter_host_bytes]
    )
    dist.all_reduce(moved)
    summary = transfer_bytes_summary(plan, itemsize=4)
    assert moved.tolist() == [summary["moved_bytes"]] * 2 + [summary["intra_host_bytes"], summary["inter_host_bytes"]]
    if dst_tensors is not None:
        slices = dst.slices(rank)
        for name, ts in dst_tensors.items():
            for t in ts:
                assert torch.equal(t, expected[name][slices[name]]), name


def matrix_body(rank, world_size):
    for config in (tiny_llama_gqa(), tiny_qwen2_tied()):
        expected = full_state(build_model(config, 0))
        with torch.no_grad():
            ref_logits = build_model(config, 0)(INPUT_IDS).logits
        sources = []
        for layout in source_layouts(config):
            module = build_sharded_module(config, layout, rank, seed=0)
            sources.append((layout, module_param_tensors(module) if module is not None else None))
        for dst in destination_layouts(config):
            module = build_sharded_module(config, dst, rank, seed=None)
            dst_tensors = module_param_tensors(module) if module is not None else None
            for src, src_tensors in sources:
                try:
                    check_pair(rank, src, src_tensors, dst, dst_tensors, expected)
                except Exception as exc:
                    raise AssertionError(
                        f"{config.model_type}: {src.strategy}@{src.ranks} fsdp={src.fsdp} -> "
                        f"{dst.strategy}@{dst.ranks} fsdp={dst.fsdp}: {exc}"
                    ) from exc
            # The last source filled the destination: its logits equal the single-process model's.
            if module is not None and tensor_parallel_forward_supported(config, dst.strategy.tp):
                logits = pipeline_logits(module, dst, rank, INPUT_IDS)
                if logits is not None:
                    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.distributed
def test_reshard_every_strategy_pair_is_exact():
    run_world(matrix_body, 4)


def train_step(stage, optimizer) -> None:
    position_ids = torch.arange(INPUT_IDS.shape[1]).expand_as(INPUT_IDS)
    logits = stage(INPUT_IDS, position_ids=position_ids)
    logits.float().pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def gathered_train_state(stage) -> dict[str, torch.Tensor]:
    """Full parameters of an FSDP2 x TP module, gathered by DTensor itself (collective)."""
    tensors = {}
    for name, p in stage.named_parameters():
        name = "model.embed_tokens.weight" if name == "lm_head.weight" else name
        tensors[name] = p.full_tensor().detach().clone()
    return tensors


def round_trip_body(rank, world_size):
    """FSDP2 x TP training layout -> generation layout, an optimizer step, generation layout again."""
    config = tiny_qwen2_tied()
    train = build_layout(config, ParallelStrategy(dp=2, tp=2), range(4), fsdp=True)
    gen = build_layout(config, ParallelStrategy(tp=2, pp=2), range(4))
    stage = build_sharded_module(config, train, rank, seed=0)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    train_step(stage, optimizer)  # the sharded values now differ from the initial model
    # Offloading the FSDP2 x TP module with its optimizer state and reloading it is exact.
    state = gathered_train_state(stage)
    handle = offload_module(stage, optimizer=optimizer)
    handle.reload()
    reloaded = gathered_train_state(stage)
    assert all(torch.equal(state[n], reloaded[n]) for n in state)
    gen_module = build_sharded_module(config, gen, rank, seed=None)
    plan = plan_reshard(train, gen, HOSTS)
    before = None
    for _ in range(2):
        expected = gathered_train_state(stage)
        execute_reshard(plan, rank, module_param_tensors(stage), module_param_tensors(gen_module), dtype=torch.float32)
        names_shapes = {n: t.shape for n, t in expected.items()}
        gathered = gather_full(gen, rank, module_param_tensors(gen_module), names_shapes)
        if rank == 0:
            for name, value in expected.items():
                assert torch.equal(gathered[name], value), name
            if before is not None:
                assert not torch.equal(before["model.norm.weight"], gathered["model.norm.weight"])
            before = gathered
        train_step(stage, optimizer)


@pytest.mark.distributed
def test_fsdp_training_layout_round_trip_carries_current_weights():
    run_world(round_trip_body, 4)
