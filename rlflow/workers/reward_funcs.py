"""Reward functions in TRL's convention, shipped to the workers by value.

A reward function scores a batch of completions::

    def reward(prompts: list[str], completions: list[str], **kwargs) -> list[float | None]: ...

``prompts`` are the dataset's prompts (repeated for each sample of a prompt), ``completions``
the decoded responses, and every other dataset column arrives as a keyword holding one value
per completion. As in TRL's ``GRPOTrainer``, two more keywords come from the trainer:
``completion_ids`` (each completion's token ids, its stop token included, no padding) and
``trainer_state`` (a ``transformers.TrainerState`` with ``global_step``, the training step the
call belongs to, and ``max_steps``). A conversational row, whose ``prompt`` is a list of chat
messages, gets that list as its prompt and ``[{"role": "assistant", "content": text}]`` as its
completion (a trailing assistant message of the prompt is taken out of it and prefixed to the
text, as TRL does). A function without ``**kwargs`` receives only the keywords it names. It
returns one float per completion, or ``None`` where it does not apply (a format
reward on a row it cannot judge): ``None`` counts as NaN, left out of the weighted sum and of
that function's mean, as in TRL. A completion every function skipped gets reward 0.

Several functions are summed, each times its weight (default 1). The driver pickles the
functions *by value* (:func:`pack_reward_funcs`), so a function defined in ``__main__``, a
notebook or a test module runs on Ray workers that cannot import its module: nothing is
registered, no worker hook or ``PYTHONPATH`` is needed. The named per-sample rewards of
:mod:`rlflow.workers.rewards` (``algorithm.reward_fn: numeric_match``) are the other way to
score completions.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import math
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from ray import cloudpickle  # vendored by Ray, which ships these functions to the workers anyway

from rlflow.workers.reward_errors import RewardErrors

__all__ = [
    "RewardFuncs",
    "as_conversation",
    "check_reward_signature",
    "dumps_by_value",
    "pack_reward_funcs",
    "required_columns",
    "score_completions",
    "trainer_state",
]

RewardFunc = Callable[..., Sequence[float | None]]
# Keywords every function takes (TRL's convention), and all those the trainer fills itself: never dataset
# columns (a column of one of these names is not passed).
_REQUIRED = ("prompts", "completions")
_FIXED = (*_REQUIRED, "completion_ids", "trainer_state")


@dataclass(frozen=True)
class RewardFuncs:
    """Reward functions pickled by value, with their names and weights.

    Attributes:
        names: each function's name (its ``__name__``); metrics are ``rewards/<name>``.
        weights: each function's weight in the summed reward.
        payload: ``cloudpickle`` of the list of functions, their code included.
        max_steps: the run's training steps (``trainer_state.max_steps``); None: unknown.
    """

    names: tuple[str, ...]
    weights: tuple[float, ...]
    payload: bytes
    max_steps: int | None = None

    def __post_init__(self) -> None:
        if len(self.names) != len(self.weights) or not self.names:
            raise ValueError(f"RewardFuncs: {len(self.names)} names and {len(self.weights)} weights; need >= 1 each")

    def load(self) -> list[RewardFunc]:
        """The functions, rebuilt from their pickled code (no import of their module needed)."""
        return cloudpickle.loads(self.payload)

    def __repr__(self) -> str:  # the payload is bytes nobody wants to read in an error message
        return f"RewardFuncs({list(self.names)}, weights={list(self.weights)})"


def reward_name(fn: Callable) -> str:
    """A function's ``__name__``; a callable object's class name."""
    return getattr(fn, "__name__", type(fn).__name__)


def pack_reward_funcs(
    funcs: Sequence[RewardFunc], weights: Sequence[float] | None = None, max_steps: int | None = None
) -> RewardFuncs:
    """Pickles ``funcs`` by value for workers that cannot import their modules.

    A function's module is pickled by value unless it belongs to an installed distribution
    (which every worker of the same environment imports by name); ``__main__`` is pickled by
    value by cloudpickle already.

    Args:
        funcs: the reward functions.
        weights: one weight per function (default 1 each).
        max_steps: the run's training steps, handed to the functions as ``trainer_state.max_steps``.

    Raises:
        ValueError: no function, a weight count that differs from the function count, or two
            functions of the same name (their metrics would collide).
        TypeError: an entry is not callable.
    """
    funcs = list(funcs)
    if not funcs:
        raise ValueError("reward_funcs is empty; give at least one function")
    for fn in funcs:
        if not callable(fn):
            raise TypeError(f"reward_funcs holds {fn!r}, which is not callable")
    names = tuple(reward_name(fn) for fn in funcs)
    if len(set(names)) != len(names):
        raise ValueError(f"reward function names {list(names)} repeat; metrics rewards/<name> need distinct names")
    weights = tuple(float(w) for w in (weights if weights is not None else [1.0] * len(funcs)))
    if len(weights) != len(funcs):
        raise ValueError(f"reward_weights has {len(weights)} values for {len(funcs)} reward functions")
    return RewardFuncs(names, weights, dumps_by_value(funcs, funcs), max_steps)


def dumps_by_value(obj: Any, code_of: Sequence[Any]) -> bytes:
    """``cloudpickle`` of ``obj``, the modules of ``code_of`` (functions, classes) pickled by value.

    A module is pickled by value unless it belongs to an installed distribution (which every
    worker of the same environment imports by name); ``__main__`` is pickled by value by
    cloudpickle already.
    """
    modules = {sys.modules.get(getattr(o, "__module__", None) or "") for o in code_of} - {None}
    by_value = [m for m in modules if m.__name__ != "__main__" and not _installed(m.__name__)]
    for module in by_value:
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(obj)
    finally:
        for module in by_value:
            cloudpickle.unregister_pickle_by_value(module)


def _installed(module_name: str) -> bool:
    """Whether the module's top-level package comes from an installed distribution (not a local file)."""
    top = module_name.partition(".")[0]
    return top in sys.stdlib_module_names or bool(importlib.metadata.packages_distributions().get(top))


def check_reward_signature(fn: RewardFunc, columns: Collection[str]) -> None:
    """Checks that ``fn`` can be called as the trainer calls it, with the dataset's ``columns``.

    The trainer passes ``prompts=``, ``completions=`` and, by keyword, ``completion_ids``,
    ``trainer_state`` and every column (all of them when ``fn`` takes ``**kwargs``, else those it names).

    Raises:
        TypeError: ``fn`` takes neither ``prompts``/``completions`` nor ``**kwargs``, or a
            positional-only parameter.
        ValueError: a required parameter names no column of the dataset (the message lists the columns).
    """
    name = reward_name(fn)
    params = inspect.signature(fn).parameters.values()
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    named = {
        p.name: p for p in params if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    }
    for p in named.values():
        if p.kind is inspect.Parameter.POSITIONAL_ONLY:
            raise TypeError(f"reward function {name!r}: parameter {p.name!r} is positional-only; rewards get keywords")
    missing_fixed = [k for k in _REQUIRED if k not in named and not takes_kwargs]
    if missing_fixed:
        raise TypeError(
            f"reward function {name!r} must accept {missing_fixed} (TRL's convention: "
            "fn(prompts, completions, **kwargs) -> list[float])"
        )
    unknown = [
        p.name for p in named.values() if p.name not in _FIXED and p.name not in columns and p.default is p.empty
    ]
    if unknown:
        raise ValueError(
            f"reward function {name!r} needs column(s) {unknown} that the dataset lacks; "
            f"its columns are {sorted(columns)}"
        )


def score_completions(
    funcs: RewardFuncs,
    prompts: Sequence[Any],
    completions: Sequence[Any],
    columns: Mapping[str, Sequence[Any]],
    errors: RewardErrors | None = None,
    uids: Sequence[Any] | None = None,
    *,
    completion_ids: Sequence[list[int]] | None = None,
    step: int = 0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The weighted sum of every function's rewards, and each function's mean.

    A function that raises is called again one completion at a time, so that the failure is
    put on the samples that cause it; ``errors`` decides what those score (default: the error
    propagates, naming the function, the sample and its prompt).

    Args:
        funcs: the packed functions.
        prompts: ``B`` prompts (strings, or message lists: :func:`as_conversation`).
        completions: ``B`` completions (decoded strings, or assistant message lists).
        columns: dataset column -> ``B`` values (``prompt`` excluded).
        errors: the reward-error policy of the call.
        uids: ``B`` prompt ids named in errors.
        completion_ids: ``B`` lists of completion token ids (keyword ``completion_ids``); None: not passed.
        step: the training step of the call (``trainer_state.global_step``).

    Returns:
        ``(B,)`` float32 rewards, and ``{"rewards/<name>": mean}`` over the values that are not
        ``None`` (NaN when a function skipped every completion).

    Raises:
        ValueError: a function returned a number of values other than ``B``; names the function.
    """
    n, errors = len(completions), errors or RewardErrors("raise")
    per_sample = {k: v for k, v in columns.items() if k not in _FIXED}
    if completion_ids is not None:
        per_sample["completion_ids"] = completion_ids
    state = {"trainer_state": trainer_state(step, funcs.max_steps)}
    scores = np.full((len(funcs.names), n), np.nan, dtype=np.float64)
    for i, (fn, name) in enumerate(zip(funcs.load(), funcs.names)):
        kwargs, shared = _kwargs_for(fn, per_sample), _kwargs_for(fn, state)
        try:
            values = _call(fn, name, list(prompts), list(completions), {**kwargs, **shared})
        except _WrongCount:
            raise
        except Exception:  # find the samples it fails on: each scores by the policy
            values = [
                _score_one(fn, name, j, prompts, completions, kwargs, shared, errors, None if uids is None else uids[j])
                for j in range(n)
            ]
        scores[i] = [np.nan if v is None else float(v) for v in values]
    weighted = np.asarray(funcs.weights)[:, None] * scores
    total = np.nansum(weighted, axis=0)  # all-None completions: 0
    means = {f"rewards/{name}": _nan_mean(row) for name, row in zip(funcs.names, scores)}
    return torch.tensor(total, dtype=torch.float32), means


class _WrongCount(ValueError):
    """A function returned another number of values than completions: its contract, not a sample, is wrong."""


def _call(fn: RewardFunc, name: str, prompts: list, completions: list, kwargs: Mapping[str, list]) -> list:
    values = list(fn(prompts=prompts, completions=completions, **kwargs))
    if len(values) != len(completions):
        raise _WrongCount(f"reward function {name!r} returned {len(values)} values for {len(completions)} completions")
    return values


def _score_one(
    fn: RewardFunc,
    name: str,
    j: int,
    prompts: Sequence[str],
    completions: Sequence[str],
    kwargs: Mapping[str, list],
    shared: Mapping[str, Any],
    errors: RewardErrors,
    uid: Any,
) -> float | None:
    """Completion ``j`` scored alone (``kwargs`` per sample, ``shared`` as they are); the policy's
    value when ``fn`` raises on it."""
    try:
        (value,) = _call(fn, name, [prompts[j]], [completions[j]], {**{k: [v[j]] for k, v in kwargs.items()}, **shared})
        return value
    except _WrongCount:
        raise
    except Exception as err:
        value = errors.value(name, j, prompts[j], err, uid)
        return None if math.isnan(value) else value


def required_columns(fn: RewardFunc) -> tuple[str, ...]:
    """The dataset columns ``fn`` names without a default (``prompts``/``completions`` aside): every
    row must hold them. A function that takes ``**kwargs`` may read any column; only the named
    ones are required.

    >>> def accuracy(prompts, completions, solution, lang="en", **kwargs): ...
    >>> required_columns(accuracy)
    ('solution',)
    """
    params = inspect.signature(fn).parameters.values()
    named = (p for p in params if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL))
    return tuple(p.name for p in named if p.name not in _FIXED and p.default is p.empty)


def _kwargs_for(fn: RewardFunc, values: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``values`` ``fn`` takes: all with ``**kwargs``, else those it names (sequences as lists)."""
    params = inspect.signature(fn).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return {
        k: list(v) if isinstance(v, (list, tuple, np.ndarray)) else v
        for k, v in values.items()
        if takes_all or k in params
    }


def trainer_state(step: int, max_steps: int | None) -> Any:
    """The ``trainer_state`` keyword: a ``transformers.TrainerState`` at training step ``step``.

    >>> trainer_state(3, 10).global_step, trainer_state(3, 10).max_steps
    (3, 10)
    """
    from transformers import TrainerState  # HF's trainer utilities: on first use (see callbacks)

    return TrainerState(global_step=step, max_steps=max_steps if max_steps is not None else 0)


def as_conversation(prompt: list[Mapping[str, Any]], text: str) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """A conversational row's ``(prompt, completion)`` as TRL's ``GRPOTrainer`` hands them to reward functions.

    The completion is one assistant message; a prompt ending in an assistant message (a prefix
    the model continued) loses that message, whose content starts the completion.

    >>> as_conversation([{"role": "user", "content": "Hi"}], "Hello")
    ([{'role': 'user', 'content': 'Hi'}], [{'role': 'assistant', 'content': 'Hello'}])
    >>> as_conversation([{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "It is "}], "4")
    ([{'role': 'user', 'content': '2+2='}], [{'role': 'assistant', 'content': 'It is 4'}])
    """
    messages = [dict(m) for m in prompt]  # the row's own list stays as it is
    prefix = messages.pop()["content"] if messages and messages[-1]["role"] == "assistant" else ""
    return messages, [{"role": "assistant", "content": prefix + text}]


def _nan_mean(values: np.ndarray) -> float:
    valid = values[~np.isnan(values)]
    return float(valid.mean()) if len(valid) else float("nan")
