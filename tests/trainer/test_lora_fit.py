"""GRPO with LoRA through the public Trainer: the base weights stay, the adapters move, the rollout
samples from the merged policy, the reference is the base with adapters disabled, the SFT warm-up
trains the adapters too, the saved adapter loads in plain peft, and a resumed run equals the run in
one go."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_fit import DRIVER_FIT, GRPO, TINY_ACTOR
from transformers import AutoModelForCausalLM

from rlflow.trainer import ConfigError, Trainer, load_config

peft = pytest.importorskip("peft")

TINY = [*TINY_ACTOR, *DRIVER_FIT, "models.actor.dtype=float32"]
LORA = [
    "models.actor.lora.r=4", "models.actor.lora.target_modules=[q_proj,v_proj,down_proj]", "models.actor.lr=0.05",
    "algorithm.entropy_coef=0.1",  # a tiny random model earns no reward: the entropy bonus gives a gradient
    "algorithm.kl_coef=0.5", "algorithm.kl_in_reward=false",  # the KL loss against the reference
    "algorithm.recompute_old_logp=true",  # logs how far the rollout's log-probs are from the trainer's
    "checkpoint.every_n_steps=1", "checkpoint.keep_last=0", "logging.rollouts_every=1",
]  # fmt: skip
ACTOR_TRAIN = "actor_train/"


def fit(run: Path, *overrides: str) -> Trainer:
    with Trainer(GRPO, overrides=[*TINY, *LORA, f"logging.dir={run}", *overrides], progress_bars=False) as trainer:
        trainer.fit()
    return trainer


def train_records(run: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if any(k.startswith(ACTOR_TRAIN) for k in r)}


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> tuple[Path, Trainer]:
    run = tmp_path_factory.mktemp("lora") / "whole"
    return run, fit(run, "trainer.total_steps=2")


def test_grpo_with_lora_trains_only_the_adapters(whole) -> None:
    run, trainer = whole
    # No reference model (the KL term reads the actor's base), so no second copy of the weights.
    assert {c.mfc.model_name for c in trainer.placement.calls.values()} == {"actor", "reward"}
    base_dir = run / "models" / "actor"  # the tiny initial model the run built
    base = load_file(base_dir / "model.safetensors")
    ckpt = run / "checkpoints" / "step_2" / "actor"
    adapters = load_file(ckpt / "engine" / "adapter" / "adapter_model.safetensors")
    assert adapters and all(v.abs().sum() > 0 for k, v in adapters.items() if ".lora_B." in k)  # moved from zero
    # The merged export is the base as loaded plus the adapters' update (alpha / r = 16 / 4).
    merged_weights, adapted = load_file(ckpt / "hf" / "model.safetensors"), set()
    for key, a in adapters.items():
        if ".lora_A." in key:
            name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            b = adapters[key.replace(".lora_A.", ".lora_B.")]
            torch.testing.assert_close(merged_weights[name], base[name] + 4.0 * (b @ a), rtol=0, atol=1e-6)
            adapted.add(name)
    assert len(adapted) == 3  # q, v and down of the one layer
    for name, value in merged_weights.items():
        if name not in adapted:
            assert torch.equal(value, base[name]), name

    records = train_records(run)
    # The rollout sampled from the merged policy: its log-probs are the trainer's at step 2 too.
    assert max(records[s]["actor_inf/logp_mismatch_max"] for s in (1, 2)) < 1e-4
    # Step 1 trains from lora_B = 0: the policy is the base, so KL(actor || ref) is 0. Step 2 is not:
    # a reference computed with the adapters on would be the policy itself and give 0 again.
    assert records[1]["actor_train/kl_loss"] == 0.0 and records[2]["actor_train/kl_loss"] > 1e-6

    # The adapter in PEFT's format loads onto the base; with it, the base is the merged export.
    ids = torch.tensor([[3, 7, 9, 4, 12, 5]])
    merged = AutoModelForCausalLM.from_pretrained(ckpt / "hf", local_files_only=True, dtype=torch.float32)
    base_model = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True, dtype=torch.float32)
    plain = base_model(input_ids=ids).logits
    with_adapter = peft.PeftModel.from_pretrained(base_model, str(ckpt / "engine" / "adapter"))
    torch.testing.assert_close(with_adapter(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=0, atol=1e-5)
    assert not torch.allclose(plain, merged(input_ids=ids).logits, atol=1e-4)  # the adapters changed the policy
    final = run / "final" / "actor"  # the export: the merged model, its adapter beside it
    assert (final / "model.safetensors").is_file() and (final / "adapter" / "adapter_model.safetensors").is_file()


def test_a_push_after_the_first_moves_only_the_adapters(whole) -> None:
    run, _ = whole
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # One worker: home and rollout copy share a device, so the push is a local copy (fp32 here).
    pushed = {r["step"]: r["realloc/actor_gen/bytes_local"] for r in records if "realloc/actor_gen/bytes_local" in r}
    base = load_file(run / "models" / "actor" / "model.safetensors")
    adapted = [k for k in base if k.rsplit(".", 2)[-2] in ("q_proj", "v_proj", "down_proj")]
    assert len(adapted) == 3
    adapters = 4 * sum(4 * sum(base[k].shape) for k in adapted)  # fp32 lora_A and lora_B: r * (in + out)
    # The first push fills the kept copy with the base, unmerged, and the adapters, which the copy
    # merges itself; later ones move the adapters only (the rollout's log-probs stay the trainer's:
    # test_grpo_with_lora_trains_only_the_adapters).
    assert pushed[1] == 4 * sum(v.numel() for v in base.values()) + adapters
    assert pushed[2] == adapters < 4 * sum(base[k].numel() for k in adapted)


def test_a_resumed_lora_run_equals_the_run_in_one_go(whole, tmp_path) -> None:
    run, _ = whole
    split = tmp_path / "split"
    fit(split, "trainer.total_steps=1")
    fit(split, "trainer.total_steps=2", "checkpoint.resume=auto")
    want, got = train_records(run)[2], train_records(split)[2]
    for key in ("actor_train/loss", "actor_train/kl_loss", "actor_train/entropy", "actor_inf/logp_mismatch_max"):
        assert got[key] == want[key], key
    # The resumed run's rollout copy got the base and the adapters afresh and merged them itself; it
    # sampled the tokens the run in one go sampled from its adapter-only push.
    rollouts = Path("rollouts", "step_2.jsonl")
    assert (split / rollouts).read_text() == (run / rollouts).read_text()
    adapter = Path("checkpoints", "step_2", "actor", "engine", "adapter", "adapter_model.safetensors")
    a, b = load_file(run / adapter), load_file(split / adapter)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_the_sft_warm_up_of_a_lora_actor_trains_its_adapters_only(tmp_path) -> None:
    run = tmp_path / "run"
    warmup = ["warmup.steps=2", "warmup.batch_size=4", "warmup.lr=0.05", "warmup.eval_every=0"]
    # GRPO's one step at lr 1e-12 moves the adapters by ~1e-12 (Adam): what moved them is the warm-up.
    fit(run, "trainer.total_steps=1", "models.actor.lr=1e-12", *warmup, "warmup.target_score=null")
    ckpt = run / "checkpoints" / "step_1" / "actor"
    adapters = load_file(ckpt / "engine" / "adapter" / "adapter_model.safetensors")
    assert max(v.abs().max().item() for k, v in adapters.items() if ".lora_B." in k) > 1e-3  # from zero
    base = load_file(run / "models" / "actor" / "model.safetensors")
    merged = load_file(ckpt / "hf" / "model.safetensors")
    kept = [k for k in base if k.rsplit(".", 2)[-2] not in ("q_proj", "v_proj", "down_proj")]
    assert kept and all(torch.equal(merged[k], base[k]) for k in kept)  # embeddings, norms, k/o/gate/up as built


def test_a_target_matching_no_module_is_a_config_error(tmp_path) -> None:
    overrides = [*TINY, f"logging.dir={tmp_path / 'run'}", "models.actor.lora.target_modules=[q_proj,qkv_proj]"]
    with pytest.raises(ConfigError, match=r"\['qkv_proj'\] match no linear module.*'down_proj'") as err:
        Trainer(GRPO, overrides=overrides, progress_bars=False).fit()
    assert err.value.key == "models.actor.lora.target_modules"


def test_a_lora_actor_needs_no_reference_model_unless_one_is_configured() -> None:
    kl = ["algorithm.kl_coef=0.1"]
    with pytest.raises(ConfigError, match="missing: algorithm 'grpo' needs a ref model"):
        load_config(GRPO, kl)  # full-parameter: the KL term needs models.ref
    assert load_config(GRPO, [*kl, "models.actor.lora.r=2"]).required_models() == ("actor",)
    with_ref = {"models": {"actor": {"lora": {"r": 2}}, "ref": {"init": "copy", "init_from": "actor"}}}
    assert load_config(with_ref, kl).required_models() == ("actor", "ref")
    # PPO with the KL in the reward: the critic's returns read the reference too, so it stays a model.
    ppo = ["algorithm.name=ppo", "algorithm.kl_in_reward=true", "models.critic.init=tiny"]
    with pytest.raises(ConfigError, match="missing: algorithm 'ppo' needs a ref model"):
        load_config(GRPO, [*kl, *ppo, "models.actor.lora.r=2"])
