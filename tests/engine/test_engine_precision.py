"""A model's compute dtype (``ModelSetup.compute_dtype``, from ``models.<role>.dtype``) on a CPU worker:
in bf16 its training engine computes in bf16 over fp32 masters and optimizer state, its rollout copy
samples in bf16 with the torch lean decoder (the C++ step is fp32-only) and a bf16 KV cache, and the
two agree on the log-probs of what was sampled; in fp32 everything stays fp32."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from rollout_helpers import call

from rlflow.algos.params import AlgorithmParams
from rlflow.data.tokenizer import load_tokenizer
from rlflow.dataflow import algorithm_mfcs
from rlflow.engine.optim import OptimConfig
from rlflow.engine.rollout import SamplingParams, hf_sampler
from rlflow.engine.rollout.fast_decode import FastDecoder
from rlflow.engine.rollout.native_decode import NativeDecoder
from rlflow.protocol import DataProto
from rlflow.strategy import ParallelStrategy
from rlflow.workers.model_worker import ModelWorker
from rlflow.workers.setup import CallLayout, ModelSetup, WorkerSetup

torch.set_num_threads(1)


@pytest.fixture
def decoders(monkeypatch) -> list:
    """The decoders the sampler builds, recorded."""
    built, real = [], hf_sampler._decoder

    def recording(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(hf_sampler, "_decoder", recording)
    return built


def grpo_worker(path: str, compute_dtype: torch.dtype) -> ModelWorker:
    """A built one-rank GRPO worker (actor only, rewards given) computing in ``compute_dtype``."""
    mfcs = {m.name: m for m in algorithm_mfcs("grpo", rule_based_reward=False, use_ref=False)}
    del mfcs["reward_inf"]  # rewards are given
    actor = ModelSetup("actor", "actor", path, trainable=True, optim=OptimConfig(lr=5e-2), compute_dtype=compute_dtype)
    one = CallLayout((0,), ParallelStrategy())
    setup = WorkerSetup(
        {"actor": actor}, mfcs, {n: one for n in mfcs}, AlgorithmParams(name="grpo", adv_estimator="grpo", n_samples=2),
        SamplingParams(n=2, max_new_tokens=6, seed=0), SamplingParams(greedy=True, max_new_tokens=6), path,
    )  # fmt: skip
    worker = ModelWorker(setup)
    worker.build()
    return worker


def _record_layer_dtypes(engine) -> list[tuple[torch.dtype, bool]]:
    """(dtype of the first decoder layer's output, grad enabled) of every forward of ``engine``, from now on."""
    seen: list[tuple[torch.dtype, bool]] = []

    def hook(module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        seen.append((out.dtype, torch.is_grad_enabled()))

    engine.stage.model.layers["0"].register_forward_hook(hook)
    return seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_worker_trains_and_samples_in_the_models_compute_dtype(one_rank_world, decoders, dtype) -> None:
    tokenizer = load_tokenizer(one_rank_world, padding_side="left")
    worker = grpo_worker(one_rank_world, dtype)
    engine = worker.residency.models["actor"].engine
    seen = _record_layer_dtypes(engine)
    assert engine.compute_dtype == dtype
    before = {n: p.detach().clone() for n, p in engine.stage.named_parameters()}

    enc = tokenizer(["12+34=", "7+8=", "100+1="], return_tensors="pt", padding=True)
    prompts = DataProto.from_dict({"prompts": enc["input_ids"], "prompt_mask": enc["attention_mask"]})
    gen = call(worker, "actor_gen", prompts, step=1)
    (decoder,) = decoders
    assert type(decoder) is (FastDecoder if dtype == torch.bfloat16 else NativeDecoder)
    assert decoder._k[0].dtype == decoder._v[0].dtype == dtype  # the KV cache in the compute dtype
    assert gen.batch["old_logp"].dtype == torch.float32  # sampled and scored from float32 logits

    # The home engine scores what the copy sampled as the copy did: the same dtype and numerics,
    # which is why the old-log-prob recompute stays off for this pair (AlgorithmConfig.old_logp_mismatch).
    with torch.no_grad():
        scored = engine.forward({k: gen.batch[k] for k in ("input_ids", "attention_mask")})["log_probs"]
    response = gen.batch["response_mask"].bool()  # (N, P+R), as old_logp
    tolerance = 0.02 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(scored[response], gen.batch["old_logp"][response], atol=tolerance, rtol=0)

    rewards = DataProto.from_dict({"rewards": torch.arange(len(gen), dtype=torch.float32) % 3})
    call(worker, "actor_train", gen, rewards, step=1)
    assert seen == [(dtype, False), (dtype, True)]  # the scoring forward, then the training forward
    params = dict(engine.stage.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.float32}  # fp32 masters
    assert any(not torch.equal(before[n], p) for n, p in params.items())  # the step moved them
    moments = [v for s in engine.optimizer.state.values() for k, v in s.items() if k.startswith("exp_avg")]
    assert moments and {m.dtype for m in moments} == {torch.float32}


def test_a_model_setup_refuses_a_dtype_it_cannot_compute_in(one_rank_world) -> None:
    actor = ModelSetup("actor", "actor", one_rank_world, trainable=True, optim=OptimConfig())
    with pytest.raises(ValueError, match=r"model 'actor': compute_dtype=torch.float16, expected one of"):
        dataclasses.replace(actor, compute_dtype=torch.float16)
