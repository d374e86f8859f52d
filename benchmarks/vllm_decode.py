"""vLLM-CPU's side of ``benchmarks/decode_sides.py``: one engine, timed, in a process of its own.

Run with the python of the vLLM venv (``make test-vllm`` makes ``.venv-vllm``), never imported by
rlflow's venv: ``python benchmarks/vllm_decode.py SPEC.json``. The spec names the model directory
(``save_pretrained``), the dtype, the torch threads, the prompts (token ids, unpadded), the samples
per prompt, the new tokens and the repeats. Every request generates exactly ``new_tokens`` tokens
(``min_tokens`` = ``max_tokens``, ``ignore_eos``) at temperature 1 without top-k/top-p, with the
sampled token's log-prob returned, as an RL rollout needs. Prints one line, ``VLLM_DECODE`` and a
JSON object: the best seconds of a full call (wall and CPU) and of a one-token call (prefill and a
first sample).
Where vLLM fails (an unsupported model, no bf16...) it exits non-zero with vLLM's error on stderr.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the caller before
vLLM is imported) on ``threads`` torch threads: vLLM's CPU worker refuses ``torch.set_num_threads``
once it is up, so the count is set first and read back after. KV cache: ``VLLM_CPU_KVCACHE_SPACE``.
Eager execution (no compile, as rlflow's vLLM engine runs on CPU); otherwise vLLM's own defaults,
its oneDNN weight packing included (which rlflow's engine turns off to push weights).
"""

from __future__ import annotations

import json
import sys
import time


def _best(call, repeats: int) -> tuple[float, float]:
    """Best wall and best CPU seconds (of this process) of ``call`` over ``repeats``, after a warm-up."""
    call()
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        call()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return min(wall), min(cpu)


def measure(spec: dict) -> dict:
    """The figures of one engine (module docstring); raises where vLLM does."""
    import torch

    torch.set_num_threads(spec["threads"])
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    llm = LLM(
        model=spec["model_dir"],
        dtype=spec["dtype"],
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=max(len(ids) for ids in spec["prompts"]) + spec["new_tokens"],
        seed=0,
    )

    def params(tokens: int) -> SamplingParams:
        return SamplingParams(
            n=spec["samples"], temperature=1.0, top_k=0, top_p=1.0, max_tokens=tokens, min_tokens=tokens,
            ignore_eos=True, logprobs=0, detokenize=False,
        )  # fmt: skip

    full, first = params(spec["new_tokens"]), params(1)
    outputs = llm.generate(prompts, full, use_tqdm=False)
    generated = [len(c.token_ids) for out in outputs for c in out.outputs]
    if generated != [spec["new_tokens"]] * (len(prompts) * spec["samples"]):
        raise RuntimeError(f"vLLM generated {generated} tokens per row, expected {spec['new_tokens']} each")
    seconds, cpu_seconds = _best(lambda: llm.generate(prompts, full, use_tqdm=False), spec["repeats"])
    return {
        "seconds": seconds,
        "prefill_seconds": _best(lambda: llm.generate(prompts, first, use_tqdm=False), spec["repeats"])[0],
        "cpu_seconds": cpu_seconds,
        "threads": torch.get_num_threads(),
        "vllm": vllm.__version__,
        "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
    }


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        figures = measure(json.load(f))
    print("VLLM_DECODE " + json.dumps(figures), flush=True)
