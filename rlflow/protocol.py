"""DataProto: the batch that travels between the driver, the worker groups and the MFCs.

A :class:`DataProto` holds ``N`` rows in three parts:

* ``batch`` — a :class:`tensordict.TensorDict` with ``batch_size == [N]``: every tensor's
  dim 0 is the row dim (``input_ids: (N, T)``, ``rewards: (N,)``).
* ``non_tensor_batch`` — numpy arrays (usually ``dtype=object``) with ``shape[0] == N``:
  prompts as strings, sample ids, ground-truth answers.
* ``meta_info`` — a plain dict about the whole batch (temperature, global step, metrics).

Choices every caller can rely on:

* Indexing always returns a ``DataProto``; an ``int`` gives a one-row DataProto (never a
  squeezed row), so every operation stays valid on the result.
* ``batch`` is ``None`` only for the bare ``DataProto()`` with no rows and no keys. Any other
  DataProto keeps a TensorDict (possibly without keys) that records the row count, so
  ``select(batch_keys=[])`` still knows its length.
* Operations return new DataProtos whose tensors and arrays are views or shared with the
  source where possible (like ``torch`` slicing) and whose ``meta_info`` is a shallow copy.
  Only :meth:`DataProto.pop` mutates its receiver.
* :meth:`DataProto.save` writes one safetensors file whose header carries the non-tensor
  columns and ``meta_info`` as JSON; nothing is ever unpickled on load.
* Pickling (how Ray moves a DataProto between processes) sends each tensor as one flat byte
  buffer (a numpy view of its memory, no copy for a contiguous tensor or row slice) plus a small
  header of key names, dtypes and shapes; the TensorDict itself is never pickled. Under Ray's
  pickle protocol 5 the buffers travel out of band: ``ray.put`` copies them once into the object
  store and the receiver's tensors are views of the object store's memory (no copy). A row slice
  ships only its rows, never its parent batch.

Transport contract (what zero-copy means for a receiver): tensors of a DataProto that came out
of Ray's object store (a worker's input, a collected part before :meth:`DataProto.concat`) share
the object's immutable buffer with every process on the node that reads the same object (tp and
pp replicas get the same part). **Treat them as read-only**: add keys, select, slice, or
``clone()`` before writing in place. torch cannot mark a tensor read-only, so an in-place write
(``x.add_(1)``, ``batch["x"][0] = 0``) is not caught; it would change what the other readers see.
Operations that build new tensors (``concat``, ``union`` of new keys, indexing by a list) give
private memory. ``pickle.loads`` outside Ray (in-band buffers) gives private, writable tensors.
"""

from __future__ import annotations

import copy
import heapq
import json
import math
import os
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from rlflow.files import write_atomic

__all__ = ["DataProto", "balanced_partition", "balanced_row_groups", "restore_order"]

_FORMAT = "rlflow.DataProto"
_FORMAT_VERSION = 1

Index = int | slice | torch.Tensor | np.ndarray | Sequence[int] | Sequence[bool]


@dataclass(eq=False)
class DataProto:
    """A batch of ``N`` rows: tensors, numpy non-tensor columns and batch-level metadata.

    Args:
        batch: tensors sharing dim 0, as a TensorDict with ``batch_size == [N]``.
        non_tensor_batch: numpy arrays with ``shape[0] == N``; keys disjoint from ``batch``.
        meta_info: batch-level values; not split or concatenated row-wise.

    >>> d = DataProto.from_dict({"x": torch.arange(4)}, {"uid": ["a", "b", "c", "d"]})
    >>> len(d), d[1:3].non_tensor_batch["uid"].tolist()
    (4, ['b', 'c'])
    """

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.meta_info, dict):
            raise TypeError(f"meta_info must be a dict, got {type(self.meta_info).__name__}")
        if not isinstance(self.non_tensor_batch, dict):
            raise TypeError(f"non_tensor_batch must be a dict, got {type(self.non_tensor_batch).__name__}")
        num_rows, source = self._validate_batch()
        for key, arr in self.non_tensor_batch.items():
            if not isinstance(arr, np.ndarray) or arr.ndim == 0:
                raise TypeError(f"non_tensor_batch[{key!r}] must be a numpy array with a row dim, got {arr!r:.80}")
            if num_rows is None:
                num_rows, source = arr.shape[0], f"non_tensor_batch[{key!r}]"
            elif arr.shape[0] != num_rows:
                raise ValueError(f"non_tensor_batch[{key!r}] has {arr.shape[0]} rows but {source} has {num_rows}")
            if self.batch is not None and key in self.batch.keys():
                raise ValueError(f"key {key!r} is in both batch and non_tensor_batch")
        if self.batch is None and num_rows is not None:
            # Keep the row count even when there are no tensors (see module docstring).
            self.batch = TensorDict({}, batch_size=[num_rows])

    def _validate_batch(self) -> tuple[int | None, str]:
        if self.batch is None:
            return None, ""
        if not isinstance(self.batch, TensorDict):
            raise TypeError(f"batch must be a TensorDict or None, got {type(self.batch).__name__}")
        if self.batch.batch_dims != 1:
            raise ValueError(f"batch must have one batch dim (rows), got batch_size={list(self.batch.batch_size)}")
        for key, value in self.batch.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"batch[{key!r}] must be a tensor (nested TensorDicts are not supported)")
        return self.batch.batch_size[0], "batch"

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict | None = None,
    ) -> DataProto:
        """Builds a DataProto; lists/tuples of non-tensors become 1-D object arrays (one object per row).

        Numpy arrays given as non-tensors are kept as they are (any dtype, any trailing shape).
        """
        tensors = dict(tensors or {})
        num_rows, first = None, ""
        for key, t in tensors.items():
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                raise TypeError(f"tensors[{key!r}] must be a tensor with a row dim, got {t!r:.80}")
            if num_rows is None:
                num_rows, first = t.shape[0], key
            elif t.shape[0] != num_rows:
                raise ValueError(f"tensors[{key!r}] has {t.shape[0]} rows but tensors[{first!r}] has {num_rows}")
        arrays = {key: _as_row_array(key, v) for key, v in (non_tensors or {}).items()}
        if num_rows is None and arrays:
            num_rows = next(iter(arrays.values())).shape[0]
        batch = TensorDict(tensors, batch_size=[num_rows]) if num_rows is not None else None
        return cls(batch=batch, non_tensor_batch=arrays, meta_info=dict(meta_info or {}))

    # ----------------------------------------------------------------- introspection
    def __len__(self) -> int:
        return 0 if self.batch is None else int(self.batch.batch_size[0])

    @property
    def batch_keys(self) -> list[str]:
        return [] if self.batch is None else list(self.batch.keys())

    @property
    def non_tensor_keys(self) -> list[str]:
        return list(self.non_tensor_batch.keys())

    @property
    def keys(self) -> list[str]:
        """Tensor keys, then non-tensor keys."""
        return self.batch_keys + self.non_tensor_keys

    def __repr__(self) -> str:
        tensors = ", ".join(f"{k}: {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}" for k, v in self._items())
        arrays = ", ".join(f"{k}: {v.shape} {v.dtype}" for k, v in self.non_tensor_batch.items())
        return (
            f"DataProto(len={len(self)}, batch={{{tensors}}}, non_tensor={{{arrays}}}, "
            f"meta_info keys={list(self.meta_info)})"
        )

    def _items(self) -> Iterable[tuple[str, torch.Tensor]]:
        return [] if self.batch is None else self.batch.items()

    def __reduce__(self) -> tuple:
        # Flat buffers + a small header instead of pickling the TensorDict: see "Transport" above.
        if self.batch is None:
            return _rebuild, (None, (), self.non_tensor_batch, self.meta_info)
        specs, buffers = [], []
        for key, t in self._items():
            specs.append((key, t.dtype, tuple(t.shape), str(t.device), t.requires_grad))
            # A view of the bytes (copies only a non-contiguous tensor); sparse layouts pickle as torch does.
            buffers.append(_bytes_of(t.cpu()) if t.layout == torch.strided else t)
        device = None if self.batch.device is None else str(self.batch.device)
        return _rebuild, ((len(self), device, tuple(specs)), tuple(buffers), self.non_tensor_batch, self.meta_info)

    def _with(
        self, tensors: dict[str, torch.Tensor], arrays: dict[str, np.ndarray], num_rows: int, meta: dict
    ) -> DataProto:
        device = None if self.batch is None else self.batch.device
        return DataProto(TensorDict(tensors, batch_size=[num_rows], device=device), arrays, meta)

    # ----------------------------------------------------------------- row access
    def __getitem__(self, idx: Index) -> DataProto:
        """Rows by int (one-row result), slice, int list/array/tensor, or bool mask of length ``len(self)``."""
        rows = _normalize_index(idx, len(self))
        if self.batch is None:
            return DataProto(meta_info=dict(self.meta_info))
        np_rows = rows if isinstance(rows, slice) else rows.numpy()
        arrays = {k: v[np_rows] for k, v in self.non_tensor_batch.items()}
        return DataProto(self.batch[rows], arrays, dict(self.meta_info))

    def select(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """Keeps the named keys; ``None`` keeps all keys of that part, ``[]`` keeps none.

        Raises:
            KeyError: a named key is missing (the message lists the present keys).
        """
        bkeys = self.batch_keys if batch_keys is None else _check_keys("batch", batch_keys, self.batch_keys)
        nkeys = self.non_tensor_keys if non_tensor_batch_keys is None else non_tensor_batch_keys
        _check_keys("non_tensor_batch", nkeys, self.non_tensor_keys)
        mkeys = list(self.meta_info) if meta_info_keys is None else meta_info_keys
        _check_keys("meta_info", mkeys, list(self.meta_info))
        if self.batch is None:
            return DataProto(meta_info={k: self.meta_info[k] for k in mkeys})
        tensors = {k: self.batch[k] for k in bkeys}
        arrays = {k: self.non_tensor_batch[k] for k in nkeys}
        meta = {k: self.meta_info[k] for k in mkeys}
        if deepcopy:
            tensors = {k: v.clone() for k, v in tensors.items()}
            arrays, meta = copy.deepcopy(arrays), copy.deepcopy(meta)
        return self._with(tensors, arrays, len(self), meta)

    def pop(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
    ) -> DataProto:
        """Removes the named keys from ``self`` and returns them as a DataProto (``None`` pops nothing)."""
        bkeys = _check_keys("batch", batch_keys or [], self.batch_keys)
        nkeys = _check_keys("non_tensor_batch", non_tensor_batch_keys or [], self.non_tensor_keys)
        mkeys = _check_keys("meta_info", meta_info_keys or [], list(self.meta_info))
        popped = self.select(bkeys, nkeys, mkeys)
        for k in bkeys:
            del self.batch[k]
        for k in nkeys:
            del self.non_tensor_batch[k]
        for k in mkeys:
            del self.meta_info[k]
        return popped

    def union(self, other: DataProto) -> DataProto:
        """Merges the keys of two DataProtos of equal length into a new one.

        Raises:
            ValueError: lengths differ, or a key present in both holds different values.
        """
        if len(self) != len(other):
            raise ValueError(f"union needs equal lengths, got {len(self)} and {len(other)}")
        tensors, arrays, meta = dict(self._items()), dict(self.non_tensor_batch), dict(self.meta_info)
        for part, mine, theirs in (
            ("batch", tensors, dict(other._items())),
            ("non_tensor_batch", arrays, other.non_tensor_batch),
            ("meta_info", meta, other.meta_info),
        ):
            for k, v in theirs.items():
                if k in mine and not _values_equal(mine[k], v):
                    raise ValueError(f"union: {part} key {k!r} holds different values in the two DataProtos")
                mine[k] = v
        if self.batch is None and other.batch is None:
            return DataProto(meta_info=meta)
        devices = {p.batch.device for p in (self, other) if p.batch is not None and len(p.batch_keys)}
        device = devices.pop() if len(devices) == 1 else None
        return DataProto(TensorDict(tensors, batch_size=[len(self)], device=device), arrays, meta)

    # ----------------------------------------------------------------- splitting and joining
    def chunk(self, n: int) -> list[DataProto]:
        """``n`` equal parts; raises ``ValueError`` when ``len(self) % n != 0`` (see :meth:`split_even`)."""
        _check_positive("n", n)
        if len(self) % n != 0:
            raise ValueError(
                f"cannot chunk len={len(self)} rows into n={n} equal parts (len % n = {len(self) % n}); "
                "use split_even for parts whose sizes differ by one, or pad_to_divisor first"
            )
        return self.split([len(self) // n] * n)

    def split(self, sizes: Sequence[int]) -> list[DataProto]:
        """Consecutive parts of the given sizes, which must be non-negative and sum to ``len(self)``."""
        if any(not _is_int(s) or s < 0 for s in sizes) or sum(sizes) != len(self):
            raise ValueError(f"split sizes {list(sizes)} must be non-negative ints summing to len={len(self)}")
        bounds = np.cumsum([0, *sizes]).tolist()
        return [self[start:end] for start, end in zip(bounds[:-1], bounds[1:])]

    def split_even(self, n: int) -> list[DataProto]:
        """``n`` consecutive parts whose sizes differ by at most one (the first ``len % n`` get the extra row)."""
        _check_positive("n", n)
        base, extra = divmod(len(self), n)
        return self.split([base + (1 if i < extra else 0) for i in range(n)])

    @staticmethod
    def concat(items: Sequence[DataProto], gather_meta_keys: Sequence[str] = ()) -> DataProto:
        """Concatenates rows of DataProtos with the same keys.

        Bare ``DataProto()`` items are skipped; zero-row parts with keys take part normally.
        ``meta_info`` is the union of the items' meta (first item's order); a key with
        different values in two items raises ``ValueError``, except keys listed in
        ``gather_meta_keys``, whose values are collected into a list in item order
        (for per-part statistics such as timings).
        """
        if not items:
            raise ValueError("concat needs at least one DataProto, got an empty list")
        meta = _merge_meta([p.meta_info for p in items], set(gather_meta_keys))
        parts = [p for p in items if p.batch is not None]
        if not parts:
            return DataProto(meta_info=meta)
        ref = parts[0]
        for i, p in enumerate(parts[1:], start=1):
            if set(p.batch_keys) != set(ref.batch_keys) or set(p.non_tensor_keys) != set(ref.non_tensor_keys):
                raise ValueError(
                    f"concat: part {i} has keys {sorted(p.keys)} but part 0 has {sorted(ref.keys)} (bare parts skipped)"
                )
        tensors = {}
        for k in ref.batch_keys:
            try:
                tensors[k] = _cat_rows([p.batch[k] for p in parts])
            except RuntimeError as err:
                shapes = [tuple(p.batch[k].shape) for p in parts]
                raise ValueError(f"concat: batch key {k!r} cannot be concatenated, shapes {shapes}: {err}") from err
        arrays = {k: np.concatenate([p.non_tensor_batch[k] for p in parts]) for k in ref.non_tensor_keys}
        return ref._with(tensors, arrays, sum(len(p) for p in parts), meta)

    def repeat(self, n: int, interleave: bool = True) -> DataProto:
        """Each row ``n`` times: ``[a, a, b, b]`` with ``interleave``, else the batch tiled ``[a, b, a, b]``."""
        _check_positive("n", n)
        rows = torch.arange(len(self))
        return self[rows.repeat_interleave(n) if interleave else rows.repeat(n)]

    def reorder(self, idx: Index) -> DataProto:
        """Rows in the order ``idx``, which must be a permutation of ``range(len(self))``."""
        perm = _normalize_index(idx, len(self))
        if isinstance(perm, slice):
            perm = torch.arange(len(self))[perm]
        if not torch.equal(torch.sort(perm).values, torch.arange(len(self))):
            raise ValueError(f"reorder needs a permutation of range({len(self)}), got {perm.tolist()[:16]}...")
        return self[perm]

    def to(self, device: torch.device | str) -> DataProto:
        """Moves the tensors to ``device``; non-tensors stay on the host."""
        batch = None if self.batch is None else self.batch.to(device)
        return DataProto(batch, dict(self.non_tensor_batch), dict(self.meta_info))

    def pad_to_divisor(self, k: int) -> tuple[DataProto, int]:
        """Pads to a multiple of ``k`` rows by repeating the first rows (cyclically); returns (padded, pad)."""
        _check_positive("k", k)
        pad = -len(self) % k
        if pad == 0:
            return self, 0
        return DataProto.concat([self, self[torch.arange(pad) % len(self)]]), pad

    def unpad(self, pad: int) -> DataProto:
        """Drops the last ``pad`` rows added by :meth:`pad_to_divisor`."""
        if not _is_int(pad) or not 0 <= pad <= len(self):
            raise ValueError(f"pad={pad} must be an int in [0, len={len(self)}]")
        return self[: len(self) - pad]

    def balanced_split(
        self,
        k: int,
        weights: Sequence[float] | torch.Tensor | str,
        equal_size: bool = True,
        group_size: int = 1,
    ) -> tuple[list[DataProto], list[list[int]]]:
        """Splits rows into ``k`` parts of nearly equal total weight (e.g. tokens per dp rank).

        Args:
            k: number of parts.
            weights: per-row weights of shape ``(N,)``, or a batch key: a 1-D tensor is used as
                is, a 2-D tensor (e.g. ``attention_mask: (N, T)``) is summed over dim 1.
            equal_size: parts' row counts differ by at most one group (see :func:`balanced_partition`).
            group_size: consecutive rows that stay in one part (the samples of one prompt).

        Returns:
            The parts, and for each part the original row indices (ascending) it holds;
            :func:`restore_order` inverts the split.
        """
        rows = balanced_row_groups(self.row_weights(weights), k, group_size, equal_size)
        return [self[torch.tensor(r, dtype=torch.long)] for r in rows], rows

    def row_weights(self, weights: Sequence[float] | torch.Tensor | str) -> list[float]:
        """Per-row weights: ``(N,)`` numbers as given, or a batch key (a 2-D tensor is summed over dim 1)."""
        if isinstance(weights, str):
            _check_keys("batch", [weights], self.batch_keys)
            weights = self.batch[weights]
            if weights.dim() == 2:
                weights = weights.sum(dim=1)
            elif weights.dim() != 1:
                raise ValueError(f"weight key tensor must be 1-D or 2-D, got shape {tuple(weights.shape)}")
        values = weights.detach().double().cpu().tolist() if isinstance(weights, torch.Tensor) else list(weights)
        if len(values) != len(self) or any(isinstance(v, list) for v in values):
            raise ValueError(f"weights must be {len(self)} numbers (one per row), got {len(values)} items")
        return values

    # ----------------------------------------------------------------- serialization
    def save(self, path: str | os.PathLike) -> None:
        """Writes one safetensors file (non-tensors and meta_info as JSON in its header), atomically.

        Raises:
            TypeError: a non-tensor column or meta_info value is not JSON-serializable (names the key).
        """
        header = {"format": _FORMAT, "version": _FORMAT_VERSION, "num_rows": len(self), "bare": self.batch is None}
        header["batch_keys"] = self.batch_keys
        header["non_tensor"] = {k: _encode_array(k, v) for k, v in self.non_tensor_batch.items()}
        header["meta_info"] = {k: _to_json(f"meta_info[{k!r}]", v) for k, v in self.meta_info.items()}
        tensors, seen = {}, set()
        for k, t in self._items():
            t = t.detach().cpu().contiguous()
            # safetensors refuses tensors that share storage; copy the repeats.
            if t.numel() and t.untyped_storage().data_ptr() in seen:
                t = t.clone()
            seen.add(t.untyped_storage().data_ptr())
            tensors[k] = t
        from safetensors.torch import save as st_save

        payload = st_save(tensors, metadata={_FORMAT: json.dumps(header)})
        write_atomic(path, payload, fsync=True)

    @classmethod
    def load(cls, path: str | os.PathLike) -> DataProto:
        """Reads a file written by :meth:`save`; never unpickles anything."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                header_json = (f.metadata() or {}).get(_FORMAT)
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except SafetensorError as err:
            raise ValueError(f"{path} is not a safetensors file written by DataProto.save: {err}") from err
        if header_json is None:
            raise ValueError(f"{path} is a safetensors file without a {_FORMAT} header")
        header = json.loads(header_json)
        if header.get("version") != _FORMAT_VERSION:
            raise ValueError(f"{path}: unsupported DataProto format version {header.get('version')}")
        if header["bare"]:
            return cls(meta_info=header["meta_info"])
        batch = TensorDict({k: tensors[k] for k in header["batch_keys"]}, batch_size=[header["num_rows"]])
        arrays = {k: _decode_array(v) for k, v in header["non_tensor"].items()}
        return cls(batch, arrays, header["meta_info"])


def restore_order(parts: Sequence[DataProto], indices: Sequence[Sequence[int]]) -> DataProto:
    """Inverts :meth:`DataProto.balanced_split`: rows of ``parts[i]`` go back to ``indices[i]``.

    Parts may have gained keys during processing, as long as all parts gained the same ones.
    """
    if len(parts) != len(indices):
        raise ValueError(f"got {len(parts)} parts but {len(indices)} index lists")
    for i, (p, idx) in enumerate(zip(parts, indices)):
        if len(p) != len(idx):
            raise ValueError(f"part {i} has {len(p)} rows but indices[{i}] has {len(idx)}")
    flat = torch.tensor([i for idx in indices for i in idx], dtype=torch.long)
    total = flat.numel()
    if not torch.equal(torch.sort(flat).values, torch.arange(total)):
        raise ValueError(f"indices must together be a permutation of range({total})")
    inverse = torch.empty(total, dtype=torch.long)
    inverse[flat] = torch.arange(total)
    return DataProto.concat(list(parts))[inverse]


def _rebuild(header: tuple | None, buffers: Sequence[np.ndarray], arrays: dict, meta: dict) -> DataProto:
    """Inverse of :meth:`DataProto.__reduce__`: tensors are views of ``buffers`` (no copy)."""
    if header is None:
        return DataProto(non_tensor_batch=arrays, meta_info=meta)
    num_rows, device, specs = header
    tensors = {}
    for (key, dtype, shape, tensor_device, requires_grad), buf in zip(specs, buffers):
        if isinstance(buf, torch.Tensor):
            t = buf
        elif buf.size:
            t = _tensor_view(buf).view(dtype).reshape(shape)
        else:  # torch refuses to view an empty buffer (stride 0) as a wider dtype
            t = torch.empty(shape, dtype=dtype)
        t = t if tensor_device == "cpu" else t.to(tensor_device)
        tensors[key] = t.requires_grad_() if requires_grad else t
    return DataProto(TensorDict(tensors, batch_size=[num_rows], device=device), arrays, meta)


def _cat_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(tensors)`` (dim 0); plain CPU tensors are joined as bytes by numpy, on this thread.

    torch splits a large copy over its intra-op threads. When the process shares few cores with
    busy workers (the driver collecting their outputs), waiting for those threads costs far more
    than the copy (docs/benchmarks.md, "DataProto round trip").
    Rows of contiguous tensors of one dtype and trailing shape concatenate as their bytes do.
    """
    first = tensors[0]
    plain = all(
        t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.requires_grad
        and not t.dtype.is_complex
        and t.dtype == first.dtype
        and t.shape[1:] == first.shape[1:]
        for t in tensors
    )
    if not plain:
        return torch.cat(tensors)
    out = torch.empty((sum(t.shape[0] for t in tensors), *first.shape[1:]), dtype=first.dtype)
    if out.numel():
        np.concatenate([_bytes_of(t) for t in tensors], out=_bytes_of(out))
    return out


def _bytes_of(t: torch.Tensor) -> np.ndarray:
    """The tensor's elements as a flat uint8 numpy array (a view when ``t`` is contiguous)."""
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy()


def _tensor_view(buf: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy`` of a byte buffer, also when Ray hands it over read-only (object store memory)."""
    if buf.flags.writeable:
        return torch.from_numpy(buf)
    with warnings.catch_warnings():
        # torch warns that it cannot protect a read-only array; DataProto's contract covers it (module doc).
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(buf)


# --------------------------------------------------------------------- balanced partition
def balanced_partition(weights: Sequence[float], k: int, equal_size: bool = False) -> list[list[int]]:
    """Splits indices ``0..n-1`` into ``k`` groups of nearly equal total weight (Karmarkar–Karp LDM).

    The largest differencing method keeps a heap of partial k-way partitions ("states"),
    each a list of ``k`` subsets sorted by sum. It repeatedly takes the two states with the
    largest spread (max sum - min sum) and merges them, joining the heaviest subset of one
    with the lightest of the other, so that large differences cancel. Start states:

    * ``equal_size=False``: one per item, the item alone in one subset.
    * ``equal_size=True``: items sorted by weight, cut into runs of ``k``; each run is a state
      with one item per subset. Every merge then adds one item of each run to each subset,
      so group sizes differ by at most one (the short last run leaves some subsets empty).

    Guarantees: merging two states of spreads ``a`` and ``b`` gives spread ``<= max(a, b)``,
    so the final spread is at most ``max(weights)``. The makespan (largest group sum) is
    within ``4/3 - 1/(3k)`` of optimal without the size constraint, and within ``2 - 1/k``
    of the optimal size-balanced one with it (Michiels, Korst, Aarts, van Leeuwen, 2003).
    Deterministic: ties are broken by index.

    Complexity: ``O(n log n + m k log k)`` time for ``m`` start states (``n`` or ``ceil(n/k)``)
    and ``O(n + m k)`` memory; index lists are joined small-into-large.

    Args:
        weights: non-negative finite weight per index, e.g. tokens per sequence.
        k: number of groups, >= 1.
        equal_size: constrain group sizes to differ by at most one.

    Returns:
        ``k`` lists of indices (each ascending), heaviest group first.

    >>> balanced_partition([8, 7, 6, 5, 4], 2)
    [[1, 3, 4], [0, 2]]
    """
    w = _check_weights(weights)
    _check_positive("k", k)
    order = sorted(range(len(w)), key=lambda i: (-w[i], i))
    if equal_size:
        starts = [order[s : s + k] for s in range(0, len(order), k)]
    else:
        starts = [[i] for i in order]
    empty = (0.0, None)
    heap: list[tuple[float, int, list]] = []
    for seq, run in enumerate(starts):
        state = [(w[i], [i]) for i in run] + [empty] * (k - len(run))
        heapq.heappush(heap, (-(state[0][0] - state[-1][0]), seq, state))
    seq = len(starts)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # a and b are sorted by sum, heaviest first: pair a's heaviest with b's lightest.
        merged = [(sa + sb, _join(ia, ib)) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
        merged.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), seq, merged))
        seq += 1
    if not heap:
        return [[] for _ in range(k)]
    return [sorted(items) if items else [] for _, items in heap[0][2]]


def balanced_row_groups(
    weights: Sequence[float], k: int, group_size: int = 1, equal_size: bool = True
) -> list[list[int]]:
    """Rows ``0..n-1`` in ``k`` parts of nearly equal weight, each group of ``group_size`` consecutive rows whole.

    A group weighs the sum of its rows; :func:`balanced_partition` splits the groups (with
    ``equal_size``, every part gets the same number of groups, give or take one), then single
    swaps between the heaviest and the lightest part narrow what is left of the gap.

    Returns:
        ``k`` lists of row indices, each ascending.

    Raises:
        ValueError: ``n`` is not a multiple of ``group_size``.

    >>> balanced_row_groups([5, 5, 1, 1, 4, 4, 2, 2], 2, group_size=2)
    [[0, 1, 2, 3], [4, 5, 6, 7]]
    """
    _check_positive("group_size", group_size)
    w = _check_weights(weights)
    if len(w) % group_size:
        raise ValueError(f"{len(w)} rows do not form whole groups of group_size={group_size} rows")
    group_weights = [sum(w[g : g + group_size]) for g in range(0, len(w), group_size)]
    parts = _swap_to_balance(group_weights, balanced_partition(group_weights, k, equal_size=equal_size))
    return [[g * group_size + j for g in groups for j in range(group_size)] for groups in parts]


def _swap_to_balance(weights: Sequence[float], parts: list[list[int]], max_rounds: int = 64) -> list[list[int]]:
    """Improves a partition by swapping one item of the heaviest part with one of the lightest.

    Each round makes the swap that brings the two parts' sums closest, if it narrows their gap;
    part sizes do not change and no part ends heavier than the heaviest was. Under the size
    constraint Karmarkar–Karp can leave a heavy item's part far above the mean (1.16x the lower
    bound on skewed lengths, 4 parts); a few swaps close most of that.
    """
    w = np.asarray(weights, dtype=np.float64)
    parts = [list(p) for p in parts]
    for _ in range(max_rounds):
        sums = [float(w[p].sum()) for p in parts]
        hi, lo = int(np.argmax(sums)), int(np.argmin(sums))
        gap = sums[hi] - sums[lo]
        if gap <= 0 or not parts[hi] or not parts[lo]:
            break
        # For each item a of hi, the items b of lo nearest to w[a] - gap/2 are the best partners.
        heavy, light = w[parts[hi]], w[parts[lo]]
        by_weight = np.argsort(light, kind="stable")
        near = np.searchsorted(light[by_weight], heavy - gap / 2)
        candidates = np.stack([np.clip(near - 1, 0, len(light) - 1), np.clip(near, 0, len(light) - 1)], axis=1)
        diff = heavy[:, None] - light[by_weight[candidates]]  # what moves from hi to lo
        new_gap = np.where((diff > 0) & (diff < gap), np.abs(gap - 2 * diff), np.inf)
        best = int(np.argmin(new_gap))
        if not np.isfinite(new_gap.flat[best]):
            break
        a = best // 2
        b = int(by_weight[candidates[a, best % 2]])
        parts[hi][a], parts[lo][b] = parts[lo][b], parts[hi][a]
    return [sorted(p) for p in parts]


def _join(x: list[int] | None, y: list[int] | None) -> list[int] | None:
    """Joins two index lists, extending the longer one in place (each list belongs to one live subset)."""
    if x is None:
        return y
    if y is None:
        return x
    if len(x) < len(y):
        x, y = y, x
    x.extend(y)
    return x


def _check_weights(weights: Sequence[float]) -> list[float]:
    values = weights.tolist() if isinstance(weights, (torch.Tensor, np.ndarray)) else list(weights)
    for i, v in enumerate(values):
        if isinstance(v, (list, tuple)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"weights[{i}]={v!r} must be a finite non-negative number")
    return [float(v) for v in values]


# --------------------------------------------------------------------- helpers
def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_positive(name: str, value: Any) -> None:
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")


def _check_keys(part: str, wanted: Iterable[str], present: Sequence[str]) -> list[str]:
    if isinstance(wanted, str):
        raise TypeError(f"{part} keys must be a list of names, got the string {wanted!r}")
    wanted = list(wanted)
    missing = [k for k in wanted if k not in present]
    if missing:
        raise KeyError(f"{part} keys {missing} not found; present keys: {list(present)}")
    return wanted


def _as_row_array(key: str, value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise TypeError(f"non_tensors[{key!r}] must have a row dim, got a 0-d array")
        return value
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"non_tensors[{key!r}] must be a list, tuple or numpy array, got {type(value).__name__}")
    # Fill element-wise so that a row holding a list stays one object (np.array would add dims).
    arr = np.empty(len(value), dtype=object)
    for i, v in enumerate(value):
        arr[i] = v
    return arr


def _normalize_index(idx: Index, n: int) -> slice | torch.Tensor:
    """A slice, or a 1-D int64 tensor of non-negative row positions."""
    if isinstance(idx, slice):
        if idx.step is None or idx.step > 0:
            return slice(*idx.indices(n))
        return torch.arange(*idx.indices(n), dtype=torch.long)
    if _is_int(idx) or (isinstance(idx, torch.Tensor) and idx.dim() == 0 and not idx.is_floating_point()):
        i = int(idx)
        if not -n <= i < n:
            raise IndexError(f"row index {i} out of range for a DataProto of len {n}")
        i %= n
        return slice(i, i + 1)
    if isinstance(idx, str):
        raise TypeError(f"DataProto rows are indexed by position; use .batch[{idx!r}] or .non_tensor_batch[{idx!r}]")
    rows = torch.as_tensor(np.asarray(idx) if isinstance(idx, (list, tuple)) else idx).cpu()
    if rows.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    if rows.dtype == torch.bool:
        if rows.shape != (n,):
            raise IndexError(f"bool mask has shape {tuple(rows.shape)} but the DataProto has {n} rows")
        return rows.nonzero().flatten()
    if rows.is_floating_point() or rows.is_complex() or rows.dim() != 1:
        raise TypeError(
            f"row index must be a 1-D integer or bool sequence, got {rows.dtype} of shape {tuple(rows.shape)}"
        )
    rows = rows.long()
    if rows.min() < -n or rows.max() >= n:
        raise IndexError(f"row indices must lie in [-{n}, {n}), got min {int(rows.min())} and max {int(rows.max())}")
    return torch.where(rows < 0, rows + n, rows)


def _values_equal(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            return False
        return all(_values_equal(x, y) for x, y in zip(a.ravel().tolist(), b.ravel().tolist()))
    try:
        return bool(a == b)
    except (ValueError, TypeError, RuntimeError):  # e.g. containers of arrays
        return False


def _merge_meta(metas: Sequence[dict], gather: set[str]) -> dict:
    merged: dict = {}
    for i, meta in enumerate(metas):
        for k, v in meta.items():
            if k in gather:
                merged.setdefault(k, []).append(v)
            elif k not in merged:
                merged[k] = v
            elif not _values_equal(merged[k], v):
                raise ValueError(f"concat: meta_info[{k!r}] conflicts: {merged[k]!r:.60} vs {v!r:.60} in part {i}")
    return merged


def _to_json(where: str, value: Any) -> Any:
    """Checks JSON-ability now so the error names the key; numpy scalars become Python numbers."""

    def default(obj: Any) -> Any:
        if isinstance(obj, np.generic):
            return obj.item()
        raise TypeError(f"{where} holds a {type(obj).__name__}, which is not JSON-serializable")

    return json.loads(json.dumps(value, default=default))


def _encode_array(key: str, arr: np.ndarray) -> dict:
    if arr.dtype.kind not in "biufUSO":
        raise TypeError(f"non_tensor_batch[{key!r}] has dtype {arr.dtype}, which cannot be saved as JSON")
    # Bytes are not JSON: store them flat, one latin-1 string per element.
    values = arr.tolist() if arr.dtype.kind != "S" else [b.decode("latin-1") for b in arr.ravel().tolist()]
    return {"dtype": arr.dtype.str, "shape": list(arr.shape), "values": _to_json(f"non_tensor_batch[{key!r}]", values)}


def _decode_array(spec: dict) -> np.ndarray:
    dtype, shape, values = np.dtype(spec["dtype"]), tuple(spec["shape"]), spec["values"]
    if dtype.kind == "S":
        return np.array([v.encode("latin-1") for v in values], dtype=dtype).reshape(shape)
    if dtype.kind != "O":
        return np.array(values, dtype=dtype).reshape(shape)
    arr = np.empty(shape, dtype=object)
    for pos in np.ndindex(*shape):
        item = values
        for i in pos:
            item = item[i]
        arr[pos] = item
    return arr
