"""Tiny HF models, a reference greedy decoder and a one-rank GRPO worker shared by the rollout tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rlflow.algos.params import AlgorithmParams
from rlflow.dataflow import algorithm_mfcs
from rlflow.engine.optim import OptimConfig
from rlflow.engine.packing import position_ids_from_mask
from rlflow.engine.rollout import SamplingParams
from rlflow.protocol import DataProto
from rlflow.strategy import ParallelStrategy
from rlflow.workers.model_worker import ModelWorker
from rlflow.workers.setup import CallLayout, ModelSetup, WorkerSetup

VOCAB = 100
PAD = 0


def tiny_config(arch: str = "llama"):
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=PAD,
        tie_word_embeddings=False,
    )
    return LlamaConfig(**kwargs) if arch == "llama" else Qwen2Config(**kwargs)


def tiny_model(arch: str = "llama", seed: int = 0) -> torch.nn.Module:
    """A randomly initialised 4-layer causal LM; the same seed gives the same weights."""
    torch.manual_seed(seed)
    cls = LlamaForCausalLM if arch == "llama" else Qwen2ForCausalLM
    model = cls(tiny_config(arch)).eval()
    # HF's default init (std 0.02) makes near-uniform logits; larger weights give decisive argmaxes.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    return model


def left_padded_prompts(lengths: list[int], seed: int = 0, width: int | None = None):
    """``(input_ids, attention_mask)`` of random prompts with the given lengths, left-padded."""
    gen = torch.Generator().manual_seed(seed)
    width = width or max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(1, VOCAB, (n,), generator=gen)
        mask[row, width - n :] = 1
    return ids, mask


@torch.no_grad()
def naive_greedy(model, input_ids, attention_mask, max_new_tokens: int, stop_token_ids=()) -> torch.Tensor:
    """Greedy decoding by recomputing the full forward every step (no KV cache).

    Returns ``(B, max_new_tokens)`` responses, padded with PAD after a row's stop token.
    """
    ids, mask = input_ids.clone(), attention_mask.clone()
    out = torch.full((ids.shape[0], max_new_tokens), PAD, dtype=torch.long)
    done = torch.zeros(ids.shape[0], dtype=torch.bool)
    for step in range(max_new_tokens):
        logits = model(
            input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=False
        ).logits[:, -1]
        token = logits.argmax(-1)
        out[:, step] = torch.where(done, PAD, token)
        done |= torch.isin(token, torch.tensor(list(stop_token_ids), dtype=torch.long))
        if done.all():
            break
        ids = torch.cat([ids, token[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return out


def grpo_worker(path: str, rollout_engine: str) -> ModelWorker:
    """A built one-rank GRPO worker (actor only, rewards given) on the model saved at ``path``."""
    mfcs = {m.name: m for m in algorithm_mfcs("grpo", rule_based_reward=False, use_ref=False)}
    del mfcs["reward_inf"]  # rewards are given
    actor = ModelSetup("actor", "actor", path, trainable=True, optim=OptimConfig(lr=5e-2))
    one = CallLayout((0,), ParallelStrategy())
    setup = WorkerSetup(
        {"actor": actor}, mfcs, {n: one for n in mfcs}, AlgorithmParams(name="grpo", adv_estimator="grpo", n_samples=2),
        SamplingParams(n=2, max_new_tokens=6, seed=0), SamplingParams(greedy=True, max_new_tokens=6), path,
        rollout_engine=rollout_engine,
    )  # fmt: skip
    worker = ModelWorker(setup)
    worker.build()
    return worker


def call(worker: ModelWorker, name: str, *inputs: DataProto, step: int = 0) -> DataProto:
    """``name`` with its pre- and post-call hooks, as the driver runs it for ``step``."""
    worker.pre_call(name, step)
    out = getattr(worker, worker.setup.mfcs[name].interface_type)(name, *inputs, step=step)
    worker.post_call(name, step)
    return out
