"""The training step's float32 matmuls on this CPU: torch's BLAS (MKL on x86) against OpenBLAS run on
torch's threads (``models.<role>.cpu_gemm``, :mod:`rlflow.engine.cpu_gemm`).

The compute-bound model of issue 25 (a Llama of width 512, 8 layers, MLP 1024) over a training
step's 16 rows of 136 tokens (2,176 rows of activations):

- each of its linear layers' three products (forward ``x @ W^T``, input gradient ``dy @ W``, weight
  gradient ``dy^T @ x``) for the projections 512 → 512, 512 → 1024 and 1024 → 512, on 1 and 2
  threads: GFLOP/s through ``torch.mm`` and through :func:`rlflow.engine.cpu_gemm.mm`;
- a whole forward and backward of the model (``TrainEngine``'s stage, fused CPU ops on) with
  ``cpu_gemm`` ``torch`` and ``openblas`` on 2 threads: seconds.

Both sides run alternately in one process, the median of several rounds each, so that a host
whose speed drifts (a shared cloud CPU) moves both alike. ``auto``'s choice on this CPU is in the
records. Run: ``python -m benchmarks.run cpu_gemm``.
"""

from __future__ import annotations

import statistics
import time

import torch

HIDDEN, LAYERS, HEADS, MLP, VOCAB = 512, 8, 8, 1024, 64
ROWS, SEQ = 16, 136
ROUNDS, STEP_ROUNDS = 7, 6


def _alternating(fns: dict, rounds: int) -> dict:
    """Median seconds of each of ``fns``, called in turn ``rounds`` times after one warm-up each."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for r in range(rounds):
        for name in sorted(fns, reverse=bool(r % 2)):
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _products() -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, a, b) of every linear layer's three products (b of the forward a transposed view)."""
    g, tokens = torch.Generator().manual_seed(0), ROWS * SEQ
    products = []
    for fan_in, fan_out in ((HIDDEN, HIDDEN), (HIDDEN, MLP), (MLP, HIDDEN)):
        x, w = torch.randn(tokens, fan_in, generator=g), torch.randn(fan_out, fan_in, generator=g)
        dy = torch.randn(tokens, fan_out, generator=g)
        products += [
            (f"forward_{fan_in}_{fan_out}", x, w.t()),
            (f"input_grad_{fan_in}_{fan_out}", dy, w),
            (f"weight_grad_{fan_in}_{fan_out}", dy.t(), x),
        ]
    return products


def _step_seconds() -> dict:
    """Median seconds of the model's forward + backward with each ``cpu_gemm``, alternating."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from rlflow.data.tiny_models import build_tiny_model
    from rlflow.engine.train_engine import EngineConfig, TrainEngine

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = DeviceMesh("cpu", torch.zeros(1, 1, 1, dtype=torch.long), mesh_dim_names=("pp", "dp", "tp"))
        ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(SEQ).expand(ROWS, SEQ)
        steps = {}
        for choice in ("openblas", "torch"):
            model = build_tiny_model(
                vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=HEADS,
                intermediate_size=MLP, seed=1,
            )  # fmt: skip
            engine = TrainEngine(model, mesh, EngineConfig(cpu_gemm=choice, device="cpu", optim=None))

            def step(stage=engine.stage):
                for p in stage.parameters():
                    p.grad = None
                stage(ids, torch.ones_like(ids), position_ids=positions).float().pow(2).mean().backward()

            steps[choice] = step
        return _alternating(steps, STEP_ROUNDS)
    finally:
        if owned:
            dist.destroy_process_group()


def run() -> list[dict]:
    from rlflow.engine.cpu_gemm import mm, openblas_blocker, resolve_cpu_gemm

    blocker = openblas_blocker()
    if blocker is not None:
        return [{"name": "cpu_gemm", "skipped": blocker}]
    records = [{"name": "cpu_gemm_auto", "resolves_to": resolve_cpu_gemm("auto")}]
    saved = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for name, a, b in _products():
                flop = 2 * a.shape[0] * a.shape[1] * b.shape[1]
                sides = {"torch": lambda a=a, b=b: torch.mm(a, b), "openblas": lambda a=a, b=b: mm(a, b)}
                seconds = _alternating(sides, ROUNDS)
                records.append({
                    "name": f"{name}_{threads}t", "m_k_n": [a.shape[0], a.shape[1], b.shape[1]], "threads": threads,
                    "torch_gflop_per_s": round(flop / seconds["torch"] / 1e9, 1),
                    "openblas_gflop_per_s": round(flop / seconds["openblas"] / 1e9, 1),
                    "speedup": round(seconds["torch"] / seconds["openblas"], 3),
                })  # fmt: skip
        torch.set_num_threads(2)
        step = _step_seconds()
        records.append({
            "name": "forward_backward_2t", "torch_s": round(step["torch"], 4), "openblas_s": round(step["openblas"], 4),
            "speedup": round(step["torch"] / step["openblas"], 3),
        })  # fmt: skip
    finally:
        torch.set_num_threads(saved)
    return records
