"""Shared helpers of the reallocation tests: tiny models, spawned gloo worlds, sharded modules.

Not a test module: imported by tests/parallel/test_{layout,executor,realloc,...}.py and by
their spawned children (spawn passes ``sys.path`` on, so the plain import works there).
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from rlflow.parallel.groups import build_call_groups, clear_group_cache, init_global_group
from rlflow.parallel.layout import Layout
from rlflow.rendezvous import free_port
from rlflow.strategy import ParallelStrategy

# ---- tiny models ----


def tiny_llama_gqa() -> LlamaConfig:
    """Llama with grouped-query attention (4 heads, 2 kv heads) and an untied head."""
    return LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )


def tiny_qwen2_tied() -> Qwen2Config:
    """Qwen2 with tied embeddings and q/k/v biases (4 heads, 4 kv heads, so tp=4 runs)."""
    return Qwen2Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        attn_implementation="eager",
    )


def build_model(config: Any, seed: int = 0) -> nn.Module:
    """A randomly initialised HF causal LM (fp32), identical on every process for one seed."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # biases start at zero in HF; randomise them so slicing errors show
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.0, 0.5)
    return model.eval()


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Canonical full parameters of a single-process model (tied head folded into the embedding)."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---- sharding a module into a layout (what the engine layer does) ----


def tensor_parallel_forward_supported(config: Any, tp: int) -> bool:
    return config.num_key_value_heads % tp == 0


def apply_tp(model: nn.Module, tp_mesh) -> None:
    """The engine's tensor-parallel split; where it refuses (tp does not divide the kv heads) the
    layout's description of that case — k/v replicated, the rest as usual — built with torch's
    parallel styles, so the layouts are still checked against real DTensors (forward not supported)."""
    from rlflow.parallel.tensor_parallel import apply_tp as engine_apply_tp

    if tensor_parallel_forward_supported(model.config, tp_mesh.size()):
        engine_apply_tp(model, tp_mesh)
    else:
        _apply_tp_kv_replicated(model, tp_mesh)


def _apply_tp_kv_replicated(model: nn.Module, tp_mesh) -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    inner = model.model
    plan: dict[str, Any] = {}
    if hasattr(inner, "embed_tokens"):
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if hasattr(model, "lm_head"):
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    for key in inner.layers.keys():
        p = f"model.layers.{key}."
        plan.update({p + c: ColwiseParallel() for c in ("self_attn.q_proj", "mlp.gate_proj", "mlp.up_proj")})
        plan.update({p + r: RowwiseParallel() for r in ("self_attn.o_proj", "mlp.down_proj")})
    tied = (
        hasattr(model, "lm_head")
        and hasattr(inner, "embed_tokens")
        and model.lm_head.weight is inner.embed_tokens.weight
    )
    parallelize_module(model, tp_mesh, plan)
    if tied:
        model.lm_head.weight = inner.embed_tokens.weight


def build_sharded_module(config: Any, layout: Layout, rank: int, seed: int | None = 0) -> nn.Module | None:
    """This rank's module of ``layout`` as the engine builds it: its pipeline stage
    (``build_stage``), tp-split (``apply_tp``), FSDP2-sharded (``apply_fsdp``) if ``layout.fsdp``.

    Values: the seed's full model, sharded; ``seed=None`` gives NaNs (a destination to fill).
    Returns None on ranks outside the layout. Collective over the pool (builds groups).
    """
    from rlflow.engine.parallelize import apply_fsdp
    from rlflow.engine.pipeline import build_stage

    groups = build_call_groups(layout.ranks, layout.strategy, "cpu")
    if groups is None:
        return None
    model = build_model(config, seed if seed is not None else 0)
    stage = build_stage(model, layout.strategy.pp, groups.coords.pp)
    if seed is None:
        with torch.no_grad():
            for p in stage.parameters():
                p.fill_(float("nan"))
    if layout.strategy.tp > 1:
        apply_tp(stage, groups.submesh("tp"))
    if layout.fsdp:
        apply_fsdp(stage, groups.submesh("dp"), param_dtype=torch.float32, reshard_after_forward=True)
    return stage


def pipeline_logits(stage: nn.Module, layout: Layout, rank: int, input_ids: torch.Tensor) -> torch.Tensor | None:
    """Logits of a pipeline of stages run one after another (hidden states sent stage to stage).

    Collective over the layout's ranks; returns the logits on last-stage ranks, else None.
    """
    pp_rank, dp_rank, tp_rank = layout.coords(rank)
    position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    x = input_ids
    if pp_rank > 0:
        x = torch.empty(*input_ids.shape, stage.config.hidden_size)
        dist.recv(x, layout.ranks[layout.strategy.rank_of(pp_rank - 1, dp_rank, tp_rank)])
    with torch.no_grad():
        out = stage(x, position_ids=position_ids)
    if pp_rank < layout.strategy.pp - 1:
        dist.send(out.contiguous(), layout.ranks[layout.strategy.rank_of(pp_rank + 1, dp_rank, tp_rank)])
        return None
    return out


# ---- spawned worlds (gloo; nccl on GPUs) ----


def _child(rank: int, world_size: int, port: int, fn: Callable, args: tuple, errors, backend: str = "gloo") -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)  # one GPU per rank: NCCL refuses two ranks on one device
        init_global_group(rank, world_size, master_port=port, backend=backend, timeout_s=120)
        fn(rank, world_size, *args)
        dist.barrier()
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        clear_group_cache()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn: Callable, world_size: int, *args: Any, backend: str = "gloo") -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes of one ``backend``
    world (gloo; nccl: rank r on cuda:r); re-raise failures."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(
            _child,
            args=(world_size, free_port(), fn, args, errors, backend),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
    except mp.ProcessRaisedException as exc:
        messages = []
        while not errors.empty():
            messages.append(errors.get())
        raise AssertionError("\n".join(messages) or str(exc)) from None


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def world_strategies(world_size: int) -> list[ParallelStrategy]:
    """Every ``(dp, tp, pp)`` with ``dp*tp*pp == world_size``."""
    out = []
    for pp in range(1, world_size + 1):
        for tp in range(1, world_size + 1):
            if world_size % (pp * tp) == 0:
                out.append(ParallelStrategy(dp=world_size // (pp * tp), tp=tp, pp=pp))
    return out
