"""What the trainer tells the planner: micro-batch budgets and the generation dtype of the engine."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from rlflow.planner.transfer import adapter_push_time_table
from rlflow.trainer.config import load_config
from rlflow.trainer.placement import planning_cluster, planning_workload

GRPO = Path(__file__).parents[2] / "recipes" / "grpo_arithmetic.yaml"


def test_workload_micro_batches_follow_the_models_token_budget() -> None:
    assert planning_workload(load_config(GRPO)).max_tokens_per_mb is None  # one micro-batch per batch
    cfg = load_config(GRPO, ["models.actor.micro_batch_tokens=256"])
    assert planning_workload(cfg).max_tokens_per_mb == 256


def test_gpu_generation_is_priced_in_the_engines_dtype() -> None:
    fp32 = ["models.actor.dtype=float32"]
    hf = planning_cluster(load_config(GRPO, fp32), use_gpu=True, profile=None)
    vllm = planning_cluster(load_config(GRPO, [*fp32, "rollout.engine=vllm"]), use_gpu=True, profile=None)
    assert hf.precision.rollout_bytes == 4  # the HF sampler runs a copy in the actor's dtype
    assert vllm.precision.rollout_bytes == 2  # vLLM generates in bf16 whatever the actor computes in
    auto = planning_cluster(load_config(GRPO), use_gpu=True, profile=None)
    assert auto.precision.rollout_bytes == 2  # the default on GPUs: bf16


# ----------------------------------------------------------------- calls tied to one layout
REMAX = Path(__file__).parents[2] / "recipes" / "remax_arithmetic.yaml"
ON_8_GPUS = ["placement.devices_per_node=8", "placement.search_seconds=1", "data.batch_size=64"]


def _plan_remax(extra: list[str]):
    from rlflow.planner.model_spec import model_preset
    from rlflow.trainer.build import build_dataflow
    from rlflow.trainer.placement import plan_placement

    cfg = load_config(REMAX, [*ON_8_GPUS, *extra])
    specs = {"actor": model_preset("llama2-7b"), "ref": model_preset("llama2-7b")}
    return plan_placement(cfg, build_dataflow(cfg, rule_reward=True), specs, use_gpu=True, progress=False)


def test_with_vllm_both_remax_rollouts_get_one_layout_and_the_plan_prices_as_in_the_full_problem() -> None:
    """One vLLM instance per process: the sampled and the greedy rollout of ReMax must share a layout."""
    from rlflow.planner.simulate import Simulator

    placement = _plan_remax(["rollout.engine=vllm"])
    calls = {c.name: c for c in placement.plan.calls}
    sampled, greedy = calls["actor_gen"], calls["actor_gen_greedy"]
    assert (sampled.mesh, sampled.strategy) == (greedy.mesh, greedy.strategy)
    assert sampled.mesh.num_devices == 8 and sampled.strategy.pp == 1  # vLLM spans the world
    full = placement.problem
    choice = [full.option_index(i, calls[n].mesh, calls[n].strategy) for i, n in enumerate(full.mfc_names)]
    assert Simulator(full).evaluate(choice).iteration_time_s == placement.plan.iteration_time_s


def test_restricting_options_keeps_the_prices_of_the_plans_left() -> None:
    from rlflow.planner.simulate import Simulator

    full = _plan_remax([]).problem
    names = full.mfc_names
    gen, greedy = names.index("actor_gen"), names.index("actor_gen_greedy")
    keep = {gen: [3, 1], greedy: [2]}
    sub = full.restricted(keep)
    assert [len(o) for o in sub.options][gen] == 2 and len(sub.options[greedy]) == 1
    assert sub.options[gen][0] == full.options[gen][3]
    plan = [0] * len(names)
    for sub_index, full_index in enumerate(keep[gen]):
        sub_plan = [*plan]
        sub_plan[gen] = sub_index
        full_plan = [*plan]
        full_plan[gen], full_plan[greedy] = full_index, 2
        assert Simulator(sub).cost(sub_plan) == Simulator(full).cost(full_plan)


def test_rollouts_that_would_each_prefer_another_layout_are_still_tied_under_vllm() -> None:
    """Price every layout but one a thousand times dearer, a different one for each rollout:
    untied, each rollout takes its own cheap layout; tied (vLLM), both share one."""
    import dataclasses

    from rlflow.trainer.placement import _choose

    problem = _plan_remax(["rollout.engine=vllm"]).problem
    options = [*problem.options]
    for name, cheap in (("actor_gen", 0), ("actor_gen_greedy", 1)):
        i = problem.mfc_names.index(name)
        options[i] = [
            o if j == cheap else dataclasses.replace(o, time_s=o.time_s * 1000) for j, o in enumerate(options[i])
        ]
    biased = dataclasses.replace(problem, options=options)

    def layouts(engine: str) -> set:
        cfg = load_config(REMAX, [*ON_8_GPUS, f"rollout.engine={engine}"])
        plan = _choose("auto", biased, [], ["actor_gen", "actor_gen_greedy"], cfg, progress=False)
        return {(c.mesh, c.strategy) for c in plan.calls if c.name in ("actor_gen", "actor_gen_greedy")}

    assert len(layouts("hf")) == 2
    assert len(layouts("vllm")) == 1


def test_vllm_takes_its_share_of_gpu_memory_while_it_generates() -> None:
    import dataclasses

    from rlflow.dataflow import algorithm_mfcs
    from rlflow.planner.cost import call_cost
    from rlflow.planner.mesh import DeviceMesh
    from rlflow.planner.model_spec import model_preset
    from rlflow.strategy import ParallelStrategy

    cfg = load_config(GRPO, ["rollout.engine=vllm", "rollout.gpu_memory_utilization=0.7"])
    vllm = planning_cluster(cfg, use_gpu=True, profile=None)
    hf = planning_cluster(load_config(GRPO), use_gpu=True, profile=None)
    assert vllm.rollout_memory_fraction == 0.7 and hf.rollout_memory_fraction is None
    gen = algorithm_mfcs("grpo")[0]
    model, strategy, mesh = model_preset("llama2-7b"), ParallelStrategy(tp=2), DeviceMesh(1, 2, devices_per_node=8)
    workload = planning_workload(cfg)
    cost = call_cost(gen, model, strategy, mesh, vllm, workload)
    assert cost.act_bytes + cost.weight_bytes == 0.7 * vllm.device_memory_bytes  # a small batch: the share binds
    unreserved = call_cost(
        gen, model, strategy, mesh, dataclasses.replace(vllm, rollout_memory_fraction=None), workload
    )
    assert unreserved.act_bytes < cost.act_bytes and unreserved.weight_bytes == cost.weight_bytes


def test_a_vllm_share_that_leaves_no_room_for_training_is_refused_by_the_memory_model() -> None:
    """Colocated with 7B training state on 8 GPUs, vLLM at 0.5 fits; at 0.95 no plan generating
    on the training GPUs does: the search has to move the rollout or it reports not fitting."""
    fits = _plan_remax(["rollout.engine=vllm", "rollout.gpu_memory_utilization=0.5", "data.batch_size=8"])
    tight = _plan_remax(["rollout.engine=vllm", "rollout.gpu_memory_utilization=0.95", "data.batch_size=8"])
    assert fits.plan.fits and not tight.plan.fits


def test_the_profile_measures_the_actors_own_calls_at_one_workers_shapes() -> None:
    from rlflow.planner.model_spec import ModelSpec
    from rlflow.trainer.placement import profile_shapes

    cfg = load_config(GRPO)  # 32 prompts x 8 samples, prompts of 8 tokens, responses of 5, 2 workers
    assert "calls" not in profile_shapes(cfg)
    spec = ModelSpec(num_layers=4, hidden_size=96, intermediate_size=256, num_heads=4, num_kv_heads=2, vocab_size=100)
    shapes = profile_shapes(cfg, spec)
    # the layer is the planned model's (the config's sizes may not be: a model loaded from a path)
    assert shapes["layer"] == {"hidden_size": 96, "intermediate_size": 256, "num_heads": 4, "num_kv_heads": 2}
    calls = shapes["calls"]
    assert calls["model"]["num_layers"] == 4 and calls["model"]["vocab_size"] == 100
    assert calls["generate"] == {"prompts": 16, "prompt_len": 8, "n": 8, "gen_len": 5}
    assert calls["train"] == {"rows": 128, "seq": 13}
    assert shapes["call_processes"] == 2  # both workers of the host busy, as the plan keeps them


def test_the_profile_times_calls_in_the_precision_the_workers_compute_in(monkeypatch) -> None:
    import rlflow.engine.parallelize as parallelize
    from rlflow.planner.model_spec import ModelSpec
    from rlflow.trainer.placement import profile_shapes

    big = ModelSpec(num_layers=2, hidden_size=512, intermediate_size=1024, num_heads=8, num_kv_heads=8, vocab_size=64)
    small = ModelSpec(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=4, vocab_size=64)
    monkeypatch.setattr(parallelize, "cpu_bf16_pays", lambda: True)  # AMX: bf16 matmuls faster than fp32
    cfg = load_config(GRPO)
    assert profile_shapes(cfg, big)["calls"]["precision"] == "bf16"  # dtype: auto, 2.6M weights a layer
    assert profile_shapes(cfg, small)["calls"]["precision"] == "fp32"  # below CPU_BF16_MIN_PASS_WORK
    assert profile_shapes(load_config(GRPO, ["models.actor.dtype=float32"]), big)["calls"]["precision"] == "fp32"
    monkeypatch.setattr(parallelize, "cpu_bf16_pays", lambda: False)
    assert profile_shapes(cfg, big)["calls"]["precision"] == "fp32"


def test_a_plan_of_one_worker_takes_every_core_where_the_profile_says_it_is_faster() -> None:
    """The one-worker plan is priced with each call kind's measured speedup on every core (the
    profile's host timings against one thread at the same shape) and taken where it beats the
    searched plan; without a speedup the searched plan stays, with one thread per worker."""
    from rlflow.planner.model_spec import ModelSpec
    from rlflow.planner.profile import BatchTiming, CallTimings, RolloutTiming
    from rlflow.trainer.build import build_dataflow
    from rlflow.trainer.placement import one_worker_on_every_core, plan_placement

    cfg = load_config(GRPO, ["placement.devices_per_node=2", "placement.use_gpu=false"])
    spec = ModelSpec(num_layers=8, hidden_size=512, intermediate_size=1024, num_heads=8, num_kv_heads=8, vocab_size=64)
    placement = plan_placement(cfg, build_dataflow(cfg, rule_reward=True), {"actor": spec}, use_gpu=False)
    plan, problem = placement.plan, placement.problem
    kinds = {"actor_gen": "generate", "actor_train": "train_step"}

    def timings(speedup: float) -> CallTimings:
        gen = RolloutTiming(prompts=32, prompt_len=8, n=8, gen_len=5, seconds=1.0, processes=1, dp=1)
        batch = BatchTiming(rows=256, seq=13, seconds=1.0, processes=1, dp=1)
        return CallTimings(
            model=spec, generate=gen, forward=batch, train=batch, generate_alone=gen, forward_alone=batch,
            train_alone=batch, generate_host=replace(gen, seconds=1 / speedup),
            forward_host=replace(batch, seconds=1 / speedup), train_host=replace(batch, seconds=1 / speedup),
        )  # fmt: skip

    fast, threads = one_worker_on_every_core(problem, plan, timings(100.0), kinds, 2)
    assert threads == 2 and fast.name == "one worker, 2 threads" and fast.iteration_time_s < plan.iteration_time_s
    assert all(c.mesh.device_ids == (0,) and c.strategy.world_size == 1 for c in fast.calls)
    assert one_worker_on_every_core(problem, plan, timings(0.5), kinds, 2) == (plan, 1)  # slower on every core
    assert one_worker_on_every_core(problem, plan, timings(100.0), kinds, 1) == (plan, 1)  # a one-core host
    no_host = replace(timings(100.0), generate_host=None)
    assert one_worker_on_every_core(problem, plan, no_host, kinds, 2) == (plan, 1)
    # A run that will measure the one-worker plan takes it when priced within the exploration factor.
    base = one_worker_on_every_core(problem, replace(plan, iteration_time_s=1e9), timings(1.0), kinds, 2)[0]
    ratio = base.iteration_time_s / plan.iteration_time_s  # no faster on every core: priced above the plan
    assert ratio > 1
    assert one_worker_on_every_core(problem, plan, timings(1.0), kinds, 2, explore=ratio * 0.99) == (plan, 1)
    explored, threads = one_worker_on_every_core(problem, plan, timings(1.0), kinds, 2, explore=ratio * 1.01)
    assert threads == 2 and explored.iteration_time_s == pytest.approx(base.iteration_time_s)


# ----------------------------------------------------------------- LoRA and mixture-of-experts actors
ON_4_GPUS = ["placement.devices_per_node=4", "placement.mode=heuristic", "data.batch_size=16"]


def _actor_train_options(tmp_path: Path, model_type: str, extra: list[str], fields: dict | None = None):
    from rlflow.data.tiny_models import save_tiny_model_and_tokenizer
    from rlflow.trainer.build import build_dataflow
    from rlflow.trainer.placement import model_specs, plan_placement

    path = save_tiny_model_and_tokenizer(
        tmp_path / model_type, family=model_type, hidden_size=64, intermediate_size=128, num_layers=4,
        num_heads=4, num_kv_heads=2, config_fields=fields,
    )  # fmt: skip
    cfg = load_config(GRPO, [*ON_4_GPUS, "models.actor.init=path", f"models.actor.path={path}", *extra])
    lora = {"actor": cfg.models["actor"].lora} if cfg.models["actor"].lora is not None else None
    specs = model_specs({"actor": path}, set(), lora)
    placement = plan_placement(cfg, build_dataflow(cfg, rule_reward=True), specs, use_gpu=True, progress=False)
    problem = placement.problem
    return specs["actor"], problem, problem.options[problem.mfc_names.index("actor_train")], cfg


def test_a_lora_actor_is_priced_with_optimizer_state_for_its_adapters_and_no_reference(tmp_path) -> None:
    pytest.importorskip("peft")
    lora = ["models.actor.lora.r=4", "models.actor.lora.target_modules=[q_proj,v_proj]", "algorithm.kl_coef=0.1",
            "algorithm.kl_in_reward=false"]  # fmt: skip
    spec, problem, options, cfg = _actor_train_options(tmp_path, "llama", lora)
    # r * (in + out) for q (64 -> 64) and v (64 -> 32) of 4 layers
    assert spec.trainable_params == 4 * 4 * ((64 + 64) + (64 + 32))
    assert "ref_inf" not in problem.mfc_names  # the reference is the base, adapters disabled
    per_param = 4 + 4 + 8  # the adapters' fp32 weights, gradients and two AdamW moments
    assert options and all(o.strategy.tp == o.strategy.pp == 1 for o in options)
    for o in options:
        assert o.train_state_bytes == spec.trainable_params * per_param / o.strategy.dp
        assert o.weight_bytes == spec.num_params * 4 / o.strategy.dp  # the whole base, fp32 master shards
    # A push after the first moves the adapters (lora.push: adapters), priced so for the rollout.
    assert spec.push_params == spec.trainable_params and spec.push_tensors == 2 * 2 * 4
    assert spec.push_base_params == 4 * (64 * 64 + 32 * 64)  # the rollout copy keeps their base in fp32
    train, gen = problem.mfc_names.index("actor_train"), problem.mfc_names.index("actor_gen")
    pairs = [[(o.mesh, o.strategy) for o in problem.options[i]] for i in (train, gen)]
    expected = adapter_push_time_table(spec, *pairs, planning_cluster(cfg, True, None))
    np.testing.assert_array_equal(problem.realloc_time[(train, gen)], expected)


def test_a_lora_actor_whose_copies_are_not_kept_or_get_merged_weights_is_priced_by_its_weights(tmp_path) -> None:
    pytest.importorskip("peft")
    from rlflow.data.tiny_models import save_tiny_model_and_tokenizer
    from rlflow.trainer.placement import model_specs

    path = save_tiny_model_and_tokenizer(tmp_path / "m", family="llama", hidden_size=64, intermediate_size=128,
                                         num_layers=2, num_heads=4, num_kv_heads=2)  # fmt: skip
    for extra, keep, pushes_adapters in (
        ([], None, True),
        ([], False, False),
        (["models.actor.lora.push=merged"], True, False),
    ):
        cfg = load_config(GRPO, ["models.actor.lora.r=4", *extra])
        spec = model_specs({"actor": path}, set(), {"actor": cfg.models["actor"].lora}, keep)["actor"]
        assert (spec.push_params is not None) == pushes_adapters, (extra, keep)


def test_a_moe_actor_with_its_router_loss_trains_without_pipeline_stages(tmp_path) -> None:
    fields = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    _, _, options, _ = _actor_train_options(tmp_path / "on", "qwen3_moe", [], fields)
    assert options and all(o.strategy.pp == 1 for o in options)
    _, _, options, _ = _actor_train_options(
        tmp_path / "off", "qwen3_moe", ["models.actor.router_aux_loss_coef=0"], fields
    )
    assert any(o.strategy.pp > 1 for o in options)
