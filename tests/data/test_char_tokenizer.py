"""The local character tokenizer: one token per character, lossless, saved and loaded by HF."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from rlflow.data import ArithmeticTask, CountdownTask, build_char_tokenizer, load_tokenizer
from rlflow.data.datasets import PromptDataset
from rlflow.trainer.build import materialize_tokenizer
from rlflow.trainer.config import ConfigError, DataConfig, RLFlowConfig

TASK_STRINGS = [
    "12+34=",
    "907-8517=-7610",
    "make 22 from 3 5 7:(3+5)*7-34",
    "Question: what is 3 * (4 + 5)?\nAnswer: <answer> 27 </answer>",
    "  leading and trailing spaces , . ;  ",
]


def test_one_token_per_character_with_bos():
    tok = build_char_tokenizer()
    ids = tok("a 1.").input_ids
    assert ids[0] == tok.bos_token_id and len(ids) == 5
    assert tok.convert_ids_to_tokens(ids[1:]) == ["a", " ", "1", "."]
    assert tok("a 1.", add_special_tokens=False).input_ids == ids[1:]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.convert_tokens_to_ids(list("0123456789")) == list(range(4, 14))
    assert tok("é", add_special_tokens=False).input_ids == [tok.unk_token_id]


def test_encode_decode_identity_on_task_strings():
    tok = build_char_tokenizer()
    examples = ArithmeticTask(reverse_answer=True).sample("train", 5) + CountdownTask().sample("train", 5)
    strings = TASK_STRINGS + [e.prompt + e.answer for e in examples]
    for text in strings:
        ids = tok(text).input_ids + [tok.eos_token_id]
        assert tok.decode(ids, skip_special_tokens=True) == text


def test_save_and_autotokenizer_round_trip(tmp_path):
    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.padding_side == "left"
    assert len(loaded) == len(tok) == 4 + 96  # specials + digits, punctuation, space, newline, letters
    assert (loaded.pad_token, loaded.bos_token, loaded.eos_token) == ("<pad>", "<bos>", "<eos>")
    for text in TASK_STRINGS:
        assert loaded(text).input_ids == tok(text).input_ids
        assert loaded.decode(loaded(text).input_ids, skip_special_tokens=True) == text
    assert load_tokenizer(str(tmp_path), padding_side="right").padding_side == "right"


def test_left_padding_for_generation():
    tok = build_char_tokenizer("0123456789+=")
    batch = tok(["1+1=", "12+34="], padding=True, return_tensors="pt")
    assert batch.input_ids.tolist() == [[0, 0, 1, 5, 14, 5, 15], [1, 5, 6, 14, 7, 8, 15]]
    assert batch.attention_mask.tolist() == [[0, 0, 1, 1, 1, 1, 1], [1] * 7]


def test_bad_alphabets_are_rejected():
    with pytest.raises(ValueError, match="repeats characters \\['1'\\]"):
        build_char_tokenizer("0112")
    with pytest.raises(ValueError, match="alphabet is empty"):
        build_char_tokenizer("")
    with pytest.raises(ValueError, match="padding_side='middle'"):
        build_char_tokenizer("01", padding_side="middle")


def _saved_without(tmp_path, *tokens: str) -> str:
    tok = build_char_tokenizer()
    for name in tokens:
        setattr(tok, name, None)
    tok.save_pretrained(tmp_path)
    assert all(getattr(AutoTokenizer.from_pretrained(tmp_path), name) is None for name in tokens)
    return str(tmp_path)


def test_a_tokenizer_without_a_pad_token_pads_with_eos_and_says_so_once(tmp_path, caplog):
    # Llama's tokenizers have no pad token; the prompt collation used to reach torch.full(..., None).
    path = _saved_without(tmp_path, "pad_token")
    with caplog.at_level("WARNING", logger="rlflow.data.tokenizer"):
        tok = load_tokenizer(path)
        load_tokenizer(path)
    assert tok.pad_token == tok.eos_token and tok.pad_token_id == tok.eos_token_id
    assert [r.getMessage() for r in caplog.records if "no pad token" in r.getMessage()] == [
        f"tokenizer {path} has no pad token: padding with its EOS token '<eos>' (id 2)"
    ]
    batch = PromptDataset([{"prompt": "1+2="}, {"prompt": "10+20="}], tok, max_prompt_length=16)
    batch = batch.collate([batch[0], batch[1]])
    assert batch["input_ids"][0, 0].item() == tok.eos_token_id  # left padding
    assert batch["attention_mask"][0, 0].item() == 0


def test_a_tokenizer_without_pad_or_eos_is_a_config_error_naming_data_tokenizer(tmp_path):
    path = _saved_without(tmp_path, "pad_token", "eos_token")
    cfg = RLFlowConfig(data=DataConfig(tokenizer=path))
    with pytest.raises(ConfigError, match=r"data\.tokenizer.*neither a pad token nor an EOS token"):
        materialize_tokenizer(cfg, tmp_path / "run")
