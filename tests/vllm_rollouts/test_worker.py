"""A one-process GRPO ModelWorker with ``rollout_engine="vllm"`` on CPU: the worker builds vLLM once,
pushes the trained weights into it before each rollout, and the log-probs vLLM reports for its
samples are the trainer's own forward (the home engine's), before and after an optimizer step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from vllm_helpers import save_char_llama

from rlflow.algos.params import AlgorithmParams
from rlflow.dataflow import algorithm_mfcs
from rlflow.engine.optim import OptimConfig
from rlflow.engine.rollout import SamplingParams
from rlflow.protocol import DataProto
from rlflow.strategy import ParallelStrategy
from rlflow.workers.model_worker import ModelWorker
from rlflow.workers.setup import CallLayout, ModelSetup, WorkerSetup

pytestmark = pytest.mark.vllm


@pytest.fixture
def worker(tmp_path):
    """A built one-rank GRPO worker (actor only, rewards given) over a tiny Llama with head_dim 32."""
    from rlflow.parallel.groups import clear_group_cache
    from rlflow.rendezvous import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    tokenizer = save_char_llama(tmp_path)
    mfcs = {m.name: m for m in algorithm_mfcs("grpo", rule_based_reward=False, use_ref=False)}
    del mfcs["reward_inf"]  # rewards are given
    actor = ModelSetup("actor", "actor", str(tmp_path), trainable=True, optim=OptimConfig(lr=5e-2))
    one = CallLayout((0,), ParallelStrategy())
    setup = WorkerSetup(
        {"actor": actor}, mfcs, {n: one for n in mfcs}, AlgorithmParams(name="grpo", adv_estimator="grpo", n_samples=2),
        SamplingParams(n=2, max_new_tokens=6, seed=0), SamplingParams(greedy=True, max_new_tokens=6), str(tmp_path),
        rollout_engine="vllm",
    )  # fmt: skip
    built = ModelWorker(setup)
    built.build()
    yield built, tokenizer
    clear_group_cache()  # the world stays: vLLM's exit handler destroys its groups over it


def _call(worker: ModelWorker, name: str, *inputs: DataProto) -> DataProto:
    worker.pre_call(name, 0)
    out = getattr(worker, worker.setup.mfcs[name].interface_type)(name, *inputs, step=0)
    worker.post_call(name, 0)
    return out


def test_rollout_log_probs_are_the_trainers_before_and_after_a_step(worker):
    worker, tokenizer = worker
    enc = tokenizer(["12+3=", "4+5=", "99-1=", "7+70="], padding=True, return_tensors="pt")
    prompts = DataProto.from_dict({"prompts": enc.input_ids, "prompt_mask": enc.attention_mask})
    home = worker.residency.models["actor"].engine
    rollouts = []
    for step in range(2):  # before and after the optimizer step
        out = _call(worker, "actor_gen", prompts)
        rollouts.append(out)
        width = out.batch["old_logp"].shape[1]  # the response tokens, at the end of each row
        trainer = home.forward({k: out.batch[k] for k in ("input_ids", "attention_mask")})["log_probs"][:, -width:]
        mask = out.batch["response_mask"][:, -width:].bool()  # the worker's is over the whole row
        assert mask.sum() > 0
        torch.testing.assert_close(out.batch["old_logp"][mask], trainer[mask], atol=1e-4, rtol=0)
        if step == 0:
            rewards = DataProto.from_dict({"rewards": torch.arange(len(out), dtype=torch.float32)})
            _call(worker, "actor_train", out, rewards)
    (engine,) = [e for e in worker.residency._copies.values()]  # built once, kept between the calls
    assert type(engine).__name__ == "VLLMRolloutEngine"
    # The step moved the policy, and the second rollout sampled from the moved one.
    assert not torch.equal(rollouts[0].batch["old_logp"], rollouts[1].batch["old_logp"])
