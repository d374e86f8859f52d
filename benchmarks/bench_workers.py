"""Model workers: one GRPO iteration on two CPU workers, per MFC, and the reallocation pre-hooks.

Two colocated workers (one Ray actor each) host a tiny Llama actor (hidden 64, 4 layers, char
vocabulary), a frozen reference and a rule-based reward. Each iteration: ``actor_gen`` (8
prompts x 4 samples, 16 new tokens, on a dp=2 copy of the actor), ``ref_inf``, ``reward_inf``
and ``actor_train`` on dp=2 (the actor's home), then a greedy rollout on a tp=2 copy. Reported
per MFC: the median over ``ITERATIONS`` iterations (after one warm-up) of the worker-side
``time_s`` (slowest dp rank), and the driver-side wall time of the ``pre_call`` hooks that
build the copy and reshard the freshly trained weights into it (dp=2 replicas / tp=2 shards).
"""

from __future__ import annotations

import statistics
import tempfile
import time

import ray
import torch

from rlflow.algos.params import AlgorithmParams
from rlflow.controller import RayClassWithInitArgs, RayWorkerGroup, ResourcePool
from rlflow.data.tiny_models import build_tiny_model
from rlflow.data.tokenizer import build_char_tokenizer
from rlflow.dataflow import MFCDef, algorithm_mfcs
from rlflow.dataflow.algorithms import GEN_OUTPUT_KEYS, PROMPT_KEYS
from rlflow.engine.optim import OptimConfig
from rlflow.engine.rollout import SamplingParams
from rlflow.protocol import DataProto
from rlflow.strategy import ParallelStrategy
from rlflow.workers.model_worker import ModelWorker
from rlflow.workers.setup import CallLayout, ModelSetup, WorkerSetup

ITERATIONS = 3
NUM_PROMPTS, N_SAMPLES, MAX_NEW = 8, 4, 16
DP2 = CallLayout((0, 1), ParallelStrategy(dp=2))
TP2 = CallLayout((0, 1), ParallelStrategy(tp=2))


def _setup(root: str) -> tuple[WorkerSetup, DataProto, int]:
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(vocab_size=len(tokenizer), hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2)
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    mfcs = {m.name: m for m in algorithm_mfcs("grpo")}
    mfcs["actor_gen_tp"] = MFCDef("actor_gen_tp", "actor", "generate", PROMPT_KEYS, GEN_OUTPUT_KEYS)
    models = {
        "actor": ModelSetup("actor", "actor", root, trainable=True, optim=OptimConfig(lr=1e-4)),
        "ref": ModelSetup("ref", "ref", root),
        "reward": ModelSetup("reward", "reward", None, reward_fn="numeric_match"),
    }
    sampling = SamplingParams(n=N_SAMPLES, max_new_tokens=MAX_NEW, seed=0)
    setup = WorkerSetup(
        models,
        mfcs,
        {name: DP2 for name in mfcs} | {"actor_gen_tp": TP2},
        AlgorithmParams("grpo", adv_estimator="grpo", n_samples=N_SAMPLES, kl_coef=0.01),
        sampling,
        SamplingParams(greedy=True, max_new_tokens=MAX_NEW),
        root,
    )
    tokenizer.padding_side = "left"
    prompts = [f"{a}+{a + 7}=" for a in range(NUM_PROMPTS)]
    enc = tokenizer(prompts, padding=True, return_tensors="pt")
    answers = [str(2 * a + 7) for a in range(NUM_PROMPTS)]
    batch = DataProto.from_dict({"prompts": enc.input_ids, "prompt_mask": enc.attention_mask}, {"answers": answers})
    return setup, batch, sum(p.numel() for p in model.parameters())


def _iteration(group: RayWorkerGroup, setup: WorkerSetup, batch: DataProto, step: int) -> dict[str, float]:
    """One iteration (the calls of training step ``step``); returns worker-side ``time_s`` per MFC and
    driver-side hook seconds."""
    times, outputs = {}, {}

    def call(name: str, *inputs, **kwargs):
        layout, hooks = setup.layouts[name], setup.hook_ranks(name)
        if hooks:
            start = time.perf_counter()
            group.view(list(hooks)).pre_call(name, step)
            times[f"{name}.pre_call"] = time.perf_counter() - start
        out = getattr(group.view(list(layout.ranks), layout.strategy), setup.mfcs[name].interface_type)(
            name, *inputs, step=step, **kwargs
        )
        if hooks:
            group.view(list(hooks)).post_call(name, step)
        return out

    gen = call("actor_gen", batch)
    outputs["ref_inf"] = call("ref_inf", gen)
    outputs["reward_inf"] = call("reward_inf", gen)
    outputs["actor_train"] = call("actor_train", gen, outputs["ref_inf"], outputs["reward_inf"])
    outputs["actor_gen"] = gen
    outputs["actor_gen_tp"] = call("actor_gen_tp", batch, greedy=True, evaluate=True)
    for name, future in outputs.items():
        times[name] = future.get().meta_info["time_s"]
    return times


def run() -> list[dict]:
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    pool = ResourcePool([2], cpus_per_worker=0.25)
    try:
        with tempfile.TemporaryDirectory() as root:
            setup, batch, num_params = _setup(root)
            group = RayWorkerGroup(pool, RayClassWithInitArgs(ModelWorker, setup))
            group.init_process_group(timeout_s=300)
            group.build()
            _iteration(group, setup, batch, 0)  # warm-up: first calls pay for lazy initialisation
            samples = [_iteration(group, setup, batch, step) for step in range(1, ITERATIONS + 1)]
        return [
            {
                "name": f"workers.grpo.{key}",
                "median_s": statistics.median(s[key] for s in samples),
                "iterations": ITERATIONS,
                "workers": 2,
                "rows": NUM_PROMPTS * N_SAMPLES,
                "max_new_tokens": MAX_NEW,
                "model_params": num_params,
                "torch_threads_per_worker": 1,
            }
            for key in samples[0]
        ]
    finally:
        pool.release()
        if started:
            ray.shutdown()


if __name__ == "__main__":
    import json

    torch.set_num_threads(1)
    for record in run():
        print(json.dumps(record))
