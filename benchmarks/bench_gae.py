"""Packed GAE: the C++ kernel (rlflow._C_gae) against its pure-torch twin on CPU.

Each record times one call of ``gae_packed`` on a random packed batch (best of several
runs, one torch thread) and reports tokens per second.
"""

from __future__ import annotations

import functools
import time

import torch

from rlflow.algos.packed_gae import gae_packed, gae_packed_torch, has_cpp_gae

CASES = [(256, 512), (1024, 1024)]  # (sequences, mean response length)


def _packed_batch(num_seqs: int, mean_len: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 2 * mean_len, (num_seqs,), generator=gen)
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    num_tokens = int(cu_seqlens[-1])
    return torch.randn(num_tokens, generator=gen), torch.randn(num_tokens, generator=gen), cu_seqlens


def _best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run() -> list[dict]:
    torch.set_num_threads(1)
    records = []
    for num_seqs, mean_len in CASES:
        rewards, values, cu = _packed_batch(num_seqs, mean_len)
        num_tokens = rewards.numel()
        impls = {"torch_twin": functools.partial(gae_packed_torch, rewards, values, cu, 0.99, 0.95)}
        if has_cpp_gae():
            impls["cpp"] = functools.partial(gae_packed, rewards, values, cu, 0.99, 0.95, use_cpp=True)
        seconds = {name: _best_time(fn, repeats=3 if name == "torch_twin" else 10) for name, fn in impls.items()}
        for name, secs in seconds.items():
            record = {
                "name": f"gae_packed/{name}/{num_seqs}x{mean_len}",
                "num_sequences": num_seqs,
                "num_tokens": num_tokens,
                "seconds": round(secs, 6),
                "tokens_per_second": round(num_tokens / secs),
            }
            if name == "cpp":
                record["speedup_vs_torch_twin"] = round(seconds["torch_twin"] / secs, 1)
            records.append(record)
    return records


if __name__ == "__main__":
    for r in run():
        print(r)
