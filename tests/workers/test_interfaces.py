"""Role interfaces, losses and advantages in one process, checked against the rlflow.algos functions."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from worker_helpers import save_models

from rlflow.algos import (
    AdaptiveKLController,
    agg_loss,
    apply_kl_penalty,
    bradley_terry_loss,
    compute_advantages,
    dpo_loss,
    kl_loss,
    ppo_policy_loss,
    sft_loss,
    value_loss,
)
from rlflow.algos.params import AlgorithmParams
from rlflow.data.tokenizer import load_tokenizer
from rlflow.dataflow import MFCDef, ParamReallocHook, algorithm_mfcs
from rlflow.engine.models import load_causal_lm
from rlflow.engine.optim import OptimConfig
from rlflow.engine.rollout import HFRolloutEngine, SamplingParams
from rlflow.protocol import DataProto
from rlflow.strategy import ParallelStrategy
from rlflow.workers.advantage import AdvantageEstimator, group_ids
from rlflow.workers.context import CallContext, last_token_scatter, shift_right, temperature_scaled
from rlflow.workers.interfaces import (
    ActorInterface,
    CriticInterface,
    RewardModelInterface,
    RuleRewardInterface,
    build_interface,
    check_calls,
)
from rlflow.workers.losses import (
    dpo_loss_fn,
    pair_rows,
    policy_loss_fn,
    reward_model_loss_fn,
    sft_loss_fn,
    value_loss_fn,
)
from rlflow.workers.rows import dataflow_rows, interface_rows, reduce_metrics
from rlflow.workers.setup import CallLayout, ModelSetup, WorkerSetup

N, T = 6, 7
ONE = CallLayout((0,), ParallelStrategy())
TWO = CallLayout((0, 1), ParallelStrategy(dp=2))


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return save_models(str(tmp_path_factory.mktemp("models")))


def rl_rows(seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows of a rollout: 2 prompt tokens then responses of 1..5 tokens, random log-probs and values."""
    g = torch.Generator().manual_seed(seed)
    response = torch.zeros(N, T, dtype=torch.long)
    for r in range(N):
        response[r, 2 : 2 + 1 + r % 5] = 1
    return {
        "response_mask": response,
        "rewards": torch.randn(N, generator=g),
        "old_logp": -torch.rand(N, T, generator=g) * response,
        "ref_logp": -torch.rand(N, T, generator=g) * response,
        "values": torch.randn(N, T, generator=g),
        "greedy_rewards": torch.randn(N, generator=g),
    }


def setup_for(algo: AlgorithmParams, paths=None, sampling: SamplingParams | None = None) -> WorkerSetup:
    path = paths["actor"] if paths else "unused"
    models = {"actor": ModelSetup("actor", "actor", path, trainable=True, optim=OptimConfig())}
    mfcs = {"actor_train": MFCDef("actor_train", "actor", "train_step", ("input_ids",), (), objective="rl")}
    sampling = sampling or SamplingParams(n=algo.n_samples)
    return WorkerSetup(models, mfcs, {"actor_train": ONE}, algo, sampling, SamplingParams(greedy=True), path)


CTX = CallContext(MFCDef("actor_train", "actor", "train_step", ("input_ids",), (), objective="rl"))


# ---------------------------------------------------------------------------- advantages
def test_grpo_advantages_use_uid_groups_and_the_last_response_token():
    rows = rl_rows()
    data = DataProto.from_dict(rows, {"uid": ["a", "a", "b", "b", "c", "c"]})
    adv, ret, metrics = AdvantageEstimator(AlgorithmParams("grpo", adv_estimator="grpo", n_samples=2, kl_coef=0.1))(
        data, CTX
    )
    token_rewards = last_token_scatter(rows["rewards"], rows["response_mask"])
    assert token_rewards.sum(1).tolist() == pytest.approx(rows["rewards"].tolist())
    expected, _ = compute_advantages(
        "grpo",
        token_level_rewards=token_rewards,
        response_mask=rows["response_mask"].float(),
        index=["a", "a", "b", "b", "c", "c"],
    )
    torch.testing.assert_close(adv, expected)
    assert metrics["score_mean"] == pytest.approx(float(rows["rewards"].mean()))
    assert metrics["kl"] > 0 and metrics["kl_coef"] == 0.1  # KL measured, not in the reward (loss mode)


def test_gae_with_kl_in_reward_and_adaptive_controller():
    rows = rl_rows(1)
    algo = AlgorithmParams(
        "ppo", adv_estimator="gae", gamma=0.9, lam=0.8, kl_coef=0.2, kl_in_reward=True, kl_target=0.05, kl_horizon=100
    )
    estimator = AdvantageEstimator(algo)
    adv, ret, metrics = estimator(DataProto.from_dict(rows), CTX)
    mask = rows["response_mask"].float()
    rewards, mean_kl = apply_kl_penalty(
        last_token_scatter(rows["rewards"], mask), rows["old_logp"], rows["ref_logp"], mask, 0.2, "k3"
    )
    expected_adv, expected_ret = compute_advantages(
        "gae", token_level_rewards=rewards, response_mask=mask, values=rows["values"] * mask, gamma=0.9, lam=0.8
    )
    torch.testing.assert_close(adv, expected_adv)
    torch.testing.assert_close(ret, expected_ret)
    controller = AdaptiveKLController(0.2, target_kl=0.05, horizon=100)
    controller.update(float(mean_kl), n_steps=N)
    assert estimator.kl_controller.value == pytest.approx(controller.value)
    estimator.load_state_dict({"kl_coef": 0.3})
    assert estimator.state_dict() == {"kl_coef": 0.3}


def test_remax_uses_greedy_rewards_as_baseline():
    rows = rl_rows(2)
    adv, _, _ = AdvantageEstimator(AlgorithmParams("remax", adv_estimator="remax"))(DataProto.from_dict(rows), CTX)
    mask = rows["response_mask"].float()
    expected, _ = compute_advantages(
        "remax",
        token_level_rewards=last_token_scatter(rows["rewards"], mask),
        response_mask=mask,
        baseline_rewards=rows["greedy_rewards"],
    )
    torch.testing.assert_close(adv, expected)


def test_group_ids_fall_back_to_consecutive_blocks_and_missing_inputs_raise():
    data = DataProto.from_dict({"x": torch.zeros(4)})
    assert group_ids(data, 2, dp_rank=1).tolist() == ["dp1:0", "dp1:0", "dp1:1", "dp1:1"]
    estimator = AdvantageEstimator(AlgorithmParams("ppo", adv_estimator="gae"))
    rows = rl_rows()
    del rows["values"]
    with pytest.raises(TypeError, match="'gae' cannot run on"):
        estimator(DataProto.from_dict(rows), CTX)
    with pytest.raises(KeyError, match="advantages need \\['rewards'\\]"):
        estimator(DataProto.from_dict({"response_mask": rows["response_mask"]}), CTX)


# ---------------------------------------------------------------------------- losses
def test_policy_loss_is_the_algos_composition():
    rows = rl_rows(3)
    g = torch.Generator().manual_seed(9)
    outputs = {
        "log_probs": rows["old_logp"] + 0.3 * torch.randn(N, T, generator=g),
        "entropy": torch.rand(N, T, generator=g),
    }
    batch = {**rows, "advantages": torch.randn(N, T, generator=g) * rows["response_mask"]}
    algo = AlgorithmParams(
        "grpo",
        adv_estimator="grpo",
        clip_ratio_low=0.1,
        clip_ratio_high=0.3,
        dual_clip_c=2.0,
        entropy_coef=0.01,
        kl_estimator="k2",
        loss_agg_mode="seq-mean-token-mean",
    )
    loss, metrics = policy_loss_fn(algo, kl_coef=0.5)(outputs, batch)
    mask, mode = rows["response_mask"], "seq-mean-token-mean"
    pg = ppo_policy_loss(outputs["log_probs"], rows["old_logp"], batch["advantages"], mask, 0.1, 0.3, 2.0, mode)
    expected = (
        pg.loss
        - 0.01 * agg_loss(outputs["entropy"], mask, mode)
        + 0.5 * kl_loss(outputs["log_probs"], rows["ref_logp"], mask, "k2", mode)
    )
    torch.testing.assert_close(loss, expected)
    assert metrics["clip_fraction"] == pytest.approx(float(pg.clip_fraction))
    assert metrics["dual_clip_fraction"] == pytest.approx(float(pg.dual_clip_fraction)) and metrics["kl_loss"] > 0
    in_reward = AlgorithmParams("ppo", adv_estimator="gae", kl_in_reward=True)
    _, metrics = policy_loss_fn(in_reward, kl_coef=0.5)(outputs, batch)
    assert "kl_loss" not in metrics  # the KL is in the reward, not in the loss


def test_value_loss_reads_the_value_of_the_prefix_before_each_token():
    rows = rl_rows(4)
    raw = torch.randn(N, T, generator=torch.Generator().manual_seed(1))
    returns = torch.randn(N, T, generator=torch.Generator().manual_seed(2))
    algo = AlgorithmParams("ppo", adv_estimator="gae", value_clip=0.2, vf_coef=0.5)
    loss, metrics = value_loss_fn(algo)({"values": raw}, {**rows, "returns": returns})
    shifted = torch.cat([torch.zeros(N, 1), raw[:, :-1]], dim=1)
    expected, clip = value_loss(shifted, rows["values"], returns, rows["response_mask"], 0.2)
    torch.testing.assert_close(loss, 0.5 * expected)
    assert metrics["vf_clip_fraction"] == pytest.approx(float(clip))
    torch.testing.assert_close(shift_right(raw), shifted)


def test_pair_losses_find_pairs_after_reordering():
    g = torch.Generator().manual_seed(5)
    mask = torch.ones(4, T, dtype=torch.long)
    log_probs, ref_logp = -torch.rand(4, T, generator=g), -torch.rand(4, T, generator=g)
    perm = torch.tensor([3, 0, 2, 1])  # rows reordered as a token-balanced split might
    batch = {
        "loss_mask": mask,
        "ref_logp": ref_logp,
        "pair_index": torch.tensor([0, 0, 1, 1]),
        "chosen": torch.tensor([1, 0, 1, 0]),
    }
    shuffled = {k: v[perm] for k, v in batch.items()}
    algo = AlgorithmParams("dpo", dpo_beta=0.2, dpo_loss="ipo")
    loss, metrics = dpo_loss_fn(algo)({"log_probs": log_probs[perm]}, shuffled)
    seq, ref = log_probs.sum(1), ref_logp.sum(1)
    expected = dpo_loss(seq[0::2], seq[1::2], ref[0::2], ref[1::2], beta=0.2, loss_type="ipo").losses.mean()
    torch.testing.assert_close(loss, expected)
    values = torch.randn(4, T, generator=g)
    rm_loss, rm_metrics = reward_model_loss_fn()({"values": values[perm]}, {**shuffled, "attention_mask": mask[perm]})
    torch.testing.assert_close(rm_loss, bradley_terry_loss(values[0::2, -1], values[1::2, -1]))
    assert 0.0 <= rm_metrics["rm_accuracy"] <= 1.0
    with pytest.raises(ValueError, match="complete \\(chosen, rejected\\) pairs"):
        pair_rows({"pair_index": torch.tensor([0, 1, 1]), "chosen": torch.tensor([1, 1, 0])})


def test_sft_loss_is_next_token_cross_entropy_over_the_mask():
    g = torch.Generator().manual_seed(6)
    logits, ids = torch.randn(3, T, 11, generator=g), torch.randint(0, 11, (3, T), generator=g)
    mask = (torch.rand(3, T, generator=g) > 0.4).long()
    loss, _ = sft_loss_fn("token-mean")({"logits": logits}, {"input_ids": ids, "loss_mask": mask})
    torch.testing.assert_close(loss, sft_loss(logits[:, :-1], ids[:, 1:], mask[:, 1:]))


# ---------------------------------------------------------------------------- actor rollout and rewards
def test_actor_generate_aligns_sampler_output_and_repeats_greedy_rows(paths):
    tokenizer = load_tokenizer(paths["tokenizer"], padding_side="left")
    enc = tokenizer(["1+2=", "30+4="], padding=True, return_tensors="pt")
    data = DataProto.from_dict({"prompts": enc.input_ids, "prompt_mask": enc.attention_mask}, {"answers": ["3", "34"]})
    sampling = SamplingParams(n=3, max_new_tokens=4, temperature=0.7, seed=0)
    actor = ActorInterface(
        ModelSetup("actor", "actor", paths["actor"], trainable=True, optim=OptimConfig()),
        setup_for(AlgorithmParams("grpo", adv_estimator="grpo", n_samples=3), paths, sampling),
    )
    engine = HFRolloutEngine(load_causal_lm(paths["actor"]))
    out = actor.generate(engine, data, CTX)
    expected = engine.generate(
        (enc.input_ids, enc.attention_mask), SamplingParams(n=3, max_new_tokens=4, temperature=0.7, seed=0)
    )
    width = enc.input_ids.shape[1]
    torch.testing.assert_close(out.batch["old_logp"][:, width:], expected["old_logp"])
    assert torch.equal(out.batch["input_ids"][:, width:], expected["responses"])
    assert torch.equal(out.batch["response_mask"][:, width:], expected["response_mask"])
    assert out.non_tensor_batch["answers"].tolist() == ["3"] * 3 + ["34"] * 3
    assert (
        len(set(out.non_tensor_batch["uid"][:3])) == 1
        and out.non_tensor_batch["uid"][0] != out.non_tensor_batch["uid"][3]
    )
    greedy = actor.generate(engine, data, CTX, greedy=True)
    assert len(greedy) == 6 and torch.equal(greedy.batch["input_ids"][0], greedy.batch["input_ids"][2])
    assert "uid" not in greedy.non_tensor_keys and actor.num_rollouts == 2
    assert actor.sampling_params(greedy=False, evaluate=False)[0].seed != sampling.seed  # a fresh stream per rollout


def test_evaluation_rollouts_do_not_move_the_training_sampling_stream(paths):
    """Evaluating between two rollouts (even with sampled evaluation) leaves the second one as it was."""
    tokenizer = load_tokenizer(paths["tokenizer"], padding_side="left")
    enc = tokenizer(["1+2=", "30+4="], padding=True, return_tensors="pt")
    data = DataProto.from_dict({"prompts": enc.input_ids, "prompt_mask": enc.attention_mask}, {"answers": ["3", "34"]})
    sampling = SamplingParams(n=2, max_new_tokens=4, temperature=3.0, seed=5)  # hot: every seed samples apart
    setup = replace(setup_for(AlgorithmParams("grpo", adv_estimator="grpo"), paths, sampling), eval_sampling=sampling)
    model = ModelSetup("actor", "actor", paths["actor"], trainable=True, optim=OptimConfig())
    engine = HFRolloutEngine(load_causal_lm(paths["actor"]))
    plain, evaluating = ActorInterface(model, setup), ActorInterface(model, setup)
    plain.generate(engine, data, CTX)
    evaluating.generate(engine, data, CTX)
    evaluated = evaluating.generate(engine, data, CTX, evaluate=True)
    second = plain.generate(engine, data, CTX)
    assert torch.equal(evaluating.generate(engine, data, CTX).batch["input_ids"], second.batch["input_ids"])
    # The evaluation sampled from a stream of its own, not the training rollout's.
    assert not torch.equal(evaluated.batch["input_ids"], second.batch["input_ids"])
    assert (evaluating.num_rollouts, evaluating.num_eval_rollouts) == (2, 1)
    restored = ActorInterface(model, setup)
    restored.load_state_dict(evaluating.state_dict())
    assert (restored.num_rollouts, restored.num_eval_rollouts) == (2, 1)


def test_rule_reward_decodes_prompt_and_response(paths):
    tokenizer = load_tokenizer(paths["tokenizer"])
    rows = [("12+3=", "15"), ("4+5=", "8"), ("2+2=", "4<eos>")]
    ids, masks = [], []
    width = 10
    for prompt, response in rows:
        p, r = tokenizer(prompt).input_ids, tokenizer(response, add_special_tokens=False).input_ids
        pad = width - len(p) - len(r)
        ids.append(p + r + [0] * pad)
        masks.append([0] * len(p) + [1] * len(r) + [0] * pad)
    input_ids, response_mask = torch.tensor(ids), torch.tensor(masks)
    attention_mask = (input_ids != 0).long()
    data = DataProto.from_dict(
        {"input_ids": input_ids, "attention_mask": attention_mask, "response_mask": response_mask},
        {"answers": ["15", "9", "4"]},
    )
    model = ModelSetup("reward", "reward", None, reward_fn="numeric_match")
    interface = build_interface(model, setup_for(AlgorithmParams("grpo", adv_estimator="grpo"), paths))
    assert isinstance(interface, RuleRewardInterface)
    out = interface.inference(None, data, CTX)
    assert out.batch["rewards"].tolist() == [1.0, 0.0, 1.0] and out.meta_info["score_mean"] == pytest.approx(2 / 3)


def test_temperature_scaled_divides_the_head_logits(paths):
    model = load_causal_lm(paths["actor"])
    ids = torch.tensor([[5, 6, 7]])
    plain = model(input_ids=ids).logits
    with temperature_scaled(SimpleNamespace(stage=model), 0.5):
        scaled = model(input_ids=ids).logits
    torch.testing.assert_close(scaled, plain / 0.5)
    torch.testing.assert_close(model(input_ids=ids).logits, plain)  # the hook is gone


# ---------------------------------------------------------------------------- setup and rows plumbing
def test_setup_placement_rules_and_hook_ranks():
    mfcs = {m.name: m for m in algorithm_mfcs("ppo_ema")}
    models = {
        "actor": ModelSetup("actor", "actor", "a", trainable=True, optim=OptimConfig()),
        "critic": ModelSetup("critic", "critic", "c", trainable=True, optim=OptimConfig(), value_head=True),
        "ref": ModelSetup("ref", "ref", "a"),
        "reward": ModelSetup("reward", "reward", "r", value_head=True),
    }
    rank2, rank3 = CallLayout((2,), ParallelStrategy()), CallLayout((3,), ParallelStrategy())
    layouts = {name: TWO for name in mfcs} | {"ref_inf": rank2, "critic_inf": rank3}
    setup = WorkerSetup(
        models, mfcs, layouts, AlgorithmParams("ppo", adv_estimator="gae"), SamplingParams(), SamplingParams(), "t"
    )
    assert setup.hook_ranks("actor_gen") == (0, 1)  # a rollout always runs on a copy
    assert setup.hook_ranks("actor_train") == () and setup.hook_ranks("reward_inf") == ()
    assert setup.hook_ranks("critic_inf") == (0, 1, 3)  # copy of the critic off its home
    assert setup.hook_ranks("ref_inf") == (0, 1, 2)  # EMA: actor home ∪ ref home
    assert not setup.offloads_home("ref") and setup.home_layout("ref") == rank2
    with pytest.raises(ValueError, match="must be a frozen model"):
        bad = dict(
            mfcs,
            critic_inf=MFCDef(
                "critic_inf", "critic", "inference", ("input_ids",), ("values",), pre_hooks=(ParamReallocHook("actor"),)
            ),
        )
        WorkerSetup(models, bad, layouts, setup.algo, SamplingParams(), SamplingParams(), "t")
    with pytest.raises(ValueError, match="has no layout"):
        WorkerSetup(models, mfcs, {"actor_gen": TWO}, setup.algo, SamplingParams(), SamplingParams(), "t")
    with pytest.raises(ValueError, match="pairs must stay in one micro-batch"):
        dpo = {m.name: m for m in algorithm_mfcs("dpo", n_mbs=2)}
        pair_models = {k: models[k] for k in ("actor", "ref")}
        WorkerSetup(
            pair_models, dpo, {n: TWO for n in dpo}, AlgorithmParams("dpo"), SamplingParams(), SamplingParams(), "t"
        )
    check_calls(setup)
    with pytest.raises(ValueError, match="'ref_train' is a train_step call, which RefInterface does not serve"):
        ref_train = MFCDef("ref_train", "critic", "train_step", ("input_ids",), (), objective="value")
        check_calls(SimpleNamespace(mfcs={"ref_train": ref_train}, models={"critic": models["ref"]}))
    with pytest.raises(ValueError, match="a critic needs value_head=True"):
        ModelSetup("critic", "critic", "c")


@pytest.mark.parametrize(
    ("interface", "objective"), [(ActorInterface, "value"), (CriticInterface, "rl"), (RewardModelInterface, "sft")]
)
def test_a_train_call_whose_objective_the_role_does_not_train_is_refused(interface, objective):
    mfc = MFCDef("train", "m", "train_step", ("input_ids",), (), objective=objective)
    with pytest.raises(ValueError, match=f"objective='{objective}', which {interface.__name__} does not train"):
        interface.check_mfc(mfc)
    for served in interface.objectives:  # every objective the role declares passes
        interface.check_mfc(MFCDef("train", "m", "train_step", ("input_ids",), (), objective=served))


def test_interface_rows_rename_inputs_and_dataflow_rows_rename_outputs():
    greedy_reward = next(m for m in algorithm_mfcs("remax") if m.name == "reward_inf_greedy")
    rows = {f"greedy_{k}": torch.ones(2, 3, dtype=torch.long) for k in ("input_ids", "attention_mask", "response_mask")}
    data = interface_rows(greedy_reward, (DataProto.from_dict(rows, {"answers": ["1", "2"]}, {"mfc": "x"}),))
    assert sorted(data.keys) == ["answers", "attention_mask", "input_ids", "response_mask"] and data.meta_info == {}
    out = dataflow_rows(greedy_reward, DataProto.from_dict({"rewards": torch.zeros(2)}), passthrough=False)
    assert out.keys == ["greedy_rewards"]
    with pytest.raises(KeyError, match="needs input keys \\['greedy_response_mask'\\]"):
        interface_rows(greedy_reward, (DataProto.from_dict({k: v for k, v in rows.items() if "response" not in k}),))
    assert reduce_metrics({"time_s": 1.0, "loss": 2.0, "tokens": 5.0}, 3, CTX) == {
        "time_s": 1.0,
        "loss": 2.0,
        "tokens": 5.0,
        "rows": 3,
    }
    assert np.all(group_ids(data, 1, 0) == np.array(["dp0:0", "dp0:1"], dtype=object))
