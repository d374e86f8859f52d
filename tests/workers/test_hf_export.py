"""An HF export completed by :func:`complete_hf_export` loads with AutoTokenizer and generates as the run sampled."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer, GenerationConfig

from rlflow.data.tiny_models import build_tiny_model
from rlflow.data.tokenizer import build_char_tokenizer
from rlflow.engine.models import init_value_model_from_lm
from rlflow.engine.rollout.base import SamplingParams
from rlflow.workers.hf_export import complete_hf_export

SAMPLING = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=5, stop_token_ids=(2,))


def _export(tmp_path, tokenizer):
    """A causal LM's weights and config only, as the engine exports them, and the run's tokenizer apart."""
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    model = build_tiny_model(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    model.save_pretrained(tmp_path / "export")
    (tmp_path / "export" / "generation_config.json").unlink()
    return tmp_path / "export", tmp_path / "tokenizer"


def test_an_export_gets_the_tokenizer_and_the_runs_sampling(tmp_path):
    export, tokenizer_dir = _export(tmp_path, build_char_tokenizer())
    complete_hf_export(export, tokenizer_dir, SAMPLING)
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert tokenizer("12+3=").input_ids == build_char_tokenizer()("12+3=").input_ids
    generation = GenerationConfig.from_pretrained(export)
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (1, 2, 0)
    assert generation.do_sample and (generation.temperature, generation.top_p, generation.top_k) == (0.7, 0.9, 0)
    assert generation.max_new_tokens == 5
    model = AutoModelForCausalLM.from_pretrained(export)
    prompt = tokenizer("1+1=", return_tensors="pt")
    torch.manual_seed(0)
    out = model.generate(**prompt)
    assert 1 <= out.shape[1] - prompt.input_ids.shape[1] <= 5


def test_a_tokenizer_without_pad_pads_with_eos_and_greedy_sampling_does_not_sample(tmp_path):
    tokenizer = build_char_tokenizer()
    tokenizer.pad_token = None
    export, tokenizer_dir = _export(tmp_path, tokenizer)
    complete_hf_export(export, tokenizer_dir, SamplingParams(greedy=True, max_new_tokens=3, stop_token_ids=(2, 7)))
    generation = GenerationConfig.from_pretrained(export)
    assert not generation.do_sample and generation.pad_token_id == 2 and generation.eos_token_id == [2, 7]
    assert AutoTokenizer.from_pretrained(export).pad_token_id == 2


def test_a_value_model_gets_the_tokenizer_and_no_generation_config(tmp_path):
    export, tokenizer_dir = _export(tmp_path, build_char_tokenizer())
    init_value_model_from_lm(export).save_pretrained(tmp_path / "critic")
    complete_hf_export(tmp_path / "critic", tokenizer_dir, SAMPLING)
    assert not (tmp_path / "critic" / "generation_config.json").exists()
    assert AutoTokenizer.from_pretrained(tmp_path / "critic").eos_token_id == 2
    assert json.loads((tmp_path / "critic" / "config.json").read_text())["architectures"][0].endswith("Classification")
    AutoModelForTokenClassification.from_pretrained(tmp_path / "critic")
