"""The sandbox as a ``python`` tool: a program's output is the observation; a failure or an escape attempt
is a tool error the model reads, counted, while its episode goes on."""

from __future__ import annotations

import json

import torch
from tool_helpers import HERMES_TEMPLATE, chat_tokenizer

from rlflow.engine.rollout import SamplingParams
from rlflow.engine.rollout.multi_turn import MultiTurn, episode_metrics, run_episodes
from rlflow.sandbox import Limits
from rlflow.workers.environments import ToolEnvironments, pack_environment
from rlflow.workers.python_tool import make_python_tool
from tests.sandbox.sandbox_helpers import working_sandbox

LIMITS = Limits(wall_seconds=3.0, cpu_seconds=1, memory_bytes=256 << 20, processes=8, output_bytes=4096)


def _call(code: str) -> str:
    call = json.dumps({"name": "python", "arguments": {"code": code}})
    return f"<tool_call>\n{call}\n</tool_call>"


# What the episode "samples", turn by turn: a program, two escape attempts, then the answer.
TURNS = [
    _call("print(sum(i * i for i in range(10)))"),
    _call("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=1)"),
    _call("while True:\n    pass"),
    "The sum is 285.",
]


def test_the_python_tool_answers_with_the_output_and_reports_escapes_as_tool_errors_while_the_episode_goes_on():
    tool = make_python_tool(sandbox=working_sandbox(LIMITS))
    tok = chat_tokenizer(HERMES_TEMPLATE)
    eos = tok.eos_token_id
    episodes = pack_environment(ToolEnvironments([tool], timeout_s=10.0)).episodes(tok)
    calls = {"n": 0}

    def sample(ids, mask, params):  # a scripted policy writing TURNS
        turn = tok(TURNS[calls["n"]], add_special_tokens=False).input_ids + [eos]
        calls["n"] += 1
        out = torch.zeros((1, params.max_new_tokens), dtype=torch.long)
        out[0, : len(turn)] = torch.tensor(turn)
        return out, (out != 0).long(), torch.zeros(out.shape)

    multi = MultiTurn(episodes=episodes, max_turns=4, max_total_tokens=4000, max_prompt_tokens=4000)
    params = SamplingParams(max_new_tokens=200, stop_token_ids=(eos,))
    records, made = run_episodes(sample, [{"prompt": "Sum the squares below 10."}], params, multi)
    (record,) = records
    assert record.turns == 4  # every failure answered, the episode went on to its answer
    observation = tok.decode([i for i, s in zip(record.ids, record.sampled) if not s])
    first, second, third = observation.split("<tool_response>")[1:]
    assert first.startswith("\n285\n")
    assert "raised PythonToolError" in second and "exit code 1" in second and "OSError" in second
    assert "raised PythonToolError" in third and ("cpu limit" in third or "wall limit" in third)
    metrics = episode_metrics(records, made)
    assert (metrics["tools/calls"], metrics["tools/errors"], metrics["tools/timeouts"]) == (3.0, 2.0, 0.0)


def test_the_python_tool_by_import_path_is_a_documented_tool_that_pickles_to_the_workers():
    spec = pack_environment(ToolEnvironments(["rlflow.workers.python_tool:python"]))
    (tool,) = spec.load().runner.tools.values()  # rebuilt as a worker does
    assert tool.name == "python"
    assert tool.schema["function"]["parameters"]["required"] == ["code"]
    assert "sandbox" in tool.schema["function"]["description"]
    # pickled with its module's code too (a source tree that is not an installed package): the lazily
    # made sandbox travels as its settings
    from ray import cloudpickle

    import rlflow.workers.python_tool as module

    cloudpickle.register_pickle_by_value(module)
    try:
        copy = cloudpickle.loads(cloudpickle.dumps(make_python_tool(LIMITS)))
    finally:
        cloudpickle.unregister_pickle_by_value(module)
    assert copy.__name__ == "python" and copy.__closure__ is not None
