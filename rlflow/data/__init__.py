"""Data: files read through ``datasets``, TRL's row formats, datasets and a resumable loader,
synthetic tasks with verifiable answers, a local character tokenizer and tiny Llama/Qwen2 models
built from configs."""

from __future__ import annotations

from rlflow.data.datasets import (
    DatasetFormatError,
    PreferenceDataset,
    PromptDataset,
    SFTDataset,
    collate_preferences,
    collate_prompts,
    collate_sft,
    pad_sequences,
)
from rlflow.data.files import FORMATS, data_format, read_records
from rlflow.data.loader import StatefulDataLoader, StatefulSampler
from rlflow.data.tasks import (
    SPLITS,
    ArithmeticTask,
    CountdownTask,
    SyntheticTask,
    TaskExample,
    solve_countdown,
    write_jsonl,
)
from rlflow.data.tiny_models import build_tiny_config, build_tiny_model, save_tiny_model_and_tokenizer
from rlflow.data.tokenizer import DEFAULT_ALPHABET, SPECIAL_TOKENS, build_char_tokenizer, load_tokenizer

__all__ = [
    "DEFAULT_ALPHABET",
    "FORMATS",
    "SPECIAL_TOKENS",
    "SPLITS",
    "ArithmeticTask",
    "CountdownTask",
    "DatasetFormatError",
    "PreferenceDataset",
    "PromptDataset",
    "SFTDataset",
    "StatefulDataLoader",
    "StatefulSampler",
    "SyntheticTask",
    "TaskExample",
    "build_char_tokenizer",
    "build_tiny_config",
    "build_tiny_model",
    "collate_preferences",
    "collate_prompts",
    "collate_sft",
    "data_format",
    "load_tokenizer",
    "pad_sequences",
    "read_records",
    "save_tiny_model_and_tokenizer",
    "solve_countdown",
    "write_jsonl",
]
