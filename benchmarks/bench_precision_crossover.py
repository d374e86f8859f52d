"""Where bf16 starts to pay on this CPU: fp32 against bf16 by the work of a pass, and what ``dtype: auto`` picks.

``models.<role>.dtype: auto`` computes in bf16 on a CPU with native bf16 when one decoder layer's
forward over a training pass multiplies at least ``CPU_BF16_MIN_PASS_WORK`` times (multiplying
parameters × the pass's tokens, :func:`rlflow.engine.parallelize.resolve_compute_dtype`). For a
few Llama shapes around that line — the tiny task's (width 64, 2 layers, 16 rows of 8 + 32), the main
job's (width 128, 4 layers, 256 rows of 8 + 5) and passes between and beyond — two ``TrainEngine``
s from the same weights (``mixed_precision`` fp32 and bf16; the padded rows, ``shared_prefix``
off) take AdamW steps, and two built-in samplers (fp32 and bf16 copies) generate the pass's rows,
alternating so that load from other jobs hits both alike. Each record: the medians, ``speedup``
(fp32 seconds / bf16 seconds, the median of the pairs' ratios), the pass's work and what ``auto``
resolves to here. The process's torch threads (``OMP_NUM_THREADS``: the one-worker plan's).

Run: ``OMP_NUM_THREADS=2 python -m benchmarks.run precision_crossover``.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from functools import partial

import torch

# (name, hidden, layers, prompts, samples, prompt tokens, new tokens)
SHAPES = [
    ("tiny_task", 64, 2, 2, 8, 8, 32),
    ("tiny_width_long", 64, 2, 8, 8, 8, 32),
    ("main_quarter", 128, 4, 8, 8, 8, 5),
    ("main_job", 128, 4, 32, 8, 8, 5),
    ("width_256", 256, 4, 8, 8, 8, 16),
]
REPEATS = 7


def _model(hidden: int, layers: int):
    from rlflow.data.tiny_models import build_tiny_model

    return build_tiny_model(
        "llama", vocab_size=100, hidden_size=hidden, num_layers=layers, num_heads=4, num_kv_heads=4,
        intermediate_size=4 * hidden, tie_word_embeddings=True,
    )  # fmt: skip


def _pairs(calls: dict) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        call()  # warm-up
    for _ in range(REPEATS):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return times


def _record(name: str, times: dict[str, list[float]], **fields) -> dict:
    ratios = [a / b for a, b in zip(times["fp32"], times["bf16"])]
    return {
        "name": name,
        "fp32_s": round(statistics.median(times["fp32"]), 4),
        "bf16_s": round(statistics.median(times["bf16"]), 4),
        "speedup": round(statistics.median(ratios), 3),
        **fields,
    }


def _loss(outputs, data):
    return -outputs["log_probs"].float().mean(), {}


def run() -> list[dict]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from rlflow.engine.optim import OptimConfig
    from rlflow.engine.parallelize import CPU_BF16_MIN_PASS_WORK, cpu_computes_bf16, resolve_compute_dtype
    from rlflow.engine.rollout.base import SamplingParams
    from rlflow.engine.rollout.hf_sampler import HFRolloutEngine
    from rlflow.engine.train_engine import EngineConfig, TrainEngine
    from rlflow.rendezvous import free_port

    threads = int(os.environ.get("OMP_NUM_THREADS") or torch.get_num_threads())
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    records = []
    try:
        mesh = DeviceMesh("cpu", torch.zeros(1, 1, 1, dtype=torch.long), mesh_dim_names=("pp", "dp", "tp"))
        for name, hidden, layers, prompts, samples, prompt_len, new in SHAPES:
            g = torch.Generator().manual_seed(0)
            base = _model(hidden, layers)
            layer = 4 * hidden * hidden + 3 * hidden * 4 * hidden
            rows, width = prompts * samples, prompt_len + new
            work = layer * rows * width
            auto = str(resolve_compute_dtype("auto", "cpu", layer, rows * width)).removeprefix("torch.")
            fields = {"hidden": hidden, "layers": layers, "rows": rows, "tokens": rows * width, "pass_work": work,
                      "auto": auto, "threads": threads, "native_bf16": cpu_computes_bf16(),
                      "threshold": CPU_BF16_MIN_PASS_WORK}  # fmt: skip
            engines = {
                p: TrainEngine(
                    copy.deepcopy(base),
                    mesh,
                    EngineConfig(optim=OptimConfig(lr=1e-4), device="cpu", mixed_precision=p, shared_prefix=False),
                )  # fmt: skip
                for p in ("fp32", "bf16")
            }
            batch = {"input_ids": torch.randint(1, 100, (rows, width), generator=g),
                     "attention_mask": torch.ones(rows, width, dtype=torch.long)}  # fmt: skip

            steps = {p: partial(e.train_step, batch, _loss, num_mini_batches=1) for p, e in engines.items()}
            records.append(_record(f"crossover_train_{name}", _pairs(steps), **fields, load_average_1m=_load()))
            samplers = {
                "fp32": HFRolloutEngine(copy.deepcopy(base).eval(), pad_token_id=0),
                "bf16": HFRolloutEngine(copy.deepcopy(base).to(torch.bfloat16).eval(), pad_token_id=0),
            }
            ids = torch.randint(1, 100, (prompts, prompt_len), generator=g)
            params = SamplingParams(n=samples, max_new_tokens=new, seed=0)
            gens = {p: partial(s.generate, (ids, torch.ones_like(ids)), params) for p, s in samplers.items()}
            records.append(_record(f"crossover_generate_{name}", _pairs(gens), **fields, load_average_1m=_load()))
    finally:
        dist.destroy_process_group()
    return records


def _load() -> float:
    return round(os.getloadavg()[0], 2)
