"""LoRA adapters on a training engine's stage, with ``peft``'s layers.

:func:`apply_lora` injects ``peft``'s LoRA layers into the stage before it is parallelized:
each targeted ``nn.Linear`` becomes a ``peft`` ``lora.Linear`` whose frozen ``base_layer`` is
the original linear and whose ``lora_A`` / ``lora_B`` are the only trainable parameters (so
the only ones the optimizer holds state for). Layouts, loading and reshards keep speaking HF
names: :func:`rlflow.parallel.executor.canonical_name` reads ``…q_proj.base_layer.weight`` as
``…q_proj.weight`` and leaves the adapters out.

What leaves the engine is the policy the adapters define:

* :class:`MergedViews` — the reshard source of a LoRA home: every weight under its HF name,
  a targeted one merged (``W + scaling · B @ A``) into a fresh tensor, so the rollout engine
  receives the merged model and the base weights are never touched; or, for a copy kept between
  calls, the base and the adapters apart (:func:`low_rank_updates`): the copy merges them itself
  (:mod:`rlflow.parallel.low_rank`), and a push after the first moves the adapters only;
* :func:`merged_state_dict` — the same, as full tensors (the HF export);
* :func:`adapters_disabled` — the base model, for the reference policy's log-probs without a
  second copy of the weights;
* :func:`adapter_state_dict` / :func:`save_adapter` — the adapters in PEFT's format
  (``adapter_config.json`` + ``adapter_model.safetensors``), loadable by
  ``PeftModel.from_pretrained``.

Only ``tp = 1`` and ``pp = 1`` are supported (tensor-parallel plans name the linear modules
that peft wraps); FSDP (``dp > 1``) shards the adapters like any other parameter.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from rlflow.parallel.executor import ADAPTER_MARKERS, canonical_name, module_param_tensors
from rlflow.parallel.low_rank import LowRankUpdate

__all__ = [
    "ADAPTER_NAME",
    "LoraSpec",
    "MergedViews",
    "adapted_weight_names",
    "adapter_state_dict",
    "adapters_disabled",
    "apply_lora",
    "init_lora_weights",
    "linear_module_names",
    "lora_strategy_error",
    "low_rank_updates",
    "merged_state_dict",
    "save_adapter",
]

ADAPTER_NAME = "default"  # peft's name of the one adapter; PEFT's files drop it from the keys
PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the HF names in adapter files
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PUSH_MODES = ("adapters", "merged")  # what a push after the first moves to a kept copy (LoraSpec.push)


@dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """Low-rank adapters on a model's linear modules (``models.<role>.lora``).

    Args:
        r: rank of the adapters.
        alpha: scaling numerator: the update is ``(alpha / r) · B @ A``.
        dropout: dropout on the adapters' input in training.
        target_modules: names of the linear modules inside the decoder layers to adapt
            (``q_proj``, ``v_proj`` …), matched against the last component of module paths.
        seed: seed of ``lora_A``'s initialisation (``lora_B`` starts at zero).
        base_model: recorded as ``base_model_name_or_path`` in the saved adapter's config.
        push: what a copy kept between calls gets after its first push: ``"adapters"`` (``A`` and
            ``B``; the copy keeps the base of the adapted weights in fp32 and merges them itself)
            or ``"merged"`` (the merged adapted weights; no base kept on the copy).
    """

    r: int
    alpha: float
    dropout: float = 0.0
    target_modules: tuple[str, ...]
    seed: int = 0
    base_model: str | None = None
    push: str = "adapters"

    def __post_init__(self) -> None:
        if self.push not in PUSH_MODES:
            raise ValueError(f"LoRA push={self.push!r}; expected one of {PUSH_MODES}")
        if self.r < 1:
            raise ValueError(f"LoRA r={self.r} must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout={self.dropout} must be in [0, 1)")
        if not self.target_modules:
            raise ValueError("LoRA target_modules is empty")

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    def peft_config(self) -> Any:
        """This spec as ``peft.LoraConfig``."""
        # peft is the optional `lora` extra: imported only where LoRA is asked for.
        from peft import LoraConfig

        return LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=list(self.target_modules),
            task_type="CAUSAL_LM",
            base_model_name_or_path=self.base_model,
        )


def lora_strategy_error(tp: int, pp: int) -> str | None:
    """Why LoRA cannot train under ``tp`` and ``pp``, or ``None``."""
    if tp > 1 or pp > 1:
        return (
            f"LoRA runs with tp=1 and pp=1 (got tp={tp}, pp={pp}): the tensor-parallel plan and the "
            "pipeline split name the linear modules peft wraps"
        )
    return None


def linear_module_names(module: nn.Module) -> list[str]:
    """Sorted last components of the ``nn.Linear`` paths inside the decoder layers of ``module``
    (what ``target_modules`` may name; the LM head and embeddings are not adaptable here)."""
    return sorted(
        {
            path.rsplit(".", 1)[-1]
            for path, sub in module.named_modules()
            if isinstance(sub, nn.Linear) and ".layers." in f".{path}"
        }
    )


def adapted_weight_names(names: Iterable[str], spec: LoraSpec) -> frozenset[str]:
    """Which of the HF parameter ``names`` the adapters of ``spec`` change: the weights of the targeted
    linear modules of the decoder layers (what a LoRA home's weight push must move after a step)."""
    return frozenset(
        name
        for name in names
        if name.endswith(".weight") and ".layers." in name and name.rsplit(".", 2)[-2] in spec.target_modules
    )


def low_rank_updates(names: Iterable[str], spec: LoraSpec) -> tuple[LowRankUpdate, ...]:
    """The adapted weights among the HF parameter ``names`` (in their order) as low-rank updates, their
    adapters under PEFT's file keys without the prefix (``…q_proj.lora_A.weight``: :meth:`MergedViews.adapter_tensors`)."""
    names = list(names)
    adapted = adapted_weight_names(names, spec)
    return tuple(
        LowRankUpdate(
            weight=n,
            a=n.removesuffix("weight") + "lora_A.weight",
            b=n.removesuffix("weight") + "lora_B.weight",
            r=spec.r,
            scaling=spec.scaling,
        )
        for n in names
        if n in adapted
    )


def apply_lora(module: nn.Module, spec: LoraSpec) -> None:
    """Inject ``spec``'s adapters into ``module`` in place and freeze everything else.

    Raises:
        ValueError: a target that matches no linear module of the decoder layers, naming the
            ones there are.
    """
    from peft import inject_adapter_in_model

    available = linear_module_names(module)
    missing = [t for t in spec.target_modules if t not in available]
    if missing:
        raise ValueError(f"LoRA target_modules {missing} match no linear module; the model's are {available}")
    inject_adapter_in_model(spec.peft_config(), module, adapter_name=ADAPTER_NAME)
    for name, param in module.named_parameters():
        param.requires_grad_(any(m in name for m in ADAPTER_MARKERS))


def _lora_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    from peft.tuners.lora import LoraLayer

    return [(path, sub) for path, sub in module.named_modules() if isinstance(sub, LoraLayer)]


@contextlib.contextmanager
def adapters_disabled(module: nn.Module) -> Iterator[None]:
    """Run ``module`` as its base model (every LoRA layer bypassed) inside the block.

    Raises:
        ValueError: ``module`` has no LoRA layers (the base would silently be the model itself).
    """
    layers = [layer for _, layer in _lora_layers(module)]
    if not layers:
        raise ValueError("adapters_disabled: the module has no LoRA layers")
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)  # and trainable again: peft freezes disabled adapters


@torch.no_grad()
def init_lora_weights(module: nn.Module, spec: LoraSpec) -> None:
    """``lora_A`` as peft initialises it (Kaiming-uniform, ``a=√5``) from ``spec.seed``, ``lora_B`` zero.

    Drawn whole on the CPU in module order, then sliced to each rank's shard: the same values
    whatever the strategy, and after a meta-device build (whose ``to_empty`` left them unset).
    """
    gen = torch.Generator().manual_seed(spec.seed)
    for _, layer in _lora_layers(module):
        a, b = layer.lora_A[ADAPTER_NAME].weight, layer.lora_B[ADAPTER_NAME].weight
        bound = 1.0 / math.sqrt(a.shape[1])  # kaiming_uniform_(a=sqrt(5)): gain sqrt(1/3) * sqrt(3 / fan_in)
        full_a = torch.empty(tuple(a.shape)).uniform_(-bound, bound, generator=gen)
        _write_full(a, full_a)
        _write_full(b, torch.zeros(tuple(b.shape)))


def _write_full(param: torch.Tensor, full: torch.Tensor) -> None:
    full = full.to(device=param.device, dtype=param.dtype)
    if isinstance(param, DTensor):
        param.to_local().copy_(
            distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        )
    else:
        param.copy_(full)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _merged_weights(module: nn.Module, *, full: bool) -> dict[str, torch.Tensor]:
    """``{HF weight name: W + scaling · B @ A}`` of every adapted linear; local rows of ``W`` unless ``full``.

    FSDP shards ``W`` ``(out, in)`` and ``B`` ``(out, r)`` along ``out`` in the same chunks, so
    this rank's rows of the merge are ``W_local + scaling · B_local @ A`` with ``A`` gathered.
    Collective over the dp ranks when the adapters are sharded.
    """
    out: dict[str, torch.Tensor] = {}
    for path, layer in _lora_layers(module):
        weight = layer.base_layer.weight.detach()
        a = _full(layer.lora_A[ADAPTER_NAME].weight.detach())
        b = layer.lora_B[ADAPTER_NAME].weight.detach()
        w, b = (_full(weight), _full(b)) if full else (_local(weight), _local(b))
        scaling = layer.scaling[ADAPTER_NAME]
        out[canonical_name(f"{path}.weight", None)] = w + scaling * (b.to(w.dtype) @ a.to(w.dtype))
    return out


def merged_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Full weights of ``module`` under HF names, the adapted ones merged (CPU tensors). Collective over dp."""
    merged = _merged_weights(module, full=True)
    state: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        if any(m in name for m in ADAPTER_MARKERS):
            continue
        key = canonical_name(name, None)
        state[key] = merged[key] if key in merged else _full(param.detach())
    return {k: v.cpu().clone() for k, v in state.items()}


class MergedViews:
    """A LoRA home as a reshard source (:class:`rlflow.parallel.executor.ParamViews`): this rank's
    local tensors under HF names, each adapted weight merged into a fresh tensor.

    Read-only: a write into a merged tensor does not reach the model. Every :meth:`param_tensors`
    call merges the current adapters (collective over dp when they are sharded). For a low-rank push
    (:class:`rlflow.parallel.low_rank.LowRankViews`) it gives the base (:meth:`base_tensors`) and the
    adapters (:meth:`adapter_tensors`) apart, for the copy to merge.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def param_tensors(self) -> dict[str, list[torch.Tensor]]:
        tensors = module_param_tensors(self.module)
        for name, value in _merged_weights(self.module, full=False).items():
            tensors[name] = [value]
        return tensors

    def base_tensors(self) -> dict[str, list[torch.Tensor]]:
        """This rank's local tensors under HF names, the adapted weights unmerged (their ``base_layer``'s)."""
        return module_param_tensors(self.module)

    def adapter_tensors(self) -> dict[str, list[torch.Tensor]]:
        """This rank's local shards of every ``lora_A`` and ``lora_B``, keyed ``…q_proj.lora_A.weight``."""
        module_param_tensors(self.module)  # reshards FSDP modules: their local shards are the current values
        return {
            canonical_name(name, None).replace(f".{ADAPTER_NAME}.", "."): [_local(param.detach())]
            for name, param in self.module.named_parameters()
            if any(m in name for m in ADAPTER_MARKERS)
        }

    def weights_updated(self) -> None:
        raise RuntimeError("a LoRA model's merged weights are read-only: it cannot be the target of a weight copy")


def adapter_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters as full CPU tensors under PEFT's keys (``base_model.model.<path>.lora_A.weight``). Collective over dp."""
    state = {}
    for name, param in module.named_parameters():
        if any(m in name for m in ADAPTER_MARKERS):
            key = PEFT_PREFIX + canonical_name(name, None).replace(f".{ADAPTER_NAME}.", ".")
            state[key] = _full(param.detach()).cpu().clone().contiguous()
    return state


def save_adapter(state: dict[str, torch.Tensor], spec: LoraSpec, path: str) -> None:
    """Write ``state`` (:func:`adapter_state_dict`) and ``spec``'s config in PEFT's format to ``path``."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    spec.peft_config().save_pretrained(path)  # adapter_config.json
    save_file(state, os.path.join(path, ADAPTER_WEIGHTS), metadata={"format": "pt"})
