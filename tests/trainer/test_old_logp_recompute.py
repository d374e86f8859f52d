"""The old-log-prob recompute (``algorithm.recompute_old_logp``) from the config to the run: when
``null`` puts the call in the graph, what the config refuses, the planner and ``rlflow plan``
pricing it, a worker whose rollout runs in bf16 logging the mismatch and weighting by TIS, and a
real ``fit()`` on one CPU worker where the recomputed log-probs are the rollout's."""

from __future__ import annotations

import copy
import socket

import pytest
import torch
import torch.distributed as dist
from test_e2e import GRPO, GRPO_TINY, fit, step_metrics

from rlflow.algos import logp_mismatch
from rlflow.algos.params import AlgorithmParams
from rlflow.cli import main
from rlflow.dataflow import algorithm_mfcs
from rlflow.engine.optim import OptimConfig
from rlflow.engine.rollout import HFRolloutEngine, SamplingParams, VLLMRolloutEngine, register_rollout_engine
from rlflow.engine.rollout import base as rollout_base
from rlflow.parallel.groups import clear_group_cache
from rlflow.planner.model_spec import model_preset
from rlflow.protocol import DataProto
from rlflow.strategy import ParallelStrategy
from rlflow.trainer.build import build_dataflow
from rlflow.trainer.config import ConfigError, load_config
from rlflow.trainer.placement import plan_placement
from rlflow.workers.model_worker import ModelWorker
from rlflow.workers.setup import CallLayout, ModelSetup, WorkerSetup
from tests.workers.worker_helpers import prompt_batch, save_models


class BF16Sampler(HFRolloutEngine):
    """The built-in sampler generating with a bf16 copy of its weights: a rollout in another dtype.
    It says whether it sampled a filtered distribution, as vLLM does."""

    weight_dtype = torch.bfloat16

    def generate(self, prompts, params):
        bf16 = copy.deepcopy(self.module).to(torch.bfloat16)
        out = HFRolloutEngine(bf16, pad_token_id=self._pad_token_id).generate(prompts, params)
        out.meta_info["old_logp_filtered"] = params.top_k > 0 or params.top_p < 1.0
        return out


class OwnKernels(VLLMRolloutEngine):
    """vLLM's declarations (its own model code and kernels, bf16), platform checks passed: no vLLM needed."""

    @classmethod
    def available(cls) -> bool:
        return True

    @classmethod
    def supports_device(cls, device_type: str) -> bool:
        return True


@pytest.fixture
def engines(monkeypatch):
    """The two stand-ins registered for one test (the registry is restored after)."""
    monkeypatch.setattr(rollout_base, "_ENGINES", dict(rollout_base._ENGINES))
    register_rollout_engine("hf_bf16")(BF16Sampler)
    register_rollout_engine("own_kernels")(OwnKernels)


# --- When the graph has the call ---


@pytest.mark.parametrize(
    ("overrides", "reasons"),
    [
        (["placement.use_gpu=false"], []),  # the built-in sampler in fp32 on CPU workers: today's graph
        (["placement.use_gpu=false", "rollout.top_p=0.9"], ["sampling is filtered (rollout.top_p=0.9, top_k=0)"]),
        (["placement.use_gpu=false", "rollout.top_k=5"], ["sampling is filtered (rollout.top_p=1, top_k=5)"]),
        (["placement.use_gpu=true"], []),  # the built-in sampler computes in the actor's dtype (float32)
        (
            ["placement.use_gpu=false", "rollout.engine=hf_bf16"],
            ["the rollout runs in torch.bfloat16, training in torch.float32"],
        ),
        (
            ["placement.use_gpu=false", "rollout.engine=own_kernels"],
            [
                "rollout.engine='own_kernels' generates with its own kernels",
                "the rollout runs in torch.bfloat16, training in torch.float32",
            ],
        ),
    ],
)
def test_null_recomputes_exactly_when_the_rollouts_numerics_differ(engines, overrides, reasons):
    cfg = load_config(None, overrides)
    graph = build_dataflow(cfg, rule_reward=True)
    assert list(graph.graph["old_logp_mismatch"]) == reasons
    assert ("actor_inf" in graph) == bool(reasons)
    if reasons:
        assert graph.nodes["actor_gen"]["mfc"].output_keys[-1] == "rollout_logp"


def test_an_explicit_setting_wins(engines):
    off = ["placement.use_gpu=false", "rollout.engine=own_kernels", "rollout.top_p=0.5"]
    off = load_config(None, [*off, "algorithm.recompute_old_logp=false"])
    assert "actor_inf" not in build_dataflow(off, rule_reward=True)
    on = load_config(None, ["algorithm.name=ppo", "algorithm.recompute_old_logp=true", "models.critic.init=tiny"])
    graph = build_dataflow(on, rule_reward=True)
    assert graph.graph["old_logp_mismatch"] == () and "actor_inf" in graph and "critic_inf" in graph


def test_the_config_refuses_what_cannot_mean_anything():
    with pytest.raises(
        ConfigError, match="algorithm.recompute_old_logp: true needs an algorithm that samples rollouts"
    ):
        load_config(None, ["algorithm.name=sft", "algorithm.recompute_old_logp=true"])
    with pytest.raises(ConfigError, match="algorithm.tis_cap: 2.0 weighs .* recomputes none here"):
        load_config(None, ["placement.use_gpu=false", "algorithm.tis_cap=2.0"])
    with pytest.raises(ConfigError, match="algorithm.tis_cap: 2.0: the decoupled correction"):
        load_config(None, ["algorithm.policy_lag=1", "algorithm.recompute_old_logp=true", "algorithm.tis_cap=2.0"])
    cfg = load_config(None, ["rollout.top_p=0.9", "algorithm.tis_cap=2.0"])  # null recomputes here: allowed
    assert cfg.algorithm.tis_cap == 2.0
    assert AlgorithmParams(**{k: getattr(cfg.algorithm, k) for k in ("tis_cap", "recompute_old_logp")}).tis_cap == 2.0


# --- The planner prices it ---


def test_plans_place_and_price_the_recompute_call():
    cfg = load_config(None, ["algorithm.recompute_old_logp=true", "placement.mode=heuristic"])
    cfg.placement.devices_per_node = 8
    graph = build_dataflow(cfg, rule_reward=True)
    placement = plan_placement(cfg, graph, {"actor": model_preset("llama2-7b")}, use_gpu=True, progress=False)
    calls = {c.name: c for c in placement.plan.calls}
    assert set(calls) == {"actor_gen", "actor_inf", "actor_train"}  # the rule reward runs on the host
    assert calls["actor_inf"].time_s > 0 and placement.plan.fits
    without = plan_placement(
        load_config(None, ["placement.mode=heuristic", "placement.devices_per_node=8"]),
        build_dataflow(load_config(None, []), rule_reward=True),
        {"actor": model_preset("llama2-7b")},
        use_gpu=True,
        progress=False,
    )
    assert placement.plan.iteration_time_s > without.plan.iteration_time_s  # the forward costs time


def test_rlflow_plan_and_draw_show_it(tmp_path, capsys):
    argv = "plan --algo grpo --actor llama2-7b --devices-per-node 4 --batch 64 --gen-len 128 --no-progress".split()
    assert main([*argv, "--search-steps", "200", "--chains", "1", "--recompute-old-logp"]) == 0
    table = capsys.readouterr().out.split("plan search")[0]
    row = next(line for line in table.splitlines() if line.startswith("actor_inf "))
    assert row.split()[1] == "actor" and row.split()[-1] == "GiB" and float(row.split()[-4]) > 0  # model, time
    assert main(["draw", "--algo", "ppo", "--recompute-old-logp", "--out", str(tmp_path / "g.svg")]) == 0
    assert "actor_inf" in (tmp_path / "g.svg").read_text()
    with pytest.raises(SystemExit) as exc:
        main(["draw", "--algo", "dpo", "--recompute-old-logp", "--out", str(tmp_path / "d.svg")])
    assert exc.value.code == 2 and "algorithm 'dpo' samples nothing" in capsys.readouterr().err


# --- A worker whose rollout runs in bf16 ---


@pytest.fixture
def one_rank(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield save_models(str(tmp_path))
    clear_group_cache()
    dist.destroy_process_group()


def recompute_worker(paths, engine: str, algo: AlgorithmParams, top_k: int = 0) -> ModelWorker:
    mfcs = {m.name: m for m in algorithm_mfcs("grpo", use_ref=False, rule_based_reward=False, recompute_old_logp=True)}
    del mfcs["reward_inf"]  # rewards are given
    actor = ModelSetup("actor", "actor", paths["actor"], trainable=True, optim=OptimConfig(lr=1e-2))
    one = CallLayout((0,), ParallelStrategy())
    sampling = SamplingParams(n=algo.n_samples, max_new_tokens=6, seed=0, top_k=top_k)
    setup = WorkerSetup(
        {"actor": actor}, mfcs, {n: one for n in mfcs}, algo, sampling, SamplingParams(greedy=True),
        paths["tokenizer"], rollout_engine=engine,
    )  # fmt: skip
    worker = ModelWorker(setup)
    worker.build()
    return worker


def run_step(worker: ModelWorker, paths) -> tuple[DataProto, DataProto, dict]:
    def call(name, *inputs):
        worker.pre_call(name, 1)
        out = getattr(worker, worker.setup.mfcs[name].interface_type)(name, *inputs, step=1)
        worker.post_call(name, 1)
        return out

    gen = call("actor_gen", prompt_batch(paths["tokenizer"]))
    old = call("actor_inf", gen)
    rewards = DataProto.from_dict({"rewards": torch.arange(len(gen), dtype=torch.float32) % 3})
    return gen, old, call("actor_train", gen, old, rewards).meta_info


@pytest.mark.timeout(300)
def test_a_bf16_rollout_is_recomputed_its_mismatch_logged_and_weighted_by_tis(engines, one_rank):
    algo = AlgorithmParams(name="grpo", adv_estimator="grpo", n_samples=2, tis_cap=1.02).resolved()
    gen, old, train = run_step(recompute_worker(one_rank, "hf_bf16", algo, top_k=40), one_rank)
    mask = gen.batch["response_mask"].bool()
    assert "old_logp" not in gen.batch.keys() and "rollout_logp" in gen.batch.keys()
    assert gen.meta_info["old_logp_filtered"] == 1.0  # the engine's flag, logged by the generate call
    # The metric is the mismatch between the rows the calls exchanged, and bf16 shows.
    expected = logp_mismatch(old.batch["old_logp"], gen.batch["rollout_logp"], mask)
    assert old.meta_info["logp_mismatch_mean"] == pytest.approx(expected["logp_mismatch_mean"])
    assert old.meta_info["logp_mismatch_max"] == pytest.approx(expected["logp_mismatch_max"])
    assert old.meta_info["logp_mismatch_mean"] > 1e-3, old.meta_info
    # The train step weighted each token by min(pi_old / pi_rollout, 1.02).
    ratio = (old.batch["old_logp"] - gen.batch["rollout_logp"]).exp()[mask]
    assert train["is_weight_mean"] != 1.0 and train["is_weight_max"] == pytest.approx(float(ratio.max()), rel=1e-4)
    truncated = float((ratio > 1.02).float().mean())
    assert 0 < truncated < 1 and train["is_truncated_fraction"] == pytest.approx(truncated, abs=1e-6)


@pytest.mark.timeout(300)
def test_an_fp32_rollout_of_the_built_in_sampler_is_recomputed_to_itself(one_rank):
    algo = AlgorithmParams(name="grpo", adv_estimator="grpo", n_samples=2).resolved()
    gen, old, train = run_step(recompute_worker(one_rank, "hf", algo), one_rank)
    mask = gen.batch["response_mask"].bool()
    torch.testing.assert_close(old.batch["old_logp"][mask], gen.batch["rollout_logp"][mask], rtol=0, atol=1e-5)
    assert old.meta_info["logp_mismatch_max"] < 1e-5 and "is_weight_mean" not in train
    assert "old_logp_filtered" not in gen.meta_info  # the built-in sampler reports full-vocabulary log-probs


# --- A real run ---


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_fit_on_one_cpu_worker_recomputes_the_rollouts_own_log_probs(ray_session, tmp_path):
    steps = 2
    overrides = [
        *GRPO_TINY,
        "placement.devices_per_node=1",
        f"trainer.total_steps={steps}",
        "algorithm.recompute_old_logp=true",
        "checkpoint.save_final=false",
    ]
    trainer, result = fit(GRPO, overrides, tmp_path)
    assert result.steps == steps
    assert "actor_inf" in trainer.placement.calls and trainer.placement.plan.fits
    for step, record in step_metrics(tmp_path).items():
        # The built-in sampler in fp32 and the trainer agree: the on-policy ratio is 1.
        assert record["actor_inf/logp_mismatch_max"] < 1e-4, (step, record)
        assert 0 <= record["actor_inf/logp_mismatch_mean"] < 1e-5
        assert record["actor_train/clip_fraction"] == 0.0
        assert abs(record["actor_train/approx_kl"]) < 1e-8
        assert record["actor_inf/tokens"] > 0 and record["actor_train/grad_norm"] > 0


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_with_lagged_rollouts_the_recomputed_log_probs_are_the_proximal_policy(ray_session, tmp_path):
    """policy_lag 1: from step 2 each rollout was sampled by the weights one step older than those
    training; actor_inf runs on the training weights, so the mismatch it logs is the staleness,
    and the decoupled correction weighs the rollout against it."""
    steps = 3
    overrides = [
        *GRPO_TINY,
        "placement.devices_per_node=1",
        f"trainer.total_steps={steps}",
        "algorithm.policy_lag=1",
        "algorithm.recompute_old_logp=true",
        "checkpoint.save_final=false",
    ]
    _, result = fit(GRPO, overrides, tmp_path)
    assert result.steps == steps
    metrics = step_metrics(tmp_path)
    assert [metrics[s]["actor_train/policy_lag"] for s in range(1, steps + 1)] == [0, 1, 1]
    assert metrics[1]["actor_inf/logp_mismatch_max"] < 1e-4  # sampled by the weights that train on it
    for step in range(2, steps + 1):
        record = metrics[step]
        assert record["actor_inf/logp_mismatch_mean"] > 1e-3, (step, record)
        assert record["actor_inf/logp_mismatch_max"] >= record["actor_inf/logp_mismatch_mean"]
        assert record["actor_train/behaviour_kl"] > 0 and record["actor_train/is_weight_max"] != 1.0
