"""The sampler's lean decoder (rlflow.engine.rollout.fast_decode) against HF's forward, HF's
decode path and ``model.generate``, for every shipped family; and where it falls back."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from rollout_helpers import PAD, left_padded_prompts, naive_greedy

import rlflow.engine.rollout.fast_decode as fast_decode_module
from rlflow.data.tiny_models import build_tiny_config
from rlflow.engine.packing import position_ids_from_mask
from rlflow.engine.rollout import HFRolloutEngine, SamplingParams
from rlflow.engine.rollout.fast_decode import (
    FastDecoder,
    _Packed,
    _project,
    fast_decode_blocker,
    kv_cache_bytes,
    packs_weights,
)
from rlflow.engine.rollout.hf_sampler import choose_tokens, sample_responses
from rlflow.families import get_family

torch.set_num_threads(1)

VOCAB = 48
LENGTHS = [5, 9, 3, 7]
# name -> (family, config overrides): every family, and the variations of LayerFeatures and attention
CASES = {
    "llama": ("llama", {}),
    "llama_biases_tied_mha": (
        "llama",
        {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True, "num_key_value_heads": 4},
    ),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {"sliding_window": None}),
    "mistral_window_4": ("mistral", {"sliding_window": 4}),
    "qwen2_sliding_and_full": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 3, "layer_types": ["sliding_attention", "full_attention"] * 2},
    ),
    "llama3_rope": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),  # fmt: skip
}


def build_model(case: str, seed: int = 0) -> torch.nn.Module:
    """A 4-layer tiny model of ``case`` with weights large enough for decisive argmaxes."""
    family, overrides = CASES[case]
    config = build_tiny_config(family, vocab_size=VOCAB, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = get_family(family).causal_lm_class(config).eval()
    model.tie_weights()
    with torch.no_grad():  # norms around 1, biases around 0
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2 if p.dim() == 2 else 0.1)
    return model


@torch.no_grad()
def hf_last_logits(model, ids, mask) -> torch.Tensor:
    """HF's forward over the whole sequence, no cache: ``(rows, V)`` logits of the last position."""
    out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=False)
    return out.logits[:, -1].float()


# --------------------------------------------------------------------------- logits


# Logits are ~5 in size; HF's own cached decoding differs from its full forward by up to 1.3e-5
# on these models (the lean decoder by up to 1.7e-5), so 3e-5 is float32 rounding, not a bug.
LOGIT_ATOL = 3e-5


@pytest.fixture(params=["bmm", "sdpa"])
def attention(request, monkeypatch):
    """Both decode attentions: bmm for few (row, kv head) batches on CPU, sdpa otherwise."""
    if request.param == "sdpa":
        monkeypatch.setattr(fast_decode_module, "_BMM_MAX_BATCHES", 0)
    return request.param


@pytest.mark.parametrize("case", list(CASES))
def test_logits_of_prefill_and_every_step_match_hf_forward(case, attention):
    model = build_model(case)
    assert fast_decode_blocker(model) is None
    ids, mask = left_padded_prompts(LENGTHS, seed=1, width=10)
    ids = ids % VOCAB
    n, steps = 2, 12
    decoder = FastDecoder(model, max_new_tokens=steps)
    with torch.inference_mode():
        logits = decoder.prefill(ids, mask, n)
    ids, mask = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
    torch.testing.assert_close(logits, hf_last_logits(model, ids, mask), atol=LOGIT_ATOL, rtol=0)
    tokens = torch.arange(ids.shape[0]) % VOCAB  # distinct samples per prompt: rows differ after the prefill
    for step in range(steps):
        ids = torch.cat([ids, tokens[:, None]], 1)
        mask = torch.cat([mask, torch.ones_like(tokens)[:, None]], 1)
        with torch.inference_mode():
            logits = decoder.step(tokens, step)
        torch.testing.assert_close(logits, hf_last_logits(model, ids, mask), atol=LOGIT_ATOL, rtol=0)
        tokens = logits.argmax(-1)


def test_sliding_window_changes_the_logits():
    # the windowed cases above would pass with full attention if the window never bit
    windowed, full = build_model("mistral_window_4"), build_model("mistral_window_4")
    full.config.sliding_window = None
    ids, mask = left_padded_prompts(LENGTHS, seed=1)
    params = SamplingParams(greedy=True, max_new_tokens=10)
    a = sample_responses(windowed, ids % VOCAB, mask, params, pad_token_id=PAD)[0]
    b = sample_responses(full, ids % VOCAB, mask, params, pad_token_id=PAD)[0]
    assert not torch.equal(a, b)


# --------------------------------------------------------------------------- decoding against HF


@pytest.mark.parametrize("case", ["llama", "qwen2", "qwen3", "mistral_window_4", "llama_biases_tied_mha"])
def test_greedy_equals_hf_path_naive_decode_and_generate(case):
    model = build_model(case, seed=2)
    ids, mask = left_padded_prompts(LENGTHS, seed=2)
    ids = ids % VOCAB
    params = SamplingParams(greedy=True, max_new_tokens=16, n=2)
    fast = HFRolloutEngine(model).generate((ids, mask), params)
    slow = HFRolloutEngine(model, fast_decode=False).generate((ids, mask), params)
    assert torch.equal(fast["responses"], slow["responses"])
    torch.testing.assert_close(fast["old_logp"], slow["old_logp"], atol=LOGIT_ATOL, rtol=0)
    expected = naive_greedy(model, ids, mask, 16).repeat_interleave(2, 0)
    assert torch.equal(fast["responses"], expected)
    generated = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=16, eos_token_id=None, pad_token_id=PAD
    )
    assert torch.equal(fast["responses"], generated[:, ids.shape[1] :].repeat_interleave(2, 0))


@pytest.mark.parametrize("case", ["llama", "qwen3", "mistral_window_4"])
@pytest.mark.parametrize(
    "sampling", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 10, "top_p": 0.9}], ids=["plain", "filtered"]
)
def test_seeded_sampling_equals_hf_path(case, sampling, attention):
    model = build_model(case, seed=3)
    ids, mask = left_padded_prompts([4, 6, 2], seed=3)
    params = SamplingParams(n=8, max_new_tokens=20, seed=7, **sampling)
    fast = HFRolloutEngine(model).generate((ids % VOCAB, mask), params)
    slow = HFRolloutEngine(model, fast_decode=False).generate((ids % VOCAB, mask), params)
    assert torch.equal(fast["responses"], slow["responses"])  # same generator draws, same tokens
    torch.testing.assert_close(fast["old_logp"], slow["old_logp"], atol=LOGIT_ATOL, rtol=0)
    assert len(set(map(tuple, fast["responses"].tolist()))) > 1  # it did sample


@pytest.mark.parametrize("case", ["llama", "qwen2", "mistral_window_4"])
def test_stop_tokens_and_pruning_equal_hf_path(case, attention):
    model = build_model(case, seed=4)
    ids, mask = left_padded_prompts([4, 6, 5, 3, 8, 6, 2, 7], seed=4)
    ids = ids % VOCAB
    stops = tuple(naive_greedy(model, ids, mask, 10)[:, :4].flatten().unique()[:5].tolist())
    for sampling in ({"greedy": True}, {"temperature": 1.0, "seed": 3}):
        params = SamplingParams(n=3, max_new_tokens=14, stop_token_ids=stops, **sampling)
        fast = HFRolloutEngine(model).generate((ids, mask), params)
        slow = HFRolloutEngine(model, fast_decode=False).generate((ids, mask), params)
        for key in ("responses", "response_mask", "attention_mask", "position_ids"):
            assert torch.equal(fast[key], slow[key]), key
        torch.testing.assert_close(fast["old_logp"], slow["old_logp"], atol=LOGIT_ATOL, rtol=0)
        lengths = fast["response_mask"].sum(1)
        assert len(set(lengths.tolist())) > 2  # rows finished at different steps (and were pruned)
        for row, length in enumerate(lengths.tolist()):
            assert (fast["responses"][row, length:] == PAD).all() and (fast["old_logp"][row, length:] == 0).all()
            if length < 14:
                assert fast["responses"][row, length - 1].item() in stops


@pytest.mark.parametrize("case", ["llama", "qwen3", "llama_biases_tied_mha"])
def test_bfloat16_decodes_like_hf_path(case):
    # 16-bit dtypes round where HF rounds (norms, residual adds, attention in sdpa)
    model = build_model(case, seed=8).to(torch.bfloat16)
    ids, mask = left_padded_prompts(LENGTHS, seed=8)
    for sampling in ({"greedy": True}, {"seed": 1}):
        params = SamplingParams(n=2, max_new_tokens=16, **sampling)
        fast = HFRolloutEngine(model).generate((ids % VOCAB, mask), params)
        slow = HFRolloutEngine(model, fast_decode=False).generate((ids % VOCAB, mask), params)
        assert torch.equal(fast["responses"], slow["responses"])
        torch.testing.assert_close(fast["old_logp"], slow["old_logp"], atol=1e-2, rtol=0)
    # on CPUs the bf16 projections run on weights packed once for oneDNN, where torch has it and
    # oneDNN runs bf16 on this CPU (elsewhere the reorder raises: torch's own bf16 linear runs)
    layer = FastDecoder(model, max_new_tokens=2)._layers[0]
    packed = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert all(isinstance(w, _Packed) == packed for w in (layer.qkv_weight, layer.o_weight, layer.down_weight))


def test_packed_projections_equal_plain_ones():
    weight, x = torch.randn(48, 32).bfloat16(), torch.randn(5, 32).bfloat16()
    if not packs_weights(weight):
        pytest.skip("this torch has no oneDNN linear ops, or its oneDNN runs no bf16 on this CPU")
    torch.testing.assert_close(_project(x, _Packed(weight), None), x @ weight.t(), atol=0, rtol=0)
    bias, residual = torch.randn(48).bfloat16(), torch.randn(5, 48).bfloat16()
    torch.testing.assert_close(
        _project(x, _Packed(weight), bias, residual=residual), residual + torch.addmm(bias, x, weight.t())
    )
    assert not packs_weights(weight.float())


def test_float32_cpu_projections_multiply_contiguous_in_out_copies_as_the_views_would(monkeypatch):
    # MKL spreads the GEMM of a decode step's few rows over its threads on an (in, out) contiguous
    # matrix and hardly on the transposed view of the (out, in) weight: the decoder keeps such copies on CPUs
    model = build_model("llama_biases_tied_mha", seed=3)
    layer = FastDecoder(model, max_new_tokens=2)._layers[1]
    for w, name, width in ((layer.o_weight, "o_proj", 64), (layer.down_weight, "down_proj", 128)):
        source = dict(model.named_parameters())[
            f"model.layers.1.{'self_attn' if name == 'o_proj' else 'mlp'}.{name}.weight"
        ]
        assert w.is_contiguous() and w.data_ptr() != source.data_ptr() and torch.equal(w, source.t())
        assert w.shape[0] == width
    assert layer.qkv_weight.is_contiguous() and layer.gate_up_weight.is_contiguous()
    decoder = FastDecoder(model, max_new_tokens=2)
    assert decoder._head_t.is_contiguous() and torch.equal(decoder._head_t, model.lm_head.weight.t())
    ids, mask = left_padded_prompts(LENGTHS, seed=3)
    params = SamplingParams(n=2, max_new_tokens=12, seed=4)
    copies = HFRolloutEngine(model, native_decode=False).generate((ids % VOCAB, mask), params)
    copies_in_out = fast_decode_module._copies_in_out
    monkeypatch.setattr(fast_decode_module, "_copies_in_out", lambda weight: False)  # the views
    fast_decode_module._LAYER_CACHE.clear()
    views = HFRolloutEngine(model, native_decode=False).generate((ids % VOCAB, mask), params)
    assert not FastDecoder(model, max_new_tokens=2)._layers[1].o_weight.is_contiguous()
    assert torch.equal(copies["responses"], views["responses"])
    torch.testing.assert_close(copies["old_logp"], views["old_logp"], atol=1e-6, rtol=0)
    # a head beyond _HEAD_COPY_MAX_BYTES stays a view (a Qwen-sized head would be a 545 MB copy)
    monkeypatch.setattr(fast_decode_module, "_copies_in_out", copies_in_out)
    monkeypatch.setattr(fast_decode_module, "_HEAD_COPY_MAX_BYTES", model.lm_head.weight.nbytes - 1)
    assert not FastDecoder(model, max_new_tokens=2)._head_t.is_contiguous()


def test_kv_cache_bytes_is_what_the_decoder_allocates():
    model = build_model("qwen2")
    ids, mask = left_padded_prompts(LENGTHS, seed=0)
    decoder = FastDecoder(model, max_new_tokens=6)
    with torch.inference_mode():
        decoder.prefill(ids % VOCAB, mask, n=3)
    allocated = sum(t.nbytes for t in (*decoder._k, *decoder._v))
    assert allocated == kv_cache_bytes(model, num_rows=len(LENGTHS) * 3, total_len=ids.shape[1] + 6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_kv_cache_beyond_half_the_free_gpu_memory_falls_back(caplog):
    model = build_model("llama").cuda()
    free, _ = torch.cuda.mem_get_info()
    per_token = kv_cache_bytes(model, num_rows=1, total_len=1)
    max_new = int(free // 2 // per_token) + 1  # one token more than half the free memory holds
    ids, mask = left_padded_prompts([1], seed=0)
    with caplog.at_level(logging.DEBUG, logger="rlflow.engine.rollout.hf_sampler"):
        sample_responses(
            model, ids.cuda() % VOCAB, mask.cuda(), SamplingParams(greedy=True, max_new_tokens=max_new,
            stop_token_ids=tuple(range(VOCAB))), pad_token_id=PAD,
        )  # fmt: skip
    assert "exceeds half the free GPU memory" in caplog.text


def test_new_weights_are_used_after_update():
    # the fused weights are cached per model: a copy into any parameter must invalidate them
    source, target = build_model("qwen2", seed=5), build_model("qwen2", seed=6)
    engine = HFRolloutEngine(target)
    ids, mask = left_padded_prompts(LENGTHS, seed=5)
    ids = ids % VOCAB
    params = SamplingParams(greedy=True, max_new_tokens=8)
    before = engine.generate((ids, mask), params)["responses"]
    assert torch.equal(before, naive_greedy(target, ids, mask, 8))
    engine.update_weights(source.state_dict())
    assert torch.equal(engine.generate((ids, mask), params)["responses"], naive_greedy(source, ids, mask, 8))


def test_choose_tokens_draws_what_torch_multinomial_draws():
    logits = torch.randn(64, 37) * 3
    for seed in range(5):
        ours = choose_tokens(logits, SamplingParams(temperature=0.9), torch.Generator().manual_seed(seed))
        probs = (logits / 0.9).softmax(-1)
        assert torch.equal(ours, torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed))[:, 0])


def test_nan_logits_are_reported():
    model = build_model("llama")
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    ids, mask = left_padded_prompts([3], seed=0)
    with pytest.raises(ValueError, match="NaN"):
        sample_responses(model, ids % VOCAB, mask, SamplingParams(max_new_tokens=2, seed=0), pad_token_id=PAD)


# --------------------------------------------------------------------------- fallback


def _assert_falls_back(model, caplog, reason: str):
    assert reason in (fast_decode_blocker(model) or "")
    ids, mask = left_padded_prompts([3, 5], seed=0)
    params = SamplingParams(greedy=True, max_new_tokens=5)
    with caplog.at_level(logging.DEBUG, logger="rlflow.engine.rollout.hf_sampler"):
        out = HFRolloutEngine(model).generate((ids % VOCAB, mask), params)
    assert f"decodes through HF's modules: {reason}" in caplog.text
    assert torch.equal(out["responses"], naive_greedy(model, ids % VOCAB, mask, 5))


def test_dynamic_rope_falls_back(caplog):
    model = build_model("llama")
    model.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config)
    _assert_falls_back(model, caplog, "rope_type='dynamic'")


def test_partial_rotary_is_refused():
    model = build_model("llama")
    model.config.partial_rotary_factor = 0.5
    assert fast_decode_blocker(model) == "partial_rotary_factor=0.5"


def test_unknown_parameters_fall_back(caplog):
    model = build_model("llama")
    model.model.layers[1].self_attn.register_parameter("adapter", torch.nn.Parameter(torch.zeros(4)))
    _assert_falls_back(
        model, caplog, "parameters differ from family 'llama''s: unexpected ['model.layers.1.self_attn.adapter']"
    )


def test_family_without_fast_decode_falls_back(caplog, monkeypatch):
    model = build_model("qwen3")
    plain = dataclasses.replace(get_family("qwen3"), fast_decode=False)
    monkeypatch.setattr(fast_decode_module, "family_of", lambda config: plain)
    _assert_falls_back(model, caplog, "family 'qwen3' declares fast_decode=False")


def test_unknown_family_falls_back(caplog):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    assert "keeps its decoder under 'transformer'" in fast_decode_blocker(model)
    ids, mask = left_padded_prompts([3, 5], seed=0)
    out = HFRolloutEngine(model, pad_token_id=PAD).generate((ids % VOCAB, mask), SamplingParams(max_new_tokens=3))
    assert out["responses"].shape == (2, 3)


def test_tensor_parallel_weights_fall_back(single_mesh, caplog):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    model = build_model("llama")
    reference = naive_greedy(model, *_prompts(), 5)
    # apply_tp leaves a one-rank mesh alone; a head split over it makes DTensor weights all the same
    parallelize_module(model, single_mesh["tp"], {"lm_head": ColwiseParallel(output_layouts=Replicate())})
    assert fast_decode_blocker(model) == "the weights are tensor-parallel DTensors"
    with caplog.at_level(logging.DEBUG, logger="rlflow.engine.rollout.hf_sampler"):
        out = HFRolloutEngine(model).generate(_prompts(), SamplingParams(greedy=True, max_new_tokens=5))
    assert "tensor-parallel DTensors" in caplog.text
    assert torch.equal(out["responses"], reference)


def _prompts():
    ids, mask = left_padded_prompts([3, 5], seed=0)
    return ids % VOCAB, mask


def test_forced_hf_path_is_logged(caplog):
    model = build_model("llama")
    with caplog.at_level(logging.DEBUG, logger="rlflow.engine.rollout.hf_sampler"):
        HFRolloutEngine(model, fast_decode=False).generate(_prompts(), SamplingParams(max_new_tokens=2, seed=0))
    assert "fast_decode=False" in caplog.text


def test_an_engine_built_for_a_worker_ties_its_head_and_decodes_lean():
    """A worker builds its copy from the config with the init skipped: the tied LM head must be
    the embedding again, or the lean decoder refuses the model (an unexpected lm_head.weight)."""
    from rlflow.engine.rollout.base import RolloutBuild

    config = build_tiny_config(
        vocab_size=40, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, tie_word_embeddings=True
    )
    engine = HFRolloutEngine.build(
        RolloutBuild(config=config, device_mesh=None, device=torch.device("cpu"), dtype=torch.float32)
    )
    model = engine.module
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert fast_decode_blocker(model) is None


@pytest.mark.parametrize("shape", [(16, 512), (3, 5, 64), (2, 7, 4, 32)])
def test_float32_rms_norm_is_hf_rms_norm_bit_for_bit(shape):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(shape, generator=gen) * 3, torch.randn(shape[-1], generator=gen)
    hf = LlamaRMSNorm(shape[-1], eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(weight)
        expected = hf(x)
    assert torch.equal(fast_decode_module._rms_norm(x, weight, 1e-6), expected)
    assert torch.equal(fast_decode_module._rms_norm(x, weight, 1e-6), torch.rms_norm(x, shape[-1:], weight, 1e-6))
    assert torch.equal(fast_decode_module._rms_norm(x, None, 1e-6), torch.rms_norm(x, shape[-1:], None, 1e-6))


def test_bf16_rms_norm_is_hf_rms_norm_bit_for_bit():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(1)
    x, weight = (torch.randn(16, 512, generator=gen) * 3).bfloat16(), torch.randn(512, generator=gen).bfloat16()
    hf = LlamaRMSNorm(512, eps=1e-6).bfloat16()
    with torch.no_grad():
        hf.weight.copy_(weight)
        expected = hf(x)
    assert torch.equal(fast_decode_module._rms_norm(x, weight, 1e-6), expected)
