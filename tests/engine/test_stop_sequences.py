"""Stop sequences in the built-in sampler: a row ends once its last sampled ids are a sequence (a tool
call's closing tag), in every decoder, keeping the tokens up to and including it and nothing after;
and the cut after sampling that the vLLM engine applies (``truncate_at_stop_sequences``) gives the same rows."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from rollout_helpers import PAD, left_padded_prompts, tiny_model

from rlflow.engine.rollout import HFRolloutEngine, SamplingParams
from rlflow.engine.rollout.base import stop_sequence_end, truncate_at_stop_sequences
from rlflow.engine.rollout.vllm_engine import to_vllm_sampling_params

torch.set_num_threads(1)

DECODERS = [{}, {"native_decode": False}, {"fast_decode": False}]
DECODER_IDS = ["native", "lean", "hf_modules"]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _first_end(row: list[int], sequences, first: int = 0) -> int | None:
    """Index of the token that first completes a sequence at or after ``first``, else None."""
    for end in range(first, len(row)):
        if any(end + 1 >= len(s) and tuple(row[end + 1 - len(s) : end + 1]) == s for s in sequences):
            return end
    return None


@pytest.mark.parametrize("decoder", DECODERS, ids=DECODER_IDS)
def test_greedy_rows_end_on_their_first_stop_sequence_and_keep_nothing_after(model, decoder):
    ids, mask = left_padded_prompts([4, 6, 5, 3, 8, 6], seed=2)
    engine = HFRolloutEngine(model, **decoder)
    free = engine.generate((ids, mask), SamplingParams(greedy=True, max_new_tokens=12))["responses"]
    # Sequences the model writes mid-response and would continue after: 3 tokens of row 0, 2 of row 1.
    sequences = (tuple(free[0, 2:5].tolist()), tuple(free[1, 4:6].tolist()))
    out = engine.generate((ids, mask), SamplingParams(greedy=True, max_new_tokens=12, stop_sequences=sequences))
    lengths = []
    for row in range(ids.shape[0]):
        end = _first_end(free[row].tolist(), sequences)
        length = 12 if end is None else end + 1
        lengths.append(length)
        assert out["responses"][row, :length].tolist() == free[row, :length].tolist()
        assert (out["responses"][row, length:] == PAD).all()
        assert out["response_mask"][row].tolist() == [1] * length + [0] * (12 - length)
        assert (out["old_logp"][row, length:] == 0).all()
    assert lengths[0] <= 5 and lengths[1] <= 6 and max(lengths) == 12, lengths  # some rows run on


@pytest.mark.parametrize("decoder", DECODERS, ids=DECODER_IDS)
def test_a_sampled_row_keeps_its_tokens_up_to_the_sequence_and_stop_tokens_still_apply(model, decoder):
    ids, mask = left_padded_prompts([5], seed=3)
    engine = HFRolloutEngine(model, **decoder)
    params = SamplingParams(max_new_tokens=16, seed=7, temperature=1.5)
    free = engine.generate((ids, mask), params)
    row = free["responses"][0].tolist()
    stopped = engine.generate((ids, mask), replace(params, stop_sequences=(tuple(row[6:9]),)))
    end = _first_end(row, (tuple(row[6:9]),))
    assert stopped["response_mask"][0].sum() == end + 1 <= 9
    assert stopped["responses"][0, : end + 1].tolist() == row[: end + 1]  # the same draws, the same tokens
    torch.testing.assert_close(stopped["old_logp"][0, : end + 1], free["old_logp"][0, : end + 1])
    both = replace(params, stop_sequences=(tuple(row[6:9]),), stop_token_ids=(row[3],))
    assert engine.generate((ids, mask), both)["response_mask"][0].sum() <= 4  # the stop token came first


@pytest.mark.parametrize("decoder", DECODERS[:2], ids=DECODER_IDS[:2])
def test_a_sequence_ending_before_min_new_tokens_does_not_stop(model, decoder):
    ids, mask = left_padded_prompts([4, 6], seed=2)
    engine = HFRolloutEngine(model, **decoder)
    free = engine.generate((ids, mask), SamplingParams(greedy=True, max_new_tokens=10))["responses"]
    sequences = (tuple(free[0, 0:2].tolist()),)  # complete at token 1
    params = SamplingParams(greedy=True, max_new_tokens=10, min_new_tokens=3, stop_sequences=sequences)
    out = engine.generate((ids, mask), params)
    end = _first_end(free[0].tolist(), sequences, first=3)
    assert int(out["response_mask"][0].sum()) == (10 if end is None else end + 1)
    assert out["responses"][0, :3].tolist() == free[0, :3].tolist()


def test_stop_sequences_are_validated_and_refused_where_they_are_not_honoured():
    with pytest.raises(ValueError, match="stop_sequences"):
        SamplingParams(stop_sequences=((),))
    with pytest.raises(ValueError, match="stop_sequences"):
        SamplingParams(stop_sequences=((1, -2),))
    assert SamplingParams(stop_sequences=[[1, 2]]).stop_sequences == ((1, 2),)
    with pytest.raises(ValueError, match="vLLM stops on text or single tokens only"):
        to_vllm_sampling_params(SamplingParams(stop_sequences=((1, 2),)), seed=0)


def test_stop_sequence_end_finds_the_first_completed_sequence_within_the_ids():
    assert stop_sequence_end([5, 1, 2, 9, 1, 2], [(1, 2)]) == 2
    assert stop_sequence_end([5, 1, 2, 9, 1, 2], [(1, 2)], first=3) == 5  # the first one ends before `first`
    assert stop_sequence_end([5, 1, 2, 9], [(1, 2), (5,)]) == 0  # the earliest end of any sequence
    assert stop_sequence_end([2, 9], [(1, 2)]) is None  # a sequence never reaches before the ids
    assert stop_sequence_end([1, 3, 2], [(1, 2)]) is None  # the ids in order and adjacent, nothing less
    assert stop_sequence_end([], [(1,)]) is None


def test_truncation_cuts_each_row_after_its_sequence_and_leaves_the_others():
    responses = torch.tensor([[4, 1, 2, 7, 7], [4, 4, 4, 0, 0], [1, 2, 5, 6, 0]])
    response_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    old_logp = -torch.arange(1.0, 16.0).reshape(3, 5) * response_mask
    before = (responses.clone(), response_mask.clone(), old_logp.clone())
    truncate_at_stop_sequences(responses, response_mask, old_logp, SamplingParams(max_new_tokens=5), PAD)
    assert all(torch.equal(a, b) for a, b in zip((responses, response_mask, old_logp), before))  # none to stop on
    params = SamplingParams(max_new_tokens=5, min_new_tokens=1, stop_sequences=((1, 2),))
    truncate_at_stop_sequences(responses, response_mask, old_logp, params, PAD)
    assert responses.tolist() == [[4, 1, 2, PAD, PAD], [4, 4, 4, 0, 0], [1, 2, PAD, PAD, PAD]]
    assert response_mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]
    assert old_logp.tolist() == [[-1, -2, -3, 0, 0], [-6, -7, -8, 0, 0], [-11, -12, 0, 0, 0]]


def test_truncating_unstopped_rows_gives_the_rows_the_sampler_stops_on(model):
    """The vLLM engine's rule against the built-in sampler's: greedy rows sampled free, then cut, equal
    the rows sampled with the sequences (one completed before ``min_new_tokens``, which must not count)."""
    ids, mask = left_padded_prompts([4, 6, 5, 3, 8, 6], seed=2)
    engine = HFRolloutEngine(model)
    params = SamplingParams(greedy=True, max_new_tokens=12, min_new_tokens=3)
    free = engine.generate((ids, mask), params)
    rows = free["responses"]
    sequences = (tuple(rows[0, 0:2].tolist()), tuple(rows[0, 5:7].tolist()), tuple(rows[2, 3:6].tolist()))
    stopped = engine.generate((ids, mask), replace(params, stop_sequences=sequences))
    cut = {k: free[k].clone() for k in ("responses", "response_mask", "old_logp")}
    truncate_at_stop_sequences(cut["responses"], cut["response_mask"], cut["old_logp"],
                               replace(params, stop_sequences=sequences), PAD)  # fmt: skip
    assert torch.equal(cut["responses"], stopped["responses"])
    assert torch.equal(cut["response_mask"], stopped["response_mask"])
    torch.testing.assert_close(cut["old_logp"], stopped["old_logp"])
    lengths = stopped["response_mask"].sum(dim=1).tolist()
    assert lengths[0] <= 7 and lengths[2] <= 6 and max(lengths) == 12, lengths  # cut rows and whole rows
