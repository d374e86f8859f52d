"""Every family through the pipeline split: chained stages equal HF's own forward, sliding windows included."""

from __future__ import annotations

import pytest
import torch

from rlflow.engine.pipeline import build_stage
from rlflow.families import get_family, list_families
from rlflow.parallel.layout import pipeline_stages

# A window shorter than the rows, so that a layer given the wrong mask changes the logits. The
# Qwen families slide from layer `max_window_layers` on; Mistral slides everywhere; Llama ignores it.
CONFIG = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    sliding_window=3,
    use_sliding_window=True,
    max_window_layers=1,
)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("name", list_families())
def test_chained_stages_equal_the_hf_model(name, tied):
    family = get_family(name)
    config = family.build_config(**CONFIG, tie_word_embeddings=tied)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = family.causal_lm_class(config).eval()
    ids = torch.randint(1, 96, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    pos = ((mask.cumsum(1) - 1) * mask).clamp(min=0)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        stages = [build_stage(model, 3, r).eval() for r in range(3)]
        x = ids
        for stage in stages:
            x = stage(x, attention_mask=mask, position_ids=pos)
    assert [s.items for s in stages] == pipeline_stages(config, 3)
    valid = mask.bool()
    torch.testing.assert_close(x[valid], want[valid], atol=1e-5, rtol=1e-5)
    held = [{n for n, _ in s.named_parameters()} for s in stages]
    assert family.embed_name in held[0] and f"{family.norm_module}.weight" in held[2]
    if tied:  # the last stage's copy of the tied embedding
        assert family.lm_head_name in held[2]
