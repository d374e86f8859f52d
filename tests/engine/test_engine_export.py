"""HF export of a training engine: written by the engine's mesh, whatever its global rank."""

from __future__ import annotations

import pytest
import torch
import transformers.distributed.mixin as hf_distributed
from transformers import AutoModelForCausalLM

from rlflow.data.tiny_models import build_tiny_model
from rlflow.engine.train_engine import EngineConfig, TrainEngine


@pytest.mark.parametrize("tied", [True, False])
def test_export_is_written_when_the_home_is_not_global_rank_zero(single_mesh, tmp_path, monkeypatch, tied) -> None:
    # transformers' save_pretrained writes only on global rank 0 of an initialised world; make
    # this process look like global rank 1 (a model homed on the second worker).
    monkeypatch.setattr(hf_distributed, "_get_torch_distributed_rank", lambda: 1)
    model = build_tiny_model(family="llama", vocab_size=40, hidden_size=32, num_layers=2, num_heads=4,
                             num_kv_heads=2, intermediate_size=64, tie_word_embeddings=tied, seed=3)  # fmt: skip
    ids = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(0))
    expected = model(input_ids=ids).logits
    engine = TrainEngine(model, single_mesh, EngineConfig(device="cpu"))
    engine.save_pretrained(str(tmp_path / "hf"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True, dtype=torch.float32)
    assert loaded.config.tie_word_embeddings == tied
    torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=0, atol=1e-6)
