"""A ``*ForSequenceClassification`` reward model (TRL's kind) loads as rlflow's value-head form —
whole, or shard by shard from its safetensors — and scores what HF's own forward scores."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, LlamaConfig, LlamaForSequenceClassification

from rlflow.data.tokenizer import build_char_tokenizer
from rlflow.engine.loading import sharded_model
from rlflow.engine.models import build_value_model, compute_values, sequence_scores
from rlflow.parallel.layout import build_layout
from rlflow.strategy import ParallelStrategy

TEXTS = ["1+1=2", "12+30=42", "7*8=", "99-9=90 ok"]


def tiny_sequence_classifier(vocab_size: int, pad_token_id: int, num_labels: int = 1):
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=num_labels,
        pad_token_id=pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config).eval()
    with torch.no_grad():  # a head far from zero and norms off one, so that a wrong load shows
        model.score.weight.normal_(0.0, 1.0)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    return model


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    tokenizer = build_char_tokenizer()
    model = tiny_sequence_classifier(len(tokenizer), tokenizer.pad_token_id)
    path = tmp_path_factory.mktemp("rm")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, tokenizer


def hf_scores(model, tokenizer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """HF's own scores of ``TEXTS`` (right padding, as TRL pads reward inputs) and the batch."""
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    assert (batch["attention_mask"] == 0).any()  # padding is there to be skipped
    with torch.no_grad():
        return model(**batch).logits[:, 0], dict(batch)


def test_a_sequence_classifier_loads_whole_or_shard_by_shard_and_scores_as_hf(reward_dir):
    path, model, tokenizer = reward_dir
    want, batch = hf_scores(model, tokenizer)
    ids, mask = batch["input_ids"], batch["attention_mask"]

    whole = build_value_model(path)  # the workers' load without safetensors
    assert type(whole).__name__ == "LlamaForTokenClassification" and torch.equal(whole.score.bias, torch.zeros(1))

    config = AutoConfig.from_pretrained(path)
    config.num_labels, config.classifier_dropout = 1, 0.0  # as the workers build a value model
    layout = build_layout(config, ParallelStrategy(), [0], fsdp=True, head="value")
    found = sharded_model(path, config, "value", layout, 0)
    assert found is not None  # not the whole-model fallback: the files lack only the bias, which is zero
    sharded, loader = found
    assert loader.zero_init == ("score.bias",)
    sharded.to_empty(device="cpu")
    loader(sharded)

    for value_model in (whole, sharded.eval()):
        with torch.no_grad():
            got = sequence_scores(compute_values(value_model, ids, mask), mask)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_sequence_classifier_of_two_labels_is_no_reward_model(tmp_path):
    tokenizer = build_char_tokenizer()
    tiny_sequence_classifier(len(tokenizer), tokenizer.pad_token_id, num_labels=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="sequence classifier of 2 labels; a reward model has one"):
        build_value_model(tmp_path)
