"""Running a reshard plan inside one process, on shards held in memory (a checkpoint's files).

:mod:`rlflow.parallel.executor` runs a :class:`~rlflow.parallel.reshard.ReshardPlan` between
live ranks with torch.distributed. A checkpoint written under one layout and loaded under
another needs the same plan run on the shards read back from its files: every piece of every
transfer (and local copy) is cut out of the source rank's tensor and written into the tensor
of each of its destination ranks. The plan gives every destination element exactly once, so
each destination shard equals the matching slice of the full tensor bit for bit.

Any tensor laid out like the parameters reshards the same way: AdamW's moments
(``exp_avg``, ``exp_avg_sq``) have the shape and layout of their parameter, so
:func:`apply_reshard_plan` is run once per kind of tensor with one plan.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from rlflow.parallel.layout import Box
from rlflow.parallel.reshard import ReshardPlan

__all__ = ["apply_reshard_plan"]


def _offset(piece: Box, holder: Box) -> tuple[slice, ...]:
    """The slices of a rank's local tensor (holding ``holder`` of the full tensor) that hold ``piece``."""
    return tuple(slice(a - start, b - start) for (a, b), (start, _) in zip(piece, holder, strict=True))


def _check_source(plan: ReshardPlan, shards: Mapping[int, Mapping[str, torch.Tensor]]) -> None:
    for rank in plan.src.ranks:
        if rank not in shards:
            raise ValueError(f"no shards given for source rank {rank} (source ranks: {plan.src.ranks})")
        for name in plan.src.boxes(rank):
            if name not in shards[rank]:
                raise KeyError(f"source rank {rank} holds {name} in its layout, but its shards have no such tensor")
            want, got = plan.src.local_shape(rank, name), tuple(shards[rank][name].shape)
            if got != want:
                raise ValueError(f"source rank {rank}: {name} has shape {got}, its layout says {want}")


def apply_reshard_plan(
    plan: ReshardPlan, shards: Mapping[int, Mapping[str, torch.Tensor]]
) -> dict[int, dict[str, torch.Tensor]]:
    """The shards of ``plan.dst``, cut from the shards of ``plan.src`` as the plan says.

    Args:
        plan: from :func:`rlflow.parallel.reshard.plan_reshard`; source and destination ranks
            are namespaces of their own here (rank ``r`` of the source is file ``r`` read back,
            rank ``r`` of the destination the file ``r`` to write), so they may overlap.
        shards: source rank -> ``{parameter name: local tensor}`` with the shapes
            ``plan.src.local_shape`` gives (parameter names as in the layout: a tied LM head is
            the embedding's name).

    Returns:
        Destination rank -> ``{parameter name: local tensor}`` for every parameter the rank
        holds in ``plan.dst`` (empty FSDP shards included), in the source's dtypes.

    Raises:
        ValueError, KeyError: a source rank, tensor or shape the layout does not match.

    >>> from transformers import LlamaConfig
    >>> from rlflow.parallel.layout import build_layout
    >>> from rlflow.parallel.reshard import plan_reshard
    >>> from rlflow.strategy import ParallelStrategy
    >>> cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
    ...                   num_attention_heads=4, num_key_value_heads=2)
    >>> one = build_layout(cfg, ParallelStrategy(), [0], fsdp=True)
    >>> two = build_layout(cfg, ParallelStrategy(dp=2), [0, 1], fsdp=True)
    >>> full = {p.name: torch.randn(p.shape) for p in one.params}
    >>> out = apply_reshard_plan(plan_reshard(one, two), {0: full})
    >>> name = "model.layers.0.mlp.up_proj.weight"
    >>> torch.equal(torch.cat([out[0][name], out[1][name]]), full[name])
    True
    """
    _check_source(plan, shards)
    dtypes = {name: tensor.dtype for per_rank in shards.values() for name, tensor in per_rank.items()}
    out = {
        rank: {name: torch.empty(plan.dst.local_shape(rank, name), dtype=dtypes[name]) for name in plan.dst.boxes(rank)}
        for rank in plan.dst.ranks
    }
    for transfer in (*plan.copies, *plan.transfers):
        source, held = shards[transfer.src], plan.src.boxes(transfer.src)
        for piece in transfer.pieces:
            value = source[piece.name][_offset(piece.box, held[piece.name])]
            for dst in transfer.dsts:
                out[dst][piece.name][_offset(piece.box, plan.dst.boxes(dst)[piece.name])] = value
    return out
