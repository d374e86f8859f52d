"""Rollout engines behind one protocol: the registry, the declarations, and the places that read them.

A third engine — the HF sampler built once per process and kept, asleep between calls, with no
tensor-parallel generation and one layout for every generate call — is registered here only; the
config, ``WorkerSetup``, the planner and a worker's residency must follow its declarations
without any change in rlflow.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from rollout_helpers import call, grpo_worker, tiny_model

from rlflow.algos.params import AlgorithmParams
from rlflow.data.tokenizer import load_tokenizer
from rlflow.dataflow import algorithm_mfcs
from rlflow.engine.optim import OptimConfig
from rlflow.engine.rollout import (
    PER_PROCESS,
    HFRolloutEngine,
    RolloutCapabilities,
    RolloutEngine,
    SamplingParams,
    SleepsBetweenCalls,
    get_rollout_engine,
    list_episode_engines,
    list_rollout_engines,
    register_rollout_engine,
)
from rlflow.engine.rollout import base as rollout_base
from rlflow.protocol import DataProto
from rlflow.strategy import ParallelStrategy
from rlflow.trainer.config import ConfigError, load_config
from rlflow.trainer.inputs import multi_turn_setup
from rlflow.trainer.placement import runtime_capabilities
from rlflow.workers.setup import CallLayout, ModelSetup, WorkerSetup

GRPO = Path(__file__).resolve().parents[2] / "recipes" / "grpo_arithmetic.yaml"


class KeptHFEngine(HFRolloutEngine):
    """The HF sampler kept between calls: asleep, its parameters' storage taken out of the model."""

    persistence = PER_PROCESS
    can_sleep = True
    capabilities = RolloutCapabilities(dp=True, tp=False, pp=False, shared_layout=True)

    built: list[KeptHFEngine] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[str] = []
        self._stash: dict[str, torch.Tensor] | None = None
        KeptHFEngine.built.append(self)

    def sleep(self) -> None:
        if self._stash is None:
            self._stash = {name: p.data for name, p in self.module.named_parameters()}
            for p in self.module.parameters():
                p.data = torch.empty(0, dtype=p.dtype)
            self.events.append("sleep")

    def wake_up(self) -> None:
        if self._stash is not None:
            for name, p in self.module.named_parameters():
                p.data = self._stash[name]
            self._stash = None
            self.events.append("wake")

    def weight_target(self) -> torch.nn.Module:
        self.wake_up()
        return super().weight_target()

    def generate(self, prompts, params):
        self.wake_up()
        return super().generate(prompts, params)


@pytest.fixture
def registry(monkeypatch):
    """A copy of the registry for one test (restored after), with ``KeptHFEngine`` as ``"kept_hf"``."""
    monkeypatch.setattr(rollout_base, "_ENGINES", dict(rollout_base._ENGINES))
    register_rollout_engine("kept_hf")(KeptHFEngine)
    KeptHFEngine.built.clear()
    return "kept_hf"


# --------------------------------------------------------------------------- registry


def test_the_builtin_engines_are_registered_without_importing_vllm():
    assert {"hf", "vllm"} <= set(list_rollout_engines())
    assert "vllm" not in sys.modules  # vLLM is imported when its engine is built, never at registration
    assert isinstance(get_rollout_engine("hf")(tiny_model()), RolloutEngine)


def test_registry_errors_name_the_engine_and_the_registered_ones(registry):
    with pytest.raises(ValueError, match=r"'hf' is already registered \(by HFRolloutEngine\); registered: \['hf', "):
        register_rollout_engine("hf")(KeptHFEngine)
    with pytest.raises(KeyError, match=r"unknown rollout engine 'sglang'; registered: \['hf', 'kept_hf', 'vllm'\]"):
        get_rollout_engine("sglang")
    with pytest.raises(TypeError, match=r"'bare' \(Bare\) does not declare \['layout_style', 'persistence'"):
        register_rollout_engine("bare")(type("Bare", (), {}))
    bad_style = type("BadStyle", (KeptHFEngine,), {"layout_style": "sglang"})
    with pytest.raises(ValueError, match=r"'bad_style': layout_style='sglang'; expected one of \('hf', 'vllm'\)"):
        register_rollout_engine("bad_style")(bad_style)
    restless = type("Restless", (HFRolloutEngine,), {"can_sleep": True})
    with pytest.raises(TypeError, match="'restless' declares can_sleep but lacks sleep"):
        register_rollout_engine("restless")(restless)
    assert list_rollout_engines() == ["hf", "kept_hf", "vllm"]  # the refused ones were not added


def test_builtin_declarations():
    hf, vllm = get_rollout_engine("hf"), get_rollout_engine("vllm")
    assert (hf.layout_style, hf.persistence, hf.can_sleep) == ("hf", "per_call", False)
    assert (vllm.layout_style, vllm.persistence, vllm.can_sleep) == ("vllm", "per_process", True)
    assert issubclass(vllm, SleepsBetweenCalls) and not issubclass(hf, SleepsBetweenCalls)
    assert hf.supports_device("cpu") and not vllm.supports_device("cpu") and vllm.supports_device("cuda")
    assert hf.capabilities.supports(ParallelStrategy(dp=2, tp=2))
    assert hf.capabilities.supports(ParallelStrategy(dp=2, tp=2, pp=2))  # pipelined generation
    assert vllm.capabilities.unsupported(ParallelStrategy(pp=2)) == "pp=2 (no pipeline-parallel generation)"
    assert vllm.capabilities.supports(ParallelStrategy(tp=4), world_size=4)
    assert not vllm.capabilities.supports(ParallelStrategy(tp=2), world_size=4)  # spans the pool
    assert (hf.weight_dtype, vllm.weight_dtype) == (None, torch.bfloat16)
    assert (hf.holds_memory_fraction, vllm.holds_memory_fraction) == (False, True)


# --------------------------------------------------------------------------- config, setup, planner


def test_multi_turn_rollouts_need_an_engine_that_runs_episodes(registry, monkeypatch):
    episodes = ["rollout.multi_turn.environment=envs:Env", "placement.use_gpu=false"]
    assert load_config(GRPO, [*episodes, "rollout.engine=kept_hf"]).rollout.multi_turn.enabled
    vllm = [*episodes[:1], "rollout.engine=vllm", "placement.use_gpu=true"]
    assert load_config(GRPO, vllm).rollout.engine == "vllm"
    monkeypatch.setattr(KeptHFEngine, "generate_episodes", None)  # an engine without them
    assert list_episode_engines() == ["hf", "vllm"]
    with pytest.raises(ConfigError, match=r"'kept_hf' runs no multi-turn episodes .* that do: \['hf', 'vllm'\]"):
        load_config(GRPO, [*episodes, "rollout.engine=kept_hf"])
    with pytest.raises(ConfigError, match=r"'kept_hf' runs no multi-turn episodes \(no generate_episodes\)"):
        multi_turn_setup(load_config(GRPO, ["rollout.engine=kept_hf", "placement.use_gpu=false"]), None, object)


def test_config_reads_the_registry_and_the_device_an_engine_needs(registry):
    assert load_config(GRPO, ["rollout.engine=kept_hf", "placement.use_gpu=false"]).rollout.engine == "kept_hf"
    with pytest.raises(ConfigError, match=r"'vllm' needs GPUs but placement.use_gpu is false; use one of \['hf', 'k"):
        load_config(GRPO, ["rollout.engine=vllm", "placement.use_gpu=false"])
    with pytest.raises(ConfigError, match=r"'sglang' is not allowed; expected one of \['hf', 'kept_hf', 'vllm'\]"):
        load_config(GRPO, ["rollout.engine=sglang"])


def test_the_planner_follows_the_declared_capabilities(registry):
    caps = {e: runtime_capabilities(load_config(GRPO, [f"rollout.engine={e}"])) for e in ("hf", "kept_hf")}
    assert caps["hf"].tensor_parallel_generate and not caps["kept_hf"].tensor_parallel_generate
    assert caps["kept_hf"].generate_world_size is None  # it does not span the pool


def remax_setup(engine: str, gen: CallLayout, greedy: CallLayout) -> WorkerSetup:
    """ReMax's actor calls (rewards given) on two workers: its two generate calls on ``gen`` and ``greedy``."""
    mfcs = {m.name: m for m in algorithm_mfcs("remax", rule_based_reward=True, use_ref=False)}
    del mfcs["reward_inf"], mfcs["reward_inf_greedy"]
    actor = ModelSetup("actor", "actor", "unused", trainable=True, optim=OptimConfig(lr=1e-3))
    layouts = {"actor_gen": gen, "actor_gen_greedy": greedy, "actor_train": CallLayout((0, 1), ParallelStrategy(dp=2))}
    return WorkerSetup(
        {"actor": actor}, mfcs, layouts, AlgorithmParams(name="remax"), SamplingParams(), SamplingParams(), "",
        rollout_engine=engine,
    )  # fmt: skip


def test_worker_setup_follows_the_declared_capabilities(registry):
    dp2, tp2 = CallLayout((0, 1), ParallelStrategy(dp=2)), CallLayout((0, 1), ParallelStrategy(tp=2))
    remax_setup("hf", dp2, tp2)  # the built-in sampler: any dp x tp, a layout per call
    with pytest.raises(ValueError, match=r"'actor_gen_greedy': the 'kept_hf' rollout engine cannot generate with tp=2"):
        remax_setup(registry, dp2, tp2)
    with pytest.raises(ValueError, match="'kept_hf' rollout engine runs one instance per process"):
        remax_setup(registry, dp2, CallLayout((1,), ParallelStrategy()))
    remax_setup(registry, dp2, dp2)
    with pytest.raises(ValueError, match="'vllm' rollout engine generates on every worker"):
        remax_setup("vllm", dp2, CallLayout((1,), ParallelStrategy()))
    with pytest.raises(ValueError, match=r"rollout_engine='sglang'; expected one of \['hf', 'kept_hf', 'vllm'\]"):
        remax_setup("sglang", dp2, dp2)


# --------------------------------------------------------------------------- a worker's residency


def test_residency_keeps_and_sleeps_an_engine_that_declares_so(one_rank_world, registry):
    tokenizer = load_tokenizer(one_rank_world, padding_side="left")
    enc = tokenizer(["12+3=", "4+5=", "99-1="], padding=True, return_tensors="pt")
    prompts = DataProto.from_dict({"prompts": enc.input_ids, "prompt_mask": enc.attention_mask})
    runs = {}
    for engine in ("hf", registry):
        worker = grpo_worker(one_rank_world, engine)
        first = call(worker, "actor_gen", prompts)
        gen = worker.setup.mfcs["actor_gen"]
        kept = worker.residency.engine_for(gen) if engine == registry else None
        if engine == "hf":  # built per call: freed after it
            with pytest.raises(RuntimeError, match="has no copy"):
                worker.residency.engine_for(gen)
        rewards = DataProto.from_dict({"rewards": torch.arange(len(first), dtype=torch.float32)})
        call(worker, "actor_train", first, rewards)
        runs[engine] = (first, call(worker, "actor_gen", prompts), worker)
        if kept is not None:
            assert worker.residency.engine_for(gen) is kept  # the same engine, kept
    for i in range(2):  # before and after the optimizer step: the pushed weights reached the kept engine
        hf, ours = runs["hf"][i].batch, runs[registry][i].batch
        assert torch.equal(ours["input_ids"], hf["input_ids"])
        torch.testing.assert_close(ours["old_logp"], hf["old_logp"], rtol=0, atol=1e-6)
    (engine,) = KeptHFEngine.built  # built once, asleep after each call, woken by the next push
    assert engine.events == ["sleep", "wake", "sleep"]
    assert all(p.numel() == 0 for p in engine.module.parameters())  # asleep now: its storage is out
