"""Running a reshard plan with torch.distributed: packed point-to-point transfers.

Every rank of the plan (source or destination) calls :func:`execute_reshard` with the same
plan. A rank packs, for each peer it sends to, all the pieces of all transfers to that peer
into one flat buffer, and posts every send and receive in one ``batch_isend_irecv``; local
copies run while the messages are in flight. So a rank issues at most one message per peer
— the number of calls does not grow with the number of parameters — and the same code runs
on gloo (CPU tensors) and NCCL (CUDA tensors).

Why point-to-point rather than broadcasts: a broadcast needs a process group per
(source, destination set); creating one is a collective over the whole pool and the sets
change with every pair of layouts. With P2P, a transfer to ``k`` destinations costs the
source ``k`` sends, which the planner spreads over replicated sources; for FSDP sources
(one holder per shard) each destination still receives each byte once.

Memory: a rank holds its packed send buffers and its receive buffers at once — extra bytes
equal to what it sends plus what it receives (at most its source shard times the number of
its destinations, plus its destination shard).

Source values are read from the modules' *current* local shards: FSDP2 modules are
resharded first, so a DTensor parameter's ``to_local()`` is the sharded value the optimizer
updated, never a stale unsharded copy.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from rlflow.families import ModelFamily, family_of
from rlflow.parallel.layout import Box, Layout
from rlflow.parallel.reshard import Piece, ReshardPlan

# Wrapper prefixes that torch inserts into parameter names (activation checkpointing, compile).
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
# peft's LoRA parameters: not in any layout (the adapted linear's own weight is its ``base_layer``'s).
ADAPTER_MARKERS = (".lora_A.", ".lora_B.")


@dataclass(frozen=True)
class ReshardStats:
    """What one rank did in :func:`execute_reshard` (bytes are wire bytes).

    ``sent_intra_host_bytes + sent_inter_host_bytes == sent_bytes``: what it sent to peers on its
    own host and on other hosts (``plan.host_of``). Summed over the plan's ranks they are the
    plan's ``intra_host_bytes`` and ``inter_host_bytes`` (:func:`~rlflow.parallel.reshard.transfer_bytes_summary`).
    """

    sent_bytes: int
    received_bytes: int
    copied_bytes: int
    num_messages: int
    seconds: float
    sent_intra_host_bytes: int = 0
    sent_inter_host_bytes: int = 0


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def canonical_name(name: str, tied_family: ModelFamily | None) -> str:
    """HF name of a module parameter as layouts spell it (wrapper prefixes dropped, tied head → embedding).

    ``tied_family`` is the model's family when its LM head is the tied embedding, else None.
    """
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    name = name.replace(".base_layer.", ".")  # a peft-wrapped linear (rlflow.engine.lora)
    return tied_family.embed_name if tied_family is not None and name == tied_family.lm_head_name else name


@runtime_checkable
class ParamViews(Protocol):
    """A reshard destination that is not an HF module: an engine with its own parameter layout.

    The vLLM rollout engine is one: its fused, padded parameters are exposed as views keyed by
    HF name (:func:`rlflow.parallel.vllm_layout.vllm_param_views`).
    """

    def param_tensors(self) -> dict[str, list[torch.Tensor]]:
        """``{HF name: [local tensors]}`` shaped like the layout's boxes; writes go into the engine."""
        ...

    def weights_updated(self) -> None:
        """Called after a reshard wrote the tensors (e.g. to drop caches computed with old weights)."""
        ...


def module_param_tensors(module: nn.Module | ParamViews) -> dict[str, list[torch.Tensor]]:
    """This rank's local parameter tensors of ``module``, keyed by layout (canonical HF) names.

    FSDP2 modules are resharded first, so FSDP parameters are read/written as their sharded
    local tensors. A tied embedding maps to one name with one or two tensors (two when the
    head has its own copy, e.g. after tensor parallelism or on a pipeline stage).

    Args:
        module: an HF model, a pipeline stage of one, TP/FSDP2-parallelized or plain; or a
            :class:`ParamViews` engine, whose ``param_tensors()`` is returned as is.

    Returns:
        ``{name: [local tensors]}``; writes into these tensors change the module's parameters.
        LoRA adapters are left out (:mod:`rlflow.engine.lora` merges them where it matters).
    """
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, nn.Module):
        if not isinstance(module, ParamViews):
            raise TypeError(f"{type(module).__name__} is neither an nn.Module nor ParamViews (param_tensors())")
        return module.param_tensors()
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()
    config = getattr(module, "config", None)
    family = family_of(config) if config is not None else None
    # The LM head is the tied embedding: the config says so and the module has an LM head.
    tied = (
        family is not None
        and bool(getattr(config, "tie_word_embeddings", False))
        and hasattr(module, family.lm_head_module.split(".")[0])
    )
    out: dict[str, list[torch.Tensor]] = defaultdict(list)
    for name, param in module.named_parameters(remove_duplicate=False):
        if any(marker in name for marker in ADAPTER_MARKERS):
            continue
        # detach(), not .data: a write into the view must bump the parameter's version counter,
        # which caches built from the weights (the sampler's fused matrices) check.
        local = _local(param.detach())
        tensors = out[canonical_name(name, family if tied else None)]
        if not any(local is t or (local.data_ptr() == t.data_ptr() and local.shape == t.shape) for t in tensors):
            tensors.append(local)
    return dict(out)


def check_tensors(layout: Layout, rank: int, tensors: Mapping[str, Sequence[torch.Tensor]]) -> None:
    """Raise ``ValueError`` unless ``tensors`` hold exactly the slices ``layout`` gives ``rank``."""
    boxes = layout.boxes(rank)
    if set(boxes) != set(tensors):
        extra, missing = sorted(set(tensors) - set(boxes)), sorted(set(boxes) - set(tensors))
        raise ValueError(
            f"rank {rank}: module parameters do not match the layout: extra {extra[:4]}, missing {missing[:4]}"
        )
    for name, box in boxes.items():
        shape = tuple(b - a for a, b in box)
        for t in tensors[name]:
            if tuple(t.shape) != shape:
                raise ValueError(f"rank {rank}: {name} has local shape {tuple(t.shape)}, layout expects {shape}")


def _view(tensor: torch.Tensor, origin: Box, box: Box) -> torch.Tensor:
    """The part ``box`` (full-tensor coordinates) of a local ``tensor`` whose own box is ``origin``."""
    return tensor[tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(box, origin))]


def _pack(
    pieces: list[Piece], layout: Layout, rank: int, src: Mapping[str, Sequence[torch.Tensor]], dtype
) -> torch.Tensor:
    origins = layout.boxes(rank)
    parts = [_view(src[p.name][0], origins[p.name], p.box).reshape(-1) for p in pieces]
    return torch.cat(parts).to(dtype) if len(parts) > 1 else parts[0].to(dtype, copy=True)


def _unpack(buf: torch.Tensor, pieces: list[Piece], layout: Layout, rank: int, dst) -> None:
    origins = layout.boxes(rank)
    offset = 0
    for p in pieces:
        n = p.numel
        chunk = buf[offset : offset + n]
        offset += n
        for t in dst[p.name]:
            view = _view(t, origins[p.name], p.box)
            view.copy_(chunk.view(view.shape))


def _pieces_by_peer(plan: ReshardPlan, rank: int) -> tuple[dict[int, list[Piece]], dict[int, list[Piece]]]:
    """Pieces this rank sends to / receives from each peer, in plan order (both sides agree)."""
    send: dict[int, list[Piece]] = defaultdict(list)
    recv: dict[int, list[Piece]] = defaultdict(list)
    for t in plan.transfers:
        if t.src == rank:
            for d in t.dsts:
                send[d].extend(t.pieces)
        elif rank in t.dsts:
            recv[t.src].extend(t.pieces)
    return send, recv


@torch.no_grad()
def execute_reshard(
    plan: ReshardPlan,
    rank: int,
    src_tensors: Mapping[str, Sequence[torch.Tensor]] | None,
    dst_tensors: Mapping[str, Sequence[torch.Tensor]] | None,
    *,
    dtype: torch.dtype,
    group: dist.ProcessGroup | None = None,
) -> ReshardStats:
    """Run ``plan`` on this rank: send its source slices, receive and write its destination slices.

    Called by every rank in ``plan.ranks`` (others may call it too and return at once), all
    with the same plan. Ranks exchange messages only with their peers in the plan.

    Args:
        plan: from :func:`rlflow.parallel.reshard.plan_reshard`.
        rank: this process's global rank (its rank in ``group``).
        src_tensors: ``{name: [local tensor]}`` of the source module on this rank
            (:func:`module_param_tensors`), or None when the rank is not in ``plan.src``.
        dst_tensors: same for the destination module, written in place; None when the rank
            is not in ``plan.dst``.
        dtype: wire dtype, the same on every rank (use the destination's dtype); values are
            cast to it when packed and to the destination's dtype when written.
        group: the pool's process group (default: the default group); peers are its ranks.

    Returns:
        This rank's :class:`ReshardStats`.
    """
    start = time.perf_counter()
    in_src, in_dst = rank in plan.src.ranks, rank in plan.dst.ranks
    if in_src:
        if src_tensors is None:
            raise ValueError(f"rank {rank} is in the source layout but got no source tensors")
        check_tensors(plan.src, rank, src_tensors)
    if in_dst:
        if dst_tensors is None:
            raise ValueError(f"rank {rank} is in the destination layout but got no destination tensors")
        check_tensors(plan.dst, rank, dst_tensors)
    send, recv = _pieces_by_peer(plan, rank)
    itemsize = torch.empty((), dtype=dtype).element_size()
    device = _device(src_tensors if in_src else dst_tensors)
    ops, recv_bufs = [], []
    for peer, pieces in sorted(send.items()):
        buf = _pack(pieces, plan.src, rank, src_tensors, dtype)
        ops.append(dist.P2POp(dist.isend, buf, peer, group))
    for peer, pieces in sorted(recv.items()):
        buf = torch.empty(sum(p.numel for p in pieces), dtype=dtype, device=device)
        ops.append(dist.P2POp(dist.irecv, buf, peer, group))
        recv_bufs.append((buf, pieces))
    works = dist.batch_isend_irecv(ops) if ops else []
    copied = 0
    for transfer in plan.local_copies(rank):  # overlaps the messages in flight
        for p in transfer.pieces:
            value = _view(src_tensors[p.name][0], plan.src.boxes(rank)[p.name], p.box)
            for t in dst_tensors[p.name]:
                _view(t, plan.dst.boxes(rank)[p.name], p.box).copy_(value)
        copied += transfer.numel * itemsize
    for work in works:
        work.wait()
    for buf, pieces in recv_bufs:
        _unpack(buf, pieces, plan.dst, rank, dst_tensors)
    sent = {peer: sum(p.numel for p in pieces) * itemsize for peer, pieces in send.items()}
    intra = sum(n for peer, n in sent.items() if plan.host_of[peer] == plan.host_of[rank])
    return ReshardStats(
        sent_bytes=sum(sent.values()),
        received_bytes=sum(b.numel() for b, _ in recv_bufs) * itemsize,
        copied_bytes=copied,
        num_messages=len(ops),
        seconds=time.perf_counter() - start,
        sent_intra_host_bytes=intra,
        sent_inter_host_bytes=sum(sent.values()) - intra,
    )


def _device(tensors: Mapping[str, Sequence[torch.Tensor]] | None) -> torch.device:
    for ts in (tensors or {}).values():
        return ts[0].device
    return torch.device("cpu")
