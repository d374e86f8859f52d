"""AdamW, a warm-up + cosine learning-rate schedule, and gradient clipping across parallel axes.

Gradients of a ``(pp, dp, tp)`` engine are spread three ways: FSDP and TP parameters are
``DTensor`` s whose local shards each hold part of a gradient, and each pipeline stage holds
other parameters altogether. :func:`clip_grad_norm_` computes the one global norm a single
process would compute: DTensor norms reduce over their own mesh axes, and the stages'
squared norms are summed over the ``pp`` axis.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

# Parameter dtypes torch's fused AdamW kernel takes on CPU.
_FUSED_CPU_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)

__all__ = ["OptimConfig", "build_lr_scheduler", "build_optimizer", "clip_grad_norm_", "lr_factor"]


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """Optimizer and schedule settings.

    Args:
        lr: peak learning rate.
        betas: AdamW betas.
        eps: AdamW epsilon.
        weight_decay: decoupled weight decay (AdamW).
        warmup_steps: optimizer steps of linear warm-up from ``lr / warmup_steps`` to ``lr``.
        total_steps: optimizer steps of the whole run; after warm-up the rate follows a
            cosine down to ``min_lr_ratio * lr`` at ``total_steps``. ``None``: constant after warm-up.
        min_lr_ratio: floor of the cosine, as a fraction of ``lr``.
        max_grad_norm: clip the global gradient norm to this; ``None`` or ``0``: no clipping.
    """

    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr_ratio: float = 0.0
    max_grad_norm: float | None = 1.0

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr} must be > 0")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be >= 0")
        if self.total_steps is not None and self.total_steps < self.warmup_steps:
            raise ValueError(f"total_steps={self.total_steps} is smaller than warmup_steps={self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.max_grad_norm is not None and self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm={self.max_grad_norm} must be >= 0 or None")


def lr_factor(step: int, config: OptimConfig) -> float:
    """Multiplier of ``config.lr`` at optimizer step ``step`` (0-based).

    >>> cfg = OptimConfig(lr=1.0, warmup_steps=2, total_steps=6, min_lr_ratio=0.1)
    >>> [round(lr_factor(s, cfg), 3) for s in range(7)]
    [0.5, 1.0, 1.0, 0.868, 0.55, 0.232, 0.1]
    """
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.total_steps is None:
        return 1.0
    span = max(1, config.total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _one_rank(param: torch.Tensor) -> bool:
    """Whether ``param`` lives whole on this rank: a plain tensor, or a DTensor over a mesh of one."""
    return not isinstance(param, DTensor) or param.device_mesh.size() == 1


def build_optimizer(params: Iterable[nn.Parameter], config: OptimConfig) -> torch.optim.AdamW:
    """AdamW over ``params`` (DTensor parameters included: the update is elementwise).

    CPU parameters take torch's fused CPU kernel: plain ones (a worker training alone in float32),
    and the DTensors of FSDP over a single rank (a worker alone computing in a 16-bit dtype, its
    float32 masters cast by FSDP): torch's default there is a Python loop of several ops per
    parameter, each a pass over the parameter's memory — a 21M-parameter update 0.15 s against
    0.04 s fused on one thread. DTensors sharded over several ranks keep torch's choice (per
    tensor: the fused kernel refuses their mix of DTensor parameters and plain step counters);
    foreach on CUDA.
    """
    trainable = [p for p in params if p.requires_grad]
    fused = bool(trainable) and all(
        p.device.type == "cpu" and p.dtype in _FUSED_CPU_DTYPES and _one_rank(p) for p in trainable
    )
    return torch.optim.AdamW(
        trainable,
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        fused=fused or None,
    )


def build_lr_scheduler(optimizer: torch.optim.Optimizer, config: OptimConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up then cosine decay (:func:`lr_factor`), stepped once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))


def _sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """Global ``sum(g**2)`` over ``grads`` (one process-group reduction per DTensor layout)."""
    by_layout: dict[object, list[torch.Tensor]] = defaultdict(list)
    plain: list[torch.Tensor] = []
    for g in grads:
        if isinstance(g, DTensor):
            by_layout[(g.device_mesh, g.placements)].append(g)
        else:
            plain.append(g)
    device = grads[0].device if grads else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    for (mesh, placements), group in by_layout.items():
        local = torch.stack([g.to_local().float().square().sum() for g in group]).sum().to(device)
        # Each shard holds a disjoint part of the tensor: sum the local squares over the mesh
        # axes the gradient is sharded on, not over the axes it is replicated on.
        for axis, placement in enumerate(placements):
            if placement.is_replicate():
                continue
            if placement.is_partial():
                raise ValueError(f"gradient placement {placements} is partial; reduce it before clipping")
            dist.all_reduce(local, group=mesh.get_group(axis))  # Shard or FSDP's _StridedShard
        total = total + local
    if plain:
        norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in plain])
        total = total + torch.stack(norms).to(device).square().sum()
    return total


def clip_grad_norm_(
    params: Iterable[nn.Parameter],
    max_norm: float | None,
    *,
    pp_group: dist.ProcessGroup | None = None,
    exclude: Iterable[nn.Parameter] = (),
) -> float:
    """Clip gradients to a global L2 norm and return the norm before clipping.

    Args:
        params: this rank's parameters (local stage; DTensors for FSDP/TP shards).
        max_norm: the norm bound; ``None`` or ``0`` only measures.
        pp_group: the pipeline group; the stages' squared norms are summed over it.
        exclude: parameters whose gradient is counted on another stage (the last stage's
            copy of a tied embedding) — left out of the norm, still clipped.

    Returns:
        The global gradient norm (identical on every rank of the engine).
    """
    params = [p for p in params if p.grad is not None]
    skip = {id(p) for p in exclude}
    sq = _sum_of_squares([p.grad for p in params if id(p) not in skip])
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=pp_group)
    total_norm = sq.sqrt()
    norm = float(total_norm)
    if max_norm and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        plain = [p.grad for p in params if not isinstance(p.grad, DTensor)]
        if plain:
            torch._foreach_mul_(plain, coef)
        for p in params:
            if isinstance(p.grad, DTensor):
                p.grad.mul_(coef)
    return norm
