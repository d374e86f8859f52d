"""Partial rollouts on the built-in sampler: a response sampled over several generate calls keeps its
tokens, their log-probs and the version of the weights that sampled each of them."""

from __future__ import annotations

import doctest

import pytest
import torch
from test_interfaces import CTX, setup_for
from transformers import LlamaConfig, LlamaForCausalLM

from rlflow.algos.params import AlgorithmParams
from rlflow.engine.packing import position_ids_from_mask
from rlflow.engine.rollout import SamplingParams
from rlflow.engine.rollout import partial as partial_module
from rlflow.engine.rollout.hf_sampler import HFRolloutEngine
from rlflow.engine.rollout.partial import TOKEN_VERSION, PartialCall, prefix_prompts, unfinished_rows
from rlflow.protocol import DataProto
from rlflow.workers.interfaces import ActorInterface
from rlflow.workers.interfaces.actor import row_versions, token_lag_metrics

STOP, LIMIT, CHUNK = 3, 7, 3  # stop token, max_new_tokens, partial_tokens
PROMPTS = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10], [0, 11, 12, 13]])
PROMPT_MASK = (PROMPTS != 0).long()
PROMPT_WIDTH = PROMPTS.shape[1]


def tiny_model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def actor(**sampling) -> ActorInterface:
    params = SamplingParams(n=2, max_new_tokens=LIMIT, stop_token_ids=(STOP,), seed=11, **sampling)
    algo = AlgorithmParams("grpo", adv_estimator="grpo", n_samples=2)
    setup = setup_for(algo, sampling=params)
    return ActorInterface(setup.models["actor"], setup)


def prompts() -> DataProto:
    return DataProto.from_dict({"prompts": PROMPTS, "prompt_mask": PROMPT_MASK}, {"answers": ["a", "b", "c"]})


def sample_in_calls(policy: ActorInterface, engines: list[HFRolloutEngine]) -> DataProto:
    """Fresh rows from the first engine (version 0), then the unfinished ones continued by each next
    engine (version 1, 2...), in the rows' order."""
    rows = policy.generate(engines[0], prompts(), CTX, partial=PartialCall(CHUNK, version=0))
    for version, engine in enumerate(engines[1:], start=1):
        carried = unfinished_rows(rows.batch["input_ids"], rows.batch["response_mask"], PROMPT_WIDTH, (STOP,))
        if not carried.any():
            break
        more = policy.continue_rows(engine, rows[carried], PartialCall(CHUNK, version=version, resume=True))
        for key in rows.batch_keys:
            rows.batch[key][carried] = more.batch[key]
    return rows


def forward_logp(model: LlamaForCausalLM, rows: DataProto) -> torch.Tensor:
    """``(N, P+R)`` log-prob of every response token under ``model``, teacher-forced; 0 elsewhere."""
    ids, mask = rows.batch["input_ids"], rows.batch["attention_mask"]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(len(ids), 1), logp], dim=1) * rows.batch["response_mask"]


def test_the_partial_modules_examples_hold():
    results = doctest.testmod(partial_module)
    assert results.attempted > 0 and results.failed == 0


def test_prefix_prompts_left_pads_each_rows_prompt_and_response_so_far():
    ids = torch.tensor([[0, 5, 6, 20, 0, 0], [7, 8, 9, 21, 22, 0]])
    ids_out, mask_out = prefix_prompts(ids, (ids != 0).long())
    assert ids_out.tolist() == [[0, 0, 5, 6, 20], [7, 8, 9, 21, 22]]
    assert mask_out.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]


def test_greedy_responses_split_over_calls_equal_one_uninterrupted_call():
    engine = HFRolloutEngine(tiny_model(0))
    whole = actor(greedy=True).generate(engine, prompts(), CTX)
    split = sample_in_calls(actor(greedy=True), [engine] * 4)
    assert int(split.batch["response_mask"].sum(dim=1).max()) > CHUNK  # some responses took several calls
    for key in ("input_ids", "attention_mask", "response_mask"):
        assert torch.equal(split.batch[key], whole.batch[key]), key
    torch.testing.assert_close(split.batch["old_logp"], whole.batch["old_logp"], atol=1e-5, rtol=0)


def test_sampled_responses_share_the_first_call_and_continue_from_a_stream_of_their_own():
    """Sampling: the first call draws what an uninterrupted call with the same seed draws first; the
    continuation draws from the next rollout's seed, so later tokens may differ, but each is the
    model's own choice: its log-prob is the teacher-forced one."""
    model = tiny_model(1)
    engine = HFRolloutEngine(model)
    whole = actor(temperature=1.0).generate(engine, prompts(), CTX)
    split = sample_in_calls(actor(temperature=1.0), [engine] * 4)
    first = slice(PROMPT_WIDTH, PROMPT_WIDTH + CHUNK)
    assert torch.equal(split.batch["input_ids"][:, first], whole.batch["input_ids"][:, first])
    assert not unfinished_rows(split.batch["input_ids"], split.batch["response_mask"], PROMPT_WIDTH, (STOP,)).any()
    torch.testing.assert_close(split.batch["old_logp"], forward_logp(model, split), atol=1e-5, rtol=0)


def test_tokens_keep_the_log_probs_and_versions_of_the_weights_that_sampled_them():
    old, new = tiny_model(2), tiny_model(2)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.3 * torch.randn_like(p))
    rows = sample_in_calls(actor(temperature=1.0), [HFRolloutEngine(old), HFRolloutEngine(new)])
    mask = rows.batch["response_mask"].bool()
    versions = rows.batch[TOKEN_VERSION]
    by_old, by_new = mask & (versions == 0), mask & (versions == 1)
    columns = torch.arange(rows.batch["input_ids"].shape[1])
    assert by_new.any() and torch.equal(by_old, mask & (columns < PROMPT_WIDTH + CHUNK))
    torch.testing.assert_close(rows.batch["old_logp"][by_old], forward_logp(old, rows)[by_old], atol=1e-5, rtol=0)
    torch.testing.assert_close(rows.batch["old_logp"][by_new], forward_logp(new, rows)[by_new], atol=1e-5, rtol=0)
    assert not torch.allclose(forward_logp(old, rows)[by_new], forward_logp(new, rows)[by_new], atol=1e-3)
    # A row's version is its oldest token's; the train call's staleness is per token.
    assert row_versions(rows, 1).tolist() == [0] * len(rows)
    lags = token_lag_metrics(rows, version=2)
    share_old = float(by_old.sum() / mask.sum())
    assert lags == pytest.approx(
        {"token_lag": 2 * share_old + (1 - share_old), "token_lag_max": 2.0, "stale_token_fraction": 1.0}
    )
