"""Multi-turn rollouts with a slow tool: what the tool's latency adds to the decode time, three ways.

Issue 26 asks that tools run off the decode loop: with a tool that sleeps 100 ms, 32 episodes × 3
tool calls should finish within the decode time plus about 0.5 s, where running the tools one after
another would add 9.6 s. Each episode here (:class:`SleepyEpisode`) samples a turn, calls the tool
(a sleep) and reads its observation three times, then samples a last turn and ends: four turns of
``new_tokens`` sampled tokens each (no stop token) with three observations of
``OBSERVATION_TOKENS`` between them. The same episodes run through
:meth:`rlflow.engine.rollout.HFRolloutEngine.generate_episodes` on a tiny model, one torch thread:

* **decode_only**: the tool answers at once (no sleep): the decode time the others are held to;
* **overlap**: ``MultiTurn(overlap=True)``: an episode whose tool answered samples its next turn
  while slower tools still run;
* **turns**: strict turn barriers (``overlap=False``): a turn's tools run concurrently, the next
  turn waits for the slowest;
* **sequential**: the tools one after another (one thread): the baseline without concurrency.

Two latencies (:data:`CASES`): 100 ms for every call (the issue's), and a seeded uniform draw in
20–180 ms per call (the same mean), where barriers wait for each turn's slowest call. Figures are
the best of ``repeats`` wall times (sequential: one run, it is mostly sleeping);
``added_seconds_*`` = that mode's seconds − decode_only's.

    python -m benchmarks.run multi_turn
"""

from __future__ import annotations

import os
import random
import time

import numpy as np
import torch

VOCAB = 100  # len(build_char_tokenizer())
PROMPT_TOKENS = 8
OBSERVATION_TOKENS = 8
REPEATS = 3
MODEL = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 4, "intermediate_size": 256}
CASES = {  # name -> (fixed latency in s, or (low, high) of a uniform draw per call)
    "fixed_100ms": 0.1,
    "uniform_20_180ms": (0.02, 0.18),
}
MODES = ("decode_only", "overlap", "turns", "sequential")


class SleepyEpisode:
    """``tool_calls`` turns each answered by a tool that sleeps its latency, then a last turn.

    Args:
        latencies: seconds of each tool call, in order (``len`` = the episode's tool calls).
    """

    def __init__(self, latencies: list[float]) -> None:
        self.latencies, self.calls, self.slept = latencies, 0, 0.0

    def reset(self, row) -> list[int]:
        return list(row["prompt_ids"])

    def step(self, ids) -> tuple[list[int], float, bool]:
        if self.calls == len(self.latencies):  # the last turn: the answer, no call
            return [], 0.0, True
        time.sleep(self.latencies[self.calls])
        self.slept += self.latencies[self.calls]
        self.calls += 1
        return [4 + (self.calls + i) % 10 for i in range(OBSERVATION_TOKENS)], 0.0, False

    def metrics(self) -> dict[str, float]:
        return {"tools/calls": float(self.calls), "tools/seconds": self.slept}


def _latencies(latency: float | tuple[float, float], episodes: int, calls: int) -> list[list[float]]:
    """Each episode's call latencies: the fixed one, or a seeded uniform draw per call."""
    if isinstance(latency, (int, float)):
        return [[float(latency)] * calls for _ in range(episodes)]
    rng = random.Random(0)
    return [[rng.uniform(*latency) for _ in range(calls)] for _ in range(episodes)]


def _describe(latency: float | tuple[float, float]) -> str:
    if isinstance(latency, (int, float)):
        return f"{latency * 1e3:g} ms"
    return f"uniform {latency[0] * 1e3:g}-{latency[1] * 1e3:g} ms"


def _prompts(episodes: int):
    from rlflow.protocol import DataProto

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (episodes, PROMPT_TOKENS), generator=gen)
    columns = np.empty(episodes, dtype=object)
    columns[:] = [{} for _ in range(episodes)]
    return DataProto.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, {"columns": columns})


def _rollout(engine, prompts, latencies: list[list[float]], mode: str, new_tokens: int) -> tuple[float, dict]:
    """Wall seconds of one multi-turn rollout in ``mode``, and its episode metrics."""
    from rlflow.engine.rollout import SamplingParams
    from rlflow.engine.rollout.multi_turn import MultiTurn

    episodes, calls = len(latencies), len(latencies[0])
    made = iter([[0.0] * calls for _ in latencies] if mode == "decode_only" else latencies)
    multi = MultiTurn(
        episodes=lambda: SleepyEpisode(next(made)),
        max_turns=calls + 1,
        max_total_tokens=(calls + 1) * new_tokens + calls * OBSERVATION_TOKENS,
        max_prompt_tokens=PROMPT_TOKENS,
        num_threads=1 if mode == "sequential" else episodes,
        overlap=mode == "overlap",
    )
    params = SamplingParams(max_new_tokens=new_tokens, seed=0)
    start = time.perf_counter()
    out = engine.generate_episodes(prompts, params, multi)
    return time.perf_counter() - start, dict(out.meta_info)


def _measure(case: str, latency, episodes: int, calls: int, new_tokens: int, repeats: int) -> dict:
    from rlflow.data.tiny_models import build_tiny_model
    from rlflow.engine.rollout import HFRolloutEngine

    engine = HFRolloutEngine(build_tiny_model(vocab_size=VOCAB, tie_word_embeddings=True, **MODEL).eval())
    prompts, latencies = _prompts(episodes), _latencies(latency, episodes, calls)
    _rollout(engine, prompts, latencies, "decode_only", new_tokens)  # warm-up
    best, metrics = {}, {}
    for _ in range(repeats):  # the modes alternate, so that load drifts hit all alike
        for mode in MODES:
            if mode == "sequential" and mode in best:
                continue
            seconds, metrics[mode] = _rollout(engine, prompts, latencies, mode, new_tokens)
            best[mode] = min(seconds, best.get(mode, float("inf")))
    return {
        "name": f"multi_turn_{case}",
        "case": case,
        "episodes": episodes,
        "tool_calls_per_episode": calls,
        "tool_latency": _describe(latency),
        "tool_seconds_total": round(sum(map(sum, latencies)), 3),
        "new_tokens_per_turn": new_tokens,
        "observation_tokens": OBSERVATION_TOKENS,
        "turns_per_episode": {mode: metrics[mode]["multi_turn/turns"] for mode in MODES},
        "tool_calls_per_episode_done": {mode: metrics[mode]["tools/calls"] for mode in MODES},
        **{f"seconds_{mode}": round(best[mode], 3) for mode in MODES},
        **{f"added_seconds_{mode}": round(best[mode] - best["decode_only"], 3) for mode in MODES[1:]},
        "load_average_1min": round(os.getloadavg()[0], 2),
        "units": {
            "seconds": f"s per rollout of all episodes (best of {repeats}, wall, 1 torch thread; sequential: 1 run)",
            "added_seconds": "mode s - decode_only s",
        },
    }


def run(
    repeats: int = REPEATS,
    episodes: int = 32,
    calls: int = 3,
    new_tokens: int = 16,
    cases: dict | None = None,
) -> list[dict]:
    """One record per latency case; the arguments shrink it for a check."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [
            _measure(name, latency, episodes, calls, new_tokens, repeats) for name, latency in (cases or CASES).items()
        ]
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    import json

    for record in run():
        print(json.dumps(record))
