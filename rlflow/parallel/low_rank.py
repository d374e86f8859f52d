"""Low-rank weight pushes: a kept copy that merges ``W = W0 + scaling · (B @ A)`` itself.

A model trained through low-rank adapters (LoRA, :mod:`rlflow.engine.lora`) changes only its
adapters in a step. A copy that holds the base ``W0`` of every adapted weight needs only ``A``
``(r, in)`` and ``B`` ``(out, r)`` to follow: ``r · (in + out)`` elements per adapted weight on the
wire instead of ``out · in``. The reallocation manager runs such pushes
(:meth:`rlflow.parallel.realloc.ReallocManager.register`, ``low_rank``):

* :func:`adapter_layouts` — the home's and a copy's layouts of the adapters: the home's sharded as
  its FSDP layout shards every parameter, the copy's whole on every rank (a box of ``W`` needs all
  of ``A``'s columns or ``B``'s rows);
* :func:`merge_into` — the copy's boxes of ``W`` computed as the home computes its own rows.

Exactness: a home rank merges the rows of ``W`` its FSDP shard holds, ``W0[rows] + scaling ·
(B[rows] @ A)``. :func:`merge_into` repeats that product per home shard (same shapes, same dtype)
and slices the copy's box from it, so every element is the one the home would have sent, whatever
the copy's split — provided the home's weights are in the wire dtype (fp32 masters on an fp32 wire).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from rlflow.parallel.layout import Layout, ParamSpec


@dataclass(frozen=True)
class LowRankUpdate:
    """One adapted weight ``W`` ``(out, in)`` and its adapters: ``W = W0 + scaling · (B @ A)``.

    Attributes:
        weight: HF name of ``W`` in the model's layouts.
        a: wire name of ``A`` ``(r, in)``.
        b: wire name of ``B`` ``(out, r)``.
        r: rank of the adapters.
        scaling: the factor of ``B @ A`` (LoRA's ``alpha / r``).
    """

    weight: str
    a: str
    b: str
    r: int
    scaling: float


@runtime_checkable
class LowRankViews(Protocol):
    """A home module whose adapted weights are ``W0 + scaling · (B @ A)``: what a low-rank push reads."""

    def base_tensors(self) -> dict[str, list[torch.Tensor]]:
        """``{HF name: [local tensor]}`` of every weight, the adapted ones unmerged (``W0``)."""
        ...

    def adapter_tensors(self) -> dict[str, list[torch.Tensor]]:
        """``{wire name: [local tensor]}`` of every ``A`` and ``B`` (:class:`LowRankUpdate`)."""
        ...


def adapter_specs(layout: Layout, updates: Sequence[LowRankUpdate]) -> tuple[ParamSpec, ...]:
    """``A`` and ``B`` of every update as parameters of ``layout``'s model (in the items of their ``W``), unsplit by tp.

    Raises:
        ValueError: an update whose weight ``layout`` does not hold as a matrix.
    """
    specs = {p.name: p for p in layout.params}
    out = []
    for u in updates:
        w = specs.get(u.weight)
        if w is None or len(w.shape) != 2:
            raise ValueError(f"low-rank update of {u.weight!r}: the layout holds no such matrix")
        rows, cols = w.shape
        out += [ParamSpec(u.a, (u.r, cols), w.items, None), ParamSpec(u.b, (rows, u.r), w.items, None)]
    return tuple(out)


def adapter_layouts(home: Layout, copy: Layout, updates: Sequence[LowRankUpdate]) -> tuple[Layout, Layout]:
    """The adapters' layouts on ``home`` (sharded like its parameters: FSDP's dim-0 chunks over dp) and
    on ``copy`` (whole on every rank of the stages holding their weights).

    Raises:
        ValueError: a home with tp > 1 (adapters are trained with tp = 1: the layout would not be the home's).
    """
    if home.strategy.tp != 1:
        raise ValueError(f"low-rank pushes need a home with tp=1 (got {home.strategy})")
    return (
        Layout(adapter_specs(home, updates), home.stages, home.strategy, home.ranks, fsdp=home.fsdp),
        Layout(adapter_specs(copy, updates), copy.stages, copy.strategy, copy.ranks, fsdp=False),
    )


def empty_boxes(
    layout: Layout, rank: int, names: Sequence[str] | None, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """Fresh tensors shaped like ``rank``'s boxes of ``layout`` (of ``names`` only, unless None)."""
    boxes = layout.boxes(rank)
    keep = boxes if names is None else [n for n in names if n in boxes]
    return {n: torch.empty([b - a for a, b in boxes[n]], dtype=dtype, device=device) for n in keep}


@torch.no_grad()
def merge_into(
    updates: Sequence[LowRankUpdate],
    home: Layout,
    copy: Layout,
    rank: int,
    base: Mapping[str, torch.Tensor],
    adapters: Mapping[str, torch.Tensor],
    dst: Mapping[str, Sequence[torch.Tensor]],
) -> None:
    """Write ``W0 + scaling · (B @ A)`` into ``rank``'s boxes of the adapted weights of ``copy``.

    Args:
        updates: the adapted weights.
        home: the layout the home merges in (its row shards fix the products' shapes).
        copy: the copy's layout.
        rank: this process's global rank, a rank of ``copy``.
        base: ``{weight: W0}`` of this rank's boxes, in the dtype of the home's merge.
        adapters: ``{wire name: A or B}``, whole.
        dst: the copy's tensors (:func:`rlflow.parallel.executor.module_param_tensors`); written
            in place, cast to their dtype.
    """
    boxes = copy.boxes(rank)
    for u in updates:
        if u.weight not in boxes:
            continue  # another pipeline stage's weight
        (r0, r1), (c0, c1) = boxes[u.weight]
        w0, a, b = base[u.weight], adapters[u.a], adapters[u.b]
        merged = torch.empty_like(w0)
        for ((h0, h1), _), _ in home.holders(u.weight):  # the home's row shards, in its tp = 1 layout
            lo, hi = max(h0, r0), min(h1, r1)
            if lo < hi:
                product = b[h0:h1].to(w0.dtype) @ a.to(w0.dtype)  # the home's own product for those rows
                merged[lo - r0 : hi - r0] = w0[lo - r0 : hi - r0] + u.scaling * product[lo - h0 : hi - h0, c0:c1]
        for t in dst[u.weight]:
            t.copy_(merged)
