"""The built-in HF sampler on one process: exactness against references, filters, layout, stops."""

from __future__ import annotations

import math

import pytest
import torch
from rollout_helpers import PAD, VOCAB, left_padded_prompts, naive_greedy, tiny_config, tiny_model

from rlflow.engine.packing import position_ids_from_mask
from rlflow.engine.rollout import HFRolloutEngine, SamplingParams, get_rollout_engine
from rlflow.engine.rollout.hf_sampler import apply_top_k, apply_top_p, choose_tokens
from rlflow.protocol import DataProto

torch.set_num_threads(1)

LENGTHS = [5, 9, 3, 7]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def engine(model):
    return get_rollout_engine("hf")(model)


# --------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_equals_naive_full_recompute(arch):
    model = tiny_model(arch, seed=1)
    ids, mask = left_padded_prompts(LENGTHS, seed=1)
    out = HFRolloutEngine(model).generate((ids, mask), SamplingParams(greedy=True, max_new_tokens=12))
    assert torch.equal(out["responses"], naive_greedy(model, ids, mask, 12))
    assert out["response_mask"].all()


def test_greedy_with_stop_tokens_equals_naive(model, engine):
    ids, mask = left_padded_prompts([4, 6, 5, 3, 8, 6, 2, 7], seed=2)
    free = naive_greedy(model, ids, mask, 10)
    # Stop on tokens that several rows emit early, so rows finish at different steps and the
    # sampler prunes finished rows from its batch (and KV cache) on the way.
    stops = tuple(free[:, :3].flatten().unique()[:4].tolist())
    out = engine.generate((ids, mask), SamplingParams(greedy=True, max_new_tokens=10, stop_token_ids=stops))
    expected = naive_greedy(model, ids, mask, 10, stop_token_ids=stops)
    assert torch.equal(out["responses"], expected)
    lengths = out["response_mask"].sum(1)
    assert len(set(lengths.tolist())) > 1, "test needs rows finishing at different steps"
    for row, length in enumerate(lengths.tolist()):
        assert out["response_mask"][row, :length].all() and not out["response_mask"][row, length:].any()
        assert (out["responses"][row, length:] == PAD).all()
        assert (out["old_logp"][row, length:] == 0).all()
        if length < 10:  # finished on a stop token, which stays in the response
            assert out["responses"][row, length - 1].item() in stops


@pytest.mark.parametrize("greedy", [False, True])
def test_old_logp_equals_teacher_forced_forward(model, engine, greedy):
    ids, mask = left_padded_prompts(LENGTHS, seed=3)
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, n=2, max_new_tokens=9, seed=5, greedy=greedy)
    out = engine.generate((ids, mask), params)
    with torch.no_grad():
        logits = model(
            input_ids=out["input_ids"],
            attention_mask=out["attention_mask"],
            position_ids=out["position_ids"],
            use_cache=False,
        ).logits
    prompt_len = ids.shape[1]
    temperature = 1.0 if greedy else params.temperature
    logp = torch.log_softmax(logits[:, prompt_len - 1 : -1].float() / temperature, dim=-1)
    expected = logp.gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1) * out["response_mask"]
    # the sampler's C++ step (FMA over its own summation order) against MKL's forward: float32
    # rounding of log-probs up to ~3 in size (test_native_decode.TWIN_ATOL)
    torch.testing.assert_close(out["old_logp"], expected, atol=2e-5, rtol=0)


def test_left_padding_does_not_change_the_continuation(model, engine):
    ids, mask = left_padded_prompts([6, 4], seed=4)
    wide_ids, wide_mask = left_padded_prompts([6, 4], seed=4, width=15)
    params = SamplingParams(greedy=True, max_new_tokens=10)
    narrow = engine.generate((ids, mask), params)
    wide = engine.generate((wide_ids, wide_mask), params)
    alone = engine.generate((ids[1:, 2:], mask[1:, 2:]), params)  # row 1 without any padding
    assert torch.equal(narrow["responses"], wide["responses"])
    assert torch.equal(narrow["responses"][1:], alone["responses"])
    torch.testing.assert_close(narrow["old_logp"], wide["old_logp"], atol=1e-5, rtol=0)


@torch.no_grad()
def reference_sample(model, input_ids, attention_mask, params: SamplingParams) -> dict[str, torch.Tensor]:
    """The sampler's contract decoded the slow way: a full forward over every sequence each step, no cache.

    Rows are dropped from the batch on the documented schedule (once a quarter of the batch has
    finished), so the generator draws for the same rows in the same order as the engine's.
    """
    generator = torch.Generator().manual_seed(params.seed)
    ids, mask = input_ids.repeat_interleave(params.n, 0), attention_mask.repeat_interleave(params.n, 0)
    num_rows, max_new = ids.shape[0], params.max_new_tokens
    temperature = 1.0 if params.greedy else params.temperature
    responses = torch.full((num_rows, max_new), PAD, dtype=torch.long)
    old_logp = torch.zeros((num_rows, max_new))
    batch, finished = list(range(num_rows)), set()
    for step in range(max_new):
        rows = torch.tensor(batch)
        logits = (
            model(input_ids=ids[rows], attention_mask=mask[rows], position_ids=position_ids_from_mask(mask[rows]))
            .logits[:, -1]
            .float()
        )
        tokens = choose_tokens(logits, params, generator)
        logp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
        column, column_mask = (
            torch.full((num_rows, 1), PAD, dtype=torch.long),
            torch.zeros((num_rows, 1), dtype=torch.long),
        )
        for i, row in enumerate(batch):
            column[row], column_mask[row] = tokens[i], 1
            if row not in finished:
                responses[row, step], old_logp[row, step] = tokens[i], logp[i]
                if tokens[i].item() in params.stop_token_ids:
                    finished.add(row)
        ids, mask = torch.cat([ids, column], 1), torch.cat([mask, column_mask], 1)
        alive = [row for row in batch if row not in finished]
        if not alive:
            break
        if len(alive) <= 0.75 * len(batch):
            batch = alive
    lengths = torch.tensor([max_new] * num_rows)
    for row in range(num_rows):
        stops = [t for t in range(max_new) if responses[row, t].item() in params.stop_token_ids]
        lengths[row] = stops[0] + 1 if stops else max_new
    response_mask = (torch.arange(max_new)[None, :] < lengths[:, None]).long()
    return {"responses": responses, "response_mask": response_mask, "old_logp": old_logp}


def _stops_hit_early(model, ids, mask) -> tuple[int, ...]:
    """Stop tokens that several rows emit in their first steps, so rows finish at different steps."""
    return tuple(naive_greedy(model, ids, mask, 10)[:, :3].flatten().unique()[:4].tolist())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("with_stops", [False, True])
@pytest.mark.parametrize(
    "sampling",
    [
        {"greedy": True},
        {"temperature": 0.8},
        {"temperature": 0.7, "top_k": 20, "top_p": 0.9},
    ],
    ids=["greedy", "tempered", "top_k_top_p"],
)
@pytest.mark.parametrize("fast_decode", [True, False], ids=["lean_decoder", "hf_modules"])
def test_sampler_equals_full_recompute_reference(arch, with_stops, sampling, fast_decode):
    model = tiny_model(arch, seed=4)
    ids, mask = left_padded_prompts([4, 6, 5, 3, 8, 6], seed=11)
    stops = _stops_hit_early(model, ids, mask) if with_stops else ()
    params = SamplingParams(n=3, max_new_tokens=14, seed=21, stop_token_ids=stops, **sampling)
    out = HFRolloutEngine(model, fast_decode=fast_decode).generate((ids, mask), params)
    expected = reference_sample(model, ids, mask, params)
    assert torch.equal(out["responses"], expected["responses"])
    assert torch.equal(out["response_mask"], expected["response_mask"])
    # the cached and the recomputed forwards round differently in the last bits
    torch.testing.assert_close(out["old_logp"], expected["old_logp"], atol=1e-5, rtol=1e-5)
    if with_stops:  # the case must exercise rows finishing (and being dropped) at different steps
        assert len(set(out["response_mask"].sum(1).tolist())) > 2


@pytest.mark.parametrize(
    "decoder", [{}, {"native_decode": False}, {"fast_decode": False}], ids=["native", "lean", "hf_modules"]
)
def test_min_new_tokens_keeps_the_stops_out_of_the_first_tokens(model, decoder):
    ids, mask = left_padded_prompts([4, 6, 5, 3, 8, 6], seed=2)
    stops = _stops_hit_early(model, ids, mask)
    engine = HFRolloutEngine(model, **decoder)
    free = engine.generate((ids, mask), SamplingParams(greedy=True, max_new_tokens=10, stop_token_ids=stops))
    assert (free["response_mask"].sum(1) < 4).any(), "test needs rows that stop within 4 tokens"
    params = SamplingParams(greedy=True, max_new_tokens=10, stop_token_ids=stops, min_new_tokens=4)
    out = engine.generate((ids, mask), params)
    assert out["response_mask"][:, :4].all() and not torch.isin(out["responses"][:, :4], torch.tensor(stops)).any()
    # greedy over the tokens left: each of the first 4 is the best non-stop token of a full forward
    with torch.no_grad():
        logits = model(
            input_ids=out["input_ids"], attention_mask=out["attention_mask"], position_ids=out["position_ids"],
            use_cache=False,
        ).logits[:, ids.shape[1] - 1 : -1].float()  # fmt: skip
    masked = logits.index_fill(-1, torch.tensor(stops), float("-inf"))
    assert torch.equal(out["responses"][:, :4], masked[:, :4].argmax(-1))
    # old_logp is the model's own (unmasked) log-prob of each chosen token, as training recomputes it
    expected = logits.log_softmax(-1).gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1) * out["response_mask"]
    torch.testing.assert_close(out["old_logp"], expected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="min_new_tokens=11"):
        SamplingParams(max_new_tokens=10, min_new_tokens=11)


def test_outputs_can_be_trained_on(model, engine):
    # The sampler decodes in inference mode; its outputs must still be ordinary tensors, or a
    # training forward that saves them for backward (the embedding's indices) would fail.
    ids, mask = left_padded_prompts([4, 6], seed=14)
    out = engine.generate((ids, mask), SamplingParams(n=2, max_new_tokens=5, seed=0, stop_token_ids=(7,)))
    assert not any(out[key].is_inference() for key in ("responses", "response_mask", "old_logp", "input_ids"))
    trained = tiny_model(seed=0).train()
    logits = trained(input_ids=out["input_ids"], attention_mask=out["attention_mask"]).logits
    (logits.float().log_softmax(-1).mean() * out["old_logp"].sum()).backward()
    assert trained.model.embed_tokens.weight.grad is not None


def test_eager_attention_equals_naive():
    model = tiny_model(seed=1)
    model.config._attn_implementation = "eager"  # the sampler then builds additive masks
    ids, mask = left_padded_prompts(LENGTHS, seed=12)
    params = SamplingParams(greedy=True, max_new_tokens=10, stop_token_ids=_stops_hit_early(model, ids, mask))
    out = HFRolloutEngine(model).generate((ids, mask), params)
    assert torch.equal(out["responses"], naive_greedy(model, ids, mask, 10, stop_token_ids=params.stop_token_ids))


def test_sliding_window_shorter_than_the_sequence_is_respected():
    # A window shorter than prompt + response: the sampler leaves the masks to the model.
    config = tiny_config("qwen2")
    config.use_sliding_window, config.sliding_window = True, 4
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    torch.manual_seed(2)
    model = type(tiny_model("qwen2"))(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    ids, mask = left_padded_prompts(LENGTHS, seed=13)
    out = HFRolloutEngine(model).generate((ids, mask), SamplingParams(greedy=True, max_new_tokens=10))
    windowed = naive_greedy(model, ids, mask, 10)
    assert torch.equal(out["responses"], windowed)
    config.sliding_window = 64  # the same weights attending to everything decode differently
    assert not torch.equal(naive_greedy(model, ids, mask, 10), windowed)


# --------------------------------------------------------------------------- output layout


def test_n_samples_are_interleaved_by_prompt(engine):
    ids, mask = left_padded_prompts(LENGTHS, seed=5)
    out = engine.generate((ids, mask), SamplingParams(n=3, max_new_tokens=6, seed=0))
    num_rows, prompt_len = len(LENGTHS) * 3, ids.shape[1]
    assert out["responses"].shape == (num_rows, 6) and out["input_ids"].shape == (num_rows, prompt_len + 6)
    assert torch.equal(out["prompts"], ids.repeat_interleave(3, dim=0))
    assert torch.equal(out["input_ids"][:, :prompt_len], out["prompts"])
    assert torch.equal(out["input_ids"][:, prompt_len:], out["responses"])
    assert torch.equal(out["attention_mask"][:, prompt_len:], out["response_mask"])
    groups = out["responses"].view(len(LENGTHS), 3, 6)
    assert any(not torch.equal(g[0], g[1]) or not torch.equal(g[0], g[2]) for g in groups)
    # positions continue from the prompt's last real token
    first = out["position_ids"][:, prompt_len]
    assert torch.equal(first, mask.sum(1).repeat_interleave(3))


def test_greedy_samples_are_identical_copies(engine):
    ids, mask = left_padded_prompts(LENGTHS, seed=6)
    one = engine.generate((ids, mask), SamplingParams(greedy=True, max_new_tokens=5))
    three = engine.generate((ids, mask), SamplingParams(greedy=True, n=3, max_new_tokens=5))
    assert torch.equal(three["responses"], one["responses"].repeat_interleave(3, dim=0))


def test_seed_reproduces_samples(engine):
    ids, mask = left_padded_prompts(LENGTHS, seed=7)
    a = engine.generate((ids, mask), SamplingParams(n=2, max_new_tokens=8, seed=11))
    b = engine.generate((ids, mask), SamplingParams(n=2, max_new_tokens=8, seed=11))
    c = engine.generate((ids, mask), SamplingParams(n=2, max_new_tokens=8, seed=12))
    assert torch.equal(a["responses"], b["responses"])
    assert not torch.equal(a["responses"], c["responses"])


def test_micro_batches_of_prompts_generate_in_turn(model, engine):
    # An MFC's n_mbs at pp = 1: groups of whole prompts one after another, rows in prompt order.
    ids, mask = left_padded_prompts([4, 6, 5, 3, 8, 6, 2], seed=9)
    greedy = SamplingParams(greedy=True, n=2, max_new_tokens=7, stop_token_ids=(5, 9))
    whole = engine.generate((ids, mask), greedy)
    for groups in (2, 3, 7, 20):  # 20 > prompts: one prompt a group
        split = HFRolloutEngine(model, num_micro_batches=groups)
        out = split.generate((ids, mask), greedy)
        for key in ("responses", "response_mask", "input_ids", "position_ids"):
            assert torch.equal(out[key], whole[key]), (groups, key)
        torch.testing.assert_close(out["old_logp"], whole["old_logp"], atol=1e-5, rtol=0)
    sampled = SamplingParams(n=2, max_new_tokens=6, seed=3)
    a, b = (HFRolloutEngine(model, num_micro_batches=3).generate((ids, mask), sampled) for _ in range(2))
    assert torch.equal(a["responses"], b["responses"])  # seeded: the groups draw in order
    assert a["responses"].shape == whole["responses"].shape[:1] + (6,)
    with pytest.raises(ValueError, match="num_micro_batches=0"):
        HFRolloutEngine(model, num_micro_batches=0)


def test_the_build_spec_carries_the_calls_micro_batches(model):
    from rlflow.engine.rollout import RolloutBuild

    spec = RolloutBuild(
        config=model.config, device_mesh=None, device=torch.device("cpu"), dtype=torch.float32, num_micro_batches=3
    )
    assert get_rollout_engine("hf").build(spec)._num_micro_batches == 3


def test_dataproto_in_dataproto_out(engine):
    ids, mask = left_padded_prompts([3, 5], seed=8)
    prompts = DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "uid": torch.tensor([10, 11])},
        {"answer": ["a", "b"]},
        {"step": 3},
    )
    out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=4, seed=0))
    assert isinstance(out, DataProto) and len(out) == 4
    assert out.non_tensor_batch["answer"].tolist() == ["a", "a", "b", "b"]
    assert out.batch["uid"].tolist() == [10, 10, 11, 11]
    assert out.meta_info == {"step": 3}
    assert out.batch["input_ids"].shape == (4, 5 + 4)


# --------------------------------------------------------------------------- sampling filters


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([[1.0, 4.0, 2.0, 3.0], [0.0, 3.0, 3.0, -1.0]])
    kept = apply_top_k(logits, 2)
    assert torch.isinf(kept[0, [0, 2]]).all() and torch.equal(kept[0, [1, 3]], logits[0, [1, 3]])
    assert torch.isinf(apply_top_k(logits, 1)[1, [0, 3]]).all()  # a tie at the k-th value keeps both
    assert torch.equal(apply_top_k(logits, 0), logits) and torch.equal(apply_top_k(logits, 4), logits)


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 0.5, 0.3, 0.15, 0.05
    logits = probs.log().unsqueeze(0)
    kept = lambda p: (~torch.isinf(apply_top_p(logits, p))).squeeze(0).tolist()  # noqa: E731
    assert kept(0.7) == [False, True, False, True]  # 0.5 < 0.7, so 0.3 is needed; 0.8 >= 0.7
    assert kept(0.5) == [False, True, False, False]
    assert kept(0.81) == [False, True, True, True]
    assert kept(0.01) == [False, True, False, False]  # the most likely token always survives
    assert kept(1.0) == [True, True, True, True]


def test_sampling_frequencies_follow_the_filtered_tempered_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0]).repeat(40_000, 1)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.5, top_k=3)
    tokens = choose_tokens(logits, params, gen)
    expected = torch.softmax(torch.tensor([2.0, 1.0, 0.5]) / 0.5, dim=0)
    freq = torch.bincount(tokens, minlength=5).float() / len(tokens)
    assert freq[3:].sum() == 0  # filtered tokens are never drawn
    torch.testing.assert_close(freq[:3], expected, atol=0.01, rtol=0)
    greedy = choose_tokens(logits[:2], SamplingParams(greedy=True, temperature=0.1), gen)
    assert greedy.tolist() == [0, 0]


# --------------------------------------------------------------------------- weights, registry, errors


def test_update_weights_switches_the_policy():
    source, target = tiny_model(seed=2), tiny_model(seed=3)
    ids, mask = left_padded_prompts(LENGTHS, seed=9)
    params = SamplingParams(greedy=True, max_new_tokens=6)
    engine = HFRolloutEngine(target)
    engine.update_weights(source.state_dict())
    assert torch.equal(engine.generate((ids, mask), params)["responses"], naive_greedy(source, ids, mask, 6))
    with pytest.raises(KeyError, match="no parameter 'nope'"):
        engine.update_weights([("nope", torch.zeros(1))])
    with pytest.raises(ValueError, match="lm_head.weight"):
        engine.update_weights({"lm_head.weight": torch.zeros(3, 3)})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": 0.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"n": 0}, "n=0"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
    ],
)
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
    assert SamplingParams(stop_token_ids=[1, 2]).stop_token_ids == (1, 2)


def test_bad_prompts_are_rejected(engine):
    ids, mask = left_padded_prompts([2, 3], seed=0)
    params = SamplingParams(max_new_tokens=2)
    with pytest.raises(ValueError, match="left-padded"):
        engine.generate((ids, mask.flip(1)), params)
    with pytest.raises(ValueError, match="no token"):
        engine.generate((ids, torch.zeros_like(mask)), params)
    with pytest.raises(ValueError, match=r"\(B, P\)"):
        engine.generate((ids, mask[:, :1]), params)
    with pytest.raises(ValueError, match="lacks"):
        engine.generate(DataProto.from_dict({"input_ids": ids}), params)


def test_probabilities_are_normalised(engine):
    ids, mask = left_padded_prompts([4], seed=10)
    out = engine.generate((ids, mask), SamplingParams(max_new_tokens=3, seed=0))
    assert (out["old_logp"] <= 0).all() and (out["old_logp"] > -math.log(VOCAB) * 10).all()
