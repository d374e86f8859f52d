"""The C++ decode step (rlflow.engine.rollout.native_decode, kernels/decode.cpp) against its torch
twin FastDecoder and HF's forward, for every shipped family; where it applies and where not."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from rollout_helpers import PAD, left_padded_prompts
from test_fast_decode import CASES, LOGIT_ATOL, VOCAB, build_model, hf_last_logits

import rlflow.engine.rollout.hf_sampler as hf_sampler
from rlflow.data.tiny_models import build_tiny_model
from rlflow.engine.rollout import HFRolloutEngine, SamplingParams
from rlflow.engine.rollout.fast_decode import FastDecoder
from rlflow.engine.rollout.native_decode import (
    NATIVE_MAX_ROWS,
    NATIVE_MAX_STEP_MACS,
    NATIVE_MAX_WEIGHT_BYTES,
    NativeDecoder,
    native_decode_blocker,
    native_sampling_blocker,
    sample_step,
    step_macs,
)

torch.set_num_threads(1)

LENGTHS = [5, 9, 3, 7]
# The C++ step sums in another order than MKL (its norms' and attention's sums in vector
# accumulators, its softmax's exp a polynomial): float32 rounding of ~5-sized logits through 4 layers
# (measured up to 2.1e-5 over these tests with AVX-512, AVX2 and scalar kernels; HF's cached decode
# differs from its own forward by up to 1.3e-5).
TWIN_ATOL = 3e-5


def _decode_both(model, steps: int, keep_at: int | None = None):
    """Prefill and ``steps`` decode steps of the twin and the native decoder on the same tokens;
    yields both logits (and the HF forward's) after every step. ``keep_at``: prune rows then."""
    ids, mask = left_padded_prompts(LENGTHS, seed=1, width=10)
    ids, n = ids % VOCAB, 2
    twin, native = FastDecoder(model, steps), NativeDecoder(model, steps)
    with torch.inference_mode():
        a, b = twin.prefill(ids, mask, n), native.prefill(ids, mask, n)
    ids, mask = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
    tokens = torch.arange(ids.shape[0]) % VOCAB  # distinct samples per prompt
    for step in range(steps):
        if step == keep_at:
            keep = torch.tensor([0, 2, 3, 6, 7])
            with torch.inference_mode():
                twin.select(keep)
                native.select(keep)
            ids, mask, tokens = ids[keep], mask[keep], tokens[keep]
        ids = torch.cat([ids, tokens[:, None]], 1)
        mask = torch.cat([mask, torch.ones_like(tokens)[:, None]], 1)
        with torch.inference_mode():
            a, b = twin.step(tokens, step), native.step(tokens, step)
        yield a, b, hf_last_logits(model, ids, mask)
        tokens = a.argmax(-1)


@pytest.mark.parametrize("case", list(CASES))
def test_every_step_equals_the_torch_twin_and_hf_forward(case):
    model = build_model(case)
    assert native_decode_blocker(model, 8) is None
    for twin, native, hf in _decode_both(model, steps=12):
        torch.testing.assert_close(native, twin, atol=TWIN_ATOL, rtol=0)
        torch.testing.assert_close(native, hf, atol=LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize("case", ["llama", "qwen3", "mistral_window_4"])
def test_pruned_rows_keep_their_cache(case):
    model = build_model(case, seed=5)
    for twin, native, hf in _decode_both(model, steps=10, keep_at=4):
        torch.testing.assert_close(native, twin, atol=TWIN_ATOL, rtol=0)
        torch.testing.assert_close(native, hf, atol=LOGIT_ATOL, rtol=0)


@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3", "mistral_window_4", "llama_biases_tied_mha"])
def test_the_sampler_draws_the_same_tokens_as_with_the_twin(case, caplog):
    model = build_model(case, seed=6)
    ids, mask = left_padded_prompts([4, 6, 5, 3, 8, 6, 2, 7], seed=4)
    ids = ids % VOCAB
    stops = (3, 11, 17)
    samplings = (
        {"greedy": True},
        {"temperature": 1.0, "seed": 3},
        {"temperature": 0.7, "seed": 5},
        {"top_k": 9, "seed": 1},
    )
    for sampling in samplings:  # the last keeps torch's filters and loop (native_sampling_blocker)
        params = SamplingParams(n=3, max_new_tokens=14, stop_token_ids=stops, **sampling)
        native = HFRolloutEngine(model).generate((ids, mask), params)
        with caplog.at_level(logging.DEBUG, logger="rlflow.engine.rollout.hf_sampler"):
            twin = HFRolloutEngine(model, native_decode=False).generate((ids, mask), params)
        assert "torch lean decoder: native_decode=False" in caplog.text
        for key in ("responses", "response_mask"):
            assert torch.equal(native[key], twin[key]), (sampling, key)
        torch.testing.assert_close(native["old_logp"], twin["old_logp"], atol=TWIN_ATOL, rtol=0)


# Wide enough that every part of the step runs on both threads (matmuls, attention, SiLU); a
# vocabulary, MLP and head size whose matrices end in a part-filled panel; head_dim 24 (not a
# multiple of 16) and 20 (not of 8: the attention's scalar weighted sum).
@pytest.mark.parametrize("kernels", [0, 1, 2])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("hidden, heads, kv_heads", [(96, 4, 2), (120, 6, 6)])
def test_every_kernel_and_thread_count_equals_the_twin(kernels, threads, hidden, heads, kv_heads):
    model = build_tiny_model(
        vocab_size=VOCAB + 3, hidden_size=hidden, num_layers=2, num_heads=heads, num_kv_heads=kv_heads,
        intermediate_size=200, tie_word_embeddings=False, seed=7,
    ).eval()  # fmt: skip
    ids, mask = left_padded_prompts([6, 9, 4, 8], seed=2, width=10)
    ids, n, steps = ids % VOCAB, 8, 6
    native = NativeDecoder(model, steps, threads=threads, kernels=kernels)
    assert native.threads == threads and native.kernels <= kernels
    _steps_equal_the_twins(native, FastDecoder(model, steps), ids, mask, n, steps)


@pytest.mark.parametrize("kernels", [1, 2])
def test_a_row_count_the_tiles_do_not_divide_equals_the_twin(kernels):
    """9 rows: the AVX2 kernel's 6-row tiles leave three rows to a 3-row tile and its 8 x 8 transpose
    one row; the MLP's 340-wide input leaves a last block of 20 panel rows after five of 64, and the
    transpose four columns (340 is no multiple of 8)."""
    model = build_tiny_model(
        vocab_size=VOCAB + 3, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=4,
        intermediate_size=340, tie_word_embeddings=True, seed=3,
    ).eval()  # fmt: skip
    ids, mask = left_padded_prompts([5, 7, 3], seed=4, width=8)
    ids, n, steps = ids % VOCAB, 3, 5
    native = NativeDecoder(model, steps, threads=2, kernels=kernels)
    _steps_equal_the_twins(native, FastDecoder(model, steps), ids, mask, n, steps)


def _steps_equal_the_twins(native, twin, ids, mask, n: int, steps: int) -> None:
    """Prefill, then ``steps`` decode steps fed the twin's greedy tokens: the logits of each within TWIN_ATOL."""
    with torch.inference_mode():
        a, b = twin.prefill(ids, mask, n), native.prefill(ids, mask, n)
        tokens = torch.arange(ids.shape[0] * n) % VOCAB
        for step in range(steps):
            a, b = twin.step(tokens, step), native.step(tokens, step)
            torch.testing.assert_close(b, a, atol=TWIN_ATOL, rtol=0)
            tokens = a.argmax(-1)


def test_the_kernels_follow_torchs_cpu_capability(monkeypatch):
    import rlflow.engine.rollout.native_decode as native_decode

    for capability, level in (("AVX512", 2), ("AVX2", 1), ("DEFAULT", 0)):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        assert native_decode.kernel_cap() == level
        assert NativeDecoder(build_model("llama"), 2).kernels <= level


def test_sample_step_refuses_what_it_would_not_write_in_place():
    logits, outputs = torch.zeros(2, 5), (torch.zeros(2, 3, dtype=torch.long),) * 2 + (torch.zeros(2, 3),)
    params, rows, stops = SamplingParams(greedy=True), torch.arange(2), np.zeros(0, dtype=np.int64)
    with pytest.raises(ValueError, match="alive must be a writable \\(N,\\) bool array"):
        sample_step(logits, params, None, stops, torch.ones(2, dtype=torch.long), rows, 0, PAD, *outputs)
    with pytest.raises(ValueError, match="responses must be a writable \\(B, R\\) array, step < R"):
        sample_step(logits, params, None, stops, torch.ones(2, dtype=torch.bool), rows, 3, PAD, *outputs)
    assert native_sampling_blocker(logits, SamplingParams(top_p=0.9), None) == "top-k / top-p filtering"
    assert native_sampling_blocker(logits.double(), params, None) == "logits are torch.float64 on cpu"


def test_the_sampler_uses_it_for_small_float32_cpu_models(monkeypatch):
    model = build_model("llama")
    built = []
    monkeypatch.setattr(hf_sampler, "NativeDecoder", lambda *a: built.append(1) or NativeDecoder(*a))
    ids, mask = left_padded_prompts([3, 4], seed=0)
    HFRolloutEngine(model).generate((ids % VOCAB, mask), SamplingParams(max_new_tokens=3, seed=0))
    assert built == [1]


def test_new_weights_are_used_after_update():
    model = build_model("llama", seed=1)
    other = build_model("llama", seed=2)
    ids, mask = left_padded_prompts([4, 5], seed=0)
    params = SamplingParams(greedy=True, max_new_tokens=8)
    engine = HFRolloutEngine(model)
    before = engine.generate((ids % VOCAB, mask), params)["responses"]
    engine.update_weights(other.state_dict())
    after = engine.generate((ids % VOCAB, mask), params)["responses"]
    assert torch.equal(after, HFRolloutEngine(other).generate((ids % VOCAB, mask), params)["responses"])
    assert not torch.equal(before, after)


# --------------------------------------------------------------------------- where it does not apply


def test_blockers_name_what_they_refuse():
    model = build_model("llama")
    assert "bfloat16" in native_decode_blocker(build_model("llama").to(torch.bfloat16), 8)
    model.config.hidden_act = "gelu"
    assert native_decode_blocker(model, 8) == "hidden_act='gelu' (the native step implements SiLU)"
    wide = build_tiny_model(vocab_size=16, hidden_size=512, num_layers=1, num_heads=8)  # 2.2 M per row
    rows = NATIVE_MAX_ROWS + 1
    macs = step_macs(wide, rows)
    assert macs > NATIVE_MAX_STEP_MACS and native_decode_blocker(wide, NATIVE_MAX_ROWS) is None  # weight-bound
    small = build_model("llama")
    assert step_macs(small, 256) <= NATIVE_MAX_STEP_MACS and native_decode_blocker(small, 256) is None  # op-bound
    assert f"{rows} rows > {NATIVE_MAX_ROWS} and {macs} multiply-adds per layer and step" in native_decode_blocker(
        wide, rows
    )
    huge = build_tiny_model(vocab_size=16, hidden_size=16, num_layers=1, num_heads=2)
    # an embedding just over the limit (never written: its pages are never touched)
    huge.model.embed_tokens.weight = torch.nn.Parameter(torch.empty(NATIVE_MAX_WEIGHT_BYTES // 64 + 1, 16))
    assert f"bytes of matrices > {NATIVE_MAX_WEIGHT_BYTES}" in native_decode_blocker(huge, 1)


def test_a_pipeline_stage_keeps_the_twin():
    model = build_model("llama")
    model.items = ["embed", "layer.0", "layer.1"]  # what a DecoderStage exposes (rlflow.engine.pipeline)
    assert native_decode_blocker(model, 8) == "a pipeline stage (the native step runs whole models)"


def test_bad_buffers_and_tokens_are_refused():
    model = build_model("llama")
    ids, mask = left_padded_prompts([3, 4], seed=0)
    decoder = NativeDecoder(model, max_new_tokens=4)
    with torch.inference_mode():
        decoder.prefill(ids % VOCAB, mask, 1)
        with pytest.raises(IndexError, match="token id 99 outside the vocabulary"):
            decoder.step(torch.tensor([1, 99]), 0)
        with pytest.raises(ValueError, match="tokens must be \\(2,\\)"):
            decoder.step(torch.tensor([1, 2, 3]), 0)
        with pytest.raises(ValueError, match="step 4 / slot"):
            decoder.step(torch.tensor([1, 2]), 4)
    k = [np.zeros((2, 2, 5, 16), dtype=np.float64)] * 4  # not float32: a converted copy would be written
    with pytest.raises(ValueError, match="k\\[0\\] must be a float32 C-contiguous array"):
        decoder._native.set_state(k, k, *(np.zeros((2, 4, 16), np.float32),) * 2, np.zeros((2, 5), np.float32))


def test_docstring_example_runs():
    import doctest

    import rlflow.engine.rollout.native_decode as module

    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
