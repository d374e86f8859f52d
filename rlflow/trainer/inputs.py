"""What a Python caller hands the :class:`~rlflow.trainer.Trainer`, turned into a config and run files.

TRL users bring a model, a tokenizer, datasets and reward functions as Python objects; rlflow's
workers read models, tokenizers and data by path. Each function here writes one kind of object
into the run directory (once, at construction) and returns the config that names it:

* :func:`build_config` — an ``RLFlowConfig``, a YAML path or a dict (+ ``key=value`` overrides),
  and an algorithm by name or as a record;
* :func:`with_model` — a local path or Hub id, or a ``PreTrainedModel`` saved with ``save_pretrained``;
* :func:`with_tokenizer` — a local path, Hub id or tokenizer object saved likewise; without one,
  the model's directory when it holds a tokenizer;
* :func:`with_datasets` — a list of dicts, a ``datasets.Dataset`` or a data file's path, every column
  kept; a training dataset replaces the synthetic task;
* :func:`split_reward_funcs` and :func:`with_reward_model` — ``reward_funcs`` as TRL takes it:
  functions, or a reward model given by local path, Hugging Face Hub id or model object, which
  becomes the run's ``models.reward`` (:func:`check_reward_tokenizer`: rlflow's kind must read the run's tokens);
  a Hub id anywhere resolves to its snapshot in the HF cache (:func:`rlflow.trainer.hub.resolve_model_dir`);
* :func:`check_reward_source` — one source of rewards for an algorithm that samples responses;
* :func:`multi_turn_setup` — ``tools=[...]`` or ``environment=Factory`` (or ``rollout.multi_turn``'s
  import paths), checked and pickled by value for the workers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from rlflow.data.tokenizer import load_tokenizer
from rlflow.dataflow.algorithms import Algorithm, get_algorithm, list_algorithms, register_algorithm
from rlflow.engine.models import is_sequence_classification
from rlflow.engine.rollout import list_episode_engines
from rlflow.trainer.config import ConfigError, ModelConfig, RLFlowConfig, load_config
from rlflow.trainer.hub import resolve_model_dir
from rlflow.workers.environments import MultiTurnSetup, ToolEnvironments, pack_environment
from rlflow.workers.reward_funcs import RewardFunc, RewardFuncs

__all__ = [
    "DatasetLike",
    "build_config",
    "check_reward_source",
    "check_reward_tokenizer",
    "multi_turn_setup",
    "records_of",
    "split_reward_funcs",
    "with_datasets",
    "with_model",
    "with_reward_model",
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
    # Algorithm distill reads no reward; a task's rule then only scores the held-out evaluation.
    if samples and algo.record.scores_responses and cfg.reward_fn is None and "reward" not in cfg.models:
        raise ConfigError(
            "algorithm.reward_fn",
            "null, and neither models.reward nor data.task gives a reward (Python: Trainer(reward_funcs=[fn]); "
            "multi-turn episodes scored by their environment alone: algorithm.reward_fn=environment)",
        )


def split_reward_funcs(
    reward_funcs: Any, reward_weights: Sequence[float] | None = None
) -> tuple[list[RewardFunc] | None, Any]:
    """``(functions, reward model)`` of ``reward_funcs`` given as TRL's ``GRPOTrainer`` takes it.

    A string or path is a reward model (a local directory or a Hub id), as is a model object
    (anything with ``save_pretrained``); anything else is a reward function.

    >>> split_reward_funcs("org/reward-model")
    (None, 'org/reward-model')

    Raises:
        ConfigError: more than one reward model, a reward model beside functions (rlflow scores
            a run's responses with one of the two), or weights other than ``[1]`` for a reward model.
    """
    if reward_funcs is None:
        return None, None
    single = callable(reward_funcs) or isinstance(reward_funcs, (str, os.PathLike))
    entries = [reward_funcs] if single or hasattr(reward_funcs, "save_pretrained") else list(reward_funcs)
    models = [e for e in entries if isinstance(e, (str, os.PathLike)) or hasattr(e, "save_pretrained")]
    funcs = [e for e in entries if not any(e is m for m in models)]
    if len(models) > 1:
        raise ConfigError("reward_funcs", f"{len(models)} reward models; rlflow scores a run with one")
    if models and funcs:
        raise ConfigError(
            "reward_funcs",
            f"a reward model ({_described(models[0])}) beside reward functions; rlflow scores a run with a "
            "reward model or with functions, not their sum: give one of the two",
        )
    if models and reward_weights is not None and [float(w) for w in reward_weights] != [1.0]:
        raise ConfigError("reward_weights", f"{list(reward_weights)} for a reward model, whose score is not weighted")
    return funcs or None, models[0] if models else None


def _described(model: Any) -> str:
    return repr(str(model)) if isinstance(model, (str, os.PathLike)) else type(model).__name__


def with_reward_model(cfg: RLFlowConfig, model: Any, run_dir: Path) -> RLFlowConfig:
    """``models.reward`` loaded from ``model``: a local directory, a Hub id or a model object.

    A Hub id resolves through ``huggingface_hub`` (its cache; ``HF_HUB_OFFLINE=1`` reads only the
    cache); an object is written to ``<run_dir>/models/reward_init``. The checkpoint is a
    one-label ``*ForSequenceClassification`` (TRL's reward models, scored on the text as TRL
    scores them) or ``*ForTokenClassification`` (rlflow's, scored on the rollout's tokens).

    Raises:
        ConfigError: ``models.reward`` is configured too; the id is neither a directory nor found
            on the Hub or in its cache; the checkpoint is no one-label classifier.
    """
    if model is None:
        return cfg
    if "reward" in cfg.models:
        raise ConfigError("reward_funcs", f"a reward model ({_described(model)}) and models.reward both; keep one")
    path = _reward_model_dir(model, run_dir)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    archs = config.architectures or []
    if not (is_sequence_classification(config) or any(a.endswith("ForTokenClassification") for a in archs)):
        raise ConfigError(
            "reward_funcs",
            f"{_described(model)} ({path}) holds {archs}; a reward model is a *ForSequenceClassification "
            "or *ForTokenClassification checkpoint",
        )
    if config.num_labels != 1:
        raise ConfigError("reward_funcs", f"{_described(model)} has {config.num_labels} labels; a reward model has one")
    return replace(cfg, models={**cfg.models, "reward": ModelConfig(init="path", path=path)})


def _reward_model_dir(model: Any, run_dir: Path) -> str:
    if hasattr(model, "save_pretrained"):
        path = run_dir / "models" / "reward_init"
        model.save_pretrained(path)  # every time: a reused run directory must not keep another model
        return str(path)
    return resolve_model_dir("reward_funcs", model)


def check_reward_tokenizer(cfg: RLFlowConfig, tokenizer_path: str) -> None:
    """An rlflow reward model (``*ForTokenClassification``) that carries a tokenizer must share the run's.

    Such a model scores the rollout's token ids; another vocabulary would read other tokens. A
    TRL reward model (``*ForSequenceClassification``) is scored on the text, tokenized again by
    its own tokenizer (:mod:`rlflow.workers.interfaces.reward`), and may have any.

    Raises:
        ConfigError: the reward model's tokenizer maps a token to another id than the run's.
    """
    reward = cfg.models.get("reward")
    if reward is None or reward.path is None or not any((Path(reward.path) / f).is_file() for f in _TOKENIZER_FILES):
        return
    if is_sequence_classification(AutoConfig.from_pretrained(reward.path, local_files_only=True)):
        return
    if load_tokenizer(reward.path).get_vocab() != load_tokenizer(tokenizer_path).get_vocab():
        raise ConfigError(
            "models.reward.path",
            f"the tokenizer of {reward.path} differs from the run's ({tokenizer_path}); this reward model "
            "(token classification) scores the policy's token ids, so both must share one tokenizer",
        )


def with_model(cfg: RLFlowConfig, model: Any, run_dir: Path) -> RLFlowConfig:
    """``models.actor`` loaded from ``model``: a local HF directory, a Hub id, or a model object saved into the run.

    A Hub id resolves to its snapshot in the HF cache (:func:`~rlflow.trainer.hub.resolve_model_dir`);
    a ``PreTrainedModel`` is written to ``<run_dir>/models/actor_init`` with ``save_pretrained``;
    the workers load it by path.

    Raises:
        ConfigError: ``model`` is neither a local directory nor a Hub id in reach.
    """
    if model is None:
        return cfg
    if isinstance(model, (str, os.PathLike)):
        path = resolve_model_dir("model", model)
    elif hasattr(model, "save_pretrained"):
        path = str(run_dir / "models" / "actor_init")
        model.save_pretrained(path)  # every time: a run directory reused with another model must not keep the old one
    else:
        raise TypeError(f"model={type(model).__name__}; expected a local HF directory, a Hub id or a PreTrainedModel")
    actor = cfg.models.get("actor")
    if actor is None:
        raise ConfigError("models.actor", f"missing, but model= was given; algorithm {cfg.algorithm.name!r}")
    models = {**cfg.models, "actor": replace(actor, init="path", path=path)}
    return replace(cfg, models=models)


def with_tokenizer(cfg: RLFlowConfig, tokenizer: Any, run_dir: Path) -> RLFlowConfig:
    """``data.tokenizer`` from ``tokenizer`` (a path, a Hub id, or an object saved into the run).

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
        path = resolve_model_dir("tokenizer", tokenizer)
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
            f"{name}={type(dataset).__name__}; expected a list of dicts, a datasets.Dataset or a data file's path"
        )
    rows = []
    for i, row in enumerate(dataset):
        if not isinstance(row, Mapping):
            raise TypeError(f"{name} row {i} is {type(row).__name__}; expected a dict of columns")
        rows.append(dict(row))
    if not rows:
        raise ValueError(f"{name} has no rows")
    return rows


def multi_turn_setup(cfg: RLFlowConfig, tools: Sequence[Any] | None, environment: Any) -> MultiTurnSetup | None:
    """The run's episodes: Python ``tools`` (a :class:`~rlflow.workers.environments.ToolEnvironments`
    timing calls out after ``rollout.multi_turn.tool_timeout_s``) or ``environment`` (a factory),
    else the import paths of ``rollout.multi_turn``; None when there are none.

    Raises:
        ConfigError: tools and an environment both (from Python, the config or both); a rollout
            engine without ``generate_episodes``; an algorithm that samples nothing; an import path that does not
            resolve or an environment missing ``reset``/``step`` (config).
        TypeError: a Python tool without type hints or docstring, or an environment missing a
            method (the message names the function or the class).
    """
    mt = cfg.rollout.multi_turn
    given = {"tools": bool(tools), "environment": environment is not None, "rollout.multi_turn": mt.enabled}
    if sum(given.values()) == 0:
        return None
    if sum(given.values()) > 1:
        named = [k for k, v in given.items() if v]
        raise ConfigError(named[0], f"{' and '.join(named)} both give the episodes; keep one")
    if cfg.rollout.engine not in list_episode_engines():
        raise ConfigError(
            "rollout.engine",
            f"{cfg.rollout.engine!r} runs no multi-turn episodes (no generate_episodes); engines that do: "
            f"{list_episode_engines()}",
        )
    if not cfg.algorithm.record.samples_responses:
        raise ConfigError("rollout.multi_turn", f"algorithm {cfg.algorithm.name!r} samples no rollouts")
    try:
        if tools or mt.tools:
            factory = ToolEnvironments(
                tools or mt.tools, mt.tool_timeout_s, mt.num_threads, tool_listing=mt.tool_listing
            )
            spec = pack_environment(factory)
        else:
            spec = pack_environment(environment if environment is not None else mt.environment)
    except (ValueError, TypeError) as err:
        if given["rollout.multi_turn"]:
            raise ConfigError("rollout.multi_turn." + ("tools" if mt.tools else "environment"), str(err)) from err
        raise
    return MultiTurnSetup(
        environment=spec,
        max_turns=mt.max_turns,
        max_total_tokens=mt.max_total_tokens,
        max_prompt_tokens=mt.max_prompt_tokens,
        num_threads=mt.num_threads,
        overlap=mt.overlap,
        stop_at_call=mt.stop_at_call,
    )
