"""Elastic checkpoints: the layouts a checkpoint was written in, and loading it into others.

A checkpoint records the plan it was written under (``plan.json``) and, in ``layouts.json``,
the home layout of every trainable model — strategy ``(dp, tp, pp)`` and global ranks — and the
worker ranks that wrote it. A run that resumes under another plan (re-planned by
``placement.mode=auto``, another manual strategy, another number of workers) loads it through
:func:`checkpoint_for_layouts`:

* the layouts match: the checkpoint directory itself is loaded (the resumed run is the
  uninterrupted one bit for bit);
* they differ: a directory next to the checkpoints is filled with the engine files of each
  model resharded into its new home layout — the reshard planner (:func:`plan_reshard`) run on
  the saved shards (:func:`apply_reshard_plan`) for the weights and AdamW's two moments,
  which have their parameter's layout — links to everything else, and a worker file for every
  current rank (a new rank takes the RNG and interface state of the lowest saved rank). The
  loaded weights and moments equal the saved ones exactly; only their split changes.

The engine files are those of :func:`rlflow.engine.engine_state.save_checkpoint`: one
``rank<r>.pt`` per mesh rank holding ``strategy``, ``global_step``, ``params`` (the stage's
local tensors by name, in ``named_parameters`` order), ``optim`` (AdamW's state dict, indexed
in that order) and ``scheduler``. The driver reads one model's files at a time, so it holds
about three copies of that model's training state (weights + two moments) while resharding.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlflow.engine.engine_state import ADAPTER_DIR
from rlflow.families import family_of
from rlflow.parallel.layout import Layout, build_layout, item_param_shapes
from rlflow.parallel.reshard import plan_reshard
from rlflow.parallel.reshard_local import apply_reshard_plan
from rlflow.strategy import ParallelStrategy
from rlflow.trainer.checkpoint import read_json, write_json

__all__ = [
    "LAYOUTS_FILE",
    "PLAN_FILE",
    "CheckpointLayouts",
    "ModelLayout",
    "checkpoint_for_layouts",
    "read_layouts",
    "home_layouts",
    "remove_scratch",
    "reshard_engine_dir",
    "stage_param_names",
    "write_layouts",
]

logger = logging.getLogger(__name__)

LAYOUTS_FILE = "layouts.json"
PLAN_FILE = "plan.json"
ENGINE_DIR = "engine"
_ENGINE_RANK = "rank{:05d}.pt"
_WORKER_FILE = re.compile(r"^worker_rank(\d+)\.pt$")
_WORKER_NAME = "worker_rank{:05d}.pt"  # rlflow.workers.model_worker's per-rank file


@dataclass(frozen=True)
class ModelLayout:
    """Where a trainable model's weights and optimizer state live: its home strategy and global ranks.

    Attributes:
        strategy: the home (training) strategy.
        ranks: global ranks of the home mesh, in call-rank order.
        head: ``"lm"`` (causal LM) or ``"value"`` (critic, reward model).
    """

    strategy: ParallelStrategy
    ranks: tuple[int, ...]
    head: str = "lm"

    def to_json(self) -> dict[str, Any]:
        s = self.strategy
        return {"strategy": {"dp": s.dp, "tp": s.tp, "pp": s.pp}, "ranks": list(self.ranks), "head": self.head}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ModelLayout:
        return cls(ParallelStrategy(**data["strategy"]), tuple(int(r) for r in data["ranks"]), data["head"])

    def describe(self) -> str:
        s = self.strategy
        return f"(dp={s.dp}, tp={s.tp}, pp={s.pp}) on ranks {list(self.ranks)}"


@dataclass(frozen=True)
class CheckpointLayouts:
    """The layouts of one run: every trainable model's home layout and the worker ranks started."""

    models: dict[str, ModelLayout]
    worker_ranks: tuple[int, ...]


def write_layouts(directory: Path, layouts: CheckpointLayouts, plan_json: str | None) -> None:
    """Write ``layouts.json`` (and the plan as ``plan.json`` when there is one) into a checkpoint directory."""
    record = {
        "models": {name: layout.to_json() for name, layout in sorted(layouts.models.items())},
        "worker_ranks": list(layouts.worker_ranks),
    }
    write_json(directory / LAYOUTS_FILE, record)
    if plan_json is not None:
        (directory / PLAN_FILE).write_text(plan_json, encoding="utf-8")


def read_layouts(checkpoint: Path) -> CheckpointLayouts | None:
    """The layouts a checkpoint was written in; ``None`` for a checkpoint that predates the record."""
    path = Path(checkpoint) / LAYOUTS_FILE
    if not path.is_file():
        return None
    record = read_json(path)
    models = {name: ModelLayout.from_json(data) for name, data in record["models"].items()}
    return CheckpointLayouts(models, tuple(int(r) for r in record["worker_ranks"]))


# --- engine files ---


def stage_param_names(config: Any, head: str, layout: Layout, pp_rank: int) -> list[tuple[str, str]]:
    """``(engine name, layout name)`` of the parameters of stage ``pp_rank``, in the stage's
    ``named_parameters`` order (its modules: embedding, layers, norm, head).

    A tied LM head is the embedding in the layout; the last stage of a pipeline holds its own
    copy under the LM head's name, and with one stage the two are one parameter (listed once).
    """
    family = family_of(config)
    tied = head == "lm" and bool(getattr(config, "tie_word_embeddings", False))
    items = set(layout.stages[pp_rank])
    names = []
    for item, shapes in item_param_shapes(config, head):
        if item not in items:
            continue
        for name in shapes:
            if tied and item == "head":
                if pp_rank == 0:
                    continue  # the embedding itself, already listed
                names.append((family.lm_head_name, name))
            else:
                names.append((name, name))
    return names


def _load_engine_files(directory: Path, layout: Layout) -> dict[int, dict[str, Any]]:
    states = {}
    for rank in layout.ranks:
        path = directory / _ENGINE_RANK.format(rank)
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the checkpoint's layout {layout.strategy} has rank {rank}")
        states[rank] = torch.load(path, weights_only=True, map_location="cpu")
    return states


def _per_kind(
    states: Mapping[int, Mapping[str, Any]], names: Mapping[int, list[tuple[str, str]]], where: Path
) -> tuple[dict[str, dict[int, dict[str, torch.Tensor]]], dict[str, dict[str, Any]]]:
    """Split the saved shards by kind: ``"params"`` and each AdamW tensor (``exp_avg``, ...) as
    rank -> {layout name: tensor}; the scalar optimizer state (``step``) per layout name."""
    tensors: dict[str, dict[int, dict[str, torch.Tensor]]] = {"params": {}}
    scalars: dict[str, dict[str, Any]] = {}
    for rank, state in states.items():
        engine_names = [engine for engine, _ in names[rank]]
        if list(state["params"]) != engine_names:
            raise ValueError(
                f"{where / _ENGINE_RANK.format(rank)}: parameters {list(state['params'])} are not the stage's "
                f"{engine_names}; the checkpoint does not come from this model"
            )
        if len(state["optim"]["param_groups"]) != 1:
            raise ValueError(f"{where}: {len(state['optim']['param_groups'])} optimizer groups; rlflow writes one")
        tensors["params"][rank] = {layout: state["params"][engine] for engine, layout in names[rank]}
        optim = state["optim"]["state"]
        for index, (_, layout) in enumerate(names[rank]):
            for key, value in optim.get(index, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    tensors.setdefault(key, {}).setdefault(rank, {})[layout] = value
                else:
                    scalars.setdefault(layout, {})[key] = value
    for key, per_rank in tensors.items():
        if len(per_rank) != len(states) or any(len(t) != len(names[r]) for r, t in per_rank.items()):
            raise ValueError(f"{where}: optimizer state {key!r} is missing for some parameters; cannot reshard it")
    return tensors, scalars


def reshard_engine_dir(
    src_dir: Path, dst_dir: Path, config: Any, head: str, src: ParallelStrategy, dst: ParallelStrategy
) -> None:
    """Write the engine files of ``dst`` from those saved under ``src``: weights and AdamW state resharded.

    Args:
        src_dir: a checkpoint's ``<model>/engine`` directory, written under strategy ``src``.
        dst_dir: where to write the files for strategy ``dst`` (created).
        config: the model's HF config (a value model's with ``num_labels`` set as its engine has it).
        head: ``"lm"`` or ``"value"``.
        src, dst: the saved and the new home strategy.

    Raises:
        FileNotFoundError: a rank file of the saved layout is missing.
        ValueError: the files do not hold this model's parameters, or not all their optimizer state.
    """
    src_layout = build_layout(config, src, range(src.world_size), fsdp=True, head=head)
    dst_layout = build_layout(config, dst, range(dst.world_size), fsdp=True, head=head)
    states = _load_engine_files(src_dir, src_layout)
    names = {r: stage_param_names(config, head, src_layout, src_layout.coords(r).pp) for r in src_layout.ranks}
    tensors, scalars = _per_kind(states, names, src_dir)
    plan = plan_reshard(src_layout, dst_layout)
    resharded = {key: apply_reshard_plan(plan, per_rank) for key, per_rank in tensors.items()}
    first = states[0]
    dst_dir.mkdir(parents=True, exist_ok=True)
    for rank in dst_layout.ranks:
        stage = stage_param_names(config, head, dst_layout, dst_layout.coords(rank).pp)
        optim_state = {}
        for index, (_, layout) in enumerate(stage):
            entry = {key: per_rank[rank][layout] for key, per_rank in resharded.items() if key != "params"}
            if entry or layout in scalars:
                optim_state[index] = {**scalars.get(layout, {}), **entry}
        group = {**first["optim"]["param_groups"][0], "params": list(range(len(stage)))}
        state = {
            "strategy": {"dp": dst.dp, "tp": dst.tp, "pp": dst.pp},
            "global_step": first["global_step"],
            "params": {engine: resharded["params"][rank][layout] for engine, layout in stage},
            "optim": {"state": optim_state, "param_groups": [group]},
            "scheduler": first["scheduler"],
        }
        torch.save(state, dst_dir / _ENGINE_RANK.format(rank))
    write_json(dst_dir / "engine.json", {"strategy": state["strategy"], "global_step": first["global_step"]})


# --- a checkpoint for the current layouts ---


def _changed_models(
    saved: CheckpointLayouts, now: CheckpointLayouts, checkpoint: Path
) -> dict[str, tuple[ModelLayout, ModelLayout]]:
    if sorted(saved.models) != sorted(now.models):
        raise ValueError(
            f"{checkpoint / LAYOUTS_FILE}: trainable models {sorted(saved.models)}, but this run trains "
            f"{sorted(now.models)}; resume a checkpoint of the same models"
        )
    return {
        name: (saved.models[name], now.models[name])
        for name in sorted(now.models)
        if saved.models[name].strategy != now.models[name].strategy or saved.models[name].head != now.models[name].head
    }


def checkpoint_for_layouts(checkpoint: Path, now: CheckpointLayouts, configs: Mapping[str, Any], scratch: Path) -> Path:
    """The directory to load ``checkpoint`` from under the layouts ``now``.

    Args:
        checkpoint: a complete checkpoint directory.
        now: this run's home layouts and worker ranks.
        configs: the HF config of every trainable model (a value model's with ``num_labels`` set).
        scratch: a directory to create when something must be resharded (the caller removes it).

    Returns:
        ``checkpoint`` itself when it was written in the same layouts (or predates the record),
        else ``scratch`` filled as the module docstring says.
    """
    saved = read_layouts(checkpoint)
    if saved is None:
        return checkpoint
    changed = _changed_models(saved, now, checkpoint)
    worker_files = {int(m.group(1)): p for p in checkpoint.iterdir() if (m := _WORKER_FILE.match(p.name))}
    if not worker_files:
        raise FileNotFoundError(f"{checkpoint}: no worker_rank*.pt files; is it an rlflow checkpoint?")
    if not changed and set(now.worker_ranks) <= set(worker_files):
        return checkpoint
    scratch.mkdir(parents=True)
    for entry in checkpoint.iterdir():
        if entry.name in changed:
            _model_dir(entry, scratch / entry.name, configs[entry.name], *changed[entry.name])
        elif not _WORKER_FILE.match(entry.name):
            os.symlink(entry.resolve(), scratch / entry.name)
    lowest = min(worker_files)
    for rank in now.worker_ranks:
        source = worker_files.get(rank, worker_files[lowest])
        os.symlink(source.resolve(), scratch / _WORKER_NAME.format(rank))
    new = sorted(set(now.worker_ranks) - set(worker_files))
    if new:
        logger.warning(
            "worker ranks %s are new: they start from the RNG and interface state of saved rank %d", new, lowest
        )
    return scratch


def _model_dir(src: Path, dst: Path, config: Any, saved: ModelLayout, now: ModelLayout) -> None:
    """A model's checkpoint directory with its engine files resharded from ``saved`` to ``now``."""
    if (src / ENGINE_DIR / ADAPTER_DIR).is_dir():  # the layouts describe base weights, not adapters
        raise ValueError(
            f"{src}: a LoRA model's checkpoint resumes only in the layout it was written in "
            f"({saved.strategy} on ranks {list(saved.ranks)}); this run trains it with {now.strategy} on ranks "
            f"{list(now.ranks)}: place its train call as before (placement.mode=manual)"
        )
    dst.mkdir()
    for entry in src.iterdir():
        if entry.name != ENGINE_DIR:
            os.symlink(entry.resolve(), dst / entry.name)
    message = f"{src.name}: resharding the checkpoint from {saved.describe()} to {now.describe()}"
    logger.info(message)
    reshard_engine_dir(src / ENGINE_DIR, dst / ENGINE_DIR, config, now.head, saved.strategy, now.strategy)


def remove_scratch(path: Path) -> None:
    """Remove a directory :func:`checkpoint_for_layouts` made (its links only, never their targets)."""
    shutil.rmtree(path, ignore_errors=True)


def home_layouts(setup: Any, worker_ranks: Sequence[int]) -> CheckpointLayouts:
    """This run's :class:`CheckpointLayouts` from its ``WorkerSetup``."""
    models = {}
    for name, model in setup.models.items():
        if model.trainable:
            home = setup.home_layout(name)
            models[name] = ModelLayout(home.strategy, home.ranks, "value" if model.value_head else "lm")
    return CheckpointLayouts(models, tuple(worker_ranks))
