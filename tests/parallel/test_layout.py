"""Tests of layouts: pipeline stages, tensor-parallel and FSDP2 slices."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from rlflow.families import family_of
from rlflow.parallel.layout import (
    assign_pipeline_stages,
    build_layout,
    item_param_shapes,
    model_param_specs,
    pipeline_items,
    pipeline_stages,
)
from rlflow.strategy import ParallelStrategy


def llama_7b_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        tie_word_embeddings=False,
    )


def tiny_configs() -> list:
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=4, num_attention_heads=4)
    return [
        LlamaConfig(**common, num_key_value_heads=2),
        LlamaConfig(**common, num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
        Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=True),
        # q/k norms and q/k/v/o biases; head_dim 24 != hidden / heads
        Qwen3Config(**common, num_key_value_heads=2, head_dim=24, attention_bias=True),
        MistralConfig(**common, num_key_value_heads=1, tie_word_embeddings=True),
    ]


TINY_IDS = ["llama_gqa", "llama_tied_bias", "qwen2_tied", "qwen3_bias", "mistral_tied_one_kv_head"]


# ---- pipeline stages ----


def test_llama2_7b_pp2_cuts_after_item_17():
    items = pipeline_items(llama_7b_config())
    assert [n for n, _ in items][:2] == ["embed", "layer.0"] and [n for n, _ in items][-2:] == ["norm", "head"]
    assert sum(n for _, n in items) == 6_738_415_616  # the published LLaMA-2-7B parameter count
    stages = pipeline_stages(llama_7b_config(), 2)
    # The paper counts 34 items (its head includes the final norm); either way the first stage is
    # the embedding plus 16 layers, i.e. the cut is after item 17.
    assert len(stages[0]) == 17 and stages[0][-1] == "layer.15"
    assert stages[1] == [f"layer.{i}" for i in range(16, 32)] + ["norm", "head"]


@pytest.mark.parametrize("config", tiny_configs(), ids=TINY_IDS)
def test_item_shapes_match_the_hf_module(config):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    actual = {name: tuple(p.shape) for name, p in model.named_parameters()}
    expected = {}
    for _, shapes in item_param_shapes(config):
        expected.update(shapes)
    assert expected == actual
    # The head item counts the tied embedding again: the last pipeline stage holds a copy.
    items = dict(pipeline_items(config))
    assert items["head"] == config.vocab_size * config.hidden_size


def brute_force_stages(sizes: list[int], pp: int) -> int:
    import itertools

    best = None
    for cuts in itertools.combinations(range(1, len(sizes)), pp - 1):
        bounds = (0, *cuts, len(sizes))
        largest = max(sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = largest if best is None else min(best, largest)
    return best


@pytest.mark.parametrize("seed", range(20))
def test_assign_pipeline_stages_is_optimal_and_contiguous(seed):
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 10, (1,), generator=gen))
    sizes = torch.randint(0, 50, (n,), generator=gen).tolist()
    for pp in range(1, n + 1):
        stages = assign_pipeline_stages(sizes, pp)
        assert len(stages) == pp and all(len(r) > 0 for r in stages)
        assert [i for r in stages for i in r] == list(range(n))
        assert max(sum(sizes[i] for i in r) for r in stages) == brute_force_stages(sizes, pp)
        assert stages == assign_pipeline_stages(list(sizes), pp)  # deterministic


def test_assign_pipeline_stages_rejects_bad_input():
    with pytest.raises(ValueError, match="pp=5 exceeds"):
        assign_pipeline_stages([1, 2, 3], 5)
    with pytest.raises(ValueError, match="pp=0"):
        assign_pipeline_stages([1, 2, 3], 0)
    with pytest.raises(ValueError, match="model_type"):
        pipeline_items(type("C", (), {"model_type": "gpt2"})())


# ---- layouts ----


def all_layouts(config, world):
    from realloc_helpers import world_strategies

    for size in (1, 2, 4):
        for strategy in world_strategies(size):
            for fsdp in (False, True):
                yield build_layout(config, strategy, range(size), fsdp=fsdp)


@pytest.mark.parametrize("config", tiny_configs(), ids=TINY_IDS)
def test_every_element_is_held_and_shards_do_not_overlap(config):
    import numpy as np

    for layout in all_layouts(config, 4):
        for spec in layout.params:
            # Within one replica group (fixed pp stage holding it and, without FSDP, dp_rank 0)
            # the boxes tile the tensor exactly once.
            count = np.zeros(spec.shape, dtype=np.int64)
            for r in layout.ranks:
                pp_rank, dp_rank, _ = layout.coords(r)
                boxes = layout.boxes(r)
                first_stage = min(s for s in range(layout.strategy.pp) if spec in layout.stage_params(s))
                if spec.name in boxes and pp_rank == first_stage and (layout.fsdp or dp_rank == 0):
                    replicated_tp = spec.tp_dim is None and layout.coords(r).tp > 0
                    if not replicated_tp:
                        count[tuple(slice(a, b) for a, b in boxes[spec.name])] += 1
            assert (count == 1).all(), (layout.strategy, layout.fsdp, spec.name)


def test_tensor_parallel_dims_follow_the_contract():
    config = tiny_configs()[2]  # Qwen2: q/k/v biases, tied embeddings, 2 kv heads
    specs = {p.name: p for p in model_param_specs(config, tp=2)}
    p = "model.layers.0."
    assert specs[p + "self_attn.q_proj.bias"].tp_dim == 0 and specs[p + "self_attn.k_proj.weight"].tp_dim == 0
    assert specs[p + "self_attn.o_proj.weight"].tp_dim == 1 and specs[p + "mlp.down_proj.weight"].tp_dim == 1
    assert specs[p + "input_layernorm.weight"].tp_dim is None and specs["model.embed_tokens.weight"].tp_dim == 0
    assert specs["model.embed_tokens.weight"].items == ("embed", "head")  # tied: first and last stage
    assert "lm_head.weight" not in specs
    # 2 kv heads do not split 4 ways: k/v (and their biases) are replicated, q is still split.
    specs4 = {p.name: p for p in model_param_specs(config, tp=4)}
    assert specs4[p + "self_attn.k_proj.weight"].tp_dim is None and specs4[p + "self_attn.v_proj.bias"].tp_dim is None
    assert specs4[p + "self_attn.q_proj.weight"].tp_dim == 0
    with pytest.raises(ValueError, match="tp=3 does not divide num_attention_heads=4"):
        model_param_specs(config, tp=3)


def test_fsdp_shards_follow_torch_chunk_with_empty_tails():
    config = tiny_configs()[0]
    config.num_labels = 1  # a critic's scalar head
    layout = build_layout(config, ParallelStrategy(dp=3), [0, 1, 2], fsdp=True)
    rows = [layout.slices(r)["model.norm.weight"][0] for r in range(3)]
    assert [(s.start, s.stop) for s in rows] == [(0, 22), (22, 44), (44, 64)]  # torch.chunk(64, 3)
    value = build_layout(config, ParallelStrategy(dp=2), [0, 1], fsdp=True, head="value")
    assert value.local_shape(0, "score.weight") == (1, 64) and value.local_shape(1, "score.weight") == (0, 64)
    assert value.holders("score.weight") == [(((0, 1), (0, 64)), (0,))]


def test_layout_rejects_bad_ranks():
    config = tiny_configs()[0]
    with pytest.raises(ValueError, match="do not match"):
        build_layout(config, ParallelStrategy(dp=2), [0, 1, 2])
    with pytest.raises(ValueError, match="repeat"):
        build_layout(config, ParallelStrategy(dp=2), [1, 1])
    with pytest.raises(ValueError, match="not in this layout"):
        build_layout(config, ParallelStrategy(dp=2), [0, 1]).slices(5)


# ---- against real DTensor / FSDP2 shards ----


def dtensor_body(rank, world_size):
    from realloc_helpers import build_model, build_sharded_module, full_state, local_tensor, tiny_llama_gqa
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from rlflow.parallel.executor import canonical_name

    for config in (tiny_llama_gqa(), *tiny_configs()[2:]):
        full = full_state(build_model(config, 0))
        for layout in [
            build_layout(config, ParallelStrategy(dp=2, tp=2), range(4), fsdp=True),
            build_layout(config, ParallelStrategy(dp=4), range(4), fsdp=True),
            build_layout(config, ParallelStrategy(tp=4), range(4), fsdp=False),  # k/v replicated (2 kv heads)
            build_layout(config, ParallelStrategy(tp=2, pp=2), range(4), fsdp=False),
            build_layout(config, ParallelStrategy(dp=2, pp=2), range(4), fsdp=True),
            build_layout(config, ParallelStrategy(dp=3), range(3), fsdp=True),
            build_layout(config, ParallelStrategy(tp=2), [2, 3], fsdp=False),
        ]:
            stage = build_sharded_module(config, layout, rank, seed=0)
            if stage is None:
                continue
            tied = config.tie_word_embeddings
            tied_family = family_of(config) if tied else None
            held = {canonical_name(n, tied_family): p for n, p in stage.named_parameters(remove_duplicate=False)}
            slices = layout.slices(rank)
            assert set(held) == set(slices), (layout.strategy, set(held) ^ set(slices))
            for name, param in held.items():
                local = local_tensor(param.data)
                assert torch.equal(local, full[name][slices[name]]), (layout.strategy, name)
                if isinstance(param, DTensor):  # DTensor's own view of the shard agrees
                    shape, offset = compute_local_shape_and_global_offset(
                        param.shape, param.device_mesh, param.placements
                    )
                    box = tuple((s.start, s.stop) for s in slices[name])
                    assert tuple(shape) == layout.local_shape(rank, name)
                    if all(n > 0 for n in shape):
                        assert tuple(offset) == tuple(a for a, _ in box), (name, offset, box)


@pytest.mark.distributed
def test_slices_equal_real_fsdp2_and_dtensor_shards():
    from realloc_helpers import run_world

    run_world(dtensor_body, 4)
