"""TRL's dataset formats, standard and conversational: what each row trains on (the loss mask), the
implicit prompt of preference pairs, and the errors of a row whose format is not one of them."""

from __future__ import annotations

import pytest

from rlflow.data.datasets import DatasetFormatError, PreferenceDataset, PromptDataset, SFTDataset
from rlflow.data.formats import preference_parts
from rlflow.data.tokenizer import build_char_tokenizer

# A chat template in the char tokenizer's alphabet: "<u>" / "<a>" open a turn, a newline closes it.
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<a>{% endif %}"
)
USER = [{"role": "user", "content": "1+1="}]
ANSWER, WRONG = [{"role": "assistant", "content": "2"}], [{"role": "assistant", "content": "3"}]


@pytest.fixture(scope="module")
def tok():
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def trained_text(tok, item, prefix: str = "") -> str:
    """The tokens the loss covers, decoded (special tokens written out)."""
    ids, mask = item[f"{prefix}input_ids"], item[f"{prefix}loss_mask"]
    return tok.decode([t for t, m in zip(ids, mask) if m])


def context_text(tok, item, prefix: str = "") -> str:
    ids, mask = item[f"{prefix}input_ids"], item[f"{prefix}loss_mask"]
    return tok.decode([t for t, m in zip(ids, mask) if not m])


def test_sft_trains_on_the_completion_of_each_format(tok):
    rows = [
        {"prompt": "1+1=", "completion": "2"},  # standard prompt-completion: completion and EOS
        {"prompt": "1+1=", "answer": "2"},  # rlflow's own files: the same
        {"prompt": USER, "completion": ANSWER},  # conversational: what the template writes after the prompt
        {"messages": USER + ANSWER},  # conversational language modelling: every token after the first
        {"text": "1+1=2"},  # standard language modelling: every token after BOS, and EOS
    ]
    items = SFTDataset(rows, tok, max_length=32)
    assert [trained_text(tok, items[i]) for i in range(5)] == [
        "2<eos>",
        "2<eos>",
        "2\n",
        "u>1+1=\n<a>2\n",
        "1+1=2<eos>",
    ]
    assert [context_text(tok, items[i]) for i in range(5)] == ["<bos>1+1=", "<bos>1+1=", "<u>1+1=\n<a>", "<", "<bos>"]
    assert items[0]["input_ids"] == items[1]["input_ids"]


def test_preference_pairs_standard_conversational_and_implicit(tok):
    explicit = {"prompt": USER, "chosen": ANSWER, "rejected": WRONG}
    implicit = {"chosen": USER + ANSWER, "rejected": USER + WRONG}
    pairs = PreferenceDataset([explicit, implicit], tok, max_length=32)
    assert {k: v for k, v in pairs[0].items() if k != "index"} == {k: v for k, v in pairs[1].items() if k != "index"}
    assert trained_text(tok, pairs[0], "chosen_") == "2\n" and trained_text(tok, pairs[0], "rejected_") == "3\n"
    assert context_text(tok, pairs[0], "rejected_") == "<u>1+1=\n<a>"
    standard = PreferenceDataset(
        [{"prompt": "1+1=", "chosen": " 2", "rejected": " 3"}, {"chosen": "1+1= 2", "rejected": "1+1= 3"}],
        tok,
        max_length=32,
    )
    assert standard[0]["chosen_input_ids"] == standard[1]["chosen_input_ids"]
    assert trained_text(tok, standard[1], "rejected_") == " 3<eos>"


def test_the_implicit_prompt_is_the_shared_beginning():
    assert preference_parts({"chosen": "The sky is blue.", "rejected": "The sky is green."}, "x") == (
        "The sky is",
        " blue.",
        " green.",
    )
    system = {"role": "system", "content": "be brief"}
    assert preference_parts({"chosen": [system, *USER, *ANSWER], "rejected": [system, *USER, *WRONG]}, "x") == (
        [system, *USER],
        ANSWER,
        WRONG,
    )
    with pytest.raises(DatasetFormatError, match="x: without a 'prompt' column .* share no first message"):
        preference_parts({"chosen": ANSWER, "rejected": WRONG}, "x")


def test_the_warm_up_trains_on_the_chosen_answer_of_an_implicit_pair(tok):
    warm_up = SFTDataset([{"chosen": USER + ANSWER, "rejected": USER + WRONG}], tok, 32, answer_field="chosen")
    assert trained_text(tok, warm_up[0]) == "2\n" and context_text(tok, warm_up[0]) == "<u>1+1=\n<a>"


def test_a_conversational_prompt_ending_with_the_assistant_is_continued(tok):
    prompts = PromptDataset([{"prompt": USER + [{"role": "assistant", "content": "The sum is"}]}], tok, 32)
    assert tok.decode(prompts[0]["input_ids"]) == "<u>1+1=\n<a>The sum is"  # no end of turn, no new turn


@pytest.mark.parametrize(
    ("dataset", "row", "message"),
    [
        (
            SFTDataset,
            {"question": "1+1=", "response": "2"},
            r"no SFT format in the columns \['question', 'response'\]; "
            r"expected 'prompt' \+ 'completion' \(or 'answer'\), 'messages' or 'text'",
        ),  # fmt: skip
        (SFTDataset, {"prompt": "1+1=", "completion": ANSWER}, r"'prompt' and 'completion' mix a string and messages"),
        (SFTDataset, {"messages": "1+1=2"}, r"field 'messages' should be a list of messages, got str"),
        (
            PreferenceDataset,
            {"prompt": "1+1=", "answer": "2"},
            r"missing field 'chosen' \(has \['answer', 'prompt'\]\); "
            "a preference row holds 'chosen' and 'rejected'",
        ),  # fmt: skip
        (PreferenceDataset, {"prompt": USER, "chosen": "2", "rejected": "3"}, r".* mix strings and messages"),
        (PromptDataset, {"question": "1+1="}, r"missing field 'prompt' \(has \['question'\]\); a prompt row holds"),
        (
            PromptDataset,
            {"prompt": [{"text": "1+1="}]},
            r"field 'prompt' should be str or a list of messages, got a list",
        ),
    ],
)
def test_a_row_of_no_known_format_names_the_row_and_the_columns_expected(tok, dataset, row, message):
    with pytest.raises(DatasetFormatError, match=rf"<records>:2: {message}"):
        dataset([{"prompt": "1+1=", "completion": "2", "chosen": "2", "rejected": "3"}, row], tok, 32)


def test_messages_need_a_chat_template_naming_the_row_and_column():
    with pytest.raises(
        DatasetFormatError, match=r"<records>:1: column 'messages' holds messages, but the tokenizer has no"
    ):
        SFTDataset([{"messages": USER + ANSWER}], build_char_tokenizer(), 32)
    with pytest.raises(DatasetFormatError, match=r"<records>:1: column 'chosen' holds messages"):
        PreferenceDataset([{"chosen": USER + ANSWER, "rejected": USER + WRONG}], build_char_tokenizer(), 32)
