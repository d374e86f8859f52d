"""Environments for multi-step episodes (gymnasium / OpenEnv-like), and tools wrapped as one.

An environment is one episode's state behind two methods::

    class Guess:
        def reset(self, row: dict) -> str | list[dict]:  # the first observation: the prompt
            self.target = row["answer"]
            return row["prompt"]

        def step(self, text: str) -> Step:  # the model's turn -> (observation, reward, done)
            return Step("", float(text.strip() == self.target), True)

An observation is text appended as it is, or chat messages the tokenizer's template renders
(:func:`~rlflow.workers.tool_render.render_observation`). A run makes one environment per
episode by calling a *factory*: the class itself, or any callable taking no argument
(:class:`ToolEnvironments` for tools). The factory reaches the workers pickled by value
(:func:`pack_environment`), as reward functions do; from YAML it is named by an import path
``module:name`` (:func:`import_object`). A factory's optional ``stop_strings`` (text such as a
closing tag) end a turn besides the end-of-turn token; :class:`ToolEnvironments` lists its calls'
closing tags. :class:`TokenEpisode` drives an environment in token ids, as a rollout loop does.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from ray import cloudpickle  # vendored by Ray, as reward_funcs uses it
from transformers import PreTrainedTokenizerBase

from rlflow.engine.rollout.multi_turn import MultiTurn
from rlflow.workers.reward_funcs import dumps_by_value
from rlflow.workers.tool_render import (
    TOOL_LISTINGS,
    call_format,
    render_observation,
    render_prompt,
    stop_sequences,
    tool_messages,
)
from rlflow.workers.tool_runner import ToolRunner, ToolStats
from rlflow.workers.tools import CALL_FORMATS, Tool, build_tools, parse_tool_calls

__all__ = [
    "Environment",
    "EnvironmentSpec",
    "MultiTurnSetup",
    "Step",
    "TokenEpisode",
    "TokenStep",
    "ToolEnvironment",
    "ToolEnvironments",
    "check_environment",
    "import_object",
    "pack_environment",
    "trace_example",
]

Observation = str | list[dict[str, Any]]
# Each method and the arguments it is called with (besides self).
_METHODS = {"reset": ("row",), "step": ("text",)}


class Step(NamedTuple):
    """What :meth:`Environment.step` returns: ``(observation, reward, done)``."""

    observation: Observation
    reward: float
    done: bool


class Environment(Protocol):
    """One episode's state. ``metrics() -> dict[str, float]`` is optional (per-episode counts)."""

    def reset(self, row: Mapping[str, Any]) -> Observation: ...

    def step(self, text: str) -> Step: ...


def check_environment(factory: Callable[[], Any]) -> None:
    """Refuses a factory whose environments lack ``reset(row)`` or ``step(text)``.

    A class is checked as it is; another callable is called once and its environment checked.

    Raises:
        TypeError: ``factory`` is not callable, or a method is missing, not callable or does not
            take its argument; the message names the class and the method.
    """
    if not callable(factory):
        raise TypeError(f"environment {factory!r} is neither a class nor a factory of environments")
    cls = factory if isinstance(factory, type) else type(factory())
    for method, args in _METHODS.items():
        fn = getattr(cls, method, None)
        if not callable(fn):
            raise TypeError(
                f"environment class {cls.__qualname__!r} has no method {method!r}; an environment needs "
                f"reset(row) -> observation and step(text) -> (observation, reward, done)"
            )
        try:
            inspect.signature(fn).bind(None, *args)  # self and the arguments the rollout passes
        except TypeError as err:
            raise TypeError(f"environment class {cls.__qualname__!r}: {method}{args} cannot be called: {err}") from err


class ToolEnvironment:
    """An episode of tool use: each turn's calls run, their results are the next observation; a turn
    without a call ends the episode. Rewards are 0: the reward functions score the final answer.

    Args:
        runner: runs the calls (shared by the episodes of one factory).
        formats: the call formats read (:data:`~rlflow.workers.tools.CALL_FORMATS`).
        tool_listing: how the ``tag`` format's prompt lists the tools
            (:data:`~rlflow.workers.tool_render.TOOL_LISTINGS`).
    """

    def __init__(
        self, runner: ToolRunner, formats: Sequence[str] = tuple(CALL_FORMATS), tool_listing: str = "schema"
    ) -> None:
        self.runner, self.formats, self.stats = runner, tuple(formats), ToolStats()
        self.tool_listing = tool_listing

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools' JSON schemas, for ``apply_chat_template(tools=...)``."""
        return [t.schema for t in self.runner.tools.values()]

    def reset(self, row: Mapping[str, Any]) -> Observation:
        if "prompt" not in row:
            raise KeyError(f"a tool episode starts from a row's 'prompt'; the row has {sorted(row)}")
        self.stats = ToolStats()
        return row["prompt"]

    def step(self, text: str) -> Step:
        calls = parse_tool_calls(text, self.runner.tools, self.formats)
        if not calls:
            return Step([], 0.0, True)
        results = self.runner.run(calls)
        self.stats.add(results)
        return Step(tool_messages(results), 0.0, False)

    def metrics(self) -> dict[str, float]:
        return self.stats.metrics()


class ToolEnvironments:
    """The factory of :class:`ToolEnvironment` episodes over ``tools``, which share one thread pool.

    Args:
        tools: typed, documented functions (or :class:`~rlflow.workers.tools.Tool`) or their
            import paths ``module:function``.
        timeout_s: seconds a call may take.
        max_workers: threads running calls at once, over all episodes of a process.
        formats: the call formats read; both by default.
        tool_listing: how the ``tag`` format's prompt lists the tools: ``schema`` (their JSON
            schemas), ``signature`` (one line each) or ``none``
            (:data:`~rlflow.workers.tool_render.TOOL_LISTINGS`).

    Raises:
        ValueError: ``tool_listing`` is none of those.
    """

    def __init__(
        self,
        tools: Sequence[Callable[..., Any] | Tool | str],
        timeout_s: float = 30.0,
        max_workers: int = 8,
        formats: Sequence[str] = tuple(CALL_FORMATS),
        tool_listing: str = "schema",
    ) -> None:
        if tool_listing not in TOOL_LISTINGS:
            raise ValueError(f"ToolEnvironments: tool_listing={tool_listing!r}; expected one of {list(TOOL_LISTINGS)}")
        resolved = [import_object(t) if isinstance(t, str) else t for t in tools]
        self.runner = ToolRunner(build_tools(resolved), timeout_s, max_workers)
        self.formats, self.tool_listing = tuple(formats), tool_listing

    def __call__(self) -> ToolEnvironment:
        return ToolEnvironment(self.runner, self.formats, self.tool_listing)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The closing tags of the formats read: a turn ends once it has written a call."""
        return tuple(CALL_FORMATS[f][1] for f in self.formats)


@dataclass(frozen=True)
class EnvironmentSpec:
    """An environment factory pickled by value, for workers that cannot import its module.

    Attributes:
        name: the factory's name (a class name, or ``ToolEnvironments``).
        payload: ``cloudpickle`` of the factory, the code of its module (and its tools') included.
        stop_strings: text a turn may end on besides the end-of-turn token, from the factory's
            ``stop_strings`` (a :class:`ToolEnvironments`: its calls' closing tags).
    """

    name: str
    payload: bytes
    stop_strings: tuple[str, ...] = ()

    def load(self) -> Callable[[], Any]:
        """The factory, rebuilt from its pickled code (no import of its module needed)."""
        return cloudpickle.loads(self.payload)

    def episodes(
        self,
        tokenizer: PreTrainedTokenizerBase,
        stop_token_ids: Sequence[int] | None = None,
        stop_strings: Sequence[str] = (),
    ) -> Callable[[], TokenEpisode]:
        """A maker of :class:`TokenEpisode` s, each over a new environment: what a rollout loop takes."""
        factory = self.load()  # once: the episodes of a ToolEnvironments share its thread pool
        return lambda: TokenEpisode(factory(), tokenizer, stop_token_ids, stop_strings)

    def __repr__(self) -> str:
        return f"EnvironmentSpec({self.name!r})"


@dataclass(frozen=True, kw_only=True)
class MultiTurnSetup:
    """What the workers need to roll out episodes of an environment (``rollout.multi_turn``).

    Attributes:
        environment: the environment factory, by value.
        max_turns: sampled turns per episode at most.
        max_total_tokens: response tokens per episode (sampled + observation).
        max_prompt_tokens: prompt tokens an episode may start from (its first observation rendered).
        num_threads: episodes stepping at once on a worker.
        overlap: episodes whose step answered go on without waiting for the turn's slower steps.
        stop_at_call: a turn also ends on the environment's ``stop_strings`` (a tool call's closing
            tag), sampled as :func:`~rlflow.workers.tool_render.stop_sequences` lists them.
    """

    environment: EnvironmentSpec
    max_turns: int
    max_total_tokens: int
    max_prompt_tokens: int
    num_threads: int = 8
    overlap: bool = False
    stop_at_call: bool = True

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """What a turn ends on besides its end-of-turn token."""
        return self.environment.stop_strings if self.stop_at_call else ()

    def episodes(
        self, tokenizer: PreTrainedTokenizerBase, stop_token_ids: Sequence[int] | None = None
    ) -> Callable[[], TokenEpisode]:
        """A maker of the episodes (:meth:`EnvironmentSpec.episodes`), which know the turns' stop strings."""
        return self.environment.episodes(tokenizer, stop_token_ids, self.stop_strings)

    def build(self, tokenizer: PreTrainedTokenizerBase, stop_token_ids: Sequence[int] | None = None) -> MultiTurn:
        """The rollout engine's :class:`~rlflow.engine.rollout.multi_turn.MultiTurn` over this environment."""
        return MultiTurn(
            episodes=self.episodes(tokenizer, stop_token_ids),
            max_turns=self.max_turns,
            max_total_tokens=self.max_total_tokens,
            max_prompt_tokens=self.max_prompt_tokens,
            num_threads=self.num_threads,
            overlap=self.overlap,
            stop_sequences=stop_sequences(tokenizer, self.stop_strings),
        )


def pack_environment(factory: Callable[[], Any] | str) -> EnvironmentSpec:
    """Checks ``factory`` (:func:`check_environment`) and pickles it by value; a string is an import path.

    Raises:
        TypeError: the environment is refused (:func:`check_environment`), or the factory's
            ``stop_strings`` is not a sequence of non-empty strings.
    """
    if isinstance(factory, str):
        factory = import_object(factory)
    check_environment(factory)
    stops = getattr(factory, "stop_strings", ())
    if isinstance(stops, str) or not all(isinstance(t, str) and t for t in stops):
        raise TypeError(f"environment {factory!r}: stop_strings={stops!r} must be a sequence of non-empty strings")
    code = [factory if isinstance(factory, type) or inspect.isfunction(factory) else type(factory)]
    if isinstance(factory, ToolEnvironments):
        code += [t.fn for t in factory.runner.tools.values()]
    name = getattr(factory, "__name__", type(factory).__name__)
    return EnvironmentSpec(name, dumps_by_value(factory, code), tuple(stops))


def import_object(path: str) -> Any:
    """The object an import path ``package.module:name`` (``name`` may be dotted) names.

    >>> import_object("fractions:Fraction.from_float")(0.5)
    Fraction(1, 2)

    Raises:
        ValueError: the path lacks ``:``, its module does not import, or it has no such name;
            the message names the path.
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"import path {path!r} is not of the form 'module:name' (e.g. 'my_tools:multiply')")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"import path {path!r}: module {module_name!r} does not import ({err})") from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"import path {path!r}: {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    return obj


class TokenStep(NamedTuple):
    """What :meth:`TokenEpisode.step` returns: the observation's token ids, the reward, and whether the episode ended."""

    ids: list[int]
    reward: float
    done: bool


class TokenEpisode:
    """One episode in token ids: what a multi-turn rollout loop drives, token in, token out.

    The loop samples a turn, hands its ids to :meth:`step` and appends the returned observation
    ids (never re-encoding what was sampled), until ``done``, a turn limit or a token budget.

    Args:
        env: the episode's environment (made by the factory).
        tokenizer: the policy's tokenizer.
        stop_token_ids: tokens a turn may end on that the template also writes after a turn (its
            end-of-turn token): not written again in the observation. Default: the EOS token.
        stop_strings: text a turn may also end on (a tool call's closing tag); the observation after
            such a turn starts with what the template writes after the turn (its end-of-turn token).
    """

    def __init__(
        self,
        env: Environment,
        tokenizer: PreTrainedTokenizerBase,
        stop_token_ids: Sequence[int] | None = None,
        stop_strings: Sequence[str] = (),
    ) -> None:
        self.env, self.tokenizer = env, tokenizer
        self.stop_token_ids = set(stop_token_ids if stop_token_ids is not None else [tokenizer.eos_token_id])
        self.stop_strings = tuple(stop_strings)
        self.format = call_format(tokenizer)

    def reset(self, row: Mapping[str, Any]) -> list[int]:
        """The prompt's ids: the first observation, offering the environment's tools if it has any."""
        first = self.env.reset(row)
        schemas = getattr(self.env, "tool_schemas", None)
        templated = self.tokenizer.chat_template is not None and (bool(schemas) or not isinstance(first, str))
        if schemas:
            listing = getattr(self.env, "tool_listing", "schema")
            text = render_prompt(self.tokenizer, first, schemas, self.format, listing)
        elif templated:
            text = self.tokenizer.apply_chat_template(first, add_generation_prompt=True, tokenize=False)
        else:
            text = first if isinstance(first, str) else "\n".join(m["content"] for m in first)
        # A template writes its own special tokens; plain text gets the tokenizer's (its BOS).
        return self.tokenizer(text, add_special_tokens=not templated).input_ids

    def step(self, ids: Sequence[int]) -> TokenStep:
        """The environment's answer to a sampled turn ``ids`` (its stop token included, if it ended on one).

        Returns:
            The observation's ids to append after ``ids`` (empty when the environment answers
            nothing, as a :class:`ToolEnvironment` at the end); the step's reward; ``done``.
        """
        ids = list(ids)
        stopped = bool(ids) and ids[-1] in self.stop_token_ids
        # The environment reads the turn without its stop token; other special tokens stay (a
        # template's <tool_call> may be one).
        answer = self.env.step(self.tokenizer.decode(ids[:-1] if stopped else ids))
        if not isinstance(answer, tuple) or len(answer) != 3:
            raise TypeError(
                f"environment class {type(self.env).__qualname__!r}: step returned {answer!r}; "
                "expected (observation, reward, done)"
            )
        observation, reward, done = answer
        if isinstance(observation, list):
            stop = self.tokenizer.decode(ids[-1:]) if stopped else ""
            observation = render_observation(self.tokenizer, observation, stop) if observation else ""
        obs_ids = self.tokenizer(observation, add_special_tokens=False).input_ids if observation else []
        return TokenStep(obs_ids, float(reward), bool(done))

    def metrics(self) -> dict[str, float]:
        """The environment's per-episode counts (``tools/calls`` ...); empty when it keeps none."""
        metrics = getattr(self.env, "metrics", None)
        return dict(metrics()) if callable(metrics) else {}


def trace_example(episode: TokenEpisode, row: Mapping[str, Any], turns: Sequence[str]) -> tuple[list[int], list[int]]:
    """A supervised example of an episode in which the policy writes ``turns``: ``(ids, loss_mask)``.

    The ids are what a multi-turn rollout of the same turns keeps — the prompt (``reset(row)``),
    each turn's ids closed by the stop token (a turn that ends on one of the episode's
    ``stop_strings``, a call's closing tag, ends there), and the observation ``step`` returns after
    it (the tools really run) — and the loss covers the turns only. An SFT warm-up on such traces teaches
    the tool-call format with the tokens the rollouts will see.

    Raises:
        ValueError: the episode ends before its last turn, or ``turns`` is empty.
    """
    if not turns:
        raise ValueError("trace_example: no turns to write")
    eos = episode.tokenizer.eos_token_id
    stop = eos if eos in episode.stop_token_ids else min(episode.stop_token_ids)
    ids = list(episode.reset(row))
    mask = [0] * len(ids)
    for i, text in enumerate(turns):
        sampled = episode.tokenizer(text, add_special_tokens=False).input_ids
        if not any(text.endswith(s) for s in episode.stop_strings):
            sampled.append(stop)
        ids, mask = ids + sampled, mask + [1] * len(sampled)
        observation, _, done = episode.step(sampled)
        if done and i + 1 < len(turns):
            raise ValueError(f"trace_example: the episode ended after turn {i} of {len(turns)} ({text!r})")
        if i + 1 < len(turns):
            ids, mask = ids + list(observation), mask + [0] * len(observation)
    return ids, mask
