"""The vLLM engine against the built-in sampler on the same weights (needs a GPU and vllm)."""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import left_padded_prompts, tiny_model

from rlflow.engine.rollout import HFRolloutEngine, SamplingParams, build_rollout_engine

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def engines():
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("vLLM needs a CUDA device")
    model = tiny_model(seed=0).cuda()
    vllm_engine = build_rollout_engine("vllm", model, dtype="float32", gpu_memory_utilization=0.2, enforce_eager=True)
    return model, HFRolloutEngine(model), vllm_engine


def test_greedy_matches_builtin_sampler(engines):
    _, hf, vllm = engines
    ids, mask = left_padded_prompts([5, 9, 3, 7], seed=0)
    params = SamplingParams(greedy=True, max_new_tokens=10)
    expected, got = hf.generate((ids, mask), params), vllm.generate((ids, mask), params)
    assert torch.equal(got["responses"], expected["responses"])
    torch.testing.assert_close(got["old_logp"], expected["old_logp"], atol=1e-3, rtol=0)


def test_sampled_log_probs_are_the_policy_log_probs(engines):
    model, _, vllm = engines
    ids, mask = left_padded_prompts([5, 9], seed=1)
    out = vllm.generate((ids, mask), SamplingParams(temperature=0.7, n=2, max_new_tokens=8, seed=0))
    with torch.no_grad():
        logits = model(
            input_ids=out["input_ids"].cuda(),
            attention_mask=out["attention_mask"].cuda(),
            position_ids=out["position_ids"].cuda(),
        ).logits.float()
    logp = torch.log_softmax(logits[:, ids.shape[1] - 1 : -1] / 0.7, dim=-1).cpu()
    expected = logp.gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1) * out["response_mask"]
    torch.testing.assert_close(out["old_logp"], expected, atol=1e-3, rtol=0)


def test_update_weights_switches_the_policy(engines):
    _, _, vllm = engines
    other = tiny_model(seed=3).cuda()
    vllm.update_weights(other.state_dict())
    ids, mask = left_padded_prompts([4, 6], seed=2)
    params = SamplingParams(greedy=True, max_new_tokens=6)
    expected = HFRolloutEngine(other).generate((ids.cuda(), mask.cuda()), params)["responses"].cpu()
    assert torch.equal(vllm.generate((ids, mask), params)["responses"], expected)
