"""Training-engine throughput: tokens/s of a train step and of inference, 1 vs 2 CPU workers.

A tiny Llama (hidden 128, 4 layers, 4 heads / 2 kv heads, vocabulary 512) trains on a fixed
global batch of 32 sequences of 128 tokens (strong scaling): with 2 workers each is one dp
rank (FSDP2 over gloo) holding half of the rows. Each worker process uses one torch thread.
Figures are the median over timed repetitions after one warm-up; tokens are valid tokens
of the global batch.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time

import torch

ROWS, SEQ, REPEATS = 32, 128, 3


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    return LlamaForCausalLM(config)


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (ROWS, SEQ), generator=g)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (ROWS,), generator=g)
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask}


def _loss(outputs, batch):
    mask = batch["attention_mask"].float()
    return -(outputs["log_probs"] * mask).sum() / mask.sum(), {}


def _timed(fn) -> float:
    fn()  # warm-up
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rlflow.engine.optim import OptimConfig
    from rlflow.engine.train_engine import EngineConfig, TrainEngine

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (1, world, 1), mesh_dim_names=("pp", "dp", "tp"))
        config = EngineConfig(optim=OptimConfig(lr=1e-4), num_micro_batches=2, device="cpu")
        engine = TrainEngine(_model(), mesh, config)
        full = _batch()
        rows = torch.arange(ROWS).chunk(world)[rank]
        batch = {k: v[rows] for k, v in full.items()}

        def train():
            engine.train_step(batch, _loss, num_mini_batches=2)
            dist.barrier()

        def infer():
            engine.forward(batch)
            dist.barrier()

        t_train, t_infer = _timed(train), _timed(infer)
        if rank == 0:
            tokens = int(full["attention_mask"].sum())
            with open(out, "w") as f:
                json.dump({"tokens": tokens, "train_s": t_train, "infer_s": t_infer}, f)
    finally:
        dist.destroy_process_group()


def _measure(world: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        torch.multiprocessing.spawn(_worker, args=(world, port, out), nprocs=world, join=True)
        with open(out) as f:
            return json.load(f)


def run() -> list[dict]:
    """Records: tokens/s of train_step and forward on 1 and 2 workers, and the 2-vs-1 ratios."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    by_world = {world: _measure(world) for world in (1, 2)}
    records = []
    for call, key in (("train_step", "train_s"), ("inference", "infer_s")):
        rates = {w: r["tokens"] / r[key] for w, r in by_world.items()}
        for world, rate in rates.items():
            records.append(
                {
                    "name": f"engine_{call}_tokens_per_s_{world}w",
                    "call": call,
                    "workers": world,
                    "strategy": f"dp={world},tp=1,pp=1",
                    "tokens_per_s": round(rate, 1),
                    "seconds": round(by_world[world][key], 4),
                    "tokens": by_world[world]["tokens"],
                    "unit": "tokens/s",
                }
            )
        records.append(
            {"name": f"engine_{call}_speedup_2w_vs_1w", "call": call, "ratio": round(rates[2] / rates[1], 3)}
        )
    return records


if __name__ == "__main__":
    for record in run():
        print(json.dumps(record))
