"""Environments for multi-step episodes, tools wrapped as one, and an episode in token ids."""

from __future__ import annotations

import sys
import textwrap

import pytest
from ray import cloudpickle
from tool_helpers import CHAT_TEMPLATE, HERMES_TEMPLATE, chat_tokenizer, lookup, multiply

from rlflow.data.tokenizer import build_char_tokenizer
from rlflow.workers.environments import (
    Step,
    TokenEpisode,
    ToolEnvironments,
    check_environment,
    import_object,
    pack_environment,
)
from rlflow.workers.tool_render import call_format, tag_tools_prompt, tool_signature

ROW = {"prompt": [{"role": "user", "content": "What is 3*4?"}], "answer": "12"}
CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>'


class Guess:
    """Three tries at a number; says higher or lower."""

    def reset(self, row):
        self.target, self.tries = int(row["answer"]), 0
        return row["prompt"]

    def step(self, text):
        self.tries += 1
        guess = int(text.strip())
        if guess == self.target or self.tries == 3:
            return Step("", float(guess == self.target), True)
        return Step([{"role": "user", "content": "higher" if guess < self.target else "lower"}], 0.0, False)


class NoStep:
    def reset(self, row):
        return row["prompt"]


class StepWithoutText:
    def reset(self, row):
        return row["prompt"]

    def step(self):
        return Step("", 0.0, True)


def test_an_environment_missing_a_method_is_refused_naming_the_class_and_the_method():
    with pytest.raises(TypeError, match="environment class 'NoStep' has no method 'step'"):
        check_environment(NoStep)
    with pytest.raises(TypeError, match=r"environment class 'StepWithoutText': step\('text',\) cannot be called"):
        check_environment(StepWithoutText)
    with pytest.raises(TypeError, match="environment class 'NoStep' has no method 'step'"):
        check_environment(lambda: NoStep())  # a factory function: the environment it makes is checked
    with pytest.raises(TypeError, match="neither a class nor a factory"):
        check_environment(Guess())
    check_environment(Guess)


def test_hermes_episode_token_in_token_out_matches_the_chat_template():
    tok = chat_tokenizer(HERMES_TEMPLATE)
    assert call_format(tok) == "hermes"
    episode = TokenEpisode(ToolEnvironments([multiply, lookup])(), tok)
    prompt = episode.reset(ROW)
    schemas = episode.env.tool_schemas
    assert tok.decode(prompt) == tok.apply_chat_template(
        ROW["prompt"], tools=schemas, add_generation_prompt=True, tokenize=False
    )
    turn = tok(CALL, add_special_tokens=False).input_ids + [tok.eos_token_id]  # sampled, ending on <|im_end|>
    obs, reward, done = episode.step(turn)
    assert (reward, done) == (0.0, False)
    answer = tok("It is 12.", add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert episode.step(answer) == ([], 0.0, True)
    # The ids a rollout keeps are what the template renders for the whole conversation.
    conversation = [
        *ROW["prompt"],
        {"role": "assistant", "content": CALL},
        {"role": "tool", "name": "multiply", "content": "12"},
    ]
    expected = tok.apply_chat_template(conversation, tools=schemas, add_generation_prompt=True, tokenize=False)
    assert tok.decode(prompt + turn + obs) == expected
    assert tok.decode(obs).startswith("\n<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>")
    assert episode.metrics() == {
        "tools/calls": 1.0, "tools/malformed": 0.0, "tools/errors": 0.0, "tools/timeouts": 0.0,
        "tools/seconds": pytest.approx(episode.env.stats.seconds),
    }  # fmt: skip


def test_a_turn_cut_before_its_stop_token_gets_the_templates_end_of_turn():
    tok = chat_tokenizer(HERMES_TEMPLATE)
    episode = TokenEpisode(ToolEnvironments([multiply])(), tok)
    episode.reset(ROW)
    obs, _, _ = episode.step(tok(CALL, add_special_tokens=False).input_ids)  # stopped on </tool_call>
    assert tok.decode(obs).startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n12\n")


def test_tag_format_without_a_chat_template_tells_the_model_the_format():
    tok = build_char_tokenizer()
    assert call_format(tok) == "tag"
    env = ToolEnvironments([multiply])()
    episode = TokenEpisode(env, tok)
    prompt = tok.decode(episode.reset({"prompt": "What is 3*4?"}), skip_special_tokens=True)
    assert prompt == tag_tools_prompt(env.tool_schemas) + "\n\nWhat is 3*4?\n"
    assert "<call>{" in prompt and '<result name="<tool name>">' in prompt
    turn = tok('<call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}</call><call>{"name": "pow"}</call>').input_ids
    obs, _, done = episode.step(turn[1:])  # the sampled turn has no BOS
    assert not done
    assert tok.decode(obs) == (
        '\n<result name="multiply">12</result>\n'
        "<result name=\"pow\">Error: there is no tool 'pow'; the tools are ['multiply']</result>\n"
    )
    assert (env.stats.calls, env.stats.malformed) == (2, 1)


def test_tag_format_lists_the_tools_as_signatures_or_not_at_all_and_reads_the_same_calls():
    tok = build_char_tokenizer()
    prompts = {}
    for listing in ("schema", "signature", "none"):
        env = ToolEnvironments([multiply], tool_listing=listing)()
        episode = TokenEpisode(env, tok)
        prompts[listing] = tok.decode(episode.reset({"prompt": "3*4="}), skip_special_tokens=True)
        turn = tok('<call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}</call>', add_special_tokens=False)
        obs, _, done = episode.step(turn.input_ids)
        assert tok.decode(obs) == '\n<result name="multiply">12</result>\n' and not done
    assert tool_signature(env.tool_schemas[0]) == "multiply(a: int, b: int) -> int: Multiplies two integers."
    assert prompts["signature"] == (
        "You can call these tools:\nmultiply(a: int, b: int) -> int: Multiplies two integers.\n"
        'To call one, write <call>{"name": ..., "arguments": {...}}</call>.\n\n3*4=\n'
    )
    assert prompts["none"] == "3*4=\n"
    assert len(prompts["signature"]) < len(prompts["schema"]) / 2
    with pytest.raises(ValueError, match="tool_listing='json'; expected one of"):
        ToolEnvironments([multiply], tool_listing="json")


def test_a_hermes_template_lists_the_tools_itself_whatever_the_tag_listing():
    tok = chat_tokenizer(HERMES_TEMPLATE)
    prompts = {
        listing: tok.decode(TokenEpisode(ToolEnvironments([multiply], tool_listing=listing)(), tok).reset(ROW))
        for listing in ("schema", "none")
    }
    assert prompts["none"] == prompts["schema"] and '"name": "multiply"' in prompts["none"]


def test_tag_format_with_a_chat_template_without_tool_role_answers_in_a_user_turn():
    tok = chat_tokenizer(CHAT_TEMPLATE)
    assert call_format(tok) == "tag"
    episode = TokenEpisode(ToolEnvironments([multiply])(), tok)
    prompt = tok.decode(episode.reset({"prompt": [{"role": "system", "content": "Be brief."}, *ROW["prompt"]]}))
    assert prompt.startswith("<|im_start|>system\nYou can call these tools.") and "\n\nBe brief.<|im_end|>" in prompt
    turn = tok('<call>{"name": "multiply", "arguments": {"a": 3, "b": 4}}</call>', add_special_tokens=False).input_ids
    obs, _, _ = episode.step([*turn, tok.eos_token_id])
    assert (
        tok.decode(obs) == '\n<|im_start|>user\n<result name="multiply">12</result><|im_end|>\n<|im_start|>assistant\n'
    )


def test_an_environment_of_its_own_runs_several_turns_with_its_rewards():
    tok = chat_tokenizer(CHAT_TEMPLATE)
    episode = TokenEpisode(Guess(), tok)
    prompt = episode.reset(ROW)
    assert tok.decode(prompt) == "<|im_start|>user\nWhat is 3*4?<|im_end|>\n<|im_start|>assistant\n"
    low = episode.step([*tok("7", add_special_tokens=False).input_ids, tok.eos_token_id])
    assert (tok.decode(low.ids), low.reward, low.done) == (
        "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n",
        0.0,
        False,
    )
    assert episode.step(tok("12", add_special_tokens=False).input_ids) == ([], 1.0, True)
    assert episode.metrics() == {}
    episode.env.step = lambda text: ("only an observation", 0.0)
    with pytest.raises(TypeError, match=r"'Guess': step returned \('only an observation', 0.0\); expected"):
        episode.step([5])
    with pytest.raises(KeyError, match=r"'prompt'; the row has \['question'\]"):
        TokenEpisode(ToolEnvironments([multiply])(), tok).reset({"question": "3*4?"})


def test_import_paths_name_tools_and_environments_and_a_bad_one_is_named():
    assert import_object("tool_helpers:multiply") is multiply
    env = ToolEnvironments(["tool_helpers:multiply", lookup])()
    assert [s["function"]["name"] for s in env.tool_schemas] == ["multiply", "lookup"]
    with pytest.raises(ValueError, match="'tool_helpers.multiply' is not of the form 'module:name'"):
        import_object("tool_helpers.multiply")
    with pytest.raises(ValueError, match="'no_such_module:f': module 'no_such_module' does not import"):
        ToolEnvironments(["no_such_module:f"])
    with pytest.raises(ValueError, match="'tool_helpers:divide': 'tool_helpers' has no 'divide'"):
        pack_environment("tool_helpers:divide")


def test_environments_and_their_tools_travel_by_value(tmp_path, monkeypatch):
    (tmp_path / "my_local_env.py").write_text(
        textwrap.dedent(
            '''
            OFFSET = 100

            def add(a: int, b: int) -> int:
                """Adds, plus an offset.

                Args:
                    a: a number.
                    b: another.
                """
                return a + b + OFFSET

            class Echo:
                def reset(self, row):
                    return row["prompt"]

                def step(self, text):
                    return text.upper(), float(OFFSET), True
            '''
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    tools_spec = pack_environment(ToolEnvironments(["my_local_env:add"], timeout_s=5))
    echo_spec = pack_environment("my_local_env:Echo")
    assert (tools_spec.name, echo_spec.name) == ("ToolEnvironments", "Echo")
    # As on a worker that cannot import the module: the code travels with the payload.
    monkeypatch.delitem(sys.modules, "my_local_env")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    with pytest.raises(ImportError):
        __import__("my_local_env")
    env = tools_spec.load()()
    env.reset({"prompt": "x"})
    observation, _, done = env.step('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    assert observation == [{"role": "tool", "name": "add", "content": "103"}] and not done
    echo = echo_spec.load()()
    echo.reset({"prompt": "x"})
    assert echo.step("hi") == ("HI", 100.0, True)
    tok = build_char_tokenizer()
    echo_episode = echo_spec.episodes(tok)()
    assert tok.decode(echo_episode.reset({"prompt": "x"})) == "<bos>x"  # plain text: the tokenizer's BOS
    assert echo_episode.step(tok("hi", add_special_tokens=False).input_ids) == (tok("HI").input_ids[1:], 100.0, True)
    make_episode = tools_spec.episodes(tok)  # what a rollout loop takes
    first, second = make_episode(), make_episode()
    assert first.env is not second.env and first.env.runner is second.env.runner  # one thread pool
    first.reset({"prompt": "1+2?"})
    turn = first.tokenizer('<call>{"name": "add", "arguments": {"a": 1, "b": 2}}</call>', add_special_tokens=False)
    assert first.tokenizer.decode(first.step(turn.input_ids).ids) == '\n<result name="add">103</result>\n'
    assert "my_local_env" not in cloudpickle.list_registry_pickle_by_value()  # nothing left registered
    env.runner.close()
    first.env.runner.close()
