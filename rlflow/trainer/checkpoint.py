"""Checkpoint directories: atomic saves, pruning, resume resolution, RNG and loader state.

A checkpoint is a directory ``<checkpoint dir>/step_<N>`` holding whatever the trainer's
``write_fn`` wrote (model and optimizer shards as safetensors, HF exports) plus ``meta.json``
(step, time, file list). :meth:`CheckpointManager.save` lets ``write_fn`` fill a temporary
directory next to the target and renames it into place only when everything is written, so a
crash never leaves a half-written ``step_<N>``: a directory with that name and a ``meta.json`` is
complete. The trained models of a finished run go apart from the rotation, to ``final/<model>``
(:func:`save_final_models`). Nothing here pickles: RNG states and the data-loader position are JSON, and any
tensors the trainer adds go through safetensors or ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import shutil
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlflow.trainer.config import CheckpointConfig

__all__ = [
    "CheckpointManager",
    "capture_rng_state",
    "complete_checkpoints",
    "final_dir",
    "read_json",
    "read_trainer_state",
    "restore_rng_state",
    "save_final_models",
    "write_json",
    "write_trainer_state",
]

META_FILE = "meta.json"
TRAINER_STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_PREFIX = ".tmp_"


class CheckpointManager:
    """Save, list, prune and find checkpoints of one run.

    Args:
        cfg: checkpoint settings (``dir``, ``keep_last``, ``resume``...).
        run_dir: the run directory; checkpoints go to ``cfg.dir`` or ``<run_dir>/checkpoints``.

    Only one process (the driver) may save into a directory at a time. Leftover temporary
    directories of an interrupted save are removed when the manager is created.

    >>> import tempfile
    >>> manager = CheckpointManager(CheckpointConfig(keep_last=1), tempfile.mkdtemp())
    >>> path = manager.save(3, lambda d: (d / "weights.txt").write_text("w"))
    >>> path.name, manager.latest() == path, manager.read_meta(path)["files"]
    ('step_3', True, ['weights.txt'])
    """

    def __init__(self, cfg: CheckpointConfig, run_dir: str | Path) -> None:
        self.cfg = cfg
        self.directory = Path(cfg.dir) if cfg.dir else Path(run_dir) / "checkpoints"
        self.directory.mkdir(parents=True, exist_ok=True)
        for leftover in self.directory.glob(f"{_TMP_PREFIX}*"):
            shutil.rmtree(leftover, ignore_errors=True)

    def path_for(self, step: int) -> Path:
        return self.directory / f"step_{step}"

    def scratch_dir(self, name: str) -> Path:
        """A fresh path for a temporary directory beside the checkpoints (not created); one an
        interrupted run leaves behind is removed when the next manager is created."""
        return self.directory / f"{_TMP_PREFIX}{name}_{uuid.uuid4().hex[:8]}"

    def save(self, step: int, write_fn: Callable[[Path], Any], *, extra_meta: Mapping[str, Any] | None = None) -> Path:
        """Write checkpoint ``step`` atomically, then prune to ``keep_last``.

        Args:
            step: training step the checkpoint holds (>= 0); an existing ``step_<step>`` is replaced.
            write_fn: called with an empty temporary directory to fill (its return value is ignored).
            extra_meta: JSON-able entries added to ``meta.json``.

        Returns:
            The final directory ``<dir>/step_<step>``.

        Raises:
            ValueError: a negative step, or ``write_fn`` wrote ``meta.json`` itself.
            Exception: whatever ``write_fn`` raises; the temporary directory is removed first.
        """
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative int")
        target = self.path_for(step)
        tmp = self.directory / f"{_TMP_PREFIX}step_{step}_{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            write_fn(tmp)
            if (tmp / META_FILE).exists():
                raise ValueError(f"write_fn wrote {META_FILE!r}, which the checkpoint manager owns")
            files = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
            meta = {"step": step, "time": time.time(), "files": files, **dict(extra_meta or {})}
            write_json(tmp / META_FILE, meta)
            _replace_dir(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.prune(keep=target)
        return target

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints (with ``meta.json``), oldest step first."""
        return complete_checkpoints(self.directory)

    def latest(self) -> Path | None:
        """The complete checkpoint with the highest step, or None."""
        checkpoints = self.checkpoints()
        return checkpoints[-1] if checkpoints else None

    def prune(self, keep: Path | None = None) -> list[Path]:
        """Keep ``keep_last`` checkpoints (0: all) and delete the rest; returns the deleted.

        The kept ones are ``keep`` (the one just saved, even when a resumed run saves below
        newer steps) and the newest others.
        """
        if self.cfg.keep_last == 0:
            return []
        others = [path for path in self.checkpoints() if path != keep]
        budget = self.cfg.keep_last - (keep is not None and keep.is_dir())
        doomed = others[: max(0, len(others) - budget)]
        for path in doomed:
            shutil.rmtree(path)
        return doomed

    def resolve_resume(self, setting: str | None = None) -> Path | None:
        """The checkpoint to resume from.

        Args:
            setting: ``"none"`` (start fresh), ``"auto"`` (the latest checkpoint, or fresh when
                there is none) or a checkpoint directory; default ``cfg.resume``.

        Raises:
            FileNotFoundError: ``setting`` is a path that is not a complete checkpoint.
        """
        setting = self.cfg.resume if setting is None else setting
        if setting == "none":
            return None
        if setting == "auto":
            return self.latest()
        path = Path(setting)
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint.resume={setting!r}: no such checkpoint directory")
        if not (path / META_FILE).is_file():
            raise FileNotFoundError(f"checkpoint.resume={setting!r}: not a complete checkpoint (no {META_FILE})")
        return path

    @staticmethod
    def read_meta(path: str | Path) -> dict[str, Any]:
        """The ``meta.json`` of a checkpoint directory."""
        return read_json(Path(path) / META_FILE)


def complete_checkpoints(directory: str | Path) -> list[Path]:
    """The complete checkpoints (``step_<N>`` with ``meta.json``) in ``directory``, oldest step first;
    none when it does not exist. Reads only: no manager (which creates the directory) needed."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / META_FILE).is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``; an existing ``dst`` is moved aside first and deleted after."""
    if not dst.exists():
        os.replace(src, dst)
        return
    old = dst.with_name(f"{_TMP_PREFIX}old_{dst.name}_{uuid.uuid4().hex[:8]}")
    os.replace(dst, old)
    os.replace(src, dst)
    shutil.rmtree(old, ignore_errors=True)


# --- The final models ---


def final_dir(cfg: CheckpointConfig, run_dir: str | Path) -> Path:
    """``cfg.final_dir`` (absolute: workers write there), or ``<run_dir>/final``."""
    return Path(os.path.abspath(cfg.final_dir)) if cfg.final_dir else Path(run_dir) / "final"


def save_final_models(export: Callable[[str, str], Any], names: Sequence[str], directory: str | Path) -> list[Path]:
    """Export each model of ``names`` to ``<directory>/<name>``, each replaced only once whole.

    ``export(name, path)`` writes an HF directory at ``path`` (``ModelWorker.save_pretrained``
    through the worker group: weights, tokenizer, generation config); it is given a temporary
    path beside the target, renamed onto the target when complete. The directory lies outside
    the checkpoint rotation, so ``keep_last`` never prunes it.

    Returns:
        The model directories, in the order of ``names``.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    # Exports a killed run left half-written: ours, and the engine's own temporary beside each of ours.
    for leftover in [*directory.glob(f"{_TMP_PREFIX}*"), *directory.glob(f".{_TMP_PREFIX}*")]:
        shutil.rmtree(leftover, ignore_errors=True)
    written = []
    for name in names:
        tmp = directory / f"{_TMP_PREFIX}{name}_{uuid.uuid4().hex[:8]}"
        try:
            export(name, str(tmp))
            _replace_dir(tmp, directory / name)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        written.append(directory / name)
    return written


# --- JSON files ---


def write_json(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as JSON through a temporary file and a rename (never a torn file)."""
    path = Path(path)
    tmp = path.with_name(f"{_TMP_PREFIX}{path.name}.{uuid.uuid4().hex[:8]}")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


# --- RNG state ---


def capture_rng_state(generators: Mapping[str, torch.Generator] | None = None) -> dict[str, Any]:
    """The Python, NumPy and torch (CPU and CUDA) global RNG states, plus named generators, as JSON.

    Args:
        generators: extra ``torch.Generator`` s to record (e.g. a sampler's), by name.

    Returns:
        A JSON-serialisable dict for :func:`restore_rng_state`.
    """
    version, mt_state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(mt_state), "gauss_next": gauss},
        "numpy": {
            "kind": kind,
            "keys": keys.tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "torch": _bytes_to_text(torch.get_rng_state()),
        "generators": {name: _bytes_to_text(g.get_state()) for name, g in (generators or {}).items()},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_bytes_to_text(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: Mapping[str, Any], generators: Mapping[str, torch.Generator] | None = None) -> None:
    """Put back RNG states from :func:`capture_rng_state` (after a JSON round trip).

    Args:
        state: the captured dict.
        generators: the generators to restore, by the names they were captured under.

    Raises:
        KeyError: a generator name that the state does not hold.
    """
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    npy = state["numpy"]
    keys = np.asarray(npy["keys"], dtype=np.uint32)
    np.random.set_state((npy["kind"], keys, npy["pos"], npy["has_gauss"], npy["cached"]))
    torch.set_rng_state(_text_to_bytes(state["torch"]))
    for name, generator in (generators or {}).items():
        if name not in state["generators"]:
            raise KeyError(f"no RNG state for generator {name!r}; saved: {sorted(state['generators'])}")
        generator.set_state(_text_to_bytes(state["generators"][name]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_text_to_bytes(s) for s in state["cuda"]])


def _bytes_to_text(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().numpy().tobytes()).decode("ascii")


def _text_to_bytes(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


# --- Trainer state: step, RNG, data-loader position ---


def write_trainer_state(
    checkpoint_dir: str | Path,
    *,
    step: int,
    data_state: Mapping[str, Any],
    generators: Mapping[str, torch.Generator] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``trainer_state.json``: the step, the driver's RNG states and the loader position.

    Args:
        checkpoint_dir: the (temporary) checkpoint directory given to ``write_fn``.
        step: the last completed step.
        data_state: JSON-able position of the data loader (epoch, index, seed...).
        generators: named torch generators of the driver to record.
        extra: other JSON-able driver state (KL controller value, counters...).

    Returns:
        The written file.
    """
    path = Path(checkpoint_dir) / TRAINER_STATE_FILE
    state = {"step": step, "rng": capture_rng_state(generators), "data": dict(data_state), "extra": dict(extra or {})}
    write_json(path, state)
    return path


def read_trainer_state(checkpoint_dir: str | Path) -> dict[str, Any]:
    """The dict written by :func:`write_trainer_state` (RNG states are not applied; call
    :func:`restore_rng_state` with ``state["rng"]``)."""
    path = Path(checkpoint_dir) / TRAINER_STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} does not exist; is {str(checkpoint_dir)!r} an rlflow checkpoint?")
    return read_json(path)
