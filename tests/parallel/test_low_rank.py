"""Low-rank pushes: a kept copy of a LoRA home gets the base once, then the adapters only, and
merges them into exactly the weights the home's merged view would have sent."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from transformers import AutoModelForCausalLM

from rlflow.data.tiny_models import build_tiny_model
from rlflow.engine.lora import LoraSpec, MergedViews, adapted_weight_names, low_rank_updates
from rlflow.engine.optim import OptimConfig
from rlflow.engine.train_engine import EngineConfig, TrainEngine
from rlflow.parallel.executor import module_param_tensors
from rlflow.parallel.layout import build_layout
from rlflow.parallel.low_rank import LowRankUpdate, adapter_layouts, merge_into
from rlflow.parallel.realloc import ReallocManager
from rlflow.strategy import ParallelStrategy

pytest.importorskip("peft")

SPEC = LoraSpec(r=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"), seed=5)
VOCAB = 40


def _model():
    return build_tiny_model(family="llama", vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                            num_kv_heads=2, intermediate_size=64, tie_word_embeddings=True, seed=3)  # fmt: skip


def _step(engine: TrainEngine, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    batch = {"input_ids": torch.randint(1, VOCAB, (4, 9), generator=g), "attention_mask": torch.ones(4, 9).long()}
    engine.train_step(batch, lambda out, b: (-(out["log_probs"] * b["attention_mask"]).mean(), {}))


@pytest.fixture(scope="module")
def world():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DeviceMesh("cpu", torch.zeros(1, 1, 1, dtype=torch.long), mesh_dim_names=("pp", "dp", "tp"))
    finally:
        dist.destroy_process_group()


def test_a_kept_copy_gets_the_adapters_only_and_merges_them_as_the_home_does(world) -> None:
    engine = TrainEngine(_model(), world, EngineConfig(device="cpu", lora=SPEC, optim=OptimConfig(lr=1e-2)))
    config = engine.stage.config
    home = build_layout(config, ParallelStrategy(), [0], fsdp=True)
    copy = build_layout(config, ParallelStrategy(), [0])  # a rollout's: replicated, no FSDP
    names = [p.name for p in home.params]
    updates = low_rank_updates(names, SPEC)
    assert [u.weight for u in updates] == [n for n in names if n in adapted_weight_names(names, SPEC)]

    def factory(_layout):
        return AutoModelForCausalLM.from_config(config).eval()

    managers = {}
    for mode, low_rank in (("adapters", updates), ("merged", None)):
        managers[mode] = ReallocManager(0)
        changing = adapted_weight_names(names, SPEC)
        managers[mode].register("actor", home, MergedViews(engine.stage), factory, dtype=torch.float32,
                                keep_copies=True, changing=changing, low_rank=low_rank)  # fmt: skip
    params = {p.name: p.numel for p in home.params}
    base_bytes = 4 * sum(params.values())
    adapter_bytes = 4 * sum(SPEC.r * sum(s for s in home_shape(home, u)) for u in updates)
    assert adapter_bytes < 4 * sum(params[u.weight] for u in updates)  # r * (in + out) < in * out here

    copied = []
    for step in range(3):
        if step:
            _step(engine, step)
            for m in managers.values():
                m.bump_version("actor")
        before = managers["adapters"].stats["copied_bytes"]
        got, want = (module_param_tensors(m.pre_call("actor", copy)) for m in managers.values())
        copied.append(managers["adapters"].stats["copied_bytes"] - before)
        assert sorted(got) == sorted(want)
        for name in want:  # bit for bit the merged push
            assert torch.equal(got[name][0], want[name][0]), (step, name)
    # The first push moves the base (unmerged) and the adapters; later ones the adapters alone.
    assert copied == [base_bytes + adapter_bytes, adapter_bytes, adapter_bytes]
    assert managers["adapters"].stats["partial"] == 2
    q = engine.stage.get_submodule("model.layers.1.self_attn.q_proj")
    assert q.lora_B["default"].weight.abs().sum() > 0  # the adapters moved: the merge is no copy of the base


def home_shape(home, update: LowRankUpdate) -> tuple[int, int]:
    return next(p.shape for p in home.params if p.name == update.weight)


@pytest.mark.parametrize(
    ("strategy", "fsdp"),
    [(ParallelStrategy(tp=2), False), (ParallelStrategy(pp=2), False), (ParallelStrategy(dp=2), True)],
    ids=["tp2-rollout", "pp2-rollout", "dp2-fsdp-copy"],
)
def test_a_copy_split_otherwise_merges_each_of_its_boxes_as_the_home_merges_its_rows(strategy, fsdp) -> None:
    # A home of 2 FSDP row shards; a copy at tp=2 (q_proj split by rows, down_proj by columns), in two
    # pipeline stages (each its layer's adapters), or FSDP-sharded (a forward copy: rows of the home's).
    config = _model().config
    home = build_layout(config, ParallelStrategy(dp=2), [0, 1], fsdp=True)
    copy = build_layout(config, strategy, [2, 3], fsdp=fsdp)
    updates = low_rank_updates([p.name for p in home.params], SPEC)
    home_adapters, copy_adapters = adapter_layouts(home, copy, updates)
    g = torch.Generator().manual_seed(0)
    full = {p.name: torch.randn(p.shape, generator=g) for p in home.params}
    adapters = {p.name: torch.randn(p.shape, generator=g) for p in home_adapters.params}
    # What each home rank's merged view sends: its rows, merged.
    merged = {}
    for u in updates:
        rows = [home.slices(r)[u.weight][0] for r in home.ranks]
        merged[u.weight] = torch.cat([full[u.weight][s] + u.scaling * (adapters[u.b][s] @ adapters[u.a]) for s in rows])
    for rank in home.ranks:  # B's FSDP shards are its weight's rows; A's split its r rows
        for u in updates:
            assert home_adapters.slices(rank)[u.b][0] == home.slices(rank)[u.weight][0]
            assert home_adapters.slices(rank)[u.a][0] == slice(2 * rank, 2 * rank + 2)
    merged_boxes = 0
    for rank in copy.ranks:
        boxes = copy.slices(rank)
        held = copy_adapters.slices(rank)  # whole, for the adapted weights of the rank's stage
        assert held == {n: tuple(slice(0, s) for s in adapters[n].shape) for n in held}
        assert {u.a for u in updates if u.weight in boxes} | {u.b for u in updates if u.weight in boxes} == set(held)
        base = {u.weight: full[u.weight][boxes[u.weight]].clone() for u in updates if u.weight in boxes}
        dst = {name: [torch.empty_like(t)] for name, t in base.items()}
        merge_into(updates, home, copy, rank, base, adapters, dst)
        for name in base:
            assert torch.equal(dst[name][0], merged[name][boxes[name]]), (rank, name)
            merged_boxes += 1
    assert merged_boxes == (2 * len(updates) if strategy.pp == 1 else len(updates))


def test_adapter_layouts_refuse_a_home_split_by_tp() -> None:
    config = _model().config
    home = build_layout(config, ParallelStrategy(tp=2), [0, 1], fsdp=True)
    updates = low_rank_updates([p.name for p in home.params], SPEC)
    with pytest.raises(ValueError, match="tp=1"):
        adapter_layouts(home, build_layout(config, ParallelStrategy(), [0]), updates)
