"""Sharded loading (meta build, each rank reads its slices) equals the full load then shard (CPU, gloo).

One ``torch.multiprocessing.spawn`` of 4 ranks builds, for every checkpoint and every strategy
(dp, tp, pp) in {(2,1,1), (1,2,1), (1,1,2), (2,2,1)}, two engines on the same mesh: one from
``rlflow.workers.residency.load_hf_model`` (the full ``from_pretrained`` on every rank, as
before) and one from :func:`rlflow.engine.loading.sharded_model`. Each rank records whether the
local parameters, buffers and a forward are bit-identical, and how many bytes it read.

A second spawn loads a ~100 MB model under dp=4 both ways and measures each rank's peak
resident memory (``VmHWM``, reset through ``/proc/self/clear_refs``): about a quarter of the
model with sharded loading, the whole model or more with the full load.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForTokenClassification, Qwen2Config, Qwen2ForCausalLM

from benchmarks.bench_sharded_load import peak_rss
from rlflow.rendezvous import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

WORLD = 4
# (dp, tp, pp) and the first global rank of each job; jobs of one round run side by side.
ROUNDS: list[list[tuple[tuple[int, int, int], int]]] = [
    [((2, 1, 1), 0), ((1, 2, 1), 2)],
    [((1, 1, 2), 0)],
    [((2, 2, 1), 0)],
]
STRATEGIES = [s for round_ in ROUNDS for s, _ in round_]


@dataclass(frozen=True)
class Case:
    """A model as a worker loads it: a directory and the head the engine puts on it."""

    name: str
    directory: str
    head: str  # "lm" or "value"


CASES = [
    Case("llama_untied", "llama_untied", "lm"),  # fp32, one file
    Case("llama_tied_bf16", "llama_tied_bf16", "lm"),  # bf16 files, sharded (index.json)
    Case("qwen2_bias", "qwen2_bias", "lm"),  # q/k/v biases, sharded
    Case("value_from_lm", "llama_tied_bf16", "value"),  # a critic started from a causal LM: zero head
    Case("value_model", "value_model", "value"),  # a saved value model: head read from the file
]


def _tiny(cls, config_cls, seed: int, **overrides):
    # Vocabulary 98: tp=2 gives 49 rows per rank and FSDP then uneven chunks (25/24), padded.
    kwargs = dict(
        vocab_size=98,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    model = cls(config_cls(**{**kwargs, **overrides}))
    with torch.no_grad():  # norms start at one and biases at zero: randomise them so slicing errors show
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.normal_(0.0, 0.5)
    return model


def _write_checkpoints(root: Path) -> None:
    _tiny(LlamaForCausalLM, LlamaConfig, 0, tie_word_embeddings=False).save_pretrained(root / "llama_untied")
    tied = _tiny(LlamaForCausalLM, LlamaConfig, 1, tie_word_embeddings=True).to(torch.bfloat16)
    tied.save_pretrained(root / "llama_tied_bf16", max_shard_size="40KB")
    qwen = _tiny(Qwen2ForCausalLM, Qwen2Config, 2, tie_word_embeddings=False)
    qwen.save_pretrained(root / "qwen2_bias", max_shard_size="60KB")
    _tiny(LlamaForTokenClassification, LlamaConfig, 3, num_labels=1).save_pretrained(root / "value_model")


def _model_setup(case: Case, root: str):
    from rlflow.workers.setup import ModelSetup

    role = "critic" if case.head == "value" else "actor"
    return ModelSetup(case.name, role, os.path.join(root, case.directory), value_head=case.head == "value")


def _engine_config(path: str, head: str):
    """The config as ``Residency._register`` builds it."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if head == "value":
        config.num_labels, config.classifier_dropout = 1, 0.0
    return config


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def _compare(case: Case, root: str, groups, outdir: str) -> None:
    from rlflow.engine.loading import sharded_model
    from rlflow.engine.train_engine import EngineConfig, TrainEngine
    from rlflow.parallel.executor import module_param_tensors
    from rlflow.parallel.layout import build_layout
    from rlflow.workers.residency import load_hf_model

    setup = _model_setup(case, root)
    config = _engine_config(setup.path, case.head)
    layout = build_layout(config, groups.strategy, groups.ranks, fsdp=True, head=case.head)
    engine_config = EngineConfig(optim=None, device="cpu")
    old = TrainEngine(load_hf_model(setup), groups.mesh, engine_config)
    module, loader = sharded_model(setup.path, config, case.head, layout, groups.rank)
    new = TrainEngine(module, groups.mesh, engine_config, load_weights=loader)
    old_params, new_params = module_param_tensors(old.stage), module_param_tensors(new.stage)
    old_buffers, new_buffers = dict(old.stage.named_buffers()), dict(new.stage.named_buffers())
    g = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(1, 98, (2, 9), generator=g),
        "attention_mask": torch.ones(2, 9, dtype=torch.long),
    }
    batch["attention_mask"][0, :3] = 0
    want, got = old.forward(batch), new.forward(batch)
    file_itemsize = 2 if "bf16" in case.directory else 4
    read_numel = sum(
        n for name, n in _box_numels(layout, groups.rank).items() if name not in loader.stats.zero_initialised
    )
    record = {
        "names": sorted(new_params) == sorted(old_params),
        "param_mismatch": [n for n in old_params if not _same(old_params[n], new_params.get(n, []))],
        "buffer_mismatch": [
            n for n in old_buffers if n not in new_buffers or not torch.equal(old_buffers[n], new_buffers[n])
        ],
        "forward_equal": (want is None and got is None) or all(torch.equal(want[k], got[k]) for k in want),
        "bytes_read": loader.stats.bytes_read,
        "expected_bytes_read": read_numel * file_itemsize,
        "zero_initialised": list(loader.stats.zero_initialised),
    }
    dp, tp, pp = groups.strategy.dp, groups.strategy.tp, groups.strategy.pp
    with open(os.path.join(outdir, f"{case.name}_{dp}{tp}{pp}_rank{groups.call_rank}.json"), "w") as f:
        json.dump(record, f)


def _box_numels(layout, rank: int) -> dict[str, int]:
    out = {}
    for name, box in layout.boxes(rank).items():
        n = 1
        for a, b in box:
            n *= b - a
        out[name] = n
    return out


def _worker(rank: int, port: int, root: str, outdir: str) -> None:
    import torch.distributed as dist

    from rlflow.parallel.groups import build_call_groups, clear_group_cache
    from rlflow.strategy import ParallelStrategy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        for round_ in ROUNDS:
            jobs = []
            for (dp, tp, pp), first in round_:  # every rank builds every job's groups: a collective
                strategy = ParallelStrategy(dp=dp, tp=tp, pp=pp)
                jobs.append(build_call_groups(range(first, first + strategy.world_size), strategy, "cpu"))
            for groups in jobs:
                if groups is not None:
                    for case in CASES:
                        _compare(case, root, groups, outdir)
            dist.barrier()
        if os.access("/proc/self/clear_refs", os.W_OK):
            groups = build_call_groups(range(WORLD), ParallelStrategy(dp=WORLD), "cpu")
            _measure_memory(os.path.join(root, MEMORY_MODEL), groups, outdir)
    finally:
        clear_group_cache()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> str:
    """Runs the 4-rank world once; returns the directory of its records."""
    root, outdir = tmp_path_factory.mktemp("checkpoints"), tmp_path_factory.mktemp("records")
    _write_checkpoints(root)
    _write_memory_model(root / MEMORY_MODEL)
    # The forwards are compared bit for bit: MKL's kernels on some CPUs (AMD's, AVX2) take paths by
    # the operands' alignment unless its conditional numerical reproducibility is on (the spawned
    # ranks read the variable when MKL starts).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MKL_CBWR", os.environ.get("MKL_CBWR", "COMPATIBLE"))
        torch.multiprocessing.spawn(_worker, args=(free_port(), str(root), str(outdir)), nprocs=WORLD, join=True)
    return str(outdir)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: "dp{}_tp{}_pp{}".format(*s))
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_sharded_load_equals_full_load(world: str, case: Case, strategy: tuple[int, int, int]) -> None:
    dp, tp, pp = strategy
    for call_rank in range(dp * tp * pp):
        with open(os.path.join(world, f"{case.name}_{dp}{tp}{pp}_rank{call_rank}.json")) as f:
            record = json.load(f)
        where = f"{case.name} {strategy} call rank {call_rank}"
        assert record["names"], f"{where}: the two engines hold different parameters"
        assert record["param_mismatch"] == [], f"{where}: parameters differ"
        assert record["buffer_mismatch"] == [], f"{where}: buffers differ (rotary inv_freq recomputed?)"
        assert record["forward_equal"], f"{where}: forward outputs differ"
        assert record["bytes_read"] == record["expected_bytes_read"], f"{where}: read more than its slices"
        head_zeroed = case.name == "value_from_lm" and call_rank >= (pp - 1) * dp * tp
        assert bool(record["zero_initialised"]) == head_zeroed, f"{where}: {record['zero_initialised']}"


def test_fallback_without_safetensors(tmp_path, caplog) -> None:
    """A directory holding only ``pytorch_model.bin`` is loaded whole, with a log line saying so."""
    from rlflow.engine.loading import sharded_model
    from rlflow.parallel.layout import build_layout
    from rlflow.strategy import ParallelStrategy

    model = _tiny(LlamaForCausalLM, LlamaConfig, 0)
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    layout = build_layout(model.config, ParallelStrategy(dp=2), [0, 1], fsdp=True)
    with caplog.at_level("WARNING", logger="rlflow.engine.loading"):
        assert sharded_model(tmp_path, model.config, "lm", layout, 0) is None
    assert "no safetensors files" in caplog.text and str(tmp_path) in caplog.text


# ---------------------------------------------------------------------------------------------
# Peak host memory per rank under dp=4
# ---------------------------------------------------------------------------------------------

MEMORY_MODEL = "memory_llama_bf16"


def _write_memory_model(path: Path) -> None:
    """A Llama of 25.6M parameters (102 MB as fp32 masters), saved in bf16 like most checkpoints.

    bf16 matters: from fp32 files ``from_pretrained`` keeps memory-mapped views and the old
    path touched only the pages each rank sharded; converting bf16 to fp32 materialises it all.
    """
    config = LlamaConfig(
        vocab_size=16000,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def _measure_memory(path: str, groups, outdir: str) -> None:
    """Peak RSS of building the dp=4 engine with sharded loading, then with the full load."""
    from rlflow.engine.loading import sharded_model
    from rlflow.engine.train_engine import EngineConfig, TrainEngine
    from rlflow.parallel.layout import build_layout
    from rlflow.workers.residency import load_hf_model
    from rlflow.workers.setup import ModelSetup

    config = _engine_config(path, "lm")
    layout = build_layout(config, groups.strategy, groups.ranks, fsdp=True)
    engine_config = EngineConfig(optim=None, device="cpu")

    def sharded() -> None:
        module, loader = sharded_model(path, config, "lm", layout, groups.rank)
        TrainEngine(module, groups.mesh, engine_config, load_weights=loader)

    def full() -> None:
        TrainEngine(load_hf_model(ModelSetup("m", "actor", path)), groups.mesh, engine_config)

    record = {"sharded": peak_rss(sharded)[2], "full": peak_rss(full)[2]}
    record["model_bytes"] = 4 * sum(spec.numel for spec in layout.params)  # as fp32 masters
    with open(os.path.join(outdir, f"memory_rank{groups.rank}.json"), "w") as f:
        json.dump(record, f)


def test_peak_host_memory_is_a_shard_of_the_model(world: str) -> None:
    """dp=4: each rank's peak is about a quarter of the fp32 model, where the full load held all of it."""
    if not os.path.exists(os.path.join(world, "memory_rank0.json")):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    for rank in range(WORLD):
        with open(os.path.join(world, f"memory_rank{rank}.json")) as f:
            record = json.load(f)
        model_bytes = record["model_bytes"]
        # The full load's peak shows that the measurement sees the model: all of it, on every rank.
        assert record["full"] > 0.9 * model_bytes, f"rank {rank}: {record}, model {model_bytes} bytes"
        # Sharded: this rank's quarter of the masters plus one slice in flight.
        assert record["sharded"] < 0.45 * model_bytes, f"rank {rank}: {record}, model {model_bytes} bytes"
