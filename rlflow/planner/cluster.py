"""Hardware description the cost model prices plans against.

All figures are SI: bytes, seconds, FLOP/s, bytes/s. Bandwidths are per device and per
direction: ``intra_host_bandwidth`` is what one device sends to a peer on its host (NVLink),
``inter_host_bandwidth`` what one device sends to another host (one NIC per device, as on DGX
machines), ``host_device_bandwidth`` its host<->device copy rate (PCIe).

Latencies follow NCCL's own tuning model (``src/graph/tuning.cc``, ring algorithm, LL
protocol): a collective costs a base latency of 6.6 us plus 0.6 us per NVLink step or
2.7 us per network step. The sustained-efficiency factors of the H100 and H200 presets come from
measurements on an H100 lent to this project (an 8192^3 bf16 matmul and a device-to-device copy
against their peaks; docs/placement.md, "Cost model"); the A100 preset's
matmul fraction is Megatron-LM's sustained training rate on A100s, and its decode latencies
(host launch per layer, tp ranks waiting at each decode all-reduce) come from metaseq's eager
and CUDA-graph decode on A100s; every constant below names its source.

Dtypes are the engines', not the model's: :class:`Precision` says how many bytes every weight,
gradient, activation and transfer takes on this kind of device (fp32 master weights
everywhere; bf16 compute on GPUs, fp32 on CPU workers).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # profile.py imports this module
    from rlflow.planner.profile import HardwareProfile, MachineProfile

GiB = 1024**3
GB = 1e9


def local_devices_per_node(use_gpu: bool | None = None) -> int:
    """The devices of this host a run may use: its GPUs (unless ``use_gpu`` is False) when it has
    any, else the CPU cores this process may run on (``os.sched_getaffinity``: a container's or
    ``taskset``'s share, not the machine's), one CPU worker process per core.

    What ``placement.devices_per_node: null`` resolves to; the planner then picks how many of
    them a plan uses.
    """
    import os

    gpus = local_gpus() if use_gpu is not False else 0
    if gpus > 0:
        return gpus
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def local_gpus() -> int:
    """The GPUs torch sees on this host (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# NCCL tuning model (src/graph/tuning.cc): Ring/LL base latency, per-step NVLink and network latencies.
NCCL_BASE_LATENCY_S = 6.6e-6
NCCL_NVLINK_STEP_S = 0.6e-6
NCCL_NET_STEP_S = 2.7e-6

# Measured on an H100 SXM here (see module docstring): sustained / peak.
H100_MATMUL_EFFICIENCY = 798.0 / 989.0
H100_MEMORY_EFFICIENCY = 3.0 / 3.35

# A100: what a training step's matmuls sustain in a real engine, not one large GEMM. Megatron-LM
# (Narayanan et al., SC'21, Table 1) trains a 7.5B GPT on A100s at 142 TFLOP/s per GPU of 312,
# counting the recomputed forward (43-46% from 1.7B to 76B). No A100 copy was measured here; the
# H100's copy ratio is kept.
A100_MATMUL_EFFICIENCY = 142.0 / 312.0
A100_MEMORY_EFFICIENCY = H100_MEMORY_EFFICIENCY

# Eager decode on A100s: metaseq's OPT-175B (96 layers, hidden 12288, fp16) on 8 A100-40GB with
# tp=8 (facebookresearch/metaseq PR #270) took ~95 ms per token eagerly and ~66 ms with the step
# captured as one CUDA graph. The difference is the host launching each layer's kernels; what the
# graph keeps beyond reading a layer's weights (at A100-40GB's 1.555 TB/s) and NCCL's model of its
# two all-reduces is the tp ranks waiting for each other, spread over the all-reduces' 2 x 14 ring steps.
METASEQ_LAYERS, METASEQ_HIDDEN, METASEQ_TP = 96, 12288, 8
METASEQ_EAGER_TOKEN_S, METASEQ_GRAPH_TOKEN_S = 95e-3, 66e-3
A100_DECODE_LAYER_DISPATCH_S = (METASEQ_EAGER_TOKEN_S - METASEQ_GRAPH_TOKEN_S) / METASEQ_LAYERS
_METASEQ_RING_STEPS = 2 * (METASEQ_TP - 1)  # of one all-reduce
_METASEQ_WEIGHT_READ_S = 12 * METASEQ_HIDDEN**2 * 2 / METASEQ_TP / (1.555e12 * A100_MEMORY_EFFICIENCY)
_METASEQ_NCCL_S = 2 * (NCCL_BASE_LATENCY_S + _METASEQ_RING_STEPS * NCCL_NVLINK_STEP_S)
A100_DECODE_TP_STEP_S = (METASEQ_GRAPH_TOKEN_S / METASEQ_LAYERS - _METASEQ_WEIGHT_READ_S - _METASEQ_NCCL_S) / (
    2 * _METASEQ_RING_STEPS
)

# rlflow's built-in sampler on Hopper, measured on the H200 lent to this project, four machines
# (benchmarks/bench_gpu_overheads.py, benchmarks/measured/gpu_overheads_h200.jsonl; torch 2.11 +
# CUDA 13, Xeon hosts; docs/benchmarks.md, "GPU overheads"): the decode step of models 256 wide —
# kernels of microseconds, so a step is its launches — at 1, 4 and 16 layers, one least-squares line
# through all twelve: its slope is the host's launch of one decoder layer's kernels, its intercept
# the step's work outside the layers (the draw, log-softmax and stop check, the loop); the steps and
# each machine's own line are on that page. An engine that replays its decode step as a CUDA graph
# (vLLM; ``RolloutCapabilities.graph_decode``) is priced with neither.
HOPPER_DECODE_LAYER_DISPATCH_S = 0.249e-3
HOPPER_DECODE_STEP_DISPATCH_S = 0.367e-3
# fp32 matmuls (a float32 model: models.<role>.dtype; torch leaves TF32 off) run on the CUDA cores at the
# datasheets' fp32 peak: A100 19.5, H100 and H200 SXM 67 TFLOP/s. On the H200 an fp32 product sustained
# the same share of its peak as a bf16 one did of its own (docs/benchmarks.md, "GPU overheads"): the
# presets' matmul efficiency serves both.
A100_FP32_PEAK_FLOPS, HOPPER_FP32_PEAK_FLOPS = 19.5e12, 67e12


@dataclass(frozen=True)
class Precision:
    """Bytes per element of what rlflow's engines hold, compute and move on a cluster.

    rlflow keeps fp32 master weights everywhere (``rlflow.workers.residency.PARAM_DTYPE``): the
    home shards, the reallocated copies and the reshard wire format are fp32, FSDP reduces the
    gradients in fp32 into fp32 shards, and AdamW keeps two fp32 moments. The training engine
    computes in the model's compute dtype (``models.<role>.dtype``): FSDP all-gathers the
    weights in that dtype, and activations and the KV cache of a forward are in it. The HF
    rollout engine runs a copy in that dtype too (weights, activations and KV cache); vLLM runs
    bf16. Log-softmax and entropies are computed on fp32 logits.

    Attributes:
        compute_bytes: the training engine's compute dtype (activations, FSDP-gathered weights).
        param_bytes: master weights, reallocated copies and the reshard wire format.
        grad_bytes: sharded gradients (reduce dtype).
        optimizer_bytes: optimizer state per parameter (AdamW: two fp32 moments).
        logit_bytes: logits as the log-softmax reads them.
        rollout_bytes: weights, activations and KV cache of a generation; ``None``: ``param_bytes``.

    >>> Precision().train_bytes_per_param, Precision().generate_bytes, GPU_PRECISION.generate_bytes
    (16, 4, 2)
    """

    compute_bytes: int = 2
    param_bytes: int = 4
    grad_bytes: int = 4
    optimizer_bytes: int = 8
    logit_bytes: int = 4
    rollout_bytes: int | None = None

    def __post_init__(self) -> None:
        for attr in ("compute_bytes", "param_bytes", "grad_bytes", "logit_bytes", "rollout_bytes"):
            value = getattr(self, attr)
            if value is not None and value not in (1, 2, 4, 8):
                raise ValueError(f"Precision.{attr}={value}; expected 1, 2, 4 or 8 bytes")
        if self.optimizer_bytes < 0:
            raise ValueError(f"Precision.optimizer_bytes={self.optimizer_bytes} must be >= 0")

    @property
    def generate_bytes(self) -> int:
        """Bytes per weight, activation and KV entry of a generation."""
        return self.param_bytes if self.rollout_bytes is None else self.rollout_bytes

    @property
    def train_bytes_per_param(self) -> int:
        """Master weight + gradient + optimizer state of one trained parameter."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


# The engines' dtypes by device kind. GPUs: bf16 compute, and bf16 generation — vLLM's, the
# rollout engine for GPU runs; a run prices its actor's dtype with ``with_precision`` instead
# (rlflow.trainer.placement.planning_cluster). CPU workers: fp32 everything, as their profile
# times its layers in fp32.
GPU_PRECISION = Precision(compute_bytes=2, rollout_bytes=2)
CPU_PRECISION = Precision(compute_bytes=4)


@dataclass(frozen=True)
class ClusterSpec:
    """A homogeneous cluster: ``num_nodes`` hosts of ``devices_per_node`` devices.

    Attributes:
        num_nodes, devices_per_node: shape of the cluster.
        device_memory_bytes: memory of one device.
        peak_flops: dense bf16 FLOP/s of one device (vendor peak).
        fp32_peak_flops: dense fp32 FLOP/s of one device without TF32 (vendor peak); ``None``:
            ``peak_flops`` (CPU workers compute in fp32 at their measured rate).
        mem_bandwidth: device memory bandwidth, bytes/s.
        intra_host_bandwidth / inter_host_bandwidth / host_device_bandwidth: bytes/s per device
            and direction (see module docstring).
        collective_latency_s: fixed cost of launching one collective or transfer.
        intra_host_latency_s / inter_host_latency_s: extra latency per ring step inside a host /
            across hosts.
        matmul_efficiency / memory_efficiency: sustained fraction of ``peak_flops`` /
            ``mem_bandwidth`` the roofline uses.
        precision: dtypes the engines use on these devices (:class:`Precision`); what every
            weight, gradient, activation and transfer is priced in.
        rollout_memory_fraction: share of a device's memory the rollout engine takes while it
            generates, whatever the generation needs (vLLM's ``gpu_memory_utilization``: weights
            plus a KV cache sized to fill it); ``None``: only what the generation needs.
        comm_overlaps_compute: FSDP's collectives run beside compute (NCCL on a stream of its
            own). ``False`` for CPU workers: gloo's threads take the cores the workers compute on,
            so every collective adds to the call's time.
        decode_layer_dispatch_s: host seconds to launch one decoder layer's kernels in an eager
            decode step, added to the step (0: not priced; CPU profiles measure their own).
        decode_step_dispatch_s: host seconds of a decode step outside its layers (the sampler's
            draw, log-softmax and stop check, its loop), added per generated token (0: not priced;
            CPU profiles measure their own).
        decode_tp_step_s: seconds per ring step that a tp all-reduce inside a decode step takes
            beyond the NCCL model (the tp ranks wait for each other at every all-reduce).
        decode_kv_passes: passes over the KV cache per decode step (``None``: HF's
            ``DynamicCache``, :data:`rlflow.planner.passes.KV_CACHE_PASSES`; 1: a cache appended
            in place).
        pipeline_lockstep: the engine's pipeline stages advance in lock-step, as DeepSpeed's
            schedules do with blocking sends (ReaLHF's engine; rlflow's own engines do not): a
            training stage's forward waits for its neighbour's backward, and a pipelined generation
            runs ``pp - 1`` decode steps more (see :mod:`rlflow.planner.cost`).
        name: preset name, for reports.
    """

    num_nodes: int
    devices_per_node: int
    device_memory_bytes: float
    peak_flops: float
    mem_bandwidth: float
    intra_host_bandwidth: float
    inter_host_bandwidth: float
    host_device_bandwidth: float
    collective_latency_s: float = NCCL_BASE_LATENCY_S
    intra_host_latency_s: float = NCCL_NVLINK_STEP_S
    inter_host_latency_s: float = NCCL_NET_STEP_S
    matmul_efficiency: float = 1.0
    memory_efficiency: float = 1.0
    precision: Precision = field(default_factory=lambda: GPU_PRECISION)
    rollout_memory_fraction: float | None = None
    comm_overlaps_compute: bool = True
    decode_layer_dispatch_s: float = 0.0
    decode_step_dispatch_s: float = 0.0
    decode_tp_step_s: float = 0.0
    fp32_peak_flops: float | None = None
    decode_kv_passes: int | None = None
    pipeline_lockstep: bool = False
    name: str = "custom"

    def __post_init__(self) -> None:
        for attr in ("num_nodes", "devices_per_node"):
            if getattr(self, attr) < 1:
                raise ValueError(f"ClusterSpec.{attr}={getattr(self, attr)} must be >= 1")
        for attr in (
            "device_memory_bytes", "peak_flops", "mem_bandwidth", "intra_host_bandwidth",
            "inter_host_bandwidth", "host_device_bandwidth",
        ):  # fmt: skip
            if not getattr(self, attr) > 0:
                raise ValueError(f"ClusterSpec.{attr}={getattr(self, attr)} must be > 0")
        for attr in (
            "collective_latency_s", "intra_host_latency_s", "inter_host_latency_s", "decode_layer_dispatch_s",
            "decode_step_dispatch_s", "decode_tp_step_s",
        ):  # fmt: skip
            if getattr(self, attr) < 0:
                raise ValueError(f"ClusterSpec.{attr}={getattr(self, attr)} must be >= 0")
        for attr in ("matmul_efficiency", "memory_efficiency"):
            if not 0 < getattr(self, attr) <= 1:
                raise ValueError(f"ClusterSpec.{attr}={getattr(self, attr)} must be in (0, 1]")
        if self.fp32_peak_flops is not None and not self.fp32_peak_flops > 0:
            raise ValueError(f"ClusterSpec.fp32_peak_flops={self.fp32_peak_flops} must be > 0 or None")
        if self.decode_kv_passes is not None and self.decode_kv_passes < 1:
            raise ValueError(f"ClusterSpec.decode_kv_passes={self.decode_kv_passes} must be >= 1 or None")
        if self.rollout_memory_fraction is not None and not 0 < self.rollout_memory_fraction <= 1:
            raise ValueError(f"ClusterSpec.rollout_memory_fraction={self.rollout_memory_fraction} must be in (0, 1]")
        if not isinstance(self.precision, Precision):
            raise ValueError(f"ClusterSpec.precision={self.precision!r} must be a Precision")

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    @property
    def flops(self) -> float:
        """Sustained matmul FLOP/s of one device."""
        return self.peak_flops * self.matmul_efficiency

    @property
    def fp32_flops(self) -> float:
        """Sustained fp32 matmul FLOP/s of one device (no TF32)."""
        return (self.fp32_peak_flops or self.peak_flops) * self.matmul_efficiency

    @property
    def bandwidth(self) -> float:
        """Sustained device-memory bytes/s of one device."""
        return self.mem_bandwidth * self.memory_efficiency

    def with_precision(self, **dtypes: int | None) -> ClusterSpec:
        """The same hardware with some dtypes changed, e.g. ``with_precision(rollout_bytes=4)`` for
        the HF sampler on GPUs generating in float32 (``models.actor.dtype``)."""
        return replace(self, precision=replace(self.precision, **dtypes))

    def with_shape(self, num_nodes: int, devices_per_node: int | None = None) -> ClusterSpec:
        """The same hardware with another number of hosts (and devices per host)."""
        return replace(self, num_nodes=num_nodes, devices_per_node=devices_per_node or self.devices_per_node)


# Vendor specifications (dense bf16, SXM parts; NVIDIA A100/H100/H200 datasheets). NVLink is
# per direction; InfiniBand HDR 200 Gb/s = 25 GB/s, NDR 400 Gb/s = 50 GB/s per device NIC;
# PCIe Gen4 x16 = 32 GB/s, Gen5 x16 = 64 GB/s per direction. Then the sustained fractions and
# decode latencies above (H100 and H200: efficiencies measured on an H100 here, the decode dispatch
# and the fp32 rate on an H200; no tp wait at decode all-reduces measured: one GPU lent).
_GPU_PRESETS: dict[str, dict[str, float]] = {
    "a100-80g": dict(
        device_memory_bytes=80 * GiB, peak_flops=312e12, mem_bandwidth=2.0e12,
        intra_host_bandwidth=300 * GB, inter_host_bandwidth=25 * GB, host_device_bandwidth=32 * GB,
        matmul_efficiency=A100_MATMUL_EFFICIENCY, memory_efficiency=A100_MEMORY_EFFICIENCY,
        decode_layer_dispatch_s=A100_DECODE_LAYER_DISPATCH_S, decode_tp_step_s=A100_DECODE_TP_STEP_S,
        fp32_peak_flops=A100_FP32_PEAK_FLOPS,
    ),
    "h100-80g": dict(
        device_memory_bytes=80 * GiB, peak_flops=989e12, mem_bandwidth=3.35e12,
        intra_host_bandwidth=450 * GB, inter_host_bandwidth=50 * GB, host_device_bandwidth=64 * GB,
        matmul_efficiency=H100_MATMUL_EFFICIENCY, memory_efficiency=H100_MEMORY_EFFICIENCY,
        decode_layer_dispatch_s=HOPPER_DECODE_LAYER_DISPATCH_S, decode_step_dispatch_s=HOPPER_DECODE_STEP_DISPATCH_S,
        fp32_peak_flops=HOPPER_FP32_PEAK_FLOPS,
    ),
    "h200": dict(
        device_memory_bytes=141 * GB, peak_flops=989e12, mem_bandwidth=4.8e12,
        intra_host_bandwidth=450 * GB, inter_host_bandwidth=50 * GB, host_device_bandwidth=64 * GB,
        matmul_efficiency=H100_MATMUL_EFFICIENCY, memory_efficiency=H100_MEMORY_EFFICIENCY,
        decode_layer_dispatch_s=HOPPER_DECODE_LAYER_DISPATCH_S, decode_step_dispatch_s=HOPPER_DECODE_STEP_DISPATCH_S,
        fp32_peak_flops=HOPPER_FP32_PEAK_FLOPS,
    ),
}  # fmt: skip

PRESETS = (*_GPU_PRESETS, "cpu")


def cluster_preset(
    name: str,
    num_nodes: int = 1,
    devices_per_node: int = 8,
    profile: MachineProfile | HardwareProfile | str | Path | None = None,
) -> ClusterSpec:
    """A cluster of a known device type.

    Args:
        name: ``"a100-80g"``, ``"h100-80g"``, ``"h200"``, or ``"cpu"`` (CPU worker processes,
            priced from a measured hardware profile).
        num_nodes: hosts.
        devices_per_node: devices (or CPU worker processes) per host.
        profile: for ``"cpu"``: a measured profile, its hardware record, or the path of a JSON
            written by ``rlflow profile``; ``None`` loads the default profile of this host
            (``rlflow.workers.profiling.profile_or_measure`` measures the hardware when there is
            none).

    Raises:
        ValueError: an unknown preset, or ``"cpu"`` without a profile when this host has none.

    >>> c = cluster_preset("a100-80g", num_nodes=2)
    >>> c.num_devices, c.peak_flops
    (16, 312000000000000.0)
    """
    if name in _GPU_PRESETS:
        return ClusterSpec(
            num_nodes=num_nodes,
            devices_per_node=devices_per_node,
            precision=GPU_PRECISION,
            name=name,
            **_GPU_PRESETS[name],
        )
    if name == "cpu":
        return _cpu_cluster(num_nodes, devices_per_node, profile)
    raise ValueError(f"unknown cluster preset {name!r}; expected one of {PRESETS}")


def _cpu_cluster(
    num_nodes: int, devices_per_node: int, profile: MachineProfile | HardwareProfile | str | Path | None
) -> ClusterSpec:
    from rlflow.planner.profile import HardwareProfile, MachineProfile, default_profile_path, load_profile

    if isinstance(profile, HardwareProfile):
        hw = profile
    elif isinstance(profile, MachineProfile):
        hw = profile.hardware
    elif profile is not None:
        hw = load_profile(profile).hardware
    elif default_profile_path().exists():
        hw = load_profile(default_profile_path()).hardware
    else:
        raise ValueError(
            f"the cpu preset is priced from a measured profile: none given and none at {default_profile_path()}; "
            "run `rlflow profile` or pass profile="
        )
    # Each "device" is one worker process with one thread: it gets the measured single-thread
    # rates and an equal share of the host's memory. Gloo moves data over loopback TCP.
    return ClusterSpec(
        num_nodes=num_nodes,
        devices_per_node=devices_per_node,
        device_memory_bytes=hw.host_memory_bytes / devices_per_node,
        peak_flops=hw.matmul_flops,
        mem_bandwidth=hw.memcpy_bandwidth,
        intra_host_bandwidth=hw.loopback_bandwidth,
        inter_host_bandwidth=hw.loopback_bandwidth,
        host_device_bandwidth=hw.memcpy_bandwidth,
        collective_latency_s=hw.collective_latency_s if hw.collective_latency_s is not None else hw.loopback_latency_s,
        intra_host_latency_s=hw.loopback_latency_s,
        inter_host_latency_s=hw.loopback_latency_s,
        precision=CPU_PRECISION,
        comm_overlaps_compute=False,
        name="cpu",
    )
