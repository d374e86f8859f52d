"""Packed (padding-free) vs padded micro-batches: tokens/s of a train step and a forward, 1 CPU worker.

The model is the tiny Llama of ``recipes/grpo_arithmetic.yaml`` (hidden 128, 4 layers,
4 heads, MLP 512, tied embeddings, the char tokenizer's 100-token vocabulary). The batch
has 64 rows in a 64-column layout, each row 8..64 valid tokens (uniform, seeded): a prompt
left-padded to 16 columns and a response right-padded after it, as a rollout produces.

One engine per mode, in one worker process with one torch thread: ``packing="off"`` (HF
SDPA with a padding mask, micro-batches trimmed to their valid columns) and
``packing="on"`` (one packed row per micro-batch through
:func:`rlflow.engine.attention.varlen_sdpa_attention`). A train step is one AdamW step on
the batch cut into 2 token-balanced micro-batches. Timed repetitions alternate between the
modes so that load from other jobs hits both alike; figures are medians. Tokens are the
valid tokens of the batch. Besides wall-clock seconds each record gives the worker's CPU
seconds (``time.process_time``): with one thread and an idle machine they match, and on a
machine shared with other jobs the CPU-time figures are the ones that still compare.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time

import torch

ROWS, PROMPT_COLS, RESPONSE_COLS, REPEATS = 64, 16, 48, 7
MIN_LEN, MAX_LEN = 8, 64


def main_job_model():
    """The main job's model (``recipes/grpo_arithmetic.yaml``), fresh weights."""
    from rlflow.data.tiny_models import build_tiny_model

    return build_tiny_model(
        "llama", vocab_size=100, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=4,
        intermediate_size=512, tie_word_embeddings=True,
    )  # fmt: skip


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(MIN_LEN, MAX_LEN + 1, (ROWS,), generator=g)
    prompts = torch.randint(2, PROMPT_COLS + 1, (ROWS,), generator=g).minimum(lengths - 1)
    mask = torch.zeros(ROWS, PROMPT_COLS + RESPONSE_COLS, dtype=torch.long)
    response = torch.zeros_like(mask)
    for r, (n, p) in enumerate(zip(lengths.tolist(), prompts.tolist())):
        n = min(n, p + RESPONSE_COLS)
        mask[r, PROMPT_COLS - p : PROMPT_COLS - p + n] = 1
        response[r, PROMPT_COLS : PROMPT_COLS - p + n] = 1
    ids = torch.randint(3, 100, mask.shape, generator=g) * mask
    return {"input_ids": ids, "attention_mask": mask, "response_mask": response}


def _loss(outputs, batch):
    mask = batch["response_mask"].float()
    return -(outputs["log_probs"] * mask).sum() / mask.sum(), {}


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rlflow.engine.optim import OptimConfig
    from rlflow.engine.train_engine import EngineConfig, TrainEngine

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
        batch = _batch()
        engines = {
            mode: TrainEngine(
                main_job_model(),
                mesh,
                EngineConfig(optim=OptimConfig(lr=1e-4), num_micro_batches=2, device="cpu", packing=mode),
            )
            for mode in ("off", "on")
        }
        calls = {
            "train_step": lambda e: e.train_step(batch, _loss, loss_mask_key="response_mask"),
            "inference": lambda e: e.forward(batch),
        }
        times: dict[str, list[float]] = {f"{c}_{m}_{clock}": [] for c in calls for m in engines for clock in "wc"}
        for rep in range(REPEATS + 1):  # the first round warms up
            for call, fn in calls.items():
                for mode, engine in engines.items():
                    wall, cpu = time.perf_counter(), time.process_time()
                    fn(engine)
                    if rep:
                        times[f"{call}_{mode}_w"].append(time.perf_counter() - wall)
                        times[f"{call}_{mode}_c"].append(time.process_time() - cpu)
        mask = batch["attention_mask"]
        result = {k: statistics.median(v) for k, v in times.items()}
        result.update(tokens=int(mask.sum()), slots=mask.numel())
        with open(out, "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def _measure() -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        torch.multiprocessing.spawn(_worker, args=(port, out), nprocs=1, join=True)
        with open(out) as f:
            return json.load(f)


def run() -> list[dict]:
    """Records: tokens/s of train_step and forward, padded and packed, and the packed/padded ratios."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = _measure()
    tokens = result["tokens"]
    records = []
    for call in ("train_step", "inference"):
        rates, cpu_rates = {}, {}
        for mode, label in (("off", "padded"), ("on", "packed")):
            seconds, cpu_seconds = result[f"{call}_{mode}_w"], result[f"{call}_{mode}_c"]
            rates[label], cpu_rates[label] = tokens / seconds, tokens / cpu_seconds
            records.append(
                {
                    "name": f"packing_{call}_tokens_per_s_{label}",
                    "call": call,
                    "packing": mode,
                    "tokens_per_s": round(rates[label], 1),
                    "tokens_per_cpu_s": round(cpu_rates[label], 1),
                    "seconds": round(seconds, 4),
                    "cpu_seconds": round(cpu_seconds, 4),
                    "tokens": tokens,
                    "padding_fraction": round(1 - tokens / result["slots"], 3),
                    "unit": "tokens/s",
                }
            )
        records.append(
            {
                "name": f"packing_{call}_ratio_packed_vs_padded",
                "call": call,
                "ratio": round(rates["packed"] / rates["padded"], 3),
                "cpu_time_ratio": round(cpu_rates["packed"] / cpu_rates["padded"], 3),
            }
        )
    return records


if __name__ == "__main__":
    for record in run():
        print(json.dumps(record))
