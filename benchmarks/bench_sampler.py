"""The built-in HF sampler against ``model.generate`` with the same sampling settings, in one process.

Issue 12 asks for generation faster than HF's own loop. Both sides run on the same model
and prompts, alternating, with one torch thread:

* **rlflow**: :meth:`rlflow.engine.rollout.HFRolloutEngine.generate` — responses, masks and
  the log-prob of every sampled token.
* **HF generate**: ``model.generate`` on each prompt repeated ``n`` times, logits returned,
  then the same log-probs taken from them (what an RL step needs from a rollout).

Shapes are the GRPO runs': 2 prompts × 8 samples = 16 rows, prompts of 5–8 tokens
left-padded to 8, 32 new tokens, no stop token (every row generates all of them); on the
tiny Llama of the profiled step (hidden 64, 2 layers) and on the model of
``recipes/grpo_arithmetic.yaml`` (hidden 128, 4 layers). Each case is timed sampled
(temperature 1, no top-k/top-p) and greedy. Figures are the best of ``REPEATS`` wall times
and ``speedup = seconds_generate / seconds_rlflow``; for greedy decoding the record also
says whether both produced the same tokens.

    python -m benchmarks.run sampler
"""

from __future__ import annotations

import time

import torch

NUM_PROMPTS = 2
SAMPLES = 8
PROMPT_LEN = 8
NEW_TOKENS = 32
VOCAB = 128
REPEATS = 5
MODELS = {  # name -> build_tiny_model arguments
    "tiny_llama_h64_l2": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2},
    "grpo_arithmetic_h128_l4": {
        "hidden_size": 128,
        "num_layers": 4,
        "num_heads": 4,
        "num_kv_heads": 4,
        "intermediate_size": 512,
        "tie_word_embeddings": True,
    },
}


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """``(NUM_PROMPTS, PROMPT_LEN)`` left-padded random prompts of 5 to ``PROMPT_LEN`` tokens."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.zeros((NUM_PROMPTS, PROMPT_LEN), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row in range(NUM_PROMPTS):
        length = int(torch.randint(5, PROMPT_LEN + 1, (1,), generator=gen))
        ids[row, PROMPT_LEN - length :] = torch.randint(3, VOCAB, (length,), generator=gen)
        mask[row, PROMPT_LEN - length :] = 1
    return ids, mask


def _hf_generate(model, ids, mask, greedy: bool, new_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(responses, old_logp)`` from ``model.generate``: no stop token, logits returned."""
    out = model.generate(  # each prompt repeated, as num_return_sequences would (it refuses greedy)
        input_ids=ids.repeat_interleave(SAMPLES, dim=0),
        attention_mask=mask.repeat_interleave(SAMPLES, dim=0),
        do_sample=not greedy,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    responses = out.sequences[:, ids.shape[1] :]
    logp = torch.log_softmax(torch.stack(out.logits, dim=1).float(), dim=-1)
    return responses, logp.gather(-1, responses.unsqueeze(-1)).squeeze(-1)


def _best_times(calls: dict, repeats: int) -> dict[str, float]:
    """Best wall time of each call, the calls alternating so that load drifts hit both alike."""
    times = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: min(values) for name, values in times.items()}


def _measure(model_name: str, greedy: bool, repeats: int, new_tokens: int) -> dict:
    from rlflow.data.tiny_models import build_tiny_model
    from rlflow.engine.rollout import HFRolloutEngine, SamplingParams

    model = build_tiny_model(vocab_size=VOCAB, **MODELS[model_name]).eval()
    engine = HFRolloutEngine(model)
    ids, mask = _prompts()
    params = SamplingParams(n=SAMPLES, max_new_tokens=new_tokens, greedy=greedy, seed=0)
    calls = {
        "rlflow": lambda: engine.generate((ids, mask), params),
        "generate": lambda: _hf_generate(model, ids, mask, greedy, new_tokens),
    }
    for call in calls.values():  # warm-up
        call()
    best = _best_times(calls, repeats)
    ours, (theirs, _) = calls["rlflow"](), calls["generate"]()
    if ours["responses"].shape != theirs.shape:
        raise RuntimeError(f"rlflow gave {tuple(ours['responses'].shape)} responses, generate {tuple(theirs.shape)}")
    tokens = ours["responses"].numel()
    record = {
        "name": f"sampler_{model_name}_{'greedy' if greedy else 'sampled'}",
        "model": model_name,
        "decoding": "greedy" if greedy else "sampled, temperature 1",
        "rows": tokens // new_tokens,
        "new_tokens_per_row": new_tokens,
        "seconds_rlflow": round(best["rlflow"], 4),
        "seconds_generate": round(best["generate"], 4),
        "tokens_per_s_rlflow": round(tokens / best["rlflow"], 1),
        "tokens_per_s_generate": round(tokens / best["generate"], 1),
        "speedup": round(best["generate"] / best["rlflow"], 2),
        "units": {"seconds": f"s (best of {repeats}, wall, 1 torch thread)", "speedup": "generate s / rlflow s"},
    }
    if greedy:
        record["same_tokens_as_generate"] = bool(torch.equal(ours["responses"], theirs))
    return record


def run(repeats: int = REPEATS, new_tokens: int = NEW_TOKENS) -> list[dict]:
    """One record per (model, greedy or sampled); ``repeats``/``new_tokens`` shrink it for a check."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [_measure(model_name, greedy, repeats, new_tokens) for model_name in MODELS for greedy in (False, True)]
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    import json

    for record in run():
        print(json.dumps(record))
