"""The call a rank is running, and tensor helpers the interfaces share.

Collectives an interface runs go over the call's dp group only (:attr:`CallContext.dp_group`),
which every rank of the call joins the same number of times.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from rlflow.protocol import DataProto
from rlflow.strategy import RankCoords

if TYPE_CHECKING:
    from rlflow.dataflow.mfc import MFCDef
    from rlflow.engine.train_engine import TrainEngine
    from rlflow.parallel.groups import CallGroups

__all__ = [
    "CallContext",
    "gather_dp",
    "last_token_scatter",
    "shift_right",
    "tensors_of",
    "temperature_scaled",
]


@dataclass(frozen=True)
class CallContext:
    """This rank's place in one call.

    Attributes:
        mfc: the call.
        groups: the call's process groups on this rank; ``None`` in a single process (tests).
        step: the training step the driver issued the call for (reward functions' ``trainer_state``).
    """

    mfc: MFCDef
    groups: CallGroups | None = None
    step: int = 0

    @property
    def coords(self) -> RankCoords:
        """This rank's coordinates in the call; ``RankCoords(0, 0, 0)`` in a single process."""
        return RankCoords(0, 0, 0) if self.groups is None else self.groups.coords

    @property
    def dp_size(self) -> int:
        return 1 if self.groups is None else self.groups.strategy.dp

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The dp group of this rank (``None`` when dp is 1)."""
        return None if self.dp_size == 1 else self.groups.group("dp")


@contextlib.contextmanager
def temperature_scaled(engine: TrainEngine, temperature: float) -> Iterator[None]:
    """Divide the LM head's logits by ``temperature`` inside the block.

    The engine's log-probs and entropies are then those of ``softmax(logits / temperature)``,
    the distribution the rollout sampled from (``old_logp`` is reported at the sampling
    temperature), so the PPO ratio starts at 1. A forward hook on the last stage's
    ``lm_head`` keeps every engine path (packing, tp, pp) unchanged.
    """
    head = getattr(engine.stage, "lm_head", None)
    if temperature == 1.0 or head is None:
        yield
        return
    handle = head.register_forward_hook(lambda module, args, output: output / temperature)
    try:
        yield
    finally:
        handle.remove()


def gather_dp(tensors: Mapping[str, Any], ctx: CallContext) -> tuple[dict[str, Any], slice]:
    """Concatenate every dp rank's rows of ``tensors`` (in dp order); also return this rank's rows.

    Values are tensors or numpy arrays (e.g. group ids) with rows along dim 0.

    Per-token tensors of ranks whose widths differ are right-padded with zeros (their masks
    are zero there). Runs ``all_gather_object`` on the dp group; a no-op when dp is 1.

    Returns:
        ``(gathered, rows)``: the global tensors, and the slice of this rank's rows in them.
    """
    local = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in tensors.items()}
    num_rows = len(next(iter(local.values())))
    if ctx.dp_size == 1:
        return local, slice(0, num_rows)
    parts: list[Any] = [None] * ctx.dp_size
    dist.all_gather_object(parts, local, group=ctx.dp_group)
    dp_rank = ctx.coords.dp
    start = sum(len(next(iter(p.values()))) for p in parts[:dp_rank])
    gathered = {k: _pad_cat([p[k] for p in parts]) for k in local}
    return gathered, slice(start, start + num_rows)


def _pad_cat(parts: list[Any]) -> Any:
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    if parts[0].dim() < 2:
        return torch.cat(parts)
    width = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) if p.shape[1] < width else p for p in parts])


def last_token_scatter(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``(N, T)`` token rewards: each row's score on its last response token, 0 elsewhere.

    >>> last_token_scatter(torch.tensor([2.0]), torch.tensor([[0, 1, 1, 0]]))
    tensor([[0., 0., 2., 0.]])
    """
    mask = response_mask.bool()
    width = mask.shape[1]
    last = width - 1 - mask.flip(dims=[1]).int().argmax(dim=1)  # (N,) last response column
    out = torch.zeros(mask.shape, dtype=torch.float32)
    has_tokens = mask.any(dim=1)
    rows = torch.arange(mask.shape[0])[has_tokens]
    out[rows, last[has_tokens]] = scores[has_tokens].float()
    return out


def shift_right(values: torch.Tensor) -> torch.Tensor:
    """``out[:, t] = values[:, t-1]`` and ``out[:, 0] = 0`` (value of the prefix *before* token ``t``)."""
    return torch.nn.functional.pad(values[:, :-1], (1, 0))


def tensors_of(data: DataProto, keys: tuple[str, ...] | list[str]) -> dict[str, torch.Tensor]:
    """The named batch tensors of ``data``; ``KeyError`` names the missing ones and what is there."""
    missing = [k for k in keys if k not in data.batch_keys]
    if missing:
        raise KeyError(f"the call's rows lack {missing}; they hold {sorted(data.keys)}")
    return {k: data.batch[k] for k in keys}
