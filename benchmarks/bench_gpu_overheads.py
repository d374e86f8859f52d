"""What rlflow's own engines spend on one CUDA device beyond the roofline: the fixed costs the
GPU presets of the cost model must add (``rlflow/planner/cluster.py``).

Models narrow enough that their kernels take microseconds (hidden 256, so every kernel is a
launch, not a matmul) are timed at several depths, in one process, on one GPU, the way the
workers run them:

* **generate** — :class:`rlflow.engine.rollout.HFRolloutEngine` (the built-in sampler, its lean
  decoder; fp32 weights, as the sampler runs the copy it is given), ``rows`` sequences, no stop
  token, at two generation lengths: the difference over the extra steps is one decode step, the
  rest the call's fixed part (prefill, cache set-up, the outputs' copy to the host).
* **forward** / **train** — :class:`rlflow.engine.train_engine.TrainEngine` (FSDP over a NCCL
  group of one, bf16 compute): log-probs and entropies of ``rows`` × ``seq`` tokens, and one
  optimizer step of the PPO policy loss on them.

Then the decode step of models whose weights take real time to read (hidden 2048 and 4096, the
widths of 7B-class layers; :data:`DECODE_CHECKS`), timed the same way: what the cost model's
price of a decode step on the ``h200`` preset is held against
(``tests/planner/test_gpu_overheads.py``).

Each figure of the narrow models is a least-squares line over the depths: the slope is the host's cost per layer
(a decode step's per layer, a forward's per layer, a training step's per layer), the intercept
the per-call (or per-step) part. A record per call kind and a ``fit`` record, JSON, one a line.
Only a GPU host measures: ``python -m benchmarks.run gpu_overheads`` (or ``python -m
benchmarks.bench_gpu_overheads``); elsewhere it prints one record saying so. ``--cpu`` runs the
narrow models on CPU workers' gloo, to check the script, not to measure a GPU.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import numpy as np
import torch

from benchmarks.run import _machine

DEPTHS = (1, 4, 16)
HIDDEN, HEADS, VOCAB = 256, 4, 128
ROWS, PROMPT_LEN, SEQ = 16, 16, 64
GEN_SHORT, GEN_LONG = 2, 34
REPEATS = 7
# (hidden, intermediate, heads, layers, rows): 7B-class layer widths, fp32 as the sampler runs them
DECODE_CHECKS = (
    (4096, 11008, 32, 4, 16), (4096, 11008, 32, 4, 128), (2048, 5504, 16, 8, 64), (4096, 11008, 32, 2, 16),
    (4096, 11008, 32, 8, 16),
)  # fmt: skip
DECODE_VOCAB, DECODE_PROMPT = 32000, 64


def _timed(fn, device: str) -> float:
    """Median wall seconds of ``fn`` over :data:`REPEATS` calls, after two warm-up calls, the
    device synchronised around each."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(2):
        fn()
    seconds = []
    for _ in range(REPEATS):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def _model(layers: int):
    from rlflow.data.tiny_models import build_tiny_model

    return build_tiny_model(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=layers, num_heads=HEADS, num_kv_heads=HEADS,
        intermediate_size=4 * HIDDEN,
    )  # fmt: skip


def _decode_seconds(model, rows: int, prompt_len: int, device: str) -> tuple[float, float]:
    """``(call_s, decode_step_s)`` of the built-in sampler on ``model``: ``rows`` prompts generated to
    :data:`GEN_SHORT` and :data:`GEN_LONG` tokens (no stop token); a step is the difference over
    the extra steps, the call's fixed part what the short call leaves beside its steps."""
    from rlflow.engine.rollout import HFRolloutEngine, SamplingParams

    engine = HFRolloutEngine(model.to(device).eval(), pad_token_id=0)
    ids = torch.randint(3, model.config.vocab_size, (rows, prompt_len), device=device)
    prompts = (ids, torch.ones_like(ids))
    short, long = (
        _timed(lambda g=g: engine.generate(prompts, SamplingParams(n=1, max_new_tokens=g, seed=0)), device)
        for g in (GEN_SHORT, GEN_LONG)
    )
    step = (long - short) / (GEN_LONG - GEN_SHORT)
    return short - GEN_SHORT * step, step


def _decode_check(hidden: int, intermediate: int, heads: int, layers: int, rows: int, device: str) -> dict:
    """Seconds of one decode step of the built-in sampler on a model of 7B-class layer widths."""
    from rlflow.data.tiny_models import build_tiny_model

    model = build_tiny_model(
        vocab_size=DECODE_VOCAB, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=heads,
        intermediate_size=intermediate, max_position_embeddings=256,
    )  # fmt: skip
    return {
        "name": f"gpu_decode_h{hidden}_l{layers}_rows{rows}",
        "hidden_size": hidden, "intermediate_size": intermediate, "num_heads": heads, "num_layers": layers,
        "vocab_size": DECODE_VOCAB, "rows": rows, "prompt_len": DECODE_PROMPT, "gen": [GEN_SHORT, GEN_LONG],
        "decode_step_s": _decode_seconds(model, rows, DECODE_PROMPT, device)[1],
    }  # fmt: skip


def _matmul_rates(device: str) -> dict:
    """FLOP/s of fp32 and bf16 matmuls (torch's defaults: no TF32) at one large square shape and at a
    decode step's shape (128 rows through a 7B-class MLP projection): what the sampler's fp32 copy
    computes at on a GPU."""
    out = {}
    big = 8192 if device == "cuda" else 512
    for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        for (m, k, n), shape in (((big, big, big), "square"), ((128, 4096, 11008), "decode128")):
            a = torch.randn(m, k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            out[f"{tag}_{shape}_flops"] = 2.0 * m * k * n / _timed(lambda a=a, b=b: a @ b, device)
    return {"name": "gpu_matmul_rates", "tf32_allowed": torch.backends.cuda.matmul.allow_tf32, **out}


def _engine_seconds(layers: int, mesh, device: str) -> dict[str, float]:
    from rlflow.algos.params import AlgorithmParams
    from rlflow.engine.optim import OptimConfig
    from rlflow.engine.train_engine import EngineConfig, TrainEngine
    from rlflow.workers.losses import policy_loss_fn

    engine = TrainEngine(
        _model(layers), mesh, EngineConfig(device=device, optim=OptimConfig(lr=1e-6, max_grad_norm=1.0))
    )
    ids = torch.randint(3, VOCAB, (ROWS, SEQ))
    mask = torch.ones_like(ids)
    batch = {"input_ids": ids, "attention_mask": mask, "response_mask": mask,
             "old_logp": torch.full(ids.shape, -4.0), "advantages": torch.randn(ids.shape)}  # fmt: skip
    loss = policy_loss_fn(AlgorithmParams().resolved(), kl_coef=0.0)
    return {
        "forward_s": _timed(lambda: engine.forward({"input_ids": ids, "attention_mask": mask}), device),
        "train_s": _timed(lambda: engine.train_step(batch, loss, loss_mask_key="response_mask"), device),
    }


def _line(xs, ys) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points."""
    slope, intercept = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    return float(intercept), float(slope)


def run(device: str | None = None) -> list[dict]:
    """The records on the GPU (``device`` None: the GPU when there is one, else one record saying
    why nothing was measured, so that ``make bench`` on a CPU machine goes on); ``device="cpu"``
    (gloo) only checks that the script runs."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rlflow.rendezvous import free_port

    if device is None and not torch.cuda.is_available():
        return [{"name": "gpu_overheads", "skipped": "needs a CUDA device (figures: benchmarks/measured/)"}]
    device = device or "cuda"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh(device, (1, 1, 1), mesh_dim_names=("pp", "dp", "tp"))
        rows = []
        for layers in DEPTHS:
            call_s, step_s = _decode_seconds(_model(layers), ROWS, PROMPT_LEN, device)
            rows.append(
                {"layers": layers, "call_s": call_s, "decode_step_s": step_s, **_engine_seconds(layers, mesh, device)}
            )
        checks = [_decode_check(*c, device) for c in DECODE_CHECKS] if device == "cuda" else []
        checks.append(_matmul_rates(device))
    finally:
        dist.destroy_process_group()
    depths = [r["layers"] for r in rows]
    fit = {}
    for key in ("call_s", "decode_step_s", "forward_s", "train_s"):
        fit[f"{key}_intercept"], fit[f"{key}_per_layer"] = _line(depths, [r[key] for r in rows])
    machine = {**_machine(), "load_average_1min": round(os.getloadavg()[0], 2)}
    shape = {"hidden": HIDDEN, "rows": ROWS, "prompt_len": PROMPT_LEN, "seq": SEQ, "gen": [GEN_SHORT, GEN_LONG]}
    units = f"s (median of {REPEATS}, device synchronised)"
    return [
        *({"name": f"gpu_overheads_l{r['layers']}", **r, "units": units} for r in rows),
        {"name": "gpu_overheads_fit", **fit, **machine, "shape": shape, "units": units},
        *({**c, **machine, "units": units} for c in checks),
    ]


if __name__ == "__main__":
    import sys

    for record in run("cpu" if "--cpu" in sys.argv else None):
        print(json.dumps(record), flush=True)
