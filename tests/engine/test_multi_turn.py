"""Multi-turn rollouts in the built-in sampler: token in, token out, the masks, and the log-probs."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from rollout_helpers import PAD, VOCAB, tiny_model

from rlflow.engine.rollout import HFRolloutEngine, SamplingParams
from rlflow.engine.rollout.multi_turn import ENV_REWARDS, MultiTurn
from rlflow.protocol import DataProto

STOP = 3  # the stop token of every turn
OBSERVATION = [7, 8, 9, 10]


class Scripted:
    """Row ``turns`` sampled turns; each observation is OBSERVATION plus the turn number; reward 1 per turn.
    Records what each step was handed."""

    def reset(self, row):
        self.turns, self.seen = int(row["turns"]), []
        return [1, 2, 5 + int(row["turns"])]

    def step(self, ids):
        self.seen.append(list(ids))
        done = len(self.seen) >= self.turns
        return ([] if done else OBSERVATION + [len(self.seen)]), 1.0, done

    def metrics(self):
        return {"scripted/steps": float(len(self.seen))}


def _prompts(turns: list[int]) -> DataProto:
    ids = torch.tensor([[PAD, 4, 4]] * len(turns))
    mask = torch.tensor([[0, 1, 1]] * len(turns))
    columns = {"columns": [{"turns": t} for t in turns]}
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask}, {k: _objects(v) for k, v in columns.items()})


def _objects(values):
    import numpy as np

    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def _run(turns, *, max_turns=4, max_total_tokens=40, n=1, make=Scripted, overlap=False):
    episodes = []

    def maker():
        episodes.append(make())
        return episodes[-1]

    engine = HFRolloutEngine(tiny_model(), pad_token_id=PAD)
    params = SamplingParams(n=n, max_new_tokens=6, stop_token_ids=(STOP,), seed=0)
    multi = MultiTurn(
        episodes=maker, max_turns=max_turns, max_total_tokens=max_total_tokens, max_prompt_tokens=4, overlap=overlap
    )
    return engine, engine.generate_episodes(_prompts(turns), params, multi), episodes


def test_trained_ids_are_the_sampled_ids_and_the_observations_as_returned_with_only_sampled_ids_in_the_loss():
    engine, out, episodes = _run([1, 2, 3])
    for row, episode in enumerate(episodes):
        assert len(episode.seen) == episode.turns  # different numbers of turns in one batch
        expected, mask = [], []
        for turn, sampled in enumerate(episode.seen):
            expected += sampled
            mask += [1] * len(sampled)
            if turn + 1 < episode.turns:
                expected += OBSERVATION + [turn + 1]
                mask += [0] * (len(OBSERVATION) + 1)
        length = len(expected)
        assert out.batch["responses"][row, :length].tolist() == expected
        assert (out.batch["responses"][row, length:] == PAD).all()
        assert out.batch["response_mask"][row].tolist() == mask + [0] * (40 - length)
        assert (
            out.batch["response_attention"][row, :length].all()
            and not out.batch["response_attention"][row, length:].any()
        )
        assert out.non_tensor_batch[ENV_REWARDS][row] == episode.turns
        for sampled in episode.seen[:-1]:
            assert sampled[-1] == STOP or len(sampled) == 6  # a turn ends on its stop token or its limit
    assert out.meta_info["multi_turn/turns"] == pytest.approx(2.0)
    assert out.meta_info["scripted/steps"] == pytest.approx(2.0)
    observed = (out.batch["response_attention"] - out.batch["response_mask"]).sum() / out.batch[
        "response_attention"
    ].sum()
    assert out.meta_info["multi_turn/observation_share"] == pytest.approx(float(observed))


def test_old_logp_is_the_policys_log_prob_of_each_sampled_token_in_its_whole_context_and_zero_on_observations():
    engine, out, _ = _run([2, 3])
    ids, attention = out.batch["input_ids"], out.batch["attention_mask"]
    with torch.no_grad():
        logits = engine.module(input_ids=ids, attention_mask=attention, position_ids=out.batch["position_ids"]).logits
    logp = torch.log_softmax(logits.float(), dim=-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    width = out.batch["prompts"].shape[1]
    recomputed = logp[:, width - 1 :]  # the log-prob of each response token
    mask = out.batch["response_mask"].bool()
    torch.testing.assert_close(out.batch["old_logp"][mask], recomputed[mask], atol=2e-4, rtol=0)
    assert (out.batch["old_logp"][~mask] == 0).all()


def test_a_turn_limit_and_a_token_budget_end_episodes_without_a_dangling_observation():
    _, out, episodes = _run([5, 5], max_turns=2)
    assert [len(e.seen) for e in episodes] == [2, 2]
    lengths = out.batch["response_attention"].sum(dim=1)
    last = out.batch["response_mask"].gather(1, (lengths - 1)[:, None])
    assert last.all()  # every row ends on a sampled token
    _, out, _ = _run([5], max_total_tokens=8)
    assert int(out.batch["response_attention"].sum()) <= 8


class SlowOnFirst(Scripted):
    """Its first step sleeps; the steps of one turn overlap on the thread pool."""

    active = 0
    peak = 0
    lock = threading.Lock()

    def step(self, ids):
        with SlowOnFirst.lock:
            SlowOnFirst.active += 1
            SlowOnFirst.peak = max(SlowOnFirst.peak, SlowOnFirst.active)
        time.sleep(0.2)
        with SlowOnFirst.lock:
            SlowOnFirst.active -= 1
        return super().step(ids)


def test_the_steps_of_a_turn_run_concurrently_off_the_decode_loop():
    _run([1, 1, 1, 1], make=SlowOnFirst)
    assert SlowOnFirst.peak == 4


def test_a_prompt_longer_than_max_prompt_tokens_is_refused_naming_the_setting():
    class Long(Scripted):
        def reset(self, row):
            super().reset(row)
            return list(range(1, VOCAB))

    with pytest.raises(ValueError, match="max_prompt_tokens=4"):
        _run([1], make=Long)


def test_observation_tokens_get_no_gradient_from_the_policy_loss_kl_and_entropy():
    from rlflow.algos.params import AlgorithmParams
    from rlflow.workers.interfaces.actor import rollout_rows
    from rlflow.workers.losses import policy_loss_fn

    _, out, _ = _run([2, 3])
    rows = rollout_rows(out, out.batch["prompts"].shape[1]).batch
    observation = rows["attention_mask"].bool() & ~rows["response_mask"].bool()
    observation[:, : out.batch["prompts"].shape[1]] = False
    assert observation.any()
    shape = rows["response_mask"].shape
    log_probs = torch.randn(shape, requires_grad=True)
    entropy = torch.rand(shape, requires_grad=True)
    batch = {**rows, "advantages": torch.ones(shape), "ref_logp": torch.randn(shape)}
    algo = AlgorithmParams(name="grpo", entropy_coef=0.1, kl_coef=0.1, kl_in_reward=False).resolved()
    loss, _ = policy_loss_fn(algo, 0.1)({"log_probs": log_probs, "entropy": entropy}, batch)
    loss.backward()
    sampled = rows["response_mask"].bool()
    assert (log_probs.grad[observation] == 0).all() and (entropy.grad[observation] == 0).all()
    assert (log_probs.grad[sampled] != 0).all()


class SlowOneTurn(Scripted):
    """The one-turn episode's step takes 1 s; the others answer at once. Notes when its last step ended."""

    def step(self, ids):
        if self.turns == 1:
            time.sleep(1.0)
        out = super().step(ids)
        self.ended = time.perf_counter()
        return out


@pytest.mark.parametrize("overlap", [False, True])
def test_with_overlap_a_slow_step_stalls_only_its_own_episode(overlap):
    _, out, (slow, fast, faster) = _run([1, 3, 3], make=SlowOneTurn, overlap=overlap)
    assert [len(e.seen) for e in (slow, fast, faster)] == [1, 3, 3]
    # Turn by turn, the fast episodes' second turn waits for the slow step; with overlap they finish first.
    assert (max(fast.ended, faster.ended) < slow.ended) == overlap
    assert out.non_tensor_batch[ENV_REWARDS].tolist() == [1.0, 3.0, 3.0]
