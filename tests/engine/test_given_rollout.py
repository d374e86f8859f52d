"""GKD's mixed rollouts (``rlflow.engine.rollout.given``): which prompts take their completion, how a
given response is laid out beside sampled ones, and how the two parts come back in prompt order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlflow.data.tokenizer import build_char_tokenizer
from rlflow.engine.rollout.base import assemble_rollout
from rlflow.engine.rollout.given import (
    GIVEN_RESPONSE,
    choose_given,
    completion_ids,
    given_rollout,
    merge_rollouts,
    pad_responses,
)
from rlflow.protocol import DataProto

PAD = 0


def _prompts(rows: list[list[int]], width: int = 4) -> DataProto:
    """Left-padded prompts with a ``name`` column."""
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    names = np.asarray([f"p{i}" for i in range(len(rows))], dtype=object)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask}, {"name": names})


@pytest.mark.parametrize(("prompts", "fraction", "given"), [(8, 0.5, 4), (7, 0.5, 4), (5, 0.25, 4), (3, 1.0, 0)])
def test_the_share_of_prompts_given_is_the_rounded_complement_of_the_student_fraction(prompts, fraction, given):
    chosen = choose_given(prompts, fraction, seed=(3, 0))
    assert chosen.dtype == bool and chosen.shape == (prompts,) and int(chosen.sum()) == given
    # The same seed draws the same prompts (every tp/pp rank of a dp rank, a resumed run); another seed others.
    assert np.array_equal(chosen, choose_given(prompts, fraction, seed=(3, 0)))
    draws = {tuple(choose_given(8, 0.5, seed=(s, 0))) for s in range(20)}
    assert len(draws) > 10


def test_a_completion_is_its_tokens_then_eos_cut_at_the_length_limit():
    tok = build_char_tokenizer()
    eos = tok.eos_token_id
    assert completion_ids(tok, ["12", "345"], max_new_tokens=3) == [
        tok("12", add_special_tokens=False)["input_ids"] + [eos],
        tok("345", add_special_tokens=False)["input_ids"],  # cut: no room for EOS, as a sample the limit stopped
    ]
    with pytest.raises(ValueError, match="row 1: 'completion' must be a string, got int"):
        completion_ids(tok, ["1", 7], max_new_tokens=3)


def test_given_rows_are_laid_out_as_the_rows_of_a_sampled_rollout():
    prompts = _prompts([[5, 6], [7, 8, 9]])
    out = given_rollout(prompts, [[11, 12, 2], [13]], n=2, pad_token_id=PAD)
    responses = torch.tensor([[11, 12, 2], [11, 12, 2], [13, PAD, PAD], [13, PAD, PAD]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 0, 0]])
    expected = assemble_rollout(
        prompts.batch["input_ids"], prompts.batch["attention_mask"], responses, mask, torch.zeros(4, 3), 2, prompts
    )
    assert sorted(out.batch_keys) == sorted(expected.batch_keys)
    for key in expected.batch_keys:
        torch.testing.assert_close(out.batch[key], expected.batch[key], rtol=0, atol=0, check_dtype=False)
    assert out.non_tensor_batch["name"].tolist() == ["p0", "p0", "p1", "p1"]


def test_padding_responses_extends_every_response_and_row_tensor_and_recomputes_positions():
    rows = given_rollout(_prompts([[5, 6]]), [[11, 2]], n=1, pad_token_id=PAD)
    assert pad_responses(rows, 2, PAD) is rows
    wide = pad_responses(rows, 4, PAD)
    assert wide.batch["responses"].tolist() == [[11, 2, PAD, PAD]]
    assert wide.batch["response_mask"].tolist() == [[1, 1, 0, 0]]
    assert wide.batch["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 1, 0, 0]]
    assert wide.batch["input_ids"].tolist() == [[PAD, PAD, 5, 6, 11, 2, PAD, PAD]]
    assert wide.batch["old_logp"].shape == (1, 4) and wide.batch["position_ids"].shape == (1, 8)
    with pytest.raises(ValueError, match="2 tokens wide, more than 1"):
        pad_responses(rows, 1, PAD)


def test_the_sampled_and_given_parts_come_back_in_prompt_order_with_the_given_column():
    prompts = _prompts([[5], [6], [7], [8]])
    given = np.array([False, True, False, True])
    # A "sampled" part with a marker response per prompt, narrower than the given part.
    sampled = given_rollout(prompts[~given], [[20], [22]], n=2, pad_token_id=PAD)
    sampled.meta_info["old_logp_filtered"] = False
    gave = given_rollout(prompts[given], [[31, 31, 2], [33, 2]], n=2, pad_token_id=PAD)
    out = merge_rollouts(sampled, gave, given, n=2, pad_token_id=PAD)
    assert out.non_tensor_batch["name"].tolist() == ["p0", "p0", "p1", "p1", "p2", "p2", "p3", "p3"]
    assert out.non_tensor_batch[GIVEN_RESPONSE].tolist() == [False, False, True, True, False, False, True, True]
    assert out.batch["responses"][:, 0].tolist() == [20, 20, 31, 31, 22, 22, 33, 33]
    assert out.batch["response_mask"].sum(dim=1).tolist() == [1, 1, 3, 3, 1, 1, 2, 2]
    assert out.meta_info == {"old_logp_filtered": False}  # the sampled part's
    # All given, or none: one part alone.
    only = merge_rollouts(None, given_rollout(prompts, [[9]] * 4, n=1, pad_token_id=PAD), np.ones(4, bool), 1, PAD)
    assert only.non_tensor_batch[GIVEN_RESPONSE].all() and only.non_tensor_batch["name"].tolist() == [
        "p0",
        "p1",
        "p2",
        "p3",
    ]
