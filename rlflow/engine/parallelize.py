"""Parallelisms as small functions applied in one order to a plain pipeline stage.

The training engine turns an HF model into this rank's part of a ``(pp, dp, tp)`` strategy
by applying, in this order:

1. **pipeline split** (:func:`rlflow.engine.pipeline.build_stage`) — everything after works on
   one stage, so each stage is parallelized on its own, as torchtitan does;
2. **tensor parallelism** (:func:`rlflow.parallel.tensor_parallel.apply_tp`) — before FSDP,
   because FSDP2 shards the *tp-local* tensors (a TP ``DTensor`` becomes a 2-D
   ``(dp, tp)`` DTensor), and DTensor TP cannot be applied to already FSDP-sharded params;
3. **activation checkpointing** (:func:`apply_ac`) — HF's per-layer checkpointing wraps the
   layer's ``forward``, inside the FSDP hooks: the recomputation then re-runs the TP
   collectives of the layer but not FSDP's all-gather, which happens once in the
   pre-backward hook;
4. **FSDP2** (:func:`apply_fsdp`) — last, so it sees the final parameters (``DTensor`` s on
   the tp mesh) and its unshard/reshard hooks are the outermost ones.

:class:`ParallelDims` validates the strategy against the mesh once, up front.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from rlflow.parallel.tensor_parallel import check_tp_degree
from rlflow.strategy import ParallelStrategy

__all__ = [
    "COMPUTE_DTYPES",
    "MESH_AXES",
    "ParallelDims",
    "apply_ac",
    "apply_fsdp",
    "cpu_bf16_pays",
    "cpu_bf16_speedup",
    "cpu_computes_bf16",
    "cpu_isa_caps",
    "layer_matmul_params",
    "mixed_precision_dtype",
    "resolve_compute_dtype",
]

logger = logging.getLogger(__name__)

MESH_AXES = ("pp", "dp", "tp")

# A model's compute precision (``models.<role>.dtype``). No float16: training in it needs loss
# scaling, which the engine does not do, and CPUs compute it without native matmuls.
COMPUTE_DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}
# /proc/cpuinfo flags of a CPU that multiplies bf16 natively (AVX512-BF16 dot products, AMX tiles).
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# Environment variables that cap the instruction sets torch's kernels use: its own vectorised
# kernels (ATen), oneDNN's (bf16 matmuls) and MKL's (fp32 matmuls). A capped process runs as a CPU
# with only those extensions would, which is how one host measures an AVX2 machine's behaviour.
ISA_CAP_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
# oneDNN's ISA names below the first that multiplies bf16 natively (AVX512_CORE_BF16)
ONEDNN_ISAS_WITHOUT_BF16 = frozenset(
    {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
)
# ``auto`` computes in bf16 on such a CPU only where one decoder layer's forward pass multiplies at
# least this much (multiplying parameters x tokens of a pass): below it a pass is per-op overhead
# and the casts around it (see resolve_compute_dtype).
CPU_BF16_MIN_PASS_WORK = 1 << 28
# ... and only where its bf16 matmul, measured on this host (cpu_bf16_speedup), beats fp32's by at least
# this factor: the flags do not say it. AMX tiles, and AMD's Zen 4 dot products, multiply bf16 several
# times faster than fp32; an Intel CPU with AVX512-BF16 but no AMX multiplies it slower (docs/benchmarks.md,
# "Precision" and "All three tasks on an AVX-512 CPU whose bf16 matmuls are slower than its fp32 ones").
CPU_BF16_MIN_SPEEDUP = 1.25
# The measured product: a training pass's projection, 256 tokens of width 512 to 1024 (F.linear).
_SPEED_SHAPE = (256, 512, 1024)
_SPEED_FILE = "cpu-matmul-speed.json"


@dataclass(frozen=True)
class ParallelDims(ParallelStrategy):
    """A ``(dp, tp, pp)`` strategy of one engine, read from its mesh and checked against the model.

    Args:
        dp: data-parallel (FSDP) degree.
        tp: tensor-parallel degree.
        pp: pipeline-parallel degree.
    """

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh) -> ParallelDims:
        """Read the degrees of a ``("pp", "dp", "tp")`` mesh, rejecting any other layout."""
        if tuple(mesh.mesh_dim_names or ()) != MESH_AXES:
            raise ValueError(f"mesh_dim_names={mesh.mesh_dim_names}; expected {MESH_AXES}")
        pp, dp, tp = mesh.shape
        return cls(dp=dp, tp=tp, pp=pp)

    def check_model(self, config) -> None:
        """Raise ``ValueError`` if the model cannot be split this way (heads by tp, items by pp)."""
        check_tp_degree(config, self.tp)
        num_items = config.num_hidden_layers + 3  # embed, layers, norm, head
        if self.pp > num_items:
            raise ValueError(
                f"pp={self.pp} exceeds the {num_items} pipeline items of a {config.num_hidden_layers}-layer model"
            )


def mixed_precision_dtype(device: torch.device, mixed_precision: str) -> torch.dtype:
    """Compute dtype: ``"auto"`` is bf16 on CUDA and fp32 on CPU; ``"bf16"``/``"fp32"`` force it."""
    if mixed_precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if mixed_precision == "bf16":
        return torch.bfloat16
    if mixed_precision == "fp32":
        return torch.float32
    raise ValueError(f"mixed_precision={mixed_precision!r}; expected 'auto', 'bf16' or 'fp32'")


@functools.cache  # the host's flags do not change; every model's dtype reads them
def cpu_flags() -> frozenset[str]:
    """This host's CPU feature flags (``/proc/cpuinfo``); empty where the file is absent (not Linux)."""
    path = Path("/proc/cpuinfo")
    if not path.exists():
        return frozenset()
    for line in path.read_text().splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_isa_caps() -> dict[str, str]:
    """The instruction-set caps this process's environment sets (:data:`ISA_CAP_VARIABLES`), by name;
    empty where none is set."""
    return {name: os.environ[name] for name in ISA_CAP_VARIABLES if os.environ.get(name)}


def cpu_computes_bf16() -> bool:
    """Whether this process computes bf16 natively on the CPU: the CPU has ``avx512_bf16`` or
    ``amx_bf16``, and neither torch's kernels nor oneDNN's are capped below them
    (``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2``: :func:`cpu_isa_caps`).

    Without them torch still runs bf16 on the CPU, but by converting to fp32 around each
    product: slower than fp32 itself, so ``auto`` keeps fp32 there.
    """
    if not cpu_flags() & BF16_CPU_FLAGS:
        return False
    caps = cpu_isa_caps()
    if caps.get("ATEN_CPU_CAPABILITY", "").lower() in ("default", "avx2"):
        return False
    return caps.get("ONEDNN_MAX_CPU_ISA", "").upper() not in ONEDNN_ISAS_WITHOUT_BF16


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` knows."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _matmul_gflops(x: torch.Tensor, w: torch.Tensor, rounds: int, reps: int = 4) -> list[float]:
    """GFLOP/s of ``F.linear(x, w)``, one figure per round (the best of ``reps`` calls)."""
    flops = 2 * x.shape[0] * x.shape[1] * w.shape[0]
    out = []
    for _ in range(rounds):
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            torch.nn.functional.linear(x, w)
            best = min(best, time.perf_counter() - start)
        out.append(flops / best / 1e9)
    return out


def measure_cpu_matmul_speed() -> dict[str, float]:
    """This process's fp32 and bf16 matmul speeds on one torch thread (GFLOP/s of a training pass's
    projection, :data:`_SPEED_SHAPE`), measured in alternating rounds so that a load on the machine
    slows both alike; the best round of each. A fraction of a second where bf16 is native."""
    m, k, n = _SPEED_SHAPE
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    operands = {"fp32": (x, w), "bf16": (x.bfloat16(), w.bfloat16())}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for pair in operands.values():
            torch.nn.functional.linear(*pair)  # oneDNN's first call builds its kernel
        speeds = {name: [] for name in operands}
        for _ in range(3):
            for name, pair in operands.items():
                speeds[name] += _matmul_gflops(*pair, rounds=2)
    finally:
        torch.set_num_threads(threads)
    return {f"{name}_gflop_per_s": round(max(v), 1) for name, v in speeds.items()}


def cpu_bf16_speedup() -> float:
    """How much faster this host multiplies in bf16 than in fp32: :func:`measure_cpu_matmul_speed`'s
    ratio, measured once per host and kept in rlflow's cache (``<cache dir>/cpu-matmul-speed.json``,
    keyed by the CPU model, its flags, the torch version and the instruction-set caps), so that every
    run on the host decides alike. Asked only where :func:`cpu_computes_bf16`; an entry that cannot be
    read is measured again and replaced."""
    import hashlib
    import json

    identity = [cpu_model(), sorted(cpu_flags()), torch.__version__, sorted(cpu_isa_caps().items())]
    return _host_bf16_speedup(hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16])


@functools.cache  # one look per process and host identity
def _host_bf16_speedup(key: str) -> float:
    import json

    from rlflow.files import cache_dir, write_atomic

    path = cache_dir() / _SPEED_FILE
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    known = known if isinstance(known, dict) else {}
    speed = known.get(key)
    valid = isinstance(speed, dict) and all(
        isinstance(speed.get(k), (int, float)) and speed[k] > 0 for k in ("fp32_gflop_per_s", "bf16_gflop_per_s")
    )
    if not valid:
        speed = {"cpu": cpu_model(), "torch": torch.__version__, **measure_cpu_matmul_speed()}
        try:
            write_atomic(path, json.dumps({**known, key: speed}, indent=1))
        except OSError as err:  # a cache that cannot be written: the next process measures again
            logger.warning("cannot keep the measured matmul speeds in %s: %s", path, err)
    return speed["bf16_gflop_per_s"] / speed["fp32_gflop_per_s"]


def cpu_bf16_pays() -> bool:
    """Whether ``auto`` may compute a CPU pass in bf16 here: the CPU multiplies it natively
    (:func:`cpu_computes_bf16`) and measurably faster than fp32 (:func:`cpu_bf16_speedup` at least
    :data:`CPU_BF16_MIN_SPEEDUP`)."""
    return cpu_computes_bf16() and cpu_bf16_speedup() >= CPU_BF16_MIN_SPEEDUP


def layer_matmul_params(config: Mapping[str, Any]) -> int | None:
    """Parameters one decoder layer multiplies every token by (attention projections and MLP), from an
    HF config's entries; None when the config does not say (no ``hidden_size``)."""
    hidden = config.get("hidden_size")
    if not hidden:
        return None
    heads = config.get("num_attention_heads") or 1
    head_dim = config.get("head_dim") or hidden // heads
    kv_heads = config.get("num_key_value_heads") or heads
    mlp = config.get("intermediate_size") or 4 * hidden
    return 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * mlp


def resolve_compute_dtype(
    name: str, device_type: str, layer_params: int | None = None, tokens: int | None = None
) -> torch.dtype:
    """The compute dtype a model's ``dtype`` setting asks for on ``device_type`` workers.

    ``"auto"`` is bf16 on CUDA; on a CPU bf16 where it computes it natively and faster than fp32
    (:func:`cpu_bf16_pays`: this host's flags and its measured matmuls) and one decoder layer's forward pass multiplies
    at least ``CPU_BF16_MIN_PASS_WORK``: ``layer_params`` multiplying parameters times the
    ``tokens`` of a training pass; else fp32. A smaller pass is per-op overhead and the casts
    around its products, which bf16 does not shrink, and its decode steps would lose the fp32-only
    C++ step (docs/benchmarks.md, "Precision", measures both sides). ``"float32"`` and
    ``"bfloat16"`` are themselves.

    >>> resolve_compute_dtype("auto", "cuda"), resolve_compute_dtype("float32", "cuda")
    (torch.bfloat16, torch.float32)
    """
    if name not in COMPUTE_DTYPES:
        raise ValueError(f"dtype={name!r}; expected one of {list(COMPUTE_DTYPES)}")
    if name != "auto":
        return COMPUTE_DTYPES[name]
    if device_type == "cuda":
        return torch.bfloat16
    large = layer_params is not None and tokens is not None and layer_params * tokens >= CPU_BF16_MIN_PASS_WORK
    if device_type == "cpu" and large and cpu_bf16_pays():
        return torch.bfloat16
    return torch.float32


def _layers(stage: nn.Module) -> list[nn.Module]:
    return list(stage.model.layers.values())


def apply_ac(stage: nn.Module) -> None:
    """Recompute each decoder layer's activations in backward instead of storing them.

    Uses HF's ``GradientCheckpointingLayer`` switch (the layer checkpoints its ``forward``,
    leaving module hooks outside), with non-reentrant ``torch.utils.checkpoint``.
    """
    for layer in _layers(stage):
        if not hasattr(layer, "gradient_checkpointing"):
            raise ValueError(f"{type(layer).__name__} does not support HF gradient checkpointing")
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)


def apply_fsdp(
    stage: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype,
    reshard_after_forward: bool,
) -> None:
    """Shard ``stage`` with FSDP2 along ``dp_mesh``: one group per decoder layer plus the root.

    Args:
        stage: the (TP-parallelized) stage.
        dp_mesh: 1-D data-parallel mesh (a sub-mesh of the engine's mesh, so TP DTensors
            and FSDP compose into 2-D DTensors).
        param_dtype: dtype of the all-gathered parameters used in compute; gradients are
            reduced in fp32 and the sharded master weights stay fp32.
        reshard_after_forward: free each layer's gathered parameters after its forward
            (ZeRO-3; gathered again in backward). The engine passes ``True`` without pipelining
            and ``False`` with it: a pipeline runs many micro-batch forwards before their
            backwards, and resharding would re-gather every layer twice per micro-batch.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in _layers(stage):
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    # The root group (embedding, norm, head) is needed first in backward: keep it gathered.
    fully_shard(stage, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
