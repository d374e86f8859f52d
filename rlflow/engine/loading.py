"""Sharded loading: every rank reads from the checkpoint only the slices it will hold.

Loading a model the plain way — ``from_pretrained`` on every rank, then the pipeline split,
tensor parallelism and FSDP2 — materialises the whole model on every rank first: eight ranks
of a node loading a 7B model hold 8 × 28 GB of fp32 weights in host memory at once. Here, as
in torchtitan and verl but without the full state dict on rank 0:

1. :func:`build_meta_model` builds the HF module from its config on the ``meta`` device (no
   storage);
2. the :class:`~rlflow.engine.train_engine.TrainEngine` parallelizes it there — the pipeline
   split keeps this stage's items, tensor parallelism and FSDP2 shard the meta parameters —
   then allocates the local shards (``to_empty``) and calls its ``load_weights`` callback;
3. :class:`ShardedLoader` is that callback: for each parameter it reads exactly the box
   ``Layout.boxes(rank)`` gives this rank with ``safe_open(...).get_slice(name)[...]``, casts
   it to the parameter's dtype (files may be bf16, masters are fp32) and writes it into the
   local tensor of :func:`rlflow.parallel.executor.module_param_tensors` — which already maps
   FSDP2 shards, tensor-parallel ``DTensor`` shards and tied embeddings (the head's copy on
   a last pipeline stage) to the layout's names. Non-persistent buffers (rotary ``inv_freq``)
   are recomputed from the config, as ``from_pretrained`` does.

A value model started from a causal LM (the critic's usual start) reads its backbone from
the LM's files; its ``score`` head is zero, exactly as
:func:`rlflow.engine.models.init_value_model_from_lm` initialises it. A value model read from a
``*ForSequenceClassification`` checkpoint (a TRL reward model) gets a zero ``score.bias``, which
those files lack, as :func:`rlflow.engine.models.build_value_model` loads it. Sharded checkpoints
(``model.safetensors.index.json``) are read file by file. A directory without safetensors
files, or whose files lack a parameter the layout needs, is loaded the plain way
(:func:`sharded_model` returns ``None`` and logs why).
"""

from __future__ import annotations

import copy
import json
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlflow.parallel.executor import check_tensors, module_param_tensors
from rlflow.parallel.layout import Layout

__all__ = [
    "LoadStats",
    "ShardedLoader",
    "build_meta_model",
    "init_buffers",
    "is_causal_lm_config",
    "load_local_shards",
    "safetensors_index",
    "sharded_model",
]

logger = logging.getLogger(__name__)

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# The scalar head of a value model, absent from a causal LM's files: zero-initialised.
VALUE_HEAD_NAMES = ("score.weight", "score.bias")


@dataclass(frozen=True)
class LoadStats:
    """What one rank's :class:`ShardedLoader` did.

    Attributes:
        bytes_read: bytes read from the checkpoint files (in the files' dtype).
        bytes_written: bytes written into the local parameter tensors (their dtype; a tied
            embedding held twice on one rank counts twice).
        zero_initialised: parameters set to zero instead of read (a fresh value head).
        num_files: checkpoint files opened.
        seconds: wall time of the load.
    """

    bytes_read: int
    bytes_written: int
    zero_initialised: tuple[str, ...]
    num_files: int
    seconds: float


def safetensors_index(path: str | Path) -> dict[str, Path] | None:
    """``{tensor name: safetensors file}`` of the HF model directory ``path``.

    Reads ``model.safetensors.index.json`` (a sharded checkpoint) or the header of
    ``model.safetensors``; no tensor data is read.

    Returns:
        The map, or ``None`` when the directory holds neither file (e.g. ``pytorch_model.bin``).

    Raises:
        ValueError: naming the index file when it lists a file that does not exist.
    """
    path = Path(path)
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = {name: path / file for name, file in weight_map.items()}
        absent = sorted({str(f) for f in files.values() if not f.is_file()})
        if absent:
            raise ValueError(f"{index} lists files that do not exist: {absent[:3]}")
        return files
    single = path / SAFETENSORS_FILE
    if single.is_file():
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            return {name: single for name in f.keys()}
    return None


def is_causal_lm_config(config: Any) -> bool:
    """Whether ``config.architectures`` names a ``*ForCausalLM`` (the checkpoint is a causal LM)."""
    return any(arch.endswith("ForCausalLM") for arch in (getattr(config, "architectures", None) or []))


def build_meta_model(config: Any, head: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The HF model of ``config`` on the ``meta`` device: shapes and module tree, no storage.

    Args:
        config: HF decoder config (a value model's may be its causal LM's config).
        head: ``"lm"`` (``AutoModelForCausalLM``) or ``"value"`` (a one-label
            ``AutoModelForTokenClassification``, built as :func:`rlflow.engine.models.build_value_model`).
        dtype: parameter dtype of the materialised model.
    """
    from transformers import AutoModelForCausalLM

    from rlflow.engine.models import build_value_model

    if head not in ("lm", "value"):
        raise ValueError(f"head={head!r}; expected 'lm' or 'value'")
    with torch.device("meta"):
        if head == "value":
            return build_value_model(config, dtype=dtype)
        return AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype).eval()


@torch.no_grad()
def init_buffers(module: nn.Module) -> None:
    """Recompute the non-persistent buffers of ``module`` in place after a meta-device build.

    ``to_empty`` leaves buffers uninitialised. The rotary embedding's ``inv_freq`` /
    ``original_inv_freq`` are computed by a fresh rotary module built from the same config,
    exactly as ``from_pretrained`` does — on the CPU, as there, and then copied to the buffers'
    device (a GPU ``pow`` may round differently). A buffer ``x`` kept beside its value
    ``scalar_x`` (HF's scaled embeddings: Gemma's ``embed_scale``) is refilled from it, as HF's
    ``_init_weights`` does.

    Raises:
        ValueError: naming a buffer of any other module (it could not be recomputed).
    """
    for name, sub in module.named_modules():
        own = dict(sub.named_buffers(recurse=False))
        scalars = {key: getattr(sub, f"scalar_{key}", None) for key in own}
        if own and all(isinstance(v, (int, float)) for v in scalars.values()):
            for key, buf in own.items():
                buf.fill_(scalars[key])
            continue
        if not own:
            continue
        if "RotaryEmbedding" not in type(sub).__name__ or not hasattr(sub, "config"):
            raise ValueError(
                f"cannot recompute buffers {sorted(own)} of {name or 'the root'} ({type(sub).__name__}) "
                "after a meta-device build; only rotary embeddings are supported"
            )
        with torch.device("cpu"):
            fresh = type(sub)(sub.config)
        for key, buf in own.items():
            buf.copy_(getattr(fresh, key))
        sub.attention_scaling = fresh.attention_scaling


class ShardedLoader:
    """Fills a parallelized module's local shards from safetensors files (the engine's ``load_weights``).

    Args:
        files: ``{tensor name: file}`` from :func:`safetensors_index`.
        layout: the module's layout (``build_layout(..., fsdp=True)`` for an engine's home).
        rank: this process's global rank in ``layout``.
        zero_init: parameter names set to zero rather than read (a fresh value head).

    After a call, :attr:`stats` holds the :class:`LoadStats`.
    """

    def __init__(self, files: dict[str, Path], layout: Layout, rank: int, zero_init: tuple[str, ...] = ()) -> None:
        self.files, self.layout, self.rank, self.zero_init = files, layout, rank, tuple(zero_init)
        self.stats: LoadStats | None = None

    def __call__(self, module: nn.Module) -> None:
        """Write this rank's slices into ``module``'s parameters and recompute its buffers."""
        self.stats = load_local_shards(module, self.files, self.layout, self.rank, zero_init=self.zero_init)
        init_buffers(module)


@torch.no_grad()
def load_local_shards(
    module: nn.Module,
    files: dict[str, Path],
    layout: Layout,
    rank: int,
    *,
    zero_init: tuple[str, ...] = (),
) -> LoadStats:
    """Read the boxes ``layout`` gives ``rank`` from ``files`` into ``module``'s local tensors.

    Args:
        module: this rank's module of ``layout`` (a pipeline stage, tp- and FSDP2-sharded or
            plain), with allocated parameters.
        files: ``{tensor name: safetensors file}``.
        layout: where every slice lives; ``module_param_tensors(module)`` must match its boxes.
        rank: global rank of this process.
        zero_init: names written as zeros instead (they need not be in ``files``).

    Returns:
        This rank's :class:`LoadStats`.

    Raises:
        ValueError: when the module does not match the layout, a needed tensor is missing
            from ``files``, or a file's tensor has another shape than the config says.
    """
    from safetensors import safe_open

    start = time.perf_counter()
    tensors = module_param_tensors(module)
    check_tensors(layout, rank, tensors)
    boxes, shapes = layout.boxes(rank), {spec.name: spec.shape for spec in layout.params}
    by_file: dict[Path, list[str]] = defaultdict(list)
    written = 0
    for name in boxes:
        if name in zero_init:
            for t in tensors[name]:
                t.zero_()
                written += t.numel() * t.element_size()
        elif name not in files:
            raise ValueError(f"{name} is not in the checkpoint files (needed by rank {rank})")
        else:
            by_file[files[name]].append(name)
    read = 0
    for file, names in by_file.items():
        for name in names:
            box = boxes[name]
            if any(b <= a for a, b in box):  # an FSDP rank past the last chunk holds nothing
                continue
            # One opening per tensor: the file is memory-mapped while open, and the pages read
            # stay resident (and count in this process's RSS) until it is closed.
            with safe_open(file, framework="pt") as f:
                piece = f.get_slice(name)
                if tuple(piece.get_shape()) != shapes[name]:
                    raise ValueError(
                        f"{file}: {name} has shape {tuple(piece.get_shape())}, the config says {shapes[name]}"
                    )
                value = piece[tuple(slice(a, b) for a, b in box)]
            read += value.numel() * value.element_size()
            for t in tensors[name]:
                t.copy_(value)  # casts to the parameter's dtype (bf16 file -> fp32 master)
                written += t.numel() * t.element_size()
    return LoadStats(
        read, written, tuple(n for n in boxes if n in zero_init), len(by_file), time.perf_counter() - start
    )


def sharded_model(
    path: str | Path, config: Any, head: str, layout: Layout, rank: int, *, dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, ShardedLoader] | None:
    """A meta-device model and the loader that fills this rank's shards, or ``None`` to load it whole.

    Pass both to :class:`~rlflow.engine.train_engine.TrainEngine` (``load_weights=loader``).

    Args:
        path: the HF model directory.
        config: its config as the engine uses it (a value model: ``num_labels=1``); a value
            model whose ``config.architectures`` is a causal LM gets a zero ``score`` head.
        head: ``"lm"`` or ``"value"``.
        layout: the engine's layout (``fsdp=True``) with the same ``head``.
        rank: this process's global rank in ``layout``.
        dtype: parameter dtype (fp32 masters).

    Returns:
        ``(meta model, loader)``, or ``None`` — logged with the reason — when the directory has
        no safetensors files or they lack a parameter the layout needs (the plain
        ``from_pretrained`` then decides, as before: another format, or its own initialisation).
    """
    files = safetensors_index(path)
    if files is None:
        logger.warning("%s has no safetensors files: loading the whole model on rank %d before sharding", path, rank)
        return None
    from rlflow.engine.models import SEQUENCE_HEAD_BIAS, is_sequence_classification

    zero_init: tuple[str, ...] = ()
    if head == "value" and is_causal_lm_config(config):
        zero_init = VALUE_HEAD_NAMES
    elif head == "value" and is_sequence_classification(config) and SEQUENCE_HEAD_BIAS not in files:
        zero_init = (SEQUENCE_HEAD_BIAS,)
    needed = {spec.name for spec in layout.params} - set(zero_init)
    missing = sorted(needed - set(files))
    if missing:
        logger.warning(
            "%s: safetensors files lack %d parameters (e.g. %s): loading the whole model on rank %d before sharding",
            path,
            len(missing),
            missing[:3],
            rank,
        )
        return None
    return build_meta_model(config, head, dtype), ShardedLoader(files, layout, rank, zero_init)
