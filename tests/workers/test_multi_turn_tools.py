"""Tool episodes through the multi-turn loop: token in, token out with a real template, and tools that
raise or time out answered as observations while the batch goes on."""

from __future__ import annotations

import time

import pytest
import torch
from tool_helpers import HERMES_TEMPLATE, chat_tokenizer, multiply

from rlflow.engine.rollout import SamplingParams
from rlflow.engine.rollout.multi_turn import MultiTurn, episode_metrics, run_episodes
from rlflow.workers.environments import ToolEnvironments, pack_environment


def divide(a: int, b: int) -> float:
    """Divides a by b.

    Args:
        a: the dividend.
        b: the divisor.
    """
    return a / b


def wait(seconds: float) -> str:
    """Waits.

    Args:
        seconds: how long.
    """
    time.sleep(seconds)
    return "waited"


def _call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


# What each episode "samples": a call on its first turn, then an answer.
TURNS = [
    [_call("multiply", '{"a": 3, "b": 4}'), "12"],
    [_call("divide", '{"a": 1, "b": 0}'), "no"],
    [_call("wait", '{"seconds": 1.5}'), "late"],
    ["7"],  # no call: the episode ends after one turn
]


def test_tool_episodes_keep_sampled_and_observation_ids_and_report_errors_and_time_outs():
    tok = chat_tokenizer(HERMES_TEMPLATE)
    eos = tok.eos_token_id
    episodes = pack_environment(ToolEnvironments([multiply, divide, wait], timeout_s=0.3)).episodes(tok)
    calls = {"n": 0}

    def sample(ids, mask, params):  # a scripted policy: each row's next turn, ended by the end-of-turn token
        turn = calls["n"]
        calls["n"] += 1
        texts = [t[turn] for t in TURNS if len(t) > turn]
        rows = [tok(text, add_special_tokens=False).input_ids + [eos] for text in texts]
        width = params.max_new_tokens
        out = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros_like(out)
        for r, row in enumerate(rows):
            out[r, : len(row)], mask[r, : len(row)] = torch.tensor(row[:width]), 1
        return out, mask, -mask.float()

    rows = [{"prompt": [{"role": "user", "content": f"question {i}"}]} for i in range(len(TURNS))]
    multi = MultiTurn(episodes=episodes, max_turns=3, max_total_tokens=400, max_prompt_tokens=2000)
    started = time.perf_counter()
    records, made = run_episodes(sample, rows, SamplingParams(max_new_tokens=100, stop_token_ids=(eos,)), multi)
    assert time.perf_counter() - started < 3.0  # the time-out answered, the sleeping tool left behind
    assert [r.turns for r in records] == [2, 2, 2, 1]
    for record, turns in zip(records, TURNS):
        sampled = [i for i, s in zip(record.ids, record.sampled) if s]
        assert sampled == [t for text in turns for t in tok(text, add_special_tokens=False).input_ids + [eos]]
    observations = [tok.decode([i for i, s in zip(r.ids, r.sampled) if not s]) for r in records]
    assert "<tool_response>\n12\n</tool_response>" in observations[0]
    assert "ZeroDivisionError" in observations[1]
    assert "did not finish within 0.3 seconds" in observations[2]
    assert observations[3] == ""
    metrics = episode_metrics(records, made)
    assert metrics["tools/calls"] == pytest.approx(3 / 4)
    assert metrics["tools/errors"] == pytest.approx(1 / 4)
    assert metrics["tools/timeouts"] == pytest.approx(1 / 4)


def test_a_rule_reads_the_prompt_before_the_first_sampled_token_and_the_sampled_turns_as_the_response():
    from rlflow.data.tokenizer import build_char_tokenizer
    from rlflow.workers.interfaces.reward import decode_rollout

    tok = build_char_tokenizer(add_bos=False)
    parts = [("1+2=", 0), ("ca", 1), ("=3", 0), ("3", 1)]  # prompt, turn, observation, turn
    ids = [tok.pad_token_id] + [i for text, _ in parts for i in tok(text, add_special_tokens=False).input_ids]
    sampled = [0] + [s for text, s in parts for s in [s] * len(text)]
    attention = [0] + [1] * (len(ids) - 1)  # a left pad, then real tokens
    prompts, responses = decode_rollout(tok, *(torch.tensor([x]) for x in (ids, attention, sampled)))
    assert (prompts, responses) == (["1+2="], ["ca3"])


def test_a_tool_trace_is_the_rollout_of_its_turns_with_the_loss_on_the_turns_only():
    from rlflow.data.tokenizer import build_char_tokenizer
    from rlflow.data.tool_tasks import multiply as task_multiply
    from rlflow.data.tool_tasks import multiply_traces
    from rlflow.workers.environments import trace_example

    tok = build_char_tokenizer()
    make = pack_environment(ToolEnvironments([task_multiply])).episodes(tok)
    row = {"prompt": "123*456=", "answer": "56088"}
    ids, mask = trace_example(make(), row, multiply_traces(row))
    episode = make()  # the same episode, stepped by hand
    prompt = episode.reset(row)
    call = tok(multiply_traces(row)[0], add_special_tokens=False).input_ids + [tok.eos_token_id]
    result = episode.step(call).ids
    answer = tok("56088", add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert ids == prompt + call + result + answer
    assert mask == [0] * len(prompt) + [1] * len(call) + [0] * len(result) + [1] * len(answer)
    assert tok.decode(result) == '\n<result name="multiply">56088</result>\n'
    with pytest.raises(ValueError, match="is not of the form 'a\\*b='"):
        multiply_traces({"prompt": "1+2=", "answer": "3"})
