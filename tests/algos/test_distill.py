"""On-policy distillation: the per-token signal log pi_teacher - log pi_student, alone (estimator
reverse_kl) or mixed into a reward estimator's advantages, checked against independent arithmetic;
the teacher's call in the dataflow graph."""

from __future__ import annotations

import math

import pytest
import torch

from rlflow.algos import compute_advantages, distill_signal
from rlflow.algos.params import AlgorithmParams
from rlflow.dataflow import MFCDef
from rlflow.dataflow.algorithms import algorithm_graph, algorithm_mfcs, with_teacher
from rlflow.protocol import DataProto
from rlflow.workers.advantage import AdvantageEstimator
from rlflow.workers.context import CallContext, last_token_scatter

CTX = CallContext(MFCDef("actor_train", "actor", "train_step", ("input_ids",), (), objective="rl"))

# Two prompts x two samples; one prompt token, responses of 3, 2, 3 and 1 tokens.
MASK = [[0, 1, 1, 1], [0, 1, 1, 0], [0, 1, 1, 1], [0, 1, 0, 0]]
STUDENT = [[-9.0, -0.5, -1.0, -2.0], [-9.0, -0.1, -3.0, -7.0], [-9.0, -1.5, -0.2, -0.4], [-9.0, -2.5, -5.0, -5.0]]
TEACHER = [[-4.0, -0.4, -2.0, -0.5], [-4.0, -0.1, -0.5, -1.0], [-4.0, -3.5, -0.3, -0.1], [-4.0, -0.5, -1.0, -1.0]]
REWARDS = [1.0, 0.0, 0.0, 1.0]


def rows() -> DataProto:
    mask = torch.tensor(MASK)
    return DataProto.from_dict(
        {
            "response_mask": mask,
            "old_logp": torch.tensor(STUDENT),
            "teacher_logp": torch.tensor(TEACHER),
            "rewards": torch.tensor(REWARDS),
        },
        {"uid": ["a", "a", "b", "b"]},
    )


def flat(rows: list[list[float]]) -> list[float]:
    return [x for row in rows for x in row]


def reference_signal() -> list[list[float]]:
    """-(log pi_student - log pi_teacher) on each response token, 0 elsewhere: plain Python."""
    return [[(t - s) if m else 0.0 for s, t, m in zip(*row)] for row in zip(STUDENT, TEACHER, MASK)]


def test_the_signal_is_the_negative_reverse_kl_sample_of_each_sampled_token():
    signal = distill_signal(torch.tensor(STUDENT), torch.tensor(TEACHER), torch.tensor(MASK))
    assert flat(signal.tolist()) == pytest.approx(flat(reference_signal()))
    # Only response tokens count: the prompt token's log-probs (-9 vs -4) never enter.
    assert signal[:, 0].abs().sum() == 0


def test_distillation_alone_is_the_signal_undiscounted_and_unnormalised():
    algo = AlgorithmParams("distill", n_samples=2).resolved()
    assert algo.adv_estimator == "reverse_kl" and algo.uses_teacher
    adv, returns, metrics = AdvantageEstimator(algo)(rows(), CTX)
    assert flat(adv.tolist()) == pytest.approx(flat(reference_signal()))
    assert flat(returns.tolist()) == pytest.approx(flat(reference_signal()))
    tokens = [s - t for row in zip(STUDENT, TEACHER, MASK) for s, t, m in zip(*row) if m]
    assert metrics["distill_reverse_kl"] == pytest.approx(sum(tokens) / len(tokens))
    assert metrics["distill_share"] == 1.0
    assert "score_mean" in metrics  # rewards were given: still logged, never in the advantage


def test_distillation_alone_needs_no_reward():
    data = rows()
    data = DataProto.from_dict({k: data.batch[k] for k in ("response_mask", "old_logp", "teacher_logp")})
    adv, _, metrics = AdvantageEstimator(AlgorithmParams("distill", n_samples=1).resolved())(data, CTX)
    assert flat(adv.tolist()) == pytest.approx(flat(reference_signal()))
    assert "score_mean" not in metrics


def test_mixed_with_a_reward_the_signal_is_added_to_the_group_advantages():
    coef = 0.3
    algo = AlgorithmParams("grpo", n_samples=2, distill_coef=coef).resolved()
    adv, _, metrics = AdvantageEstimator(algo)(rows(), CTX)
    # GRPO by hand: each group of two is (1, 0) -> +-1/sqrt(2) after the std (unbiased, n-1) division.
    g = 1 / math.sqrt(2)
    group = [g, -g, -g, g]
    expected = [[(group[i] + coef * d) if m else 0.0 for d, m in zip(reference_signal()[i], MASK[i])] for i in range(4)]
    assert flat(adv.tolist()) == pytest.approx(flat(expected), abs=1e-5)
    distill = sum(coef * abs(d) for row in reference_signal() for d in row)
    task = sum(abs(group[i]) * m for i in range(4) for m in MASK[i])
    assert metrics["distill_share"] == pytest.approx(distill / (distill + task), rel=1e-5)
    # The task's own advantages are exactly the estimator's without a teacher.
    plain, _ = compute_advantages(
        "grpo",
        token_level_rewards=last_token_scatter(torch.tensor(REWARDS), torch.tensor(MASK).float()),
        response_mask=torch.tensor(MASK).float(),
        index=["a", "a", "b", "b"],
    )
    signal = distill_signal(*map(torch.tensor, (STUDENT, TEACHER, MASK)))
    torch.testing.assert_close(adv - plain, coef * signal)


def test_without_a_coefficient_the_advantages_ignore_a_teacher():
    algo = AlgorithmParams("grpo", n_samples=2).resolved()
    with_teacher_rows, _, metrics = AdvantageEstimator(algo)(rows(), CTX)
    data = rows()
    data.pop(["teacher_logp"])
    without, _, _ = AdvantageEstimator(algo)(data, CTX)
    assert torch.equal(with_teacher_rows, without) and "distill_share" not in metrics


def test_the_teacher_call_is_an_inference_of_the_student_samples_read_by_the_actor_train_step():
    names = [m.name for m in algorithm_mfcs("distill", use_ref=False)]
    assert names == ["actor_gen", "teacher_inf", "actor_train"]  # no reward call
    mfcs = {m.name: m for m in algorithm_mfcs("grpo", use_teacher=True)}
    teacher = mfcs["teacher_inf"]
    assert (teacher.model_name, teacher.interface_type) == ("teacher", "inference")
    assert teacher.output_keys == ("teacher_logp",) and "teacher_logp" in mfcs["actor_train"].input_keys
    graph = algorithm_graph("grpo", use_teacher=True)
    assert graph.has_edge("actor_gen", "teacher_inf") and graph.has_edge("teacher_inf", "actor_train")
    # A critic's value step never reads it: the teacher's signal enters the policy's advantages only.
    ppo = {m.name: m for m in algorithm_mfcs("ppo", use_teacher=True)}
    assert "teacher_logp" not in ppo["critic_train"].input_keys
    # With the old-log-prob recompute the student's log-probs are the trainer's.
    assert [m.name for m in algorithm_mfcs("distill", use_ref=False, recompute_old_logp=True)] == [
        "actor_gen", "actor_inf", "teacher_inf", "actor_train"
    ]  # fmt: skip


def test_a_teacher_needs_sampled_responses():
    with pytest.raises(ValueError, match="samples nothing"):
        algorithm_graph("dpo", use_teacher=True)
    with pytest.raises(ValueError, match="already has a call named 'teacher_inf'"):
        with_teacher(algorithm_mfcs("distill"))


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"name": "distill", "distill_coef": 0.5}, "reverse_kl estimator's advantage is the teacher's signal itself"),
        ({"name": "sft", "distill_coef": 0.5}, "samples nothing"),
    ],
)
def test_conflicting_distillation_options_are_refused(options, match):
    with pytest.raises(ValueError, match=f"AlgorithmParams.distill_coef=0.5: .*{match}"):
        AlgorithmParams(**options)


def test_a_kl_penalty_in_a_reward_the_teacher_estimator_never_reads_is_refused():
    with pytest.raises(ValueError, match="AlgorithmParams.kl_in_reward=True: the reverse_kl estimator reads no reward"):
        AlgorithmParams("distill", kl_coef=0.1, kl_in_reward=True)
    assert AlgorithmParams("distill", kl_coef=0.1).resolved().kl_in_reward is False  # a KL loss
