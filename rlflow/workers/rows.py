"""Rows in and out of a model function call, and the call's metrics.

* :func:`interface_rows` — the rows an interface receives: the union of the producers' rows
  (row-aligned), dataflow keys renamed to interface names (``input_key_remap``);
* :func:`carried_rows` — the rows a generate call continues (partial rollouts): the rows it wrote
  before, under its interface's names;
* :func:`dataflow_rows` — the interface's output under the dataflow names (``output_key_remap``);
* :func:`reduce_metrics` — per-rank metrics combined over the call's dp ranks, identical on all
  of them so that the dp parts' ``meta_info`` concatenate without conflicts.
"""

from __future__ import annotations

import resource
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from rlflow.dataflow.mfc import MFCDef
from rlflow.protocol import DataProto
from rlflow.workers.context import CallContext

__all__ = ["carried_rows", "dataflow_rows", "interface_rows", "num_tokens", "peak_memory_bytes", "reduce_metrics"]

# How per-rank metrics combine over the dp ranks of a call; any other key is a row-weighted mean.
_MAX_KEYS = ("time_s", "peak_memory_bytes", "logp_mismatch_max", "token_lag_max")
_SUM_KEYS = ("tokens", "rows")


def interface_rows(mfc: MFCDef, inputs: tuple[DataProto, ...]) -> DataProto:
    """The rows an interface receives: the union of ``inputs``, input keys renamed by ``input_key_remap``.

    Keeps the MFC's input keys and every non-tensor column (answers, uids); meta_info is dropped.

    Raises:
        KeyError: an input key is missing (the message lists what the rows hold).
    """
    if not inputs or not all(isinstance(d, DataProto) for d in inputs):
        raise TypeError(f"MFC {mfc.name!r} needs DataProto rows, got {[type(d).__name__ for d in inputs]}")
    merged = DataProto(inputs[0].batch, dict(inputs[0].non_tensor_batch))
    for data in inputs[1:]:
        merged = merged.union(DataProto(data.batch, dict(data.non_tensor_batch)))
    missing = [k for k in mfc.input_keys if k not in merged.keys]
    if missing:
        raise KeyError(f"MFC {mfc.name!r} needs input keys {missing}; its rows hold {sorted(merged.keys)}")
    names = mfc.interface_inputs()
    tensors = {names[k]: merged.batch[k] for k in mfc.input_keys if k in merged.batch_keys}
    columns = {names.get(k, k): v for k, v in merged.non_tensor_batch.items()}
    return DataProto.from_dict(tensors, columns)


def carried_rows(mfc: MFCDef, inputs: tuple[DataProto, ...]) -> DataProto:
    """A resumed generate call's rows (``rollout.partial_tokens``): the output keys it wrote before,
    renamed back to what its interface returned, and every non-tensor column.

    Raises:
        KeyError: an output key of the call is missing from the rows.
    """
    (data,) = inputs
    names = {key: name for name, key in mfc.interface_outputs().items()}  # dataflow key -> interface name
    missing = [k for k in mfc.output_keys if k not in data.batch_keys]
    if missing:
        raise KeyError(f"MFC {mfc.name!r} continues rows it wrote, but they lack {missing}")
    tensors = {names[k]: data.batch[k] for k in mfc.output_keys}
    return DataProto.from_dict(tensors, dict(data.non_tensor_batch))


def dataflow_rows(mfc: MFCDef, out: DataProto, passthrough: bool) -> DataProto:
    """The MFC's output keys of an interface's output (``output_key_remap`` applied).

    Args:
        passthrough: also keep the non-tensor columns that are not outputs (a rollout repeats
            ``answers`` and ``uid`` with its samples for the calls downstream).
    """
    names = mfc.interface_outputs()
    missing = [n for n in names if n not in out.keys]
    if missing:
        raise KeyError(f"MFC {mfc.name!r}: the interface returned {sorted(out.keys)}, missing {missing}")
    tensors = {names[n]: out.batch[n] for n in names if n in out.batch_keys}
    columns = {names[n]: out.non_tensor_batch[n] for n in names if n in out.non_tensor_keys}
    if passthrough:
        columns.update({k: v for k, v in out.non_tensor_batch.items() if k not in names})
    return DataProto.from_dict(tensors, columns)


def reduce_metrics(local: Mapping[str, float], rows: int, ctx: CallContext) -> dict[str, float]:
    """Combine one call's per-rank metrics over its dp ranks (same result on each of them).

    ``time_s``, ``peak_memory_bytes`` and the ``*_max`` figures of ``_MAX_KEYS`` take the
    maximum, ``tokens`` and ``rows`` the sum, and any other value the mean weighted by rows.
    """
    entries: list[Any] = [(dict(local), rows)]
    if ctx.dp_size > 1:
        entries = [None] * ctx.dp_size
        dist.all_gather_object(entries, (dict(local), rows), group=ctx.dp_group)
    total_rows = sum(n for _, n in entries)
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for metrics, _ in entries for k in metrics):
        values = [(m[key], n) for m, n in entries if key in m]
        if key in _MAX_KEYS:
            out[key] = max(v for v, _ in values)
        elif key in _SUM_KEYS:
            out[key] = sum(v for v, _ in values)
        else:
            weight = sum(n for _, n in values) or 1
            out[key] = sum(v * n for v, n in values) / weight
    out["rows"] = total_rows
    return out


def num_tokens(data: DataProto | None) -> float:
    """Real tokens of the rows (``attention_mask`` ones); 0 without a mask."""
    if data is None or "attention_mask" not in data.batch_keys:
        return 0.0
    return float(data.batch["attention_mask"].sum())


def peak_memory_bytes(device: torch.device) -> int:
    """Peak CUDA memory since the last reset, or the process's peak RSS on CPU (bytes)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
