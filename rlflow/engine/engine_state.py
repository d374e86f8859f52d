"""Weights and training state of a :class:`~rlflow.engine.train_engine.TrainEngine`.

Two kinds of state, for two uses:

* **Full HF weights** (:func:`state_dict_full`, :func:`load_state_dict_full`,
  :func:`save_pretrained`): every parameter gathered to its whole tensor under its HF name
  — what another strategy, the rollout engine, or plain ``transformers`` can read. A tied
  embedding appears once, as ``model.embed_tokens.weight``.
* **LoRA** (an engine built with ``EngineConfig.lora``): the full weights are the merged ones
  (base + adapter update, under HF names), and :func:`save_pretrained` and
  :func:`save_checkpoint` also write the adapters in PEFT's format under ``adapter/``
  (:data:`ADAPTER_DIR`).
* **Engine checkpoints** (:func:`save_checkpoint`, :func:`load_checkpoint`): each rank's own
  shards of the weights (a LoRA engine's adapters only) and of the AdamW state, plus the
  scheduler, one file per rank, for resuming under the same strategy without any gathering.
  Files hold only plain tensors and Python values, so they load with
  ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from rlflow.engine.lora import adapter_state_dict, merged_state_dict, save_adapter
from rlflow.parallel.executor import ADAPTER_MARKERS

if TYPE_CHECKING:
    from rlflow.engine.train_engine import TrainEngine

__all__ = ["load_checkpoint", "load_state_dict_full", "save_checkpoint", "save_pretrained", "state_dict_full"]

ADAPTER_DIR = "adapter"  # beside an export's files: a top-level adapter_config.json would make transformers load it
EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
_KERNEL_FLAGS = ("fused", "foreach", "capturable", "differentiable")  # how AdamW runs, not what it holds


def mesh_rank(engine: TrainEngine) -> int:
    """Rank inside the engine's mesh: ``(pp_rank * dp + dp_rank) * tp + tp_rank``."""
    d = engine.dims
    return (engine.pp_rank * d.dp + engine.dp_rank) * d.tp + engine.tp_rank


def mesh_barrier(engine: TrainEngine) -> None:
    """Barrier over the whole mesh: tp, then dp, then pp groups (each waits for the previous)."""
    for axis in ("tp", "dp", "pp"):
        if engine.mesh[axis].size() > 1:
            dist.barrier(group=engine.mesh[axis].get_group())


def _is_tied_copy(engine: TrainEngine, name: str) -> bool:
    """The last stage's own copy of a tied embedding (the first stage's is the reference)."""
    return name == HEAD and engine.stage.tied and not engine.stage.is_first


@contextlib.contextmanager
def _quiet_redistribute():
    """Silence DTensor's advice to flatten (dp, tp) when gathering 2-D parameters one by one."""
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _full_tensor(param: torch.Tensor) -> torch.Tensor:
    if not isinstance(param, DTensor):
        return param.detach()
    with _quiet_redistribute():
        return param.detach().full_tensor()


def state_dict_full(engine: TrainEngine) -> dict[str, torch.Tensor] | None:
    """Gather every parameter to full CPU tensors on the mesh's rank 0 (``None`` elsewhere).

    Collective: every rank of the mesh must call it.
    """
    keep = engine.dp_rank == 0 and engine.tp_rank == 0
    if engine.config.lora is not None:  # tp = pp = 1 (checked by the engine)
        merged = merged_state_dict(engine.stage)
        if engine.stage.tied:
            merged.pop(HEAD, None)
        return merged if keep else None
    local: dict[str, torch.Tensor] = {}
    for name, param in engine.stage.named_parameters():
        full = _full_tensor(param)
        if keep and not _is_tied_copy(engine, name):
            local[name] = full.cpu().clone()
    if not keep:
        return None
    if engine.dims.pp > 1:
        parts = [None] * engine.dims.pp if engine.pp_rank == 0 else None
        dist.gather_object(local, parts, group=engine.mesh["pp"].get_group(), group_dst=0)
        if engine.pp_rank != 0:
            return None
        local = {k: v for part in parts for k, v in part.items()}
    return local


def load_state_dict_full(engine: TrainEngine, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy full HF weights into this rank's shards; every rank passes the whole dict."""
    if engine.config.lora is not None:
        raise ValueError("a LoRA engine's full weights are merged: load its engine checkpoint instead")
    for name, param in engine.stage.named_parameters():
        src = EMBED if name == HEAD and HEAD not in state_dict and engine.stage.tied else name
        if src not in state_dict:
            raise KeyError(f"state_dict has no {src!r} (this rank's stage holds it)")
        full = state_dict[src]
        if tuple(full.shape) != tuple(param.shape):
            raise ValueError(f"{name}: state_dict shape {tuple(full.shape)} != parameter shape {tuple(param.shape)}")
        with torch.no_grad():
            full = full.to(device=engine.device, dtype=param.dtype)
            if isinstance(param, DTensor):
                # src_data_rank=None: every rank already has the full tensor and just slices it.
                shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(shard.to_local())
            else:
                param.copy_(full)


def _build_hf_model(engine: TrainEngine, state_dict: dict[str, torch.Tensor]):
    with torch.device("meta"):
        model = engine.hf_class(engine.hf_config)
    missing, unexpected = model.load_state_dict(state_dict, strict=False, assign=True)
    allowed = {HEAD} if engine.stage.tied else set()
    if set(missing) - allowed or unexpected:
        raise RuntimeError(
            f"gathered state dict does not match {engine.hf_class.__name__}: missing={missing}, unexpected={unexpected}"
        )
    if engine.stage.tied:
        model.tie_weights()
    return model


def _write_hf_dir(model: torch.nn.Module, path: str, *, tied: bool) -> None:
    """``config.json`` (+ ``generation_config.json``) and ``model.safetensors``, as ``save_pretrained`` lays them out.

    Not ``model.save_pretrained``: transformers writes only on *global* rank 0 of an initialised
    ``torch.distributed`` world, and a model's home mesh need not include it (the export would
    silently be an empty directory).
    """
    from safetensors.torch import save_file

    model.config.architectures = [type(model).__name__]  # loaders pick the head from it (value vs causal LM)
    model.config.save_pretrained(path)
    if model.can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(path)
    weights = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if tied:
        weights.pop(HEAD, None)  # the tied head is the embedding; HF re-ties it on load
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def _replace_dir(tmp: str, path: str) -> None:
    """Move ``tmp`` to ``path``, replacing an existing ``path`` (readers never see a half-written one)."""
    if os.path.exists(path):
        old = f"{path}.old-{os.getpid()}"
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old)
    else:
        os.rename(tmp, path)


def save_pretrained(engine: TrainEngine, path: str) -> None:
    """Write an HF checkpoint (``config.json`` + safetensors) of the full model to ``path``.

    Collective. Rank 0 of the mesh writes into a temporary directory next to ``path`` and
    renames it, so ``path`` is either the old checkpoint or the complete new one.
    """
    state_dict = state_dict_full(engine)
    adapter = _adapter_if_lora(engine)
    if state_dict is not None:
        model = _build_hf_model(engine, state_dict)
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
        _write_hf_dir(model, tmp, tied=engine.stage.tied)
        if adapter is not None:
            save_adapter(adapter, engine.config.lora, os.path.join(tmp, ADAPTER_DIR))
        _replace_dir(tmp, path)
    mesh_barrier(engine)


def _adapter_if_lora(engine: TrainEngine) -> dict[str, torch.Tensor] | None:
    """The adapters in PEFT's keys on the mesh's rank 0 of a LoRA engine; ``None`` otherwise. Collective."""
    if engine.config.lora is None:
        return None
    state = adapter_state_dict(engine.stage)
    return state if mesh_rank(engine) == 0 else None


def _checkpointed_params(engine: TrainEngine) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters an engine checkpoint holds: all of them, or a LoRA engine's adapters (its
    frozen base is what it loaded from the model's files, at every step)."""
    params = list(engine.stage.named_parameters())
    if engine.config.lora is None:
        return params
    return [(name, p) for name, p in params if any(m in name for m in ADAPTER_MARKERS)]


def _to_local(value):
    if isinstance(value, DTensor):
        return value.to_local().detach().cpu().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _to_local(v) for k, v in value.items()}
    return value


def _optimizer_params(engine: TrainEngine) -> list[torch.nn.Parameter]:
    return [p for group in engine.optimizer.param_groups for p in group["params"]]


def save_checkpoint(engine: TrainEngine, path: str) -> None:
    """Write ``path/rank{r:05d}.pt`` for every mesh rank ``r`` (weights, AdamW, scheduler shards). Collective."""
    if engine.optimizer is None:
        raise RuntimeError("save_checkpoint needs a trainable engine (optim=None was given)")
    os.makedirs(path, exist_ok=True)
    d = engine.dims
    state = {
        "strategy": {"dp": d.dp, "tp": d.tp, "pp": d.pp},
        "global_step": engine.global_step,
        "params": {name: _to_local(p) for name, p in _checkpointed_params(engine)},
        "optim": _to_local(engine.optimizer.state_dict()),
        "scheduler": engine.scheduler.state_dict(),
    }
    adapter = _adapter_if_lora(engine)
    if adapter is not None:
        save_adapter(adapter, engine.config.lora, os.path.join(path, ADAPTER_DIR))
    file = os.path.join(path, f"rank{mesh_rank(engine):05d}.pt")
    torch.save(state, file + ".tmp")
    os.replace(file + ".tmp", file)
    if mesh_rank(engine) == 0:
        with open(os.path.join(path, "engine.json"), "w") as f:
            json.dump({"strategy": state["strategy"], "global_step": engine.global_step}, f)
    mesh_barrier(engine)


def _as_param_layout(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    local = local.to(param.device)
    if isinstance(param, DTensor):
        return DTensor.from_local(
            local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(), run_check=False
        )
    return local


def load_checkpoint(engine: TrainEngine, path: str) -> None:
    """Restore weights, optimizer and scheduler written by :func:`save_checkpoint` under the same strategy."""
    if engine.optimizer is None:
        raise RuntimeError("load_checkpoint needs a trainable engine (optim=None was given)")
    file = os.path.join(path, f"rank{mesh_rank(engine):05d}.pt")
    state = torch.load(file, weights_only=True, map_location="cpu")
    d = engine.dims
    if state["strategy"] != {"dp": d.dp, "tp": d.tp, "pp": d.pp}:
        raise ValueError(
            f"checkpoint strategy {state['strategy']} != engine strategy (dp={d.dp}, tp={d.tp}, pp={d.pp})"
        )
    with torch.no_grad():
        for name, param in _checkpointed_params(engine):
            target = param.to_local() if isinstance(param, DTensor) else param
            target.copy_(state["params"][name])
    optim_sd = state["optim"]
    params = _optimizer_params(engine)
    for idx, entry in optim_sd["state"].items():
        param = params[int(idx)]
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                entry[key] = _as_param_layout(value, param)
    # The kernel (fused, foreach) is this engine's choice for its parameters, not the writer's: a
    # checkpoint of a fused single-rank engine may be loaded, resharded, into DTensor parameters.
    kernels = [{k: g[k] for k in _KERNEL_FLAGS if k in g} for g in engine.optimizer.param_groups]
    engine.optimizer.load_state_dict(optim_sd)
    for group, flags in zip(engine.optimizer.param_groups, kernels, strict=True):
        group.update(flags)
    engine.scheduler.load_state_dict(state["scheduler"])
    engine.global_step = state["global_step"]
