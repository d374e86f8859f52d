"""``rlflow profile``: a quick measurement on this machine, its JSON, and rates read from it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rlflow.dataflow import algorithm_mfcs
from rlflow.planner.cluster import cluster_preset
from rlflow.planner.cost import Workload, call_cost
from rlflow.planner.mesh import DeviceMesh, ParallelStrategy
from rlflow.planner.model_spec import ModelSpec
from rlflow.planner.profile import ProfiledRates, default_profile_path, load_profile, run_profile


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "p.json"
    return run_profile(path, device="cpu", progress=False, passes=((1, 16), (2, 64)), decodes=((1, 32), (4, 32)))


def test_profile_measures_this_machine_and_round_trips(profile):
    hw = profile["hardware"]
    for key in ("matmul_flops", "memcpy_bandwidth", "loopback_bandwidth", "host_memory_bytes"):
        assert hw[key] > 0, key
    assert 0 < hw["loopback_latency_s"] < 0.1
    assert [s["seq"] for s in profile["forward"]] == [16, 64] and all(s["seconds"] > 0 for s in profile["backward"])
    loaded = load_profile(profile["path"])
    assert loaded["decode"] == profile["decode"] and loaded["device"] == "cpu" and loaded["dtype"] == "float32"


def test_profiled_rates_price_calls(profile):
    cluster = cluster_preset("cpu", 1, 2, profile=profile)
    rates = ProfiledRates.from_profile(profile["path"], cluster)
    # interpolation stays inside the measured range
    fwd = rates.flops_rate(np.array([0.5, 1.0, 128.0, 1e6]))  # profiled passes span 1 to 128 tokens
    assert fwd[0] == fwd[1] and fwd[2] == fwd[3] and np.all(fwd > 0)
    m = ModelSpec(
        num_layers=2,
        hidden_size=128,
        intermediate_size=256,
        num_heads=4,
        num_kv_heads=4,
        vocab_size=256,
        bytes_per_param=4,
    )
    w = Workload(batch_size=8, prompt_len=16, gen_len=8)
    for mfc in algorithm_mfcs("ppo")[::2]:
        one = call_cost(mfc, m, ParallelStrategy(), DeviceMesh(1, 1, devices_per_node=2), cluster, w, rates).time_s
        two = call_cost(mfc, m, ParallelStrategy(dp=2), DeviceMesh(1, 2, devices_per_node=2), cluster, w, rates).time_s
        assert 0 < two < one < 60


def test_profile_files_are_checked(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="rlflow profile"):
        load_profile(tmp_path / "missing.json")
    (tmp_path / "old.json").write_text(json.dumps({"version": 0}))
    with pytest.raises(ValueError, match="version 0"):
        load_profile(tmp_path / "old.json")
    monkeypatch.setenv("RLFLOW_CACHE", str(tmp_path))
    assert default_profile_path().parent == tmp_path
