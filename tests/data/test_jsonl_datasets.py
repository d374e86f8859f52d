"""Datasets from JSON lines (read through ``datasets``): line-numbered errors, length limits, collates,
and exact loader resume."""

from __future__ import annotations

import json

import pytest
import torch

from rlflow.data import (
    DatasetFormatError,
    PreferenceDataset,
    PromptDataset,
    SFTDataset,
    StatefulDataLoader,
    StatefulSampler,
    build_char_tokenizer,
    read_records,
)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer("0123456789+= abc")  # '0' -> 4, ..., '9' -> 13, '+' 14, '=' 15, ' ' 16, 'a' 17


def write(path, lines):
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"prompt": "1+1=",', "invalid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"question": "1+1="}', "missing field 'prompt'"),
        ('{"prompt": 12}', "column 'prompt' holds a number here and a string on line 1"),
        ('{"prompt": "1", "index": 4}', "field\\(s\\) \\['index'\\] are reserved"),
    ],
)
def test_bad_line_names_file_and_line(tmp_path, tok, bad_line, message):
    path = write(tmp_path / "p.jsonl", [{"prompt": "1+1="}, "", bad_line])
    with pytest.raises(DatasetFormatError, match=f"p.jsonl:3: {message}"):
        PromptDataset(path, tok, max_prompt_length=8)


def test_read_records_skips_blank_lines_and_keeps_line_numbers(tmp_path):
    path = write(tmp_path / "r.jsonl", [{"a": 1}, "  ", {"a": 2, "b": "x"}])
    assert read_records(path) == [(f"{path}:1", {"a": 1}), (f"{path}:3", {"a": 2, "b": "x"})]


def test_prompt_dataset_items_and_left_padded_collate(tmp_path, tok):
    path = write(tmp_path / "p.jsonl", [{"prompt": "1+1=", "ground_truth": "2"}, {"prompt": "12+3=", "answer": "15"}])
    ds = PromptDataset(path, tok, max_prompt_length=8)
    assert ds[0] == {"index": 0, "input_ids": [1, 5, 14, 5, 15], "prompt": "1+1=", "ground_truth": "2"}
    batch = ds.collate([ds[0], ds[1]])
    assert batch["input_ids"].tolist() == [[0, 1, 5, 14, 5, 15], [1, 5, 6, 14, 7, 15]]
    assert batch["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 1], [1] * 6]
    assert batch["position_ids"].tolist() == [[0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5]]
    assert batch["prompt"] == ["1+1=", "12+3="] and batch["index"] == [0, 1]
    assert batch["ground_truth"] == ["2", None] and batch["answer"] == [None, "15"]


def test_prompt_truncation_is_configured_and_reported(tok):
    records = [{"prompt": "123456789"}, {"prompt": "1"}]
    with pytest.raises(DatasetFormatError, match="<records>:1: prompt has 10 tokens > max_prompt_length=4"):
        PromptDataset(records, tok, max_prompt_length=4)
    with pytest.warns(UserWarning, match="truncated 1 of 2 examples \\(left\\)"):
        left = PromptDataset(records, tok, max_prompt_length=4, truncation="left")
    assert left.num_truncated == 1 and left[0]["input_ids"] == [1, 11, 12, 13]  # BOS kept, then the end
    with pytest.warns(UserWarning):
        right = PromptDataset(records, tok, max_prompt_length=4, truncation="right")
    assert right[0]["input_ids"] == [1, 5, 6, 7]
    with pytest.raises(ValueError, match="accepts \\('error', 'right'\\)"):
        SFTDataset([], tok, max_length=4, truncation="left")


def test_sft_loss_mask_covers_answer_and_eos_only(tok):
    ds = SFTDataset([{"prompt": "1+1=", "answer": "2"}, {"prompt": "12+3=", "answer": "15"}], tok, max_length=10)
    assert ds[0]["input_ids"] == [1, 5, 14, 5, 15, 6, 2]
    assert ds[0]["loss_mask"] == [0, 0, 0, 0, 0, 1, 1]
    batch = ds.collate([ds[0], ds[1]])
    assert batch["input_ids"].tolist() == [[1, 5, 14, 5, 15, 6, 2, 0, 0], [1, 5, 6, 14, 7, 15, 5, 9, 2]]
    assert batch["attention_mask"].tolist() == [[1] * 7 + [0, 0], [1] * 9]
    assert batch["loss_mask"].tolist() == [[0] * 5 + [1, 1, 0, 0], [0] * 6 + [1, 1, 1]]


def test_sft_truncation(tok):
    records = [{"prompt": "1+1=", "answer": "222"}]
    with pytest.raises(DatasetFormatError, match="prompt \\+ answer has 9 tokens > max_length=7"):
        SFTDataset(records, tok, max_length=7)
    with pytest.warns(UserWarning):
        cut = SFTDataset(records, tok, max_length=7, truncation="right")
    assert cut[0]["input_ids"] == [1, 5, 14, 5, 15, 6, 6] and cut[0]["loss_mask"] == [0] * 5 + [1, 1]
    with pytest.raises(DatasetFormatError, match="leaves no answer token"):
        SFTDataset(records, tok, max_length=5, truncation="right")


def test_sft_on_the_chosen_answers_of_a_preference_file(tmp_path, tok):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n{"prompt": "1+2=", "rejected": "4"}\n')
    with pytest.raises(DatasetFormatError, match=rf"{path}:2: missing field 'chosen'"):
        SFTDataset(path, tok, max_length=10, answer_field="chosen")
    path.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n')
    ds = SFTDataset(path, tok, max_length=10, answer_field="chosen")
    assert ds[0] == SFTDataset([{"prompt": "1+1=", "answer": "2"}], tok, max_length=10)[0]


def test_preference_pairs_pad_to_one_length(tok):
    ds = PreferenceDataset([{"prompt": "1+1=", "chosen": "2", "rejected": "333"}], tok, max_length=12)
    batch = ds.collate([ds[0]])
    assert batch["chosen_input_ids"].tolist() == [[1, 5, 14, 5, 15, 6, 2, 0, 0]]
    assert batch["rejected_input_ids"].tolist() == [[1, 5, 14, 5, 15, 7, 7, 7, 2]]
    assert batch["chosen_loss_mask"].tolist() == [[0] * 5 + [1, 1, 0, 0]]
    assert batch["rejected_attention_mask"].tolist() == [[1] * 9]
    with pytest.raises(DatasetFormatError, match="<records>:1: missing field 'rejected'"):
        PreferenceDataset([{"prompt": "a", "chosen": "b"}], tok, max_length=12)


def run(loader, num_batches):
    batches = []
    while len(batches) < num_batches:
        for batch in loader:
            batches.append(batch)
            if len(batches) == num_batches:
                break
    return batches


@pytest.mark.parametrize("stop_after", [1, 3, 4, 6])  # mid-epoch, end of epoch (4 per epoch), next epoch
def test_loader_resumes_exactly(stop_after):
    data = list(range(10))

    def make():
        return StatefulDataLoader(data, batch_size=2, collate_fn=list, seed=5, drop_last=True)

    reference = run(make(), 12)
    first = make()
    head = run(first, stop_after)
    resumed = make()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # states survive JSON
    assert head + run(resumed, 12 - stop_after) == reference


def test_sampler_epochs_are_seeded_permutations():
    sampler = StatefulSampler(10, batch_size=3, seed=1, drop_last=False)
    epoch0, epoch1 = list(sampler), list(sampler)
    assert [len(b) for b in epoch0] == [3, 3, 3, 1] and sampler.epoch == 2
    assert sorted(sum(epoch0, [])) == list(range(10)) and sum(epoch0, []) != sum(epoch1, [])
    assert list(StatefulSampler(10, batch_size=3, seed=1, drop_last=False)) == epoch0
    assert list(StatefulSampler(10, batch_size=3, seed=2, drop_last=False)) != epoch0
    other = StatefulSampler(10, batch_size=4, seed=1)
    with pytest.raises(ValueError, match="batch_size=3 but this sampler has 4"):
        other.load_state_dict(sampler.state_dict())
    with pytest.raises(ValueError, match="no batch at all"):
        StatefulSampler(2, batch_size=3)


def test_loader_over_a_dataset_uses_its_collate(tok):
    ds = PromptDataset([{"prompt": "1"}, {"prompt": "22"}, {"prompt": "333"}], tok, max_prompt_length=8)
    loader = StatefulDataLoader(ds, batch_size=3, shuffle=False)
    (batch,) = list(loader)
    assert isinstance(batch["input_ids"], torch.Tensor) and batch["input_ids"].shape == (3, 4)
    with pytest.raises(ValueError, match="list has no collate"):
        StatefulDataLoader([1, 2], batch_size=1)
