"""A turn ends at its closing tag: the environment's stop strings, tokenized by the policy's tokenizer,
stop the built-in sampler's turn right after the tag although the model would write on."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tool_helpers import chat_tokenizer, multiply
from transformers import LlamaConfig, LlamaForCausalLM

from rlflow.data.tokenizer import build_char_tokenizer
from rlflow.engine.rollout import HFRolloutEngine, SamplingParams
from rlflow.protocol import DataProto
from rlflow.workers.environments import MultiTurnSetup, ToolEnvironments, pack_environment, trace_example
from rlflow.workers.tool_render import stop_sequences

TAG = "</end>"
SCRIPT = "Qhi</end>xyz"  # each character is followed by the next; z by itself: the model never stops


def scripted_model(tok, script: str) -> LlamaForCausalLM:
    """A 1-layer Llama whose greedy next token is the character after the current one in ``script``.

    The layer adds nothing (zero output projections), so the last hidden state is the current
    token's one-hot embedding and the LM head maps it to its successor.
    """
    vocab = len(tok)
    config = LlamaConfig(vocab_size=vocab, hidden_size=vocab + (-vocab % 8), intermediate_size=8,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                         tie_word_embeddings=False, pad_token_id=tok.pad_token_id)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    ids = tok(script, add_special_tokens=False).input_ids
    with torch.no_grad():
        for p in model.parameters():
            p.zero_() if p.dim() == 2 else p.fill_(1.0)
        model.model.embed_tokens.weight[:, :vocab] = torch.eye(vocab)
        for current, following in zip(ids, ids[1:] + ids[-1:]):
            model.lm_head.weight[following, current] = 10.0
    return model


class Echo:
    """Two turns; each step records the turn's text and answers with ``Q`` (the script starts over)."""

    stop_strings = (TAG,)
    seen: list[str] = []

    def reset(self, row):
        self.turns = 0
        return row["prompt"]

    def step(self, text):
        Echo.seen.append(text)
        self.turns += 1
        return "Q", 0.0, self.turns == 2


def _prompts(num: int) -> DataProto:
    ids, mask = torch.tensor([[1, 1]] * num), torch.ones((num, 2), dtype=torch.long)
    columns = np.empty(num, dtype=object)
    columns[:] = [{"prompt": "Q"}] * num
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask}, {"columns": columns})


@pytest.mark.parametrize("stop_at_call", [True, False])
def test_a_turn_ends_right_after_the_tag_the_model_would_write_on_from(stop_at_call):
    tok = build_char_tokenizer()
    spec = pack_environment(Echo)
    assert spec.stop_strings == (TAG,)
    setup = MultiTurnSetup(environment=spec, max_turns=2, max_total_tokens=40, max_prompt_tokens=4,
                           stop_at_call=stop_at_call)  # fmt: skip
    multi = setup.build(tok, [tok.eos_token_id])
    engine = HFRolloutEngine(scripted_model(tok, SCRIPT), pad_token_id=tok.pad_token_id)
    Echo.seen.clear()
    out = engine.generate_episodes(_prompts(2), SamplingParams(greedy=True, max_new_tokens=12), multi)
    turn = "hi</end>" if stop_at_call else "hi</end>xyzz"  # else: the turn's 12 tokens
    assert Echo.seen == [turn] * 4
    sampled = tok(turn, add_special_tokens=False).input_ids
    expected = sampled + tok("Q", add_special_tokens=False).input_ids + sampled
    for row in range(2):
        assert out.batch["responses"][row, : len(expected)].tolist() == expected
        assert out.batch["response_mask"][row].tolist()[: len(expected) + 1] == [1] * len(sampled) + [0] + [1] * len(
            sampled
        ) + [0]


def test_stop_sequences_of_tags_single_special_tokens_and_the_tool_environments_tags():
    tok = chat_tokenizer(None)
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    tools = ToolEnvironments([multiply])
    assert tools.stop_strings == ("</tool_call>", "</call>")
    close = tok.convert_tokens_to_ids("</tool_call>")
    assert stop_sequences(tok, tools.stop_strings) == (
        (close,),
        tuple(tok("</call>", add_special_tokens=False).input_ids),
    )
    with pytest.raises(ValueError, match="empty stop string"):
        stop_sequences(tok, [""])

    class Bad(Echo):
        stop_strings = "</end>"

    with pytest.raises(TypeError, match="stop_strings"):
        pack_environment(Bad)


def test_a_trace_turn_that_ends_on_the_tag_is_not_closed_by_the_end_of_turn_token():
    from rlflow.data.tool_tasks import multiply as task_multiply
    from rlflow.data.tool_tasks import multiply_traces

    tok = build_char_tokenizer()
    setup = MultiTurnSetup(environment=pack_environment(ToolEnvironments([task_multiply])), max_turns=2,
                           max_total_tokens=160, max_prompt_tokens=640)  # fmt: skip
    row = {"prompt": "123*456=", "answer": "56088"}
    call_text, answer_text = multiply_traces(row)
    ids, mask = trace_example(setup.episodes(tok)(), row, [call_text, answer_text])
    episode = setup.episodes(tok)()
    prompt = episode.reset(row)
    call = tok(call_text, add_special_tokens=False).input_ids  # ends on </call>: no EOS after it
    result = episode.step(call).ids
    answer = tok(answer_text, add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert call_text.endswith("</call>")
    assert ids == prompt + call + result + answer
    assert mask == [0] * len(prompt) + [1] * len(call) + [0] * len(result) + [1] * len(answer)


def test_a_bpe_tokenizer_that_merges_the_calls_closing_braces_with_the_tag_is_stopped_at_the_merged_token():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    call = '<call>{"name": "f", "arguments": {"a": 1}}</call>'
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([call] * 20 + ["a </call> b"] * 5, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe)
    ids = tok(call, add_special_tokens=False).input_ids
    assert tok.decode(ids[-3:-2]) == "}}</"  # the braces and the tag's start are one token
    sequences = stop_sequences(tok, ["</call>"])
    assert tuple(ids[-3:]) in sequences and tuple(tok("</call>", add_special_tokens=False).input_ids) in sequences
    assert all(tok.decode(list(seq)).endswith("</call>") for seq in sequences)
