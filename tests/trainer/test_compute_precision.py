"""``models.<role>.dtype`` is the model's compute precision: its choices, ``auto`` resolved once by the
driver from the device and this host's CPU flags, the old-log-prob recompute following it, and a
driver-hosted GRPO run in bf16 that trains, samples in bf16 and checkpoints fp32 masters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_run_dir import GRPO, TINY

import rlflow.engine.parallelize as parallelize
from rlflow.dataflow import algorithm_mfcs
from rlflow.engine.parallelize import resolve_compute_dtype
from rlflow.engine.rollout import HFRolloutEngine, hf_sampler, register_rollout_engine
from rlflow.engine.rollout import base as rollout_base
from rlflow.engine.rollout.fast_decode import FastDecoder
from rlflow.engine.train_engine import TrainEngine
from rlflow.strategy import ParallelStrategy
from rlflow.trainer import ConfigError, Trainer, load_config
from rlflow.trainer.build import build_dataflow, model_setups
from rlflow.trainer.placement import planning_cluster
from rlflow.trainer.runner import CallPlacement

NATIVE_BF16 = frozenset({"fpu", "avx512f", "avx512_bf16"})
AMX = frozenset({"fpu", "amx_tile", "amx_bf16"})
AVX2_ONLY = frozenset({"fpu", "avx", "avx2", "fma"})
MEASURED_SPEEDUP = parallelize.cpu_bf16_speedup


@pytest.fixture(autouse=True)
def bf16_four_times_faster(monkeypatch):
    """This host's measured bf16 matmul speed-up, as an AMX or Zen 4 CPU measures it (each test that
    asks another says so): the tests decide alike on every machine and measure nothing."""
    monkeypatch.setattr(parallelize, "cpu_bf16_speedup", lambda: 4.0)


def test_dtype_takes_auto_float32_or_bfloat16_and_names_the_field_otherwise():
    assert load_config(None, []).models["actor"].dtype == "auto"  # the default
    for value in ("auto", "float32", "bfloat16"):
        assert load_config(None, [f"models.actor.dtype={value}"]).models["actor"].dtype == value
    for bad in ("float16", "fp32"):
        with pytest.raises(ConfigError, match="models.actor.dtype") as err:
            load_config(None, [f"models.actor.dtype={bad}"])
        assert err.value.key == "models.actor.dtype"
        assert "bfloat16" in str(err.value) and "auto" in str(err.value)  # the allowed values


# Decoder layers of issue 25's compute-bound model (width 512, MLP 1024) and of the main job (width 128),
# and the tokens of a training pass of the main job (256 rows of 8 + 5) and of the tiny task (16 rows of 8 + 32).
LARGE = parallelize.layer_matmul_params({"hidden_size": 512, "num_attention_heads": 8, "intermediate_size": 1024})
SMALL = parallelize.layer_matmul_params({"hidden_size": 128, "num_attention_heads": 4, "intermediate_size": 512})
TINY_LAYER = parallelize.layer_matmul_params({"hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 256})
MAIN_PASS, TINY_PASS = 256 * 13, 16 * 40


@pytest.mark.parametrize(
    ("flags", "device", "layer_params", "tokens", "expected"),
    [
        (NATIVE_BF16, "cpu", LARGE, TINY_PASS, torch.bfloat16),
        (AMX, "cpu", LARGE, TINY_PASS, torch.bfloat16),
        (NATIVE_BF16, "cpu", SMALL, MAIN_PASS, torch.bfloat16),  # a small layer over many tokens
        (NATIVE_BF16, "cpu", SMALL, 64, torch.float32),  # per-op overhead: bf16 does not pay
        (NATIVE_BF16, "cpu", TINY_LAYER, TINY_PASS, torch.float32),
        (NATIVE_BF16, "cpu", None, MAIN_PASS, torch.float32),  # size unknown
        (NATIVE_BF16, "cpu", LARGE, None, torch.float32),  # tokens unknown
        (AVX2_ONLY, "cpu", LARGE, MAIN_PASS, torch.float32),
        (frozenset(), "cpu", LARGE, MAIN_PASS, torch.float32),  # no /proc/cpuinfo
        (AVX2_ONLY, "cuda", TINY_LAYER, 1, torch.bfloat16),
    ],
)
def test_auto_is_bf16_on_gpus_and_for_large_passes_on_cpus_that_compute_it_natively(
    monkeypatch, flags, device, layer_params, tokens, expected
):
    monkeypatch.setattr(parallelize, "cpu_flags", lambda: flags)
    assert resolve_compute_dtype("auto", device, layer_params, tokens) == expected
    # explicit names are what they say
    assert resolve_compute_dtype("float32", device, layer_params, tokens) == torch.float32
    assert resolve_compute_dtype("bfloat16", device, layer_params, tokens) == torch.bfloat16


@pytest.mark.parametrize(
    ("caps", "native"),
    [
        ({}, True),
        ({"ATEN_CPU_CAPABILITY": "avx2"}, False),
        ({"ATEN_CPU_CAPABILITY": "default"}, False),
        ({"ATEN_CPU_CAPABILITY": "avx512"}, True),
        ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, False),
        ({"ONEDNN_MAX_CPU_ISA": "avx512_core"}, False),  # AVX-512 without its bf16 dot products
        ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, True),
        ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}, True),
        ({"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, True),  # MKL multiplies fp32 only
    ],
)
def test_an_environment_that_caps_the_instruction_sets_below_bf16_computes_in_fp32(monkeypatch, caps, native):
    monkeypatch.setattr(parallelize, "cpu_flags", lambda: NATIVE_BF16)
    for name in parallelize.ISA_CAP_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in caps.items():
        monkeypatch.setenv(name, value)
    assert parallelize.cpu_isa_caps() == caps
    assert parallelize.cpu_computes_bf16() is native
    expected = torch.bfloat16 if native else torch.float32
    assert resolve_compute_dtype("auto", "cpu", LARGE, MAIN_PASS) == expected


@pytest.mark.parametrize(("speedup", "expected"), [(0.55, torch.float32), (1.1, torch.float32), (1.3, torch.bfloat16)])
def test_auto_keeps_fp32_on_a_cpu_with_the_flags_whose_bf16_matmul_measured_no_faster(monkeypatch, speedup, expected):
    # An Intel CPU with AVX512-BF16 and no AMX multiplies bf16 at about half fp32's speed (0.55 measured)
    monkeypatch.setattr(parallelize, "cpu_flags", lambda: NATIVE_BF16)
    monkeypatch.setattr(parallelize, "cpu_bf16_speedup", lambda: speedup)
    assert resolve_compute_dtype("auto", "cpu", LARGE, MAIN_PASS) == expected
    assert resolve_compute_dtype("bfloat16", "cpu", LARGE, MAIN_PASS) == torch.bfloat16  # what it says
    assert resolve_compute_dtype("auto", "cuda", LARGE, MAIN_PASS) == torch.bfloat16


def test_the_measured_speedup_is_kept_per_host_identity_and_measured_again_when_unreadable(monkeypatch, tmp_path):
    monkeypatch.setattr(parallelize, "cpu_bf16_speedup", MEASURED_SPEEDUP)  # the real one, not the fixture's
    monkeypatch.setenv("RLFLOW_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(parallelize, "cpu_flags", lambda: NATIVE_BF16)
    for name in parallelize.ISA_CAP_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    measured = []

    def measure():
        measured.append(1)
        return {"fp32_gflop_per_s": 160.0, "bf16_gflop_per_s": 88.0}

    monkeypatch.setattr(parallelize, "measure_cpu_matmul_speed", measure)
    parallelize._host_bf16_speedup.cache_clear()
    assert parallelize.cpu_bf16_speedup() == pytest.approx(0.55)
    assert not parallelize.cpu_bf16_pays() and len(measured) == 1
    parallelize._host_bf16_speedup.cache_clear()  # another process on the host: reads the file
    assert parallelize.cpu_bf16_speedup() == pytest.approx(0.55) and len(measured) == 1
    (entry,) = json.loads((tmp_path / "cpu-matmul-speed.json").read_text()).values()
    assert entry["bf16_gflop_per_s"] == 88.0 and entry["cpu"] == parallelize.cpu_model()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")  # another identity: measured on its own
    parallelize.cpu_bf16_speedup()
    assert len(measured) == 2 and len(json.loads((tmp_path / "cpu-matmul-speed.json").read_text())) == 2
    (tmp_path / "cpu-matmul-speed.json").write_text("{cut sho")
    parallelize._host_bf16_speedup.cache_clear()
    assert parallelize.cpu_bf16_speedup() == pytest.approx(0.55) and len(measured) == 3
    assert len(json.loads((tmp_path / "cpu-matmul-speed.json").read_text())) == 1  # replaced, readable
    # a cache that cannot be written: the measurement still decides, and the next process measures again
    monkeypatch.setenv("RLFLOW_CACHE_DIR", str(tmp_path / "cpu-matmul-speed.json" / "not-a-directory"))
    parallelize._host_bf16_speedup.cache_clear()
    assert parallelize.cpu_bf16_speedup() == pytest.approx(0.55) and len(measured) == 4
    parallelize._host_bf16_speedup.cache_clear()


def test_the_matmul_speeds_are_measured_on_one_thread_and_the_threads_restored(monkeypatch):
    monkeypatch.setattr(parallelize, "_SPEED_SHAPE", (8, 16, 32))  # any CPU multiplies this bf16 quickly
    threads = torch.get_num_threads()
    seen = []
    real = parallelize._matmul_gflops
    monkeypatch.setattr(
        parallelize, "_matmul_gflops", lambda *a, **k: seen.append(torch.get_num_threads()) or real(*a, **k)
    )
    speed = parallelize.measure_cpu_matmul_speed()
    assert speed["fp32_gflop_per_s"] > 0 and speed["bf16_gflop_per_s"] > 0
    assert set(seen) == {1} and len(seen) == 6 and torch.get_num_threads() == threads


def test_layer_params_count_the_projections_and_the_mlp():
    assert TINY_LAYER * TINY_PASS < parallelize.CPU_BF16_MIN_PASS_WORK <= SMALL * MAIN_PASS
    assert LARGE == 4 * 512 * 512 + 3 * 512 * 1024
    gqa = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 1024}
    assert parallelize.layer_matmul_params(gqa) == 2 * 512 * 512 + 2 * 512 * 128 + 3 * 512 * 1024
    assert parallelize.layer_matmul_params({}) is None


def test_a_pass_holds_a_mini_batchs_rows_at_their_longest_at_most_the_micro_batch_budget():
    cfg = load_config(None, ["data.batch_size=32", "algorithm.n_samples=8", "data.max_prompt_len=8",
                             "rollout.max_new_tokens=5", "data.max_response_len=5"])  # fmt: skip
    assert cfg.pass_tokens("actor") == 32 * 8 * 13
    halves = load_config(None, ["data.batch_size=32", "algorithm.n_samples=8", "data.max_prompt_len=8",
                                "rollout.max_new_tokens=5", "algorithm.n_minibatches=2"])  # fmt: skip
    assert halves.pass_tokens("actor") == 16 * 8 * 13
    budget = load_config(None, ["data.batch_size=32", "models.actor.micro_batch_tokens=512"])
    assert budget.pass_tokens("actor") == 512
    dpo = load_config(None, ["algorithm.name=dpo", "models.ref.init=tiny", "data.batch_size=4", "data.max_prompt_len=8",
                             "data.max_response_len=8"])  # fmt: skip
    assert dpo.pass_tokens("actor") == 2 * 4 * 16  # chosen and rejected rows


def _setups(overrides: list[str], use_gpu: bool, tmp_path: Path) -> dict:
    """The driver's ModelSetups of a GRPO plan with a reference model, on one worker."""
    cfg = load_config(None, ["algorithm.kl_coef=0.1", *overrides])
    one = ParallelStrategy()
    mfcs = algorithm_mfcs("grpo", rule_based_reward=True, use_ref=True)
    calls = {m.name: CallPlacement(m, (0,), one) for m in mfcs}
    paths = {"actor": str(tmp_path), "ref": str(tmp_path)}
    return model_setups(cfg, paths, calls, "arithmetic", use_gpu=use_gpu)


def test_the_driver_resolves_each_models_dtype_for_its_workers(monkeypatch, tmp_path):
    monkeypatch.setattr(parallelize, "cpu_flags", lambda: NATIVE_BF16)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 512, "intermediate_size": 1024}))
    auto = ["models.actor.dtype=auto", "models.ref.init=tiny", "models.ref.dtype=float32"]
    setups = _setups(auto, use_gpu=False, tmp_path=tmp_path)
    assert (setups["actor"].compute_dtype, setups["ref"].compute_dtype) == (torch.bfloat16, torch.float32)
    monkeypatch.setattr(parallelize, "cpu_flags", lambda: AVX2_ONLY)
    assert _setups(auto, use_gpu=False, tmp_path=tmp_path)["actor"].compute_dtype == torch.float32
    assert _setups(auto, use_gpu=True, tmp_path=tmp_path)["actor"].compute_dtype == torch.bfloat16
    explicit = ["models.ref.init=tiny", "models.actor.dtype=float32"]
    assert _setups(explicit, use_gpu=True, tmp_path=tmp_path)["actor"].compute_dtype == torch.float32
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "intermediate_size": 256}))
    monkeypatch.setattr(parallelize, "cpu_flags", lambda: NATIVE_BF16)
    assert _setups(auto, use_gpu=False, tmp_path=tmp_path)["actor"].compute_dtype == torch.bfloat16  # 6144 tokens
    small = [*auto, "data.batch_size=2"]  # 2 x 8 rows of 16 + 8 tokens: per-op overhead
    assert _setups(small, use_gpu=False, tmp_path=tmp_path)["actor"].compute_dtype == torch.float32


class FP32Sampler(HFRolloutEngine):
    """The built-in sampler declaring that it generates in float32 whatever the copy's dtype."""

    weight_dtype = torch.float32


@pytest.mark.parametrize(
    ("overrides", "reasons"),
    [
        # the built-in sampler computes in the actor's dtype: the same numerics as training
        (["placement.use_gpu=false", "models.actor.dtype=bfloat16"], []),
        (["placement.use_gpu=true"], []),  # the default (auto): bf16 on GPUs, the sampler too
        (["placement.use_gpu=true", "models.actor.dtype=auto"], []),
        (
            ["placement.use_gpu=false", "models.actor.dtype=bfloat16", "rollout.engine=fp32_sampler"],
            ["the rollout runs in torch.float32, training in torch.bfloat16"],
        ),
        (["placement.use_gpu=false", "models.actor.dtype=float32", "rollout.engine=fp32_sampler"], []),
    ],
)
def test_the_recompute_follows_the_actors_dtype(monkeypatch, overrides, reasons):
    monkeypatch.setattr(rollout_base, "_ENGINES", dict(rollout_base._ENGINES))
    register_rollout_engine("fp32_sampler")(FP32Sampler)
    graph = build_dataflow(load_config(None, overrides), rule_reward=True)
    assert list(graph.graph["old_logp_mismatch"]) == reasons
    assert ("actor_inf" in graph) == bool(reasons)


@pytest.mark.timeout(300)
def test_a_bf16_run_trains_and_samples_in_bf16_and_checkpoints_fp32_masters(tmp_path, monkeypatch):
    training: list[torch.dtype] = []
    real_init = TrainEngine.__init__

    def recording_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)

        def hook(module, inputs, output):
            if torch.is_grad_enabled():  # a training forward
                training.append((output[0] if isinstance(output, tuple) else output).dtype)

        self.stage.model.layers["0"].register_forward_hook(hook)

    decoders, real_decoder = [], hf_sampler._decoder

    def recording_decoder(*args, **kwargs):
        decoders.append(real_decoder(*args, **kwargs))
        return decoders[-1]

    monkeypatch.setattr(TrainEngine, "__init__", recording_init)
    monkeypatch.setattr(hf_sampler, "_decoder", recording_decoder)
    run = tmp_path / "run"
    overrides = [*TINY, f"logging.dir={run}", "models.actor.dtype=bfloat16", "placement.use_gpu=false"]
    with Trainer(GRPO, overrides=overrides, progress_bars=False) as trainer:
        assert trainer.fit().steps == 1
        assert trainer.workers.driver_hosted
        assert trainer.setup.models["actor"].compute_dtype == torch.bfloat16
        assert "actor_inf" not in trainer.graph  # both sides compute in bf16: no recompute

    assert training and set(training) == {torch.bfloat16}
    assert decoders and all(type(d) is FastDecoder and d._k[0].dtype == torch.bfloat16 for d in decoders)
    step = run / "checkpoints" / "step_1" / "actor"
    state = torch.load(step / "engine" / "rank00000.pt", weights_only=False)
    assert {t.dtype for t in state["params"].values()} == {torch.float32}
    moments = [v for s in state["optim"]["state"].values() for k, v in s.items() if k.startswith("exp_avg")]
    assert moments and {m.dtype for m in moments} == {torch.float32}
    assert {t.dtype for t in load_file(step / "hf" / "model.safetensors").values()} == {torch.float32}
    record = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("actor_train/loss" in r for r in record)


@pytest.mark.parametrize(
    ("overrides", "compute_bytes", "rollout_bytes"),
    [
        ([], 2, 2),  # the default, auto: bf16 on GPUs, training and the built-in sampler
        (["models.actor.dtype=float32"], 4, 4),
        (["models.actor.dtype=bfloat16"], 2, 2),
        (["models.actor.dtype=float32", "rollout.engine=vllm"], 4, 2),  # vLLM generates in bf16 whatever the actor does
    ],
)
def test_gpu_plans_price_the_actors_compute_dtype(overrides, compute_bytes, rollout_bytes):
    cluster = planning_cluster(load_config(GRPO, overrides), use_gpu=True, profile=None)
    assert (cluster.precision.compute_bytes, cluster.precision.generate_bytes) == (compute_bytes, rollout_bytes)
