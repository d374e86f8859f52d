"""Shared prompts against padded rows: seconds of a train step and a forward of the main job's model.

The model is the main job's (``recipes/grpo_arithmetic.yaml``: hidden 128, 4 layers, 4 heads, MLP
512, tied embeddings, a 100-token vocabulary); the batch is a GRPO step of that job: 32 prompts of
3..7 tokens (left-padded to 8 columns), 8 samples each, responses of 1..5 tokens. Two engines from
the same weights in one process: ``shared_prefix=False`` (the padded rows) and ``True`` (the
samples of a prompt as one sequence, the prompt once: :mod:`rlflow.engine.shared_prefix`), in fp32
and in bf16 (fp32 master weights), with the process's torch threads (``OMP_NUM_THREADS``; rlflow's
one-worker plan takes every core). A train step is one AdamW step over the batch in one micro-batch.
Timed repetitions alternate between the two engines so that load from other jobs hits both alike;
figures are medians, ``speedup`` the median of the per-pair ratios padded / shared.
"""

from __future__ import annotations

import copy
import os
import statistics
import time

import torch

from benchmarks.bench_packing import main_job_model

PROMPTS, SAMPLES, PROMPT_COLS, RESPONSE_COLS, REPEATS = 32, 8, 8, 5, 9


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids, mask, response = [], [], []
    for _ in range(PROMPTS):
        length = int(torch.randint(3, PROMPT_COLS, (1,), generator=g))
        real_prompt = (torch.arange(PROMPT_COLS) >= PROMPT_COLS - length).long()
        prompt = torch.randint(1, 100, (PROMPT_COLS,), generator=g) * real_prompt
        for _ in range(SAMPLES):
            own = (torch.arange(RESPONSE_COLS) < int(torch.randint(1, RESPONSE_COLS + 1, (1,), generator=g))).long()
            ids.append(torch.cat([prompt, torch.randint(1, 100, (RESPONSE_COLS,), generator=g) * own]))
            mask.append(torch.cat([real_prompt, own]))
            response.append(torch.cat([torch.zeros(PROMPT_COLS, dtype=torch.long), own]))
    return {"input_ids": torch.stack(ids), "attention_mask": torch.stack(mask), "response_mask": torch.stack(response)}


def _loss(outputs, data):
    mask = data["response_mask"].float()
    return -(outputs["log_probs"] * mask).sum() / mask.sum(), {}


def _pairs(engines: dict, call) -> dict[bool, list[float]]:
    times: dict[bool, list[float]] = {shared: [] for shared in engines}
    for _ in range(2):  # warm-up
        for engine in engines.values():
            call(engine)
    for _ in range(REPEATS):
        for shared, engine in engines.items():
            start = time.perf_counter()
            call(engine)
            times[shared].append(time.perf_counter() - start)
    return times


def run() -> list[dict]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from rlflow.engine.optim import OptimConfig
    from rlflow.engine.packing import position_ids_from_mask
    from rlflow.engine.train_engine import EngineConfig, TrainEngine
    from rlflow.rendezvous import free_port

    threads = int(os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads())
    torch.set_num_threads(threads)
    batch = _batch()
    real = int(batch["attention_mask"].sum())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    records = []
    try:
        mesh = DeviceMesh("cpu", torch.zeros(1, 1, 1, dtype=torch.long), mesh_dim_names=("pp", "dp", "tp"))
        base = main_job_model()
        for precision in ("fp32", "bf16"):
            config = dict(optim=OptimConfig(lr=1e-4), device="cpu", mixed_precision=precision)
            engines = {
                shared: TrainEngine(copy.deepcopy(base), mesh, EngineConfig(**config, shared_prefix=shared))
                for shared in (False, True)
            }
            layout = engines[True]._shared_prefix(batch, position_ids_from_mask(batch["attention_mask"]))
            calls = {
                "train_step": lambda e: e.train_step(batch, _loss, num_mini_batches=1),
                "forward": lambda e: e.forward(batch),
            }
            for name, call in calls.items():
                times = _pairs(engines, call)
                ratios = [a / b for a, b in zip(times[False], times[True])]
                records.append({
                    "name": f"shared_prefix_{name}_{precision}",
                    "padded_s": round(statistics.median(times[False]), 4),
                    "shared_s": round(statistics.median(times[True]), 4),
                    "speedup": round(statistics.median(ratios), 3),
                    "speedup_min": round(min(ratios), 3),
                    "speedup_max": round(max(ratios), 3),
                    "rows": len(batch["input_ids"]),
                    "padded_tokens": int(batch["attention_mask"].numel()),
                    "real_tokens": real,
                    "shared_tokens": layout.groups * layout.length if layout is not None else None,
                    "threads": threads,
                    "load_average_1m": round(os.getloadavg()[0], 2),
                })  # fmt: skip
    finally:
        dist.destroy_process_group()
    return records
