"""vLLM's tensor-parallel layout: boxes, views into fused parameters, and reshards into them.

No vLLM here: a "vLLM-shaped" stand-in holds plain tensors named and shaped as vLLM's parameters
of one tp rank. :func:`reference_vllm_rank` builds them independently of
``rlflow.parallel.vllm_layout``, the way vLLM's weight loaders cut and fuse a full HF state dict
(``QKVParallelLinear``: q of rank r, then kv head ``r // replicas`` when tp > num_kv_heads;
``MergedColumnParallelLinear``: gate then up; ``RowParallelLinear``: columns; vocabulary padded to
a multiple of 64 and split evenly, padding rows zero). The distributed test reshards FSDP
training weights into the stand-in through the real executor and reallocation manager (gloo)
and compares every fused tensor with that reference.
"""

from __future__ import annotations

import pytest
import torch
from realloc_helpers import build_model, build_sharded_module, full_state, run_world
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from rlflow.parallel.executor import module_param_tensors
from rlflow.parallel.layout import build_layout
from rlflow.parallel.realloc import ReallocManager
from rlflow.parallel.reshard import minimum_moved_numel, plan_reshard, transfer_bytes_summary
from rlflow.parallel.vllm_layout import padded_vocab_size, vllm_param_specs, vllm_param_views, vocab_shard_rows
from rlflow.strategy import ParallelStrategy as S

pytestmark = pytest.mark.timeout(120)

PAD_SENTINEL = 7.0  # padding rows of the stand-in: a push must leave them alone


def llama_gqa_untied() -> LlamaConfig:  # vocab 97: neither a multiple of 64 nor of tp
    return LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip


def qwen2_tied_one_kv_head() -> Qwen2Config:  # q/k/v biases; tp > kv heads replicates; rank 3 of tp=4 all padding
    return Qwen2Config(vocab_size=70, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)  # fmt: skip


def qwen3_head_dim() -> Qwen3Config:  # q_norm/k_norm; head_dim 24 != hidden / heads
    return Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, head_dim=24,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip


def llama_biases_tied() -> LlamaConfig:  # q/k/v/o and MLP biases (o, down biases replicated); vocab < 64
    return LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
                       attention_bias=True, mlp_bias=True)  # fmt: skip


def mistral_gqa() -> MistralConfig:
    return MistralConfig(vocab_size=130, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)  # fmt: skip


CONFIGS = [llama_gqa_untied, qwen2_tied_one_kv_head, qwen3_head_dim, llama_biases_tied, mistral_gqa]


# ---- the independent reference: vLLM's per-rank tensors from a full HF state dict ----


def reference_vllm_rank(config, full: dict[str, torch.Tensor], tp: int, r: int) -> dict[str, torch.Tensor]:
    """vLLM's parameters of tp rank ``r`` by vLLM name, as its weight loaders fill them."""
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv = config.num_key_value_heads
    replicas = max(1, tp // kv)
    kv_rows = max(1, kv // tp) * d
    padded = -(-config.vocab_size // 64) * 64
    assert padded % tp == 0, "vLLM's default padding; the test uses tp that divide it"
    per_rank = padded // tp

    def vocab_shard(w: torch.Tensor) -> torch.Tensor:
        shard = torch.zeros(per_rank, w.shape[1])
        rows = w[r * per_rank : (r + 1) * per_rank]
        shard[: rows.shape[0]] = rows
        return shard

    out = {"model.embed_tokens.weight": vocab_shard(full["model.embed_tokens.weight"])}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = vocab_shard(full["lm_head.weight"])
    out["model.norm.weight"] = full["model.norm.weight"]
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            q = full.get(f"{p}self_attn.q_proj.{kind}")
            if q is None:
                continue
            k, v = full[f"{p}self_attn.k_proj.{kind}"], full[f"{p}self_attn.v_proj.{kind}"]
            kv_part = slice((r // replicas) * kv_rows, (r // replicas + 1) * kv_rows)
            out[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat([q.chunk(tp)[r], k[kv_part], v[kv_part]])
        for kind in ("weight", "bias"):
            gate = full.get(f"{p}mlp.gate_proj.{kind}")
            if gate is not None:
                out[f"{p}mlp.gate_up_proj.{kind}"] = torch.cat(
                    [gate.chunk(tp)[r], full[f"{p}mlp.up_proj.{kind}"].chunk(tp)[r]]
                )
        for row_parallel in ("self_attn.o_proj", "mlp.down_proj"):
            out[f"{p}{row_parallel}.weight"] = full[f"{p}{row_parallel}.weight"].chunk(tp, dim=1)[r]
            if f"{p}{row_parallel}.bias" in full:
                out[f"{p}{row_parallel}.bias"] = full[f"{p}{row_parallel}.bias"]
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            if f"{p}{norm}.weight" in full:
                out[f"{p}{norm}.weight"] = full[f"{p}{norm}.weight"]
    return out


def real_rows(config, tp: int, r: int) -> int:
    """Rows of rank r's vocabulary shard that hold tokens (the rest is padding)."""
    per_rank = -(-config.vocab_size // 64) * 64 // tp
    return max(0, min(per_rank, config.vocab_size - r * per_rank))


def stand_in(reference: dict[str, torch.Tensor], config, tp: int, r: int) -> dict[str, torch.Tensor]:
    """Tensors shaped like vLLM's: NaN (to be written), padding rows at a sentinel (to stay)."""
    out = {}
    for name, t in reference.items():
        out[name] = torch.full_like(t, float("nan"))
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name][real_rows(config, tp, r) :] = PAD_SENTINEL
    return out


def assert_matches_reference(tensors, reference, config, tp, r) -> None:
    assert set(tensors) == set(reference)
    for name, want in reference.items():
        got = tensors[name]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            n = real_rows(config, tp, r)
            assert torch.equal(got[:n], want[:n]), name
            assert bool((got[n:] == PAD_SENTINEL).all()), f"{name}: padding rows were written"
        else:
            assert torch.equal(got, want), name


# ---- pure tests ----


def test_vocab_shards_follow_vllms_padding():
    # 100 tokens, tp=4: padded to 128, 32 rows per rank, the last rank 4 real rows.
    assert [vocab_shard_rows(100, 4, r) for r in range(4)] == [(0, 32), (32, 64), (64, 96), (96, 100)]
    # 70 tokens, tp=4: 128 rows, the last rank holds only padding.
    assert [vocab_shard_rows(70, 4, r) for r in range(4)] == [(0, 32), (32, 64), (64, 70), (70, 70)]
    assert vocab_shard_rows(50, 1, 0) == (0, 50) and padded_vocab_size(50, 1) == 64
    # tp=3 does not divide 64: current vLLM pads to lcm(64, 3) = 192 (64 rows per rank).
    assert padded_vocab_size(100, 3) == 192 and vocab_shard_rows(100, 3, 1) == (64, 100)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("make_config", CONFIGS, ids=lambda f: f.__name__)
def test_views_hold_the_layout_slices_of_vllms_tensors(make_config, tp):
    """Views into the reference's fused tensors are exactly the vLLM layout's slices of the HF tensors."""
    config = make_config()
    full = full_state(build_model(config))
    layout = build_layout(config, S(dp=2, tp=tp), range(2 * tp), style="vllm")
    for r in range(tp):
        reference = reference_vllm_rank(config, full, tp, r)
        views = vllm_param_views(config, tp, r, reference)
        slices = layout.slices(layout.ranks[r])  # dp rank 0, tp rank r
        assert set(views) == set(slices) == set(full)
        for name, ts in views.items():
            assert len(ts) == 1 and torch.equal(ts[0], full[name][slices[name]]), name
        qkv = reference["model.layers.0.self_attn.qkv_proj.weight"]
        assert views["model.layers.0.self_attn.q_proj.weight"][0].data_ptr() == qkv.data_ptr()  # views, not copies


def test_tied_head_aliasing_the_embedding_is_one_tensor():
    config = qwen2_tied_one_kv_head()
    reference = reference_vllm_rank(config, full_state(build_model(config)), 2, 0)
    aliased = {**reference, "lm_head.weight": reference["model.embed_tokens.weight"]}  # remove_duplicate=False
    assert len(vllm_param_views(config, 2, 0, aliased)["model.embed_tokens.weight"]) == 1
    separate = {**reference, "lm_head.weight": reference["model.embed_tokens.weight"].clone()}
    assert len(vllm_param_views(config, 2, 0, separate)["model.embed_tokens.weight"]) == 2


def test_kv_heads_replicated_over_tp_ranks_share_one_box():
    config = llama_gqa_untied()  # 2 kv heads of 16 rows, tp=4: ranks 0,1 hold head 0 and ranks 2,3 head 1
    layout = build_layout(config, S(tp=4), [4, 5, 6, 7], style="vllm")
    assert layout.holders("model.layers.1.self_attn.v_proj.weight") == [
        (((0, 16), (0, 64)), (4, 5)),
        (((16, 32), (0, 64)), (6, 7)),
    ]
    # The HF layout keeps all kv heads on every rank when tp does not divide them.
    hf = build_layout(config, S(tp=4), [4, 5, 6, 7])
    assert hf.holders("model.layers.1.self_attn.v_proj.weight") == [(((0, 32), (0, 64)), (4, 5, 6, 7))]


@pytest.mark.parametrize(
    "src,dst",
    [((S(dp=4), range(4)), (S(tp=4), range(4))), ((S(dp=2), [0, 1]), (S(dp=2, tp=2), range(4)))],
    ids=["fsdp4->tp4", "fsdp2->dp2tp2"],
)
@pytest.mark.parametrize("make_config", CONFIGS[:3], ids=lambda f: f.__name__)
def test_a_push_moves_exactly_each_ranks_vllm_shard(make_config, src, dst):
    """Every destination rank receives (or copies locally) each element of its vLLM shard once —
    never a full tensor: with tp > num_kv_heads only its own kv head, and only real vocabulary rows."""
    config = make_config()
    home = build_layout(config, src[0], src[1], fsdp=True)
    vllm = build_layout(config, dst[0], dst[1], style="vllm")
    plan = plan_reshard(home, vllm)
    got: dict[int, dict[str, int]] = {r: {} for r in vllm.ranks}
    for t in (*plan.copies, *plan.transfers):
        for d in t.dsts:
            for p in t.pieces:
                got[d][p.name] = got[d].get(p.name, 0) + p.numel
    full_numel = sum(p.numel for p in vllm.params)
    for r in vllm.ranks:
        want = {n: _numel(vllm.local_shape(r, n)) for n in vllm.boxes(r) if _numel(vllm.local_shape(r, n))}
        assert got[r] == want
        assert sum(want.values()) < full_numel or dst[0].tp == 1
    tp, d = dst[0].tp, getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_rows = max(1, config.num_key_value_heads // tp) * d
    assert got[vllm.ranks[-1]]["model.layers.0.self_attn.k_proj.weight"] == kv_rows * config.hidden_size
    summary = transfer_bytes_summary(plan, itemsize=4)
    assert summary["moved_bytes"] == 4 * minimum_moved_numel(home, vllm)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def test_refuses_what_vllm_cannot_split():
    with pytest.raises(ValueError, match="tp=3 does not divide num_attention_heads=4"):
        vllm_param_specs(llama_gqa_untied(), 3)
    six_heads = LlamaConfig(hidden_size=48, intermediate_size=96, num_attention_heads=6, num_key_value_heads=3)
    with pytest.raises(ValueError, match="tp=2 must divide num_key_value_heads=3 or be a multiple of it"):
        vllm_param_specs(six_heads, 2)
    with pytest.raises(ValueError, match="tp=4 does not divide intermediate_size=98"):
        vllm_param_specs(LlamaConfig(hidden_size=64, intermediate_size=98, num_attention_heads=4), 4)
    with pytest.raises(ValueError, match="no o_proj bias"):
        vllm_param_specs(Qwen3Config(attention_bias=True, num_attention_heads=4, num_key_value_heads=2), 2)
    with pytest.raises(ValueError, match="style='vllm' describes a vLLM rollout: pp=1"):
        build_layout(llama_gqa_untied(), S(pp=2), [0, 1], style="vllm")
    with pytest.raises(ValueError, match="fsdp=True"):
        build_layout(llama_gqa_untied(), S(dp=2), [0, 1], fsdp=True, style="vllm")
    with pytest.raises(ValueError, match="style='sglang'"):
        build_layout(llama_gqa_untied(), S(), [0], style="sglang")


def test_views_refuse_tensors_vllm_would_not_have():
    config = llama_gqa_untied()
    reference = reference_vllm_rank(config, full_state(build_model(config)), 2, 1)
    extra = {**reference, "model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}
    with pytest.raises(ValueError, match="no HF parameter maps to.*o_proj.bias"):
        vllm_param_views(config, 2, 1, extra)
    wrong = {**reference, "model.layers.1.mlp.gate_up_proj.weight": torch.zeros(2 * 96, 64)}  # tp=1 sized
    with pytest.raises(ValueError, match="gate_up_proj.weight has 192 rows on this rank; the layout expects 48 \\+ 48"):
        vllm_param_views(config, 2, 1, wrong)
    unpadded = {**reference, "lm_head.weight": torch.zeros(49, 64)}  # 97 tokens split 49/48 without padding
    with pytest.raises(ValueError, match="lm_head.weight has 49 rows on this rank; expected 64"):
        vllm_param_views(config, 2, 1, unpadded)
    missing = {k: v for k, v in reference.items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match="no parameter 'lm_head.weight'"):
        vllm_param_views(config, 2, 1, missing)


# ---- through the executor and the reallocation manager, on four gloo processes ----


class VLLMStandIn:
    """What the manager sees of a vLLM engine (``ParamViews``): tensors in vLLM's layout."""

    def __init__(self, config, tensors: dict[str, torch.Tensor], tp: int, tp_rank: int) -> None:
        self.config, self.tensors, self.tp, self.tp_rank = config, tensors, tp, tp_rank
        self.pushes = 0

    def param_tensors(self) -> dict[str, list[torch.Tensor]]:
        return vllm_param_views(self.config, self.tp, self.tp_rank, self.tensors)

    def weights_updated(self) -> None:
        self.pushes += 1


# (config, home: FSDP strategy and ranks, vLLM strategy on all four ranks)
PUSHES = [
    (llama_gqa_untied, (S(dp=4), [0, 1, 2, 3]), S(tp=4)),  # kv heads replicated 2x
    (qwen2_tied_one_kv_head, (S(dp=2), [0, 1]), S(dp=2, tp=2)),  # tied, biases, replicated kv
    (qwen3_head_dim, (S(dp=4), [0, 1, 2, 3]), S(dp=2, tp=2)),
    (llama_biases_tied, (S(dp=2), [2, 3]), S(tp=4)),  # home on two ranks only
    (mistral_gqa, (S(dp=4), [0, 1, 2, 3]), S(dp=4)),
]


def _push_child(rank: int, world_size: int) -> None:
    for case, (make_config, (home_strategy, home_ranks), vllm_strategy) in enumerate(PUSHES):
        config = make_config()
        full = full_state(build_model(config))
        home = build_layout(config, home_strategy, home_ranks, fsdp=True)
        vllm = build_layout(config, vllm_strategy, range(world_size), style="vllm")
        tp, tp_rank = vllm_strategy.tp, vllm.coords(rank)[2]
        reference = reference_vllm_rank(config, full, tp, tp_rank)
        engine = VLLMStandIn(config, stand_in(reference, config, tp, tp_rank), tp, tp_rank)
        module = build_sharded_module(config, home, rank)
        manager = ReallocManager(rank)
        manager.register("actor", home, module, lambda layout, engine=engine: engine, dtype=torch.float32)
        assert manager.pre_call("actor", vllm) is engine
        assert_matches_reference(engine.tensors, reference, config, tp, tp_rank)
        assert engine.pushes == 1
        received = transfer_bytes_summary(manager._plan(home, vllm), itemsize=4)["per_rank"][rank]["received_bytes"]
        assert manager.stats["received_bytes"] == received
        if case == 0:  # the home weights change: the copy is stale and is pushed again, into the same engine
            if module is not None:
                for ts in module_param_tensors(module).values():
                    ts[0].neg_()
                manager.bump_version("actor")
            manager.post_call("actor", vllm)
            manager.pre_call("actor", vllm)
            negated = reference_vllm_rank(config, {n: -t for n, t in full.items()}, tp, tp_rank)
            assert_matches_reference(engine.tensors, negated, config, tp, tp_rank)
            assert engine.pushes == 2


@pytest.mark.distributed
@pytest.mark.timeout(300)  # four spawned processes import torch: slow on a loaded machine
def test_fsdp_weights_reach_vllms_fused_tensors_through_the_executor():
    run_world(_push_child, 4)
