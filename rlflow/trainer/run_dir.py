"""The run directory: what a new run does with an earlier run's outputs, and what a resume must match.

A run writes its metrics, TensorBoard events, checkpoints and final model under ``logging.dir``
(default ``runs/{experiment_name}``). A new run whose directory already holds an earlier run's
outputs resumes it when ``checkpoint.resume`` finds a checkpoint (with ``auto`` and no complete
checkpoint nor final model, the earlier attempt starts over: its logged steps are dropped); otherwise
``logging.if_exists`` decides: ``refuse`` (a ConfigError before any work), ``replace`` (the
earlier outputs are deleted) or ``new`` (this run takes ``{dir}-2``, ``-3``, ...). A resumed
checkpoint must hold the models this config describes: each checkpoint records its models'
shapes (:func:`model_identities`), compared field by field before anything is built.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from rlflow.trainer.checkpoint import META_FILE, CheckpointManager, complete_checkpoints, final_dir
from rlflow.trainer.config import ConfigError, RLFlowConfig

logger = logging.getLogger(__name__)

# What a run writes in its directory (checkpoints and final models: where their settings put them).
RUN_OUTPUTS = ("metrics.jsonl", "tensorboard")
# Caches a run builds from its config (tiny models, value-head copies); rebuilt when the config changes.
RUN_CACHES = ("models",)
# The fields of a tiny model's config that decide its parameter shapes.
TINY_SHAPE_FIELDS = (
    "family", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "tie_word_embeddings",
)  # fmt: skip
# The entries of an HF config.json that decide a loaded model's parameter shapes.
HF_SHAPE_KEYS = (
    "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "vocab_size", "tie_word_embeddings",
)  # fmt: skip


def model_identities(cfg: RLFlowConfig) -> dict[str, dict[str, Any]]:
    """Per model role, what decides its parameter shapes: a tiny model's shape fields, a loaded
    model's ``config.json`` entries, or the source a copy starts from."""
    identities: dict[str, dict[str, Any]] = {}
    for role, m in cfg.models.items():
        if m.init == "tiny":
            identities[role] = {"init": "tiny", **{f: getattr(m, f) for f in TINY_SHAPE_FIELDS}}
        elif m.init == "path":
            config = Path(m.path) / "config.json"
            hf = json.loads(config.read_text()) if config.is_file() else {}
            identities[role] = {"init": "path", **{k: hf[k] for k in HF_SHAPE_KEYS if k in hf}}
        else:
            identities[role] = {"init": "copy", "init_from": m.init_from}
    return identities


def earlier_outputs(cfg: RLFlowConfig) -> list[Path]:
    """What an earlier run left in ``cfg``'s run directory, checkpoint directory and final-model directory."""
    places = [cfg.run_dir / name for name in RUN_OUTPUTS] + [final_dir(cfg.checkpoint, cfg.run_dir)]
    return [p for p in places if _non_empty(p)] + complete_checkpoints(cfg.checkpoint_dir)


def claim_run_dir(cfg: RLFlowConfig) -> RLFlowConfig:
    """``cfg`` with the run directory this run may write: its own, or the one ``logging.if_exists``
    gives when an earlier run's outputs are there and this run does not resume them.

    Raises:
        ConfigError: an earlier run is there and ``logging.if_exists`` is ``refuse``; a resumed
            checkpoint holds models of other shapes than the config's (names the field).
    """
    resumed = _resumed_checkpoint(cfg)
    if resumed is not None:
        check_resumable(cfg, resumed)
        return cfg
    outputs = earlier_outputs(cfg)
    if not outputs:
        return cfg
    policy, run_dir = cfg.logging.if_exists, cfg.run_dir
    listed = ", ".join(str(p.relative_to(run_dir)) if p.is_relative_to(run_dir) else str(p) for p in outputs)
    if cfg.checkpoint.resume == "auto" and final_dir(cfg.checkpoint, run_dir) not in outputs:
        # An attempt of this run that died before its first complete checkpoint: resuming it is
        # starting over, and the steps it logged are logged again (as a restart from step 0 does).
        for path in outputs:
            _remove(path)
        logger.warning(
            "%s holds no complete checkpoint; checkpoint.resume=auto starts over (dropped: %s)", run_dir, listed
        )
        return cfg
    if policy == "refuse":
        key = "logging.dir" if cfg.logging.dir else "experiment_name"
        resume = "resume it with checkpoint.resume=auto, " if complete_checkpoints(cfg.checkpoint_dir) else ""
        raise ConfigError(
            key,
            f"{run_dir} already holds an earlier run ({listed}); {resume}name another {key}, or set "
            f"logging.if_exists=replace (deletes it) or logging.if_exists=new (a new directory beside it)",
        )
    if policy == "replace":
        for path in outputs + [run_dir / name for name in RUN_CACHES]:
            _remove(path)
        logger.info("replaced the earlier run in %s (logging.if_exists=replace)", run_dir)
        return cfg
    if cfg.checkpoint.dir is not None and complete_checkpoints(cfg.checkpoint_dir):
        raise ConfigError(
            "checkpoint.dir",
            f"{cfg.checkpoint.dir} holds an earlier run's checkpoints and logging.if_exists=new moves only the run "
            "directory; name another checkpoint.dir or leave it null",
        )
    new = _free_sibling(cfg)
    logger.info("%s holds an earlier run; this run writes to %s (logging.if_exists=new)", run_dir, new.run_dir)
    return new


def check_resumable(cfg: RLFlowConfig, checkpoint: Path) -> None:
    """Refuses a checkpoint whose models' shapes differ from the config's (checkpoints that
    predate the record are not checked).

    Raises:
        ConfigError: names ``models.<role>.<field>`` (``models.<role>.path`` for a loaded model).
    """
    recorded = json.loads((checkpoint / META_FILE).read_text()).get("models")
    if not recorded:
        return
    for role, now in model_identities(cfg).items():
        before = recorded.get(role)
        if before is None or before == now:
            continue
        fields = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
        if now.get("init") == "tiny" and before.get("init") == "tiny":
            key = f"models.{role}.{fields[0]}"
        else:
            key = f"models.{role}.path" if now.get("init") == "path" else f"models.{role}.init"
        changes = ", ".join(f"{k}: {before.get(k)!r} there, {now.get(k)!r} here" for k in fields)
        raise ConfigError(
            key,
            f"checkpoint.resume={cfg.checkpoint.resume!r} resumes {checkpoint}, whose {role} has another shape "
            f"({changes}); resume with the config it was trained with, or start a new run",
        )


def _resumed_checkpoint(cfg: RLFlowConfig) -> Path | None:
    if cfg.checkpoint.resume == "none":
        return None
    if cfg.checkpoint.resume == "auto":
        found = complete_checkpoints(cfg.checkpoint_dir)
        return found[-1] if found else None
    try:
        return CheckpointManager(cfg.checkpoint, cfg.run_dir).resolve_resume()
    except FileNotFoundError as err:
        raise ConfigError("checkpoint.resume", str(err)) from None


def _free_sibling(cfg: RLFlowConfig) -> RLFlowConfig:
    base = cfg.run_dir
    for n in range(2, 10_000):
        candidate = replace(cfg, logging=replace(cfg.logging, dir=str(base.with_name(f"{base.name}-{n}"))))
        if not earlier_outputs(candidate):
            return candidate
    raise ConfigError("logging.if_exists", f"no free directory beside {base}")


def _non_empty(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0 or path.is_dir() and any(path.iterdir())


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
