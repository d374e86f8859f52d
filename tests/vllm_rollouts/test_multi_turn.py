"""Multi-turn episodes on real vLLM (CPU), one engine for the module: token in, token out (each turn's
response is the ids vLLM sampled, handed to the episode as they are, the observations placed as the
episode returned them), the loss mask on sampled tokens only, vLLM's log-probs of them, episodes of
one batch ending after different numbers of turns, and a turn ending exactly at a stop sequence."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from vllm_helpers import PAD, left_padded_prompts, tiny_model

from rlflow.engine.rollout import HFRolloutEngine, SamplingParams, get_rollout_engine
from rlflow.engine.rollout.base import stop_sequence_end
from rlflow.engine.rollout.multi_turn import ENV_REWARDS, MultiTurn
from rlflow.protocol import DataProto

pytestmark = pytest.mark.vllm
TURNS = [1, 3, 2, 4, 3, 1]  # turns each row's episodes take before they are done
GREEDY = SamplingParams(greedy=True, max_new_tokens=6, stop_token_ids=(7,))


@pytest.fixture(scope="module")
def engines():
    model = tiny_model(seed=0)
    return model, HFRolloutEngine(model), get_rollout_engine("vllm")(model)


class Scripted:
    """An episode done after its row's ``turns`` steps; each observation is two ids that depend on the
    turn and on the ids handed to ``step``, which it keeps (``seen``) with what it answered (``answers``)."""

    def reset(self, row):
        self.turns, self.seen, self.answers = int(row["turns"]), [], []
        return row["prompt_ids"]

    def step(self, ids):
        self.seen.append(list(ids))
        self.answers.append([90 + len(self.seen), 1 + sum(ids) % 50])
        return self.answers[-1], 0.25, len(self.seen) >= self.turns

    def metrics(self):
        return {"scripted/steps": float(len(self.seen))}


def _episodes(engine, params: SamplingParams, stop_sequences=(), max_total_tokens: int = 40):
    """``engine``'s episodes of the rows of ``TURNS`` and the :class:`Scripted` episodes that ran them."""
    made = []

    def make():
        made.append(Scripted())
        return made[-1]

    multi = MultiTurn(episodes=make, max_turns=4, max_total_tokens=max_total_tokens, max_prompt_tokens=16,
                      stop_sequences=stop_sequences)  # fmt: skip
    ids, mask = left_padded_prompts([5, 9, 3, 7, 12, 6], seed=4)
    prompts = DataProto.from_dict({"input_ids": ids, "attention_mask": mask}, {"turns": np.asarray(TURNS)})
    return engine.generate_episodes(prompts, params, multi), made


def _check_rows(out, made, max_total_tokens: int = 40):
    """Each row is its episode's turns and observations in order, the mask 1 on the turns only."""
    for row, episode in enumerate(made):
        ids, mask = out.batch["responses"][row].tolist(), out.batch["response_mask"][row].tolist()
        length = int(out.batch["response_attention"][row].sum())
        expected, sampled = [], []
        for turn, answer in zip(episode.seen, episode.answers):
            expected += turn
            sampled += [1] * len(turn)
            if len(expected) < length:  # the observation was appended: something was sampled after it
                expected += answer
                sampled += [0] * len(answer)
        assert ids[:length] == expected and mask[:length] == sampled, row
        assert ids[length:] == [PAD] * (max_total_tokens - length) and not any(mask[length:])
        assert out.batch["old_logp"][row][torch.tensor(sampled + [0] * (max_total_tokens - length)) == 0].eq(0).all()


def test_greedy_episodes_are_the_builtin_samplers_token_for_token(engines):
    _, hf, vllm = engines
    out, made = _episodes(vllm, GREEDY)
    expected, _ = _episodes(hf, GREEDY)
    _check_rows(out, made)
    for key in ("prompts", "responses", "response_mask", "response_attention", "attention_mask", "position_ids"):
        assert torch.equal(out.batch[key], expected.batch[key]), key
    torch.testing.assert_close(out.batch["old_logp"], expected.batch["old_logp"], atol=1e-4, rtol=0)
    # Episodes of one batch end after different numbers of turns; each turn was sampled once.
    assert [len(e.seen) for e in made] == TURNS
    assert out.meta_info["multi_turn/turns"] == pytest.approx(sum(TURNS) / len(TURNS))
    assert out.meta_info["scripted/steps"] == pytest.approx(sum(TURNS) / len(TURNS))
    assert out.non_tensor_batch[ENV_REWARDS].tolist() == [0.25 * t for t in TURNS]
    assert out.meta_info["old_logp_filtered"] is False
    lengths = [len(turn) for e in made for turn in e.seen]
    assert min(lengths) < GREEDY.max_new_tokens == max(lengths)  # turns ending on the stop token and not


def test_sampled_episodes_carry_vllms_log_probs_of_the_sampled_tokens(engines):
    model, _, vllm = engines
    params = SamplingParams(temperature=0.7, n=2, max_new_tokens=5, seed=3)
    out, made = _episodes(vllm, params)
    again, _ = _episodes(vllm, params)
    _check_rows(out, made)
    assert torch.equal(out.batch["responses"], again.batch["responses"])  # a seed fixes the episodes
    assert not torch.equal(out.batch["responses"][0], out.batch["responses"][1])  # two samples of a prompt differ
    assert [len(e.seen) for e in made] == [t for t in TURNS for _ in range(2)]
    with torch.no_grad():
        logits = model(
            input_ids=out.batch["input_ids"],
            attention_mask=out.batch["attention_mask"],
            position_ids=out.batch["position_ids"],
        ).logits
    width = out.batch["prompts"].shape[1]
    logp = torch.log_softmax(logits[:, width - 1 : -1] / 0.7, dim=-1)
    expected = logp.gather(-1, out.batch["responses"].unsqueeze(-1)).squeeze(-1) * out.batch["response_mask"]
    torch.testing.assert_close(out.batch["old_logp"], expected, atol=1e-4, rtol=0)


def test_a_turn_ends_exactly_at_a_stop_sequence(engines):
    _, hf, vllm = engines
    free, free_made = _episodes(vllm, GREEDY)
    first_turn = free_made[1].seen[0]  # a whole turn (no stop token) of row 1
    assert len(first_turn) == GREEDY.max_new_tokens, first_turn
    tag = tuple(first_turn[2:4])  # a "closing tag" the policy writes mid-turn
    out, made = _episodes(vllm, GREEDY, stop_sequences=(tag,))
    _check_rows(out, made)
    for free_episode, episode in zip(free_made, made):
        end = stop_sequence_end(free_episode.seen[0], [tag])
        kept = free_episode.seen[0] if end is None else free_episode.seen[0][: end + 1]
        assert episode.seen[0] == kept  # the first turn: the same context, cut after the tag, nothing after
        for turn in episode.seen:  # a turn ends on the tag, a stop token or its length, never past the tag
            assert stop_sequence_end(turn, [tag]) in (None, len(turn) - 1)
    assert made[1].seen[0][-2:] == list(tag) and len(made[1].seen[0]) <= 4
    expected, _ = _episodes(hf, GREEDY, stop_sequences=(tag,))
    assert torch.equal(out.batch["responses"], expected.batch["responses"])
    assert torch.equal(out.batch["response_mask"], expected.batch["response_mask"])
