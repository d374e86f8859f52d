"""What a Python caller hands the :class:`~rlflow.trainer.Trainer`, turned into a config and run files.

TRL users bring a model, a tokenizer, datasets and reward functions as Python objects; rlflow's
workers read models, tokenizers and data by path. Each function here writes one kind of object
into the run directory (once, at construction) and returns the config that names it:

* :func:`build_config` — an ``RLFlowConfig``, a YAML path or a dict (+ ``key=value`` overrides),
  and an algorithm by name or as a record;
* :func:`with_model` — a local path, or a ``PreTrainedModel`` saved with ``save_pretrained``;
* :func:`with_tokenizer` — a local path or a tokenizer object saved likewise; without one, the
  model's directory when it holds a tokenizer;
* :func:`with_datasets` — a list of dicts, a ``datasets.Dataset`` or a JSONL path, every column
  kept; a training dataset replaces the synthetic task;
* :func:`check_reward_source` — one source of rewards for an algorithm that samples responses.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from rlflow.dataflow.algorithms import Algorithm, get_algorithm, list_algorithms, register_algorithm
from rlflow.trainer.config import ConfigError, RLFlowConfig, load_config
from rlflow.workers.reward_funcs import RewardFuncs

__all__ = [
    "DatasetLike",
    "build_config",
    "check_reward_source",
    "records_of",
    "with_datasets",
    "with_model",
    "with_tokenizer",
]

DatasetLike = str | os.PathLike | Sequence[Mapping[str, Any]] | Any  # Any: a ``datasets.Dataset``
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def build_config(
    config: RLFlowConfig | str | os.PathLike | Mapping[str, Any] | None,
    overrides: Sequence[str] = (),
    algorithm: str | Algorithm | None = None,
) -> RLFlowConfig:
    """The run's validated config from an ``RLFlowConfig``, a YAML path, a dict or ``None`` (defaults).

    Args:
        config: the settings.
        overrides: ``key=value`` strings applied after a YAML path or a dict.
        algorithm: an algorithm name, or an :class:`~rlflow.dataflow.algorithms.Algorithm`
            record (registered here when it is not yet); sets ``algorithm.name``.

    Raises:
        ValueError: ``overrides`` given with an ``RLFlowConfig`` (edit the object instead), an
            unknown algorithm name, or another record registered under the record's name.
    """
    name = _algorithm_name(algorithm)
    if isinstance(config, RLFlowConfig):
        if overrides:
            raise ValueError(f"overrides {list(overrides)} apply to a YAML path or a dict, not to an RLFlowConfig")
        return config if name is None else replace(config, algorithm=replace(config.algorithm, name=name))
    return load_config(config, [*overrides, *([f"algorithm.name={name}"] if name is not None else [])])


def _algorithm_name(algorithm: str | Algorithm | None) -> str | None:
    if algorithm is None:
        return None
    if isinstance(algorithm, str):
        return get_algorithm(algorithm).name  # an unknown name fails here, listing the registered ones
    if not isinstance(algorithm, Algorithm):
        raise TypeError(f"algorithm={type(algorithm).__name__}; expected a name or an Algorithm record")
    if algorithm.name not in list_algorithms():
        register_algorithm(algorithm)
    elif get_algorithm(algorithm.name) is not algorithm:
        raise ValueError(f"another algorithm is registered as {algorithm.name!r}; give this one another name")
    return algorithm.name


def check_reward_source(cfg: RLFlowConfig, reward_funcs: RewardFuncs | None) -> None:
    """Exactly one source scores the responses of an algorithm that samples them.

    The sources: ``reward_funcs`` (Python functions), ``algorithm.reward_fn`` (a named rule),
    ``models.reward`` (a reward model), or the synthetic task's own rule.

    Raises:
        ConfigError: no source, or reward functions beside a named rule or a reward model, or
            reward functions for an algorithm that samples no responses.
    """
    algo = cfg.algorithm
    samples = algo.record.samples_responses
    if reward_funcs is not None:
        if not samples:
            raise ConfigError("reward_funcs", f"algorithm {algo.name!r} samples no responses to score")
        if algo.reward_fn is not None or "reward" in cfg.models:
            other = f"algorithm.reward_fn={algo.reward_fn!r}" if algo.reward_fn else "models.reward"
            raise ConfigError("reward_funcs", f"{list(reward_funcs.names)} and {other} both give rewards; keep one")
        return
    if samples and cfg.reward_fn is None and "reward" not in cfg.models:
        raise ConfigError(
            "algorithm.reward_fn",
            "null, and neither models.reward nor data.task gives a reward (Python: Trainer(reward_funcs=[fn]))",
        )


def with_model(cfg: RLFlowConfig, model: Any, run_dir: Path) -> RLFlowConfig:
    """``models.actor`` loaded from ``model``: a local HF directory, or a model object saved into the run.

    A ``PreTrainedModel`` is written to ``<run_dir>/models/actor_init`` with ``save_pretrained``;
    the workers load it by path.
    """
    if model is None:
        return cfg
    if isinstance(model, (str, os.PathLike)):
        path = str(model)
    elif hasattr(model, "save_pretrained"):
        path = str(run_dir / "models" / "actor_init")
        model.save_pretrained(path)  # every time: a run directory reused with another model must not keep the old one
    else:
        raise TypeError(f"model={type(model).__name__}; expected a local HF directory or a PreTrainedModel")
    actor = cfg.models.get("actor")
    if actor is None:
        raise ConfigError("models.actor", f"missing, but model= was given; algorithm {cfg.algorithm.name!r}")
    models = {**cfg.models, "actor": replace(actor, init="path", path=path)}
    return replace(cfg, models=models)


def with_tokenizer(cfg: RLFlowConfig, tokenizer: Any, run_dir: Path) -> RLFlowConfig:
    """``data.tokenizer`` from ``tokenizer`` (a path or an object saved into the run).

    Without one (and without ``data.tokenizer``), a path-loaded actor's directory is the
    tokenizer when it holds one, as ``AutoTokenizer.from_pretrained(model_path)`` in TRL.
    """
    if tokenizer is None:
        actor = cfg.models.get("actor")
        if cfg.data.tokenizer is None and actor is not None and actor.path is not None:
            if any((Path(actor.path) / f).is_file() for f in _TOKENIZER_FILES):
                return replace(cfg, data=replace(cfg.data, tokenizer=actor.path))
        return cfg
    if isinstance(tokenizer, (str, os.PathLike)):
        path = str(tokenizer)
    elif hasattr(tokenizer, "save_pretrained"):
        path = str(run_dir / "tokenizer")
        tokenizer.save_pretrained(path)
    else:
        raise TypeError(f"tokenizer={type(tokenizer).__name__}; expected a local directory or a tokenizer object")
    return replace(cfg, data=replace(cfg.data, tokenizer=path))


def with_datasets(
    cfg: RLFlowConfig, train: DatasetLike | None, eval: DatasetLike | None, run_dir: Path
) -> RLFlowConfig:
    """``data.train_file`` / ``data.eval_file`` from in-memory datasets (written as JSONL into the run) or paths.

    A training dataset replaces the synthetic task (``data.task`` becomes null).
    """
    data = cfg.data
    if train is not None:
        data = replace(data, task=None, train_file=_as_file(train, run_dir / "train.jsonl", "train_dataset"))
    if eval is not None:
        data = replace(data, eval_file=_as_file(eval, run_dir / "eval.jsonl", "eval_dataset"))
    return cfg if data is cfg.data else replace(cfg, data=data)


def _as_file(dataset: DatasetLike, path: Path, name: str) -> str:
    if isinstance(dataset, (str, os.PathLike)):
        return str(dataset)
    rows = records_of(dataset, name)
    with open(path, "w", encoding="utf-8") as f:
        for i, row in enumerate(rows):
            try:
                f.write(json.dumps(row) + "\n")
            except TypeError as err:
                raise TypeError(
                    f"{name} row {i}: {err}; columns must hold JSON values (str, numbers, lists, dicts)"
                ) from None
    return str(path)


def records_of(dataset: Iterable[Mapping[str, Any]], name: str = "dataset") -> list[dict[str, Any]]:
    """Rows of a list of dicts or a ``datasets.Dataset`` (iterating it gives dicts), every column kept.

    >>> records_of([{"prompt": "1+1=", "answer": "2"}])
    [{'prompt': '1+1=', 'answer': '2'}]

    Raises:
        TypeError: not iterable, or a row that is not a mapping.
        ValueError: no rows.
    """
    if isinstance(dataset, Mapping) or not isinstance(dataset, Iterable):
        raise TypeError(
            f"{name}={type(dataset).__name__}; expected a list of dicts, a datasets.Dataset or a JSONL path"
        )
    rows = []
    for i, row in enumerate(dataset):
        if not isinstance(row, Mapping):
            raise TypeError(f"{name} row {i} is {type(row).__name__}; expected a dict of columns")
        rows.append(dict(row))
    if not rows:
        raise ValueError(f"{name} has no rows")
    return rows
