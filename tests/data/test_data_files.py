"""Data files read through ``datasets``: every format gives the same rows (nested columns as dicts),
rows are named by line or row in errors, an unknown extension is refused, and ``datasets`` leaves
no cache behind."""

from __future__ import annotations

import json

import datasets
import pytest

from rlflow.data.datasets import DatasetFormatError, PromptDataset
from rlflow.data.files import data_format, read_records
from rlflow.data.tokenizer import build_char_tokenizer

# verl's rows: a messages prompt, the ground truth nested under reward_model, extra_info a dict.
NESTED = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"{i}+1="}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
        "extra_info": {"split": "train", "index": i},
    }
    for i in range(3)
]
FLAT = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(3)]


def rows_of(path) -> list[dict]:
    return [row for _, row in read_records(path)]


def test_every_format_gives_the_rows_written(tmp_path):
    nested = datasets.Dataset.from_list(NESTED)
    nested.to_parquet(str(tmp_path / "a.parquet"))
    nested.to_json(str(tmp_path / "a.jsonl"))
    (tmp_path / "array.json").write_text(json.dumps(NESTED))
    nested.save_to_disk(str(tmp_path / "saved"))
    (arrow,) = (tmp_path / "saved").glob("*.arrow")
    for path in (tmp_path / "a.parquet", tmp_path / "a.jsonl", tmp_path / "array.json", tmp_path / "saved", arrow):
        assert rows_of(path) == NESTED, path
    datasets.Dataset.from_list(FLAT).to_csv(str(tmp_path / "a.csv"), index=False)
    assert rows_of(tmp_path / "a.csv") == [{**r, "answer": int(r["answer"])} for r in FLAT]  # CSV infers numbers


def test_rows_are_named_by_line_in_json_lines_else_by_row(tmp_path):
    columns = {"prompt": ["1+1=", None], "answer": [None, "2"]}
    datasets.Dataset.from_dict(columns).to_parquet(str(tmp_path / "a.parquet"))
    (tmp_path / "a.jsonl").write_text('{"prompt": "1+1="}\n\n{"answer": "2"}\n')
    assert read_records(tmp_path / "a.parquet") == [
        (f"{tmp_path / 'a.parquet'} row 0", {"prompt": "1+1="}),  # datasets' None for the absent column: dropped
        (f"{tmp_path / 'a.parquet'} row 1", {"answer": "2"}),
    ]
    with pytest.raises(DatasetFormatError, match=r"a\.parquet row 1: missing field 'prompt' \(has \['answer'\]\)"):
        PromptDataset(tmp_path / "a.parquet", build_char_tokenizer(), 16)
    with pytest.raises(DatasetFormatError, match=r"a\.jsonl:3: missing field 'prompt'"):
        PromptDataset(tmp_path / "a.jsonl", build_char_tokenizer(), 16)


def test_a_column_of_mixed_types_is_read_and_named_by_the_dataset(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"prompt": "1+1="}\n{"prompt": 12}\n')
    with pytest.raises(DatasetFormatError, match=rf"{path}:2: field 'prompt' should be str or a list of messages"):
        PromptDataset(path, build_char_tokenizer(), 16)


def test_a_file_datasets_cannot_read_names_the_file_and_format(tmp_path):
    path = tmp_path / "a.parquet"
    path.write_text("prompt,answer\n1+1=,2\n")
    with pytest.raises(DatasetFormatError, match=rf"{path}: datasets cannot read it as parquet: .*magic bytes"):
        read_records(path)


def test_unknown_formats_and_a_dataset_dict_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"'\.txt'; data files are \.parquet, \.jsonl, \.json, \.csv, \.arrow"):
        data_format(tmp_path / "train.txt")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(FLAT)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ValueError, match=r"holds a DatasetDict with splits \['train'\]; give one split's directory"):
        data_format(tmp_path / "dd")
    assert rows_of(tmp_path / "dd" / "train") == FLAT
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="Dataset.save_to_disk did not write"):
        data_format(tmp_path / "plain")


def test_datasets_leaves_no_cache_behind(tmp_path, monkeypatch):
    default_cache = tmp_path / "hf_datasets_cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", default_cache)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    path = tmp_path / "a.parquet"
    datasets.Dataset.from_list(FLAT).to_parquet(str(path))
    assert rows_of(path) == FLAT
    assert not default_cache.exists() and list((tmp_path / "tmp").iterdir()) == []
