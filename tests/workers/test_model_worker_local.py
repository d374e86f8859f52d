"""A ModelWorker in this process (a one-rank gloo world): PPO with a critic, SFT, DPO, reward-model
training and checkpoints, each checked against a single-process computation with plain HF models."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from worker_helpers import ANSWERS, PROMPTS, prompt_batch, save_models

from rlflow.algos import bradley_terry_loss, sft_loss
from rlflow.algos.params import AlgorithmParams
from rlflow.controller import TaskError
from rlflow.data.tiny_models import build_tiny_model
from rlflow.data.tokenizer import load_tokenizer
from rlflow.dataflow import MFCDef, algorithm_mfcs
from rlflow.engine.models import build_value_model, load_causal_lm, sequence_scores
from rlflow.engine.optim import OptimConfig
from rlflow.engine.packing import position_ids_from_mask
from rlflow.engine.rollout import SamplingParams
from rlflow.parallel.groups import clear_group_cache
from rlflow.protocol import DataProto
from rlflow.strategy import ParallelStrategy
from rlflow.workers.model_worker import ModelWorker
from rlflow.workers.setup import CallLayout, ModelSetup, WorkerSetup

pytestmark = pytest.mark.timeout(300)

ONE = CallLayout((0,), ParallelStrategy())
LR = 1e-2


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield save_models(str(tmp_path_factory.mktemp("models")))
    clear_group_cache()
    dist.destroy_process_group()


def make_worker(paths, algo: AlgorithmParams, models: dict[str, ModelSetup], **mfc_kwargs) -> ModelWorker:
    mfcs = {m.name: m for m in algorithm_mfcs(algo.name, **mfc_kwargs)}
    sampling = SamplingParams(n=algo.n_samples, max_new_tokens=4, seed=0)
    setup = WorkerSetup(
        models, mfcs, {n: ONE for n in mfcs}, algo, sampling, SamplingParams(greedy=True), paths["tokenizer"]
    )
    worker = ModelWorker(setup)
    worker.build()
    return worker


def call(worker: ModelWorker, name: str, *inputs: DataProto, step: int = 1, **kwargs) -> DataProto:
    """The driver's protocol around one MFC issued for training step ``step``."""
    hooks = worker.setup.hook_ranks(name)
    if hooks:
        worker.pre_call(name, step)
    out = getattr(worker, worker.setup.mfcs[name].interface_type)(name, *inputs, step=step, **kwargs)
    if hooks:
        worker.post_call(name, step)
    return out


def trainable(name: str, role: str, path: str, **kw) -> ModelSetup:
    return ModelSetup(name, role, path, trainable=True, optim=OptimConfig(lr=LR), **kw)


def answer_rows(paths, pairs: bool = False) -> DataProto:
    """Right-padded prompt + answer rows with ``loss_mask`` on the answer; pairs: (correct, wrong) answers."""
    tokenizer = load_tokenizer(paths["tokenizer"])
    texts = []
    for prompt, answer in zip(PROMPTS, ANSWERS):
        texts.append((prompt, answer))
        if pairs:
            texts.append((prompt, str(int(answer) + 1)))
    ids, loss = [], []
    for prompt, answer in texts:
        p, a = tokenizer(prompt).input_ids, tokenizer(answer + tokenizer.eos_token, add_special_tokens=False).input_ids
        ids.append(p + a)
        loss.append([0] * len(p) + [1] * len(a))
    width = max(len(r) for r in ids)
    pad = lambda rows: torch.tensor([r + [0] * (width - len(r)) for r in rows])  # noqa: E731
    mask = pad([[1] * len(r) for r in ids])
    return DataProto.from_dict({"input_ids": pad(ids), "attention_mask": mask, "loss_mask": pad(loss)})


def hf_inputs(rows: DataProto) -> dict[str, torch.Tensor]:
    mask = rows.batch["attention_mask"]
    return {"input_ids": rows.batch["input_ids"], "attention_mask": mask, "position_ids": position_ids_from_mask(mask)}


def test_ppo_iteration_with_critic_and_checkpoint_round_trip(paths, tmp_path):
    algo = AlgorithmParams(
        "ppo_ema", adv_estimator="gae", n_samples=2, kl_coef=0.1, kl_in_reward=True, n_minibatches=2, ppo_epochs=2
    )
    models = {
        "actor": trainable("actor", "actor", paths["actor"]),
        "critic": trainable("critic", "critic", paths["reward"], value_head=True),
        "ref": ModelSetup("ref", "ref", paths["actor"]),
        "reward": ModelSetup("reward", "reward", paths["reward"], value_head=True),
    }
    worker = make_worker(paths, algo, models, ref_ema_eta=0.5)
    gen = call(worker, "actor_gen", prompt_batch(paths["tokenizer"]))
    values = call(worker, "critic_inf", gen)
    mask = gen.batch["attention_mask"]
    raw = build_value_model(paths["reward"])(**hf_inputs(gen)).logits.squeeze(-1) * mask
    expected = torch.cat([torch.zeros(len(gen), 1), raw[:, :-1]], dim=1) * mask  # value of the prefix before t
    torch.testing.assert_close(values.batch["values"], expected, atol=1e-5, rtol=0)
    inputs = (gen, values, call(worker, "ref_inf", gen), call(worker, "reward_inf", gen))
    worker.save_checkpoint(str(tmp_path / "ckpt"))
    weights = {name: worker.residency.models[name].engine.state_dict_full for name in ("critic", "ref")}
    saved = {name: {k: v.clone() for k, v in full().items()} for name, full in weights.items()}
    actor_metrics = call(worker, "actor_train", *inputs).meta_info
    critic_metrics = call(worker, "critic_train", *inputs).meta_info
    assert actor_metrics["return_mean"] == critic_metrics["return_mean"]  # one advantage computation
    assert "kl" in actor_metrics and "kl_loss" not in actor_metrics  # the KL is in the reward
    assert critic_metrics["vf_loss"] > 0 and critic_metrics["grad_norm"] > 0
    for name in ("actor", "critic"):  # 2 mini-batches x 2 epochs
        assert worker.residency.models[name].engine.global_step == 4
    num_rollouts = worker.interfaces["actor"].num_rollouts
    call(worker, "ref_inf", call(worker, "actor_gen", prompt_batch(paths["tokenizer"])))  # EMA of the trained actor
    for name, full in weights.items():
        changed = full()
        assert any(not torch.equal(changed[k], saved[name][k]) for k in changed), name
    worker.load_checkpoint(str(tmp_path / "ckpt"))
    for name, full in weights.items():
        restored = full()
        assert all(torch.equal(restored[k], saved[name][k]) for k in restored), name
    assert worker.interfaces["actor"].num_rollouts == num_rollouts
    assert worker.residency.models["critic"].engine.global_step == 0


def test_sft_train_step_matches_cross_entropy_and_learns(paths):
    worker = make_worker(paths, AlgorithmParams("sft"), {"actor": trainable("actor", "actor", paths["actor"])})
    rows = answer_rows(paths)
    logits = load_causal_lm(paths["actor"])(**hf_inputs(rows)).logits
    mask = rows.batch["loss_mask"] * (position_ids_from_mask(rows.batch["attention_mask"]) > 0)
    expected = sft_loss(logits[:, :-1], rows.batch["input_ids"][:, 1:], mask[:, 1:])
    losses = [call(worker, "actor_train", rows).meta_info["sft_loss"] for _ in range(4)]
    assert losses[0] == pytest.approx(float(expected.detach()), abs=1e-4)
    assert losses[-1] < losses[0]


def test_dpo_starts_at_log2_and_prefers_the_chosen_answers(paths):
    models = {"actor": trainable("actor", "actor", paths["actor"]), "ref": ModelSetup("ref", "ref", paths["actor"])}
    worker = make_worker(paths, AlgorithmParams("dpo", dpo_beta=0.5), models)
    rows = answer_rows(paths, pairs=True)
    ref = call(worker, "ref_inf", rows)
    first = call(worker, "actor_train", rows, ref).meta_info
    assert first["dpo_loss"] == pytest.approx(float(torch.log(torch.tensor(2.0))), abs=1e-5)  # policy == reference
    for _ in range(3):
        last = call(worker, "actor_train", rows, ref).meta_info
    assert last["dpo_loss"] < first["dpo_loss"] and last["reward_margin"] > 0


def test_reward_model_training_is_bradley_terry_on_last_token_scores(paths):
    worker = make_worker(
        paths, AlgorithmParams("rm"), {"reward": trainable("reward", "reward", paths["reward"], value_head=True)}
    )
    rows = answer_rows(paths, pairs=True).select(batch_keys=["input_ids", "attention_mask"])
    values = build_value_model(paths["reward"])(**hf_inputs(rows)).logits.squeeze(-1)
    scores = sequence_scores(values, rows.batch["attention_mask"])
    metrics = call(worker, "reward_train", rows).meta_info
    assert metrics["rm_loss"] == pytest.approx(float(bradley_terry_loss(scores[0::2], scores[1::2]).detach()), abs=1e-5)
    with pytest.raises(
        TaskError, match=r"^reward_train \(model reward\) on rank 0: ValueError: paired rows must come in"
    ):
        call(worker, "reward_train", rows[:3])


def test_kept_copies_are_resharded_only_after_the_home_weights_change(paths):
    models = {"actor": trainable("actor", "actor", paths["actor"]), "ref": ModelSetup("ref", "ref", paths["actor"])}
    mfcs = {m.name: m for m in algorithm_mfcs("grpo", rule_based_reward=False, use_ref=True)}
    del mfcs["reward_inf"]
    algo = AlgorithmParams("grpo", adv_estimator="grpo", n_samples=2)
    setup = WorkerSetup(
        models,
        mfcs,
        {n: ONE for n in mfcs},
        algo,
        SamplingParams(n=2, max_new_tokens=4, seed=0),
        SamplingParams(greedy=True, max_new_tokens=4),
        paths["tokenizer"],
        keep_copies=("actor",),
    )
    worker = ModelWorker(setup)
    worker.build()
    stats = worker.residency.manager.stats
    batch = prompt_batch(paths["tokenizer"])
    gen = call(worker, "actor_gen", batch)
    call(worker, "actor_gen", batch)
    assert stats["reshards"] == 1  # the kept copy was current
    rewards = DataProto.from_dict({"rewards": torch.arange(len(gen), dtype=torch.float32)})
    call(worker, "actor_train", gen, call(worker, "ref_inf", gen), rewards)
    call(worker, "actor_gen", batch)
    assert stats["reshards"] == 2  # one optimizer step later the copy was stale


def test_sft_warmup_uses_its_own_optimizer_and_records_metrics(paths, monkeypatch):
    models = {"actor": trainable("actor", "actor", paths["actor"]), "ref": ModelSetup("ref", "ref", paths["actor"])}
    mfcs = {m.name: m for m in algorithm_mfcs("grpo", rule_based_reward=False)}
    del mfcs["reward_inf"]
    mfcs["warmup_sft"] = MFCDef(
        "warmup_sft", "actor", "train_step", ("input_ids", "attention_mask", "loss_mask"), objective="sft"
    )
    setup = WorkerSetup(
        models,
        mfcs,
        {n: ONE for n in mfcs},
        AlgorithmParams("grpo", adv_estimator="grpo", n_samples=2),
        SamplingParams(n=2, max_new_tokens=4, seed=0),
        SamplingParams(greedy=True, max_new_tokens=4),
        paths["tokenizer"],
    )
    worker = ModelWorker(setup)
    worker.build()
    engine = worker.residency.models["actor"].engine
    before = {k: v.clone() for k, v in engine.state_dict_full().items()}
    losses = [worker.train_step("warmup_sft", answer_rows(paths), lr=5e-2, step=0).meta_info["loss"] for _ in range(3)]
    assert losses[-1] < losses[0]
    assert not engine.optimizer.state and engine.scheduler.last_epoch == 0  # the RL optimizer is still fresh
    assert any(not torch.equal(v, before[k]) for k, v in engine.state_dict_full().items())
    gen = call(worker, "actor_gen", prompt_batch(paths["tokenizer"]), step=7)
    rewards = DataProto.from_dict({"rewards": torch.arange(len(gen), dtype=torch.float32)})
    call(worker, "actor_train", gen, call(worker, "ref_inf", gen, step=7), rewards, step=7)
    assert engine.optimizer.state and not worker.residency._side_optimizers  # warm-up optimizer dropped
    records = worker.pop_metrics()
    calls = [(r.mfc, r.model, r.kind, r.step) for r in records]
    assert calls[:3] == [("warmup_sft", "actor", "call", 0)] * 3
    assert calls[3:] == [
        ("actor_gen", "actor", "pre_call", 7),
        ("actor_gen", "actor", "call", 7),
        ("actor_gen", "actor", "post_call", 7),
        ("ref_inf", "ref", "call", 7),
        ("actor_train", "actor", "call", 7),
    ]
    assert [r.metrics["loss"] for r in records[:3]] == losses and all(r.rank == 0 for r in records)
    gen_hook = records[3]
    assert gen_hook.interval_kind == "realloc" and {r.interval_kind for r in records} == {"call", "realloc"}
    assert gen_hook.metrics["realloc_reshards"] == 1 and gen_hook.end >= gen_hook.start
    assert records[4].metrics["rows"] == len(gen) and records[4].metrics["time_s"] <= records[4].seconds
    assert worker.pop_metrics() == []

    def out_of_memory(mfc):
        raise RuntimeError(f"no memory for a copy of {mfc.model_name}")

    # A failing hook names the call, the hook and the model; the cause stays chained and no record is kept.
    monkeypatch.setattr(worker.residency, "prepare", out_of_memory)
    expected = r"^actor_gen pre_call \(model actor\) on rank 0: RuntimeError: no memory for a copy of actor$"
    with pytest.raises(TaskError, match=expected) as info:
        worker.pre_call("actor_gen", 8)
    assert isinstance(info.value.__cause__, RuntimeError) and worker.pop_metrics() == []


def test_copy_weights_gives_the_reference_and_the_critic_backbone_the_trained_actor(paths, tmp_path):
    """``init: copy`` at RL start: after a warm-up, the reference is the warmed-up actor and the
    critic its backbone under the critic's own value head, with a fresh optimizer; checkpoints
    hold the copies, so a restarted worker gets them back instead of its initial weights."""
    algo = AlgorithmParams("ppo", adv_estimator="gae", n_samples=1, kl_coef=0.1)
    models = {
        "actor": trainable("actor", "actor", paths["actor"]),
        "critic": trainable("critic", "critic", paths["actor"], value_head=True),  # actor backbone, zero head
        "ref": ModelSetup("ref", "ref", paths["actor"]),
    }
    mfcs = {m.name: m for m in algorithm_mfcs("ppo")}
    del mfcs["reward_inf"]  # rewards come from the test
    mfcs["warmup_sft"] = MFCDef(
        "warmup_sft", "actor", "train_step", ("input_ids", "attention_mask", "loss_mask"), objective="sft"
    )
    sampling = SamplingParams(n=1, max_new_tokens=4, seed=0)
    setup = WorkerSetup(
        models, mfcs, {n: ONE for n in mfcs}, algo, sampling, SamplingParams(greedy=True), paths["tokenizer"]
    )
    worker = ModelWorker(setup)
    worker.build()
    engines = {name: worker.residency.models[name].engine for name in models}
    for _ in range(2):
        worker.train_step("warmup_sft", answer_rows(paths), lr=5e-2, step=0)
    gen = call(worker, "actor_gen", prompt_batch(paths["tokenizer"]))
    rewards = DataProto.from_dict({"rewards": torch.ones(len(gen))})
    call(worker, "critic_train", gen, call(worker, "critic_inf", gen), call(worker, "ref_inf", gen), rewards)
    actor = {k: v.clone() for k, v in engines["actor"].state_dict_full().items()}
    initial = load_causal_lm(paths["actor"]).state_dict()
    assert max(float((actor[k] - initial[k]).abs().max()) for k in actor) > 1e-2  # the warm-up moved the actor
    head = {k: v.clone() for k, v in engines["critic"].state_dict_full().items() if k.startswith("score.")}

    assert worker.copy_weights("ref", "actor") == []
    assert worker.copy_weights("critic", "actor") == sorted(head)
    ref, critic = engines["ref"].state_dict_full(), engines["critic"].state_dict_full()
    assert sorted(ref) == sorted(actor) and all(torch.equal(ref[k], actor[k]) for k in actor)
    backbone = [k for k in critic if not k.startswith("score.")]
    assert backbone and all(torch.equal(critic[k], actor[k]) for k in backbone)
    assert all(torch.equal(critic[k], head[k]) for k in head)  # the critic's own (once trained) head
    assert not engines["critic"].optimizer.state and engines["critic"].scheduler.last_epoch == 0
    # The reference serves the copied weights: its log-probs are the rollout's (same policy).
    gen = call(worker, "actor_gen", prompt_batch(paths["tokenizer"]))
    ref_logp = call(worker, "ref_inf", gen).batch["ref_logp"]
    mask = gen.batch["response_mask"].bool()
    torch.testing.assert_close(ref_logp[mask], gen.batch["old_logp"][mask], atol=1e-5, rtol=0)

    worker.save_checkpoint(str(tmp_path / "ckpt"))
    restarted = ModelWorker(setup)
    restarted.build()
    assert not torch.equal(restarted.residency.models["ref"].engine.state_dict_full()[backbone[0]], actor[backbone[0]])
    restarted.load_checkpoint(str(tmp_path / "ckpt"))
    ref = restarted.residency.models["ref"].engine.state_dict_full()
    assert all(torch.equal(ref[k], actor[k]) for k in actor)


def test_copy_weights_refuses_models_whose_shared_parameters_differ_in_shape(paths, tmp_path):
    other = tmp_path / "narrower"
    build_tiny_model(
        "llama",
        vocab_size=len(load_tokenizer(paths["tokenizer"])),
        hidden_size=16,
        num_layers=2,
        num_heads=2,
        num_kv_heads=2,
        seed=0,
    ).save_pretrained(other)
    models = {"actor": trainable("actor", "actor", paths["actor"]), "ref": ModelSetup("ref", "ref", str(other))}
    worker = make_worker(paths, AlgorithmParams("dpo"), models)
    with pytest.raises(ValueError, match=r"cannot copy 'actor' into 'ref': model\.embed_tokens\.weight has shape"):
        worker.copy_weights("ref", "actor")


def test_remax_baseline_rollout_decodes_greedily(paths):
    """The graph's ``actor_gen_greedy`` call is greedy on its own: the driver passes no flag."""
    algo = AlgorithmParams("remax", adv_estimator="remax", n_samples=2)
    models = {
        "actor": trainable("actor", "actor", paths["actor"]),
        "ref": ModelSetup("ref", "ref", paths["actor"]),
        "reward": ModelSetup("reward", "reward", None, reward_fn="numeric_match"),
    }
    worker = make_worker(paths, algo, models, rule_based_reward=True)
    prompts = prompt_batch(paths["tokenizer"])
    first, second = (call(worker, "actor_gen_greedy", prompts) for _ in range(2))
    explicit = call(worker, "actor_gen", prompts, greedy=True)
    # Greedy rows: the same for both samples of a prompt, in every call, and equal to greedy=True.
    for out in (first, second):
        ids = out.batch["greedy_input_ids"]
        torch.testing.assert_close(ids, explicit.batch["input_ids"], rtol=0, atol=0)
        torch.testing.assert_close(ids[0::2], ids[1::2], rtol=0, atol=0)


def test_a_generate_calls_micro_batches_reach_its_rollout_engine(paths, monkeypatch):
    """``MFCDef.n_mbs`` of a generate call, which the planner prices, is what its engine runs."""
    from rlflow.engine.rollout import HFRolloutEngine

    built = []
    build = HFRolloutEngine.build.__func__

    def recording(cls, spec):
        built.append(spec.num_micro_batches)
        return build(cls, spec)

    monkeypatch.setattr(HFRolloutEngine, "build", classmethod(recording))
    algo = AlgorithmParams("grpo", adv_estimator="grpo", n_samples=2)
    models = {
        "actor": trainable("actor", "actor", paths["actor"]),
        "reward": ModelSetup("reward", "reward", None, reward_fn="numeric_match"),
    }
    rollouts = {}
    for n_mbs in (None, 2):
        worker = make_worker(paths, algo, models, rule_based_reward=True, use_ref=False, n_mbs=n_mbs)
        rollouts[n_mbs] = call(worker, "actor_gen", prompt_batch(paths["tokenizer"]), greedy=True)
    assert set(built) == {None, 2}
    assert len(rollouts[2]) == len(rollouts[None]) == 2 * len(PROMPTS)
    torch.testing.assert_close(rollouts[2].batch["input_ids"], rollouts[None].batch["input_ids"], rtol=0, atol=0)
