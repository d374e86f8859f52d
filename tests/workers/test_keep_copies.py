"""Kept copies (``WorkerSetup.keep_copies``): the pre-hook moves weights only when the home changed.

* one worker in this process (a one-rank gloo world), run twice on the same calls — copies
  kept and copies freed: a repeated rollout moves 0 bytes on the kept copy, and every output,
  log-prob and training metric is bit-identical to the freed-copy run (the reshard is exact);
* two Ray workers with a tensor-parallel rollout copy and a copy of an offloaded frozen model:
  after a train step the kept copy is refreshed, greedy rollouts equal one process running
  the home weights, and the rollout's log-probs equal the trainer's forward;
* ``placement.keep_copies``: null asks the planner's memory model; a GRPO fit keeps bit-identical
  weights and metrics with copies kept or freed.
"""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from worker_helpers import eos_id, prompt_batch, save_models

from rlflow.algos.params import AlgorithmParams
from rlflow.controller import RayClassWithInitArgs, RayWorkerGroup, ResourcePool
from rlflow.dataflow import MFCDef, algorithm_mfcs
from rlflow.dataflow.algorithms import GEN_OUTPUT_KEYS, PROMPT_KEYS, ROLLOUT_KEYS
from rlflow.engine.models import load_causal_lm
from rlflow.engine.optim import OptimConfig
from rlflow.engine.rollout import HFRolloutEngine, SamplingParams
from rlflow.parallel.groups import clear_group_cache
from rlflow.protocol import DataProto
from rlflow.strategy import ParallelStrategy
from rlflow.workers.model_worker import ModelWorker
from rlflow.workers.setup import CallLayout, ModelSetup, WorkerSetup
from tests.trainer.recipe_helpers import QUICK_FIT, TINY_ACTOR

pytestmark = pytest.mark.timeout(300)

ONE = CallLayout((0,), ParallelStrategy())
DP2 = CallLayout((0, 1), ParallelStrategy(dp=2))
TP2 = CallLayout((0, 1), ParallelStrategy(tp=2))
RANK1 = CallLayout((1,), ParallelStrategy())
N_SAMPLES, MAX_NEW = 2, 5
RECIPES = Path(__file__).resolve().parents[2] / "recipes"
# The actor's forward on its home: the log-probs a rollout must reproduce.
ACTOR_INF = MFCDef("actor_inf", "actor", "inference", ROLLOUT_KEYS, ("logp",))


def _setup(paths: dict[str, str], layouts: dict[str, CallLayout], mfcs: dict[str, MFCDef], keep, models=None):
    models = models or {
        "actor": ModelSetup("actor", "actor", paths["actor"], trainable=True, optim=OptimConfig(lr=1e-2)),
        "ref": ModelSetup("ref", "ref", paths["actor"]),
    }
    stop = (eos_id(paths["tokenizer"]),)
    return WorkerSetup(
        models,
        mfcs,
        layouts,
        AlgorithmParams("grpo", adv_estimator="grpo", n_samples=N_SAMPLES, kl_coef=0.05),
        SamplingParams(n=N_SAMPLES, temperature=0.8, max_new_tokens=MAX_NEW, stop_token_ids=stop, seed=3),
        SamplingParams(greedy=True, max_new_tokens=MAX_NEW, stop_token_ids=stop),
        paths["tokenizer"],
        keep_copies=keep,
    )


def _hook_metrics(records, mfc: str) -> list[dict[str, float]]:
    return [dict(r.metrics) for r in records if r.mfc == mfc and r.kind == "pre_call"]


def _same(a: DataProto, b: DataProto) -> None:
    assert sorted(a.batch_keys) == sorted(b.batch_keys)
    for k in a.batch_keys:
        assert torch.equal(a.batch[k], b.batch[k]), k


# ------------------------------------------------------------------ one worker in this process
@pytest.fixture(scope="module")
def local_paths(tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield save_models(str(tmp_path_factory.mktemp("models")))
    clear_group_cache()
    dist.destroy_process_group()


def _local_run(paths, keep: tuple[str, ...]) -> dict:
    """Two rollouts, the reference, a train step, a third rollout and the actor's forward of it."""
    mfcs = {m.name: m for m in algorithm_mfcs("grpo", rule_based_reward=False)}
    del mfcs["reward_inf"]  # rewards come from the test
    mfcs["actor_inf"] = ACTOR_INF
    worker = ModelWorker(_setup(paths, {n: ONE for n in mfcs}, mfcs, keep))
    worker.build()

    def call(name, *inputs, **kwargs):
        hooks = worker.setup.hook_ranks(name)
        if hooks:
            worker.pre_call(name, 1)
        out = getattr(worker, worker.setup.mfcs[name].interface_type)(name, *inputs, step=1, **kwargs)
        if hooks:
            worker.post_call(name, 1)
        return out

    batch = prompt_batch(paths["tokenizer"])
    out = {"gen": [call("actor_gen", batch), call("actor_gen", batch)]}
    out["eval"] = call("actor_gen", batch, greedy=True, evaluate=True)
    rewards = DataProto.from_dict({"rewards": torch.arange(len(out["gen"][0]), dtype=torch.float32)})
    out["train"] = call("actor_train", out["gen"][0], call("ref_inf", out["gen"][0]), rewards).meta_info
    out["gen"].append(call("actor_gen", batch))
    out["logp"] = call("actor_inf", out["gen"][2])
    out["hooks"] = _hook_metrics(worker.pop_metrics(), "actor_gen")
    out["weights"] = worker.residency.models["actor"].engine.state_dict_full()
    return out


def test_kept_copy_moves_nothing_until_a_train_step_and_changes_no_result(local_paths):
    kept, freed = _local_run(local_paths, ("actor",)), _local_run(local_paths, ())
    # Kept: the first rollout builds the copy, the next two find it current, the one after the
    # train step refreshes it. Freed: every rollout reshards.
    assert [h["realloc_reshards"] for h in kept["hooks"]] == [1, 0, 0, 1]
    assert [h["realloc_skipped"] for h in kept["hooks"]] == [0, 1, 1, 0]
    # (One rank copies locally: no wire bytes here; the Ray test below counts them.)
    assert [h["realloc_reshards"] for h in freed["hooks"]] == [1, 1, 1, 1]
    assert [h["realloc_skipped"] for h in freed["hooks"]] == [0, 0, 0, 0]
    for a, b in zip(kept["gen"], freed["gen"]):
        _same(a, b)
    _same(kept["eval"], freed["eval"])
    _same(kept["logp"], freed["logp"])
    numbers = {k: v for k, v in kept["train"].items() if k not in ("time_s", "peak_memory_bytes")}
    assert numbers == {k: freed["train"][k] for k in numbers}
    assert all(torch.equal(kept["weights"][k], freed["weights"][k]) for k in kept["weights"])
    # The refreshed copy samples from the trained policy: its log-probs are the trainer's forward.
    gen, mask = kept["gen"][2], kept["gen"][2].batch["response_mask"].bool()
    torch.testing.assert_close(gen.batch["old_logp"][mask], kept["logp"].batch["logp"][mask], atol=1e-5, rtol=0)


def test_keep_copies_names_models_with_weights(local_paths):
    mfcs = {m.name: m for m in algorithm_mfcs("grpo", rule_based_reward=False) if m.name != "reward_inf"}
    with pytest.raises(ValueError, match=r"keep_copies names 'critic'; expected models with weights among"):
        _setup(local_paths, {n: ONE for n in mfcs}, mfcs, ("critic",))
    with pytest.raises(TypeError, match=r"keep_copies=True; expected a tuple of model names"):
        _setup(local_paths, {n: ONE for n in mfcs}, mfcs, True)


# ------------------------------------------------------------------ two Ray workers
@pytest.fixture(scope="module")
def ray_world(ray_session, tmp_path_factory):
    """Actor home dp=2 with a tp=2 rollout; a reward model at home dp=2 and on rank 1 alone (a copy)."""
    paths = save_models(str(tmp_path_factory.mktemp("ray_models")))
    mfcs = {m.name: m for m in algorithm_mfcs("grpo", rule_based_reward=False)}
    mfcs["actor_gen_tp"] = MFCDef("actor_gen_tp", "actor", "generate", PROMPT_KEYS, GEN_OUTPUT_KEYS)
    mfcs["reward_inf_one"] = MFCDef("reward_inf_one", "reward", "inference", ROLLOUT_KEYS, ("rewards",))
    mfcs["actor_inf"] = ACTOR_INF
    layouts = {n: DP2 for n in mfcs} | {"actor_gen_tp": TP2, "reward_inf_one": RANK1}
    models = {
        "actor": ModelSetup("actor", "actor", paths["actor"], trainable=True, optim=OptimConfig(lr=1e-2)),
        "ref": ModelSetup("ref", "ref", paths["actor"]),
        "reward": ModelSetup("reward", "reward", paths["reward"], value_head=True),
    }
    setup = _setup(paths, layouts, mfcs, ("actor", "reward"), models)
    pool = ResourcePool([2], cpus_per_worker=0.25)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(ModelWorker, setup))
    group.init_process_group(timeout_s=120)
    group.build()
    yield group, setup, paths
    pool.release()


def _ray_call(group: RayWorkerGroup, setup: WorkerSetup, name: str, *inputs, **kwargs):
    hooks, layout = list(setup.hook_ranks(name)), setup.layouts[name]
    if hooks:
        group.view(hooks).pre_call(name, 1)
    out = getattr(group.view(list(layout.ranks), layout.strategy), setup.mfcs[name].interface_type)(
        name, *inputs, step=1, **kwargs
    )
    if hooks:
        group.view(hooks).post_call(name, 1)
    return out.get()


def _greedy_reference(group: RayWorkerGroup, setup: WorkerSetup, batch: DataProto, path) -> dict[str, torch.Tensor]:
    group.save_pretrained("actor", str(path))
    engine = HFRolloutEngine(load_causal_lm(str(path)))
    return engine.generate((batch.batch["prompts"], batch.batch["prompt_mask"]), setup.eval_sampling)


@pytest.mark.distributed
def test_kept_tensor_parallel_copy_is_refreshed_after_a_train_step(ray_world, tmp_path):
    group, setup, paths = ray_world
    batch = prompt_batch(paths["tokenizer"])

    def call(name, *inputs, **kwargs):
        return _ray_call(group, setup, name, *inputs, **kwargs)

    def pre_hooks(name):
        return [h for per_rank in group.pop_metrics() for h in _hook_metrics(per_rank, name)]

    gen = call("actor_gen_tp", batch)
    mask = gen.batch["response_mask"].bool()
    home = call("actor_inf", gen).batch["logp"]
    torch.testing.assert_close(gen.batch["old_logp"][mask], home[mask], atol=1e-4, rtol=0)
    assert [h["realloc_reshards"] for h in pre_hooks("actor_gen_tp")] == [1, 1]

    before = _greedy_reference(group, setup, batch, tmp_path / "before")
    again = call("actor_gen_tp", batch, greedy=True, evaluate=True)
    hooks = pre_hooks("actor_gen_tp")
    assert len(hooks) == 2 and all(h["realloc_skipped"] == 1 and h["realloc_reshards"] == 0 for h in hooks)
    assert all(h["realloc_sent_bytes"] == 0 and h["realloc_received_bytes"] == 0 for h in hooks)
    assert torch.equal(again.batch["input_ids"], before["input_ids"])

    rows = DataProto.from_dict({k: gen.batch[k] for k in ROLLOUT_KEYS})
    call("actor_train", gen, call("ref_inf", gen), call("reward_inf", rows))
    after = _greedy_reference(group, setup, batch, tmp_path / "after")
    assert not torch.equal(after["input_ids"], before["input_ids"])  # a stale copy would be caught
    fresh = call("actor_gen_tp", batch, greedy=True, evaluate=True)
    assert torch.equal(fresh.batch["input_ids"], after["input_ids"])
    gen = call("actor_gen_tp", batch)
    mask = gen.batch["response_mask"].bool()
    logp = call("actor_inf", gen).batch["logp"]
    torch.testing.assert_close(gen.batch["old_logp"][mask], logp[mask], atol=1e-4, rtol=0)
    refreshed = pre_hooks("actor_gen_tp")  # rank 0's two hooks, then rank 1's
    assert [h["realloc_reshards"] for h in refreshed] == [1, 0, 1, 0]  # refreshed once, then current

    # A frozen model's kept copy (its home rests offloaded) is made once and matches home.
    copies = [call("reward_inf_one", rows) for _ in range(2)]
    home = call("reward_inf", rows)
    for copy in copies:
        torch.testing.assert_close(copy.batch["rewards"], home.batch["rewards"], atol=1e-5, rtol=0)
    hooks = pre_hooks("reward_inf_one")  # ranks 0 (home) and 1 (the copy), two calls each
    assert [(h["realloc_reshards"], h["realloc_skipped"]) for h in hooks] == [(1, 0), (0, 1)] * 2


# ------------------------------------------------------------------ the config field
def test_null_keep_copies_follows_the_planners_memory_model(caplog):
    caplog.set_level(logging.INFO, logger="rlflow")
    from rlflow.planner.model_spec import model_preset
    from rlflow.trainer.build import build_dataflow, kept_copies
    from rlflow.trainer.config import load_config
    from rlflow.trainer.placement import plan_placement

    def decide(preset: str, extra: list[str]) -> tuple[str, ...]:
        cfg = load_config(
            RECIPES / "grpo_arithmetic.yaml", ["placement.mode=heuristic", "placement.devices_per_node=8", *extra]
        )
        specs = {name: model_preset(preset) for name in ("actor", "ref")}
        placement = plan_placement(cfg, build_dataflow(cfg, rule_reward=True), specs, use_gpu=True, progress=False)
        return kept_copies(cfg, ["actor", "ref"], placement, use_gpu=True)

    assert decide("llama2-7b", []) == ("actor",)  # the ref is resident at home: it has no copy
    assert "planner's memory model): kept copies of ['actor']" in caplog.text
    caplog.clear()
    # 70B on 8 devices: fp32 master shards, optimizer state and a tp=8 copy leave no room to keep it.
    assert decide("llama2-70b", []) == ()
    assert "kept copies of [], freed for ['actor']" in caplog.text
    assert decide("llama2-70b", ["placement.keep_copies=true"]) == ("actor", "ref")
    assert decide("llama2-7b", ["placement.keep_copies=false"]) == ()


FIT = [
    "trainer.total_steps=2",
    *QUICK_FIT,
    "checkpoint.save_final=true",
    "algorithm.n_samples=2",
    "algorithm.entropy_coef=0.1",
    *TINY_ACTOR,
]


# Logged numbers that differ from run to run: the wall clock, timings, throughputs, memory peaks;
# and the bytes reallocations moved ("realloc/"), which a kept current copy saves.
_RUN_PREFIXES = ("time/", "startup/", "perf/", "memory/", "realloc/")
_RUN_SUFFIXES = ("time_s", "_seconds", "memory_bytes", "throughput", "tokens_per_s")


def _content(record: dict) -> dict:
    """A logged step without the numbers that differ from run to run."""
    return {
        k: v
        for k, v in record.items()
        if k != "time" and not k.startswith(_RUN_PREFIXES) and not k.endswith(_RUN_SUFFIXES)
    }


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_grpo_fit_is_bit_identical_with_copies_kept_or_freed(ray_session, tmp_path):
    from rlflow.trainer import Trainer, load_config

    runs = {}
    for keep in ("true", "false"):
        run_dir = tmp_path / keep
        cfg = load_config(
            RECIPES / "grpo_arithmetic.yaml", [*FIT, f"placement.keep_copies={keep}", f"logging.dir={run_dir}"]
        )
        trainer = Trainer(cfg, progress_bars=False)
        try:
            trainer.fit()
            kept = trainer.setup.keep_copies
        finally:
            trainer.close()
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        runs[keep] = (
            kept,
            [_content(r) for r in records],
            load_file(run_dir / "checkpoints" / "step_2" / "actor" / "hf" / "model.safetensors"),
        )
    assert "actor" in runs["true"][0] and runs["false"][0] == ()
    for kept, freed in zip(runs["true"][1], runs["false"][1], strict=True):
        assert kept == freed, {k: (v, freed.get(k)) for k, v in kept.items() if freed.get(k) != v}
    assert any("actor_train/loss" in r for r in runs["true"][1])
    weights_kept, weights_freed = runs["true"][2], runs["false"][2]
    assert sorted(weights_kept) == sorted(weights_freed)
    assert all(torch.equal(weights_kept[k], weights_freed[k]) for k in weights_kept)
