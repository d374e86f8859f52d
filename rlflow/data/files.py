"""Data files read through Hugging Face ``datasets``, the loader chosen by the file's extension.

``.parquet`` (verl's data), ``.jsonl`` / ``.json``, ``.csv``, ``.arrow``, or a directory written by
``Dataset.save_to_disk``. Rows come back as plain Python dicts (nested columns as dicts and
lists), each named for errors by ``file:line`` in a file of JSON lines, else by ``file row i``
(the row's index in ``datasets``). ``datasets`` writes its Arrow cache into a temporary
directory that is removed once the rows are read, so nothing is left in ``~/.cache``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["FORMATS", "DatasetFormatError", "data_format", "read_records"]

# File extension -> the ``datasets`` builder that reads it.
FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".arrow": "arrow"}
SAVED = "save_to_disk"  # data_format of a directory written by Dataset.save_to_disk


class DatasetFormatError(ValueError):
    """A data file or one of its rows is malformed; the message starts with the file (and line or row)."""


def data_format(path: str | os.PathLike) -> str:
    """How ``path`` is read: a builder of :data:`FORMATS` by extension, or :data:`SAVED` for a directory.

    >>> data_format("train.parquet"), data_format("train.jsonl")
    ('parquet', 'json')

    Raises:
        ValueError: an extension not in :data:`FORMATS`, a directory that ``save_to_disk`` did not
            write, or a saved ``DatasetDict`` (its splits are named: give one split's directory).
    """
    path = Path(path)
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
            raise ValueError(f"{path} holds a DatasetDict with splits {splits}; give one split's directory")
        if not (path / "state.json").is_file():
            raise ValueError(f"{path} is a directory that Dataset.save_to_disk did not write (no state.json)")
        return SAVED
    builder = FORMATS.get(path.suffix.lower())
    if builder is None:
        raise ValueError(
            f"{str(path)!r} has the extension {path.suffix!r}; data files are {', '.join(FORMATS)} "
            "or a directory written by Dataset.save_to_disk"
        )
    return builder


def read_records(path: str | os.PathLike) -> list[tuple[str, dict[str, Any]]]:
    """Every row of a data file, with where it is.

    A column that is null in a row is left out of that row (``datasets`` gives every row every
    column, ``None`` where the file has none), so a missing field is named as missing.

    Returns:
        ``(where, row)`` pairs: ``where`` is ``"file:line"`` in a file of JSON lines (blank lines
        skipped), else ``"file row i"``.

    Raises:
        ValueError: the format is unknown (:func:`data_format`).
        DatasetFormatError: ``datasets`` cannot read the file (a line of JSON lines that is not
            UTF-8, not JSON or not an object is named with its line), or the file has no rows.
    """
    builder, name = data_format(path), str(path)
    if builder != SAVED and os.path.getsize(path) == 0:
        raise DatasetFormatError(f"{name}: the file is empty; a dataset needs at least one row")
    lines = _non_blank_lines(name) if builder == "json" else []
    if builder == "json" and not lines:
        raise DatasetFormatError(f"{name}: the file holds only blank lines; a dataset needs at least one row")
    try:
        rows = _load(name, builder)
    except DatasetFormatError:
        if builder == "json":
            _check_json_lines(name)  # datasets names no line: find the bad one
        raise
    if not rows:
        raise DatasetFormatError(f"{name}: no rows; a dataset needs at least one")
    if len(lines) == len(rows):  # JSON lines: one row per non-blank line
        places = [f"{name}:{line}" for line in lines]
    else:
        places = [f"{name} row {i}" for i in range(len(rows))]
    return [(where, {k: v for k, v in row.items() if v is not None}) for where, row in zip(places, rows)]


def _load(path: str, builder: str) -> list[dict[str, Any]]:
    # Imported here: datasets (with pyarrow and pandas) is slow to import, and only file data needs it.
    import datasets

    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # one bar per small file is noise in a run's log
    try:
        if builder == SAVED:
            return datasets.load_from_disk(path).to_list()
        with tempfile.TemporaryDirectory(prefix="rlflow-datasets-") as cache:
            return datasets.load_dataset(builder, data_files=path, split="train", cache_dir=cache).to_list()
    except (datasets.exceptions.DatasetsError, ValueError, OSError) as err:
        cause = err.__cause__ or err  # DatasetGenerationError says only that generation failed
        raise DatasetFormatError(f"{path}: datasets cannot read it as {builder}: {cause}") from err
    finally:
        if bars:
            datasets.enable_progress_bars()


def _non_blank_lines(path: str) -> list[int]:
    """1-based numbers of the lines of ``path`` that hold more than whitespace."""
    with open(path, "rb") as f:
        return [n for n, raw in enumerate(f, start=1) if raw.strip()]


def _check_json_lines(path: str) -> None:
    """Raises for the first line of a JSON-lines file that is not UTF-8, not JSON or not an object,
    or whose column holds another JSON type than on an earlier line (Arrow wants one per column).

    A ``.json`` file whose first line is not a JSON value on its own is one document, not lines:
    nothing to name then.
    """
    with open(path, "rb") as f:
        numbered = [(n, raw) for n, raw in enumerate(f, start=1) if raw.strip()]
    first_seen: dict[str, tuple[str, int]] = {}  # column -> (JSON type, line)
    for n, raw in numbered:
        where = f"{path}:{n}"
        try:
            record = json.loads(_decoded(raw, where))
        except json.JSONDecodeError as e:
            if n == numbered[0][0] and not path.endswith(".jsonl"):
                return
            raise DatasetFormatError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(record, dict):
            raise DatasetFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
        for column, value in record.items():
            kind = _json_type(value)
            seen, line = first_seen.setdefault(column, (kind, n))
            if kind != seen and "null" not in (kind, seen):
                raise DatasetFormatError(
                    f"{where}: column {column!r} holds a {kind} here and a {seen} on line {line}; "
                    "give a column one type in every row"
                )


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "list", dict: "object"}[type(value)]


def _decoded(raw: bytes, where: str) -> str:
    """One line as text; bytes that are not UTF-8 are named with their column (1-based, in bytes)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        byte = raw[e.start : e.start + 1].hex()
        raise DatasetFormatError(
            f"{where}: not UTF-8: byte 0x{byte} at column {e.start + 1} ({e.reason}); save the file as UTF-8"
        ) from None
