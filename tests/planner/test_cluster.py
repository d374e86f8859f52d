"""Cluster presets and their validation."""

from __future__ import annotations

import pytest

from rlflow.planner.cluster import ClusterSpec, GiB, cluster_preset
from rlflow.planner.profile import HardwareProfile

HW = {
    "matmul_flops": 2e10,
    "memcpy_bandwidth": 1e10,
    "loopback_bandwidth": 5e8,
    "loopback_latency_s": 4e-5,
    "host_memory_bytes": 16 * GiB,
}


def test_gpu_presets_carry_the_vendor_figures():
    a100 = cluster_preset("a100-80g", num_nodes=4)
    assert (a100.num_devices, a100.peak_flops, a100.mem_bandwidth) == (32, 312e12, 2.0e12)
    assert (a100.intra_host_bandwidth, a100.inter_host_bandwidth, a100.host_device_bandwidth) == (300e9, 25e9, 32e9)
    assert a100.device_memory_bytes == 80 * GiB
    h100 = cluster_preset("h100-80g")
    assert (h100.peak_flops, h100.mem_bandwidth, h100.inter_host_bandwidth) == (989e12, 3.35e12, 50e9)
    assert cluster_preset("h200").mem_bandwidth == 4.8e12
    # sustained rates: the H100 measurements (798 of 989 TFLOP/s, 3.0 of 3.35 TB/s)
    assert h100.flops == pytest.approx(798e12) and h100.bandwidth == pytest.approx(3.0e12)


def test_cpu_preset_is_priced_from_a_measured_profile():
    c = cluster_preset("cpu", num_nodes=1, devices_per_node=4, profile=HardwareProfile(**HW))
    assert c.peak_flops == 2e10 and c.flops == 2e10  # measured already: no efficiency factor
    assert c.device_memory_bytes == 4 * GiB and c.intra_host_bandwidth == 5e8 and c.collective_latency_s == 4e-5
    assert c.with_shape(2).num_devices == 8
    measured = cluster_preset("cpu", devices_per_node=2, profile=HardwareProfile(**HW, collective_latency_s=2e-3))
    assert measured.collective_latency_s == 2e-3 and measured.intra_host_latency_s == 4e-5


def test_bad_presets_and_specs_are_refused():
    with pytest.raises(ValueError, match=r"unknown cluster preset 'tpu'.*'a100-80g'"):
        cluster_preset("tpu")
    with pytest.raises(ValueError, match="num_nodes=0"):
        cluster_preset("a100-80g", num_nodes=0)
    good = cluster_preset("a100-80g")
    with pytest.raises(ValueError, match="inter_host_bandwidth=0"):
        ClusterSpec(**{**good.__dict__, "inter_host_bandwidth": 0})
    with pytest.raises(ValueError, match="matmul_efficiency=1.5"):
        ClusterSpec(**{**good.__dict__, "matmul_efficiency": 1.5})
