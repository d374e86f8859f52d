"""Python functions as tools (TRL's convention), the calls a model writes, and running them."""

from __future__ import annotations

import doctest
import pickle
import threading

import pytest
from tool_helpers import HERMES_TEMPLATE, chat_tokenizer, lookup, multiply

from rlflow.workers import environments, tool_render, tool_runner, tools
from rlflow.workers.tool_runner import ToolRunner, ToolStats
from rlflow.workers.tools import Tool, build_tools, parse_tool_calls


def no_hints(a, b):
    """Adds.

    Args:
        a: a number.
        b: another.
    """
    return a + b


def no_docstring(a: int) -> int:
    return a


def undocumented_arg(a: int, b: int) -> int:
    """Adds.

    Args:
        a: a number.
    """
    return a + b


def test_a_typed_documented_function_becomes_the_schema_the_chat_template_shows():
    tool = Tool.from_function(multiply)
    assert tool.name == "multiply"
    params = tool.schema["function"]["parameters"]
    assert params["properties"]["a"] == {"type": "integer", "description": "the first factor."}
    assert params["required"] == ["a", "b"]
    tok = chat_tokenizer(HERMES_TEMPLATE)
    text = tok.apply_chat_template([{"role": "user", "content": "3*4?"}], tools=[tool.schema], tokenize=False)
    assert '"name": "multiply"' in text and "Multiplies two integers." in text


@pytest.mark.parametrize("fn", [no_hints, no_docstring, undocumented_arg])
def test_a_tool_without_type_hints_or_docstring_is_refused_naming_it(fn):
    with pytest.raises(TypeError, match=f"tool '{fn.__name__}' cannot be described"):
        build_tools([multiply, fn])


def test_tools_need_distinct_names_and_at_least_one():
    with pytest.raises(ValueError, match="repeat"):
        build_tools([multiply, multiply])
    with pytest.raises(ValueError, match="empty"):
        build_tools([])


def test_several_calls_a_turn_in_either_format_in_the_order_written():
    tools = build_tools([multiply, lookup])
    text = (
        'Let me compute. <tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>'
        '<call>{"name": "lookup", "arguments": "{\\"key\\": \\"x\\"}"}</call>'
        '<tool_call>{"name": "multiply", "arguments": {"a": -1, "b": 0}}</tool_call>'
    )
    calls = parse_tool_calls(text, tools)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("multiply", {"a": 3, "b": 4}, None),
        ("lookup", {"key": "x"}, None),
        ("multiply", {"a": -1, "b": 0}, None),
    ]
    assert parse_tool_calls(text, tools, formats=("tag",))[0].name == "lookup"
    assert parse_tool_calls("no call here: 12", tools) == []


@pytest.mark.parametrize(
    "body, error",
    [
        ('{"name": "multiply", "arguments": {"a": 3, "b": 4}', "not valid JSON"),
        ('["multiply"]', 'a call is a JSON object {"name"'),
        (
            '{"name": "divide", "arguments": {"a": 3}}',
            "there is no tool 'divide'; the tools are ['lookup', 'multiply']",
        ),
        ('{"name": "multiply", "arguments": {"a": 3}}', "missing argument(s) ['b']"),
        (
            '{"name": "multiply", "arguments": {"a": "3", "b": true}}',
            "argument 'a' of tool 'multiply' is '3', not integer",
        ),
        ('{"name": "multiply", "arguments": {"a": 3, "b": 4, "c": 5}}', "cannot take these arguments"),
        ('{"name": "multiply", "arguments": [3, 4]}', "must be a JSON object"),
    ],
)
def test_a_malformed_call_says_what_is_wrong(body, error):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>", build_tools([multiply, lookup]))
    assert call.error is not None and call.arguments == {}
    assert error in call.error


def test_a_call_cut_off_by_the_token_budget_is_malformed():
    (call,) = parse_tool_calls('<tool_call>{"name": "multiply", "argu', build_tools([multiply]))
    assert call.error == "<tool_call> is never closed by </tool_call>"


def test_calls_of_a_turn_run_concurrently():
    barrier = threading.Barrier(3, timeout=10)  # passes only when all three calls are running at once

    def meet(tag: str) -> str:
        """Waits for the other calls.

        Args:
            tag: returned.
        """
        barrier.wait()
        return tag

    runner = ToolRunner(build_tools([meet]), timeout_s=20, max_workers=3)
    text = "".join(f'<tool_call>{{"name": "meet", "arguments": {{"tag": "{t}"}}}}</tool_call>' for t in "xyz")
    results = runner.run(parse_tool_calls(text, runner.tools))
    assert [(r.content, r.status) for r in results] == [("x", "ok"), ("y", "ok"), ("z", "ok")]
    runner.close()


def test_what_goes_wrong_in_a_tool_becomes_an_observation_and_is_counted():
    release = threading.Event()

    def boom(x: int) -> int:
        """Raises.

        Args:
            x: ignored.
        """
        raise ZeroDivisionError("division by zero")

    def opaque(x: int) -> object:
        """Returns what JSON cannot hold.

        Args:
            x: ignored.
        """
        return {x, x + 1}

    def slow(x: int) -> int:
        """Outlives its time limit.

        Args:
            x: returned.
        """
        release.wait(10)
        return x

    runner = ToolRunner(build_tools([boom, opaque, slow, lookup, multiply]), timeout_s=0.2)
    names = ["boom", "opaque", "slow", "lookup", "multiply"]
    args = ['{"x": 1}', '{"x": 1}', '{"x": 1}', '{"key": "k"}', '{"a": 2}']
    text = "".join(f'<tool_call>{{"name": "{n}", "arguments": {a}}}</tool_call>' for n, a in zip(names, args))
    results = runner.run(parse_tool_calls(text, runner.tools))
    release.set()
    assert [r.status for r in results] == ["error", "error", "timeout", "ok", "malformed"]
    assert results[0].content == "Error: tool 'boom' raised ZeroDivisionError: division by zero"
    assert results[1].content == "Error: the tool returned a set, which is neither a string nor a JSON value"
    assert results[2].content == "Error: tool 'slow' did not finish within 0.2 seconds"
    assert results[3].content == '{"key": "k", "found": [1, 2]}'  # a JSON value, as JSON
    assert results[4].content.startswith("Error: missing argument(s) ['b']")
    stats = ToolStats()
    stats.add(results)
    assert (stats.calls, stats.errors, stats.timeouts, stats.malformed) == (5, 2, 1, 1)
    assert stats.seconds >= 0.2 and stats.metrics()["tools/timeouts"] == 1.0
    runner.close()


def test_a_hung_tool_does_not_starve_the_calls_after_it():
    release = threading.Event()

    def hang(x: int) -> int:
        """Never returns in time.

        Args:
            x: returned.
        """
        release.wait(10)
        return x

    runner = ToolRunner(build_tools([hang, multiply]), timeout_s=0.2, max_workers=1)  # one thread, held by hang
    (hung,) = runner.run(parse_tool_calls('<call>{"name": "hang", "arguments": {"x": 1}}</call>', runner.tools))
    (done,) = runner.run(
        parse_tool_calls('<call>{"name": "multiply", "arguments": {"a": 2, "b": 5}}</call>', runner.tools)
    )
    release.set()
    assert (hung.status, done.status, done.content, runner.num_retired_pools) == ("timeout", "ok", "10", 1)
    runner.close()


def test_a_runner_pickles_without_its_threads_and_runs_on_arrival():
    runner = ToolRunner(build_tools([multiply]), timeout_s=5)
    runner.run(parse_tool_calls('<call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</call>', runner.tools))
    copy = pickle.loads(pickle.dumps(runner))
    assert copy._pool is None and runner._pool is not None
    (result,) = copy.run(
        parse_tool_calls('<call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</call>', copy.tools)
    )
    assert (result.content, result.status) == ("42", "ok")
    runner.close()
    copy.close()


def test_runner_arguments_are_checked():
    with pytest.raises(ValueError, match="timeout_s=0"):
        ToolRunner(build_tools([multiply]), timeout_s=0)
    with pytest.raises(ValueError, match="max_workers=0"):
        ToolRunner(build_tools([multiply]), max_workers=0)


@pytest.mark.parametrize("module", [tools, tool_runner, environments, tool_render], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
