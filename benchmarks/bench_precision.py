"""Compute precision on this CPU: the machine's limits, and rlflow's engines in fp32 and bf16 against them.

The compute-bound model of issue 25 (a 21M-parameter Llama: width 512, 8 layers, 8 heads, MLP
1024, vocabulary 512) in one process on one torch thread, as an rlflow CPU worker runs:

- limits: a 2048² matmul's FLOP/s in fp32 and bf16 (1 and 2 threads), and one thread's copy
  bandwidth (bytes read + written per second);
- a training step (``TrainEngine.train_step``, AdamW, fp32 master weights; ``mixed_precision``
  fp32 or bf16) on 16 rows of 32 + 128 tokens: seconds and model FLOP/s (6 · matmul parameters ·
  tokens + the attention products), as a share of the matmul peak at that precision;
- generation with the built-in sampler (its weights in the compute dtype; 16 prompts of 32
  tokens, 128 new tokens, no stop): seconds, and a decode step's weight bytes per second against
  the copy bandwidth (each step reads every weight once; the KV cache is left out).

- two of the kernels the engines choose by precision: causal attention forward + backward at
  the training step's shape (torch's CPU flash kernel in bf16 and in fp32: a bf16 engine on a
  CPU attends in fp32), and a decode step's bf16 projection (16 rows, 512 → 2048) as ``x @ w.T``
  and on a weight packed once for oneDNN (what the lean decoder does).

Run: ``python -m benchmarks.run precision``. Each figure is the best of a few repetitions after a
warm-up; whether the CPU has native bf16 (``avx512_bf16`` / ``amx_bf16``) is in every record.
"""

from __future__ import annotations

import time

import torch

HIDDEN, LAYERS, HEADS, MLP, VOCAB = 512, 8, 8, 1024, 512
ROWS, PROMPT, NEW = 16, 32, 128
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _best(fn, repeats: int = 3) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _matmul_flops(dtype: torch.dtype, threads: int, n: int = 2048) -> float:
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / _best(lambda: a @ b, repeats=5)


def _copy_bytes_per_s(nbytes: int = 256 << 20, threads: int = 1) -> float:
    """Bytes read and written per second by a ``nbytes`` copy on ``threads`` torch threads (best of 5)."""
    torch.set_num_threads(threads)
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    return 2 * nbytes / _best(lambda: dst.copy_(src), repeats=5)


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=PROMPT + NEW,
        tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _matmul_params() -> int:
    """Parameters that multiply every token: the layers' projections and the LM head."""
    return LAYERS * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * MLP) + VOCAB * HIDDEN


def _train_flops(seq: int) -> float:
    """Model FLOPs of one training step: forward + backward (3×) of the matmuls and of attention's
    two products over the full ``seq × seq`` scores."""
    tokens = ROWS * seq
    return 6 * _matmul_params() * tokens + 3 * 4 * LAYERS * HIDDEN * seq * seq * ROWS


def _train_seconds(precision: str) -> float:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from rlflow.engine.optim import OptimConfig
    from rlflow.engine.train_engine import EngineConfig, TrainEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cpu", torch.zeros(1, 1, 1, dtype=torch.long), mesh_dim_names=("pp", "dp", "tp"))
        config = EngineConfig(optim=OptimConfig(lr=1e-4), device="cpu", mixed_precision=precision)
        engine = TrainEngine(_model(), mesh, config)
        g = torch.Generator().manual_seed(0)
        seq = PROMPT + NEW
        batch = {"input_ids": torch.randint(0, VOCAB, (ROWS, seq), generator=g),
                 "attention_mask": torch.ones(ROWS, seq, dtype=torch.long)}  # fmt: skip

        def loss(outputs, data):
            return -outputs["log_probs"].float().mean(), {}

        return _best(lambda: engine.train_step(batch, loss, num_mini_batches=1))
    finally:
        dist.destroy_process_group()


def _generate_seconds(dtype: torch.dtype) -> float:
    from rlflow.engine.rollout.base import SamplingParams
    from rlflow.engine.rollout.hf_sampler import HFRolloutEngine

    torch.set_num_threads(1)
    model = _model().to(dtype).eval()
    sampler = HFRolloutEngine(model, pad_token_id=0)
    ids = torch.randint(1, VOCAB, (ROWS, PROMPT), generator=torch.Generator().manual_seed(0))
    prompts = (ids, torch.ones_like(ids))
    params = SamplingParams(n=1, max_new_tokens=NEW, seed=0)
    return _best(lambda: sampler.generate(prompts, params), repeats=2)


def _attention_seconds(dtype: torch.dtype) -> float:
    """Causal SDPA forward + backward at the training step's shape, one thread."""
    torch.set_num_threads(1)
    shape = (ROWS, HEADS, PROMPT + NEW, HIDDEN // HEADS)
    q, k, v = (torch.randn(shape, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, dtype=dtype)

    def step():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    return _best(step)


def _projection_seconds(packed: bool) -> float:
    """A decode step's bf16 projection (ROWS rows, HIDDEN -> 2 MLP), plain or on a packed weight."""
    from rlflow.engine.rollout.fast_decode import _Packed, _project, packs_weights

    torch.set_num_threads(1)
    weight, x = torch.randn(2 * MLP, HIDDEN).bfloat16(), torch.randn(ROWS, HIDDEN).bfloat16()
    if packed and not packs_weights(weight):
        return float("nan")
    w = _Packed(weight) if packed else weight.t()
    return _best(lambda: [_project(x, w, None) for _ in range(100)]) / 100


def run() -> list[dict]:
    """Records: the machine's limits, then per precision a training step and a generation."""
    from rlflow.engine.parallelize import cpu_computes_bf16

    native = cpu_computes_bf16()
    threads = torch.get_num_threads()
    peaks = {(p, t): _matmul_flops(d, t) for p, d in DTYPES.items() for t in (1, 2)}
    copy = _copy_bytes_per_s()
    torch.set_num_threads(threads)
    records = [
        {"name": f"matmul_2048_{p}_{t}t", "gflop_per_s": round(f / 1e9, 1), "threads": t, "native_bf16": native}
        for (p, t), f in peaks.items()
    ]
    records.append({"name": "copy_1t", "gb_per_s": round(copy / 1e9, 1), "threads": 1})
    seq = PROMPT + NEW
    weight_count = _matmul_params()
    for precision, dtype in DTYPES.items():
        train_s = _train_seconds(precision)
        flops = _train_flops(seq)
        records.append({
            "name": f"train_step_21m_{precision}", "seconds": round(train_s, 3), "tokens": ROWS * seq,
            "gflop_per_s": round(flops / train_s / 1e9, 1),
            "share_of_matmul_peak_1t": round(flops / train_s / peaks[(precision, 1)], 3), "native_bf16": native,
        })  # fmt: skip
        gen_s = _generate_seconds(dtype)
        step_bytes = weight_count * dtype.itemsize
        records.append({
            "name": f"generate_21m_{precision}", "seconds": round(gen_s, 3), "new_tokens": ROWS * NEW,
            "tokens_per_s": round(ROWS * NEW / gen_s, 1),
            "weight_gb_per_s": round(step_bytes * NEW / gen_s / 1e9, 2),
            "share_of_copy_bandwidth": round(step_bytes * NEW / gen_s / copy, 3), "native_bf16": native,
        })  # fmt: skip
    for precision, dtype in DTYPES.items():
        records.append({"name": f"attention_fwd_bwd_{precision}", "seconds": round(_attention_seconds(dtype), 5)})
    plain, packed = _projection_seconds(False), _projection_seconds(True)
    records.append({
        "name": "decode_projection_bf16", "plain_us": round(plain * 1e6, 1), "packed_us": round(packed * 1e6, 1),
        "ratio": round(plain / packed, 3), "native_bf16": native,
    })  # fmt: skip
    by_name = {r["name"]: r for r in records}
    for call in ("train_step_21m", "generate_21m"):
        records.append({
            "name": f"{call}_bf16_speedup", "native_bf16": native,
            "ratio": round(by_name[f"{call}_fp32"]["seconds"] / by_name[f"{call}_bf16"]["seconds"], 3),
        })  # fmt: skip
    return records
