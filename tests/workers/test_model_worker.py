"""Two colocated CPU model workers run a GRPO iteration by hand, with reallocation between layouts.

One worker group (ranks 0 and 1) hosts a trainable ``actor`` (home: dp=2), a frozen ``ref``
(dp=2, resident) and a value-head ``reward`` model (home dp=2, plus a call on rank 1 alone,
so it rests offloaded and is copied for that call). The driver side here does what the
trainer does: ``pre_call`` on ``setup.hook_ranks``, the call on its view, ``post_call``.
Generation always runs on a copy — dp=2 replicas, tensor parallel over both ranks, or two
pipeline stages.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from worker_helpers import eos_id, prompt_batch, save_models

from rlflow.algos.params import AlgorithmParams
from rlflow.controller import DataFuture, RayClassWithInitArgs, RayWorkerGroup, ResourcePool
from rlflow.dataflow import MFCDef, ParamReallocHook, algorithm_mfcs
from rlflow.dataflow.algorithms import GEN_OUTPUT_KEYS, PROMPT_KEYS, ROLLOUT_KEYS
from rlflow.engine.models import build_value_model, load_causal_lm
from rlflow.engine.optim import OptimConfig
from rlflow.engine.rollout import HFRolloutEngine, SamplingParams
from rlflow.protocol import DataProto
from rlflow.strategy import ParallelStrategy
from rlflow.workers.model_worker import ModelWorker
from rlflow.workers.setup import CallLayout, ModelSetup, WorkerSetup

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

N_SAMPLES, MAX_NEW, TEMPERATURE, EMA_ETA = 2, 5, 0.8, 0.5
DP2 = CallLayout((0, 1), ParallelStrategy(dp=2))
TP2 = CallLayout((0, 1), ParallelStrategy(tp=2))
PP2 = CallLayout((0, 1), ParallelStrategy(pp=2))
RANK1 = CallLayout((1,), ParallelStrategy())


def build_setup(paths: dict[str, str]) -> WorkerSetup:
    mfcs = {m.name: m for m in algorithm_mfcs("grpo", rule_based_reward=False)}
    extra = [
        MFCDef("actor_gen_tp", "actor", "generate", PROMPT_KEYS, GEN_OUTPUT_KEYS),
        MFCDef("actor_gen_pp", "actor", "generate", PROMPT_KEYS, GEN_OUTPUT_KEYS),
        MFCDef("reward_inf_one", "reward", "inference", ROLLOUT_KEYS, ("rewards",)),
        MFCDef(
            "ref_inf_ema",
            "ref",
            "inference",
            ROLLOUT_KEYS,
            ("ref_logp",),
            output_key_remap={"logp": "ref_logp"},
            pre_hooks=(ParamReallocHook("actor", EMA_ETA),),
        ),
    ]
    mfcs.update({m.name: m for m in extra})
    layouts = {name: DP2 for name in mfcs} | {"actor_gen_tp": TP2, "actor_gen_pp": PP2, "reward_inf_one": RANK1}
    models = {
        "actor": ModelSetup("actor", "actor", paths["actor"], trainable=True, optim=OptimConfig(lr=1e-2)),
        "ref": ModelSetup("ref", "ref", paths["actor"]),
        "reward": ModelSetup("reward", "reward", paths["reward"], value_head=True),
    }
    stop = (eos_id(paths["tokenizer"]),)
    return WorkerSetup(
        models,
        mfcs,
        layouts,
        AlgorithmParams("grpo", adv_estimator="grpo", n_samples=N_SAMPLES, kl_coef=0.05),
        SamplingParams(n=N_SAMPLES, temperature=TEMPERATURE, max_new_tokens=MAX_NEW, stop_token_ids=stop, seed=3),
        SamplingParams(greedy=True, max_new_tokens=MAX_NEW, stop_token_ids=stop),
        paths["tokenizer"],
    )


class Driver:
    """What the trainer does around every MFC."""

    def __init__(self, group: RayWorkerGroup, setup: WorkerSetup) -> None:
        self.group, self.setup = group, setup

    def call(self, name: str, *inputs, step: int = 1, **kwargs) -> DataFuture:
        mfc, layout = self.setup.mfcs[name], self.setup.layouts[name]
        hooks = self.setup.hook_ranks(name)
        if hooks:
            self.group.view(list(hooks)).pre_call(name, step)
        view = self.group.view(list(layout.ranks), layout.strategy)
        out = getattr(view, mfc.interface_type)(name, *inputs, step=step, **kwargs)
        if hooks:
            self.group.view(list(hooks)).post_call(name, step)
        return out

    def export(self, model: str, path) -> dict[str, torch.Tensor]:
        self.group.save_pretrained(model, str(path))
        loaded = build_value_model(str(path)) if model == "reward" else load_causal_lm(str(path))
        return {k: v.detach().clone() for k, v in loaded.state_dict().items()}


@pytest.fixture(scope="module")
def world(ray_session, tmp_path_factory):
    paths = save_models(str(tmp_path_factory.mktemp("models")))
    setup = build_setup(paths)
    pool = ResourcePool([2], cpus_per_worker=0.25)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(ModelWorker, setup))
    group.init_process_group(timeout_s=120)
    built = group.build()
    yield Driver(group, setup), paths, built
    pool.release()


@pytest.fixture(scope="module")
def iteration(world, tmp_path_factory):
    """One GRPO iteration (rollout, reference, reward, train) on dp=2, with the actor exported before and after."""
    driver, paths, _ = world
    tmp = tmp_path_factory.mktemp("exports")
    before = driver.export("actor", tmp / "before")
    batch = prompt_batch(paths["tokenizer"])
    gen = driver.call("actor_gen", batch)
    ref = driver.call("ref_inf", gen)
    reward = driver.call("reward_inf", gen)
    train = driver.call("actor_train", gen, ref, reward)
    out = {"gen": gen.get(), "ref": ref.get(), "reward": reward.get(), "train": train.get()}
    out["before"], out["after"] = before, driver.export("actor", tmp / "after")
    return out


def test_build_places_every_model_on_both_ranks(world):
    _, _, built = world
    assert [b["rank"] for b in built] == [0, 1]
    assert all(sorted(b["models"]) == ["actor", "ref", "reward"] and b["memory_bytes"] > 0 for b in built)


def test_rollout_rows_are_aligned_and_grouped(world, iteration):
    _, paths, _ = world
    gen, prompts = iteration["gen"], prompt_batch(paths["tokenizer"])
    num_rows, width = len(prompts) * N_SAMPLES, prompts.batch["prompts"].shape[1] + MAX_NEW
    assert sorted(gen.batch_keys) == ["attention_mask", "input_ids", "old_logp", "response_mask"]
    assert all(tuple(gen.batch[k].shape) == (num_rows, width) for k in gen.batch_keys)
    prompt_cols = slice(0, prompts.batch["prompts"].shape[1])
    assert torch.equal(gen.batch["input_ids"][:, prompt_cols], prompts.batch["prompts"].repeat_interleave(N_SAMPLES, 0))
    assert not gen.batch["response_mask"][:, prompt_cols].any()
    assert (gen.batch["old_logp"][gen.batch["response_mask"] == 0] == 0).all()
    assert (gen.batch["old_logp"][gen.batch["response_mask"] == 1] < 0).all()
    uid = gen.non_tensor_batch["uid"]
    assert len(set(uid)) == len(prompts) and all(uid[i] == uid[i + 1] for i in range(0, num_rows, N_SAMPLES))
    assert (
        gen.non_tensor_batch["answers"].tolist() == np.repeat(prompts.non_tensor_batch["answers"], N_SAMPLES).tolist()
    )
    assert gen.meta_info["mfc"] == "actor_gen" and gen.meta_info["rows"] == num_rows
    assert 1 <= gen.meta_info["response_length"] <= MAX_NEW and gen.meta_info["time_s"] > 0


def test_reference_and_reward_outputs(iteration):
    gen, ref, reward = iteration["gen"], iteration["ref"], iteration["reward"]
    mask = gen.batch["response_mask"].bool()
    # The reference starts as the actor: its log-probs at the sampling temperature are the rollout's.
    torch.testing.assert_close(ref.batch["ref_logp"][mask], gen.batch["old_logp"][mask], atol=1e-4, rtol=0)
    assert reward.batch["rewards"].shape == (len(gen),) and reward.batch["rewards"].std() > 0
    assert reward.meta_info["score_mean"] == pytest.approx(float(reward.batch["rewards"].mean()), abs=1e-5)


def test_train_step_reports_metrics_and_changes_the_weights(iteration):
    metrics = iteration["train"].meta_info
    for key in ("loss", "pg_loss", "clip_fraction", "approx_kl", "entropy", "kl_loss", "grad_norm", "lr", "tokens"):
        assert key in metrics, key
    assert metrics["mfc"] == "actor_train" and len(iteration["train"]) == 0
    assert metrics["approx_kl"] < 1e-4  # first step: the policy still is the rollout policy (same temperature)
    assert metrics["grad_norm"] > 0 and metrics["lr"] == pytest.approx(1e-2)
    before, after = iteration["before"], iteration["after"]
    assert max((before[k] - after[k]).abs().max().item() for k in before) > 1e-4


@pytest.mark.parametrize("name", ["actor_gen_tp", "actor_gen_pp", "actor_gen"])
def test_generate_after_train_uses_the_new_weights(world, iteration, tmp_path, name):
    """Greedy rollouts on a tp=2 copy, on pp=2 stages (pipelined) and on dp=2 copies equal one process
    running the home weights."""
    driver, paths, _ = world
    batch = prompt_batch(paths["tokenizer"])
    out = driver.call(name, batch, greedy=True, evaluate=True).get()
    driver.group.save_pretrained("actor", str(tmp_path / "actor_now"))
    model = load_causal_lm(str(tmp_path / "actor_now"))
    expected = HFRolloutEngine(model).generate(
        (batch.batch["prompts"], batch.batch["prompt_mask"]), driver.setup.eval_sampling
    )
    stale = HFRolloutEngine(load_causal_lm(paths["actor"])).generate(
        (batch.batch["prompts"], batch.batch["prompt_mask"]), driver.setup.eval_sampling
    )
    assert not torch.equal(stale["input_ids"], expected["input_ids"])  # a stale copy would be caught
    assert torch.equal(out.batch["input_ids"], expected["input_ids"])
    assert torch.equal(out.batch["attention_mask"], expected["attention_mask"])
    assert len(out) == len(batch)  # evaluation: one response per prompt


def test_offloaded_model_copy_on_another_layout_matches_home(iteration, world):
    driver, _, _ = world
    rows = DataProto.from_dict({k: iteration["gen"].batch[k] for k in ROLLOUT_KEYS})
    home = driver.call("reward_inf", rows).get()
    copy = driver.call("reward_inf_one", rows).get()
    torch.testing.assert_close(copy.batch["rewards"], home.batch["rewards"], atol=1e-5, rtol=0)


def test_ema_hook_blends_the_actor_into_the_reference(iteration, world, tmp_path):
    driver, _, _ = world
    ref_before, actor = driver.export("ref", tmp_path / "ref0"), driver.export("actor", tmp_path / "actor")
    hooks = driver.group.view(list(driver.setup.hook_ranks("ref_inf_ema")))
    hooks.pre_call("ref_inf_ema", 1)
    hooks.post_call("ref_inf_ema", 1)
    ref_after = driver.export("ref", tmp_path / "ref1")
    for k in ref_before:
        expected = (1 - EMA_ETA) * ref_before[k] + EMA_ETA * actor[k]
        torch.testing.assert_close(ref_after[k], expected, atol=1e-5, rtol=0)
