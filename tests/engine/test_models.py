"""Loading, saving and value models: everything goes through HF save_pretrained/from_pretrained."""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import left_padded_prompts, tiny_config, tiny_model
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from rlflow.engine.models import (
    build_value_model,
    compute_values,
    init_value_model_from_lm,
    load_causal_lm,
    resolve_dtype,
    save_model,
    sequence_scores,
)
from rlflow.engine.packing import position_ids_from_mask

torch.set_num_threads(1)


def _logits(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits


@pytest.fixture(scope="module")
def actor_dir(tmp_path_factory):
    return save_model(tiny_model("llama", seed=7), tmp_path_factory.mktemp("ckpt") / "actor")


def test_saved_actor_loads_with_plain_hf(actor_dir):
    ids, mask = left_padded_prompts([4, 6], seed=0)
    reference = _logits(tiny_model("llama", seed=7), ids, mask)
    assert (actor_dir / "model.safetensors").is_file() and not list(actor_dir.glob("*.bin"))
    assert not [p for p in actor_dir.parent.iterdir() if p.name.startswith(".")], "temporary dirs left behind"
    torch.testing.assert_close(_logits(AutoModelForCausalLM.from_pretrained(actor_dir), ids, mask), reference)
    loaded = load_causal_lm(actor_dir, dtype="fp32")
    assert not loaded.training
    torch.testing.assert_close(_logits(loaded, ids, mask), reference)


def test_save_replaces_an_existing_checkpoint(tmp_path):
    ids, mask = left_padded_prompts([5], seed=1)
    target = tmp_path / "actor"
    save_model(tiny_model(seed=1), target)
    save_model(tiny_model(seed=2), target)
    torch.testing.assert_close(_logits(load_causal_lm(target), ids, mask), _logits(tiny_model(seed=2), ids, mask))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["actor"]


def test_load_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_causal_lm(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty.*no config.json"):
        load_causal_lm(tmp_path / "empty")
    with pytest.raises(ValueError, match="dtype='int8'"):
        resolve_dtype("int8")
    assert resolve_dtype("bf16") is torch.bfloat16


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_value_model_round_trip(tmp_path, arch):
    torch.manual_seed(0)
    critic = build_value_model(tiny_config(arch))
    ids, mask = left_padded_prompts([3, 6, 5], seed=2)
    values = compute_values(critic, ids, mask)
    assert values.shape == ids.shape and values.dtype == torch.float32
    path = save_model(critic, tmp_path / "critic")
    reloaded = build_value_model(path)
    assert type(reloaded).__name__.endswith("ForTokenClassification")
    torch.testing.assert_close(compute_values(reloaded, ids, mask), values)
    plain = AutoModelForTokenClassification.from_pretrained(path)
    with torch.no_grad():
        hf_values = plain(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    torch.testing.assert_close(hf_values.squeeze(-1), values)
    critic.train()  # no dropout on the value head: train mode gives the same values
    with torch.no_grad():
        torch.testing.assert_close(compute_values(critic, ids, mask), values)


def test_value_model_ignores_left_padding():
    torch.manual_seed(0)
    critic = build_value_model(tiny_config())
    ids, mask = left_padded_prompts([3, 6], seed=3)
    with torch.no_grad():
        padded = compute_values(critic, ids, mask)
        alone = compute_values(critic, ids[:1, 3:], mask[:1, 3:])
    torch.testing.assert_close(padded[0, 3:], alone[0], atol=1e-5, rtol=1e-5)


def test_critic_from_actor_shares_the_backbone(actor_dir):
    actor = load_causal_lm(actor_dir)
    critic = init_value_model_from_lm(actor_dir)
    for name, param in actor.model.state_dict().items():
        assert torch.equal(critic.model.state_dict()[name], param), name
    ids, mask = left_padded_prompts([4, 2], seed=4)
    assert (compute_values(critic, ids, mask) == 0).all()  # zero-initialised head
    noisy = init_value_model_from_lm(actor_dir, head_init_std=0.1)
    assert noisy.score.weight.abs().sum() > 0 and (noisy.score.bias == 0).all()
    with pytest.raises(ValueError, match="init_value_model_from_lm"):
        build_value_model(actor_dir)


def test_sequence_scores_pick_the_last_real_token():
    values = torch.arange(12, dtype=torch.float32).view(3, 4)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0], [0, 1, 1, 0]])
    assert sequence_scores(values, mask).tolist() == [3.0, 5.0, 10.0]
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        sequence_scores(values[:2], torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]]))
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        sequence_scores(values, mask[:, :2])
