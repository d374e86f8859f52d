"""Generation throughput of the built-in HF sampler on CPU worker processes.

Two models of :func:`rlflow.data.tiny_models.build_tiny_model` (100-token vocabulary): the tiny
one (4 layers, 128 wide; 32 prompts, one sample each, 64 new tokens), whose decode step is per-op
overhead, and a wider one (8 layers, 512 wide, 25 M parameters; 32 prompts × 4 samples, 16 new
tokens), whose step is the 128 rows' matmuls. Each runs on 1 process, on 2 processes as dp=2
(each samples half the prompts), as tp=2 (the model split with ``apply_tp``; gloo collectives in
every layer) and as pp=2 (two stages passing hidden states every decode step) with 1, 2 and 4
micro-batches of prompts in flight; each process with one torch thread. Figures are generated
tokens per second of wall time (the slowest rank), best of ``REPEATS`` runs, and the ratio to
one process.

    python -m benchmarks.run rollout
"""

from __future__ import annotations

import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlflow.rendezvous import free_port

NUM_PROMPTS = 32
PROMPT_LEN = 16
NEW_TOKENS = 64
REPEATS = 5
MODELS = {  # name -> build_tiny_model arguments, samples per prompt, new tokens
    "tiny": ({}, 1, NEW_TOKENS),
    # a GRPO group of 4 samples per prompt: 128 rows, where a decode step is the rows' matmuls
    "wide": (
        {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 8, "intermediate_size": 2048},
        4,
        16,
    ),
}
# name, dp, tp, pp, micro-batches in flight (pp only)
STRATEGIES = (
    ("1 process", 1, 1, 1, None), ("dp=2", 2, 1, 1, None), ("tp=2", 1, 2, 1, None), ("pp=2 M=1", 1, 1, 2, 1),
    ("pp=2 M=2", 1, 1, 2, 2), ("pp=2 M=4", 1, 1, 2, 4),
)  # fmt: skip


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(PROMPT_LEN // 2, PROMPT_LEN + 1, (NUM_PROMPTS,), generator=gen)
    ids = torch.zeros((NUM_PROMPTS, PROMPT_LEN), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths.tolist()):
        ids[row, PROMPT_LEN - n :] = torch.randint(3, 100, (n,), generator=gen)
        mask[row, PROMPT_LEN - n :] = 1
    return ids, mask


def _worker(
    rank: int, world: int, model: str, dp: int, tp: int, pp: int, mbs: int | None, port: int, outdir: str
) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from rlflow.data.tiny_models import build_tiny_model
    from rlflow.engine.rollout import HFRolloutEngine, SamplingParams

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        shape, samples, new_tokens = MODELS[model]
        lm = build_tiny_model(vocab_size=100, **shape).eval()
        engine = HFRolloutEngine(lm, mesh, num_micro_batches=mbs)
        ids, mask = _prompts()
        rows = NUM_PROMPTS // dp
        dp_rank = mesh["dp"].get_local_rank()
        ids, mask = ids[dp_rank * rows : (dp_rank + 1) * rows], mask[dp_rank * rows : (dp_rank + 1) * rows]
        # No stop tokens: every row generates NEW_TOKENS, so all strategies do the same work.
        params = SamplingParams(n=samples, temperature=1.0, max_new_tokens=new_tokens, seed=0)
        engine.generate((ids, mask), SamplingParams(max_new_tokens=4, seed=0))  # warm-up
        times = []
        for _ in range(REPEATS):
            dist.barrier()
            start = time.perf_counter()
            out = engine.generate((ids, mask), params)
            dist.barrier()
            times.append(time.perf_counter() - start)
        counts = mesh["tp"].get_local_rank() == 0 and mesh["pp"].get_local_rank() == 0  # every pp rank holds all
        tokens = torch.tensor([int(out["response_mask"].sum()) if counts else 0])
        dist.all_reduce(tokens)
        if rank == 0:
            torch.save({"tokens": int(tokens), "times": times}, os.path.join(outdir, "result.pt"))
    finally:
        dist.destroy_process_group()


def _measure(model: str, dp: int, tp: int, pp: int, mbs: int | None) -> dict:
    world = dp * tp * pp
    with tempfile.TemporaryDirectory() as outdir:
        mp.spawn(_worker, args=(world, model, dp, tp, pp, mbs, free_port(), outdir), nprocs=world, join=True)
        result = torch.load(os.path.join(outdir, "result.pt"))
    best = min(result["times"])
    return {"tokens": result["tokens"], "seconds": best, "tokens_per_s": result["tokens"] / best}


def run(models: tuple[str, ...] = tuple(MODELS)) -> list[dict]:
    records = []
    for model in models:
        base = None
        for name, dp, tp, pp, mbs in STRATEGIES:
            figures = _measure(model, dp, tp, pp, mbs)
            base = base or figures
            records.append(
                {
                    "name": f"rollout_hf_{model}_{name.replace(' ', '_').replace('=', '')}",
                    "model": model,
                    "strategy": name,
                    "processes": dp * tp * pp,
                    "prompts": NUM_PROMPTS,
                    "samples_per_prompt": MODELS[model][1],
                    "new_tokens_per_row": MODELS[model][2],
                    "generated_tokens": figures["tokens"],
                    "seconds": round(figures["seconds"], 3),
                    "tokens_per_s": round(figures["tokens_per_s"], 1),
                    "ratio_to_1_process": round(figures["tokens_per_s"] / base["tokens_per_s"], 2),
                    "load_average_1min": round(os.getloadavg()[0], 2),
                    "units": {
                        "seconds": f"s (best of {REPEATS}, slowest rank)",
                        "tokens_per_s": "generated tokens / s",
                    },
                }
            )
    return records


if __name__ == "__main__":
    import json

    for record in run():
        print(json.dumps(record))
