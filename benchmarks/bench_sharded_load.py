"""Host memory of building a home engine: sharded loading vs the full load then shard.

Four spawned gloo processes (one torch thread each) build a ``TrainEngine`` (inference-only,
so no optimizer state) of a random 134M-parameter Llama (12 layers, hidden 768, 12 heads,
intermediate 2048, vocabulary 32000, untied head: 537 MB as fp32 masters) saved as safetensors
in bf16 — the usual checkpoint dtype — and in fp32, two ways:

* **full** — ``rlflow.workers.residency.load_hf_model`` (``from_pretrained`` of the whole
  model in fp32 on every rank), then the engine's pipeline split, tensor parallelism, FSDP2;
* **sharded** — ``rlflow.engine.loading.sharded_model``: a meta-device model parallelized by
  the engine, each rank reading only its slices with ``safe_open(...).get_slice``.

Each figure is a rank's peak resident memory (``VmHWM``, reset through
``/proc/self/clear_refs`` before each build) minus its resident memory before the build, and
the build's wall time. The run checks that both ways give bit-identical local parameters.

It also measures an off-home forward copy (``Residency._build_copy`` with an FSDP layout: the
engine of a call on another layout than the model's home, whose weights the reallocation
manager writes): built on the meta device (``copy_meta``) against built from a whole empty model
first (``copy_full``, before this was changed).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import re
import tempfile
import time

import torch

from rlflow.rendezvous import free_port

WORLD = 4
STRATEGIES = [(4, 1, 1), (2, 2, 1), (2, 1, 2)]  # (dp, tp, pp)
MIB = 2**20


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        tie_word_embeddings=False,
    )


def _malloc_trim() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the peak may then be underestimated, never inflated
        pass


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def peak_rss(fn):
    """``(result, seconds, bytes by which fn() raised the resident peak above the RSS before it)``.

    Linux only (``/proc/self/clear_refs`` resets the peak); also used by tests/engine/test_sharded_load.py.
    """
    gc.collect()
    _malloc_trim()  # hand freed heap back, so that earlier frees do not absorb fn's allocations
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    return result, seconds, (_status_kib("VmHWM") - before) * 1024


def _measure(path: str, groups) -> dict:
    from transformers import AutoConfig

    from rlflow.engine.loading import build_meta_model, init_buffers, sharded_model
    from rlflow.engine.train_engine import EngineConfig, TrainEngine
    from rlflow.parallel.executor import module_param_tensors
    from rlflow.parallel.layout import build_layout
    from rlflow.workers.residency import _empty_hf_model, load_hf_model
    from rlflow.workers.setup import ModelSetup

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    layout = build_layout(config, groups.strategy, groups.ranks, fsdp=True)
    engine_config = EngineConfig(optim=None, device="cpu")

    def sharded():
        module, loader = sharded_model(path, config, "lm", layout, groups.rank)
        return module_param_tensors(TrainEngine(module, groups.mesh, engine_config, load_weights=loader).stage)

    def full():
        model = load_hf_model(ModelSetup("m", "actor", path))
        return module_param_tensors(TrainEngine(model, groups.mesh, engine_config).stage)

    def copy_meta():  # an off-home forward copy as Residency builds it: the manager writes its weights next
        return TrainEngine(build_meta_model(config, "lm"), groups.mesh, engine_config, load_weights=init_buffers)

    def copy_full():  # the same copy built from a whole empty model, as before
        return TrainEngine(_empty_hf_model(config, "lm"), groups.mesh, engine_config)

    new, new_s, new_peak = peak_rss(sharded)
    old, old_s, old_peak = peak_rss(full)
    copy_meta_peak, copy_full_peak = peak_rss(copy_meta)[2], peak_rss(copy_full)[2]
    equal = new.keys() == old.keys() and all(
        all(torch.equal(a, b) for a, b in zip(new[k], old[k], strict=True)) for k in old
    )
    local = sum(t.numel() * t.element_size() for ts in new.values() for t in ts)
    return {
        **{"sharded": new_peak, "full": old_peak, "sharded_s": new_s, "full_s": old_s, "local": local, "eq": equal},
        **{"copy_meta": copy_meta_peak, "copy_full": copy_full_peak},
    }


def _worker(rank: int, port: int, paths: dict[str, str], out: str) -> None:
    import torch.distributed as dist

    from rlflow.parallel.groups import build_call_groups, clear_group_cache
    from rlflow.strategy import ParallelStrategy

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        results = {}
        for dtype, path in paths.items():
            for dp, tp, pp in STRATEGIES if dtype == "bf16" else STRATEGIES[:1]:
                groups = build_call_groups(range(WORLD), ParallelStrategy(dp=dp, tp=tp, pp=pp), "cpu")
                results[f"{dtype}/dp{dp}_tp{tp}_pp{pp}"] = _measure(path, groups)
                dist.barrier()
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        clear_group_cache()
        dist.destroy_process_group()


def run() -> list[dict]:
    """One record per (file dtype, strategy): per-rank peak host-memory growth, full vs sharded."""
    from transformers import LlamaForCausalLM

    if not os.access("/proc/self/clear_refs", os.W_OK):
        raise RuntimeError("bench_sharded_load needs Linux's /proc/self/clear_refs to reset the peak RSS")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = LlamaForCausalLM(_config())
        model_bytes = sum(p.numel() * 4 for p in model.parameters())
        paths = {"fp32": os.path.join(tmp, "fp32"), "bf16": os.path.join(tmp, "bf16")}
        model.save_pretrained(paths["fp32"])
        model.to(torch.bfloat16).save_pretrained(paths["bf16"])
        del model
        torch.multiprocessing.spawn(_worker, args=(free_port(), paths, tmp), nprocs=WORLD, join=True)
        ranks = []
        for r in range(WORLD):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    records = []
    for key in ranks[0]:
        per_rank = [r[key] for r in ranks]
        records.append(
            {
                "name": f"sharded_load/{key}",
                "model_fp32_mib": round(model_bytes / MIB, 1),
                "local_params_mib": [round(r["local"] / MIB, 1) for r in per_rank],
                "full_peak_mib": [round(r["full"] / MIB, 1) for r in per_rank],
                "sharded_peak_mib": [round(r["sharded"] / MIB, 1) for r in per_rank],
                "full_seconds": [round(r["full_s"], 2) for r in per_rank],
                "sharded_seconds": [round(r["sharded_s"], 2) for r in per_rank],
                "copy_full_peak_mib": [round(r["copy_full"] / MIB, 1) for r in per_rank],
                "copy_meta_peak_mib": [round(r["copy_meta"] / MIB, 1) for r in per_rank],
                "bit_identical": all(r["eq"] for r in per_rank),
            }
        )
    return records


if __name__ == "__main__":
    for record in run():
        print(json.dumps(record))
