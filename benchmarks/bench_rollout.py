"""Generation throughput of the built-in HF sampler on CPU worker processes.

Runs the tiny Llama of :func:`rlflow.data.tiny_models.build_tiny_model` (4 layers, 128 wide,
100-token vocabulary) on 1 process, on 2 processes as dp=2 (each samples half the prompts)
and as tp=2 (the model split with ``apply_tp``; gloo collectives in every layer), each
process with one torch thread. Figures are generated tokens per second of wall time (the
slowest rank), best of ``REPEATS`` runs, and the ratio to one process.

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
REPEATS = 3


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(PROMPT_LEN // 2, PROMPT_LEN + 1, (NUM_PROMPTS,), generator=gen)
    ids = torch.zeros((NUM_PROMPTS, PROMPT_LEN), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths.tolist()):
        ids[row, PROMPT_LEN - n :] = torch.randint(3, 100, (n,), generator=gen)
        mask[row, PROMPT_LEN - n :] = 1
    return ids, mask


def _worker(rank: int, world: int, dp: int, tp: int, port: int, outdir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from rlflow.data.tiny_models import build_tiny_model
    from rlflow.engine.rollout import HFRolloutEngine, SamplingParams

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (1, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        engine = HFRolloutEngine(build_tiny_model(vocab_size=100).eval(), mesh)
        ids, mask = _prompts()
        rows = NUM_PROMPTS // dp
        dp_rank = mesh["dp"].get_local_rank()
        ids, mask = ids[dp_rank * rows : (dp_rank + 1) * rows], mask[dp_rank * rows : (dp_rank + 1) * rows]
        # No stop tokens: every row generates NEW_TOKENS, so all strategies do the same work.
        params = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, seed=0)
        engine.generate((ids, mask), SamplingParams(max_new_tokens=4, seed=0))  # warm-up
        times = []
        for _ in range(REPEATS):
            dist.barrier()
            start = time.perf_counter()
            out = engine.generate((ids, mask), params)
            dist.barrier()
            times.append(time.perf_counter() - start)
        tokens = torch.tensor([int(out["response_mask"].sum()) if mesh["tp"].get_local_rank() == 0 else 0])
        dist.all_reduce(tokens)
        if rank == 0:
            torch.save({"tokens": int(tokens), "times": times}, os.path.join(outdir, "result.pt"))
    finally:
        dist.destroy_process_group()


def _measure(dp: int, tp: int) -> dict:
    with tempfile.TemporaryDirectory() as outdir:
        mp.spawn(_worker, args=(dp * tp, dp, tp, free_port(), outdir), nprocs=dp * tp, join=True)
        result = torch.load(os.path.join(outdir, "result.pt"))
    best = min(result["times"])
    return {"tokens": result["tokens"], "seconds": best, "tokens_per_s": result["tokens"] / best}


def run() -> list[dict]:
    base = _measure(dp=1, tp=1)
    records = []
    for name, dp, tp in (("1 process", 1, 1), ("dp=2", 2, 1), ("tp=2", 1, 2)):
        figures = base if (dp, tp) == (1, 1) else _measure(dp=dp, tp=tp)
        records.append(
            {
                "name": f"rollout_hf_tiny_{name.replace(' ', '_').replace('=', '')}",
                "strategy": name,
                "processes": dp * tp,
                "prompts": NUM_PROMPTS,
                "new_tokens_per_prompt": NEW_TOKENS,
                "generated_tokens": figures["tokens"],
                "seconds": round(figures["seconds"], 3),
                "tokens_per_s": round(figures["tokens_per_s"], 1),
                "ratio_to_1_process": round(figures["tokens_per_s"] / base["tokens_per_s"], 2),
                "units": {"seconds": "s (best of 3, slowest rank)", "tokens_per_s": "generated tokens / s"},
            }
        )
    return records


if __name__ == "__main__":
    import json

    for record in run():
        print(json.dumps(record))
